//! Lone-row kernels: a decode forward over several tokens (a speculative verify, a batch step)
//! computed on the GPU so that every token gets the bits of a one-token step.
//!
//! MLX picks its GPU kernels by shape. A matmul over T > 1 rows runs cuBLAS where one row runs
//! gemv, a quantized matmul the tiled qmm where one row runs qmv, and a block of causal queries
//! cuDNN's attention where one query runs the vector kernel (or cuDNN with another tiling);
//! each rounds a row differently, by up to 0.0156 in bf16 on an H200, enough to flip a greedy
//! token within 20 steps, so speculation changed output and a batched row was not its request.
//! The same kernels with every row computed alone (measured on mlx-cuda 0.32.4, bf16 and f32,
//! 2 to 33 rows, docs/DESIGN.md "Lone-row kernels"):
//! - a dense product as a batch of one-row products: MLX folds a batch into one gemm only when
//!   the left side is untransposed, so the rows are handed over as a (T, 1, K) view with
//!   transposed strides, and the batched gemv computes each row as gemv computes it alone;
//! - a quantized product through `gather_qmm` over at most [`QMV_ROWS`] rows per call, which
//!   runs qmv's per-row kernel (quantized_matmul would take qmm there);
//! - on CUDA, where it checks out, the quantized product in one call that repeats qmv's
//!   arithmetic for several rows per weight load instead ([`crate::model::row_products`]),
//!   since `gather_qmm` reads the whole weight once per row;
//! - attention one query at a time over its own key extent: the one-token step's call itself,
//!   or on CUDA, where they repeat that call, one call of the rows kernels for every query
//!   ([`crate::model::layers::rows_kernel`]).
//!
//! RMS norms, RoPE at offsets, softmax, logsumexp, argmax and gathers already give each row its
//! lone bits, and so does everything on the CPU, where this path is never taken.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

use mlx::{ops, Array, Dtype, Result};

use crate::model::row_products;

/// The most rows one `gather_qmm` call takes and still runs qmv's kernel (MLX switches to a
/// tiled kernel at 8 rows).
pub const QMV_ROWS: i32 = 7;

/// Whether decode forwards on a GPU use the lone-row kernels (the default), process-wide.
static ENABLED: AtomicBool = AtomicBool::new(true);

thread_local! {
    /// Whether the forward running on this thread (the engine thread) is a decode forward
    /// inside [`decode_rows`] on a GPU.
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    /// Whether the forward running on this thread is a decode forward inside [`decode_rows`]
    /// whose tokens must each get their one-token step's bits, on any device.
    static AS_ONE_TOKEN_STEPS: Cell<bool> = const { Cell::new(false) };
    /// Whether this thread is inside [`oracle_kernels`].
    static AS_ORACLE: Cell<bool> = const { Cell::new(false) };
    /// Whether this thread is inside [`on_any_device`].
    static ON_ANY_DEVICE: Cell<bool> = const { Cell::new(false) };
}

/// Turns the lone-row kernels on or off for every later decode forward: off trades the
/// guarantee (a verified or batched row equals its one-token step) for the batched kernels'
/// speed.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether the lone-row kernels are on ([`set_enabled`]).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Runs `f` with MLX's batched kernels in every decode forward, whatever [`set_enabled`] says:
/// what mlx-lm runs, so what a golden trace recorded (its verify rows and batch rows included).
pub fn oracle_kernels<T>(f: impl FnOnce() -> T) -> T {
    let outer = AS_ORACLE.replace(true);
    let out = f();
    AS_ORACLE.set(outer);
    out
}

/// Runs `f` with the lone-row kernels in every decode forward on any device, the CPU included,
/// where they must give the bits the CPU's own kernels give (its kernels are row-independent):
/// how the tests check, without a GPU, that this path computes the same function.
pub fn on_any_device<T>(f: impl FnOnce() -> T) -> T {
    let outer = ON_ANY_DEVICE.replace(true);
    let out = f();
    ON_ANY_DEVICE.set(outer);
    out
}

/// Whether a decode forward started here ([`decode_rows`]) gives each of its tokens its
/// one-token step's bits: the lone-row kernels are on and this is not an oracle's replay. A
/// speculative round asks before its forward whether its caches could take it back, which for
/// a rotating cache past its window depends on this (`crate::cache::rollback_plan`).
pub fn exact_decode() -> bool {
    enabled() && !AS_ORACLE.get()
}

/// Whether what decoding does for CUDA's kernels applies here: on CUDA, or inside
/// [`on_any_device`], where the tests check it on the CPU.
pub(crate) fn cuda_or_any_device() -> bool {
    mlx::default_is_cuda() || ON_ANY_DEVICE.get()
}

/// Runs `forward`, a decode forward over several rows, with the lone-row kernels when they are
/// enabled and the default device is a GPU.
pub fn decode_rows<T>(forward: impl FnOnce() -> T) -> T {
    let gpu = mlx::default_device() == mlx::Device::Gpu;
    let exact = exact_decode();
    let on = exact && (gpu || ON_ANY_DEVICE.get());
    let outer = (ACTIVE.replace(on), AS_ONE_TOKEN_STEPS.replace(exact));
    let out = forward();
    ACTIVE.set(outer.0);
    AS_ONE_TOKEN_STEPS.set(outer.1);
    out
}

/// Whether the forward in progress is a decode forward (a verify, a batch step) whose every
/// token must get its one-token step's bits, on any device. A family whose one-token step is
/// another computation than a multi-token forward (MLA's absorbed attention, glm4_moe_lite)
/// then runs each token of a row as that step, and a rotating cache takes a row's tokens one
/// at a time as its one-token steps do, so that speculation never changes the output; golden
/// replay runs what mlx-lm runs ([`oracle_kernels`]).
pub fn as_one_token_steps() -> bool {
    AS_ONE_TOKEN_STEPS.get()
}

/// Whether the forward in progress computes its rows with the lone-row kernels.
pub(crate) fn active() -> bool {
    ACTIVE.get()
}

/// The rows of `x` (..., K): every axis but the last.
pub(crate) fn rows(x: &Array) -> i32 {
    (x.size() / x.dim(-1) as usize) as i32
}

/// `x @ wt` for `wt` (K, N) a transposed view of a row-major (N, K) weight, each row by the
/// batched gemv ([module docs](self)); the result has `x`'s shape with N last.
///
/// A one-output product (qwen3_next's shared-expert gate) stays one call: with N = 1, MLX runs
/// gemv over `x`'s rows whatever their number, and each row gets its lone bits, where the
/// batched form sums a row's K = 64 products in another order (on an H100, 2 of 5 rows kept
/// their bits; `oracles/row_kernels.py`, "small f32").
pub fn dense(x: &Array, wt: &Array) -> Result<Array> {
    let (k, n, rows) = (wt.dim(0), wt.dim(1), rows(x));
    if n == 1 {
        return x.matmul(wt);
    }
    let lhs = x.reshape(&[rows, k, 1])?.transpose(&[0, 2, 1])?;
    let out = lhs.matmul(&wt.broadcast_to(&[rows, k, n])?)?;
    out.reshape(&out_shape(x, n))
}

/// `quantized_matmul(x, w, ...)` (transposed weight) each row by qmv's arithmetic: in one call
/// where [`row_products`] takes it, else by qmv itself in calls of at most [`QMV_ROWS`] rows.
#[allow(clippy::too_many_arguments)]
pub fn quantized(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    group_size: i32,
    bits: i32,
    mode: &str,
    out_dims: i32,
) -> Result<Array> {
    let (k, rows) = (x.dim(-1), rows(x));
    if let (Some(biases), "affine") = (biases, mode) {
        let flat = x.reshape(&[rows, k])?;
        if let Some(out) = row_products::quantized(&flat, w, scales, biases, group_size, bits)? {
            return out.reshape(&out_shape(x, out_dims));
        }
    }
    let flat = x.reshape(&[rows, 1, k])?;
    let (w, scales) = (w.expand_dims(&[0])?, scales.expand_dims(&[0])?);
    let biases = biases.map(|b| b.expand_dims(&[0])).transpose()?;
    let mut parts = Vec::new();
    for start in (0..rows).step_by(QMV_ROWS as usize) {
        let n = QMV_ROWS.min(rows - start);
        let first = Array::zeros(&[n], Dtype::Uint32)?;
        parts.push(ops::gather_qmm(
            &flat.slice_axis(0, start, start + n)?,
            &w,
            &scales,
            biases.as_ref(),
            &first,
            true,
            group_size,
            bits,
            mode,
            false,
        )?);
    }
    let out = ops::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?;
    out.reshape(&out_shape(x, out_dims))
}

/// `x`'s shape with the last axis `n` wide.
fn out_shape(x: &Array, n: i32) -> Vec<i32> {
    let mut shape = x.shape();
    *shape.last_mut().expect("a matrix operand") = n;
    shape
}
