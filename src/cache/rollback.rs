//! The rollback contract (docs/DESIGN.md, "Caches and rollback"). Before a speculative round the caller asks each
//! cache whether the round's tokens could be taken back; the answer is trim, snapshot + replay,
//! or a refusal before the round — never a silent no-op after it (mlx-lm's trim_prompt_cache
//! returns 0 and trims nothing once a sliding window has wrapped, mlx-lm #1914).

use super::LayerCache;
use crate::{error::contract, Result};

/// How a cache would take back the rejected tail of a round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rollback {
    /// Move the write position back; dropped entries are overwritten later.
    Trim,
    /// Restore the state from before the round and replay the kept tokens.
    SnapshotReplay,
    /// Restore the state the kept tokens left, kept token by token during the round: a rotating
    /// cache past its window, whose round's forward writes its tokens one at a time.
    Restore,
    /// The round's tokens could not be taken back exactly; do not start it.
    Refuse(String),
}

impl LayerCache {
    /// How this cache would undo up to `round_len` tokens appended in the next round, whose
    /// forward writes its tokens one at a time when `one_token_writes` (a decode forward on the
    /// lone-row path, `crate::model::lone_rows::exact_decode`).
    pub fn rollback_plan(&self, round_len: usize, one_token_writes: bool) -> Rollback {
        match self {
            LayerCache::Kv(_) | LayerCache::QuantizedKv(_) => Rollback::Trim,
            LayerCache::Recurrent(_) => Rollback::SnapshotReplay,
            LayerCache::Rotating(c) if c.offset + round_len <= c.max_size => Rollback::Trim,
            LayerCache::Rotating(_) if one_token_writes => Rollback::Restore,
            LayerCache::Batch(_) | LayerCache::RecurrentRows(_) => {
                Rollback::Refuse("a batch cache's rows take rounds in caches of their own".into())
            }
            LayerCache::Rotating(c) => Rollback::Refuse(format!(
                "a rotating cache of {} holding {} tokens would wrap during a round of \
                 {round_len} written several tokens at a time",
                c.max_size, c.offset
            )),
        }
    }

    /// Opens a round: remembers where it starts (and snapshots recurrent state).
    pub fn begin_round(&mut self) {
        match self {
            LayerCache::Kv(c) => c.round_start = Some(c.offset),
            LayerCache::QuantizedKv(c) => c.round_start = Some(c.offset),
            LayerCache::Rotating(c) => c.begin_round(),
            LayerCache::Recurrent(c) => c.begin_round(),
            LayerCache::Batch(_) | LayerCache::RecurrentRows(_) => {}
        }
    }

    /// Closes the round keeping all but the last `reject` tokens appended during it. Fails —
    /// rather than leaving stale entries — when that cannot be done exactly.
    pub fn end_round(&mut self, reject: usize) -> Result<usize> {
        match self {
            LayerCache::Kv(c) => {
                round_written(c.round_start.take(), c.offset, reject)?;
                Ok(c.trim(reject))
            }
            LayerCache::QuantizedKv(c) => {
                round_written(c.round_start.take(), c.offset, reject)?;
                Ok(c.trim(reject))
            }
            LayerCache::Rotating(c) => c.end_round(reject),
            LayerCache::Recurrent(c) => c.end_round(reject),
            LayerCache::Batch(_) | LayerCache::RecurrentRows(_) => {
                Err(contract("a batch cache takes no speculative rounds"))
            }
        }
    }
}

/// The tokens a round that began at offset `start` (None: no open round) wrote by `offset`,
/// checked to hold the `reject` to take back.
pub(super) fn round_written(start: Option<usize>, offset: usize, reject: usize) -> Result<usize> {
    let start = start.ok_or_else(|| contract("end_round without begin_round"))?;
    let written = offset - start;
    if reject > written {
        return Err(contract(format!(
            "cannot reject {reject} of the {written} tokens of the round"
        )));
    }
    Ok(written)
}

/// The plan for a model's caches: refuse if any layer refuses, else replay if any must, else
/// restore if any must.
pub fn rollback_plan(caches: &[LayerCache], round_len: usize, one_token_writes: bool) -> Rollback {
    let mut plan = Rollback::Trim;
    for c in caches {
        match c.rollback_plan(round_len, one_token_writes) {
            refuse @ Rollback::Refuse(_) => return refuse,
            Rollback::SnapshotReplay => plan = Rollback::SnapshotReplay,
            Rollback::Restore if plan == Rollback::Trim => plan = Rollback::Restore,
            Rollback::Restore | Rollback::Trim => {}
        }
    }
    plan
}

/// Opens a round on every cache.
pub fn begin_round(caches: &mut [LayerCache]) {
    caches.iter_mut().for_each(LayerCache::begin_round);
}

/// Closes the round on every cache, rejecting its last `reject` tokens.
pub fn end_round(caches: &mut [LayerCache], reject: usize) -> Result<()> {
    for c in caches {
        c.end_round(reject)?;
    }
    Ok(())
}
