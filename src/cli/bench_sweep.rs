//! `cleave bench sweep`: `bench serve` over rates for several `cleave up` configurations.

pub fn run(_args: cleave_bench::sweep::SweepArgs) -> anyhow::Result<()> {
    anyhow::bail!("cleave bench sweep: not built yet")
}
