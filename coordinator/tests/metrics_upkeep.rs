//! The Prometheus recorder keeps memory bounded when nobody scrapes `/metrics` (found by
//! `scripts/soak`: an unscraped coordinator grew by about 1.5 MiB a minute under load, a
//! scraped one stayed flat). Histogram samples wait in a per-histogram buffer until the
//! recorder's upkeep folds them into buckets; this test records many samples, never renders,
//! and watches the bytes this process holds (a counting allocator: this test file is its own
//! process) go back down.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use cleave_coordinator::metrics::{prometheus_handle, INTER_TOKEN_LATENCY_SECONDS, UPKEEP_EVERY};

/// Counts the bytes allocated and not yet freed, and their high-water mark.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged to the system allocator.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed) + layout.size() as isize;
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn unscraped_histogram_samples_are_folded_and_freed() {
    let _handle = prometheus_handle().expect("the recorder installs");
    let h = metrics::histogram!(INTER_TOKEN_LATENCY_SECONDS, "pool" => "decode", "path" => "remote");
    h.record(0.01);
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);

    // Half a million tokens' latencies: 4 MB of samples if they wait.
    const N: usize = 500_000;
    for _ in 0..N {
        h.record(0.01);
    }
    let peak = PEAK.load(Ordering::Relaxed) - before;
    // The measure sees the waiting samples (an upkeep may have folded some already).
    assert!(peak >= (N * 8 / 2) as isize, "recording {N} samples held only {peak} bytes at most");

    // Without a scrape, the samples are folded within a few upkeep periods and the buffer is
    // freed (its blocks are reclaimed as the recording thread keeps pinning the epoch).
    let deadline = Instant::now() + UPKEEP_EVERY * 10;
    loop {
        for _ in 0..1000 {
            h.record(0.01);
        }
        let held = LIVE.load(Ordering::Relaxed) - before;
        if held < (N * 8 / 10) as isize {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{held} bytes still held {:?} after recording {N} samples with no scrape: histogram samples pile up",
            UPKEEP_EVERY * 10
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
