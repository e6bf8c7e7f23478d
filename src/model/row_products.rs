//! When a lone-row quantized product may compute all its rows in one call that loads each
//! packed weight row once for several rows (`mlx::fast::rows_qmv`), rather than through
//! `gather_qmm` over 7 rows at a time, which reads the whole weight once per row: an 8-row step
//! of the 4B 4-bit shape spent 24.5 ms that way on an H100, and 21 ms with this call
//! (docs/gpu-rows.md). The call repeats the float operations of MLX's qmv, another library's
//! arithmetic, so each process checks it once per operand types and shape, on the weight at
//! hand, against MLX's own one-row product before any batch trusts it; a libmlx that computes
//! otherwise keeps `gather_qmm`.
//!
//! Dense weights keep the batched gemv: the same kind of call for gemv's arithmetic was correct,
//! and faster on a weight held in L2, but slower when serving the 0.6B bf16 shape.

use mlx::{fast, ops, random, Array, Dtype, Result};

use crate::model::kernel_checks::KernelChecks;

/// How the kernel splits its work (rows per weight load, tiles loaded at a time): of nine tilings
/// timed on an H100 over a 4B-shape projection at 8 and 32 rows, within 2% of the fastest, and
/// the one served end to end (docs/gpu-rows.md).
const TILING: fast::RowTiling = fast::RowTiling { rows: 2, ahead: 1 };

/// Rows the check multiplies: more than the kernel takes per load, and an odd number, so that
/// several groups of rows, one of them cut short, are checked.
const CHECKED_ROWS: i32 = 11;

/// Whether the check passed, per element type, K, N, group size and bits, once per process.
static CHECKS: KernelChecks<(Dtype, i32, i32, i32, i32), ()> = KernelChecks::new(
    "one-call lone-row product (element type, K, N, group size, bits)",
    "batch rows keep gather_qmm",
);

/// `quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits, "affine")` for `x`
/// (rows, K) in one call, where that gives every row the bits of its lone product; None where
/// it may not (not CUDA; not 4 or 8 bits, group size 32, 64 or 128 and K a multiple of 16; or
/// the check failed).
pub fn quantized(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
) -> Result<Option<Array>> {
    let k = x.dim(1);
    let dtype = x.dtype();
    let fits = mlx::default_is_cuda()
        && matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
        && scales.dtype() == dtype
        && biases.dtype() == dtype
        && matches!(bits, 4 | 8)
        && matches!(group_size, 32 | 64 | 128)
        && k % 16 == 0;
    let product = |x: &Array| fast::rows_qmv(x, w, scales, biases, group_size, bits, TILING);
    let lone = |row: &Array| {
        ops::quantized_matmul(
            row,
            w,
            scales,
            Some(biases),
            true,
            group_size,
            bits,
            "affine",
        )
    };
    let check = || Ok(matches(dtype, k, product, lone)?.then_some(()));
    if !fits
        || CHECKS
            .outcome((dtype, k, w.dim(0), group_size, bits), check)
            .is_none()
    {
        return Ok(None);
    }
    Ok(Some(product(x)?))
}

/// Whether random rows through `product` all at once get the bits of each row through `lone`,
/// as a lone decode step computes it.
fn matches(
    dtype: Dtype,
    k: i32,
    product: impl Fn(&Array) -> Result<Array>,
    lone: impl Fn(&Array) -> Result<Array>,
) -> Result<bool> {
    let x = random::normal(&[CHECKED_ROWS, k], Dtype::Float32, &random::key(7)?)?.astype(dtype)?;
    let alone = (0..CHECKED_ROWS)
        .map(|r| lone(&x.slice_axis(0, r, r + 1)?))
        .collect::<Result<Vec<_>>>()?;
    let alone = ops::concatenate(&alone.iter().collect::<Vec<_>>(), 0)?;
    Ok(product(&x)?.to_bytes()? == alone.to_bytes()?)
}
