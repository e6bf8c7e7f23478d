//! Where each random draw's key comes from. mlx-lm seeds one global key and splits it once per
//! draw (`mlx::random::KeySequence`), so a token's draw depends on every draw before it.
//! mlx-vlm 0.7.10, given a seed and plain temperature (or top-k) sampling, keys each generated
//! position on its own instead (mlx_vlm/generate/ar.py:75-148, `_PositionedTargetSampler`):
//! the token at position p is drawn with `key(_position_seed(seed, 0, p))` however many draws
//! came before, so a speculative round samples the same tokens plain decoding would.

use mlx::random::{self, KeySequence};
use mlx::Array;
use serde::{Deserialize, Serialize};

use crate::Result;

/// How a seeded request keys its draws (a trace's `params.keys`, `verity generate --keys`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeySchedule {
    /// mlx-lm: `mx.random.seed(seed)`, then one split per draw.
    #[default]
    Sequence,
    /// mlx-vlm's positioned sampler: one key per generated position.
    Positioned,
}

/// A request's key state.
pub(crate) enum SampleKeys {
    Sequence(KeySequence),
    /// The next draw samples generated position `next` (the first token is position 0).
    Positioned {
        seed: u64,
        next: usize,
    },
}

impl SampleKeys {
    pub fn new(schedule: KeySchedule, seed: u64) -> Result<SampleKeys> {
        Ok(match schedule {
            KeySchedule::Sequence => SampleKeys::Sequence(KeySequence::new(seed)?),
            KeySchedule::Positioned => SampleKeys::Positioned { seed, next: 0 },
        })
    }

    /// Takes back the last `n` positions drawn but not emitted (a speculative round's rejected
    /// rows), so the next draw samples the position after the last emitted token. A key
    /// sequence has no positions: mlx-lm's drafts and verifies consume keys for good.
    pub fn rewind(&mut self, n: usize) {
        if let SampleKeys::Positioned { next, .. } = self {
            *next -= n;
        }
    }
}

/// `_position_seed(seed, row_id, position)` (mlx_vlm/generate/ar.py:75-82): a 32-bit mix of the
/// request seed's low 32 bits with the batch row and the generated position.
pub fn position_seed(seed: u64, row: u64, position: u64) -> u32 {
    let mut x = (seed as u32) ^ 0x9E37_79B9;
    x = x.wrapping_add((row as u32).wrapping_add(1).wrapping_mul(0x85EB_CA6B));
    x ^= (position as u32).wrapping_add(1).wrapping_mul(0xC2B2_AE35);
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x
}

/// The key of generated position `position` in row 0 (`_position_keys`).
pub fn position_key(seed: u64, position: usize) -> mlx::Result<Array> {
    random::key(u64::from(position_seed(seed, 0, position as u64)))
}

#[cfg(test)]
mod tests {
    use super::position_seed;

    /// Values printed by mlx-vlm's `_position_seed` for the same arguments, including a seed
    /// past 32 bits (only its low half counts) and a nonzero row.
    #[test]
    fn position_seed_matches_mlx_vlm() {
        assert_eq!(position_seed(7, 0, 0), 126_315_207);
        assert_eq!(position_seed((1 << 40) + 5, 3, 9), 2_941_884_255);
    }
}
