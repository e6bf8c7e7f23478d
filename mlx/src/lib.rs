//! A safe Rust binding of MLX's C++ API through cxx, linked to the same pinned MLX wheel the
//! Python oracle (mlx-lm / mlx-vlm) runs, so both execute one libmlx build (DESIGN.md section 1).
//!
//! Names follow mlx-rs where mlx-rs has them (`Array`, `Dtype`, `ops`, `fast`, `random`), so the
//! engine reads like mlx-rs code. All MLX work belongs on one thread: see [`thread`].

mod array;
pub mod compiled;
mod error;
pub mod fast;
mod ffi;
pub mod io;
pub mod ops;
pub mod random;
pub mod thread;

pub use array::{Array, Dtype, Element};
pub use error::{Error, Result};

use array::List;
use ffi::bridge;

/// The MLX version this crate is built and pinned against (mlx/build.rs).
pub const PINNED_VERSION: &str = env!("MLX_PINNED_VERSION");

/// `mx.eval(*arrays)`: evaluates the arrays' graphs and waits.
pub fn eval<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
    Ok(bridge::eval(&List::new(arrays).raw)?)
}

/// `mx.async_eval(*arrays)`: schedules evaluation and returns at once.
pub fn async_eval<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
    Ok(bridge::async_eval(&List::new(arrays).raw)?)
}

/// The MLX version libmlx reports (for example "0.32.4").
pub fn version() -> String {
    bridge::version()
}

/// Makes the CPU the default device of this process (the oracle goldens are CPU runs).
pub fn use_cpu() -> Result<()> {
    Ok(bridge::use_cpu()?)
}

/// Memory accounting, as `mx.get_peak_memory()` and friends report it (bytes).
pub mod memory {
    use super::bridge;

    pub fn peak() -> usize {
        bridge::peak_memory()
    }

    pub fn active() -> usize {
        bridge::active_memory()
    }

    pub fn reset_peak() {
        bridge::reset_peak_memory()
    }

    /// `mx.clear_cache()`: returns cached buffers to the system.
    pub fn clear_cache() {
        bridge::clear_cache()
    }
}
