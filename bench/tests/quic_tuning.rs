//! Tuning sweep of the QUIC transport (ignored by default; a measurement, not a check):
//! `cargo test --release -p cleave-bench --test quic_tuning -- --ignored --nocapture`
//! Knobs (environment, read by this test only): `CLEAVE_BENCH_TOKENS` (default 2048),
//! `CLEAVE_BENCH_VARIANTS` (comma-separated variant names; default all), `CLEAVE_BENCH_KINDS`
//! (quic,tcp-plain,tcp-tls), `CLEAVE_BENCH_STREAMS` (default 1,4), `CLEAVE_BENCH_HANDOFFS` (set:
//! also run handoff rows), `CLEAVE_BENCH_ROUNDS` (default 1).

use cleave_bench::transfer::{self as bench, TransferBenchConfig};
use cleave_net::{NetKind, QuicTuning};

#[test]
#[ignore]
fn quic_tuning_sweep() {
    let tokens = std::env::var("CLEAVE_BENCH_TOKENS").ok().and_then(|s| s.parse().ok()).unwrap_or(2048);
    let base = QuicTuning::default();
    let mut tunings = vec![("quinn defaults".to_string(), QuicTuning::naive()), ("tuned".to_string(), base.clone())];
    let nogso = QuicTuning { gso: false, ..base.clone() };
    let variants: Vec<(&str, QuicTuning)> = vec![
        ("no gso", nogso.clone()),
        ("gso mtu 1452", QuicTuning { gso: true, mtu_discovery_upper_bound: Some(1452), ..base.clone() }),
        ("no gso mtu 1452", QuicTuning { mtu_discovery_upper_bound: Some(1452), ..nogso.clone() }),
        ("no gso mtu 9000", QuicTuning { mtu_discovery_upper_bound: Some(9000), ..nogso.clone() }),
        ("no gso mtu 16k", QuicTuning { mtu_discovery_upper_bound: Some(16384), ..nogso.clone() }),
        ("no gso mtu 32k", QuicTuning { mtu_discovery_upper_bound: Some(32768), ..nogso.clone() }),
        ("no gso bbr", QuicTuning { congestion: cleave_net::Congestion::Bbr, ..nogso.clone() }),
        ("cubic", QuicTuning { congestion: cleave_net::Congestion::Cubic, ..base.clone() }),
        ("no gso init window 16M", QuicTuning { initial_window: Some(16 << 20), ..nogso.clone() }),
        (
            "no gso quinn windows",
            QuicTuning {
                stream_receive_window: 1_250_000,
                receive_window: u32::MAX,
                send_window: 10_000_000,
                ..nogso.clone()
            },
        ),
        ("no gso no sockbuf", QuicTuning { socket_buffer: 0, ..nogso.clone() }),
        ("sockbuf 4M", QuicTuning { socket_buffer: 4 << 20, ..base.clone() }),
        ("sockbuf 8M", QuicTuning { socket_buffer: 8 << 20, ..base.clone() }),
        ("2 conns", QuicTuning { connections_per_peer: 2, ..base.clone() }),
        ("4 conns", QuicTuning { connections_per_peer: 4, ..base.clone() }),
        ("ack every 4", QuicTuning { ack_eliciting_threshold: Some(4), ..base.clone() }),
        ("ack every 16", QuicTuning { ack_eliciting_threshold: Some(16), ..base.clone() }),
        ("ack every 64", QuicTuning { ack_eliciting_threshold: Some(64), ..base.clone() }),
    ];
    let only = std::env::var("CLEAVE_BENCH_VARIANTS").ok();
    for (name, t) in variants {
        if only.as_deref().is_none_or(|o| o.split(',').any(|v| v == name)) {
            tunings.push((name.to_string(), t));
        }
    }
    let cfg = TransferBenchConfig {
        prompts: vec![tokens],
        repeats: 3,
        streams: std::env::var("CLEAVE_BENCH_STREAMS")
            .map_or(vec![1, 4], |k| k.split(',').map(|s| s.parse().unwrap()).collect()),
        kinds: std::env::var("CLEAVE_BENCH_KINDS")
            .map_or(vec![NetKind::Quic, NetKind::TcpPlain, NetKind::TcpTls], |k| {
                k.split(',').map(|s| s.parse().unwrap()).collect()
            }),
        quic_tunings: tunings,
        handoffs: std::env::var("CLEAVE_BENCH_HANDOFFS").is_ok(),
        rounds: std::env::var("CLEAVE_BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(1),
        ..Default::default()
    };
    let rows = bench::run(&cfg, |m| eprintln!("{}: {:.2} GB/s", m.label, m.gb_per_s())).unwrap();
    println!("{}", bench::render(&rows));
}
