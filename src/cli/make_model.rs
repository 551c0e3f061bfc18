//! `cleave make-model`: parses arguments and calls `cleave_engine::model::synth`.

use std::path::PathBuf;

use clap::builder::{PossibleValue, PossibleValuesParser};
use cleave_engine::model::synth::{self, SynthDtype};

/// Writes a random-weight Llama model in Hugging Face format (config.json, generation_config.json,
/// model.safetensors, tokenizer.json, tokenizer_config.json), deterministic from the seed.
#[derive(clap::Args, Debug)]
pub struct MakeModelArgs {
    /// Model shape (see each preset's size with --help).
    #[arg(long, value_parser = preset_parser())]
    pub preset: String,
    /// Output folder (created if missing; files with the same names are replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the weights: one seed always gives byte-identical files.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage dtype of the weights.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub dtype: DtypeArg,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DtypeArg {
    F32,
    F16,
    Bf16,
}

/// The presets with their shapes, so `--help` lists them.
fn preset_parser() -> PossibleValuesParser {
    PossibleValuesParser::new(synth::PRESETS.iter().map(|p| PossibleValue::new(p.name).help(p.spec.describe())))
}

pub fn run(args: MakeModelArgs) -> anyhow::Result<()> {
    let spec = synth::preset_or_err(&args.preset)?;
    let dtype = match args.dtype {
        DtypeArg::F32 => SynthDtype::F32,
        DtypeArg::F16 => SynthDtype::F16,
        DtypeArg::Bf16 => SynthDtype::BF16,
    };
    let summary = synth::write_model(&spec, args.seed, dtype, &args.out)?;
    eprintln!(
        "wrote preset `{}` (seed {}, {}) to {}: {} parameters, model.safetensors {:.1} MB",
        args.preset,
        args.seed,
        dtype.torch_name(),
        args.out.display(),
        summary.num_parameters,
        summary.weight_bytes as f64 / 1e6,
    );
    Ok(())
}
