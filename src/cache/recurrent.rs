//! mlx-lm's ArraysCache(size=2) as the gated-DeltaNet layers use it: the last K-1 conv inputs
//! (activation dtype) and the f32 recurrent state (B, Hv, Dv, Dk). A state cannot be trimmed,
//! so a speculative round snapshots it and records the round's inputs; rolling back restores
//! the snapshot and replays the kept tokens through the conv and the delta rule, which gives
//! the bits of never having seen the rejected ones.

use std::rc::Rc;

use mlx::{ops, Array};

use super::gated_delta::{Recurrence, RecurrentStep};
use crate::{error::contract, Result};

/// What a gated-DeltaNet layer carries from token to token.
#[derive(Clone)]
pub struct RecurrentState {
    /// The last K-1 conv inputs.
    pub conv: Array,
    /// The f32 delta-rule state.
    pub state: Array,
}

/// State before a round, and the inputs fed during it.
#[derive(Clone)]
struct Round {
    before: Option<RecurrentState>,
    seen: usize,
    recurrence: Option<Recurrence>,
    /// (mixed_qkv, a, b) of each call in the round, in order.
    inputs: Vec<(Array, Array, Array)>,
}

#[derive(Clone, Default)]
pub struct RecurrentCache {
    /// None before the first token.
    state: Option<RecurrentState>,
    /// Tokens folded into the state so far.
    pub seen: usize,
    round: Option<Round>,
    /// The stacked states of the batch step that wrote `state` (row `.1` of them is `state`):
    /// the next step of the same rows in the same order starts from them as they are, where
    /// stacking the rows' states again would copy every one ([`RecurrentCache::advance_together`]).
    stacked: Option<(Rc<RecurrentState>, usize)>,
}

impl RecurrentCache {
    /// A cache holding a saved state (a prompt cache file). The file does not record how many
    /// tokens the state absorbed; only attention layers' offsets matter for decoding.
    pub fn from_state(state: Option<RecurrentState>) -> RecurrentCache {
        RecurrentCache {
            state,
            ..RecurrentCache::default()
        }
    }

    /// The state, None before the first token.
    pub fn current(&self) -> Option<&RecurrentState> {
        self.state.as_ref()
    }

    /// Puts `state` back as the state after `seen` tokens (a row giving back a token).
    pub fn restore(&mut self, state: Option<RecurrentState>, seen: usize) {
        self.state = state;
        self.seen = seen;
        self.stacked = None;
    }

    pub fn state(&self) -> Vec<&Array> {
        self.state
            .iter()
            .flat_map(|s| [&s.conv, &s.state])
            .collect()
    }

    fn run(&mut self, recurrence: &Recurrence, qkv: &Array, a: &Array, b: &Array) -> Result<Array> {
        let RecurrentStep { y, conv, state } = recurrence.run(self.state.as_ref(), qkv, a, b)?;
        self.state = Some(RecurrentState { conv, state });
        self.stacked = None;
        self.seen += qkv.dim(1) as usize;
        Ok(y)
    }

    /// Feeds S tokens' projected inputs through `recurrence`, updates the state, and returns
    /// the (B, S, Hv, Dv) outputs. Inside a round the inputs are kept for a replay.
    pub fn advance(
        &mut self,
        recurrence: &Recurrence,
        mixed_qkv: &Array,
        a: &Array,
        b: &Array,
    ) -> Result<Array> {
        if let Some(round) = &mut self.round {
            round.recurrence.get_or_insert_with(|| recurrence.clone());
            round.inputs.push((mixed_qkv.clone(), a.clone(), b.clone()));
        }
        self.run(recurrence, mixed_qkv, a, b)
    }

    /// Feeds one token of each row of `caches` through `recurrence` in one call over the rows'
    /// stacked states, row r's inputs at r of `mixed_qkv` (R, 1, conv_dim), `a` and `b` (R, 1,
    /// Hv); returns the (R, 1, Hv, Dv) outputs. For a batch decode step whose kernels give each
    /// row its own bits (the CPU's, MLX's batched ones on request): the host builds the conv and
    /// the delta rule once, not once per row. None, nothing fed, when a row has no state yet or
    /// is inside a speculative round (whose inputs it records for a replay). Rows that stepped
    /// together last, in the same order, start from that step's stacked states uncopied.
    pub fn advance_together(
        caches: &mut [&mut RecurrentCache],
        recurrence: &Recurrence,
        mixed_qkv: &Array,
        a: &Array,
        b: &Array,
    ) -> Result<Option<Array>> {
        let states: Option<Vec<&RecurrentState>> = (caches.iter())
            .map(|c| c.round.is_none().then_some(c.state.as_ref()).flatten())
            .collect();
        let Some(states) = states else {
            return Ok(None);
        };
        let from = match stacked_last(caches) {
            Some(stacked) => stacked.as_ref().clone(),
            None => {
                let stack = |pick: fn(&RecurrentState) -> &Array| -> mlx::Result<Array> {
                    ops::concatenate(&states.iter().map(|s| pick(s)).collect::<Vec<_>>(), 0)
                };
                RecurrentState {
                    conv: stack(|s| &s.conv)?,
                    state: stack(|s| &s.state)?,
                }
            }
        };
        let RecurrentStep { y, conv, state } = recurrence.run(Some(&from), mixed_qkv, a, b)?;
        let stacked = Rc::new(RecurrentState { conv, state });
        for (r, cache) in (0..).zip(caches.iter_mut()) {
            cache.state = Some(RecurrentState {
                conv: stacked.conv.slice_axis(0, r, r + 1)?,
                state: stacked.state.slice_axis(0, r, r + 1)?,
            });
            cache.seen += 1;
            cache.stacked = Some((stacked.clone(), r as usize));
        }
        Ok(Some(y))
    }

    /// Snapshots the state before a speculative round.
    pub fn begin_round(&mut self) {
        self.round = Some(Round {
            before: self.state.clone(),
            seen: self.seen,
            recurrence: None,
            inputs: Vec::new(),
        });
    }

    /// Ends the round keeping all but the last `reject` tokens fed during it: restores the
    /// snapshot and replays the kept tokens. Returns how many tokens were removed.
    pub fn end_round(&mut self, reject: usize) -> Result<usize> {
        let round = self
            .round
            .take()
            .ok_or_else(|| contract("end_round without begin_round"))?;
        let fed = self.seen - round.seen;
        if reject > fed {
            return Err(contract(format!(
                "cannot reject {reject} of the {fed} tokens of the round"
            )));
        }
        if reject == 0 {
            return Ok(0);
        }
        self.restore(round.before, round.seen);
        let keep = (fed - reject) as i32;
        if let (Some(rec), true) = (&round.recurrence, keep > 0) {
            let cat = |pick: fn(&(Array, Array, Array)) -> &Array| -> mlx::Result<Array> {
                let parts: Vec<&Array> = round.inputs.iter().map(pick).collect();
                ops::concatenate(&parts, 1)?.slice_axis(1, 0, keep)
            };
            let (qkv, a, b) = (cat(|i| &i.0)?, cat(|i| &i.1)?, cat(|i| &i.2)?);
            self.run(rec, &qkv, &a, &b)?;
        }
        Ok(reject)
    }
}

/// The stacked states every cache of `caches` is a row of, in order, if they are all the rows of
/// one batch step's.
fn stacked_last(caches: &[&mut RecurrentCache]) -> Option<Rc<RecurrentState>> {
    let (stacked, _) = caches.first()?.stacked.as_ref()?;
    let whole = stacked.state.dim(0) as usize == caches.len()
        && (caches.iter().enumerate()).all(
            |(r, c)| matches!(&c.stacked, Some((s, at)) if Rc::ptr_eq(s, stacked) && *at == r),
        );
    whole.then(|| stacked.clone())
}
