//! The workers of a forward pass ([`Backend::run`](crate::Backend::run)), kept spinning for the
//! whole of it, and the regions of tasks the pass hands them ([`par_tasks`]).
//!
//! Why not rayon alone: a decode step forks ~150 short parallel regions. Between two of them an
//! idle rayon worker goes to sleep, and inside one, the thread that finishes its share first
//! sleeps in `join` until the other is done; each sleep is a futex round trip (on SmolLM2 at
//! batch 1, 251 context switches a step, and two threads decoded only 1.48x as fast as one).
//! Here the workers spin on one atomic word for the pass's duration, take tasks by
//! compare-and-swap, and the pass's own thread takes tasks too and then spins until the last one
//! is done: no thread sleeps inside a pass. A worker idle for a few hundred microseconds (a serial
//! stretch of the pass, or a handoff's channel holding it) starts yielding its core between
//! polls, so a node's runtime and transfer threads still get it.
//!
//! Invariants:
//! - Only the pass's own thread (the one [`Crew::pass`] runs `f` on) publishes regions, one at a
//!   time, and only once the previous region's every task is done.
//! - The state word holds the region's generation, task count and next task index, so a worker
//!   that read an old region's state can never take a task of a newer one (its compare-and-swap
//!   fails), and a task's closure is read only after a successful take, while the region is
//!   still running: the pass's thread waits for every taken task before it returns from
//!   [`par_tasks`], so the closure it lent outlives every use.

use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use rayon::prelude::*;

/// Idle polls a worker spins through before it starts yielding its core between polls.
const SPINS_BEFORE_YIELDING: u32 = 1 << 12;

/// The most tasks one region takes (the state word's 16-bit fields); more go to rayon.
const MAX_TASKS: usize = 0xFFFF;

/// A task of a region, its lifetime erased: see the module's invariants for why it is only
/// called while the region runs.
type Task = *const (dyn Fn(usize) + Sync);

/// The shared state of one forward pass's workers.
pub(crate) struct Crew {
    /// Generation (high 32 bits), task count (16), next task index (low 16).
    state: AtomicU64,
    /// Tasks of the current region finished.
    done: AtomicUsize,
    /// The current region's task (written by the pass's thread before it publishes the region).
    task: UnsafeCell<Option<Task>>,
    /// A task of the current region panicked (the pass's thread panics in turn).
    panicked: AtomicBool,
    /// The pass is over: the workers return.
    over: AtomicBool,
}

// SAFETY: `task` is written only by the pass's thread while no region runs, and read by others
// only after a successful take of a running region's task (module invariants); every other
// field is atomic.
unsafe impl Sync for Crew {}

thread_local! {
    /// The crew of the pass this thread runs, while it runs it and is not inside a task.
    static CREW: Cell<*const Crew> = const { Cell::new(std::ptr::null()) };
}

impl Crew {
    /// Runs `f` on the calling thread (a rayon pool's worker) while every other worker of that
    /// pool spins in [`Crew::work`] until `f` returns or unwinds.
    pub(crate) fn pass<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        let crew = Crew {
            state: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            task: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            over: AtomicBool::new(false),
        };
        let main = rayon::current_thread_index();
        rayon::scope(|s| {
            for _ in 1..rayon::current_num_threads() {
                s.spawn(|_| crew.work(main));
            }
            /// Ends the pass on every path out of `f`, a panic included: the scope waits for the
            /// workers, and they wait for this.
            struct Over<'a>(&'a Crew, *const Crew);
            impl Drop for Over<'_> {
                fn drop(&mut self) {
                    CREW.with(|c| c.set(self.1));
                    self.0.over.store(true, Ordering::Release);
                }
            }
            // A pass inside a pass (not done today) gets its own crew and gives the outer one
            // back after.
            let _over = Over(&crew, CREW.with(|c| c.replace(&crew)));
            f()
        })
    }

    /// A worker's loop: take the pass's region tasks and rayon's forked work as they come,
    /// spinning in between, until the pass is over. On the pass's own thread (`main`: a join
    /// waiting for stolen work may pop this job) it returns at once, or it would wait there
    /// for the pass that is waiting for it.
    fn work(&self, main: Option<usize>) {
        if rayon::current_thread_index() == main {
            return;
        }
        let mut idle = 0u32;
        while !self.over.load(Ordering::Acquire) {
            if self.take_one() || rayon::yield_now() == Some(rayon::Yield::Executed) {
                idle = 0;
            } else if idle < SPINS_BEFORE_YIELDING {
                idle += 1;
                std::hint::spin_loop();
            } else {
                // Long idle (the pass is in a serial stretch, or waits on a KV handoff's
                // channel): let the node's other threads (its runtime, the transfers) have this
                // core when they want it, at a system call's cost when they do not.
                std::thread::yield_now();
            }
        }
    }

    /// Takes and runs one task of the running region; false if none is left.
    fn take_one(&self) -> bool {
        let s = self.state.load(Ordering::Acquire);
        let (count, next) = ((s >> 16) & 0xFFFF, s & 0xFFFF);
        if next >= count {
            return false;
        }
        if self.state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return true;
        }
        // SAFETY: the take succeeded on a running region, so its task was written before the
        // region was published (release, acquired by the take) and stays valid until this task
        // is counted done (module invariants).
        let task = unsafe { (*self.task.get()).expect("a running region has a task") };
        // SAFETY: as above: the closure outlives this call.
        if catch_unwind(AssertUnwindSafe(|| unsafe { (*task)(next as usize) })).is_err() {
            self.panicked.store(true, Ordering::Relaxed);
        }
        self.done.fetch_add(1, Ordering::Release);
        true
    }

    /// Publishes a region of `count <= MAX_TASKS` tasks, takes tasks with the workers, and
    /// returns once every task is done. Only on the pass's own thread, outside any task.
    fn region(&self, count: usize, task: &(dyn Fn(usize) + Sync)) {
        let gen = (self.state.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xFFFF_FFFF;
        // SAFETY: no region runs (the last one's tasks are all done), so no worker reads `task`;
        // the lifetime is erased here and the pointer is used only while this call waits below.
        unsafe {
            *self.task.get() = Some(std::mem::transmute::<&(dyn Fn(usize) + Sync), Task>(task));
        }
        self.done.store(0, Ordering::Relaxed);
        self.state.store(gen << 32 | (count as u64) << 16, Ordering::Release);
        CREW.with(|c| c.set(std::ptr::null()));
        while self.take_one() {}
        while self.done.load(Ordering::Acquire) < count {
            std::hint::spin_loop();
        }
        CREW.with(|c| c.set(self));
        if self.panicked.swap(false, Ordering::Relaxed) {
            panic!("a task of a parallel region panicked");
        }
    }
}

/// `task(i)` for every `i < count`, in parallel: through the running pass's crew when called on
/// its thread outside a task ([`Crew::pass`]), else on `pool` through rayon.
pub(crate) fn par_tasks(pool: &rayon::ThreadPool, count: usize, task: &(dyn Fn(usize) + Sync)) {
    let crew = CREW.with(|c| c.get());
    if !crew.is_null() && count <= MAX_TASKS {
        // SAFETY: `CREW` points at the crew of the pass this thread is running, which lives
        // until `Crew::pass` clears the pointer.
        unsafe { &*crew }.region(count, task);
    } else {
        pool.install(|| (0..count).into_par_iter().for_each(task));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
    }

    /// Every task of every region runs exactly once, on 1-4 threads, with regions of every size
    /// back to back (a worker reading a finished region's state must not take a newer one's
    /// task), a nested region inside a task (it goes to rayon), and one past `MAX_TASKS`.
    #[test]
    fn every_task_runs_once_in_every_region() {
        for threads in 1..=4 {
            let pool = pool(threads);
            let hits: Vec<AtomicUsize> = (0..MAX_TASKS + 2).map(|_| AtomicUsize::new(0)).collect();
            let rounds = pool.install(|| {
                Crew::pass(|| {
                    // The calls below go through this pass's crew (of one thread, too).
                    assert!(!CREW.with(|c| c.get()).is_null());
                    let mut rounds = 0;
                    for count in (0..200).chain([1000, MAX_TASKS, MAX_TASKS + 1]) {
                        hits.iter().for_each(|h| h.store(0, Ordering::Relaxed));
                        par_tasks(&pool, count, &|i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                            if i == 3 {
                                let inner: Vec<AtomicUsize> = (0..5).map(|_| AtomicUsize::new(0)).collect();
                                par_tasks(&pool, 5, &|j| {
                                    inner[j].fetch_add(1, Ordering::Relaxed);
                                });
                                assert!(inner.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                            }
                        });
                        let ran: Vec<usize> = hits[..count].iter().map(|h| h.load(Ordering::Relaxed)).collect();
                        assert!(ran.iter().all(|&n| n == 1), "{threads} threads, {count} tasks: {ran:?}");
                        assert!(hits[count..].iter().all(|h| h.load(Ordering::Relaxed) == 0));
                        rounds += 1;
                    }
                    rounds
                })
            });
            assert_eq!(rounds, 203);
            assert!(CREW.with(|c| c.get()).is_null(), "the pass gives the crew back");
        }
    }

    /// A task that panics on any thread, or the pass itself, ends the pass with that panic:
    /// nothing waits for a worker that will not come back, and the pool serves the next pass.
    #[test]
    fn a_panic_in_a_task_or_the_pass_ends_the_pass() {
        let pool = pool(2);
        for bad in [0, 7, 63] {
            let got = catch_unwind(AssertUnwindSafe(|| {
                pool.install(|| {
                    Crew::pass(|| {
                        par_tasks(&pool, 64, &|i| assert_ne!(i, bad, "task {i} fails"));
                    })
                })
            }));
            assert!(got.is_err(), "task {bad}");
        }
        let got = catch_unwind(AssertUnwindSafe(|| pool.install(|| Crew::pass(|| panic!("the pass fails")))));
        assert!(got.is_err());
        let sum = AtomicUsize::new(0);
        pool.install(|| Crew::pass(|| par_tasks(&pool, 10, &|i| _ = sum.fetch_add(i, Ordering::Relaxed))));
        assert_eq!(sum.load(Ordering::Relaxed), 45);
        // Outside a pass, the same call goes to rayon.
        par_tasks(&pool, 10, &|i| _ = sum.fetch_add(i, Ordering::Relaxed));
        assert_eq!(sum.load(Ordering::Relaxed), 90);
    }
}
