//! `cleave bench serve`: loads the tokenizer (folder, .gguf or hub id) and runs the load generator.

use std::path::{Path, PathBuf};

use anyhow::Context;
use cleave_engine::model::ModelFiles;
use cleave_tokenizer::Tokenizer;

use super::model_source::resolve_model;

pub fn run(args: cleave_bench::serve::ServeArgs) -> anyhow::Result<()> {
    let source = args
        .tokenizer
        .clone()
        .or_else(|| args.model.clone())
        .context("cleave bench serve needs --tokenizer (or a --model that is a path or hub id) to count tokens")?;
    let tokenizer = load_tokenizer(Path::new(&source))?;
    cleave_bench::serve::run(args, tokenizer)?;
    Ok(())
}

/// A tokenizer from an HF folder, a .gguf file, or a hub id (resolved through the HF cache).
pub(super) fn load_tokenizer(arg: &Path) -> anyhow::Result<Tokenizer> {
    let path: PathBuf = resolve_model(arg).with_context(|| format!("tokenizer {}", arg.display()))?;
    if path.is_file() {
        let files = ModelFiles::open(&path).with_context(|| format!("opening {}", path.display()))?;
        Ok(files.tokenizer)
    } else {
        Tokenizer::from_model_dir(&path).with_context(|| format!("loading the tokenizer in {}", path.display()))
    }
}
