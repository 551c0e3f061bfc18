//! `cleave quantize`: a Hugging Face folder's or a GGUF file's model in a block format.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use cleave_engine::model::gguf::quantize::{file_type, requantize};
use cleave_engine::model::gguf::GgufFile;
use cleave_engine::model::to_gguf::convert_hf;
use cleave_kernels::quant::QuantFormat;

#[derive(clap::Args, Debug)]
pub struct QuantizeArgs {
    /// The model to quantize: a Hugging Face folder (config.json, safetensors in f32/bf16/f16,
    /// a byte-level BPE tokenizer.json; Llama, Mistral, Qwen2, Qwen3) or a GGUF file (any format
    /// cleave reads: F32, F16, BF16, Q8_0, Q4_1, Q4_K, ...). Quantizing a quantized file
    /// compounds the roundings: start from the most precise file there is.
    #[arg(long)]
    model: PathBuf,
    /// The block format of the output's matrices (norm vectors stay f32). Matrices whose rows
    /// are not whole blocks take llama.cpp's fallback (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K ->
    /// Q8_0; f16 when even 32 does not divide them).
    #[arg(long = "type", value_parser = parse_format)]
    format: QuantFormat,
    /// The GGUF file to write (refused if it exists, unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Overwrite --out.
    #[arg(long)]
    force: bool,
}

fn parse_format(s: &str) -> Result<QuantFormat, String> {
    QuantFormat::ALL.into_iter().find(|f| f.name().eq_ignore_ascii_case(s)).ok_or_else(|| {
        let names: Vec<&str> = QuantFormat::ALL.iter().map(|f| f.name()).collect();
        format!("unknown format `{s}` (supported: {})", names.join(", "))
    })
}

pub fn run(args: QuantizeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.force || !args.out.exists(), "{} exists (--force overwrites it)", args.out.display());
    let t = Instant::now();
    let (image, report) = if args.model.is_dir() {
        convert_hf(&args.model, args.format).with_context(|| format!("converting {}", args.model.display()))?
    } else {
        let input = GgufFile::open(&args.model).with_context(|| format!("reading {}", args.model.display()))?;
        requantize(&input, args.format)?
    };
    let mut counts: Vec<(String, usize)> = Vec::new();
    for r in &report {
        let key = format!("{:?} -> {:?}", r.from, r.to);
        match counts.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => *n += 1,
            None => counts.push((key, 1)),
        }
    }
    // Written beside the target, then renamed: a crash never leaves half a file under its name.
    let tmp = args.out.with_extension("gguf.part");
    std::fs::write(&tmp, &image).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &args.out)
        .with_context(|| format!("renaming {} to {}", tmp.display(), args.out.display()))?;
    for (k, n) in counts {
        eprintln!("{n:>4} tensors {k}");
    }
    eprintln!(
        "wrote {} ({:.1} MB, general.file_type {}) in {:.1}s",
        args.out.display(),
        image.len() as f64 / 1e6,
        file_type(args.format),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
