//! `cleave bench sweep`: `bench serve` over rates for several `cleave up` configurations.

use std::path::Path;

use anyhow::Context;

pub fn run(args: cleave_bench::sweep::SweepArgs) -> anyhow::Result<()> {
    // Re-analysis reads result files only: no model, no tokenizer.
    let tokenizer = match args.reanalyze {
        Some(_) => None,
        None => {
            let source = args
                .serve
                .tokenizer
                .clone()
                .or_else(|| args.serve.model.clone())
                .context("cleave bench sweep needs --model (what every `cleave up` serves)")?;
            Some(super::bench_serve::load_tokenizer(Path::new(&source))?)
        }
    };
    let bin = match &args.cleave_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe().context("locating the cleave binary")?,
    };
    cleave_bench::sweep::run(args, tokenizer, bin)?;
    Ok(())
}
