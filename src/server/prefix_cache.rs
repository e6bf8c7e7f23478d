//! The prefix cache across requests, keyed by token prefix and by a namespace naming everything
//! that shapes a cache (model, draft pairing, KV quantization, max_kv_size). It holds the
//! caches of prompts (all but their last token, as they stood after the prefill) and of
//! finished requests' prompts and answers, so a conversation's next turn prefills only what it
//! adds. For a speculative lane the target's and the draft model's caches are one entry,
//! stored and restored together. A byte budget bounds it; the least recently used entries go
//! first.
//!
//! An entry is a copy of immutable MLX arrays: the request that made it goes on writing to its
//! caches, and MLX copies a buffer rather than update it in place while this copy holds it, so
//! an entry never changes. That is also why restoring one is cheap: its arrays are shared.
//! mlx_lm.server keeps its prompt cache after generation for every request (server.py:1148);
//! with a draft model that goes wrong (known-oracle-bugs.toml, server-draft-with-prompt-cache),
//! which prefilling a speculative lane's answer onto its prompt's entry avoids
//! (`Engine::keep_answer`).

use mlx::Array;

use crate::cache::LayerCache;
use crate::decode::Start;
use crate::speculative::DraftPrefix;

/// One stored prompt prefix.
struct Entry {
    namespace: String,
    tokens: Vec<u32>,
    target: Vec<LayerCache>,
    draft: Option<DraftPrefix>,
    bytes: usize,
    last_used: u64,
}

impl Entry {
    /// Whether every cache of the entry can be cut back to a shorter prefix exactly.
    fn trims(&self) -> bool {
        all_trim(&self.target) && self.draft.as_ref().is_none_or(DraftPrefix::trims)
    }
}

/// Whether every cache of `caches` can be cut back to a shorter prefix exactly (KV caches).
pub fn all_trim(caches: &[LayerCache]) -> bool {
    caches.iter().all(|c| matches!(c, LayerCache::Kv(_)))
}

/// A restored prefix: how many prompt tokens the caches hold, and copies of them.
pub struct Hit {
    pub cached: usize,
    pub target: Vec<LayerCache>,
    pub draft: Option<DraftPrefix>,
}

impl Hit {
    /// Where a decode starts from a lookup's result: the restored prefix, or fresh caches.
    pub fn start(hit: Option<Hit>) -> Start {
        match hit {
            Some(h) => Start::Prefix {
                caches: h.target,
                draft: h.draft,
                cached: h.cached,
            },
            None => Start::Fresh,
        }
    }
}

/// The stored prefixes under a byte budget.
pub struct PrefixCache {
    budget: usize,
    entries: Vec<Entry>,
    clock: u64,
}

/// The bytes of `arrays`.
fn bytes_of<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> usize {
    arrays
        .into_iter()
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

    /// The entry that holds the most of `prompt` but its last token (which must be fed), as
    /// shared copies: an entry whose key starts the prompt, or a longer one that shares a
    /// prefix with it and whose caches all trim (KV caches), cut back to that prefix, as the
    /// next turn of a conversation that renders the last answer otherwise than it was
    /// generated. `resume(n)` is the furthest point up to `n` that the prompt's prefill may go
    /// on from (`n` itself but for a model whose one-token forward takes its own path:
    /// [`crate::model::LanguageModel::one_token_path`]).
    pub fn lookup(
        &mut self,
        namespace: &str,
        prompt: &[u32],
        resume: impl Fn(usize) -> usize,
    ) -> Option<Hit> {
        self.clock += 1;
        let usable = &prompt[..prompt.len().saturating_sub(1)];
        let (entry, reach) = self
            .entries
            .iter_mut()
            .filter(|e| e.namespace == namespace)
            .filter_map(|e| {
                let shared = e
                    .tokens
                    .iter()
                    .zip(usable)
                    .take_while(|(a, b)| a == b)
                    .count();
                let reach = if e.trims() {
                    resume(shared)
                } else if shared == e.tokens.len() && resume(shared) == shared {
                    shared
                } else {
                    0
                };
                (reach > 0).then_some((e, reach))
            })
            .max_by_key(|(_, reach)| *reach)?;
        entry.last_used = self.clock;
        let cut = entry.tokens.len() - reach;
        let (mut target, mut draft) = (entry.target.clone(), entry.draft.clone());
        if cut > 0 {
            const TRIMS: &str = "entries that are cut back trim";
            for c in &mut target {
                c.trim(cut).expect(TRIMS);
            }
            if let Some(d) = &mut draft {
                d.trim(cut).expect(TRIMS);
            }
        }
        Some(Hit {
            cached: reach,
            target,
            draft,
        })
    }

    /// Stores the caches of `tokens`, replacing an entry with the same key and, when the new
    /// caches trim, every entry whose key starts it (the new one serves their lookups), then
    /// evicts the least recently used entries until the budget holds. Caches bigger than the
    /// budget are not stored, nor caches a prefill cannot go on from exactly
    /// ([`LayerCache::resumes_exactly`]).
    pub fn insert(
        &mut self,
        namespace: &str,
        tokens: &[u32],
        target: &[LayerCache],
        draft: Option<&DraftPrefix>,
    ) {
        let bytes = bytes_of(target.iter().flat_map(LayerCache::state))
            + draft.map_or(0, |d| bytes_of(d.arrays()));
        let draft_caches = match draft {
            Some(DraftPrefix::Caches(caches)) => caches.as_slice(),
            _ => &[],
        };
        let exact = target
            .iter()
            .chain(draft_caches)
            .all(LayerCache::resumes_exactly);
        if tokens.is_empty() || bytes > self.budget || !exact {
            return;
        }
        self.clock += 1;
        let entry = Entry {
            namespace: namespace.to_string(),
            tokens: tokens.to_vec(),
            target: target.to_vec(),
            draft: draft.cloned(),
            bytes,
            last_used: self.clock,
        };
        let supersedes = entry.trims();
        self.entries.retain(|e| {
            let covered = if supersedes {
                tokens.starts_with(&e.tokens)
            } else {
                e.tokens == tokens
            };
            !(e.namespace == namespace && covered)
        });
        self.entries.push(entry);
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
