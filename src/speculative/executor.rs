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
//! A request's rounds are a [`Speculator`]: [`Speculator::next_input`] drafts a round, the
//! caller runs the target over that input, [`Speculator::settle`] accepts and emits. The lone
//! loop ([`resume_speculative`]) runs the forward itself; a batch ([`crate::batch`]) runs one
//! forward over every row's input.
//!
//! Verity departs from mlx-lm in two places, both so that speculation never changes output:
//! logits processors see the same history as in plain decoding (mlx-lm hides the prompt from
//! them when speculating), and a round the target caches could not take back is refused before
//! it starts and decoded without drafts (mlx-lm trims nothing and goes on, #1914).

use mlx::{Array, Dtype};

use super::{DraftContext, DraftSource, PrefillMode, SpeculationStats, Verified};
use crate::cache::{begin_round, end_round, quantize_due, rollback_plan, LayerCache, Rollback};
use crate::generate::{prefill_tapped, token_array, GenerateParams, GeneratedToken, Resume};
use crate::grammar::Constraint;
use crate::model::{lone_rows, LanguageModel};
use crate::request::Control;
use crate::sample::{row_views, Masking, StepSampler};
use crate::{validate, Result};

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
    let mut spec = Speculator::start(model, source, resume, request)?;
    while !spec.is_done() {
        let input = token_array(&spec.next_input(source)?)?;
        let ids = input.expand_dims(&[0])?;
        let out = lone_rows::decode_rows(|| model.forward(&ids, &mut spec.caches, &spec.taps))?;
        spec.settle(source, &out.logits, &out.hidden, on_token)?;
    }
    Ok(spec.finish())
}

/// A source in `PrefillMode::Full*` waiting for the first pass to seed it.
struct Seeding {
    prompt: Vec<u32>,
    /// The target's taps over the prompt (`PrefillMode::FullContext`; empty otherwise).
    context: Vec<Array>,
}

/// A round's verdict as enqueued, before the host reads it.
enum Verdict {
    /// No grammar, and no processors or, greedy, a logit bias alone (which reads no history,
    /// so every position takes the same one): every position sampled in one draw, (n,) tokens
    /// and each position's (V,) logprobs, views of one (n, V) array evaluated with the tokens,
    /// so that reading one later costs nothing.
    Whole(Array, Vec<Array>),
    /// As `Whole`, sampled by a batch together with other rows' positions
    /// (crate::batch::greedy) and read back: the tokens and each position's (V,) logprobs.
    Read(Vec<u32>, Vec<Array>),
    /// Greedy with other logits processors: each position processed with the history it has when
    /// the walk reaches it (the drafts before it, which the walk has accepted by then), one
    /// token and (V,) logprobs per position; the walk stops where plain judging would.
    Walk(Vec<(Array, Array)>),
}

/// One speculative request between rounds: its target caches, sampler and counters, and where
/// its rounds stand. Its draft source is the caller's, passed to every call.
pub struct Speculator {
    pub(crate) caches: Vec<LayerCache>,
    sampler: StepSampler,
    params: GenerateParams,
    num_draft_tokens: usize,
    /// At most this many drafts a round, whatever `num_draft_tokens` says
    /// ([`Speculator::cap_drafts`]).
    draft_cap: Option<usize>,
    stats: SpeculationStats,
    /// The target hidden states the source taps.
    pub(crate) taps: Vec<usize>,
    /// The last emitted token (the prompt's last before the first round).
    last: u32,
    emitted: usize,
    /// Some until the first pass has seeded a `PrefillMode::Full*` source.
    seeding: Option<Seeding>,
    /// The target's taps at the position `last` was sampled from.
    anchor: Vec<Array>,
    /// The round in flight: `[last, drafts...]`.
    input: Vec<u32>,
    /// The round's verdict, enqueued by [`Speculator::enqueue_verdict`].
    verdict: Option<Verdict>,
    done: bool,
}

impl Speculator {
    /// Validates the request, prefills the source and the target (the rest of the prompt after
    /// `resume.cached`, as the source's mode says), and stands before the first round.
    pub fn start(
        model: &dyn LanguageModel,
        source: &mut dyn DraftSource,
        resume: Resume<'_>,
        request: Speculation<'_>,
    ) -> Result<Speculator> {
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
            mut caches,
            cached,
            on_prefilled,
            on_chunk,
        } = resume;
        let (&last, head) = prompt
            .split_last()
            .expect("validate refuses an empty prompt");
        let taps = source.taps();
        let mode = source.prefill_mode();
        if mode == PrefillMode::FullContext && cached != source.context_rows() {
            return Err(crate::Error::Unsupported(
                "a drafter that reads the target's hidden states over the whole prompt cannot \
                 start from a prompt cache without them"
                    .into(),
            ));
        }
        if mode == PrefillMode::Head {
            source.prefill(
                prompt,
                &mut DraftContext {
                    sampler: &mut sampler,
                    params,
                    last,
                    anchor: &[],
                    target: &caches,
                },
            )?;
        }
        let context_taps = if mode == PrefillMode::FullContext {
            &taps[..]
        } else {
            &[]
        };
        let mut done = cached;
        let context = prefill_tapped(
            model,
            &mut caches,
            &token_array(&head[cached..])?,
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
        on_prefilled(&caches, source.prefix(&context)?.as_ref());
        // In PrefillMode::Full* the first pass is the last prompt token alone, seeding the
        // source.
        let seeding = (mode != PrefillMode::Head).then(|| Seeding {
            prompt: prompt.to_vec(),
            context,
        });
        Ok(Speculator {
            caches,
            sampler,
            params: params.clone(),
            num_draft_tokens,
            draft_cap: None,
            stats: SpeculationStats::default(),
            taps,
            last,
            emitted: 0,
            seeding,
            anchor: Vec::new(),
            input: Vec::new(),
            verdict: None,
            done: false,
        })
    }

    /// Whether the request has ended (its last token emitted, or its caller said stop).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Drafts the next round and opens it on the target caches: returns the tokens the target
    /// must take next, `[last, drafts...]` (the last token alone when the source proposes
    /// nothing, or when the caches could not take the drafts back).
    pub fn next_input(&mut self, source: &mut dyn DraftSource) -> Result<Vec<u32>> {
        let drafts = match self.draft_request() {
            Some((want, mut ctx)) => source.draft(want, &mut ctx)?,
            None => Vec::new(),
        };
        Ok(self.open_round(&drafts))
    }

    /// What the next round may draft: how many tokens, and the context to draft them in. None
    /// when it drafts nothing: while seeding, at max_tokens, or when the target caches could
    /// not take the drafts back (a refused round, counted).
    pub(crate) fn draft_request(&mut self) -> Option<(usize, DraftContext<'_>)> {
        let seeding = self.seeding.is_some();
        let want = self.draft_budget();
        let refused = self.refuses(want);
        if refused && !seeding {
            self.stats.refused_rounds += 1;
        }
        if refused || want == 0 {
            return None;
        }
        let ctx = DraftContext {
            sampler: &mut self.sampler,
            params: &self.params,
            last: self.last,
            anchor: &self.anchor,
            target: &self.caches,
        };
        Some((want, ctx))
    }

    /// How many drafts the next round takes, as [`Speculator::draft_request`] will say (0 for
    /// none), without counting a refused round.
    pub(crate) fn next_drafts(&self) -> usize {
        let want = self.draft_budget();
        if self.refuses(want) {
            0
        } else {
            want
        }
    }

    /// Whether the target caches could not take back a round of `want` drafts.
    fn refuses(&self, want: usize) -> bool {
        matches!(
            rollback_plan(&self.caches, want + 1, lone_rows::exact_decode()),
            Rollback::Refuse(_)
        )
    }

    /// Drafts the next round may take: none while seeding, else up to num_draft_tokens, the
    /// cap and what max_tokens leaves.
    fn draft_budget(&self) -> usize {
        if self.seeding.is_some() {
            0
        } else {
            self.num_draft_tokens
                .min(self.draft_cap.unwrap_or(usize::MAX))
                .min(self.params.max_tokens - self.emitted)
        }
    }

    /// Whether the number of drafts leaves the tokens as they are: greedy, where speculation
    /// emits what plain decoding does (a sampled round draws as many keys as it verifies).
    pub(crate) fn emits_as_plain(&self) -> bool {
        self.sampler.is_greedy()
    }

    /// Caps the drafts of the rounds from the next on (None: num_draft_tokens); with 0 a round
    /// is a plain step, the source catching up on its tokens when drafting resumes.
    pub(crate) fn cap_drafts(&mut self, cap: Option<usize>) {
        self.draft_cap = cap;
    }

    /// Opens the round on the target caches with `drafts` (from [`Speculator::draft_request`];
    /// any past its budget dropped): returns `[last, drafts...]`, the target's next input.
    pub(crate) fn open_round(&mut self, drafts: &[u32]) -> Vec<u32> {
        let drafts = &drafts[..drafts.len().min(self.draft_budget())];
        self.open_round_unread();
        self.read_drafts(drafts);
        self.input.clone()
    }

    /// Opens the round on the target caches with drafts still on the device (drafted as
    /// [`Speculator::draft_request`] asked, never past its budget), which the caller feeds
    /// after the returned `last`; [`Speculator::read_drafts`] gives them to the round once read,
    /// before [`Speculator::settle`]. Only for a round whose verdict does not read its drafts
    /// ([`Speculator::verdict_reads_drafts`]).
    pub(crate) fn open_round_unread(&mut self) -> u32 {
        self.input = vec![self.last];
        begin_round(&mut self.caches);
        self.last
    }

    /// The drafts of the round [`Speculator::open_round_unread`] opened, as read.
    pub(crate) fn read_drafts(&mut self, drafts: &[u32]) {
        self.input.extend(drafts);
    }

    /// Whether the round's verdict, as [`Speculator::enqueue_verdict`] builds it, reads the
    /// drafts: greedy with processors other than a logit bias and no grammar, each position
    /// processed with the drafts before it.
    pub(crate) fn verdict_reads_drafts(&self) -> bool {
        !self.sampler.is_constrained()
            && self.sampler.is_greedy()
            && self.sampler.has_processors()
            && !self.sampler.samples_by_argmax()
    }

    /// Enqueues the round's verdict over the target's `logits` (1, n, V) when it needs no token
    /// read between positions (no grammar, and greedy when there are processors: the others
    /// are judged position by position), returning what to evaluate; [`Speculator::settle`]
    /// then reads it. A batch evaluates every row's verdict at once instead of waiting for
    /// each row in turn.
    pub(crate) fn enqueue_verdict(&mut self, logits: &Array) -> Result<Vec<Array>> {
        let processors = self.sampler.has_processors();
        if self.sampler.is_constrained() || (processors && !self.sampler.is_greedy()) {
            return Ok(Vec::new());
        }
        let logits = logits.squeeze(&[0])?;
        if !self.verdict_reads_drafts() {
            let logits = match self.sampler.argmax_bias(logits.dim(1), logits.dtype())? {
                Some(bias) => logits.add(&bias)?,
                None => logits,
            };
            let lp = logits.subtract(&logits.logsumexp(&[-1], true)?)?;
            let sampled = self.sampler.sample(&lp)?.astype(Dtype::Uint32)?;
            let rows = row_views(&lp)?;
            let pending = std::iter::once(&sampled).chain(&rows).cloned().collect();
            self.verdict = Some(Verdict::Whole(sampled, rows));
            return Ok(pending);
        }
        let mut walk = Vec::with_capacity(self.input.len());
        for i in 0..self.input.len() {
            let row = logits.slice_axis(0, i as i32, i as i32 + 1)?;
            let processed = self
                .sampler
                .process(&row, &self.input[..=i], Masking::Grammar)?;
            let lp = processed.subtract(&processed.logsumexp(&[-1], true)?)?;
            let t = self.sampler.sample(&lp)?.astype(Dtype::Uint32)?;
            walk.push((t, lp.squeeze(&[0])?));
        }
        let pending = walk
            .iter()
            .flat_map(|(t, lp)| [t.clone(), lp.clone()])
            .collect();
        self.verdict = Some(Verdict::Walk(walk));
        Ok(pending)
    }

    /// Whether the round's verdict is every position's argmax after at most a fixed bias
    /// (greedy, no grammar, no processor but a logit bias): a batch may then sample it with
    /// other rows ([`Speculator::argmax_bias`], [`Speculator::read_verdict`]).
    pub(crate) fn verdict_by_argmax(&self) -> bool {
        self.sampler.samples_by_argmax()
    }

    /// The (1, V) row the verdict's logits of V = `vocab` and `dtype` take before the argmax,
    /// None when none.
    pub(crate) fn argmax_bias(&self, vocab: i32, dtype: Dtype) -> Result<Option<Array>> {
        self.sampler.argmax_bias(vocab, dtype)
    }

    /// The round's verdict as a batch sampled and read it: each position's token and (V,)
    /// logprobs, what [`Speculator::enqueue_verdict`] would give.
    pub(crate) fn read_verdict(&mut self, tokens: Vec<u32>, logprobs: Vec<Array>) {
        self.verdict = Some(Verdict::Read(tokens, logprobs));
    }

    /// Closes the round [`Speculator::next_input`] opened, given the target's `logits`
    /// (1, n, V) and tapped `hidden` states (one (1, n, H) per tap) over its input: accepts the
    /// drafts the target agrees with, emits them and the target's own token through
    /// `on_token`, takes the rest back from the caches and the sampler, and tells the source.
    /// Returns how many tokens of the round the caches gave back: a batch holding this row's
    /// caches in a shared buffer meanwhile (its own are empty then) takes them back there.
    pub fn settle(
        &mut self,
        source: &mut dyn DraftSource,
        logits: &Array,
        hidden: &[Array],
        on_token: &mut dyn FnMut(&GeneratedToken) -> Control,
    ) -> Result<usize> {
        quantize_due(&mut self.caches, self.params.kv_quantization.as_ref())?;
        if self.verdict.is_none() {
            self.enqueue_verdict(logits)?;
        }
        let input = std::mem::take(&mut self.input);
        let (tokens, logprobs) = self.judge(&input, logits)?;
        let drafts = &input[1..];
        let k = drafts.len();
        // The last examined position is always the target's own token.
        let matching = drafts
            .iter()
            .zip(&tokens)
            .take_while(|(d, t)| d == t)
            .count();
        let accepted = matching.min(tokens.len() - 1);
        let seeding = self.seeding.is_some();
        if !seeding {
            if k == 0 && self.draft_cap == Some(0) {
                self.stats.record_undrafted_step();
            } else {
                self.stats.record_round(k, accepted);
            }
        }

        // Emit the accepted drafts, then the target's own token, one at a time.
        let mut emit_count = 0;
        let mut stop = false;
        for (i, (&token, lp)) in tokens.iter().zip(&logprobs).enumerate().take(accepted + 1) {
            if self.emitted == self.params.max_tokens {
                break;
            }
            self.emitted += 1;
            emit_count = i + 1;
            let finish = self.params.finish_for(token, self.emitted);
            let step = GeneratedToken {
                token,
                logprobs: lp.clone(),
                from_draft: i < accepted,
                finish,
            };
            self.stats.generated += 1;
            self.stats.from_draft += usize::from(step.from_draft);
            // Feed the token to the processors' history as plain decoding would (no array for
            // a sampler without processors: this runs per emitted token on the host).
            if self.sampler.has_processors() {
                self.sampler.extend_history(&token_array(&[input[i]])?)?;
            }
            if on_token(&step) == Control::Stop || finish.is_some() {
                stop = true;
                break;
            }
        }
        // The grammar and positioned keys walked every examined position; take back what was
        // not emitted.
        self.sampler.rewind(tokens.len() - emit_count)?;
        // The target fed the last token and the k drafts; it keeps those and the accepted ones.
        let rejected = k - accepted;
        end_round(&mut self.caches, rejected)?;
        let verified = Verified {
            drafted: k,
            accepted: accepted.min(emit_count),
            next: (emit_count == accepted + 1).then(|| tokens[accepted]),
            hidden,
        };
        if stop {
            if !seeding {
                source.commit(&verified)?;
            }
            self.done = true;
            return Ok(rejected);
        }
        self.last = tokens[accepted];
        self.anchor = hidden
            .iter()
            .map(|h| h.slice_axis(1, accepted as i32, accepted as i32 + 1))
            .collect::<mlx::Result<_>>()?;
        if let Some(Seeding { prompt, context }) = self.seeding.take() {
            if !context.is_empty() {
                self.anchor = context
                    .iter()
                    .zip(&self.anchor)
                    .map(|(prompt, last)| mlx::ops::concatenate(&[prompt, last], 1))
                    .collect::<mlx::Result<_>>()?;
            }
            source.prefill(
                &prompt,
                &mut DraftContext {
                    sampler: &mut self.sampler,
                    params: &self.params,
                    last: self.last,
                    anchor: &self.anchor,
                    target: &self.caches,
                },
            )?;
        } else {
            source.commit(&verified)?;
        }
        // max_tokens reached inside the accepted drafts: no bonus token (as mlx-lm).
        self.done = emit_count <= accepted;
        Ok(rejected)
    }

    /// The request's statistics and the constraint in the state of the emitted tokens.
    pub fn finish(self) -> (SpeculationStats, Option<Constraint>) {
        let mut sampler = self.sampler;
        (self.stats, sampler.take_constraint())
    }

    /// The most tokens a round feeds the target (and the draft model): the last token and the
    /// drafts.
    pub(crate) fn max_round(&self) -> usize {
        self.num_draft_tokens + 1
    }

    /// Whether this request quantizes its KV caches as they grow.
    pub(crate) fn quantizes_kv(&self) -> bool {
        self.params.kv_quantization.is_some()
    }

    /// The speculation counters so far.
    pub fn stats(&self) -> &SpeculationStats {
        &self.stats
    }

    /// The target's token and logprobs (V,) at each position of `input` it examined, from its
    /// `logits` (1, n, V) over them. Without processors or a grammar every position is sampled
    /// in one (n, V) call, as mlx-lm does. Otherwise the walk goes position by position, each
    /// processed with the history it would have in plain decoding and masked by the grammar
    /// advanced over the walk so far, and stops at the first rejected draft, an EOS, or a
    /// finished grammar.
    fn judge(&mut self, input: &[u32], logits: &Array) -> Result<(Vec<u32>, Vec<Array>)> {
        let positions = input.len() as i32;
        match self.verdict.take() {
            Some(Verdict::Whole(sampled, rows)) => {
                mlx::eval(std::iter::once(&sampled).chain(&rows))?;
                return Ok((sampled.to_vec::<u32>()?, rows));
            }
            Some(Verdict::Read(tokens, rows)) => return Ok((tokens, rows)),
            Some(Verdict::Walk(walk)) => {
                mlx::eval(walk.iter().flat_map(|(t, lp)| [t, lp]))?;
                let (mut tokens, mut rows) = (Vec::new(), Vec::new());
                for (i, (t, lp)) in walk.into_iter().enumerate() {
                    let t = t.item::<u32>()?;
                    tokens.push(t);
                    rows.push(lp);
                    if input.get(i + 1) != Some(&t) || self.params.eos_token_ids.contains(&t) {
                        break;
                    }
                }
                return Ok((tokens, rows));
            }
            None => {}
        }
        let logits = logits.squeeze(&[0])?;
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
        Ok((tokens, rows))
    }
}
