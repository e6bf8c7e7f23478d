//! Attention of a long chunk in blocks of query rows, on the CPU whose matmul is netlib's
//! reference BLAS.
//!
//! MLX's CPU attention is the unfused composition (scale, scores, mask, softmax, values), so a
//! prefill chunk of L queries over K keys holds (heads x L x K) f32 scores, twice over while the
//! mask is applied: 34 MB of a 1024-token prompt's peak for the 4-layer fixture, 134 MB per
//! copy for a 2048-token chunk after 2048 more. Every score row, its softmax and its output row
//! depend on that query row alone, and the reference BLAS computes each output element the same
//! way whatever the number of rows around it (`mlx/tests/blas_layout.rs`), so attending a block
//! of rows at a time gives the same bits. Each block is tied to the previous block's output
//! with `depends`, so MLX schedules the blocks one after another inside the same evaluation
//! (without it, its breadth-first schedule computes every block's scores first) and no host
//! round trip is added. Other backends choose kernels by shape and keep the one-call form.

use mlx::{fast, ops, Array, Dtype, Result};

use crate::cache::Mask;

/// Query rows per block. Blocks this small keep a prompt's scores (and the peak) small even at a
/// few hundred tokens, at no cost measurable against run-to-run noise in prefill speed on the
/// fixtures (a block's fixed cost is a dozen ops); decode and verify widths up to 32 attend in
/// one call.
const ROWS_PER_BLOCK: i32 = 32;

/// The rows per block for attending `queries` (B, heads, L, D), or None where one call is the
/// better (or the only bit-exact) form.
pub fn rows_per_block(queries: &Array) -> Option<i32> {
    let splits = mlx::CPU_MATMUL_IS_REFERENCE_BLAS
        && queries.dtype() == Dtype::Float32
        && mlx::default_device() == mlx::Device::Cpu
        && queries.dim(2) > ROWS_PER_BLOCK;
    splits.then_some(ROWS_PER_BLOCK)
}

/// `fast::scaled_dot_product_attention(queries, keys, values, scale, mask)` computed `block`
/// query rows at a time, each block masked as the whole chunk would mask its rows.
pub fn attend_in_row_blocks(
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: &Mask,
    block: i32,
) -> Result<Array> {
    let (rows, key_len) = (queries.dim(2), keys.dim(2));
    // The causal mask of MLX's own fallback: query i sits at position (key_len - rows) + i.
    // Built per block rather than sliced from create_causal_mask's whole-chunk mask, which
    // would stay alive until the last block (8 MB for a 2048-token chunk after 2048).
    let key_positions = Array::arange(0.0, key_len as f64, 1.0, Dtype::Int32)?.expand_dims(&[0])?;
    let offset = key_len - rows;
    let mut outputs: Vec<Array> = Vec::new();
    for start in (0..rows).step_by(block as usize) {
        let stop = (start + block).min(rows);
        let mut part = queries.slice_axis(2, start, stop)?;
        if let Some(previous) = outputs.last() {
            part = ops::depends(&part, previous)?;
        }
        let part_mask = match mask {
            Mask::None => None,
            Mask::Causal => Some(
                Array::arange(
                    (offset + start) as f64,
                    (offset + stop) as f64,
                    1.0,
                    Dtype::Int32,
                )?
                .expand_dims(&[1])?
                .greater_equal(&key_positions)?,
            ),
            Mask::Array(m) if m.ndim() >= 2 && m.dim(-2) == rows => {
                Some(m.slice_axis(-2, start, stop)?)
            }
            Mask::Array(m) => Some(m.clone()),
            Mask::Steps(_) => {
                return Err(mlx::Error::Invalid(
                    "one-token steps' masks given to a chunk's attention".into(),
                ))
            }
        };
        let sdpa_mask = match &part_mask {
            Some(m) => fast::SdpaMask::Array(m),
            None => fast::SdpaMask::None,
        };
        outputs.push(fast::scaled_dot_product_attention(
            &part, keys, values, scale, sdpa_mask, None,
        )?);
    }
    ops::concatenate(&outputs.iter().collect::<Vec<_>>(), 2)
}
