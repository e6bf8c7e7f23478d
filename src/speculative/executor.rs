//! The one verify/accept executor, with mlx-lm's speculative_generate_step semantics: the prompt
//! minus its last token is prefilled (draft source first); each round drafts up to
//! `min(num_draft_tokens, max_tokens - emitted)` tokens, verifies `[last, d1..dk]` in one target
//! forward, accepts drafts while they equal the target's own sample at their position, then
//! emits the target's token at the first mismatch (or a bonus after all k, unless max_tokens is
//! reached), and takes the rejected tail back through the rollback contract.
//!
//! A source in `PrefillMode::Full` (mlx-vlm's loop) instead has the target take the whole prompt
//! first: the first token comes from the last prompt row, is emitted, and seeds the source with
//! that row's hidden taps; rounds then verify `[last emitted, drafts...]` as above. The tapped
//! hidden rows of every verify forward go to the source with the round's outcome.
//!
//! Verity departs from mlx-lm in two places, both so that speculation never changes output:
//! logits processors see the same history as in plain decoding (mlx-lm hides the prompt from
//! them when speculating), and a round the target caches could not take back is refused before
//! it starts and decoded without drafts (mlx-lm trims nothing and goes on, #1914).

use mlx::{Array, Dtype};

use super::{DraftContext, DraftSource, PrefillMode, SpeculationStats, Verified};
use crate::cache::{begin_round, end_round, rollback_plan, LayerCache, Rollback};
use crate::generate::{
    forward_tapped, prefill_tapped, token_array, GenerateParams, GeneratedToken, Resume,
};
use crate::grammar::Constraint;
use crate::model::LanguageModel;
use crate::request::Control;
use crate::sample::{Masking, StepSampler};
use crate::{validate, Result};

struct Executor<'a> {
    model: &'a dyn LanguageModel,
    caches: Vec<LayerCache>,
    sampler: StepSampler,
    params: &'a GenerateParams,
    stats: SpeculationStats,
    /// The target hidden states the source taps.
    taps: Vec<usize>,
}

impl Executor<'_> {
    /// One target forward over `input` (the last emitted token and the drafts); returns the
    /// target's token and logprobs (V,) at each position it examined, and the tapped hidden
    /// states over all of `input`. Without processors or a
    /// grammar every position is sampled in one (k+1, V) call, as mlx-lm does. Otherwise the
    /// walk goes position by position, each processed with the history it would have in plain
    /// decoding and masked by the grammar advanced over the walk so far, and stops at the first
    /// rejected draft, an EOS, or a finished grammar.
    fn verify(&mut self, input: &[u32]) -> Result<(Vec<u32>, Vec<Array>, Vec<Array>)> {
        let kv = self.params.kv_quantization.as_ref();
        let out = forward_tapped(
            self.model,
            &mut self.caches,
            &token_array(input)?,
            kv,
            &self.taps,
        )?;
        let logits = out.logits.squeeze(&[0])?;
        let positions = input.len() as i32;
        let (tokens, logprobs) = if self.sampler.has_processors() || self.sampler.is_constrained() {
            let (mut tokens, mut rows) = (Vec::new(), Vec::new());
            for i in 0..positions {
                let row = logits.slice_axis(0, i, i + 1)?;
                let mut fed = input[..1].to_vec();
                fed.extend(&tokens);
                let processed = self.sampler.process(&row, &fed, Masking::Grammar)?;
                let lp = processed.subtract(&processed.logsumexp(&[-1], true)?)?;
                let t = self
                    .sampler
                    .sample(&lp)?
                    .astype(Dtype::Uint32)?
                    .item::<u32>()?;
                self.sampler.advance_grammar(t)?;
                tokens.push(t);
                rows.push(lp.squeeze(&[0])?);
                let draft_matches = input.get(i as usize + 1) == Some(&t);
                if !draft_matches
                    || self.params.eos_token_ids.contains(&t)
                    || self.sampler.grammar_stopped()
                {
                    break;
                }
            }
            (tokens, rows)
        } else {
            let lp = logits.subtract(&logits.logsumexp(&[-1], true)?)?;
            let sampled = self.sampler.sample(&lp)?.astype(Dtype::Uint32)?;
            mlx::eval([&sampled, &lp])?;
            let rows =
                (0..positions).map(|i| lp.slice_axis(0, i, i + 1).and_then(|r| r.squeeze(&[0])));
            (
                sampled.to_vec::<u32>()?,
                rows.collect::<mlx::Result<Vec<_>>>()?,
            )
        };
        Ok((tokens, logprobs, out.hidden))
    }
}

/// Generates speculatively, calling `on_token` with every emitted token in order (the last one
/// carries the finish reason), optionally with the target's tokens constrained to a grammar:
/// drafts run unconstrained, the mask rides the verify walk position by position, and the
/// grammar advances only over emitted tokens. Returns the request's statistics and the
/// constraint in the state of the emitted tokens.
pub fn generate_speculative(
    model: &dyn LanguageModel,
    source: &mut dyn DraftSource,
    prompt: &[u32],
    params: &GenerateParams,
    num_draft_tokens: usize,
    constraint: Option<Constraint>,
    on_token: &mut dyn FnMut(&GeneratedToken) -> Control,
) -> Result<(SpeculationStats, Option<Constraint>)> {
    // mlx-lm's speculative path builds the target's own caches, ignoring max_kv_size.
    let resume = Resume {
        caches: model.make_cache(None),
        cached: 0,
        on_prefilled: &mut |_, _| {},
        on_chunk: &mut |_| Control::Continue,
    };
    let request = Speculation {
        prompt,
        params,
        num_draft_tokens,
        constraint,
    };
    resume_speculative(model, source, resume, request, on_token)
}

/// What a speculative generation is asked for, besides the models.
pub struct Speculation<'a> {
    pub prompt: &'a [u32],
    pub params: &'a GenerateParams,
    pub num_draft_tokens: usize,
    pub constraint: Option<Constraint>,
}

/// [`generate_speculative`] from target caches that already hold the first `resume.cached`
/// prompt tokens (the draft source, e.g. [`super::DraftModel::resume`], holds the same): the
/// processors see the whole prompt, only the rest is prefilled, and `resume.on_prefilled` sees
/// the target's and the draft model's caches once they hold all of the prompt but its last
/// token. The output is the cold run's (on the CPU a forward gives the same bits whatever the
/// number of tokens per call).
pub fn resume_speculative(
    model: &dyn LanguageModel,
    source: &mut dyn DraftSource,
    resume: Resume<'_>,
    request: Speculation<'_>,
    on_token: &mut dyn FnMut(&GeneratedToken) -> Control,
) -> Result<(SpeculationStats, Option<Constraint>)> {
    let Speculation {
        prompt,
        params,
        num_draft_tokens,
        constraint,
    } = request;
    validate::speculation(model, source.draft_model(), num_draft_tokens, params)?;
    let mut sampler = params.step_sampler(model, prompt, constraint)?;
    resume.seed_history(prompt, &mut sampler)?;
    let Resume {
        caches,
        cached,
        on_prefilled,
        on_chunk,
    } = resume;
    let (&last, head) = prompt
        .split_last()
        .expect("validate refuses an empty prompt");
    let mut ex = Executor {
        model,
        caches,
        sampler,
        params,
        stats: SpeculationStats::default(),
        taps: source.taps(),
    };
    let mode = source.prefill_mode();
    let full = mode != PrefillMode::Head;
    if mode == PrefillMode::FullContext && cached > 0 {
        return Err(crate::Error::Unsupported(
            "a drafter that reads the target's hidden states over the whole prompt cannot \
             start from a prompt cache (it holds no hidden states)"
                .into(),
        ));
    }
    if !full {
        source.prefill(
            prompt,
            &mut DraftContext {
                sampler: &mut ex.sampler,
                params,
                last,
                anchor: &[],
            },
        )?;
    }
    let rest = token_array(&head[cached..])?;
    let sampler = &mut ex.sampler;
    let context_taps = if mode == PrefillMode::FullContext {
        &ex.taps[..]
    } else {
        &[]
    };
    let mut done = cached;
    let context = prefill_tapped(
        model,
        &mut ex.caches,
        &rest,
        params,
        context_taps,
        |chunk| {
            done += chunk.dim(0) as usize;
            if on_chunk(done) == Control::Stop {
                return Err(crate::Error::Cancelled);
            }
            sampler.extend_history(chunk)
        },
    )?;
    on_prefilled(&ex.caches, source.caches());

    let mut y = last;
    let mut emitted = 0usize;
    // In PrefillMode::Full the first pass is the last prompt token alone, seeding the source.
    let mut seeding = full;
    let mut anchor: Vec<Array> = Vec::new();
    loop {
        let want = if seeding {
            0
        } else {
            num_draft_tokens.min(params.max_tokens - emitted)
        };
        let refused = matches!(rollback_plan(&ex.caches, want + 1), Rollback::Refuse(_));
        let drafts = if refused || want == 0 {
            Vec::new()
        } else {
            let mut ctx = DraftContext {
                sampler: &mut ex.sampler,
                params,
                last: y,
                anchor: &anchor,
            };
            let mut drafts = source.draft(want, &mut ctx)?;
            drafts.truncate(want);
            drafts
        };
        if refused && !seeding {
            ex.stats.refused_rounds += 1;
        }
        let k = drafts.len();
        let mut input = vec![y];
        input.extend(&drafts);
        begin_round(&mut ex.caches);
        let (tokens, logprobs, hidden) = ex.verify(&input)?;
        // The last examined position is always the target's own token.
        let matching = drafts
            .iter()
            .zip(&tokens)
            .take_while(|(d, t)| d == t)
            .count();
        let accepted = matching.min(tokens.len() - 1);
        if !seeding {
            ex.stats.record_round(k, accepted);
        }

        // Emit the accepted drafts, then the target's own token, one at a time.
        let mut emit_count = 0;
        let mut stop = false;
        for (i, (&token, lp)) in tokens.iter().zip(&logprobs).enumerate().take(accepted + 1) {
            if emitted == params.max_tokens {
                break;
            }
            emitted += 1;
            emit_count = i + 1;
            let finish = params.finish_for(token, emitted);
            let step = GeneratedToken {
                token,
                logprobs: lp.clone(),
                from_draft: i < accepted,
                finish,
            };
            ex.stats.generated += 1;
            ex.stats.from_draft += usize::from(step.from_draft);
            // Feed the token to the processors' history as plain decoding would.
            ex.sampler.extend_history(&token_array(&[input[i]])?)?;
            if on_token(&step) == Control::Stop || finish.is_some() {
                stop = true;
                break;
            }
        }
        // The grammar and positioned keys walked every examined position; take back what was
        // not emitted.
        ex.sampler.rewind(tokens.len() - emit_count)?;
        // The target fed y and the k drafts; it keeps y and the accepted ones.
        end_round(&mut ex.caches, k - accepted)?;
        let verified = Verified {
            drafted: k,
            accepted: accepted.min(emit_count),
            next: (emit_count == accepted + 1).then(|| tokens[accepted]),
            hidden: &hidden,
        };
        if stop {
            if !seeding {
                source.commit(&verified)?;
            }
            return Ok((ex.stats, ex.sampler.take_constraint()));
        }
        y = tokens[accepted];
        anchor = hidden
            .iter()
            .map(|h| h.slice_axis(1, accepted as i32, accepted as i32 + 1))
            .collect::<mlx::Result<_>>()?;
        if seeding {
            seeding = false;
            if !context.is_empty() {
                anchor = context
                    .iter()
                    .zip(&anchor)
                    .map(|(prompt, last)| mlx::ops::concatenate(&[prompt, last], 1))
                    .collect::<mlx::Result<_>>()?;
            }
            source.prefill(
                prompt,
                &mut DraftContext {
                    sampler: &mut ex.sampler,
                    params,
                    last: y,
                    anchor: &anchor,
                },
            )?;
        } else {
            source.commit(&verified)?;
        }
        if emit_count <= accepted {
            // max_tokens was reached inside the accepted drafts: no bonus token (as mlx-lm).
            return Ok((ex.stats, ex.sampler.take_constraint()));
        }
    }
}
