//! cleave's coordinator: the OpenAI-compatible HTTP edge.
//!
//! Requests are parsed ([`api`]), validated and tokenized once ([`validate`]), and handed to
//! the request router as one [`Dispatch`] per choice over a bounded channel ([`dispatch`]);
//! token events come back and are detokenized, stop-string-matched and shaped into JSON or
//! SSE here ([`generate`], [`respond`]), because only the edge sees a request's whole
//! stream. HTTP statuses are chosen in [`error`] only. Connections arrive through [`edge`]
//! (TCP_NODELAY; TLS when given a certificate) and are admitted under their API key ([`keys`]:
//! names for logs and metrics, a concurrent-request limit per key).
//!
//! The cluster side ([`cluster`]): the node registry (drain, role switch, leave), routing,
//! each request's path through the nodes (a sans-IO state machine, `cluster::attempt`, and the
//! shell that performs its actions), the admin API, and the planner's actor with its actuators.
//! A node registers only with a certificate that names it and allows its role, and is not
//! revoked.
//!
//! Structured output and tool calling: the constraint a request asks for is compiled once
//! here against the model's vocabulary (cleave-constrain) and travels in its sampling
//! parameters to the nodes that enforce it; tool calls are parsed out of the output here
//! ([`structured`], [`respond`]).
//!
//! Allowed dependencies: cleave-protocol, cleave-tokenizer, cleave-constrain (compiling and
//! tool-call text, never masks), cleave-planner and cleave-net's
//! authenticated streams and certificates (never the engine or kernels), axum/tokio,
//! tokio-rustls for the edge, metrics; kube behind the `kubernetes` feature.

pub mod api;
pub mod cluster;
pub mod config;
pub mod dispatch;
pub mod edge;
pub mod error;
pub mod generate;
mod handlers;
pub mod keys;
pub mod metrics;
pub mod model;
pub mod respond;
pub mod server;
pub mod state;
pub mod structured;
pub mod validate;

pub use config::CoordinatorArgs;
pub use dispatch::{dispatch_channel, Dispatch, DispatchEvent, DispatchSender};
pub use error::{CoordinatorError, ErrorResponse};
pub use model::ModelInfo;
pub use server::{bind, router, serve, serve_with_shutdown, AppState, Readiness};
