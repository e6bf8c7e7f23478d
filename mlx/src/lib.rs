//! A safe Rust binding of MLX's C++ API through cxx, linked to the same pinned MLX wheel the
//! Python oracle (mlx-lm / mlx-vlm) runs, so both execute one libmlx build (docs/DESIGN.md, section 1).
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

/// A device MLX can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu,
}

impl Device {
    /// The backend this device runs on, as traces name it: "cpu", or for the GPU "cuda" or
    /// "metal" depending on the libmlx this process loaded ("gpu" if it is neither).
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu if bridge::cuda_available() => "cuda",
            Device::Gpu if bridge::metal_available() => "metal",
            Device::Gpu => "gpu",
        }
    }

    /// The GPU (CUDA or Metal) when this process's libmlx has one and a device is present,
    /// else the CPU.
    pub fn best_available() -> Device {
        if bridge::gpu_available() {
            Device::Gpu
        } else {
            Device::Cpu
        }
    }
}

/// Makes `device` the default device of this process.
pub fn set_default_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => bridge::use_cpu()?,
        Device::Gpu => bridge::use_gpu()?,
    }
    Ok(())
}

/// The device this process's MLX work runs on unless told otherwise.
pub fn default_device() -> Device {
    if bridge::default_is_cpu() {
        Device::Cpu
    } else {
        Device::Gpu
    }
}

/// Whether this process's MLX work runs on CUDA by default (where kernel choices that depend on
/// shapes and buffer layouts decide a row's bits).
pub fn default_is_cuda() -> bool {
    default_device() == Device::Gpu && Device::Gpu.name() == "cuda"
}

/// Whether this libmlx's CPU matmul is the netlib reference BLAS that the Linux wheels (mlx-cpu
/// and mlx-cuda) bundle, rather than Accelerate (macOS). Reference `sgemm` sums every output
/// element over the inner dimension in order, from zero, without fused multiply-adds, whichever
/// operand is transposed: the layout of an f32 operand changes its speed, never its bits.
pub const CPU_MATMUL_IS_REFERENCE_BLAS: bool = cfg!(target_os = "linux");

/// Memory accounting, as `mx.get_peak_memory()` and friends report it (bytes).
pub mod memory {
    use super::bridge;

    pub fn peak() -> usize {
        bridge::peak_memory()
    }

    pub fn reset_peak() {
        bridge::reset_peak_memory()
    }

    /// `mx.clear_cache()`: returns cached buffers to the system.
    pub fn clear_cache() {
        bridge::clear_cache()
    }
}

/// Where MLX keeps the kernels `mx::compile` JIT-builds on CPU: `<temp dir>/mlx/<version>/cpu`,
/// shared by every process, written without locking. Parallel test processes (nextest runs one
/// process per test) could then read a kernel another is still compiling.
pub mod jit {
    /// Under nextest, points this process's temp dir (and so MLX's JIT cache) at a folder of its
    /// own test slot: processes running at the same time never share one, and the tests that
    /// run one after another in a slot reuse its kernels. Does nothing outside nextest.
    ///
    /// Call it first thing in a test, before any MLX work or other threads start.
    pub fn isolate_per_test_slot() {
        let Ok(slot) = std::env::var("NEXTEST_TEST_GLOBAL_SLOT") else {
            return;
        };
        let name = format!("verity-mlx-jit-slot-{slot}");
        if std::env::temp_dir().ends_with(&name) {
            return;
        }
        let dir = std::env::temp_dir().join(name);
        if std::fs::create_dir_all(&dir).is_ok() {
            std::env::set_var("TMPDIR", &dir);
        }
    }
}
