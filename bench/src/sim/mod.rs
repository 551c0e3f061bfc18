//! (being written)

/// `cleave bench simulate` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct SimulateArgs {}
