//! An in-memory reliable connection between a [`SimSender`] and a [`SimReceiver`], with the
//! verbs semantics the links rely on, for tests and benchmarks without a device:
//!
//! - writes execute in posting order into the receiver's region (checked against its rkey and
//!   bounds: a miss is IBV_WC_REM_ACCESS_ERR);
//! - a WRITE WITH IMMEDIATE consumes one posted receive (none posted: IBV_WC_RNR_RETRY_EXC_ERR)
//!   and yields a receive completion after its data landed;
//! - only signaled requests complete successfully; once the connection failed, every
//!   outstanding request on both sides completes as flushed and nothing more lands.
//!
//! Fault injection: [`SimNet::fail_write`] (the n-th next write fails with a status),
//! [`SimNet::corrupt_write`] (the n-th next write lands with one bit flipped and completes
//! successfully, as memory or a buggy peer could make it), [`SimNet::hold`] (writes stay in
//! flight, as on a stuck path, until [`SimNet::release`]).
//!
//! Addressing, as on a device: every queue pair of a [`SimFabric`] lives on a [`SimPort`] (a
//! LID, a GID or both; [`SimFabric::on_port`] gives a node its own). Connecting applies
//! [`super::AddressVector::towards`] to the peer's metadata and fails unless it reaches the port
//! the peer's queue pair is really on: a GID that is not the peer's, a LID route to a RoCE port
//! (LID 0: the GID was not exchanged), or a global route from a port without a GID.
//!
//! The two ends share state through a mutex: this is a test double, not a pattern to copy.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use super::completion::{RecvCompletion, SendCompletion, WcStatus};
use super::link::{RecvOps, SendOps};
use super::plan::RdmaWrite;
use crate::error::Result;

#[derive(Debug)]
struct Posted {
    wr_id: u64,
    src: Vec<u8>,
    rkey: u32,
    write: RdmaWrite,
}

/// The receiver's memory: a buffer of its own, or a [`crate::MemoryPool`] (writes land in the
/// pool a receiver actor reads, as on a device where the pool is the registered region).
#[derive(Clone)]
enum Region {
    Own(Vec<u8>),
    Pool(crate::MemoryPool),
}

impl Default for Region {
    fn default() -> Self {
        Region::Own(Vec::new())
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Region::Own(b) => write!(f, "Own({} bytes)", b.len()),
            Region::Pool(p) => write!(f, "Pool({} bytes)", p.region_len()),
        }
    }
}

impl Region {
    fn len(&self) -> usize {
        match self {
            Region::Own(b) => b.len(),
            Region::Pool(p) => p.region_len(),
        }
    }

    fn write(&mut self, at: usize, bytes: &[u8]) {
        match self {
            Region::Own(b) => b[at..at + bytes.len()].copy_from_slice(bytes),
            Region::Pool(p) => {
                p.write_region(at, bytes);
            }
        }
    }

    fn bytes(&self) -> Vec<u8> {
        match self {
            Region::Own(b) => b.clone(),
            Region::Pool(p) => p.region_bytes(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    region: Region,
    addr: u64,
    rkey: u32,
    recvs: u32,
    send_cq: VecDeque<SendCompletion>,
    recv_cq: VecDeque<RecvCompletion>,
    error: bool,
    fail: Option<(u64, WcStatus)>,
    corrupt: Option<u64>,
    hold: bool,
    held: VecDeque<Posted>,
    landed_writes: u64,
}

/// The shared wire; clone it to keep a handle for faults and inspection.
#[derive(Debug, Clone)]
pub struct SimNet {
    state: Arc<Mutex<State>>,
}

impl SimNet {
    /// A connection whose receiver exposes a zeroed region of `len` bytes at `addr`.
    pub fn new(addr: u64, len: usize, rkey: u32) -> Self {
        let state = State { region: Region::Own(vec![0; len]), addr, rkey, ..State::default() };
        Self { state: Arc::new(Mutex::new(state)) }
    }

    /// A connection whose receiver's region is `pool`'s memory.
    pub fn over_pool(addr: u64, pool: crate::MemoryPool, rkey: u32) -> Self {
        let state = State { region: Region::Pool(pool), addr, rkey, ..State::default() };
        Self { state: Arc::new(Mutex::new(state)) }
    }

    /// True once the connection failed (an error completion, a reset, a dropped receiver).
    pub fn is_broken(&self) -> bool {
        self.lock().error
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere in a test must not hide its own message behind a poisoned lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn sender(&self, staging_len: usize) -> SimSender {
        SimSender { net: self.clone(), staging: vec![0; staging_len] }
    }

    pub fn receiver(&self) -> SimReceiver {
        SimReceiver { net: self.clone() }
    }

    /// A copy of the receiver's region.
    pub fn region(&self) -> Vec<u8> {
        self.lock().region.bytes()
    }

    /// Writes executed so far.
    pub fn landed_writes(&self) -> u64 {
        self.lock().landed_writes
    }

    /// The `n`-th write from now (0 = the next) fails with `status`, breaking the connection.
    pub fn fail_write(&self, n: u64, status: WcStatus) {
        self.lock().fail = Some((n, status));
    }

    /// The `n`-th write from now (0 = the next) lands with the first bit of its data flipped;
    /// nothing on the wire says so (only the receiver's checksum can).
    pub fn corrupt_write(&self, n: u64) {
        self.lock().corrupt = Some(n);
    }

    /// While held, posted writes stay in flight: nothing lands, nothing completes.
    pub fn hold(&self, on: bool) {
        self.lock().hold = on;
    }

    /// Executes the held writes now (or flushes them if the connection failed meanwhile).
    pub fn release(&self) {
        let mut s = self.lock();
        s.hold = false;
        while let Some(p) = s.held.pop_front() {
            s.execute(p);
        }
    }

    pub fn in_flight(&self) -> usize {
        self.lock().held.len()
    }
}

impl State {
    fn break_connection(&mut self) {
        if self.error {
            return;
        }
        self.error = true;
        for _ in 0..self.recvs {
            self.recv_cq.push_back(RecvCompletion { status: WcStatus::Flushed, imm: None });
        }
        self.recvs = 0;
        let held: Vec<Posted> = self.held.drain(..).collect();
        for p in held {
            self.send_cq.push_back(SendCompletion { wr_id: p.wr_id, status: WcStatus::Flushed, vendor_err: 0 });
        }
    }

    fn execute(&mut self, p: Posted) {
        let complete =
            |s: &mut Self, status| s.send_cq.push_back(SendCompletion { wr_id: p.wr_id, status, vendor_err: 0 });
        if self.error {
            return complete(self, WcStatus::Flushed);
        }
        if let Some((n, status)) = self.fail {
            if n == 0 {
                self.fail = None;
                complete(self, status);
                return self.break_connection();
            }
            self.fail = Some((n - 1, status));
        }
        let w = p.write;
        let at = w.remote_addr.checked_sub(self.addr).map(|a| a as usize);
        let fits = at.is_some_and(|a| a.checked_add(w.len as usize).is_some_and(|e| e <= self.region.len()));
        if p.rkey != self.rkey || !fits {
            complete(self, WcStatus::RemoteAccess);
            return self.break_connection();
        }
        if w.imm.is_some() && self.recvs == 0 {
            complete(self, WcStatus::RnrRetryExceeded);
            return self.break_connection();
        }
        let at = at.unwrap_or(0);
        let mut src = p.src;
        match self.corrupt {
            Some(0) => {
                self.corrupt = None;
                if let Some(b) = src.first_mut() {
                    *b ^= 1;
                }
            }
            Some(n) => self.corrupt = Some(n - 1),
            None => {}
        }
        self.region.write(at, &src);
        self.landed_writes += 1;
        if let Some(imm) = w.imm {
            self.recvs -= 1;
            self.recv_cq.push_back(RecvCompletion { status: WcStatus::Success, imm: Some(imm.encode()) });
        }
        if w.signaled {
            complete(self, WcStatus::Success);
        }
    }
}

/// The sending end; its staging memory is a plain buffer.
#[derive(Debug)]
pub struct SimSender {
    net: SimNet,
    staging: Vec<u8>,
}

impl SendOps for SimSender {
    fn staging(&mut self) -> &mut [u8] {
        &mut self.staging
    }

    fn post_writes(&mut self, src_base: u64, rkey: u32, writes: &[RdmaWrite], wr_ids: &[u64]) -> Result<()> {
        let mut s = self.net.lock();
        for (w, &wr_id) in writes.iter().zip(wr_ids) {
            let from = (src_base + w.src_offset) as usize;
            // Copied at post time, like a NIC that fetched the data: the slot may be reused
            // only after the completion anyway.
            let src = self.staging[from..from + w.len as usize].to_vec();
            let p = Posted { wr_id, src, rkey, write: *w };
            if s.hold && !s.error {
                s.held.push_back(p);
            } else {
                s.execute(p);
            }
        }
        Ok(())
    }

    fn poll_send(&mut self, out: &mut Vec<SendCompletion>) -> Result<()> {
        out.extend(self.net.lock().send_cq.drain(..));
        Ok(())
    }
}

/// The receiving end.
#[derive(Debug)]
pub struct SimReceiver {
    net: SimNet,
}

impl RecvOps for SimReceiver {
    fn post_recvs(&mut self, count: u32) -> Result<()> {
        let mut s = self.net.lock();
        if s.error {
            for _ in 0..count {
                s.recv_cq.push_back(RecvCompletion { status: WcStatus::Flushed, imm: None });
            }
        } else {
            s.recvs += count;
        }
        Ok(())
    }

    fn poll_recv(&mut self, out: &mut Vec<RecvCompletion>) -> Result<()> {
        out.extend(self.net.lock().recv_cq.drain(..));
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        self.net.lock().break_connection();
        Ok(())
    }
}

impl Drop for SimReceiver {
    /// A destroyed queue pair: nothing lands any more, the sender's writes fail.
    fn drop(&mut self) {
        self.net.lock().break_connection();
    }
}

/// The port of a simulated node: how its queue pairs are addressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimPort {
    /// 0 on RoCE (Ethernet has no LIDs).
    pub lid: u16,
    /// The GID at the node's configured GID index; `None`: no GID configured (LID routing).
    pub gid: Option<[u8; 16]>,
}

impl SimPort {
    /// An InfiniBand port routed by LID (what a fabric's queue pairs use unless told otherwise).
    pub const IB: SimPort = SimPort { lid: 1, gid: None };

    /// A RoCE port: no LID, addressed by `gid`.
    pub fn roce(gid: [u8; 16]) -> Self {
        Self { lid: 0, gid: Some(gid) }
    }
}

/// A [`super::setup::Provider`] in memory: each receiving queue pair is a fresh [`SimNet`]
/// whose region has the pool's layout, found by the sender through the queue-pair number in the
/// receiver's metadata (as a device finds the peer's queue pair through its address), which
/// must also route to the peer's port (see the module docs).
#[derive(Debug, Clone)]
pub struct SimFabric {
    inner: Arc<Mutex<Fabric>>,
    /// The port this handle's queue pairs live on.
    port: SimPort,
    /// When set, every receiving queue pair's region is this pool's memory.
    pool: Option<crate::MemoryPool>,
    layout: super::layout::PoolLayout,
    addr: u64,
    rkey: u32,
    staging_len: usize,
}

#[derive(Debug, Default)]
struct Fabric {
    next_qp: u32,
    nets: std::collections::HashMap<u32, SimNet>,
    /// The port of every queue pair created on the fabric.
    ports: std::collections::HashMap<u32, SimPort>,
}

impl SimFabric {
    /// Receivers expose a pool of `layout` at `addr` with `rkey`; senders get `staging_len`
    /// bytes of staging memory.
    pub fn new(layout: super::layout::PoolLayout, addr: u64, rkey: u32, staging_len: usize) -> Self {
        Self { inner: Arc::default(), port: SimPort::IB, pool: None, layout, addr, rkey, staging_len }
    }

    /// Receivers expose `pool` itself (block-major, as [`crate::MemoryPool`] lays its blocks
    /// out): what lands is what a receiver actor over that pool reads.
    pub fn over_pool(pool: crate::MemoryPool, layout: &cleave_protocol::KvLayout, staging_len: usize) -> Result<Self> {
        let layout = super::layout::PoolLayout::block_major(layout, pool.total_blocks() as u32)?;
        if layout.extent()? != pool.region_len() as u64 {
            return Err(crate::error::KvTransferError::RdmaLayout {
                reason: format!("pool of {} bytes, layout of {}", pool.region_len(), layout.extent()?),
            });
        }
        Ok(Self {
            inner: Arc::default(),
            port: SimPort::IB,
            pool: Some(pool),
            layout,
            addr: 0x7f00_0000_0000,
            rkey: 0x5eed,
            staging_len,
        })
    }

    /// The same fabric, with receivers exposing `pool` from now on (a receiver restarted with a
    /// new pool; senders of the fabric still find its queue pairs).
    pub fn with_pool(&self, pool: crate::MemoryPool) -> Result<Self> {
        if pool.region_len() as u64 != self.layout.extent()? {
            return Err(crate::error::KvTransferError::RdmaLayout {
                reason: format!("pool of {} bytes, layout of {}", pool.region_len(), self.layout.extent()?),
            });
        }
        Ok(Self { pool: Some(pool), ..self.clone() })
    }

    /// The same fabric seen from a node whose queue pairs live on `port` (two nodes of a test
    /// each take their own).
    pub fn on_port(&self, port: SimPort) -> Self {
        Self { port, ..self.clone() }
    }

    /// The connection of the receiving queue pair `qp_num` (for faults and inspection).
    pub fn net(&self, qp_num: u32) -> Option<SimNet> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).nets.get(&qp_num).cloned()
    }

    fn metadata(&self, qp_num: u32, region: Option<super::plan::RemoteRegion>) -> super::meta::QpMetadata {
        super::meta::QpMetadata {
            qp_num,
            lid: self.port.lid,
            gid: self.port.gid.unwrap_or([0; 16]),
            psn: qp_num & 0xFF_FFFF,
            mtu: super::meta::PathMtu::Mtu4096,
            max_write_bytes: 1 << 20,
            region,
        }
    }

    fn new_qp(&self) -> u32 {
        let mut f = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f.next_qp += 1;
        let qp = f.next_qp;
        f.ports.insert(qp, self.port);
        qp
    }

    /// Connecting to the side that sent `remote`: its address vector must reach the port its
    /// queue pair is on (a device's RTR would succeed and every write then time out; failing
    /// at connect says the same sooner).
    fn route(&self, remote: &super::meta::QpMetadata) -> Result<()> {
        let unreachable = |message: String| crate::error::KvTransferError::RdmaVerbs {
            call: "sim connect",
            errno: 113, // EHOSTUNREACH
            message,
        };
        let peer = self.inner.lock().unwrap_or_else(|p| p.into_inner()).ports.get(&remote.qp_num).copied();
        let peer = peer.ok_or_else(|| unreachable(format!("no queue pair {} on this fabric", remote.qp_num)))?;
        // The sim's port has its GID at index 0 of its table, when it has one.
        let av = super::meta::AddressVector::towards(remote, self.port.gid.map(|_| 0));
        match av.global {
            Some(_) if self.port.gid.is_none() => {
                Err(unreachable("a global route from a port without a GID (no source GID index)".into()))
            }
            Some(g) if Some(g.dgid) != peer.gid => Err(unreachable(format!(
                "GID {:02x?} is not the GID of queue pair {}'s port ({:02x?})",
                g.dgid, remote.qp_num, peer.gid
            ))),
            Some(_) => Ok(()),
            None if peer.lid == 0 || av.dlid != peer.lid => Err(unreachable(format!(
                "LID {} does not reach queue pair {} (its port has LID {}{})",
                av.dlid,
                remote.qp_num,
                peer.lid,
                if peer.lid == 0 { ": RoCE, reachable by GID only" } else { "" }
            ))),
            None => Ok(()),
        }
    }
}

impl super::setup::Provider for SimFabric {
    type PendingSend = ();
    type Send = SimSender;
    type PendingRecv = SimNet;
    type Recv = SimReceiver;

    fn create_send(&self) -> Result<((), super::meta::QpMetadata)> {
        Ok(((), self.metadata(self.new_qp(), None)))
    }

    fn connect_send(&self, _: (), remote: &super::meta::QpMetadata) -> Result<SimSender> {
        self.route(remote)?;
        let net = self.net(remote.qp_num).ok_or_else(|| crate::error::KvTransferError::RdmaMetadata {
            reason: format!("no queue pair {} on this fabric", remote.qp_num),
        })?;
        Ok(net.sender(self.staging_len))
    }

    fn create_recv(&self) -> Result<(SimNet, super::meta::QpMetadata)> {
        let len = self.layout.extent()?;
        let qp = self.new_qp();
        let net = match &self.pool {
            Some(pool) => SimNet::over_pool(self.addr, pool.clone(), self.rkey),
            None => SimNet::new(self.addr, len as usize, self.rkey),
        };
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).nets.insert(qp, net.clone());
        let region = super::plan::RemoteRegion { addr: self.addr, len, rkey: self.rkey, layout: self.layout };
        Ok((net, self.metadata(qp, Some(region))))
    }

    fn connect_recv(&self, net: SimNet, remote: &super::meta::QpMetadata) -> Result<SimReceiver> {
        self.route(remote)?;
        Ok(net.receiver())
    }
}
