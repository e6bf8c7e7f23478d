//! What a prefix cache keeps of a speculative request's draft side next to the target's caches,
//! so that a later request resumes both from the same prefix: a draft model's caches, or the
//! target's tapped hidden states over the prefix that a DFlash drafter reads as its context
//! (it drafts from the taps of every prompt row, which no cache holds).

use mlx::Array;

use crate::cache::LayerCache;
use crate::Result;

#[derive(Clone)]
pub enum DraftPrefix {
    /// A draft model's caches.
    Caches(Vec<LayerCache>),
    /// The target's taps over the prefix, one (1, P, H) array per tapped layer
    /// ([`super::PrefillMode::FullContext`]).
    Taps(Vec<Array>),
}

impl DraftPrefix {
    /// The arrays it holds (for a byte budget).
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            DraftPrefix::Caches(caches) => caches.iter().flat_map(LayerCache::state).collect(),
            DraftPrefix::Taps(taps) => taps.iter().collect(),
        }
    }

    /// Whether it can be cut back to a shorter prefix exactly (KV caches; taps are rows).
    pub fn trims(&self) -> bool {
        match self {
            DraftPrefix::Caches(caches) => caches.iter().all(|c| matches!(c, LayerCache::Kv(_))),
            DraftPrefix::Taps(_) => true,
        }
    }

    /// Drops the last `n` tokens (what [`DraftPrefix::trims`] allows).
    pub fn trim(&mut self, n: usize) -> Result<()> {
        match self {
            DraftPrefix::Caches(caches) => {
                for c in caches {
                    c.trim(n)?;
                }
            }
            DraftPrefix::Taps(taps) => {
                for t in taps {
                    *t = t.slice_axis(1, 0, t.dim(1) - n as i32)?;
                }
            }
        }
        Ok(())
    }
}
