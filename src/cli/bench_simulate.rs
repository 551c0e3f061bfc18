//! `cleave bench simulate`: the discrete-event cluster simulator.

pub fn run(_args: cleave_bench::sim::SimulateArgs) -> anyhow::Result<()> {
    anyhow::bail!("cleave bench simulate: not built yet")
}
