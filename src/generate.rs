//! The plain decode loop, with mlx-lm's generate_step / stream_generate semantics: the prompt
//! prefilled in chunks of `prefill_step_size` leaving the last token for the first step, the
//! next step always enqueued before the current token is returned (so one extra forward and
//! one extra random draw happen after the last token, and the cache holds every emitted
//! token), EOS counted as a generated token, and "length" at max_tokens.

use mlx::{ops, Array, Dtype};

use crate::cache::{eval_state, quantize_due, KvQuantization, LayerCache};
use crate::grammar::Constraint;
use crate::model::{Forward, LanguageModel};
pub use crate::request::{Control, FinishReason, GenerateParams};
use crate::sample::{LogitsProcessors, Masking, Sampler, StepSampler};
use crate::speculative::DraftPrefix;
use crate::{validate, Result};

impl GenerateParams {
    /// Validates a request against `model` (crate::validate) and builds its step sampler
    /// (sampler, processors, seeded key sequence, grammar), as plain and speculative decoding
    /// share it.
    pub fn step_sampler(
        &self,
        model: &dyn LanguageModel,
        prompt: &[u32],
        constraint: Option<Constraint>,
    ) -> Result<StepSampler> {
        validate::request(model, prompt, self)?;
        let sampler = Sampler::new(self.sampler.clone());
        let processors = LogitsProcessors::new(&self.processors)?;
        StepSampler::new(sampler, processors, self.seed, self.keys, constraint)
    }
}

/// One generated token with the step's full logprobs (V,) after the processors, before the
/// sampler's filters and temperature.
pub struct GeneratedToken {
    pub token: u32,
    pub logprobs: Array,
    pub from_draft: bool,
    /// Set on the last token: "stop" on EOS, "length" at max_tokens.
    pub finish: Option<FinishReason>,
}

/// One model call over the 1-D `tokens` — mlx-lm's `model(tokens[None], cache=...)` — then the
/// quantized-KV conversion when due (`maybe_quantize_kv_cache`). Returns the (1, L, V) logits.
pub fn forward_tokens(
    model: &dyn LanguageModel,
    caches: &mut [LayerCache],
    tokens: &Array,
    kv_quantization: Option<&KvQuantization>,
) -> Result<Array> {
    Ok(forward_tapped(model, caches, tokens, kv_quantization, &[])?.logits)
}

/// `forward_tokens` keeping the hidden states at `taps` (a drafter's view of the target).
pub fn forward_tapped(
    model: &dyn LanguageModel,
    caches: &mut [LayerCache],
    tokens: &Array,
    kv_quantization: Option<&KvQuantization>,
    taps: &[usize],
) -> Result<Forward> {
    let out = model.forward(&tokens.expand_dims(&[0])?, caches, taps)?;
    quantize_due(caches, kv_quantization)?;
    Ok(out)
}

/// Token-layers (chunk tokens times layers) a prefill chunk is enqueued by, group after group
/// (see [`enqueue_by_groups`]): two layers per group for a 1024-token chunk, none for short ones.
const PREFILL_GROUP_TOKENS: usize = 2048;

/// The layers whose outputs end each group of a `tokens`-token chunk through `layers` layers
/// (the last layer is left to the caches' own evaluation).
fn group_ends(tokens: usize, layers: usize) -> Vec<usize> {
    let per_group = (PREFILL_GROUP_TOKENS / tokens.max(1)).max(1);
    (per_group..layers)
        .step_by(per_group)
        .map(|end| end - 1)
        .collect()
}

/// Enqueues a prefill chunk's forward group by group of layers, `ends` being the outputs of
/// each group's last layer, and lets at most two groups wait for the device at a time. The
/// buffers a layer's kernels read and write (projections, MLP activations, for every token of
/// the chunk) stay allocated until the device has run them, and on a GPU the host enqueues
/// faster than the device computes: enqueued in one go, every layer's are held at once (on the
/// H200, a 1024-token chunk of the 0.6B shape peaked at 1.22 GB against 0.45 GB of weights and
/// cache). The same kernels run in the same order, so no bit changes.
///
/// Each end is dropped once it has been waited for: a handle kept would hold its hidden state
/// (tokens x hidden) allocated after the next layers consumed it.
fn enqueue_by_groups(ends: Vec<Array>) -> mlx::Result<()> {
    let mut before: Option<Array> = None;
    for end in ends {
        mlx::async_eval([&end])?;
        if let Some(before) = before.replace(end) {
            mlx::eval([&before])?;
        }
    }
    Ok(())
}

/// Feeds `tokens` to the model in chunks of `prefill_step_size` (each also ending at the
/// `prefill_splits` it reaches), evaluating the caches after each chunk, and converting them to quantized KV caches when due (generate_step's prefill).
/// `on_chunk` sees each chunk (the processors' history collects them).
pub fn prefill(
    model: &dyn LanguageModel,
    caches: &mut [LayerCache],
    tokens: &Array,
    params: &GenerateParams,
    on_chunk: impl FnMut(&Array) -> Result<()>,
) -> Result<()> {
    prefill_tapped(model, caches, tokens, params, &[], on_chunk).map(drop)
}

/// [`prefill`] keeping the hidden states at `taps` over every token fed, one (1, L, H) array
/// per tap (a drafter that reads the whole prompt); none when `taps` is empty or `tokens` is.
pub fn prefill_tapped(
    model: &dyn LanguageModel,
    caches: &mut [LayerCache],
    tokens: &Array,
    params: &GenerateParams,
    taps: &[usize],
    mut on_chunk: impl FnMut(&Array) -> Result<()>,
) -> Result<Vec<Array>> {
    let mut rest = tokens.clone();
    let mut chunks: Vec<Vec<Array>> = vec![Vec::new(); taps.len()];
    let mut at = caches.first().map_or(0, LayerCache::offset);
    while rest.dim(0) > 0 {
        let n = chunk_len(
            at,
            rest.dim(0) as usize,
            params.prefill_step_size,
            &params.prefill_splits,
        );
        at += n;
        let n = n as i32;
        let chunk = rest.slice_axis(0, 0, n)?;
        let groups = group_ends(n as usize, model.num_layers());
        let wanted: Vec<usize> = taps.iter().chain(&groups).copied().collect();
        let kv = params.kv_quantization.as_ref();
        // The chunk's logits are never read, and their pending graph would hold the last
        // layer's input (tokens x hidden) through the evaluation: dropped first, as mlx-lm
        // drops the output of a prefill chunk's model call.
        let Forward { mut hidden, .. } = forward_tapped(model, caches, &chunk, kv, &wanted)?;
        enqueue_by_groups(hidden.split_off(taps.len()))?;
        eval_state(caches)?;
        if !hidden.is_empty() {
            mlx::eval(&hidden)?;
        }
        for (kept, h) in chunks.iter_mut().zip(hidden) {
            kept.push(h);
        }
        on_chunk(&chunk)?;
        rest = rest.slice_axis(0, n, rest.dim(0))?;
        mlx::memory::clear_cache();
    }
    chunks
        .iter()
        .filter(|parts| !parts.is_empty())
        .map(|parts| Ok(ops::concatenate(&parts.iter().collect::<Vec<_>>(), 1)?))
        .collect()
}

/// The length of the prefill chunk at position `at` with `remaining` tokens to feed: the step,
/// or less where a split or the end comes first.
fn chunk_len(at: usize, remaining: usize, step: usize, splits: &[usize]) -> usize {
    let step = step.min(remaining);
    match splits.iter().find(|&&s| s > at && s < at + step) {
        Some(&split) => split - at,
        None => step,
    }
}

/// Where the chunks of a prefill of `len` tokens from position 0 end, in order (`len` last),
/// with `prefill_step_size` `step` and `prefill_splits` `splits`. A prefill that goes on from
/// one of them feeds the chunks one from the start feeds there.
pub fn chunk_ends(len: usize, step: usize, splits: &[usize]) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut at = 0;
    while at < len {
        at += chunk_len(at, len - at, step, splits);
        ends.push(at);
    }
    ends
}

/// mlx_lm.cache_prompt: fresh caches holding all of `tokens`, processed as generate_step with
/// max_tokens=0 processes a prompt (chunked prefill, then the last token alone, then the
/// quantized-KV conversion when due).
pub fn cache_prompt(
    model: &dyn LanguageModel,
    tokens: &[u32],
    params: &GenerateParams,
) -> Result<Vec<LayerCache>> {
    validate::request(model, tokens, params)?;
    let (&last, head) = tokens
        .split_last()
        .expect("validate refuses an empty prompt");
    let mut caches = model.make_cache(params.max_kv_size);
    prefill(model, &mut caches, &token_array(head)?, params, |_| Ok(()))?;
    let kv = params.kv_quantization.as_ref();
    forward_tokens(model, &mut caches, &token_array(&[last])?, kv)?;
    eval_state(&caches)?;
    Ok(caches)
}

/// Token ids as the int32 array mlx-lm feeds (mx.array of Python ints).
pub fn token_array(tokens: &[u32]) -> mlx::Result<Array> {
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Array::from_slice(&ids, &[ids.len() as i32])
}

/// One decode step after `input` (1-D token ids) was fed: the model call, the processors over
/// the history (which then includes `input`) and the grammar mask, and the logprobs
/// `logits - logsumexp(logits)` (1, V) the sampler draws from (generate_step's `_step`).
fn step_logprobs(
    model: &dyn LanguageModel,
    caches: &mut [LayerCache],
    sampler: &mut StepSampler,
    input: &Array,
    params: &GenerateParams,
) -> Result<Array> {
    let logits = forward_tokens(model, caches, input, params.kv_quantization.as_ref())?;
    logprobs_after(sampler, input, &last_logits(&logits)?)
}

/// A decode step after the model call: the processors over the history (which then includes
/// `input`), the grammar mask, and the logprobs of the last position's (1, V) `logits`.
pub(crate) fn logprobs_after(
    sampler: &mut StepSampler,
    input: &Array,
    logits: &Array,
) -> Result<Array> {
    sampler.extend_history(input)?;
    let logits = sampler.process(logits, &[], Masking::Grammar)?;
    StepSampler::logprobs(&logits)
}

/// Teacher forcing: the logprobs (V,) the model gives each token of `continuation`, computed as
/// generation computes them — the prompt prefilled the same way into `caches`, the same
/// processors over the same history, the same cache conversions — but with `continuation`'s
/// tokens fed in place of sampled ones. `on_step(i, logprobs)` sees the distribution that
/// token i was drawn from. Nothing is sampled.
pub fn score(
    model: &dyn LanguageModel,
    mut caches: Vec<LayerCache>,
    prompt: &[u32],
    continuation: &[u32],
    params: &GenerateParams,
    mut on_step: impl FnMut(usize, &Array) -> Result<()>,
) -> Result<()> {
    let mut sampler = params.step_sampler(model, prompt, None)?;
    validate::token_ids("continuation", continuation, model.vocab_size())?;
    let (&last, head) = prompt
        .split_last()
        .expect("validate refuses an empty prompt");
    prefill(model, &mut caches, &token_array(head)?, params, |chunk| {
        sampler.extend_history(chunk)
    })?;
    let mut input = token_array(&[last])?;
    for (i, &token) in continuation.iter().enumerate() {
        let logprobs = step_logprobs(model, &mut caches, &mut sampler, &input, params)?;
        on_step(i, &logprobs.squeeze(&[0])?)?;
        input = token_array(&[token])?;
    }
    Ok(())
}

/// The last position's (1, V) logits of a (1, L, V) forward.
pub fn last_logits(logits: &Array) -> mlx::Result<Array> {
    let l = logits.dim(1);
    logits.slice_axis(1, l - 1, l)?.squeeze(&[1])
}

/// Where a generation starts when a prefix cache supplies the beginning of the prompt.
pub struct Resume<'a> {
    /// Caches holding the first `cached` prompt tokens (fresh ones when `cached` is 0).
    pub caches: Vec<LayerCache>,
    pub cached: usize,
    /// Sees the target's caches, and the draft model's when speculating with one, once they
    /// hold the whole prompt but its last token: what a prefix cache keeps.
    pub on_prefilled: OnPrefilled<'a>,
    /// Told the prompt tokens the caches hold after every prefill chunk; `Stop` ends the
    /// prefill with [`crate::Error::Cancelled`].
    pub on_chunk: &'a mut dyn FnMut(usize) -> Control,
}

impl Resume<'_> {
    /// Checks that the cached prefix leaves a token of `prompt` to feed, and gives the
    /// processors' history the cached part (mlx-lm's history holds the whole prompt).
    pub(crate) fn seed_history(&self, prompt: &[u32], sampler: &mut StepSampler) -> Result<()> {
        let cached = self.cached;
        if cached >= prompt.len() {
            return Err(crate::error::contract(format!(
                "a cached prefix of {cached} tokens leaves nothing of a {}-token prompt to feed",
                prompt.len()
            )));
        }
        if cached > 0 {
            sampler.extend_history(&token_array(&prompt[..cached])?)?;
        }
        Ok(())
    }
}

/// A plain request with all of its prompt but the last token in its caches: where the lone
/// loop and a batch row ([`crate::batch`]) take their first step from.
pub(crate) struct Prefilled {
    pub caches: Vec<LayerCache>,
    pub sampler: StepSampler,
    /// The prompt's last token, the first step's input.
    pub last: u32,
}

/// Validates a plain request, builds its step sampler, and prefills the prompt but its last
/// token after the `resume.cached` tokens the caches already hold (the processors see the whole
/// prompt); `resume.on_prefilled` then sees the caches.
pub(crate) fn prefill_request(
    model: &dyn LanguageModel,
    resume: Resume<'_>,
    prompt: &[u32],
    params: &GenerateParams,
    constraint: Option<Constraint>,
) -> Result<Prefilled> {
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
    let mut done = cached;
    let rest = token_array(&head[cached..])?;
    prefill(model, &mut caches, &rest, params, |chunk| {
        done += chunk.dim(0) as usize;
        if on_chunk(done) == Control::Stop {
            return Err(crate::Error::Cancelled);
        }
        sampler.extend_history(chunk)
    })?;
    on_prefilled(&caches, None);
    Ok(Prefilled {
        caches,
        sampler,
        last,
    })
}

/// A callback given the target's caches and the draft model's, if any.
pub type OnPrefilled<'a> = &'a mut dyn FnMut(&[LayerCache], Option<&DraftPrefix>);

/// Streams tokens; ends after the token that carries a finish reason.
pub struct Generation<'m> {
    model: &'m dyn LanguageModel,
    caches: Vec<LayerCache>,
    step_sampler: StepSampler,
    params: GenerateParams,
    /// The token sampled for step n and its logprobs, already enqueued.
    pending: Option<(Array, Array)>,
    n: usize,
    done: bool,
    split: StepSplit,
}

/// Where the host spends a decode step's time, summed over the steps after the first token:
/// building the next step's graph, handing it to MLX (`async_eval`: on a GPU, the kernel
/// launches), and waiting for the current token. A step whose build and enqueue take longer
/// than the device's work is overhead-bound; `verity bench speed` prints the split per token.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepSplit {
    pub build_s: f64,
    pub enqueue_s: f64,
    pub wait_s: f64,
    /// The decode steps measured (tokens after the first).
    pub steps: usize,
}

impl StepSplit {
    /// The parts' names, in the order of [`StepSplit::per_step_us`].
    pub const PARTS: [&str; 3] = ["build", "enqueue", "wait"];

    /// Microseconds per measured step of each part, or None before any step.
    pub fn per_step_us(&self) -> Option<[f64; 3]> {
        let per = |s: f64| s / self.steps as f64 * 1e6;
        (self.steps > 0).then(|| [per(self.build_s), per(self.enqueue_s), per(self.wait_s)])
    }
}

/// Runs `f`, adding its wall time to `total` when `on`.
fn timed<T>(on: bool, total: &mut f64, f: impl FnOnce() -> T) -> T {
    let start = std::time::Instant::now();
    let out = f();
    if on {
        *total += start.elapsed().as_secs_f64();
    }
    out
}

impl<'m> Generation<'m> {
    /// Prefills the prompt into fresh caches and enqueues the first token.
    pub fn new(
        model: &'m dyn LanguageModel,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Generation<'m>> {
        Self::start(
            model,
            model.make_cache(params.max_kv_size),
            prompt,
            params,
            None,
        )
    }

    /// The general form: from `caches` (fresh, or holding a prefix from a prompt cache, in
    /// which case `prompt` is the rest and, as in mlx-lm, the processors' history starts with
    /// it), optionally constrained to a grammar from the first generated token on.
    pub fn start(
        model: &'m dyn LanguageModel,
        caches: Vec<LayerCache>,
        prompt: &[u32],
        params: &GenerateParams,
        constraint: Option<Constraint>,
    ) -> Result<Generation<'m>> {
        let resume = Resume {
            caches,
            cached: 0,
            on_prefilled: &mut |_, _| {},
            on_chunk: &mut |_| Control::Continue,
        };
        Self::resume(model, resume, prompt, params, constraint)
    }

    /// Starts from caches that already hold the first `resume.cached` tokens of `prompt` (a
    /// prefix cache's copy): the processors see the whole prompt, only the rest is prefilled,
    /// and `resume.on_prefilled` sees the caches once they hold all of the prompt but its last
    /// token. The output is the cold run's: on the CPU a forward gives the same bits whatever
    /// the number of tokens per call.
    pub fn resume(
        model: &'m dyn LanguageModel,
        resume: Resume<'_>,
        prompt: &[u32],
        params: &GenerateParams,
        constraint: Option<Constraint>,
    ) -> Result<Generation<'m>> {
        let Prefilled {
            caches,
            sampler,
            last,
        } = prefill_request(model, resume, prompt, params, constraint)?;
        let mut g = Generation {
            model,
            caches,
            step_sampler: sampler,
            params: params.clone(),
            pending: None,
            n: 0,
            done: false,
            split: StepSplit::default(),
        };
        let first = g.step(&token_array(&[last])?)?;
        mlx::async_eval([&first.0, &first.1])?;
        g.pending = Some(first);
        Ok(g)
    }

    /// generate_step's `_step`: forward the input, process, quantize the cache, sample.
    fn step(&mut self, input: &Array) -> Result<(Array, Array)> {
        let logprobs = step_logprobs(
            self.model,
            &mut self.caches,
            &mut self.step_sampler,
            input,
            &self.params,
        )?;
        let sampled = self.step_sampler.sample(&logprobs)?;
        Ok((sampled, logprobs.squeeze(&[0])?))
    }

    fn next_token(&mut self) -> Result<GeneratedToken> {
        let (y, logprobs) = self.pending.take().expect("a pending step while not done");
        let read = |y: &Array| -> mlx::Result<u32> { y.astype(Dtype::Uint32)?.item::<u32>() };
        // The first call's wait holds the end of the prefill: the split starts after it.
        let on = self.n > 0;
        let mut split = self.split;
        // A grammar must see token n before it can mask step n+1, so a constrained generation
        // reads the token first and takes no step after the last one.
        let early = if self.step_sampler.is_constrained() {
            let token = timed(on, &mut split.wait_s, || read(&y))?;
            self.step_sampler.advance_grammar(token)?;
            Some(token)
        } else {
            None
        };
        if early.is_none_or(|t| self.params.finish_for(t, self.n + 1).is_none()) {
            // Enqueue step n+1 before returning token n, as generate_step does, even after the
            // last token: the extra forward and random draw are part of mlx-lm's behaviour.
            let next = timed(on, &mut split.build_s, || self.step(&y))?;
            timed(on, &mut split.enqueue_s, || {
                mlx::async_eval([&next.0, &next.1])
            })?;
            self.pending = Some(next);
        }
        let token = match early {
            Some(t) => t,
            None => timed(on, &mut split.wait_s, || read(&y))?,
        };
        split.steps += usize::from(on);
        self.split = split;
        self.n += 1;
        if self.n.is_multiple_of(256) {
            mlx::memory::clear_cache();
        }
        let finish = self.params.finish_for(token, self.n);
        self.done = finish.is_some();
        Ok(GeneratedToken {
            token,
            logprobs,
            from_draft: false,
            finish,
        })
    }
}

impl Generation<'_> {
    /// The host's time per part of the decode steps so far.
    pub fn step_split(&self) -> StepSplit {
        self.split
    }
}

/// The step enqueued after the last token may still be running when a generation is dropped;
/// waiting for it keeps MLX from writing into outputs nobody holds any more.
impl Drop for Generation<'_> {
    fn drop(&mut self) {
        if let Some((y, logprobs)) = &self.pending {
            let _ = mlx::eval([y, logprobs]);
        }
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<GeneratedToken>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let item = self.next_token();
        if item.is_err() {
            self.done = true;
        }
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::group_ends;

    #[test]
    fn long_chunks_go_in_groups_of_layers_short_ones_at_once() {
        // 2048 token-layers a group: two layers for 1024 tokens, one for 2048 and more.
        assert_eq!(group_ends(1024, 7), [1, 3, 5]);
        assert_eq!(group_ends(4096, 3), [0, 1]);
        // The last layer is never a group end: the caches' evaluation takes it.
        assert_eq!(group_ends(1024, 4), [1]);
        assert_eq!(group_ends(128, 28), [15]);
        assert!(group_ends(127, 4).is_empty());
        assert!(group_ends(0, 4).is_empty());
    }
}
