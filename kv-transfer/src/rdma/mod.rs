//! RDMA transport (cargo feature `rdma`): the prefill node writes each layer of each prefill
//! chunk straight into the decode node's leased KV blocks with one-sided RDMA WRITE (WITH
//! IMMEDIATE) over a reliable-connected queue pair. The decode node's KV pool is one memory
//! region, registered once.
//!
//! Build needs libibverbs and librdmacm headers (Debian: `libibverbs-dev librdmacm-dev`) and
//! libclang (`libclang-dev`, for rdma-sys's bindgen). Running needs an RDMA device; everything
//! except [`verbs`] is pure and tested without one.
//!
//! Flow of one handoff over RDMA:
//! 1. Link setup, once per peer pair ([`setup`]): each side creates a queue pair and sends its
//!    [`QpMetadata`] over the QUIC control stream (the decode side with its [`RemoteRegion`]:
//!    address, length, rkey and [`PoolLayout`] of the pool); both [`verbs::QueuePair::connect`].
//! 2. Per lease: the decode side reserves blocks (the ticket carries the block ids); the
//!    sender's `Open` names the link, and the receiver assigns a 12-bit lease tag unused on
//!    this queue pair, opens it in its [`RecvTracker`] (one receive stays posted per expected
//!    immediate) and answers `Accept` with the tag.
//! 3. Per computed (layer, chunk): the prefill side builds the writes with [`plan_chunk`] (runs
//!    of adjacent blocks merged, the last write carrying the [`Imm`]), claims wr_ids from its
//!    [`SendTracker`], posts them, and sends a `Landed` notice (with the chunk's CRC-32) on the
//!    control stream.
//! 4. Once every write completed, the prefill side sends `Complete`; the receiver gives the
//!    chunk count to its tracker ([`RecvTracker::set_chunks`]), which reports Done when every
//!    (layer, chunk) immediate arrived; then every notice's CRC is checked against the pool.
//! 5. Faults: see [`completion`] for the lease state machine and who frees blocks when.
//!
//! [`link`] drives it all (one end per queue pair) over a small operations trait, implemented
//! by [`verbs`] for a device and by [`sim`] in memory, so the whole flow, faults included, runs
//! in tests without a device. [`driver`] gives each link end an owner task with a handle (posting
//! in order under back-pressure, `finish` and `cancel` that wait for the outcome or the drain).
//!
//! [`send`], [`handoff`] and [`lease`] make it a payload path a handoff can pick
//! ([`crate::payload`]): the [`RdmaTransport`] gives each transfer an [`RdmaSendPath`] (the
//! sender's [`crate::payload::SendPath`]), a receiver spawned with [`RdmaReceive`]
//! (`ReceiverService::spawn_rdma`) holds its links as its [`crate::payload::RecvPath`], and that
//! path gives each lease it binds an [`RdmaLease`] (the lease's
//! [`crate::payload::LeasePayload`] in the receiver's state machine: its notices, checked once
//! every group landed). The generic sender, receiver and actor hold no RDMA logic; a build without this feature has no
//! RDMA code, and its receivers refuse an `Open` naming a link and a link offer.
//!
//! The pool an RDMA receiver exposes is a [`crate::MemoryPool`] registered whole
//! ([`verbs::MemoryRegion::register_pool`]). A decode node uses one as its landing pool and
//! copies each completed lease into the engine's cache: the engine keeps one buffer per layer
//! (device memory on a GPU backend), which is not one registrable region.
//!
//! Module dependencies: [`layout`], [`plan`], [`meta`], [`completion`], [`link`], [`lease`]
//! and [`sim`] depend on no verbs type; [`verbs`] is the only module with `unsafe`.

pub mod completion;
pub mod driver;
pub mod handoff;
pub mod layout;
pub mod lease;
pub mod link;
pub mod meta;
pub mod plan;
pub mod send;
pub mod setup;
pub mod sim;
pub mod verbs;

pub use completion::{
    FailReason, LeaseEvent, Outcome, RecvCompletion, RecvTracker, SendCompletion, SendTracker, WcStatus,
};
pub use driver::{DriverConfig, RecvDriver, SendChunk, SendDriver};
pub use handoff::RdmaReceive;
pub use layout::{Half, Imm, PoolLayout};
pub use lease::RdmaLease;
pub use link::{RecvLink, RecvLinkConfig, RecvOps, SendLink, SendLinkConfig, SendOps};
pub use meta::{AddressVector, GlobalRoute, PathMtu, QpMetadata};
pub use plan::{landed_checksum, plan_chunk, source_len, ChunkWrite, RdmaWrite, RemoteRegion, SignalPolicy};
pub use send::{LinkHandle, RdmaSendConfig, RdmaSendPath, RdmaTransport};
pub use setup::{accept as accept_link, connect as connect_link, Acceptor, DynRecvLink, Provider};
