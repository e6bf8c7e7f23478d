//! What the libtest-mimic suites share.

use libtest_mimic::Arguments;

/// The command-line arguments, with the trials run one at a time on the main thread whatever
/// `--test-threads` says. MLX work stays on one thread (the one-engine-thread rule), and that
/// thread must be gone before `exit` runs MLX's static destructors: a pool worker is not, since
/// `thread::scope` returns before a worker's thread-local destructors (MLX compile caches and
/// their arrays) have finished, and the two racing corrupted the heap after every trial passed
/// ("malloc_consolidate(): unaligned fastbin chunk detected", about one run in twenty).
pub fn main_thread_args() -> Arguments {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    args
}
