//! Delay and jitter for the multi-host tests. This kernel has no `netem` qdisc, so a relay in
//! the test process stands between two hosts: it listens on an address of the root namespace
//! (on the bridge), forwards to the real target, and holds every datagram (UDP) or chunk (TCP)
//! for `base ± jitter` in each direction. A node is told to advertise the relay's address
//! (`--rpc-advertise`, `--kv-advertise`) or to reach its coordinator through one, so that every
//! packet of that link crosses the bridge twice and waits in between.
//!
//! Jitter varies the delay without reordering (a datagram or chunk never leaves before the one
//! that arrived before it in the same direction), as on most real paths and as netem does with
//! a rate limit: with reordering, QUIC (like TCP) takes out-of-order packets for lost ones and
//! collapses its window, which is a different fault. Each UDP client gets its own upstream
//! socket, so the target sees one peer per client.

use std::collections::{BinaryHeap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// One-way delay of each datagram or chunk: uniform in `[base - jitter, base + jitter]`.
#[derive(Clone, Copy, Debug)]
pub struct Delay {
    pub base: Duration,
    pub jitter: Duration,
}

impl Delay {
    pub fn new(base_ms: u64, jitter_ms: u64) -> Self {
        Delay { base: Duration::from_millis(base_ms), jitter: Duration::from_millis(jitter_ms.min(base_ms)) }
    }
}

/// Draws delays: a xorshift generator (deterministic per seed; statistical quality is not the
/// point, spread is) over the relay's current setting.
struct Draw {
    delay: watch::Receiver<Delay>,
    state: u64,
}

impl Draw {
    fn new(delay: watch::Receiver<Delay>, seed: u64) -> Self {
        Draw { delay, state: seed | 1 }
    }

    fn next(&mut self) -> Duration {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        let d = *self.delay.borrow();
        let span = 2 * d.jitter.as_micros() as u64;
        let off = if span == 0 { 0 } else { self.state % (span + 1) };
        (d.base + Duration::from_micros(off)).saturating_sub(d.jitter)
    }
}

/// A running relay; dropping it stops every task (and closes its sockets).
pub struct Relay {
    pub addr: SocketAddr,
    delay: watch::Sender<Delay>,
    /// Datagrams or chunks forwarded, both directions: proof that a link goes through it.
    forwarded: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<()>>,
}

impl Relay {
    /// Changes the delay of everything forwarded from now on.
    pub fn set_delay(&self, d: Delay) {
        self.delay.send_replace(d);
    }

    pub fn forwarded(&self) -> u64 {
        self.forwarded.load(Ordering::Relaxed)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A datagram due at `due` (ordered earliest first; `seq` breaks ties in arrival order).
struct Due {
    due: Instant,
    seq: u64,
    to: SocketAddr,
    data: Vec<u8>,
}

impl PartialEq for Due {
    fn eq(&self, o: &Self) -> bool {
        (self.due, self.seq) == (o.due, o.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Due {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.due, o.seq).cmp(&(self.due, self.seq))
    }
}

/// Sends each queued datagram on `sock` once it is due (earliest first, whatever the order of
/// arrival).
fn delay_line(sock: Arc<UdpSocket>, forwarded: Arc<AtomicU64>) -> (mpsc::UnboundedSender<Due>, JoinHandle<()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Due>();
    let task = tokio::spawn(async move {
        let mut heap = BinaryHeap::new();
        loop {
            let next = heap.peek().map(|d: &Due| d.due);
            tokio::select! {
                item = rx.recv() => match item {
                    Some(d) => heap.push(d),
                    None => return,
                },
                () = async { tokio::time::sleep_until(next.unwrap()).await }, if next.is_some() => {
                    let d = heap.pop().unwrap();
                    // A full socket buffer drops the datagram, as a congested link would.
                    let _ = sock.send_to(&d.data, d.to).await;
                    forwarded.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    });
    (tx, task)
}

impl Relay {
    /// Relays UDP datagrams from `listen` to `target` and the answers back, each delayed.
    pub async fn udp(listen: SocketAddr, target: SocketAddr, delay: Delay) -> Relay {
        let front = Arc::new(UdpSocket::bind(listen).await.expect("relay bind"));
        let addr = front.local_addr().unwrap();
        let (delay_tx, delay_rx) = watch::channel(delay);
        let forwarded = Arc::new(AtomicU64::new(0));
        let (to_clients, back_task) = delay_line(front.clone(), forwarded.clone());
        let count = forwarded.clone();
        let task = tokio::spawn(async move {
            let mut draw = Draw::new(delay_rx.clone(), addr.port() as u64 * 7919);
            let mut seq = 0u64;
            // Per client: the upstream socket's delay line, the due time of the last datagram
            // queued on it, and the tasks (its sender, and the reader of its answers).
            type Upstream = (mpsc::UnboundedSender<Due>, Instant, Vec<JoinHandle<()>>);
            let mut upstream: HashMap<SocketAddr, Upstream> = HashMap::new();
            let mut buf = vec![0u8; 65_536];
            loop {
                let Ok((n, client)) = front.recv_from(&mut buf).await else { return };
                if let std::collections::hash_map::Entry::Vacant(slot) = upstream.entry(client) {
                    let bind: SocketAddr = SocketAddr::new(listen.ip(), 0);
                    let sock = Arc::new(UdpSocket::bind(bind).await.expect("relay upstream bind"));
                    let (tx, send_task) = delay_line(sock.clone(), count.clone());
                    let back = to_clients.clone();
                    let mut back_draw = Draw::new(delay_rx.clone(), seq.wrapping_mul(104_729) ^ 0x9E37);
                    let read_task = tokio::spawn(async move {
                        let mut buf = vec![0u8; 65_536];
                        let mut seq = 0u64;
                        let mut last = Instant::now();
                        while let Ok((n, from)) = sock.recv_from(&mut buf).await {
                            if from != target {
                                continue;
                            }
                            seq += 1;
                            last = last.max(Instant::now() + back_draw.next());
                            let due = last;
                            if back.send(Due { due, seq, to: client, data: buf[..n].to_vec() }).is_err() {
                                return;
                            }
                        }
                    });
                    slot.insert((tx, Instant::now(), vec![send_task, read_task]));
                }
                let entry = upstream.get_mut(&client).unwrap();
                seq += 1;
                entry.1 = entry.1.max(Instant::now() + draw.next());
                let due = entry.1;
                let _ = entry.0.send(Due { due, seq, to: target, data: buf[..n].to_vec() });
            }
        });
        Relay { addr, delay: delay_tx, forwarded, tasks: vec![task, back_task] }
    }

    /// Relays TCP connections from `listen` to `target`, each direction's chunks delayed in
    /// order.
    pub async fn tcp(listen: SocketAddr, target: SocketAddr, delay: Delay) -> Relay {
        let l = TcpListener::bind(listen).await.expect("relay bind");
        let addr = l.local_addr().unwrap();
        let (delay_tx, delay_rx) = watch::channel(delay);
        let forwarded = Arc::new(AtomicU64::new(0));
        let count = forwarded.clone();
        let task = tokio::spawn(async move {
            let mut n = 0u64;
            while let Ok((client, _)) = l.accept().await {
                n += 1;
                let Ok(server) = TcpStream::connect(target).await else { continue };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pump(cr, sw, Draw::new(delay_rx.clone(), n * 31 + 1), count.clone()));
                tokio::spawn(pump(sr, cw, Draw::new(delay_rx.clone(), n * 37 + 2), count.clone()));
            }
        });
        Relay { addr, delay: delay_tx, forwarded, tasks: vec![task] }
    }
}

/// Copies `from` to `to`, each chunk leaving no earlier than its own delay after it was read
/// and never before the chunk read before it. The writer's end is shut down after the last
/// chunk (end of stream travels with the same delay).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut draw: Draw,
    forwarded: Arc<AtomicU64>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
    let writer = tokio::spawn(async move {
        while let Some((due, data)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            match data {
                Some(d) => {
                    if to.write_all(&d).await.is_err() {
                        return;
                    }
                    forwarded.fetch_add(1, Ordering::Relaxed);
                }
                None => {
                    let _ = to.shutdown().await;
                    return;
                }
            }
        }
    });
    let mut last = Instant::now();
    let mut buf = vec![0u8; 65_536];
    loop {
        let n = from.read(&mut buf).await.unwrap_or(0);
        last = last.max(Instant::now() + draw.next());
        if tx.send((last, (n > 0).then(|| buf[..n].to_vec()))).is_err() || n == 0 {
            break;
        }
    }
    let _ = writer.await;
}
