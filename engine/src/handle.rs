//! The engine loop on its own thread, and the handle async code uses to talk to it.
//!
//! The loop owns the [`EngineCore`] outright (no locks): commands arrive on a bounded channel,
//! token events leave on one channel per request. Dropping a [`TokenStream`] cancels its request,
//! so a client that disconnects frees its KV blocks at the engine's next step.
//!
//! Disaggregation: [`EngineHandle::submit_prefill_only`] (layer-wise KV export, see
//! [`crate::export`]) and the import commands [`EngineHandle::reserve_import`],
//! [`EngineHandle::import_kv`], [`EngineHandle::release_import`] and
//! [`EngineHandle::submit_imported`] (see [`crate::import`]). Commands are applied in the order
//! they were sent, so the chunks of one request are written in order and before a
//! `submit_imported` sent after them. A loop that stops releases every import reservation.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_kernels::Backend;
use cleave_protocol::control::LoadReport;
use cleave_protocol::{KvLayout, RequestId, TokenEvent};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;

use crate::export::KvExport;
use crate::import::{ImportGrant, ImportStart};
use crate::runner::{ConstraintCompiler, EngineCore, EngineRequest, EngineSnapshot};
use crate::{EngineError, Result};

/// A new request, of each kind the engine takes.
enum Submission {
    Plain(EngineRequest),
    PrefillOnly(EngineRequest, KvExport),
    Imported(EngineRequest, ImportStart),
    Resumed(EngineRequest, Vec<u32>, Option<u64>),
}

/// The queue's slots are allocated and written when it is made, `COMMAND_QUEUE` of them a
/// `Command`, so the submission (216 bytes: an [`EngineRequest`] and more) is boxed: a `Command`
/// is 40 bytes, where 4096 slots of the unboxed one held about a megabyte of every node's
/// resident memory.
enum Command {
    Submit(Box<Submission>, UnboundedSender<TokenEvent>),
    Control(Control),
}

/// Commands that are not submissions.
enum Control {
    ReserveImport {
        id: RequestId,
        num_tokens: usize,
        reply: oneshot::Sender<Result<Vec<u32>>>,
    },
    ReserveImportPrompt {
        id: RequestId,
        prompt: Vec<u32>,
        reply: oneshot::Sender<Result<ImportGrant>>,
    },
    ReleaseImport {
        id: RequestId,
        reply: oneshot::Sender<Result<()>>,
    },
    Cancel(RequestId),
    Snapshot(oneshot::Sender<EngineSnapshot>),
    PrefixHashes(oneshot::Sender<Vec<u64>>),
    SetStepBudget(usize, oneshot::Sender<Result<()>>),
    SetTpotTarget(Option<std::time::Duration>, oneshot::Sender<Result<()>>),
    /// Imports are waiting in the import channel (see [`EngineHandle::import_kv`]).
    Wake,
    Shutdown,
}

/// One chunk of K/V for a reservation. Chunks travel on their own unbounded channel so that
/// a burst of them (layers x chunks x requests) never fills the bounded command queue; their
/// memory is bounded by the reservations, which the pool bounds.
struct ImportKv {
    id: RequestId,
    layer: u32,
    token_start: u32,
    k: Bytes,
    v: Bytes,
    reply: oneshot::Sender<Result<()>>,
}

/// Facts about the engine that do not change while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// Block layout and model fingerprint (see [`EngineCore::kv_layout`]).
    pub kv_layout: KvLayout,
    pub max_model_len: usize,
    pub kv_blocks_total: usize,
    /// The weights' fingerprint and formats (see [`EngineCore::weights`]).
    pub weights: cleave_protocol::WeightsInfo,
}

/// How long after its last step the loop lets the core give back a large activation
/// workspace ([`EngineCore::on_idle`]).
const IDLE_RELEASE: Duration = Duration::from_secs(5);

/// How many commands may wait for the engine loop before `submit` reports the queue full.
pub const COMMAND_QUEUE: usize = 4096;

/// A cheap, cloneable handle to a running engine loop.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Command>,
    imports: mpsc::Sender<ImportKv>,
    /// Set while a `Wake` for queued imports is pending; the loop clears it before draining.
    wake: Arc<AtomicBool>,
    info: Arc<EngineInfo>,
    compiler: Arc<ConstraintCompiler>,
}

/// The engine loop's thread; dropping it (or calling [`EngineThread::shutdown`]) stops the loop
/// after the current step.
pub struct EngineThread {
    handle: EngineHandle,
    join: Option<JoinHandle<Result<()>>>,
}

/// The token events of one request. Dropping it cancels the request.
pub struct TokenStream {
    id: RequestId,
    rx: UnboundedReceiver<TokenEvent>,
    tx: SyncSender<Command>,
    finished: bool,
    /// A prefill-only request: its stream ends after the first token event.
    handoff: bool,
}

impl TokenStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next event; `None` after the final one (or if the engine stopped).
    pub async fn next(&mut self) -> Option<TokenEvent> {
        let ev = self.rx.recv().await;
        self.note(&ev);
        ev
    }

    /// Blocking variant for synchronous callers (never call it inside an async runtime).
    pub fn blocking_next(&mut self) -> Option<TokenEvent> {
        let ev = self.rx.blocking_recv();
        self.note(&ev);
        ev
    }

    fn note(&mut self, ev: &Option<TokenEvent>) {
        if self.handoff || ev.as_ref().is_none_or(|e| e.finish_reason.is_some()) {
            self.finished = true;
        }
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        if !self.finished {
            // Best effort: if the queue is full or the engine is gone, the loop notices the closed
            // event channel when it next sends to it and aborts the request then.
            let _ = self.tx.try_send(Command::Control(Control::Cancel(self.id)));
        }
    }
}

impl EngineHandle {
    /// Submits a request; its events arrive on the returned stream.
    pub fn submit(&self, req: EngineRequest) -> Result<TokenStream> {
        let (etx, erx) = unbounded_channel();
        let id = req.id;
        self.send(Command::Submit(Box::new(Submission::Plain(req)), etx))?;
        Ok(TokenStream { id, rx: erx, tx: self.tx.clone(), finished: false, handoff: false })
    }

    /// Facts about the engine (KV layout, model fingerprint, limits).
    /// Builds the constraint compiler on a thread of its own unless it is built, and waits for
    /// it: a request handler calls this before it submits a constrained request, so the first
    /// one does not stall the engine's step for the build (see [`ConstraintCompiler`]).
    pub async fn prepare_constraints(&self) {
        if self.compiler.is_built() {
            return;
        }
        let (tx, rx) = oneshot::channel();
        let compiler = self.compiler.clone();
        let build = move || {
            compiler.get();
            let _ = tx.send(());
        };
        // Without a thread the engine builds it when the request arrives, as it would anyway.
        if std::thread::Builder::new().name("cleave-constraints".into()).spawn(build).is_ok() {
            let _ = rx.await;
        }
    }

    /// Whether the constraint compiler is built (by [`EngineHandle::prepare_constraints`] or by
    /// a constrained request).
    pub fn constraints_built(&self) -> bool {
        self.compiler.is_built()
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Submits a prefill-only request whose K/V goes to `export` (see [`crate::export`]). The
    /// stream yields one event, the first token (`finish_reason` `None` when the request is to
    /// be handed off), or an error event, and then ends.
    pub fn submit_prefill_only(&self, req: EngineRequest, export: KvExport) -> Result<TokenStream> {
        let (etx, erx) = unbounded_channel();
        let id = req.id;
        self.send(Command::Submit(Box::new(Submission::PrefillOnly(req, export)), etx))?;
        Ok(TokenStream { id, rx: erx, tx: self.tx.clone(), finished: false, handoff: true })
    }

    /// Reserves blocks for `num_tokens` tokens of K/V that will arrive for `id`
    /// ([`EngineCore::reserve_import`]); the reply carries the block ids or why not.
    pub fn reserve_import(&self, id: RequestId, num_tokens: usize) -> Result<oneshot::Receiver<Result<Vec<u32>>>> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Control(Control::ReserveImport { id, num_tokens, reply }))?;
        Ok(rx)
    }

    /// Reserves blocks for the K/V of `prompt` that will arrive for `id`, reusing its cached
    /// prefix ([`EngineCore::reserve_import_prompt`]).
    pub fn reserve_import_prompt(
        &self,
        id: RequestId,
        prompt: Vec<u32>,
    ) -> Result<oneshot::Receiver<Result<ImportGrant>>> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Control(Control::ReserveImportPrompt { id, prompt, reply }))?;
        Ok(rx)
    }

    /// Writes one chunk of K/V into `id`'s reservation ([`EngineCore::import_kv`]). Never
    /// refused for a full queue. Chunks are applied in the order sent, before any submission
    /// sent after them (so `submit_imported` sees every chunk sent before it).
    pub fn import_kv(
        &self,
        id: RequestId,
        layer: u32,
        token_start: u32,
        k: Bytes,
        v: Bytes,
    ) -> Result<oneshot::Receiver<Result<()>>> {
        let (reply, rx) = oneshot::channel();
        self.imports.send(ImportKv { id, layer, token_start, k, v, reply }).map_err(|_| EngineError::Stopped)?;
        if !self.wake.swap(true, Ordering::AcqRel) {
            // A full queue means the loop is busy and drains the imports anyway.
            let _ = self.tx.try_send(Command::Control(Control::Wake));
        }
        Ok(rx)
    }

    /// Gives `id`'s reserved blocks back ([`EngineCore::release_import`]).
    pub fn release_import(&self, id: RequestId) -> Result<oneshot::Receiver<Result<()>>> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Control(Control::ReleaseImport { id, reply }))?;
        Ok(rx)
    }

    /// Starts decoding an imported request ([`EngineCore::add_imported`]): its stream starts
    /// with the token after `start.first_token`; a refusal arrives as an error event.
    pub fn submit_imported(&self, req: EngineRequest, start: ImportStart) -> Result<TokenStream> {
        let (etx, erx) = unbounded_channel();
        let id = req.id;
        self.send(Command::Submit(Box::new(Submission::Imported(req, start)), etx))?;
        Ok(TokenStream { id, rx: erx, tx: self.tx.clone(), finished: false, handoff: false })
    }

    /// Submits a request that already generated `generated` elsewhere (a migrated stream,
    /// [`EngineCore::add_resumed`]); its stream starts with the token after them.
    pub fn submit_resumed(
        &self,
        req: EngineRequest,
        generated: Vec<u32>,
        sampler_seed: Option<u64>,
    ) -> Result<TokenStream> {
        let (etx, erx) = unbounded_channel();
        let id = req.id;
        self.send(Command::Submit(Box::new(Submission::Resumed(req, generated, sampler_seed)), etx))?;
        Ok(TokenStream { id, rx: erx, tx: self.tx.clone(), finished: false, handoff: false })
    }

    /// Keys of the blocks in the prefix cache ([`EngineCore::cached_prefix_hashes`]).
    pub fn prefix_hashes(&self) -> Result<oneshot::Receiver<Vec<u64>>> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Control(Control::PrefixHashes(reply)))?;
        Ok(rx)
    }

    /// Queues a command without blocking: a full queue is the caller's back-pressure signal.
    fn send(&self, cmd: Command) -> Result<()> {
        self.tx.try_send(cmd).map_err(|e| match e {
            TrySendError::Full(_) => EngineError::Rejected(format!("engine queue full ({COMMAND_QUEUE} pending)")),
            TrySendError::Disconnected(_) => EngineError::Stopped,
        })
    }

    /// Changes the engine's step budget (most tokens per step) from the next step on.
    pub async fn set_step_budget(&self, tokens: usize) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Control(Control::SetStepBudget(tokens, tx)))?;
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    /// Paces prompt chunks beside running decodes to `target` time per output token from the
    /// next step on (None: the step budget alone limits them; see [`crate::sched::pacing`]).
    pub async fn set_tpot_target(&self, target: Option<std::time::Duration>) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Control(Control::SetTpotTarget(target, tx)))?;
        rx.await.map_err(|_| EngineError::Stopped)?
    }

    /// Cancels a request; its blocks are freed at the next step.
    pub fn cancel(&self, id: RequestId) {
        let _ = self.tx.try_send(Command::Control(Control::Cancel(id)));
    }

    /// Asks the loop for a snapshot of its load; answered between steps.
    pub fn snapshot(&self) -> Result<oneshot::Receiver<EngineSnapshot>> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Control(Control::Snapshot(tx)))?;
        Ok(rx)
    }

    /// The load a node reports to the coordinator: the snapshot plus at most `max_hashes`
    /// prefix-cache keys. `None` once the engine has stopped.
    pub async fn load_report(&self, max_hashes: usize) -> Option<LoadReport> {
        let snap = self.snapshot().ok()?.await.ok()?;
        let hashes = match self.prefix_hashes() {
            Ok(rx) => rx.await.unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        Some(LoadReport {
            queued_prefill_tokens: snap.queued_prefill_tokens as u64,
            waiting_seqs: n(snap.waiting),
            running_seqs: n(snap.running),
            free_blocks: n(snap.kv_blocks_free),
            cached_blocks: n(snap.kv_blocks_cached),
            total_blocks: n(snap.kv_blocks_total),
            prefix_hashes: hashes.into_iter().take(max_hashes).collect(),
            steps: snap.step_totals,
            step_budget: u32::try_from(snap.step_budget).ok(),
            tpot_target_us: snap.tpot_target.map(|t| u32::try_from(t.as_micros()).unwrap_or(u32::MAX)),
            paced_steps: snap.paced_steps,
            kv_resident_bytes: snap.kv_resident_bytes,
        })
    }
}

impl EngineThread {
    /// Starts the loop on a new thread. The core is built on that thread by `make`, so backends
    /// that are bound to their creating thread work too.
    pub fn spawn<B, F>(make: F) -> Result<Self>
    where
        B: Backend,
        F: FnOnce() -> Result<EngineCore<B>> + Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(COMMAND_QUEUE);
        let (imports, imports_rx) = mpsc::channel();
        let wake = Arc::new(AtomicBool::new(false));
        let loop_wake = wake.clone();
        let (ready_tx, ready_rx) = mpsc::channel();
        let join = std::thread::Builder::new()
            .name("cleave-engine".into())
            .spawn(move || {
                let core = match make() {
                    Ok(core) => {
                        let info = EngineInfo {
                            kv_layout: core.kv_layout(),
                            max_model_len: core.max_model_len(),
                            kv_blocks_total: core.scheduler().kv().num_blocks(),
                            weights: core.weights(),
                        };
                        let _ = ready_tx.send(Ok((info, core.constraint_compiler())));
                        core
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        let _ = ready_tx.send(Err(e));
                        return Err(EngineError::Rejected(msg));
                    }
                };
                run_loop(core, Inbox { commands: rx, imports: imports_rx, wake: loop_wake })
            })
            .map_err(|e| EngineError::io("engine thread", e))?;
        match ready_rx.recv() {
            Ok(Ok((info, compiler))) => Ok(Self {
                handle: EngineHandle { tx, imports, wake, info: Arc::new(info), compiler },
                join: Some(join),
            }),
            Ok(Err(e)) => {
                let _ = join.join();
                Err(e)
            }
            Err(_) => Err(EngineError::Stopped),
        }
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Stops the loop and waits for it; reports an error the loop died with.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> Result<()> {
        let _ = self.handle.tx.send(Command::Control(Control::Shutdown));
        match self.join.take() {
            Some(j) => j.join().map_err(|_| EngineError::Rejected("engine thread panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// What the loop receives: commands, and K/V chunks on their own channel.
struct Inbox {
    commands: Receiver<Command>,
    imports: Receiver<ImportKv>,
    wake: Arc<AtomicBool>,
}

impl Inbox {
    /// Applies every queued chunk, in order.
    fn drain_imports<B: Backend>(&self, core: &mut EngineCore<B>) {
        self.wake.store(false, Ordering::Release);
        while let Ok(c) = self.imports.try_recv() {
            let _ = c.reply.send(core.import_kv(c.id, c.layer, c.token_start, &c.k, &c.v));
        }
    }
}

fn run_loop<B: Backend>(mut core: EngineCore<B>, inbox: Inbox) -> Result<()> {
    let result = drive(&mut core, &inbox);
    if let Err(e) = core.release_all_imports() {
        tracing::error!(error = %e, "releasing kv import reservations at shutdown");
    }
    result
}

fn drive<B: Backend>(core: &mut EngineCore<B>, inbox: &Inbox) -> Result<()> {
    let rx = &inbox.commands;
    let mut senders: std::collections::HashMap<RequestId, UnboundedSender<TokenEvent>> = Default::default();
    // Prefill-only requests: their stream closes after their one event.
    let mut handoff: HashSet<RequestId> = HashSet::new();
    // When the last step ran, and whether the core has been told of the idle spell since. Time
    // since a step, not since a command: a node asks for a snapshot several times a second.
    let (mut stepped_at, mut told_idle) = (Instant::now(), false);
    loop {
        // Block while idle; otherwise only drain what is already queued.
        let first = if core.has_work() {
            None
        } else {
            if !told_idle && stepped_at.elapsed() >= IDLE_RELEASE {
                core.on_idle();
                told_idle = true;
            }
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        };
        inbox.drain_imports(core);
        for cmd in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
            // Chunks sent before this command are queued by now: apply them first, so that a
            // submission or release sees every chunk sent before it.
            inbox.drain_imports(core);
            let now = Instant::now();
            let (sub, etx) = match cmd {
                Command::Submit(sub, etx) => (sub, etx),
                Command::Control(c) => {
                    if control(core, c) {
                        return Ok(());
                    }
                    continue;
                }
            };
            // Every kind of submission: on success the stream is registered, else it gets the
            // error as its one event.
            let (id, added, is_handoff) = match *sub {
                Submission::Plain(req) => (req.id, core.add_request(req, now), false),
                Submission::PrefillOnly(req, export) => (req.id, core.add_prefill_only(req, export, now), true),
                Submission::Imported(req, start) => (req.id, core.add_imported(req, start, now), false),
                Submission::Resumed(req, generated, seed) => {
                    (req.id, core.add_resumed(req, generated, seed, now), false)
                }
            };
            match added {
                Ok(()) => {
                    senders.insert(id, etx);
                    if is_handoff {
                        handoff.insert(id);
                    }
                }
                Err(e) => {
                    tracing::debug!(request_id = %id, error = %e, "request rejected");
                    let _ = etx.send(core.error_event(id, &e));
                }
            }
        }
        if !core.has_work() {
            continue;
        }
        let started = Instant::now();
        let stepped = core.step(started);
        core.note_step_time(started.elapsed());
        (stepped_at, told_idle) = (Instant::now(), false);
        let events = match stepped {
            Ok(events) => events,
            Err(e) => {
                // The engine cannot go on: tell every live request why before the loop exits.
                tracing::error!(error = %e, "engine step failed");
                for (id, tx) in senders.drain() {
                    let _ = tx.send(core.error_event(id, &e));
                }
                return Err(e);
            }
        };
        for ev in events {
            let id = ev.request_id;
            let was_handoff = handoff.remove(&id);
            let last = ev.finish_reason.is_some() || was_handoff;
            let gone = senders.get(&id).is_none_or(|tx| tx.send(ev).is_err());
            if last {
                senders.remove(&id);
            } else if gone {
                // The receiver was dropped without a Cancel reaching us: abort now.
                senders.remove(&id);
                core.abort(id);
            }
        }
    }
}

/// Applies a command that is not a submission; true for `Shutdown`.
fn control<B: Backend>(core: &mut EngineCore<B>, cmd: Control) -> bool {
    match cmd {
        Control::ReserveImport { id, num_tokens, reply } => {
            let _ = reply.send(core.reserve_import(id, num_tokens));
        }
        Control::ReserveImportPrompt { id, prompt, reply } => {
            let _ = reply.send(core.reserve_import_prompt(id, &prompt));
        }
        Control::Wake => {}
        Control::ReleaseImport { id, reply } => {
            let _ = reply.send(core.release_import(id));
        }
        Control::Cancel(id) => core.abort(id),
        Control::Snapshot(reply) => {
            let _ = reply.send(core.snapshot());
        }
        Control::PrefixHashes(reply) => {
            let _ = reply.send(core.cached_prefix_hashes());
        }
        Control::SetStepBudget(tokens, reply) => {
            let _ = reply.send(core.set_step_budget(tokens));
        }
        Control::SetTpotTarget(target, reply) => {
            let _ = reply.send(core.set_tpot_target(target));
        }
        Control::Shutdown => return true,
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The command queue's slots are allocated whole (see [`Command`]): a variant that grows
    /// past this grows every node's resident memory by `COMMAND_QUEUE` times as much.
    #[test]
    fn a_command_stays_small() {
        let size = std::mem::size_of::<Command>();
        assert!(size <= 96, "Command is {size} bytes; box the variant that grew");
        assert!(std::mem::size_of::<Submission>() > size, "the submission is the boxed part");
    }
}
