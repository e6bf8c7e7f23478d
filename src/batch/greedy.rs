//! Greedy rows sampled together.

use mlx::Array;

use super::{Decoder, Row};
use crate::sample::{argmax_rows, row_views};
use crate::Result;

/// The plain rows of a step that sample by argmax alone (greedy, without logits processors or a
/// grammar), sampled together ([`argmax_rows`]).
pub(super) struct GreedyRows {
    /// The rows' positions on the step's token axis, ascending.
    at: Vec<i32>,
    /// (n,) uint32 tokens, and each row's logprobs (V,): views of one (n, V) array, evaluated
    /// with the step so that reading one later costs nothing.
    pub(super) tokens: Array,
    pub(super) logprobs: Vec<Array>,
}

impl GreedyRows {
    /// The greedy plain rows of a step over rows of `lens` tokens with `logits` (1, T, V); None
    /// when fewer than two.
    pub(super) fn sample(
        rows: &[Row<'_>],
        lens: &[usize],
        logits: &Array,
    ) -> Result<Option<GreedyRows>> {
        let mut at = Vec::new();
        let mut start = 0;
        for (row, &len) in rows.iter().zip(lens) {
            if matches!(&row.decoder, Decoder::Plain(p) if p.sampler.samples_by_argmax()) {
                at.push(start);
            }
            start += len as i32;
        }
        if at.len() < 2 {
            return Ok(None);
        }
        let (tokens, logprobs) = argmax_rows(&logits.squeeze(&[0])?, &at)?;
        let logprobs = row_views(&logprobs)?;
        Ok(Some(GreedyRows {
            at,
            tokens,
            logprobs,
        }))
    }

    /// Whether the row starting at `start` on the token axis is one of these.
    pub(super) fn holds(&self, start: i32) -> bool {
        self.at.binary_search(&start).is_ok()
    }

    pub(super) fn index(&self, start: i32) -> usize {
        self.at.binary_search(&start).expect("a greedy row")
    }
}
