//! Greedy rows sampled together.

use mlx::Array;

use super::{Decoder, Row};
use crate::sample::{argmax_rows, row_views};
use crate::Result;

/// The rows of a step whose every position is sampled by argmax alone (greedy, no grammar, no
/// processor but a logit bias), sampled together ([`argmax_rows`]): a plain row's one position
/// and a speculative row's verify positions. Plain rows' token histories are not extended
/// here: no processor of theirs reads one.
pub(super) struct GreedyRows {
    /// Each such row's first position on the step's token axis, ascending, with the index of
    /// its first position in `tokens`.
    at: Vec<(i32, usize)>,
    /// (n,) uint32 tokens, and each position's logprobs (V,): views of one (n, V) array,
    /// evaluated with the step so that reading one later costs nothing.
    pub(super) tokens: Array,
    pub(super) logprobs: Vec<Array>,
}

impl GreedyRows {
    /// The greedy rows of a step over rows of `lens` tokens with `logits` (1, T, V); None when
    /// fewer than two.
    pub(super) fn sample(
        rows: &[Row<'_>],
        lens: &[usize],
        logits: &Array,
    ) -> Result<Option<GreedyRows>> {
        let logits = logits.squeeze(&[0])?;
        let (vocab, dtype) = (logits.dim(1), logits.dtype());
        let (mut at, mut positions, mut biases) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for (row, &len) in rows.iter().zip(lens) {
            let bias = match &row.decoder {
                Decoder::Plain(p) if p.sampler.samples_by_argmax() => {
                    Some(p.sampler.argmax_bias(vocab, dtype)?)
                }
                Decoder::Speculative { speculator, .. } if speculator.verdict_by_argmax() => {
                    Some(speculator.argmax_bias(vocab, dtype)?)
                }
                _ => None,
            };
            if let Some(bias) = bias {
                at.push((start, positions.len()));
                positions.extend(start..start + len as i32);
                biases.extend(std::iter::repeat_n(bias, len));
            }
            start += len as i32;
        }
        if at.len() < 2 {
            return Ok(None);
        }
        let (tokens, logprobs) = argmax_rows(&logits, &positions, &biases)?;
        let logprobs = row_views(&logprobs)?;
        Ok(Some(GreedyRows {
            at,
            tokens,
            logprobs,
        }))
    }

    /// The index in `tokens` of the first position of the row starting at `start` on the token
    /// axis, if it is one of these.
    pub(super) fn index(&self, start: i32) -> Option<usize> {
        let i = self.at.binary_search_by_key(&start, |&(s, _)| s).ok()?;
        Some(self.at[i].1)
    }
}
