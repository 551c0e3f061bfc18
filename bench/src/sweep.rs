//! (being written)

/// `cleave bench sweep` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct SweepArgs {}
