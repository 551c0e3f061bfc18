//! What the fuzz targets share: driving the crates' async readers over an in-memory slice.

use std::future::Future;
use std::task::{Context, Poll, Waker};

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
