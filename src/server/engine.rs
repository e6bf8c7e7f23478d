//! The engine thread: the one thread that owns the models and every MLX array (MLX arrays are
//! not shared across threads as verity uses them). The HTTP side hands it jobs through a bounded
//! queue and reads each job's events from its own channel. Requests decode together
//! (continuous batching, crate::batch), speculative ones included: up to `--max-num-seqs` of
//! them, each joining between steps and leaving when it ends. A client that goes away closes its event channel; the engine notices at the next
//! prefill chunk or the next token (within a speculative round too) and stops it there.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{info, Span};

mod handle;
mod history;
mod prompt;

pub use handle::{EngineHandle, EngineThread, Event, Job};
use history::Answered;

use super::api::{GenRequest, Prompt};
use super::error::ApiError;
use super::lane::{refusal, Lane, Outcome};
pub use super::lane::{Finish, RequestStats, SpeculationReport, Summary, TokenInfo, TopLogprob};
use super::metrics::Metrics;
use super::prefix_cache::{all_trim, Hit, PrefixCache};
use super::request_log;
use super::stop::StopMatcher;
use crate::batch::{Batch, DraftPolicy};
use crate::bundle::ModelBundle;
use crate::cache::{KvQuantization, LayerCache};
use crate::decode::{decode, Hooks, Request, Start};
use crate::generate::{Control, GenerateParams, GeneratedToken};
use crate::grammar::Constraint;
use crate::request::reproducible_seed;
use crate::sample::{KeySchedule, ProcessorParams, SamplerParams};
use crate::speculative::{DraftPrefix, Drafter, DrafterSpec};
use crate::{validate, Error};

/// What the engine serves and how it processes prompts.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub model: PathBuf,
    pub drafter: Option<DrafterSpec>,
    /// Drafts per round unless a request names its own; None: 3, or a DFlash drafter's
    /// block_size - 1.
    pub num_draft_tokens: Option<usize>,
    pub device: mlx::Device,
    pub queue_size: usize,
    /// Requests decoded together at most (1: one request at a time).
    pub max_num_seqs: usize,
    pub prefill_step_size: usize,
    pub max_kv_size: Option<usize>,
    pub kv_quantization: Option<KvQuantization>,
    /// The prefix cache's budget in bytes (0: no prefix cache).
    pub prompt_cache_bytes: usize,
    /// A chat template's text and where it came from, replacing the model's.
    pub chat_template: Option<(String, String)>,
    /// Whether greedy speculative rows draft only while drafting measures faster than plain
    /// steps ([`Batch::adapt_drafts`]).
    pub adaptive_drafts: bool,
}

impl EngineConfig {
    /// Everything that shapes a cache, so that an entry of the prefix cache is only ever
    /// restored into the lane that could have made it.
    fn namespace(&self) -> String {
        format!(
            "model={} drafter={:?} max_kv_size={:?} kv={:?}",
            self.model.display(),
            self.drafter,
            self.max_kv_size,
            self.kv_quantization
        )
    }
}

/// Starts the engine thread, loads the model (and the draft, refused unless it fits the target)
/// on it, and returns once it is ready to serve or failed to load.
pub fn start(config: EngineConfig) -> anyhow::Result<(EngineHandle, EngineThread)> {
    let (jobs, queue) = mpsc::channel(config.queue_size);
    let (ready, loaded) = std_mpsc::sync_channel(1);
    let queue_size = config.queue_size;
    let shutdown = Arc::new(AtomicBool::new(false));
    let cut = shutdown.clone();
    let metrics = Arc::new(Metrics::new(config.drafter.as_ref()));
    let engine_metrics = metrics.clone();
    let thread = thread::Builder::new()
        .name("verity-engine".into())
        .spawn(move || {
            let engine = match Engine::load(config, cut, engine_metrics) {
                Ok(engine) => {
                    let _ = ready.send(Ok(engine.model_id.clone()));
                    engine
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            engine.serve(queue);
        })?;
    let model_id = match loaded.recv()? {
        Ok(id) => id,
        Err(e) => {
            // Whatever the failed load had built is freed before the process exits.
            let _ = thread.join();
            return Err(e);
        }
    };
    let handle = EngineHandle {
        jobs,
        model_id,
        queue_size,
        shutdown,
        metrics,
    };
    Ok((handle, EngineThread(thread)))
}

/// The engine thread's state: the target, its drafter if any, and what every request needs
/// from them.
struct Engine {
    config: EngineConfig,
    target: ModelBundle,
    drafter: Option<Drafter>,
    /// Drafts per round unless a request names its own (None: the drafter's default).
    num_draft_tokens: Option<usize>,
    model_id: String,
    /// The model's context length (max_position_embeddings), when its config names one.
    context: Option<usize>,
    /// What XTC never excludes (ModelBundle::xtc_special_tokens).
    xtc_special_tokens: Vec<u32>,
    /// Shared by the lanes (the engine thread's alone).
    prefix: RefCell<PrefixCache>,
    /// Whether a prefill may go on from any prefix of an entry: the target's caches (and a
    /// draft model's) can all be cut back to a prefix, and the model computes a token alike in
    /// any chunk ([`LanguageModel::one_token_path`] is false).
    trims: bool,
    namespace: String,
    /// [`EngineHandle::cut_running`]'s flag.
    shutdown: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    /// Prompt tokens prefilled by joining requests since the running rows last stepped.
    unstepped: Cell<usize>,
    /// Time in [`Engine::step`] so far: a join's own time is its wall time less this.
    stepping: Cell<Duration>,
}

impl Engine {
    fn load(
        config: EngineConfig,
        shutdown: Arc<AtomicBool>,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Engine> {
        mlx::set_default_device(config.device)?;
        let mut target = ModelBundle::load(&config.model)?;
        if let Some((source, origin)) = &config.chat_template {
            target.tokenizer = target.tokenizer.with_chat_template(source, origin);
        }
        let drafter = config
            .drafter
            .as_ref()
            .map(|spec| Drafter::load(spec, &target))
            .transpose()?;
        if let Some(k) = config.num_draft_tokens {
            anyhow::ensure!(
                (1..=validate::MAX_DRAFT_TOKENS).contains(&k),
                "--num-draft-tokens is {k}, must be from 1 to {}",
                validate::MAX_DRAFT_TOKENS
            );
        }
        check_flags(&target, &config)?;
        let prompt_cache_bytes = config.prompt_cache_bytes;
        Ok(Engine {
            shutdown,
            metrics,
            unstepped: Cell::new(0),
            stepping: Cell::new(Duration::ZERO),
            model_id: config.model.display().to_string(),
            prefix: RefCell::new(PrefixCache::new(prompt_cache_bytes)),
            trims: config.kv_quantization.is_none()
                && all_trim(&target.model().make_cache(config.max_kv_size))
                && !target.model().one_token_path()
                && drafter
                    .as_ref()
                    .and_then(Drafter::draft_model)
                    .is_none_or(|d| {
                        all_trim(&d.model().make_cache(None)) && !d.model().one_token_path()
                    }),
            namespace: config.namespace(),
            context: target.context_length(),
            xtc_special_tokens: target.xtc_special_tokens()?,
            num_draft_tokens: config.num_draft_tokens,
            config,
            target,
            drafter,
        })
    }

    fn serve(self, queue: mpsc::Receiver<Job>) {
        if self.config.max_num_seqs == 1 {
            self.serve_one_at_a_time(queue)
        } else {
            self.serve_batched(queue)
        }
    }

    /// `--max-num-seqs 1`: one request at a time, in arrival order.
    fn serve_one_at_a_time(&self, mut queue: mpsc::Receiver<Job>) {
        while let Some(job) = queue.blocking_recv() {
            let (events, span) = (job.events.clone(), job.span.clone());
            // A panicking request fails alone: the engine thread goes on serving the queue.
            let mut answered = None;
            let outcome = panic::catch_unwind(AssertUnwindSafe(|| self.run(job, &mut answered)))
                .unwrap_or_else(|_| Err(ApiError::internal("the request panicked in the engine")));
            self.report(outcome, &events, &span);
            if let Some(answered) = answered {
                self.keep_answer(&answered, None);
            }
            mlx::memory::clear_cache();
        }
    }

    /// Continuous batching: requests join the batch between steps (each prefilled alone, the
    /// running rows stepping between chunks, [`Engine::join`]), up to `max_num_seqs` at a time, and leave it
    /// when they finish or their client goes away; every step runs one forward over each row's
    /// next token (a speculative row's round: its last token and its drafts).
    fn serve_batched(&self, mut queue: mpsc::Receiver<Job>) {
        let mut batch = self.new_batch();
        let mut lanes: HashMap<usize, Lane> = HashMap::new();
        let mut next_id = 0;
        loop {
            while lanes.len() < self.config.max_num_seqs {
                let job = if lanes.is_empty() {
                    let waiting = Instant::now();
                    let job = queue.blocking_recv();
                    self.metrics.outside_steps("idle", waiting.elapsed());
                    match job {
                        Some(job) => job,
                        None => return,
                    }
                } else {
                    match queue.try_recv() {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                };
                let (events, span) = (job.events.clone(), job.span.clone());
                let (started, stepped) = (Instant::now(), self.stepping.get());
                let joined = panic::catch_unwind(AssertUnwindSafe(|| {
                    self.join(&mut batch, &mut lanes, next_id, job)
                }))
                .unwrap_or_else(|_| Err(ApiError::internal("the request panicked in the engine")));
                let between = self.stepping.get() - stepped;
                self.metrics
                    .outside_steps("join", started.elapsed().saturating_sub(between));
                match joined {
                    Ok(Ok(lane)) => {
                        lanes.insert(next_id, lane);
                        next_id += 1;
                    }
                    Ok(Err(ended)) => self.report(Ok(ended), &events, &span),
                    Err(e) => self.report(Err(e), &events, &span),
                }
            }
            if lanes.is_empty() {
                mlx::memory::clear_cache();
                continue;
            }
            self.step(&mut batch, &mut lanes);
        }
    }

    fn new_batch(&self) -> Batch<'_> {
        let mut batch = Batch::new(self.target.model());
        batch.adapt_drafts(self.config.adaptive_drafts.then(DraftPolicy::default));
        batch
    }

    /// One step of every row in `batch`, each lane told its tokens; the lanes whose requests
    /// ended are reported and removed. A failed step fails every row and empties the batch.
    fn step<'s>(&'s self, batch: &mut Batch<'s>, lanes: &mut HashMap<usize, Lane>) {
        let started = Instant::now();
        self.unstepped.set(0);
        let width = lanes.len();
        for lane in lanes.values_mut() {
            lane.batch_rows = lane.batch_rows.max(width);
        }
        let target = &self.target;
        let mut on_token = |id: usize, step: &GeneratedToken| match lanes.get_mut(&id) {
            Some(lane) => lane.on_token(target, step),
            None => Control::Stop,
        };
        let before = batch.split().clone();
        let stepped = panic::catch_unwind(AssertUnwindSafe(|| batch.step(&mut on_token)))
            .unwrap_or_else(|_| Err(crate::Error::Contract("a batch step panicked".into())));
        match stepped {
            Ok(left) => {
                let split = batch.split().since(&before);
                self.metrics.stepped(&split);
                let mut kept = Duration::ZERO;
                for left in left {
                    let lane = lanes.remove(&left.id).expect("a row is a lane");
                    let answered = lane.answered().then(|| self.answered(&lane));
                    let (events, span) = (lane.events.clone(), lane.span.clone());
                    self.report(lane.outcome(left.speculation.as_ref()), &events, &span);
                    if let Some(answered) = answered {
                        kept += self.keep_answer(&answered, left.caches);
                    }
                }
                let finishing = started.elapsed().saturating_sub(split.total() + kept);
                self.metrics.outside_steps("finish", finishing);
            }
            Err(e) => {
                // MLX state of the rows is unknown after a failed step: every row fails.
                let e = refusal(e);
                for (_, lane) in lanes.drain() {
                    self.report(Err(e.clone()), &lane.events, &lane.span);
                }
                *batch = self.new_batch();
            }
        }
        self.stepping.set(self.stepping.get() + started.elapsed());
    }

    /// Logs how a request ended (in its span), counts it, and tells its client.
    fn report(
        &self,
        outcome: Result<Outcome, ApiError>,
        events: &mpsc::UnboundedSender<Event>,
        span: &Span,
    ) {
        let _in_request = span.enter();
        match outcome {
            Ok(Outcome::Done(s)) => {
                let prefix = self.prefix.borrow();
                request_log::finished(&s, prefix.len(), prefix.bytes());
                self.metrics.finished(&s);
                let _ = events.send(Event::Done(*s));
            }
            Ok(Outcome::Cancelled { tokens }) => info!(tokens, "cancelled by the client"),
            Ok(Outcome::CancelledInPrefill) => {
                info!("cancelled by the client during the prefill")
            }
            Err(e) => {
                request_log::refused(&e);
                let _ = events.send(Event::Failed(e));
            }
        }
    }

    /// Validates a request, tells its client it started, and finds where its prefill starts
    /// (a prefix cache hit, or fresh caches); `Err(Outcome)` when the client is gone already.
    fn admit(&self, job: Job) -> Result<Result<Admitted, Outcome>, ApiError> {
        let Job {
            request,
            events,
            span,
            queued,
        } = job;
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(ApiError::shutting_down());
        }
        let started = Instant::now();
        self.metrics.waited(started - queued);
        let prompt = self.prompt_tokens(&request).map_err(refusal)?;
        let mut params = self.params(&request, &prompt);
        validate::request(self.target.model(), &prompt, &params).map_err(refusal)?;
        if let Some(room) = self.context.and_then(|c| c.checked_sub(prompt.len())) {
            if params.max_tokens > room && request.max_tokens_named {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!(
                        "max_tokens is {}, but the prompt's {} tokens leave {room} of the \
                         model's context of {} tokens",
                        params.max_tokens,
                        prompt.len(),
                        prompt.len() + room
                    ),
                ));
            }
            params.max_tokens = params.max_tokens.min(room.max(1));
        }
        if let Some(context) = self.context.filter(|&c| prompt.len() > c) {
            let param = match request.prompt {
                Prompt::Messages(_) => "messages",
                Prompt::Text(_) | Prompt::Tokens(_) => "prompt",
            };
            return Err(ApiError::invalid(
                param,
                format!(
                    "the prompt is {} tokens, longer than the model's context of {context} tokens",
                    prompt.len()
                ),
            ));
        }
        let grammar = match self.call_grammar(&request)? {
            Some(g) => Some(g),
            None => request.grammar.clone(),
        };
        let constraint = grammar
            .as_ref()
            .map(|g| self.target.constraint(g))
            .transpose()
            .map_err(refusal)?;
        if events
            .send(Event::Started {
                prompt_tokens: prompt.len(),
                channels: Box::new(self.channels(&request, &prompt)),
            })
            .is_err()
        {
            return Ok(Err(Outcome::Cancelled { tokens: 0 }));
        }
        let mut hit = self.lookup(&prompt, &params.prefill_splits);
        let cached = hit.as_ref().map_or(0, |h| h.cached);
        self.metrics.prefix_lookup(cached);
        if let Some(end) = self
            .system_end(&request, &prompt)
            .filter(|&end| end > cached)
        {
            self.keep_prefill(&prompt[..=end], hit, &params.prefill_splits);
            hit = self.lookup(&prompt, &params.prefill_splits);
        }
        let start = Hit::start(hit);
        let lane = Lane {
            detok: self.target.tokenizer.detokenizer(),
            stop: StopMatcher::new(request.stop.clone()),
            request,
            events,
            count: 0,
            started,
            first_token_at: None,
            prompt_tokens: prompt.len(),
            cached,
            tokens: prompt.clone(),
            text: String::new(),
            batch_rows: 1,
            prefill_chunks: 0,
            interleaved_steps: 0,
            finish: None,
            shutdown: self.shutdown.clone(),
            _running: self.metrics.running(),
            span,
            cut: false,
            cancelled: false,
            error: None,
        };
        Ok(Ok(Admitted {
            lane,
            prompt,
            params,
            constraint,
            start,
        }))
    }

    /// Admits `job` and prefills it into `batch` as row `id`. The running rows (`lanes`) step
    /// after a chunk once the prompts joining since their last step have prefilled
    /// `prefill_step_size` tokens (vLLM's token budget per step): a long prompt holds them up a
    /// chunk at a time, and short prompts arriving together all join before the next step,
    /// where a step after each would make the last of 32 wait 32 steps.
    fn join<'s>(
        &'s self,
        batch: &mut Batch<'s>,
        lanes: &mut HashMap<usize, Lane>,
        id: usize,
        job: Job,
    ) -> Result<Result<Lane, Outcome>, ApiError> {
        let admitted = match self.admit(job)? {
            Ok(admitted) => admitted,
            Err(ended) => return Ok(Err(ended)),
        };
        let Admitted {
            mut lane,
            prompt,
            params,
            constraint,
            start,
        } = admitted;
        let num_draft_tokens = lane.request.num_draft_tokens.or(self.num_draft_tokens);
        let mut prefilled = lane.cached;
        let mut between_chunks = |batch: &mut Batch<'s>, done: usize| {
            lane.prefill_chunks += 1;
            self.unstepped
                .set(self.unstepped.get() + done.saturating_sub(prefilled));
            prefilled = done;
            if !lanes.is_empty() && self.unstepped.get() >= self.config.prefill_step_size {
                self.step(batch, lanes);
                lane.interleaved_steps += 1;
            }
            lane.gone()
        };
        let mut keep = |target: &[LayerCache], draft: Option<&DraftPrefix>| {
            self.keep_prefix(&prompt, target, draft)
        };
        let request = Request {
            prompt: &prompt,
            params: &params,
            constraint,
            num_draft_tokens,
        };
        let drafter = self.drafter.as_ref();
        let added = batch.add(
            id,
            drafter,
            start,
            request,
            Some(&mut between_chunks),
            Some(&mut keep),
        );
        Ok(match checked(added)? {
            Some(()) => Ok(lane),
            None => Err(Outcome::CancelledInPrefill),
        })
    }

    /// Runs one request to its end or until the client goes away; `answered` then holds its
    /// [`Engine::answered`] tokens when it ended with a finish reason of its own.
    fn run(&self, job: Job, answered: &mut Option<Answered>) -> Result<Outcome, ApiError> {
        let admitted = match self.admit(job)? {
            Ok(admitted) => admitted,
            Err(ended) => return Ok(ended),
        };
        let Admitted {
            mut lane,
            prompt,
            params,
            constraint,
            start,
        } = admitted;
        let num_draft_tokens = lane.request.num_draft_tokens.or(self.num_draft_tokens);
        let events = lane.events.clone();
        let chunks = Cell::new(0);
        let mut gone = |_| {
            chunks.set(chunks.get() + 1);
            if events.is_closed() {
                Control::Stop
            } else {
                Control::Continue
            }
        };
        let mut keep = |target: &[LayerCache], draft: Option<&DraftPrefix>| {
            self.keep_prefix(&prompt, target, draft)
        };
        let target = &self.target;
        let mut on_token = |step: &GeneratedToken| lane.on_token(target, step);
        let hooks = Hooks {
            on_token: &mut on_token,
            on_chunk: Some(&mut gone),
            on_prefilled: Some(&mut keep),
        };
        let request = Request {
            prompt: &prompt,
            params: &params,
            constraint,
            num_draft_tokens,
        };
        let decoded = decode(
            self.target.model(),
            self.drafter.as_ref(),
            start,
            request,
            hooks,
        );
        let Some(decoded) = checked(decoded)? else {
            return Ok(Outcome::CancelledInPrefill);
        };
        lane.prefill_chunks = chunks.get();
        *answered = lane.answered().then(|| self.answered(&lane));
        lane.outcome(decoded.speculation.as_ref())
    }

    /// The request's generation parameters. Sampling without a seed uses seed 0 (as
    /// `verity generate` does), so every response can be reproduced.
    fn params(&self, r: &GenRequest, prompt: &[u32]) -> GenerateParams {
        GenerateParams {
            max_tokens: r.max_tokens,
            sampler: SamplerParams {
                temp: r.temperature,
                top_p: r.top_p,
                min_p: r.min_p,
                top_k: r.top_k,
                xtc_probability: r.xtc_probability,
                xtc_threshold: r.xtc_threshold,
                xtc_special_tokens: self.xtc_special_tokens.clone(),
                ..SamplerParams::default()
            },
            processors: ProcessorParams {
                logit_bias: r.logit_bias.clone(),
                repetition_penalty: r.repetition_penalty,
                repetition_context_size: r.repetition_context_size,
                presence_penalty: r.presence_penalty,
                presence_context_size: r.presence_context_size,
                frequency_penalty: r.frequency_penalty,
                frequency_context_size: r.frequency_context_size,
            },
            seed: reproducible_seed(r.seed, r.temperature),
            keys: KeySchedule::Sequence,
            prefill_step_size: self.config.prefill_step_size,
            prefill_splits: self.prefill_splits(r, prompt),
            max_kv_size: self.config.max_kv_size,
            kv_quantization: self.config.kv_quantization,
            eos_token_ids: self.target.eos_token_ids.clone(),
        }
    }
}

/// The server's own cache flags, checked as every request's parameters will be, so that a bad
/// flag stops the server before it listens rather than failing every request.
fn check_flags(target: &ModelBundle, config: &EngineConfig) -> anyhow::Result<()> {
    let params = GenerateParams {
        prefill_step_size: config.prefill_step_size,
        max_kv_size: config.max_kv_size,
        kv_quantization: config.kv_quantization,
        ..GenerateParams::greedy(1, Vec::new())
    };
    validate::request(target.model(), &[0], &params)
        .map_err(|e| anyhow::anyhow!("verity serve's cache flags: {e}"))
}

/// An engine result as a lane sees it: cancelled during the prefill is no error (`None`).
fn checked<T>(result: crate::Result<T>) -> Result<Option<T>, ApiError> {
    match result {
        Ok(v) => Ok(Some(v)),
        Err(Error::Cancelled) => Ok(None),
        Err(e) => Err(refusal(e)),
    }
}

/// A validated request whose client was told it started, and what its decode needs.
struct Admitted {
    lane: Lane,
    prompt: Vec<u32>,
    params: GenerateParams,
    constraint: Option<Constraint>,
    start: Start,
}
