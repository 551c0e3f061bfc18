//! What the fuzz targets share: a cap on single allocations, and driving the crates' async
//! readers over an in-memory slice.

use std::alloc::{GlobalAlloc, Layout, System};
use std::future::Future;
use std::io::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

/// Largest single allocation a target may make (a target may raise it before its first input).
/// The decoders under test bound what they allocate before allocating (a control frame at
/// 16 MiB, a handoff payload at the limits the target sets, GGUF arrays and tensors by the
/// bytes of the file); 256 MiB is past all of them, so crossing it means a length was trusted
/// before it was checked.
///
/// Why an allocator: libFuzzer's own `-malloc_limit_mb` works through sanitizer hooks, which a
/// `--sanitizer none` build (stable Rust) does not have, and its RSS limit (`-rss_limit_mb`,
/// which does work) misses a large zeroed allocation that is never touched.
pub static MAX_ALLOC_BYTES: AtomicUsize = AtomicUsize::new(256 << 20);

/// The system allocator, aborting (a crash libFuzzer reports with its input) on any single
/// allocation over [`MAX_ALLOC_BYTES`].
pub struct CappedAlloc;

fn check(size: usize) {
    if size > MAX_ALLOC_BYTES.load(Ordering::Relaxed) {
        // No formatting: this must not allocate.
        let _ = std::io::stderr().write_all(b"fuzz: a single allocation exceeded MAX_ALLOC_BYTES\n");
        std::process::abort();
    }
}

// SAFETY: every method checks the size, then forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees are ours.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CappedAlloc = CappedAlloc;

/// Runs a future that reads only from a byte slice to completion in one poll.
///
/// Why no runtime: tokio's `AsyncRead` for `&[u8]` is always ready, so the readers under test
/// (`read_msg`, `read_frame`) finish in their first poll; a `Pending` would mean the reader
/// waits on something other than its input, which is itself a bug worth a crash.
pub fn ready<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("a reader over an in-memory slice returned Pending"),
    }
}
