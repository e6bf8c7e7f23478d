//! A smaller model as the draft source, with mlx-lm's draft bookkeeping: the draft model is
//! prefilled with the prompt minus its last token, drafts with the request's sampler, and after
//! a round keeps what it fed up to the accepted drafts; when every draft was accepted, the last
//! one (sampled but never fed) is fed next round together with the target's bonus token.

use mlx::Array;

use super::{DraftContext, DraftSource, Verified};
use crate::cache::{begin_round, end_round, rollback_plan, LayerCache, Rollback};
use crate::generate::{forward_tokens, last_logits, prefill, token_array};
use crate::model::LanguageModel;
use crate::{Error, Result};

pub struct DraftModel<'m> {
    model: &'m dyn LanguageModel,
    caches: Vec<LayerCache>,
    /// Prompt tokens the caches already hold (from a prefix cache).
    cached: usize,
    /// Tokens the draft model has not been fed yet.
    pending: Vec<u32>,
    /// This round's drafts and how many tokens were fed to the draft model for them.
    round: Option<(Vec<u32>, usize)>,
}

impl<'m> DraftModel<'m> {
    pub fn new(model: &'m dyn LanguageModel) -> DraftModel<'m> {
        Self::resume(model, model.make_cache(None), 0)
    }

    /// A draft model whose `caches` already hold the first `cached` prompt tokens (a prefix
    /// cache's copy, stored together with the target's): its prefill feeds only the rest.
    pub fn resume(
        model: &'m dyn LanguageModel,
        caches: Vec<LayerCache>,
        cached: usize,
    ) -> DraftModel<'m> {
        DraftModel {
            model,
            caches,
            cached,
            pending: Vec::new(),
            round: None,
        }
    }

    /// The model's next-token logits (1, V) after feeding the 1-D token ids `tokens`.
    fn step(&mut self, tokens: &Array, ctx: &DraftContext<'_>) -> Result<Array> {
        let kv = ctx.params.kv_quantization.as_ref();
        let logits = forward_tokens(self.model, &mut self.caches, tokens, kv)?;
        Ok(last_logits(&logits)?)
    }
}

impl DraftSource for DraftModel<'_> {
    fn prefill(&mut self, prompt: &[u32], ctx: &mut DraftContext<'_>) -> Result<()> {
        let (last, head) = prompt
            .split_last()
            .ok_or_else(|| Error::Params("the prompt is empty".into()))?;
        let rest = head.get(self.cached..).ok_or_else(|| {
            Error::Contract(format!(
                "the draft caches hold {} tokens, more than the prompt's {}",
                self.cached,
                head.len()
            ))
        })?;
        prefill(
            self.model,
            &mut self.caches,
            &token_array(rest)?,
            ctx.params,
            |_| Ok(()),
        )?;
        self.pending = vec![*last];
        Ok(())
    }

    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> Result<Vec<u32>> {
        let fed = self.pending.len() + n.saturating_sub(1);
        if n == 0 || matches!(rollback_plan(&self.caches, fed), Rollback::Refuse(_)) {
            return Ok(Vec::new());
        }
        begin_round(&mut self.caches);
        let mut input = token_array(&std::mem::take(&mut self.pending))?;
        let mut drafts = Vec::with_capacity(n);
        if ctx.needs_draft_ids() {
            for _ in 0..n {
                let logits = self.step(&input, ctx)?;
                let token = ctx.sample(&logits, &drafts)?;
                let token = token.astype(mlx::Dtype::Uint32)?.item::<u32>()?;
                drafts.push(token);
                input = token_array(&[token])?;
            }
        } else {
            // As mlx-lm's _draft_generate: each sampled draft is fed back as an array and
            // enqueued at once, so the round waits for the host only once, for all of them.
            let mut sampled = Vec::with_capacity(n);
            for _ in 0..n {
                let logits = self.step(&input, ctx)?;
                input = ctx.sample(&logits, &[])?;
                mlx::async_eval([&input])?;
                sampled.push(input.clone());
            }
            let sampled: Vec<&Array> = sampled.iter().collect();
            drafts = mlx::ops::concatenate(&sampled, 0)?
                .astype(mlx::Dtype::Uint32)?
                .to_vec::<u32>()?;
        }
        self.round = Some((drafts.clone(), fed));
        Ok(drafts)
    }

    fn commit(&mut self, round: &Verified<'_>) -> Result<()> {
        let (drafted, accepted, next) = (round.drafted, round.accepted, round.next);
        let Some((drafts, fed)) = self.round.take() else {
            // Nothing drafted this round: the target's token joins what is still to be fed.
            self.pending.extend(next);
            return Ok(());
        };
        debug_assert_eq!(drafts.len(), drafted);
        // Fed: the pending tokens and drafts 1..n-1. Keep the pending ones and the accepted drafts.
        let kept_drafts = accepted.min(drafted - 1);
        let pending_fed = fed - (drafted - 1);
        end_round(&mut self.caches, fed - pending_fed - kept_drafts)?;
        self.pending = if accepted == drafted {
            vec![drafts[drafted - 1]]
        } else {
            Vec::new()
        };
        self.pending.extend(next);
        Ok(())
    }

    fn draft_model(&self) -> Option<&dyn LanguageModel> {
        Some(self.model)
    }

    fn caches(&self) -> Option<&[LayerCache]> {
        Some(&self.caches)
    }
}
