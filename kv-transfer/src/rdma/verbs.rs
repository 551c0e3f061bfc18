//! A small safe wrapper over the libibverbs calls the RDMA transport needs (through `rdma-sys`):
//! device list and open, protection domain, memory region, completion queue, reliable-connected
//! queue pair with its INIT -> RTR -> RTS transitions, RDMA WRITE (WITH IMMEDIATE) posting,
//! zero-length receives for immediates, completion polling.
//!
//! Every object frees its verbs resource on `Drop` and holds an `Arc` of what it was created
//! from, so a queue pair can never outlive its protection domain, completion queues or device
//! context. Errors name the call and carry the errno.
//!
//! Thread safety: libibverbs objects may be used from several threads (the library locks
//! internally), so the wrappers are `Send + Sync`.

use std::ffi::CStr;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys::*;

use super::completion::{RecvCompletion, SendCompletion, WcStatus};
use super::meta::{AddressVector, PathMtu, QpMetadata};
use super::plan::{RdmaWrite, RemoteRegion};
use crate::error::{KvTransferError, Result};

fn last_os_error(call: &'static str) -> KvTransferError {
    let e = std::io::Error::last_os_error();
    KvTransferError::RdmaVerbs { call, errno: e.raw_os_error().unwrap_or(0), message: e.to_string() }
}

/// For calls that return the errno (`ibv_modify_qp`, `ibv_post_send`, ...) instead of setting it.
fn check_ret(call: &'static str, ret: i32) -> Result<()> {
    if ret == 0 {
        return Ok(());
    }
    // Some providers return -1 and set errno instead.
    let errno = if ret < 0 { std::io::Error::last_os_error().raw_os_error().unwrap_or(0) } else { ret };
    let message = std::io::Error::from_raw_os_error(errno).to_string();
    Err(KvTransferError::RdmaVerbs { call, errno, message })
}

/// Names of the RDMA devices present (empty on a machine without one; not an error).
pub fn device_names() -> Result<Vec<String>> {
    let mut n = 0i32;
    // SAFETY: ibv_get_device_list writes the count and returns a NULL-terminated array that we
    // free with ibv_free_device_list below, after copying the names.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        // ENOSYS/no kernel support is "no devices" for our purposes.
        let e = std::io::Error::last_os_error();
        if matches!(e.raw_os_error(), Some(libc_errno::ENOSYS) | Some(libc_errno::ENODEV) | Some(0) | None) {
            return Ok(Vec::new());
        }
        return Err(last_os_error("ibv_get_device_list"));
    }
    let mut names = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: i < n entries, each a valid device pointer while the list lives.
        let name = unsafe { device_name(*list.add(i)) };
        names.push(name);
    }
    // SAFETY: list came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(list) };
    Ok(names)
}

mod libc_errno {
    pub const ENODEV: i32 = 19;
    pub const ENOSYS: i32 = 38;
}

/// # Safety
/// `dev` must be a valid device pointer from a live device list.
unsafe fn device_name(dev: *mut ibv_device) -> String {
    let p = unsafe { ibv_get_device_name(dev) };
    if p.is_null() {
        return String::from("?");
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// An open device.
pub struct Context {
    ctx: NonNull<ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts are thread-safe (see the module docs).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

/// What [`Context::port`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    pub lid: u16,
    pub active_mtu: PathMtu,
    pub active: bool,
    /// Largest message the port carries: the `max_write_bytes` to advertise.
    pub max_msg_sz: u32,
    /// An Ethernet port (RoCE): LIDs are 0 and queue pairs address each other by GID.
    pub ethernet: bool,
    /// Entries of the port's GID table.
    pub gid_table_len: u32,
}

/// `IBV_LINK_LAYER_ETHERNET` (verbs.h; not in rdma-sys's bindings).
const LINK_LAYER_ETHERNET: u8 = 2;

impl Context {
    /// Opens the device called `name`, or the first one when `None`.
    pub fn open(name: Option<&str>) -> Result<Arc<Self>> {
        let mut n = 0i32;
        // SAFETY: as in device_names; the list is freed on every path below.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(KvTransferError::RdmaNoDevice { wanted: name.unwrap_or("(any)").into(), found: String::new() });
        }
        let mut found = Vec::new();
        let mut chosen = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n.
            let dev = unsafe { *list.add(i) };
            let dev_name = unsafe { device_name(dev) };
            if chosen.is_none() && name.is_none_or(|w| w == dev_name) {
                chosen = Some((dev, dev_name.clone()));
            }
            found.push(dev_name);
        }
        let result = match chosen {
            None => {
                Err(KvTransferError::RdmaNoDevice { wanted: name.unwrap_or("(any)").into(), found: found.join(", ") })
            }
            Some((dev, dev_name)) => {
                // SAFETY: dev is valid while the list lives; the context stays valid after the
                // list is freed (libibverbs keeps a reference to the device).
                let ctx = unsafe { ibv_open_device(dev) };
                NonNull::new(ctx)
                    .map(|ctx| Arc::new(Self { ctx, name: dev_name }))
                    .ok_or_else(|| last_os_error("ibv_open_device"))
            }
        };
        // SAFETY: freed once.
        unsafe { ibv_free_device_list(list) };
        result
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn port(&self, port: u8) -> Result<PortInfo> {
        // SAFETY: zeroed is a valid ibv_port_attr; the call fills it.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        let ret = unsafe { ___ibv_query_port(self.ctx.as_ptr(), port, &mut attr) };
        check_ret("ibv_query_port", ret)?;
        let active_mtu = PathMtu::from_verbs(attr.active_mtu).ok_or(KvTransferError::RdmaVerbs {
            call: "ibv_query_port",
            errno: 0,
            message: format!("unknown active mtu code {}", attr.active_mtu),
        })?;
        Ok(PortInfo {
            lid: attr.lid,
            active_mtu,
            active: attr.state == ibv_port_state::IBV_PORT_ACTIVE,
            max_msg_sz: attr.max_msg_sz,
            ethernet: attr.link_layer == LINK_LAYER_ETHERNET,
            gid_table_len: attr.gid_tbl_len.max(0) as u32,
        })
    }

    /// The GID at `index` of `port`, in network byte order.
    pub fn gid(&self, port: u8, index: u8) -> Result<[u8; 16]> {
        // SAFETY: zeroed is a valid ibv_gid; the call fills it.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        let ret = unsafe { ibv_query_gid(self.ctx.as_ptr(), port, index as i32, &mut gid) };
        check_ret("ibv_query_gid", ret)?;
        // SAFETY: every bit pattern is a valid [u8; 16].
        Ok(unsafe { gid.raw })
    }

    /// Whether the GID at `index` of `port` is a RoCE v2 one (routable UDP/IP), as the kernel
    /// reports it in sysfs (`ibv_query_gid_type` is missing from older libibverbs and from
    /// rdma-sys's bindings; NCCL reads the same file). `None` when the file is absent.
    pub fn gid_is_roce_v2(&self, port: u8, index: u8) -> Option<bool> {
        let path = format!("/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{index}", self.name);
        std::fs::read_to_string(path).ok().map(|t| t.trim().eq_ignore_ascii_case("RoCE v2"))
    }

    /// The GID index a queue pair on `port` uses when none is configured: `None` on an
    /// InfiniBand port (LID routing), and on an Ethernet (RoCE) port the first RoCE v2 GID,
    /// IPv4-mapped ones (`::ffff:a.b.c.d`, routable across subnets) first, else its first
    /// nonzero GID. A RoCE port without any GID is an error: no queue pair could connect.
    pub fn default_gid_index(&self, port: u8) -> Result<Option<u8>> {
        let info = self.port(port)?;
        if !info.ethernet {
            return Ok(None);
        }
        let mut gids = Vec::new();
        for i in 0..info.gid_table_len.min(256) {
            let i = i as u8;
            match self.gid(port, i) {
                Ok(g) if g != [0; 16] => gids.push((i, g, self.gid_is_roce_v2(port, i))),
                _ => {}
            }
        }
        let v4_mapped = |g: &[u8; 16]| g[..10] == [0; 10] && g[10..12] == [0xff, 0xff];
        let pick = gids
            .iter()
            .find(|(_, g, v2)| *v2 == Some(true) && v4_mapped(g))
            .or_else(|| gids.iter().find(|(_, _, v2)| *v2 == Some(true)))
            .or_else(|| gids.first());
        match pick {
            Some((i, _, _)) => Ok(Some(*i)),
            None => Err(KvTransferError::RdmaMetadata {
                reason: format!("port {port} of {} is RoCE but has no GID: give it an address", self.name),
            }),
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object created from this context holds an Arc of it, so none is alive.
        let ret = unsafe { ibv_close_device(self.ctx.as_ptr()) };
        if ret != 0 {
            tracing::warn!(device = %self.name, ret, "ibv_close_device failed");
        }
    }
}

/// A protection domain.
pub struct ProtectionDomain {
    pd: NonNull<ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: see the module docs.
unsafe impl Send for ProtectionDomain {}
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Self>> {
        // SAFETY: the context is open.
        let pd = unsafe { ibv_alloc_pd(ctx.ctx.as_ptr()) };
        NonNull::new(pd).map(|pd| Arc::new(Self { pd, ctx: ctx.clone() })).ok_or_else(|| last_os_error("ibv_alloc_pd"))
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: regions and queue pairs hold an Arc of the domain, so none is alive.
        let ret = unsafe { ibv_dealloc_pd(self.pd.as_ptr()) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_dealloc_pd failed");
        }
    }
}

/// Access a memory region grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Source of RDMA writes (sender staging buffers).
    LocalOnly,
    /// Target of remote RDMA writes (the receiver's KV pool).
    RemoteWrite,
}

/// A registered memory region. Does not own the memory: see [`MemoryRegion::register_raw`]
/// ([`MemoryRegion::register_pool`] keeps its pool alive instead).
pub struct MemoryRegion {
    mr: NonNull<ibv_mr>,
    addr: u64,
    len: u64,
    _pd: Arc<ProtectionDomain>,
    /// What owns the memory, when the region keeps it alive; dropped after deregistration
    /// (`Drop::drop` runs before the fields are dropped).
    _owner: Option<crate::MemoryPool>,
}

// SAFETY: see the module docs.
unsafe impl Send for MemoryRegion {}
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` (the decode node's KV pool is registered once, whole).
    ///
    /// # Safety
    /// The memory must stay allocated (and not be moved) until the region is dropped, and, with
    /// [`Access::RemoteWrite`], the owner must accept that the peer writes into it while the
    /// region and a connected queue pair exist.
    pub unsafe fn register_raw(pd: &Arc<ProtectionDomain>, addr: *mut u8, len: usize, access: Access) -> Result<Self> {
        let flags = match access {
            Access::LocalOnly => ibv_access_flags::IBV_ACCESS_LOCAL_WRITE,
            Access::RemoteWrite => ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE,
        };
        // SAFETY: the caller guarantees the range; the domain is live.
        let mr = unsafe { ibv_reg_mr(pd.pd.as_ptr(), addr.cast(), len, flags.0 as i32) };
        NonNull::new(mr)
            .map(|mr| Self { mr, addr: addr as u64, len: len as u64, _pd: pd.clone(), _owner: None })
            .ok_or_else(|| last_os_error("ibv_reg_mr"))
    }

    /// Registers `pool`'s whole memory for remote writes (a receiver's pool, registered once)
    /// and keeps the pool alive while the region exists.
    ///
    /// Peers then write into the pool without its lock, which is what one-sided writes are:
    /// the receiver reads a lease's blocks ([`crate::KvSink::landed_checksum`], `gather`) only
    /// after the lease's last immediate arrived, and frees them only once no write of the lease
    /// can land (see [`super::handoff`]), so no byte is read while the NIC writes it unless a
    /// peer breaks the protocol, and then the checksum fails.
    pub fn register_pool(pd: &Arc<ProtectionDomain>, pool: &crate::MemoryPool) -> Result<Self> {
        let (addr, len) = pool.raw_region();
        // SAFETY: the pool's buffer is allocated once, never resized or moved, and freed only
        // when the last clone of the pool is dropped; the region holds a clone until after it
        // is deregistered.
        let mut mr = unsafe { Self::register_raw(pd, addr, len, Access::RemoteWrite)? };
        mr._owner = Some(pool.clone());
        Ok(mr)
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: the region is registered.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: the region is registered.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once.
        let ret = unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_dereg_mr failed");
        }
    }
}

/// A heap buffer registered for its whole life (tests, sender staging buffers).
pub struct OwnedRegion {
    // Declared first so it is dropped (deregistered) before the buffer is freed.
    mr: MemoryRegion,
    buf: Box<[u8]>,
}

impl OwnedRegion {
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize, access: Access) -> Result<Self> {
        let mut buf = vec![0u8; len.max(1)].into_boxed_slice();
        // SAFETY: the box lives in self beside the region and is dropped after it; a boxed
        // slice's heap storage does not move when the box does.
        let mr = unsafe { MemoryRegion::register_raw(pd, buf.as_mut_ptr(), len.max(1), access)? };
        Ok(Self { mr, buf })
    }

    pub fn region(&self) -> &MemoryRegion {
        &self.mr
    }

    /// Reading while a peer may write is a data race at the byte level only (no UB for u8 in
    /// practice, but the values may be torn); read after the write's completion.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

/// A completion queue.
pub struct CompletionQueue {
    cq: NonNull<ibv_cq>,
    _ctx: Arc<Context>,
}

// SAFETY: see the module docs.
unsafe impl Send for CompletionQueue {}
unsafe impl Sync for CompletionQueue {}

/// One polled work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Host-order immediate, when the completion carried one.
    pub imm: Option<u32>,
    pub qp_num: u32,
}

impl WorkCompletion {
    pub fn to_send(self) -> SendCompletion {
        SendCompletion { wr_id: self.wr_id, status: self.status, vendor_err: self.vendor_err }
    }

    pub fn to_recv(self) -> RecvCompletion {
        RecvCompletion { status: self.status, imm: self.imm }
    }
}

impl CompletionQueue {
    pub fn new(ctx: &Arc<Context>, depth: u32) -> Result<Arc<Self>> {
        let depth = i32::try_from(depth).unwrap_or(i32::MAX);
        // SAFETY: no channel, no context pointer; the device context is open.
        let cq = unsafe { ibv_create_cq(ctx.ctx.as_ptr(), depth, ptr::null_mut(), ptr::null_mut(), 0) };
        NonNull::new(cq)
            .map(|cq| Arc::new(Self { cq, _ctx: ctx.clone() }))
            .ok_or_else(|| last_os_error("ibv_create_cq"))
    }

    /// Polls up to `max` completions without blocking; appends them to `out`.
    pub fn poll(&self, max: usize, out: &mut Vec<WorkCompletion>) -> Result<usize> {
        const BATCH: usize = 32;
        // SAFETY: ibv_wc is plain data; zeroed is valid and the call overwrites what it returns.
        let mut wcs: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        let want = max.min(BATCH) as i32;
        let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), want, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(KvTransferError::RdmaVerbs { call: "ibv_poll_cq", errno: -n, message: "poll failed".into() });
        }
        for wc in &wcs[..n as usize] {
            let with_imm = wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            out.push(WorkCompletion {
                wr_id: wc.wr_id,
                status: WcStatus::from_verbs(wc.status),
                vendor_err: wc.vendor_err,
                byte_len: wc.byte_len,
                // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate (network order).
                imm: with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
                qp_num: wc.qp_num,
            });
        }
        Ok(n as usize)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: queue pairs hold an Arc of their queues, so none is alive.
        let ret = unsafe { ibv_destroy_cq(self.cq.as_ptr()) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_destroy_cq failed");
        }
    }
}

/// Sizes and link parameters of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpConfig {
    pub port: u8,
    /// GID table index for RoCE (routed by GID); `None` on InfiniBand (routed by LID).
    pub gid_index: Option<u8>,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    /// Ack timeout exponent (4.096 us * 2^timeout) and retries before IBV_WC_RETRY_EXC_ERR.
    pub timeout: u8,
    pub retry_cnt: u8,
    /// Retries when the receiver has no receive posted (7 = infinite; we use a finite count so
    /// a missing receive surfaces as IBV_WC_RNR_RETRY_EXC_ERR).
    pub rnr_retry: u8,
}

impl Default for QpConfig {
    fn default() -> Self {
        Self { port: 1, gid_index: None, max_send_wr: 1024, max_recv_wr: 1024, timeout: 14, retry_cnt: 7, rnr_retry: 6 }
    }
}

impl QpConfig {
    /// Queue pairs on `port` of `ctx` using the GID at `gid_index`, or when `None` the port's
    /// default ([`Context::default_gid_index`]: none on InfiniBand, a RoCE v2 GID on Ethernet).
    /// Checked here, at start: the port exists and is active, and the chosen GID is not empty.
    pub fn for_port(ctx: &Context, port: u8, gid_index: Option<u8>) -> Result<Self> {
        let info = ctx.port(port)?;
        if !info.active {
            tracing::warn!(device = ctx.name(), port, "rdma port is not active; queue pairs will not connect");
        }
        let gid_index = match gid_index {
            Some(i) => Some(i),
            None => ctx.default_gid_index(port)?,
        };
        if let Some(i) = gid_index {
            if ctx.gid(port, i)? == [0; 16] {
                return Err(KvTransferError::RdmaMetadata {
                    reason: format!("GID index {i} of port {port} of {} is empty", ctx.name()),
                });
            }
        }
        Ok(Self { port, gid_index, ..Self::default() })
    }
}

/// A reliable-connected queue pair.
pub struct QueuePair {
    qp: NonNull<ibv_qp>,
    cfg: QpConfig,
    _pd: Arc<ProtectionDomain>,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
}

// SAFETY: see the module docs.
unsafe impl Send for QueuePair {}
unsafe impl Sync for QueuePair {}

impl QueuePair {
    pub fn new_rc(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        cfg: QpConfig,
    ) -> Result<Self> {
        // SAFETY: zeroed is a valid ibv_qp_init_attr (null pointers, zero sizes).
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq.as_ptr();
        init.recv_cq = recv_cq.cq.as_ptr();
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = cfg.max_send_wr;
        init.cap.max_recv_wr = cfg.max_recv_wr;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.sq_sig_all = 0;
        // SAFETY: the domain and queues are live.
        let qp = unsafe { ibv_create_qp(pd.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| last_os_error("ibv_create_qp"))?;
        Ok(Self { qp, cfg, _pd: pd.clone(), _send_cq: send_cq.clone(), _recv_cq: recv_cq.clone() })
    }

    pub fn qp_num(&self) -> u32 {
        // SAFETY: the queue pair is live.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    /// What to send the peer: this queue pair's address, `psn`, and the receiver's `region`.
    pub fn local_metadata(&self, psn: u32, max_write_bytes: u32, region: Option<RemoteRegion>) -> Result<QpMetadata> {
        let ctx = &self._pd.ctx;
        let port = ctx.port(self.cfg.port)?;
        let gid = match self.cfg.gid_index {
            Some(i) => ctx.gid(self.cfg.port, i)?,
            None => [0; 16],
        };
        let m = QpMetadata {
            qp_num: self.qp_num(),
            lid: port.lid,
            gid,
            psn,
            mtu: port.active_mtu,
            max_write_bytes,
            region,
        };
        m.validate()?;
        Ok(m)
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, call: &'static str) -> Result<()> {
        // SAFETY: attr is initialised for every field the mask names.
        let ret = unsafe { ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as i32) };
        check_ret(call, ret)
    }

    /// RESET -> INIT, allowing remote writes (the receiver's side needs it; harmless on the
    /// sender's).
    pub fn to_init(&self) -> Result<()> {
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = self.cfg.port;
        a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE).0;
        use ibv_qp_attr_mask as m;
        self.modify(
            &mut a,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )
    }

    /// INIT -> RTR (ready to receive) towards `remote`.
    pub fn to_rtr(&self, remote: &QpMetadata) -> Result<()> {
        let local = self._pd.ctx.port(self.cfg.port)?;
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = local.active_mtu.min(remote.mtu) as u32;
        a.dest_qp_num = remote.qp_num;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        let av = AddressVector::towards(remote, self.cfg.gid_index);
        a.ah_attr.dlid = av.dlid;
        a.ah_attr.port_num = self.cfg.port;
        if let Some(g) = av.global {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = g.dgid;
            a.ah_attr.grh.sgid_index = g.sgid_index;
            a.ah_attr.grh.hop_limit = g.hop_limit;
        }
        use ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_AV
            | m::IBV_QP_PATH_MTU
            | m::IBV_QP_DEST_QPN
            | m::IBV_QP_RQ_PSN
            | m::IBV_QP_MAX_DEST_RD_ATOMIC
            | m::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut a, mask, "ibv_modify_qp(RTR)")
    }

    /// RTR -> RTS (ready to send) starting at `psn`, the value this side sent the peer.
    pub fn to_rts(&self, psn: u32) -> Result<()> {
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = psn;
        a.timeout = self.cfg.timeout;
        a.retry_cnt = self.cfg.retry_cnt;
        a.rnr_retry = self.cfg.rnr_retry;
        a.max_rd_atomic = 1;
        use ibv_qp_attr_mask as m;
        let mask = m::IBV_QP_STATE
            | m::IBV_QP_SQ_PSN
            | m::IBV_QP_TIMEOUT
            | m::IBV_QP_RETRY_CNT
            | m::IBV_QP_RNR_RETRY
            | m::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut a, mask, "ibv_modify_qp(RTS)")
    }

    /// INIT, RTR and RTS in one go.
    pub fn connect(&self, local_psn: u32, remote: &QpMetadata) -> Result<()> {
        self.to_init()?;
        self.to_rtr(remote)?;
        self.to_rts(local_psn)
    }

    /// Moves the queue pair to the error state: every posted request is flushed and the peer's
    /// further writes fail. The receiver does this before freeing the blocks of a failed lease
    /// that the sender might still write.
    pub fn to_error(&self) -> Result<()> {
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ibv_modify_qp(ERR)")
    }

    /// Posts `writes` (one plan from [`super::plan_chunk`], ids from
    /// [`super::SendTracker::post`]) from `src`, whose byte `src_base` holds source offset 0.
    ///
    /// Checked before posting: lengths match and every source range lies in `src`. If the
    /// provider refuses a request midway, the error says how many were posted; treat that as a
    /// broken queue pair (move it to the error state so the posted ones complete as flushed).
    pub fn post_writes(
        &self,
        src: &MemoryRegion,
        src_base: u64,
        rkey: u32,
        writes: &[RdmaWrite],
        wr_ids: &[u64],
    ) -> Result<()> {
        if writes.len() != wr_ids.len() {
            return Err(KvTransferError::RdmaPlan {
                reason: format!("{} writes but {} wr_ids", writes.len(), wr_ids.len()),
            });
        }
        for w in writes {
            let end = src_base.checked_add(w.src_offset).and_then(|s| s.checked_add(w.len as u64));
            if end.is_none_or(|e| e > src.len()) {
                return Err(KvTransferError::RdmaPlan {
                    reason: format!(
                        "source {}+{}+{} outside the {}-byte local region",
                        src_base,
                        w.src_offset,
                        w.len,
                        src.len()
                    ),
                });
            }
        }
        if writes.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ibv_sge> = writes
            .iter()
            .map(|w| ibv_sge { addr: src.addr() + src_base + w.src_offset, length: w.len, lkey: src.lkey() })
            .collect();
        // SAFETY: zeroed is a valid ibv_send_wr (null links, zero flags).
        let mut wrs: Vec<ibv_send_wr> = (0..writes.len()).map(|_| unsafe { std::mem::zeroed() }).collect();
        for (i, w) in writes.iter().enumerate() {
            let wr = &mut wrs[i];
            wr.wr_id = wr_ids[i];
            wr.sg_list = &mut sges[i];
            wr.num_sge = 1;
            wr.wr.rdma = rdma_t { remote_addr: w.remote_addr, rkey };
            match w.imm {
                Some(imm) => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                    wr.imm_data_invalidated_rkey_union.imm_data = imm.encode().to_be();
                }
                None => wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            }
            if w.signaled {
                wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
        }
        for i in 0..wrs.len() - 1 {
            let next: *mut ibv_send_wr = &mut wrs[i + 1];
            wrs[i].next = next;
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: the chain and its sges live until the call returns (verbs copies them).
        let ret = unsafe { ibv_post_send(self.qp.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        if ret != 0 {
            let posted = if bad.is_null() {
                0
            } else {
                (bad as usize - wrs.as_ptr() as usize) / std::mem::size_of::<ibv_send_wr>()
            };
            let call = "ibv_post_send";
            return check_ret(call, ret).map_err(|e| match e {
                KvTransferError::RdmaVerbs { call, errno, message } => KvTransferError::RdmaVerbs {
                    call,
                    errno,
                    message: format!("{message}; {posted} of {} posted", writes.len()),
                },
                other => other,
            });
        }
        Ok(())
    }

    /// Posts zero-length receives, one per expected immediate.
    pub fn post_recvs(&self, wr_ids: &[u64]) -> Result<()> {
        if wr_ids.is_empty() {
            return Ok(());
        }
        // SAFETY: zeroed is a valid ibv_recv_wr (no scatter entries: an immediate needs none).
        let mut wrs: Vec<ibv_recv_wr> = wr_ids.iter().map(|_| unsafe { std::mem::zeroed() }).collect();
        for (wr, id) in wrs.iter_mut().zip(wr_ids) {
            wr.wr_id = *id;
        }
        for i in 0..wrs.len() - 1 {
            let next: *mut ibv_recv_wr = &mut wrs[i + 1];
            wrs[i].next = next;
        }
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: the chain lives until the call returns.
        let ret = unsafe { ibv_post_recv(self.qp.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        check_ret("ibv_post_recv", ret)
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once; the queues and domain outlive it (Arcs).
        let ret = unsafe { ibv_destroy_qp(self.qp.as_ptr()) };
        if ret != 0 {
            tracing::warn!(ret, "ibv_destroy_qp failed");
        }
    }
}

/// The sending end of a link on a device: a connected queue pair, its send completion queue
/// and a registered staging buffer.
pub struct VerbsSender {
    pub qp: QueuePair,
    pub cq: Arc<CompletionQueue>,
    pub staging: OwnedRegion,
}

impl super::link::SendOps for VerbsSender {
    fn staging(&mut self) -> &mut [u8] {
        self.staging.bytes_mut()
    }

    fn post_writes(&mut self, src_base: u64, rkey: u32, writes: &[RdmaWrite], wr_ids: &[u64]) -> Result<()> {
        self.qp.post_writes(self.staging.region(), src_base, rkey, writes, wr_ids)
    }

    fn poll_send(&mut self, out: &mut Vec<SendCompletion>) -> Result<()> {
        let mut wcs = Vec::new();
        while self.cq.poll(32, &mut wcs)? == 32 {}
        out.extend(wcs.into_iter().map(WorkCompletion::to_send));
        Ok(())
    }
}

/// The receiving end of a link on a device: a connected queue pair and its receive completion
/// queue (the pool's [`MemoryRegion`] lives with the pool).
pub struct VerbsReceiver {
    pub qp: QueuePair,
    pub cq: Arc<CompletionQueue>,
    next_recv_id: u64,
}

impl VerbsReceiver {
    pub fn new(qp: QueuePair, cq: Arc<CompletionQueue>) -> Self {
        Self { qp, cq, next_recv_id: 0 }
    }
}

impl super::link::RecvOps for VerbsReceiver {
    fn post_recvs(&mut self, count: u32) -> Result<()> {
        let ids: Vec<u64> = (0..count as u64).map(|i| self.next_recv_id + i).collect();
        self.next_recv_id += count as u64;
        self.qp.post_recvs(&ids)
    }

    fn poll_recv(&mut self, out: &mut Vec<RecvCompletion>) -> Result<()> {
        let mut wcs = Vec::new();
        while self.cq.poll(32, &mut wcs)? == 32 {}
        out.extend(wcs.into_iter().map(WorkCompletion::to_recv));
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        self.qp.to_error()
    }
}

/// A [`super::setup::Provider`] on a device: queue pairs on one protection domain, each with its
/// own completion queue. Receivers expose `pool` (the KV pool, registered once, whole) with its
/// layout; each sender registers its own staging buffer of `staging_len` bytes.
pub struct VerbsProvider {
    pub pd: Arc<ProtectionDomain>,
    pub qp: QpConfig,
    pub cq_depth: u32,
    /// The receiving side's registered pool; `None` on a node that only sends.
    pub pool: Option<(Arc<MemoryRegion>, super::layout::PoolLayout)>,
    pub staging_len: usize,
    pub max_write_bytes: u32,
}

/// A created, not yet connected queue pair.
pub struct PendingQp {
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    psn: u32,
    staging: Option<OwnedRegion>,
}

impl VerbsProvider {
    fn create(&self, staging: bool) -> Result<PendingQp> {
        let cq = CompletionQueue::new(self.pd.context(), self.cq_depth)?;
        let qp = QueuePair::new_rc(&self.pd, &cq, &cq, self.qp)?;
        let staging =
            if staging { Some(OwnedRegion::new(&self.pd, self.staging_len, Access::LocalOnly)?) } else { None };
        // A random initial packet sequence number, so a stale packet of an earlier queue pair
        // with the same number is not taken for this one's.
        let mut psn = [0u8; 4];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut psn)
            .map_err(|_| KvTransferError::RdmaMetadata { reason: "no randomness for the psn".into() })?;
        Ok(PendingQp { qp, cq, psn: u32::from_le_bytes(psn) & 0xFF_FFFF, staging })
    }
}

impl super::setup::Provider for VerbsProvider {
    type PendingSend = PendingQp;
    type Send = VerbsSender;
    type PendingRecv = PendingQp;
    type Recv = VerbsReceiver;

    fn create_send(&self) -> Result<(PendingQp, QpMetadata)> {
        let p = self.create(true)?;
        let m = p.qp.local_metadata(p.psn, self.max_write_bytes, None)?;
        Ok((p, m))
    }

    fn connect_send(&self, p: PendingQp, remote: &QpMetadata) -> Result<VerbsSender> {
        p.qp.connect(p.psn, remote)?;
        let staging = p.staging.ok_or_else(|| KvTransferError::RdmaPlan { reason: "sender without staging".into() })?;
        Ok(VerbsSender { qp: p.qp, cq: p.cq, staging })
    }

    fn create_recv(&self) -> Result<(PendingQp, QpMetadata)> {
        let (mr, layout) = self.pool.as_ref().ok_or_else(|| KvTransferError::RdmaPlan {
            reason: "this node registered no KV pool: it cannot receive over RDMA".into(),
        })?;
        let region = RemoteRegion { addr: mr.addr(), len: mr.len(), rkey: mr.rkey(), layout: *layout };
        region.validate()?;
        let p = self.create(false)?;
        let m = p.qp.local_metadata(p.psn, self.max_write_bytes, Some(region))?;
        Ok((p, m))
    }

    fn connect_recv(&self, p: PendingQp, remote: &QpMetadata) -> Result<VerbsReceiver> {
        p.qp.connect(p.psn, remote)?;
        Ok(VerbsReceiver::new(p.qp, p.cq))
    }
}
