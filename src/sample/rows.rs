//! Rows sampled by argmax together: one add of their logit biases, one logsumexp and one
//! argmax over their (n, V) logits in place of a handful of ops per row, which on a GPU is what
//! sampling a row costs. Each row keeps its lone bits, since each op works on each row alone
//! ([`crate::model::lone_rows`]) and a bias row adds what the row's own processor adds
//! ([`super::LogitsProcessors::as_bias`]).

use mlx::{ops, Array, Dtype};

use crate::Result;

/// The greedy tokens (n,) uint32 and logprobs (n, V) of the rows at the ascending positions
/// `at` of `logits` (T, V), row i first adding `biases[i]` ((1, V), None for none), as
/// [`super::StepSampler`] gives each of them alone.
pub fn argmax_rows(logits: &Array, at: &[i32], biases: &[Option<Array>]) -> Result<(Array, Array)> {
    let mut logits = if at.len() as i32 == logits.dim(0) {
        logits.clone()
    } else {
        logits.take(&Array::from_slice(at, &[at.len() as i32])?, 0)?
    };
    if biases.iter().any(Option::is_some) {
        let (vocab, dtype) = (logits.dim(1), logits.dtype());
        let neutral = Array::full(&[1, vocab], &Array::from_f32(-0.0), dtype)?;
        let rows: Vec<&Array> = biases
            .iter()
            .map(|b| b.as_ref().unwrap_or(&neutral))
            .collect();
        logits = logits.add(&ops::concatenate(&rows, 0)?)?;
    }
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
