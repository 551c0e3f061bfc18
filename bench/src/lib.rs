//! cleave's load-test harness for SLO tuning (`cleave bench serve|sweep|simulate`).
//!
//! - [`serve`]: an open- or closed-loop load generator for any OpenAI-compatible streaming server
//!   ([`dataset`] builds the requests, [`schedule`] their arrival times, [`client`] sends them and
//!   timestamps every streamed chunk, [`metrics`] turns records into TTFT/TPOT/ITL/E2EL summaries
//!   and goodput, [`result`] writes vLLM-compatible result files).
//! - [`mix`]: `--mix`, a load of several request shapes (streamed, whole, chat, n > 1, clients
//!   that leave, bursts), and [`outcome`]: how each request ended, checked against the errors
//!   the server's OpenAPI document lists.
//! - [`sweep`]: `serve` over request rates for several system configurations, each started as its
//!   own `cleave up`.
//! - [`sim`]: a discrete-event simulator of a cleave cluster driven by a measured cost profile.
//! - [`plot`]: PNG and SVG plots of latency CDFs and sweep curves.
//! - [`transfer`]: `cleave bench transfer`, KV-cache bytes over every transport on loopback
//!   beside memcpy, AES-GCM and raw TCP, and the real handoff into a block pool.
//!
//! Dependencies: HTTP and the shared tokenizer; net and kv-transfer for `transfer` alone; never
//! the engine or kernels.

pub mod client;
pub mod compare;
pub mod dataset;
pub mod error;
pub mod metrics;
pub mod mix;
pub mod outcome;
pub mod plot;
pub mod result;
pub mod schedule;
pub mod serve;
pub mod sim;
pub mod sweep;
pub mod timeline;
pub mod transfer;

pub use error::{BenchError, Result};
