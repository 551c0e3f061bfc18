//! `cleave bench simulate`: the discrete-event cluster simulator (all logic in
//! `cleave_bench::sim`).

pub fn run(args: cleave_bench::sim::SimulateArgs) -> anyhow::Result<()> {
    cleave_bench::sim::cli::run(&args)?;
    Ok(())
}
