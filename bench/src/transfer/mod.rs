//! `cleave bench transfer`: moves the KV cache of real model shapes over every transport on
//! loopback and prints the throughput beside the limits measured in the same run (STYLE 12):
//! - **memcpy**: one thread copying the request's bytes between two warm buffers;
//! - **AES-128-GCM**: sealing then opening the request in 64 KiB records on one thread (the
//!   crypto work of an encrypted transport, both sides together);
//! - **raw TCP**: plain tokio `TcpStream`s, the whole request in one `write_all`, read into a
//!   warm buffer, a 1-byte ack back; once over one long-lived connection (before the stream rows)
//!   and once with a connection per request (after them); "% raw" is against the faster.
//!
//! Stream rows go through [`Connector`]/[`Listener`] exactly as a handoff does: per request, open
//! `streams` streams, spread the layers over them (layer `l` on stream `l % streams`), write each
//! layer as one `write_all`, shut down; the receiver reads each stream into a warm buffer to EOF
//! and answers a 1-byte ack. Time runs from the first `open` to the last ack, so connection
//! reuse (QUIC) and per-request connects (TCP) are both inside the number.
//!
//! Handoff rows ([`crate::transfer::handoff`]) run the real protocol into a block pool.
//!
//! A row's time is the median of `repeats` requests after one warm-up request. Throughput is
//! payload bytes over that time. The p99 and worst columns are over every timed request of
//! every round: the tail a median hides.

pub mod handoff;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_protocol::TransportKind;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::{BenchError, Result};
use cleave_net::tls::NodeIdentity;
use cleave_net::{Connector, Listener, NetConfig, NetKind, QuicTuning};

/// Model shape and what to measure.
#[derive(Debug, Clone)]
pub struct TransferBenchConfig {
    /// Prompt lengths in tokens.
    pub prompts: Vec<usize>,
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Bytes per element (bf16: 2).
    pub dtype_bytes: usize,
    /// Timed requests per row (after one warm-up).
    pub repeats: usize,
    /// Stream counts to run each transport with (one row each).
    pub streams: Vec<usize>,
    pub kinds: Vec<NetKind>,
    /// QUIC tunings to run, each with a label (one row per tuning and stream count).
    pub quic_tunings: Vec<(String, QuicTuning)>,
    /// Runtime worker threads (default: available cores).
    pub threads: Option<usize>,
    /// Also run real handoffs (sender -> receiver into a block pool) over each transport and
    /// in-process ([`crate::transfer::handoff`]).
    pub handoffs: bool,
    /// Times the whole set of rows is run. On a shared machine a burst of other load slows
    /// whichever rows run during it; with several rounds each row's figure is the median of its
    /// per-round medians and its share of raw TCP the median of the per-round shares, so one
    /// burst moves neither.
    pub rounds: usize,
    /// Run the receiving side on the sender's runtime instead of its own. By default every
    /// receiver (raw TCP's included) has its own runtime with its own worker threads, as it
    /// would on its own node; on one shared two-worker runtime the two ends' tasks compete for
    /// the same workers and a row swings between two speeds (measured: 90 or 200 ms for the same
    /// 256 MiB over QUIC).
    pub shared_runtime: bool,
}

impl Default for TransferBenchConfig {
    /// Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16 (128 KiB of K+V per token).
    fn default() -> Self {
        Self {
            prompts: vec![512, 2048, 8192],
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            repeats: 5,
            streams: vec![1, 4],
            kinds: NetKind::ALL.to_vec(),
            quic_tunings: vec![("tuned".into(), QuicTuning::default())],
            threads: None,
            handoffs: true,
            rounds: 1,
            shared_runtime: false,
        }
    }
}

impl TransferBenchConfig {
    /// Bytes of K and V for one token across all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes
    }
}

/// One measured row.
#[derive(Debug, Clone)]
pub struct Measurement {
    pub label: String,
    pub tokens: usize,
    pub bytes: u64,
    /// Median seconds per request.
    pub median_s: f64,
    /// Fastest request.
    pub best_s: f64,
    /// Every timed request's seconds (all rounds), for the tail: a transfer ten times slower
    /// than the median now and then hides behind a median.
    pub times_s: Vec<f64>,
    /// Throughput as a share of the faster raw-TCP row of the same prompt and round (median
    /// over rounds); set by [`run`].
    pub raw_share: Option<f64>,
    /// CPU seconds per request, every thread of the process (both ends of the transfer) over
    /// the timed requests. Unlike wall time it does not grow when other processes take the
    /// cores, so it shows what each path costs even on a busy machine.
    pub cpu_s: Option<f64>,
}

impl Measurement {
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.median_s / 1e9
    }

    /// The `q` quantile (0..=1, nearest rank) of the timed requests' seconds.
    pub fn quantile_s(&self, q: f64) -> f64 {
        let mut v = self.times_s.clone();
        v.sort_by(f64::total_cmp);
        v.get(((v.len().max(1) - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize).copied().unwrap_or(f64::NAN)
    }

    pub(crate) fn from_times(label: String, tokens: usize, bytes: u64, times: Vec<f64>) -> Self {
        let best_s = times.iter().copied().fold(f64::INFINITY, f64::min);
        Self {
            label,
            tokens,
            bytes,
            median_s: median(times.clone()),
            best_s,
            times_s: times,
            raw_share: None,
            cpu_s: None,
        }
    }

    /// Sets [`Measurement::cpu_s`] from the process CPU time at the first timed request.
    pub(crate) fn with_cpu(mut self, cpu_at_start: f64, requests: usize) -> Self {
        self.cpu_s = Some((process_cpu_s() - cpu_at_start) / requests.max(1) as f64);
        self
    }
}

/// CPU time of the whole process (user + system, all threads), in seconds.
pub(crate) fn process_cpu_s() -> f64 {
    // SAFETY: getrusage writes one rusage struct, which we own and zero-initialise.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Sets each row's share of raw TCP within its round.
fn set_raw_shares(rows: &mut [Measurement]) {
    let mut prompts: Vec<usize> = rows.iter().map(|r| r.tokens).collect();
    prompts.dedup();
    for tokens in prompts {
        let raw = rows
            .iter()
            .filter(|r| r.tokens == tokens && r.label.starts_with("raw tcp"))
            .map(Measurement::gb_per_s)
            .reduce(f64::max);
        for r in rows.iter_mut().filter(|r| r.tokens == tokens) {
            r.raw_share = raw.map(|raw| r.gb_per_s() / raw);
        }
    }
}

/// One row per (prompt, label) from several rounds: medians of the per-round figures, the
/// fastest request overall.
fn combine(rounds: Vec<Vec<Measurement>>) -> Vec<Measurement> {
    let Some(first) = rounds.first() else { return Vec::new() };
    first
        .iter()
        .map(|r| {
            let same: Vec<&Measurement> = rounds
                .iter()
                .filter_map(|round| round.iter().find(|m| m.tokens == r.tokens && m.label == r.label))
                .collect();
            let shares: Vec<f64> = same.iter().filter_map(|m| m.raw_share).collect();
            let cpus: Vec<f64> = same.iter().filter_map(|m| m.cpu_s).collect();
            Measurement {
                label: r.label.clone(),
                tokens: r.tokens,
                bytes: r.bytes,
                median_s: median(same.iter().map(|m| m.median_s).collect()),
                best_s: same.iter().map(|m| m.best_s).fold(f64::INFINITY, f64::min),
                times_s: same.iter().flat_map(|m| m.times_s.iter().copied()).collect(),
                raw_share: (!shares.is_empty()).then(|| median(shares)),
                cpu_s: (!cpus.is_empty()).then(|| median(cpus)),
            }
        })
        .collect()
}

/// Runs every row, calling `progress` as each finishes. Builds its own tokio runtime.
pub fn run(cfg: &TransferBenchConfig, mut progress: impl FnMut(&Measurement)) -> Result<Vec<Measurement>> {
    if cfg.repeats == 0 || cfg.rounds == 0 || cfg.prompts.is_empty() || cfg.layers == 0 || cfg.streams.contains(&0) {
        return Err(BenchError::InvalidArg("repeats, rounds, prompts, layers and stream counts must be > 0".into()));
    }
    let threads = cfg.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(cleave_net::io_err("tokio runtime"))?;
    let receiver_rt = if cfg.shared_runtime {
        None
    } else {
        Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .thread_name("bench-receiver")
                .enable_all()
                .build()
                .map_err(cleave_net::io_err("tokio runtime"))?,
        )
    };
    let receiver = receiver_rt.as_ref().map_or_else(|| rt.handle().clone(), |r| r.handle().clone());
    // Everything that is timed runs in a runtime task, never on this (block_on) thread: a
    // future polled here competes with the worker threads for the cores.
    let cfg = cfg.clone();
    let result = rt.block_on(async move {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let job = tokio::spawn(async move {
            let mut rounds = Vec::with_capacity(cfg.rounds);
            for _ in 0..cfg.rounds {
                let mut rows = run_all(&cfg, &receiver, tx.clone()).await?;
                set_raw_shares(&mut rows);
                rounds.push(rows);
            }
            Ok(combine(rounds))
        });
        while let Some(m) = rx.recv().await {
            progress(&m);
        }
        job.await.map_err(|e| BenchError::Task(e.to_string()))?
    });
    if let Some(r) = receiver_rt {
        r.shutdown_background();
    }
    result
}

/// Runs `fut` on the receiving side's runtime and waits for it.
pub(crate) async fn on<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    fut: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T> {
    rt.spawn(fut).await.map_err(|e| BenchError::Task(format!("receiver task: {e}")))
}

async fn run_all(
    cfg: &TransferBenchConfig,
    rx: &tokio::runtime::Handle,
    tx: mpsc::UnboundedSender<Measurement>,
) -> Result<Vec<Measurement>> {
    {
        let ids = NodeIdentity::generate_test_cluster(&["bench-receiver", "bench-sender"])?;
        let mut rows = Vec::new();
        for &tokens in &cfg.prompts {
            let bytes = tokens * cfg.bytes_per_token();
            let payload = payload(bytes);
            let push = |rows: &mut Vec<Measurement>, m: Measurement| {
                let _ = tx.send(m.clone());
                rows.push(m);
            };
            push(&mut rows, memcpy(tokens, &payload, cfg.repeats));
            push(&mut rows, aead(tokens, &payload, cfg.repeats)?);
            push(&mut rows, raw_tcp(rx, tokens, &payload, cfg.repeats, false).await?);
            for &kind in &cfg.kinds {
                let tunings: Vec<(String, QuicTuning)> = match kind {
                    NetKind::Quic => cfg.quic_tunings.clone(),
                    _ => vec![(String::new(), QuicTuning::default())],
                };
                for (tname, tuning) in &tunings {
                    for &streams in &cfg.streams {
                        let mut label = format!("{} x{streams}", kind.name());
                        if !tname.is_empty() {
                            label.push_str(&format!(" ({tname})"));
                        }
                        let run = StreamRun { kind, tuning, streams, layers: cfg.layers, repeats: cfg.repeats };
                        push(&mut rows, run.measure(rx, label, tokens, &payload, &ids).await?);
                    }
                }
            }
            // The second raw-TCP variant after the stream rows, so a burst of other load during
            // one of them does not flatter the transports (the limit is the faster).
            push(&mut rows, raw_tcp(rx, tokens, &payload, cfg.repeats, true).await?);
            if cfg.handoffs {
                drop(payload);
                let mut kinds = vec![TransportKind::InProcess];
                kinds.extend(cfg.kinds.iter().map(|k| match k {
                    NetKind::Quic => TransportKind::Quic,
                    NetKind::TcpTls => TransportKind::TcpTls,
                    NetKind::TcpPlain => TransportKind::TcpPlain,
                }));
                for kind in kinds {
                    for &streams in &cfg.streams {
                        push(&mut rows, crate::transfer::handoff::measure(cfg, rx, kind, streams, tokens, &ids).await?);
                    }
                }
                // One control stream whatever `streams` says: the payload goes through the link.
                #[cfg(feature = "rdma")]
                push(
                    &mut rows,
                    crate::transfer::handoff::measure(cfg, rx, TransportKind::Rdma, 1, tokens, &ids).await?,
                );
            }
        }
        Ok(rows)
    }
}

/// Deterministic, non-zero payload (so no page is shared or compressible by accident).
pub(crate) fn payload(len: usize) -> Bytes {
    let mut v = vec![0u8; len];
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    for chunk in v.chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let b = s.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    Bytes::from(v)
}

fn memcpy(tokens: usize, src: &[u8], repeats: usize) -> Measurement {
    let mut dst = vec![1u8; src.len()];
    let mut times = Vec::new();
    let mut cpu0 = 0.0;
    for i in 0..=repeats {
        if i == 1 {
            cpu0 = process_cpu_s();
        }
        let t = Instant::now();
        dst.copy_from_slice(src);
        std::hint::black_box(&mut dst);
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Measurement::from_times("memcpy (limit)".into(), tokens, src.len() as u64, times).with_cpu(cpu0, repeats)
}

/// AES-128-GCM (the suite every TLS link here negotiates) sealing and then opening the request
/// in 64 KiB records on one thread: the per-byte crypto an encrypted transport does, sender and
/// receiver together. Time is seal + open, so on two cores (one per side) the encrypted ceiling
/// is up to twice this figure.
fn aead(tokens: usize, src: &[u8], repeats: usize) -> Result<Measurement> {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};
    const RECORD: usize = 64 << 10;
    let key = UnboundKey::new(&AES_128_GCM, &[7u8; 16]).map_err(|_| BenchError::Crypto("aead key"))?;
    let key = LessSafeKey::new(key);
    let nonce = |i: usize| {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&(i as u64).to_be_bytes());
        Nonce::assume_unique_for_key(n)
    };
    let mut buf = src.to_vec();
    let mut tags = Vec::with_capacity(buf.len().div_ceil(RECORD));
    let mut times = Vec::new();
    let mut cpu0 = 0.0;
    for r in 0..=repeats {
        if r == 1 {
            cpu0 = process_cpu_s();
        }
        let t = Instant::now();
        tags.clear();
        for (i, rec) in buf.chunks_mut(RECORD).enumerate() {
            let tag = key
                .seal_in_place_separate_tag(nonce(i), Aad::empty(), rec)
                .map_err(|_| BenchError::Crypto("aead seal"))?;
            tags.push(tag);
        }
        for (i, rec) in buf.chunks_mut(RECORD).enumerate() {
            key.open_in_place_separate_tag(nonce(i), Aad::empty(), tags[i], rec, 0..)
                .map_err(|_| BenchError::Crypto("aead open"))?;
        }
        if r > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(Measurement::from_times("aes-128-gcm seal+open 1 thr".into(), tokens, src.len() as u64, times)
        .with_cpu(cpu0, repeats))
}

/// Plain tokio TCP, one `write_all` of the whole request, 1-byte ack. `fresh`: a new connection
/// per request (as the TCP transports do), else one connection for all requests. Both are
/// measured because on loopback a fresh connection's small, cache-resident socket buffers can
/// beat a long-lived connection's autotuned ones; the limit is the faster.
async fn raw_tcp(
    rx: &tokio::runtime::Handle,
    tokens: usize,
    payload: &Bytes,
    repeats: usize,
    fresh: bool,
) -> Result<Measurement> {
    let io = |what: &'static str| cleave_net::io_err(format!("raw tcp {what}"));
    // Bound on the receiver's runtime, so its socket is driven by that runtime's reactor.
    let listener = on(rx, async { tokio::net::TcpListener::bind("127.0.0.1:0").await }).await?.map_err(io("bind"))?;
    let addr = listener.local_addr().map_err(io("addr"))?;
    let len = payload.len();
    let server = rx.spawn(async move {
        let mut buf = vec![1u8; len];
        let mut conn = None;
        for _ in 0..=repeats {
            if fresh || conn.is_none() {
                let (s, _) = listener.accept().await?;
                s.set_nodelay(true)?;
                conn = Some(s);
            }
            let s = conn.as_mut().expect("set above");
            s.read_exact(&mut buf).await?;
            s.write_all(&[1]).await?;
        }
        std::io::Result::Ok(())
    });
    let mut conn: Option<tokio::net::TcpStream> = None;
    let mut times = Vec::new();
    let mut ack = [0u8; 1];
    let mut cpu0 = 0.0;
    for i in 0..=repeats {
        if i == 1 {
            cpu0 = process_cpu_s();
        }
        let t = Instant::now();
        if fresh || conn.is_none() {
            let s = tokio::net::TcpStream::connect(addr).await.map_err(io("connect"))?;
            s.set_nodelay(true).map_err(io("nodelay"))?;
            conn = Some(s);
        }
        let s = conn.as_mut().expect("set above");
        s.write_all(payload).await.map_err(io("write"))?;
        s.read_exact(&mut ack).await.map_err(io("ack"))?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    server.await.map_err(|e| BenchError::Task(e.to_string()))?.map_err(io("server"))?;
    let label = if fresh { "raw tcp, conn/request" } else { "raw tcp, one conn" };
    Ok(Measurement::from_times(label.into(), tokens, len as u64, times).with_cpu(cpu0, repeats))
}

struct StreamRun<'a> {
    kind: NetKind,
    tuning: &'a QuicTuning,
    streams: usize,
    layers: usize,
    repeats: usize,
}

impl StreamRun<'_> {
    async fn measure(
        &self,
        rx: &tokio::runtime::Handle,
        label: String,
        tokens: usize,
        payload: &Bytes,
        ids: &[NodeIdentity],
    ) -> Result<Measurement> {
        let net = |id: &NodeIdentity| {
            let identity = (self.kind != NetKind::TcpPlain).then(|| id.clone());
            NetConfig { kind: self.kind, identity, connect_timeout: Duration::from_secs(10) }
        };
        let local: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
        let (rnet, tuning) = (net(&ids[0]), self.tuning.clone());
        let listener = on(rx, async move { Listener::bind_with_tuning(&rnet, local, &tuning).await }).await??;
        let addr = listener.local_addr();
        // One warm receive buffer per stream, handed out and back through a channel.
        let per_stream = payload.len().div_ceil(self.streams) + payload.len() / self.layers;
        let (buf_tx, buf_rx) = mpsc::channel(self.streams);
        for _ in 0..self.streams {
            buf_tx.send(vec![1u8; per_stream]).await.expect("capacity = streams");
        }
        let server = rx.spawn(serve(listener, buf_tx, buf_rx));
        let connector = Arc::new(Connector::with_tuning(&net(&ids[1]), self.tuning)?);
        let layer_len = payload.len() / self.layers;
        let mut times = Vec::new();
        let mut cpu0 = 0.0;
        for i in 0..=self.repeats {
            if i == 1 {
                cpu0 = process_cpu_s();
            }
            let t = Instant::now();
            let mut tasks = Vec::with_capacity(self.streams);
            for s in 0..self.streams {
                let layers: Vec<Bytes> = (s..self.layers)
                    .step_by(self.streams)
                    .map(|l| payload.slice(l * layer_len..(l + 1) * layer_len))
                    .collect();
                let connector = connector.clone();
                tasks.push(tokio::spawn(async move { send_layers(&connector, addr, layers).await }));
            }
            for task in tasks {
                task.await.map_err(|e| BenchError::Task(e.to_string()))??;
            }
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        server.abort();
        connector.close();
        Ok(Measurement::from_times(label, tokens, (layer_len * self.layers) as u64, times).with_cpu(cpu0, self.repeats))
    }
}

async fn send_layers(connector: &Connector, addr: SocketAddr, layers: Vec<Bytes>) -> Result<()> {
    let mut s = connector.open(addr).await?;
    let io = |what: &'static str| cleave_net::io_err(format!("bench stream {what} to {addr}"));
    for layer in layers {
        s.send.write_bytes(layer).await.map_err(io("write"))?;
    }
    s.send.shutdown().await.map_err(io("shutdown"))?;
    let mut ack = [0u8; 1];
    s.recv.read_exact(&mut ack).await.map_err(io("ack"))?;
    Ok(())
}

/// Accepts streams; each reads to EOF into a pooled buffer and acks with one byte.
async fn serve(mut listener: Listener, buf_tx: mpsc::Sender<Vec<u8>>, mut buf_rx: mpsc::Receiver<Vec<u8>>) {
    while let Some(Ok((mut s, _))) = listener.accept().await {
        let Some(mut buf) = buf_rx.recv().await else { return };
        let buf_tx = buf_tx.clone();
        tokio::spawn(async move {
            let mut pos = 0;
            loop {
                if pos == buf.len() {
                    break; // more than expected: stop reading, the sender sees no ack
                }
                // Each byte copied once into place: QUIC hands out its buffers, the other
                // pipes read into ours.
                let got = if s.recv.zero_copy() {
                    s.recv.read_chunk(buf.len() - pos).await.map(|c| {
                        c.map_or(0, |c| {
                            buf[pos..pos + c.len()].copy_from_slice(&c);
                            c.len()
                        })
                    })
                } else {
                    s.recv.read(&mut buf[pos..]).await
                };
                match got {
                    Ok(0) | Err(_) => break,
                    Ok(n) => pos += n,
                }
            }
            let _ = s.send.write_all(&[1]).await;
            let _ = s.send.shutdown().await;
            let _ = buf_tx.send(buf).await;
        });
    }
}

/// The result table: one block per prompt length, each row with GB/s and % of raw TCP.
pub fn render(rows: &[Measurement]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>7} {:>9}  {:<26} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "tokens", "MiB", "path", "median ms", "best ms", "p99 ms", "worst ms", "GB/s", "% raw", "core ms"
    );
    let mut prompts: Vec<usize> = rows.iter().map(|r| r.tokens).collect();
    prompts.dedup();
    for tokens in prompts {
        for r in rows.iter().filter(|r| r.tokens == tokens) {
            let pct = r.raw_share.map_or(String::from("-"), |share| format!("{:.0}%", 100.0 * share));
            let cpu = r.cpu_s.map_or(String::from("-"), |c| format!("{:.0}", c * 1e3));
            let _ = writeln!(
                out,
                "{:>7} {:>9.0}  {:<26} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8.2} {:>8} {:>8}",
                r.tokens,
                r.bytes as f64 / (1 << 20) as f64,
                r.label,
                r.median_s * 1e3,
                r.best_s * 1e3,
                r.quantile_s(0.99) * 1e3,
                r.quantile_s(1.0) * 1e3,
                r.gb_per_s(),
                pct,
                cpu
            );
        }
    }
    out
}
