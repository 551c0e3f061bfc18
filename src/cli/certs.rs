//! `cleave certs`: a cluster CA and node certificates for local use (mutual TLS on every internal
//! link). The CA is created in the directory if it holds none, and reused otherwise, so nodes
//! can be added later with the same command.

use std::path::PathBuf;

use cleave_net::tls::CertFiles;

#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    /// Directory for ca.crt, ca.key and <node>.crt / <node>.key (PEM; keys are mode 0600).
    #[arg(long, default_value = "certs")]
    dir: PathBuf,
    /// Node names (DNS-name syntax), one certificate each, valid as server and client.
    #[arg(long, value_delimiter = ',', required = true)]
    nodes: Vec<String>,
}

pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    let written = CertFiles { dir: args.dir }.generate(&args.nodes)?;
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}
