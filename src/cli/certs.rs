//! `cleave certs`: a cluster CA and node certificates for local use (mutual TLS on every internal
//! link). The CA is created in the directory if it holds none, and reused otherwise, so nodes
//! can be added later with the same command.

use std::path::PathBuf;

use cleave_net::tls::{fingerprint_hex, CertFiles, NodeIdentity, Roles};

#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    /// Directory for ca.crt, ca.key and <node>.crt / <node>.key (PEM; keys are mode 0600).
    #[arg(long, default_value = "certs")]
    dir: PathBuf,
    /// Node names (DNS-name syntax), one certificate each, valid as server and client.
    #[arg(long, value_delimiter = ',')]
    nodes: Vec<String>,
    /// Print the SHA-256 fingerprint of <NAME>.crt in the directory (what a coordinator's
    /// `--revoked-certs` file lists) and its roles, and issue nothing.
    #[arg(long, conflicts_with = "nodes", conflicts_with = "edge")]
    fingerprint: Option<String>,
    /// What the `--nodes` certificates allow their holders to be: `prefill`, `decode`,
    /// `coordinator`, or `node` (prefill and decode, which a node whose role the planner
    /// switches needs). The coordinator refuses a registration its certificate does not allow;
    /// nodes take requests only from a `coordinator` certificate.
    #[arg(long, value_delimiter = ',', default_value = "node")]
    roles: Vec<String>,
    /// Also edge.crt / edge.key for the HTTPS edge (`--tls-cert`, `--tls-key`), naming these
    /// host names and IP addresses, signed by the same CA (clients then trust ca.crt).
    #[arg(long, value_delimiter = ',')]
    edge: Vec<String>,
}

pub fn run(args: CertsArgs) -> anyhow::Result<()> {
    if let Some(name) = &args.fingerprint {
        let id = NodeIdentity::load(&args.dir, name)?;
        println!("{} {name} roles={}", fingerprint_hex(&id.fingerprint()), id.roles());
        return Ok(());
    }
    anyhow::ensure!(
        !args.nodes.is_empty() || !args.edge.is_empty(),
        "nothing to do: name certificates to issue with --nodes (or --edge)"
    );
    let files = CertFiles { dir: args.dir };
    let roles = Roles::parse(args.roles.iter().map(String::as_str))?;
    let mut written = if args.nodes.is_empty() { Vec::new() } else { files.generate_with(&args.nodes, roles)? };
    if !args.edge.is_empty() {
        written.extend(files.generate_edge(&args.edge)?);
    }
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}
