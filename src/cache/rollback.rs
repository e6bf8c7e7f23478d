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
    /// The round's tokens could not be taken back exactly; do not start it.
    Refuse(String),
}

impl LayerCache {
    /// How this cache would undo up to `round_len` tokens appended in the next round.
    pub fn rollback_plan(&self, round_len: usize) -> Rollback {
        match self {
            LayerCache::Kv(_) | LayerCache::QuantizedKv(_) => Rollback::Trim,
            LayerCache::Recurrent(_) => Rollback::SnapshotReplay,
            LayerCache::Rotating(c) if c.offset + round_len <= c.max_size => Rollback::Trim,
            LayerCache::Rotating(c) => Rollback::Refuse(format!(
                "a rotating cache of {} holding {} tokens would wrap during a round of {round_len}",
                c.max_size, c.offset
            )),
        }
    }

    /// Opens a round: remembers where it starts (and snapshots recurrent state).
    pub fn begin_round(&mut self) {
        match self {
            LayerCache::Kv(c) => c.round_start = Some(c.offset),
            LayerCache::QuantizedKv(c) => c.round_start = Some(c.offset),
            LayerCache::Rotating(c) => c.round_start = Some(c.offset),
            LayerCache::Recurrent(c) => c.begin_round(),
        }
    }

    /// Closes the round keeping all but the last `reject` tokens appended during it. Fails —
    /// rather than leaving stale entries — when that cannot be done exactly.
    pub fn end_round(&mut self, reject: usize) -> Result<usize> {
        let checked = |start: Option<usize>, offset: usize| -> Result<()> {
            let start = start.ok_or_else(|| contract("end_round without begin_round"))?;
            if reject > offset - start {
                return Err(contract(format!(
                    "cannot reject {reject} of the {} tokens of the round",
                    offset - start
                )));
            }
            Ok(())
        };
        match self {
            LayerCache::Kv(c) => {
                checked(c.round_start.take(), c.offset)?;
                Ok(c.trim(reject))
            }
            LayerCache::QuantizedKv(c) => {
                checked(c.round_start.take(), c.offset)?;
                Ok(c.trim(reject))
            }
            LayerCache::Rotating(c) => {
                let start = c.round_start.take();
                checked(start, c.offset)?;
                if reject > 0 && c.offset > c.max_size {
                    return Err(contract(format!(
                        "the rotating cache wrapped during the round ({} tokens in a window of {}); \
                         its evicted entries cannot be restored",
                        c.offset, c.max_size
                    )));
                }
                Ok(c.trim(reject))
            }
            LayerCache::Recurrent(c) => c.end_round(reject),
        }
    }
}

/// The plan for a model's caches: refuse if any layer refuses, else replay if any must.
pub fn rollback_plan(caches: &[LayerCache], round_len: usize) -> Rollback {
    let mut plan = Rollback::Trim;
    for c in caches {
        match c.rollback_plan(round_len) {
            refuse @ Rollback::Refuse(_) => return refuse,
            Rollback::SnapshotReplay => plan = Rollback::SnapshotReplay,
            Rollback::Trim => {}
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
