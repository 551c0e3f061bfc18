//! The engine loop on its own thread, and the handle async code uses to talk to it.
//!
//! The loop owns the [`EngineCore`] outright (no locks): commands arrive on a bounded channel,
//! token events leave on one channel per request. Dropping a [`TokenStream`] cancels its request,
//! so a client that disconnects frees its KV blocks at the engine's next step.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cleave_kernels::Backend;
use cleave_protocol::{RequestId, TokenEvent};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::runner::{EngineCore, EngineRequest, EngineSnapshot};
use crate::{EngineError, Result};

enum Command {
    Submit(EngineRequest, UnboundedSender<TokenEvent>),
    Cancel(RequestId),
    Snapshot(tokio::sync::oneshot::Sender<EngineSnapshot>),
    Shutdown,
}

/// How many commands may wait for the engine loop before `submit` reports the queue full.
pub const COMMAND_QUEUE: usize = 4096;

/// A cheap, cloneable handle to a running engine loop.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Command>,
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
        if ev.as_ref().is_none_or(|e| e.finish_reason.is_some()) {
            self.finished = true;
        }
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        if !self.finished {
            // Best effort: if the queue is full or the engine is gone, the loop notices the closed
            // event channel when it next sends to it and aborts the request then.
            let _ = self.tx.try_send(Command::Cancel(self.id));
        }
    }
}

impl EngineHandle {
    /// Submits a request; its events arrive on the returned stream.
    pub fn submit(&self, req: EngineRequest) -> Result<TokenStream> {
        let (etx, erx) = unbounded_channel();
        let id = req.id;
        self.send(Command::Submit(req, etx))?;
        Ok(TokenStream { id, rx: erx, tx: self.tx.clone(), finished: false })
    }

    /// Queues a command without blocking: a full queue is the caller's back-pressure signal.
    fn send(&self, cmd: Command) -> Result<()> {
        self.tx.try_send(cmd).map_err(|e| match e {
            TrySendError::Full(_) => EngineError::Rejected(format!("engine queue full ({COMMAND_QUEUE} pending)")),
            TrySendError::Disconnected(_) => EngineError::Stopped,
        })
    }

    /// Cancels a request; its blocks are freed at the next step.
    pub fn cancel(&self, id: RequestId) {
        let _ = self.tx.try_send(Command::Cancel(id));
    }

    /// Asks the loop for a snapshot of its load; answered between steps.
    pub fn snapshot(&self) -> Result<tokio::sync::oneshot::Receiver<EngineSnapshot>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Command::Snapshot(tx))?;
        Ok(rx)
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
        let (ready_tx, ready_rx) = mpsc::channel();
        let join = std::thread::Builder::new()
            .name("cleave-engine".into())
            .spawn(move || {
                let core = match make() {
                    Ok(core) => {
                        let _ = ready_tx.send(Ok(()));
                        core
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        let _ = ready_tx.send(Err(e));
                        return Err(EngineError::Rejected(msg));
                    }
                };
                run_loop(core, rx)
            })
            .map_err(|e| EngineError::io("engine thread", e))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self { handle: EngineHandle { tx }, join: Some(join) }),
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
        let _ = self.handle.tx.send(Command::Shutdown);
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

fn run_loop<B: Backend>(mut core: EngineCore<B>, rx: Receiver<Command>) -> Result<()> {
    let mut senders: std::collections::HashMap<RequestId, UnboundedSender<TokenEvent>> = Default::default();
    loop {
        // Block while idle; otherwise only drain what is already queued.
        let first = if core.has_work() {
            None
        } else {
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        };
        for cmd in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
            match cmd {
                Command::Submit(req, etx) => {
                    let id = req.id;
                    match core.add_request(req, Instant::now()) {
                        Ok(()) => {
                            senders.insert(id, etx);
                        }
                        Err(e) => {
                            tracing::debug!(request_id = %id, error = %e, "request rejected");
                            let _ = etx.send(core.error_event(id, &e));
                        }
                    }
                }
                Command::Cancel(id) => core.abort(id),
                Command::Snapshot(reply) => {
                    let _ = reply.send(core.snapshot());
                }
                Command::Shutdown => return Ok(()),
            }
        }
        if !core.has_work() {
            continue;
        }
        let events = match core.step(Instant::now()) {
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
            let last = ev.finish_reason.is_some();
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
