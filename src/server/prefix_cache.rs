//! The prefix cache across requests: the caches of earlier prompts (all but their last token,
//! as they stood after the prefill), keyed by exact token prefix and by a namespace naming
//! everything that shapes a cache (model, draft pairing, KV quantization, max_kv_size). For a
//! speculative lane the target's and the draft model's caches are one entry, stored and
//! restored together. A byte budget bounds it; the least recently used entries go first.
//!
//! An entry is a copy of immutable MLX arrays: the request that made it goes on writing to its
//! caches, and MLX copies a buffer rather than update it in place while this copy holds it, so
//! an entry never changes. That is also why restoring one is cheap: its arrays are shared.
//! mlx_lm.server keeps its prompt cache after generation instead (server.py:1148), with the
//! generated tokens in it; with a draft model that goes wrong (known-oracle-bugs.toml,
//! server-draft-with-prompt-cache), which keeping only prefilled prompts avoids.

use crate::cache::LayerCache;

/// One stored prompt prefix.
struct Entry {
    namespace: String,
    tokens: Vec<u32>,
    target: Vec<LayerCache>,
    draft: Option<Vec<LayerCache>>,
    bytes: usize,
    last_used: u64,
}

/// A restored prefix: how many prompt tokens the caches hold, and copies of them.
pub struct Hit {
    pub cached: usize,
    pub target: Vec<LayerCache>,
    pub draft: Option<Vec<LayerCache>>,
}

/// The stored prefixes under a byte budget.
pub struct PrefixCache {
    budget: usize,
    entries: Vec<Entry>,
    clock: u64,
}

/// The bytes of a model's caches (every state array).
fn bytes_of(caches: &[LayerCache]) -> usize {
    caches
        .iter()
        .flat_map(LayerCache::state)
        .map(|a| a.size() * a.dtype().size())
        .sum()
}

impl PrefixCache {
    /// A cache of at most `budget` bytes (0: nothing is kept).
    pub fn new(budget: usize) -> PrefixCache {
        PrefixCache {
            budget,
            entries: Vec::new(),
            clock: 0,
        }
    }

    /// The entry with the longest key that starts `prompt` and leaves at least its last token
    /// to feed, as shared copies.
    pub fn lookup(&mut self, namespace: &str, prompt: &[u32]) -> Option<Hit> {
        self.clock += 1;
        let usable = prompt.len().saturating_sub(1);
        let entry = self
            .entries
            .iter_mut()
            .filter(|e| {
                e.namespace == namespace
                    && e.tokens.len() <= usable
                    && prompt.starts_with(&e.tokens)
            })
            .max_by_key(|e| e.tokens.len())?;
        entry.last_used = self.clock;
        Some(Hit {
            cached: entry.tokens.len(),
            target: entry.target.clone(),
            draft: entry.draft.clone(),
        })
    }

    /// Stores the caches of `tokens` (replacing an entry with the same key), then evicts the
    /// least recently used entries until the budget holds. Caches bigger than the budget are
    /// not stored.
    pub fn insert(
        &mut self,
        namespace: &str,
        tokens: &[u32],
        target: &[LayerCache],
        draft: Option<&[LayerCache]>,
    ) {
        let bytes = bytes_of(target) + draft.map_or(0, bytes_of);
        if tokens.is_empty() || bytes > self.budget {
            return;
        }
        self.clock += 1;
        self.entries
            .retain(|e| !(e.namespace == namespace && e.tokens == tokens));
        self.entries.push(Entry {
            namespace: namespace.to_string(),
            tokens: tokens.to_vec(),
            target: target.to_vec(),
            draft: draft.map(<[LayerCache]>::to_vec),
            bytes,
            last_used: self.clock,
        });
        while self.bytes() > self.budget {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .expect("over budget means not empty");
            self.entries.remove(oldest);
        }
    }

    /// The bytes held now.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
