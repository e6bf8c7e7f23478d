//! mlx-lm's ArraysCache(size=2) as the gated-DeltaNet layers use it: the last K-1 conv inputs
//! (activation dtype) and the f32 recurrent state (B, Hv, Dv, Dk). A state cannot be trimmed,
//! so a speculative round snapshots it and records the round's inputs; rolling back restores
//! the snapshot and replays the kept tokens through the conv and the delta rule, which gives
//! the bits of never having seen the rejected ones.

use mlx::{ops, Array, Result};

use crate::model::gated_delta::Recurrence;

/// State before a round, and the inputs fed during it.
#[derive(Clone)]
struct Round {
    conv: Option<Array>,
    state: Option<Array>,
    seen: usize,
    recurrence: Option<Recurrence>,
    /// (mixed_qkv, a, b) of each call in the round, in order.
    inputs: Vec<(Array, Array, Array)>,
}

#[derive(Clone, Default)]
pub struct RecurrentCache {
    pub conv: Option<Array>,
    pub state: Option<Array>,
    /// Tokens folded into the state so far.
    pub seen: usize,
    round: Option<Round>,
}

impl RecurrentCache {
    /// A cache holding a saved state (a prompt cache file). The file does not record how many
    /// tokens the state absorbed; only attention layers' offsets matter for decoding.
    pub fn from_state(conv: Option<Array>, state: Option<Array>) -> RecurrentCache {
        RecurrentCache {
            conv,
            state,
            ..RecurrentCache::default()
        }
    }

    pub fn state(&self) -> Vec<&Array> {
        self.conv.iter().chain(self.state.iter()).collect()
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
        let step = recurrence.run(self.conv.as_ref(), self.state.as_ref(), mixed_qkv, a, b)?;
        if let Some(round) = &mut self.round {
            round.recurrence.get_or_insert_with(|| recurrence.clone());
            round.inputs.push((mixed_qkv.clone(), a.clone(), b.clone()));
        }
        self.conv = Some(step.conv);
        self.state = Some(step.state);
        self.seen += mixed_qkv.dim(1) as usize;
        Ok(step.y)
    }

    /// Snapshots the state before a speculative round.
    pub fn begin_round(&mut self) {
        self.round = Some(Round {
            conv: self.conv.clone(),
            state: self.state.clone(),
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
            .ok_or_else(|| mlx::Error::Invalid("end_round without begin_round".into()))?;
        let fed = self.seen - round.seen;
        if reject > fed {
            return Err(mlx::Error::Invalid(format!(
                "cannot reject {reject} of the {fed} tokens of the round"
            )));
        }
        if reject == 0 {
            return Ok(0);
        }
        self.conv = round.conv;
        self.state = round.state;
        self.seen = round.seen;
        let keep = (fed - reject) as i32;
        if let (Some(rec), true) = (&round.recurrence, keep > 0) {
            let cat = |pick: fn(&(Array, Array, Array)) -> &Array| -> Result<Array> {
                let parts: Vec<&Array> = round.inputs.iter().map(pick).collect();
                ops::concatenate(&parts, 1)?.slice_axis(1, 0, keep)
            };
            let (qkv, a, b) = (cat(|i| &i.0)?, cat(|i| &i.1)?, cat(|i| &i.2)?);
            let step = rec.run(self.conv.as_ref(), self.state.as_ref(), &qkv, &a, &b)?;
            self.conv = Some(step.conv);
            self.state = Some(step.state);
            self.seen += keep as usize;
        }
        Ok(reject)
    }
}
