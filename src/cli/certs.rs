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
    #[arg(long, value_delimiter = ',', required_unless_present = "edge")]
    nodes: Vec<String>,
    /// Also edge.crt / edge.key for the HTTPS edge (`--tls-cert`, `--tls-key`), naming these
    /// host names and IP addresses, signed by the same CA (clients then trust ca.crt).
    #[arg(long, value_delimiter = ',')]
    edge: Vec<String>,
}

pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    let files = CertFiles { dir: args.dir };
    let mut written = if args.nodes.is_empty() { Vec::new() } else { files.generate(&args.nodes)? };
    if !args.edge.is_empty() {
        written.extend(files.generate_edge(&args.edge)?);
    }
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}
