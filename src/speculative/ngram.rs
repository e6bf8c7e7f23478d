//! Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the sequence's last
//! n tokens, longest n first, and propose the tokens that followed it. No model, no cache: it
//! works with every target, and costs nothing when it finds nothing.

use super::{DraftContext, DraftSource, Verified};
use crate::{validate, Result};

pub struct NgramLookup {
    min_n: usize,
    max_n: usize,
    /// The prompt and every emitted token.
    history: Vec<u32>,
    drafts: Vec<u32>,
}

impl NgramLookup {
    /// Matches n-grams of `min_n..=max_n` tokens (longest first); the bounds are validated
    /// (crate::validate::ngram).
    pub fn new(min_n: usize, max_n: usize) -> Result<NgramLookup> {
        validate::ngram(min_n, max_n)?;
        Ok(NgramLookup {
            min_n,
            max_n,
            history: Vec::new(),
            drafts: Vec::new(),
        })
    }

    /// The continuation of the latest earlier match of the last `size` tokens, up to `n` long.
    fn lookup(&self, size: usize, n: usize) -> Option<&[u32]> {
        let h = &self.history;
        if h.len() <= size {
            return None;
        }
        let pattern = &h[h.len() - size..];
        (0..h.len() - size)
            .rev()
            .find(|&start| &h[start..start + size] == pattern)
            .map(|start| {
                let from = start + size;
                &h[from..(from + n).min(h.len())]
            })
    }
}

impl DraftSource for NgramLookup {
    fn prefill(&mut self, prompt: &[u32], _ctx: &mut DraftContext<'_>) -> Result<()> {
        self.history = prompt.to_vec();
        Ok(())
    }

    fn draft(&mut self, n: usize, _ctx: &mut DraftContext<'_>) -> Result<Vec<u32>> {
        self.drafts = (self.min_n..=self.max_n)
            .rev()
            .find_map(|size| self.lookup(size, n).filter(|c| !c.is_empty()))
            .map(<[u32]>::to_vec)
            .unwrap_or_default();
        Ok(self.drafts.clone())
    }

    fn commit(&mut self, round: &Verified<'_>) -> Result<()> {
        // A round the caches refused drafted nothing: the last drafts are the round before's.
        let drafts = std::mem::take(&mut self.drafts);
        debug_assert_eq!(round.drafted, drafts.len());
        self.history.extend(&drafts[..round.accepted]);
        self.history.extend(round.next);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_latest_match_wins_and_is_cut_to_n() {
        let mut s = NgramLookup::new(1, 3).unwrap();
        s.history = vec![1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3];
        // "2 3" last seen before at 5..7, followed by 7 8 5.
        assert_eq!(s.lookup(2, 2), Some(&[7, 8][..]));
        assert_eq!(s.lookup(3, 4), None);
    }
}
