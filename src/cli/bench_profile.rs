//! `cleave bench profile`: measures the engine's cost profile for `cleave bench simulate`.

#[derive(clap::Args, Debug)]
pub struct BenchProfileArgs {}

pub fn run(_args: BenchProfileArgs) -> anyhow::Result<()> {
    anyhow::bail!("cleave bench profile: not built yet")
}
