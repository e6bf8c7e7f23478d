//! Rows sampled by argmax together: one logsumexp and one argmax over their (n, V) logits in
//! place of a handful of ops per row, which on a GPU is what sampling a row costs. Each row
//! keeps its lone bits, since both reduce each row on its own ([`crate::model::lone_rows`]).

use mlx::{ops, Array, Dtype};

use crate::Result;

/// The greedy tokens (n,) uint32 and logprobs (n, V) of the rows at the ascending positions
/// `at` of `logits` (T, V), as [`super::StepSampler`] gives each of them alone.
pub fn argmax_rows(logits: &Array, at: &[i32]) -> Result<(Array, Array)> {
    let logits = if at.len() as i32 == logits.dim(0) {
        logits.clone()
    } else {
        logits.take(&Array::from_slice(at, &[at.len() as i32])?, 0)?
    };
    let logprobs = logits.subtract(&logits.logsumexp(&[-1], true)?)?;
    let tokens = ops::argmax(&logprobs, -1, false)?.astype(Dtype::Uint32)?;
    Ok((tokens, logprobs))
}

/// Each row of `a` (n, ...) as its own view (...), to hand out one row at a time: views of one
/// array evaluated once.
pub fn row_views(a: &Array) -> mlx::Result<Vec<Array>> {
    (0..a.dim(0))
        .map(|i| a.slice_axis(0, i, i + 1)?.squeeze(&[0]))
        .collect()
}
