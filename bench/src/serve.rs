//! (being written)

/// `cleave bench serve` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {}
