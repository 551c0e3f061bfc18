//! Prefill-only requests and their layer-wise KV export (the prefill side of a handoff).
//!
//! A prefill-only request ([`crate::EngineCore::add_prefill_only`]) runs its prompt like any
//! other request, with chunked prefill and prefix caching, and hands its K/V to a [`KvExport`]
//! sink as it is computed:
//!
//! - **Layer-wise**: inside the forward pass, right after layer `l` has written the chunk's K/V
//!   into the cache and before layer `l + 1` runs, the sink receives a [`KvChunk`] for layer `l`
//!   of that chunk, so the network can ship layer `l` while the rest computes.
//! - **Prefix-cache hits**: prompt tokens served from the prefix cache were never computed by
//!   this request; at the first step that runs it they are read from the cache and sent, every
//!   layer, before the forward pass (and before the computed tokens of that layer).
//! - **Exactly once, in order**: for every layer the chunks cover `0..prompt_len` exactly once,
//!   in position order (a preempted request that recomputes does not resend what it sent).
//!   Chunks of different layers interleave.
//! - **Done**: after the last chunk, once the first token is sampled, the sink receives
//!   [`KvExportEvent::Done`]. Nothing follows it.
//!
//! Chunk bytes (agreed with kv-transfer): for one layer and a run of `token_count` tokens, K is
//! `token_count * num_kv_heads * head_dim` little-endian values of the cache's dtype (f32, f16
//! or bf16: [`crate::EngineConfig::kv_dtype`], the `dtype` of the engine's `KvLayout`),
//! token-major (position order, then head, then dimension), exactly the cache's row layout; V
//! the same.
//!
//! The request's token stream gets exactly one event, the first token. Its `finish_reason` is
//! `Some` only when that token really ends the request (EOS or a stop token id or stop string:
//! `Stop`; `max_tokens == 1` or the context is full: `Length`); then nothing is to be handed
//! off and [`ExportDone::finish`] says the same. `None` means the request continues on a decode
//! node: the engine is done with it (its blocks stay in the prefix cache as usual) and the
//! stream ends right after. Text the stop-string matcher holds back after the first token is
//! not emitted here; the decode side replays the first token and releases it later (see
//! [`crate::import`]).
//!
//! A sink never blocks the engine thread: it returns [`SinkError`] instead (a full bounded
//! channel, a dropped receiver). The request then ends with an `Error` event and its blocks are
//! freed at the next step; the other requests of the batch are unaffected.

use bytes::Bytes;
use cleave_protocol::{FinishReason, RequestId};
use tokio::sync::mpsc;

/// K and V of one layer for a run of consecutive prompt tokens (layout in the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct KvChunk {
    pub request_id: RequestId,
    pub layer: u32,
    /// Position of the first token of the run.
    pub token_start: u32,
    pub token_count: u32,
    pub k: Bytes,
    pub v: Bytes,
}

/// Every chunk of a prefill-only request is out and its first token is sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportDone {
    pub request_id: RequestId,
    /// The first generated token (already in the request's token stream).
    pub first_token: u32,
    /// `Some` when the first token ends the request (nothing to hand off), as in its event.
    pub finish: Option<FinishReason>,
    pub prompt_tokens: u32,
    /// Prompt tokens this engine served from its prefix cache (report them to the client).
    pub cached_tokens: u32,
    /// The seed the request's sampler used: pass it to
    /// [`crate::ImportStart::sampler_seed`] so that the decode side continues the same random
    /// stream.
    pub sampler_seed: u64,
}

/// What a [`KvExport`] sink receives: chunks, then one `Done`.
#[derive(Debug, Clone, PartialEq)]
pub enum KvExportEvent {
    Chunk(KvChunk),
    Done(ExportDone),
}

/// Why a sink did not take an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    #[error("the kv export sink is full")]
    Full,
    #[error("the kv export sink is closed")]
    Closed,
}

type SinkFn = Box<dyn FnMut(KvExportEvent) -> Result<(), SinkError> + Send>;

/// Where a prefill-only request's K/V goes. The sink is called on the engine thread, inside the
/// forward pass: it must return promptly (hand the bytes to another task; never block on the
/// network).
pub struct KvExport {
    sink: SinkFn,
}

impl std::fmt::Debug for KvExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvExport")
    }
}

impl KvExport {
    /// Any function; an `Err` fails the request (see the module docs).
    pub fn new(sink: impl FnMut(KvExportEvent) -> Result<(), SinkError> + Send + 'static) -> Self {
        Self { sink: Box::new(sink) }
    }

    /// Into an unbounded channel: never full, so memory grows if the receiver falls behind.
    pub fn unbounded(tx: mpsc::UnboundedSender<KvExportEvent>) -> Self {
        Self::new(move |ev| tx.send(ev).map_err(|_| SinkError::Closed))
    }

    /// Into a bounded channel with `try_send`: when it is full the request fails rather than
    /// stalling the engine (size it for a whole prompt: `num_layers * prefill chunks + 1`).
    pub fn bounded(tx: mpsc::Sender<KvExportEvent>) -> Self {
        Self::new(move |ev| {
            tx.try_send(ev).map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => SinkError::Full,
                mpsc::error::TrySendError::Closed(_) => SinkError::Closed,
            })
        })
    }

    pub(crate) fn send(&mut self, ev: KvExportEvent) -> Result<(), SinkError> {
        (self.sink)(ev)
    }
}

/// Export bookkeeping of one live prefill-only request.
#[derive(Debug)]
pub(crate) struct ExportState {
    pub sink: KvExport,
    /// Prompt positions `0..exported` have been sent for every layer.
    pub exported: usize,
    /// The request's own `max_tokens` (the scheduler sees 1).
    pub max_tokens: u32,
    /// Set when the sink refused an event; the request is then failed after the pass.
    pub failed: Option<SinkError>,
}

impl ExportState {
    pub fn new(sink: KvExport, max_tokens: u32) -> Self {
        Self { sink, exported: 0, max_tokens, failed: None }
    }

    /// Sends one event unless the sink already failed; records a failure.
    pub fn send(&mut self, ev: KvExportEvent) {
        if self.failed.is_none() {
            if let Err(e) = self.sink.send(ev) {
                self.failed = Some(e);
            }
        }
    }
}

/// One prefill-only sequence's share of a step: positions `from..to` to export, with the block
/// table of the step.
#[derive(Debug, Clone)]
pub(crate) struct ExportItem {
    pub seq_id: u64,
    pub from: usize,
    pub to: usize,
    pub block_table: Vec<u32>,
}
