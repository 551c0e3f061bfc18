//! `cleave bench serve`: loads the tokenizer (folder, .gguf or hub id) and runs the load generator.

pub fn run(_args: cleave_bench::serve::ServeArgs) -> anyhow::Result<()> {
    anyhow::bail!("cleave bench serve: not built yet")
}
