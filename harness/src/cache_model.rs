//! Reference models of every cache kind in plain Rust, and proptest strategies over the
//! operations a decoder performs on a cache: append k tokens, trim, and speculative rounds that
//! append then reject a tail (docs/DESIGN.md, "Caches and rollback").
//!
//! A reference tracks token ids, not tensors: which tokens a cache makes visible to attention
//! (in temporal order) or, for a recurrent cache, which tokens its state has absorbed. An engine
//! test applies the same operations to its real cache, writing keys that encode each token's id,
//! and compares after every step.

use proptest::prelude::*;

/// The cache kinds of the rollback contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Kv,
    QuantizedKv,
    /// A ring of `max_size` slots whose first `keep` slots are never overwritten.
    Rotating {
        max_size: usize,
        keep: usize,
    },
    /// Gated-DeltaNet conv + delta-rule state: not trimmable, rolled back by snapshot + replay.
    Recurrent,
}

/// One operation on a cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Append `k` new tokens in one model call.
    Append(usize),
    /// Drop the last `n` tokens (KV kinds only, as mlx-lm's trim: capped at the length).
    Trim(usize),
    /// A speculative round: ask whether `chunks.sum()` tokens could be taken back; if so,
    /// append them in calls of the given sizes, then reject the last `reject` of them. With
    /// `one_at_a_time`, a rotating cache takes each call's tokens one at a time, as a decode
    /// forward on the lone-row path writes them.
    Round {
        chunks: Vec<usize>,
        reject: usize,
        one_at_a_time: bool,
    },
}

/// What a cache must answer before a round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    Trim,
    SnapshotReplay,
    /// Restore the state the kept tokens left (a rotating cache written one token at a time).
    Restore,
    Refuse,
}

/// The reference cache: token ids, assigned 0, 1, 2, ... in append order.
#[derive(Clone, Debug)]
pub struct RefCache {
    pub kind: Kind,
    /// Visible tokens in temporal order (KV kinds, rotating), or absorbed tokens (recurrent).
    visible: Vec<u32>,
    /// Tokens appended in total and not taken back (the RoPE offset).
    pub offset: usize,
    next_id: u32,
}

impl RefCache {
    pub fn new(kind: Kind) -> RefCache {
        RefCache {
            kind,
            visible: Vec::new(),
            offset: 0,
            next_id: 0,
        }
    }

    /// The ids attention sees (in temporal order), or the ids a recurrent state absorbed.
    pub fn visible(&self) -> &[u32] {
        &self.visible
    }

    /// The ids the next `k` appended tokens get.
    pub fn next_ids(&self, k: usize) -> Vec<u32> {
        (self.next_id..self.next_id + k as u32).collect()
    }

    /// Appends `k` tokens in one call.
    pub fn append(&mut self, k: usize) -> Vec<u32> {
        let ids = self.next_ids(k);
        self.next_id += k as u32;
        self.offset += k;
        match self.kind {
            Kind::Rotating { max_size, keep } => self.rotate_in(&ids, max_size, keep),
            _ => self.visible.extend(&ids),
        }
        ids
    }

    /// mlx-lm's RotatingKVCache, seen in temporal order: a single token replaces the oldest
    /// entry after the kept prefix once the window is full (after shrinking back to the window
    /// if a multi-token call grew it); a multi-token call first drops entries so the window
    /// holds `max_size - 1` old ones, then appends all new tokens, so every new query sees a
    /// full window.
    fn rotate_in(&mut self, ids: &[u32], max_size: usize, keep: usize) {
        let drop_after_keep = |v: &mut Vec<u32>, n: usize| {
            let keep = keep.min(v.len());
            let n = n.min(v.len() - keep);
            v.drain(keep..keep + n);
        };
        if ids.len() == 1 {
            let len = self.visible.len();
            if len > max_size {
                drop_after_keep(&mut self.visible, len - max_size);
            }
            if self.visible.len() == max_size {
                drop_after_keep(&mut self.visible, 1);
            }
        } else if !self.visible.is_empty() {
            let trim = self.visible.len() as isize - max_size as isize + 1;
            if trim > 0 {
                drop_after_keep(&mut self.visible, trim as usize);
            }
        }
        self.visible.extend(ids);
    }

    /// Drops the last `n` tokens, capped at the length; returns how many.
    pub fn trim(&mut self, n: usize) -> usize {
        assert!(
            matches!(self.kind, Kind::Kv | Kind::QuantizedKv),
            "only KV kinds trim freely"
        );
        let n = n.min(self.visible.len());
        self.visible.truncate(self.visible.len() - n);
        self.offset -= n;
        n
    }

    /// The answer a correct cache gives before a round of `round_len` tokens, written one
    /// token at a time when `one_at_a_time`.
    pub fn plan(&self, round_len: usize, one_at_a_time: bool) -> Plan {
        match self.kind {
            Kind::Kv | Kind::QuantizedKv => Plan::Trim,
            Kind::Recurrent => Plan::SnapshotReplay,
            Kind::Rotating { max_size, .. } if self.offset + round_len <= max_size => Plan::Trim,
            Kind::Rotating { .. } if one_at_a_time => Plan::Restore,
            Kind::Rotating { .. } => Plan::Refuse,
        }
    }

    /// A round the plan allows: the cache ends as if only the kept tokens had been appended,
    /// one at a time when the round wrote them so (the rejected ids are never reused, as a
    /// real round's draft tokens are discarded).
    pub fn round(&mut self, chunks: &[usize], reject: usize, one_at_a_time: bool) {
        let total: usize = chunks.iter().sum();
        assert!(self.plan(total, one_at_a_time) != Plan::Refuse && reject <= total);
        let kept = total - reject;
        if one_at_a_time {
            (0..kept).for_each(|_| {
                self.append(1);
            });
        } else if kept > 0 {
            self.append(kept);
        }
        self.next_id += reject as u32;
    }
}

/// Operations valid for `kind`, at most `max_ops` of them.
pub fn ops(kind: Kind, max_ops: usize) -> impl Strategy<Value = Vec<Op>> {
    let append = (1usize..=6).prop_map(Op::Append);
    let round = (
        prop::collection::vec(1usize..=4, 1..=3),
        0usize..=12,
        any::<bool>(),
    )
        .prop_map(|(chunks, r, one_at_a_time)| {
            let total: usize = chunks.iter().sum();
            Op::Round {
                reject: r % (total + 1),
                chunks,
                one_at_a_time,
            }
        });
    let op = match kind {
        Kind::Kv | Kind::QuantizedKv => {
            prop_oneof![3 => append, 1 => (0usize..=8).prop_map(Op::Trim), 3 => round].boxed()
        }
        _ => prop_oneof![1 => append, 1 => round].boxed(),
    };
    prop::collection::vec(op, 1..=max_ops)
}

/// Rotating caches with small windows, with and without a kept prefix.
pub fn rotating_kind() -> impl Strategy<Value = Kind> {
    (4usize..=12, 0usize..=3).prop_map(|(max_size, keep)| Kind::Rotating {
        max_size,
        keep: keep.min(max_size - 1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rotating(max_size: usize, keep: usize) -> RefCache {
        RefCache::new(Kind::Rotating { max_size, keep })
    }

    #[test]
    fn kv_round_keeps_only_accepted_tokens() {
        let mut c = RefCache::new(Kind::Kv);
        c.append(3);
        c.round(&[4], 2, false);
        assert_eq!(c.visible(), &[0, 1, 2, 3, 4]);
        c.append(1);
        assert_eq!(c.visible(), &[0, 1, 2, 3, 4, 7]);
    }

    /// Appends calls of `k` tokens to `c`, checking what it makes visible after each.
    fn check_appends(mut c: RefCache, steps: &[(usize, &[u32])]) {
        for (k, want) in steps {
            c.append(*k);
            assert_eq!(c.visible(), *want, "after a call of {k}");
        }
    }

    #[test]
    fn rotating_single_tokens_keep_the_prefix_and_the_newest() {
        let full: [&[u32]; 6] = [
            &[0],
            &[0, 1],
            &[0, 1, 2],
            &[0, 1, 2, 3],
            &[0, 2, 3, 4],
            &[0, 3, 4, 5],
        ];
        check_appends(rotating(4, 1), &full.map(|v| (1, v)));
    }

    #[test]
    fn rotating_multi_token_call_grows_to_window_minus_one_plus_new() {
        // A first call is stored whole; later ones keep window - 1 old entries plus the new.
        let steps: [(usize, &[u32]); 3] = [
            (5, &[0, 1, 2, 3, 4]),
            (2, &[2, 3, 4, 5, 6]),
            (1, &[4, 5, 6, 7]),
        ];
        check_appends(rotating(4, 0), &steps);
    }

    #[test]
    fn rotating_refuses_a_round_that_would_wrap_unless_written_one_at_a_time() {
        let mut c = rotating(8, 0);
        c.append(5);
        assert_eq!(c.plan(3, false), Plan::Trim);
        assert_eq!(c.plan(4, false), Plan::Refuse);
        assert_eq!(c.plan(4, true), Plan::Restore);
    }

    #[test]
    fn rotating_round_written_one_at_a_time_keeps_the_newest_window() {
        let mut c = rotating(4, 0);
        c.append(3);
        c.round(&[2, 2], 1, true);
        assert_eq!(c.visible(), &[2, 3, 4, 5]);
        assert_eq!(c.offset, 6);
        assert_eq!(c.next_ids(1), vec![7]);
    }
}
