//! The engine thread: the one thread that owns the models and every MLX array (MLX arrays are
//! not shared across threads as verity uses them). The HTTP side hands it jobs through a bounded
//! queue and reads each job's events from its own channel. Requests decode together
//! (continuous batching, crate::batch), speculative ones included: up to `--max-num-seqs` of
//! them, each joining between steps and leaving when it ends. A client that goes away closes its event channel; the engine notices at the next
//! prefill chunk or the next token (within a speculative round too) and stops it there.

use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Map};
use tokio::sync::mpsc;
use tracing::{info, warn, Span};

use super::api::{ApiError, GenRequest, Prompt, ToolChoice};
use super::channels::Channels;
use super::lane::{refusal, Lane, Outcome};
pub use super::lane::{Finish, RequestStats, SpeculationReport, Summary, TokenInfo, TopLogprob};
use super::metrics::Metrics;
use super::prefix_cache::{all_trim, Hit, PrefixCache};
use super::request_log;
use super::stop::StopMatcher;
use super::tools::{self, CallFormatter};
use crate::batch::Batch;
use crate::bundle::ModelBundle;
use crate::cache::{KvQuantization, LayerCache};
use crate::decode::{decode, Hooks, Request, Start};
use crate::generate::{Control, GenerateParams, GeneratedToken};
use crate::grammar::{Constraint, Grammar};
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

/// What the engine tells the HTTP side about one request, in this order: `Started` or
/// `Failed`; then `Delta`s; then `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// The request passed validation and the prompt is being processed.
    Started {
        prompt_tokens: usize,
        /// How a chat answer's text splits into content, reasoning and tool calls.
        channels: Box<Channels>,
    },
    /// Text released by the stop matcher (possibly empty) and the tokens just generated.
    Delta {
        text: String,
        tokens: Vec<TokenInfo>,
    },
    Done(Summary),
    Failed(ApiError),
}

/// A request, where its events go, and its log span.
pub struct Job {
    pub request: GenRequest,
    pub events: mpsc::UnboundedSender<Event>,
    pub span: Span,
}

/// The HTTP side's handle: the bounded queue into the engine thread, and what it serves.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: mpsc::Sender<Job>,
    pub model_id: String,
    pub queue_size: usize,
    shutdown: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
}

impl EngineHandle {
    /// The shutdown's cut: every running request ends at its next token with finish_reason
    /// "shutdown" (its held-back text released), and every request not yet admitted is
    /// answered 503.
    pub fn cut_running(&self) {
        self.shutdown.store(true, Ordering::Relaxed);
    }

    /// Queues a request, logged under `span`; refuses at once when the queue is full (never
    /// waits).
    pub fn submit(
        &self,
        request: GenRequest,
        span: Span,
    ) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        let (events, rx) = mpsc::unbounded_channel();
        self.jobs
            .try_send(Job {
                request,
                events,
                span,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => ApiError::busy(self.queue_size),
                mpsc::error::TrySendError::Closed(_) => {
                    ApiError::internal("the engine thread has stopped")
                }
            })?;
        Ok(rx)
    }

    /// Requests waiting in the queue.
    pub fn queued(&self) -> usize {
        self.jobs.max_capacity() - self.jobs.capacity()
    }
}

/// The engine thread itself. It ends once every [`EngineHandle`] is dropped, freeing the model
/// as it goes; the process joins it before exiting, since an MLX array freed while the
/// process's static destructors (MLX's allocator among them) run corrupts the heap.
pub struct EngineThread(thread::JoinHandle<()>);

impl EngineThread {
    /// Waits up to `limit` for the engine thread to end; false if it is still running.
    pub fn join_within(self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !self.0.is_finished() {
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(10));
        }
        self.0.join().is_ok()
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
    /// Whether the target's caches (and a draft model's) can all be cut back to a prefix.
    trims: bool,
    namespace: String,
    /// [`EngineHandle::cut_running`]'s flag.
    shutdown: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
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
            model_id: config.model.display().to_string(),
            prefix: RefCell::new(PrefixCache::new(prompt_cache_bytes)),
            trims: config.kv_quantization.is_none()
                && all_trim(&target.model().make_cache(config.max_kv_size))
                && drafter
                    .as_ref()
                    .and_then(Drafter::draft_model)
                    .is_none_or(|d| all_trim(&d.model().make_cache(None))),
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
    /// running rows stepping between its chunks), up to `max_num_seqs` at a time, and leave it
    /// when they finish or their client goes away; every step runs one forward over each row's
    /// next token (a speculative row's round: its last token and its drafts).
    fn serve_batched(&self, mut queue: mpsc::Receiver<Job>) {
        let mut batch = Batch::new(self.target.model());
        let mut lanes: HashMap<usize, Lane> = HashMap::new();
        let mut next_id = 0;
        loop {
            while lanes.len() < self.config.max_num_seqs {
                let job = if lanes.is_empty() {
                    match queue.blocking_recv() {
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
                let joined = panic::catch_unwind(AssertUnwindSafe(|| {
                    self.join(&mut batch, &mut lanes, next_id, job)
                }))
                .unwrap_or_else(|_| Err(ApiError::internal("the request panicked in the engine")));
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

    /// One step of every row in `batch`, each lane told its tokens; the lanes whose requests
    /// ended are reported and removed. A failed step fails every row and empties the batch.
    fn step<'s>(&'s self, batch: &mut Batch<'s>, lanes: &mut HashMap<usize, Lane>) {
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
                self.metrics.stepped(&batch.split().since(&before));
                for left in left {
                    let lane = lanes.remove(&left.id).expect("a row is a lane");
                    let answered = lane.answered().then(|| self.answered(&lane));
                    let (events, span) = (lane.events.clone(), lane.span.clone());
                    self.report(lane.outcome(left.speculation.as_ref()), &events, &span);
                    if let Some(answered) = answered {
                        self.keep_answer(&answered, left.caches);
                    }
                }
            }
            Err(e) => {
                // MLX state of the rows is unknown after a failed step: every row fails.
                let e = refusal(e);
                for (_, lane) in lanes.drain() {
                    self.report(Err(e.clone()), &lane.events, &lane.span);
                }
                *batch = Batch::new(self.target.model());
            }
        }
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
                let _ = events.send(Event::Done(s));
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
        } = job;
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(ApiError::shutting_down());
        }
        let started = Instant::now();
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
        let mut hit = self.prefix.borrow_mut().lookup(&self.namespace, &prompt);
        let cached = hit.as_ref().map_or(0, |h| h.cached);
        self.metrics.prefix_lookup(cached);
        if let Some(end) = self
            .system_end(&request, &prompt)
            .filter(|&end| end > cached)
        {
            self.keep_prefill(&prompt[..=end], hit, &params.prefill_splits);
            hit = self.prefix.borrow_mut().lookup(&self.namespace, &prompt);
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

    /// A finished lane's prompt and generated tokens, and the tokens the next turn of its
    /// conversation starts with: the chat rendered (with the request's template variables)
    /// with the answer as the client carries it back as the assistant's message (its content
    /// and tool calls; reasoning is not sent back), but the template's last token (the next
    /// prompt goes on after the end of the turn), when that goes on from the prompt. Otherwise
    /// (a raw prompt, or a history the template renders otherwise) the prompt and the
    /// generated tokens.
    fn answered(&self, lane: &Lane) -> Answered {
        let generated = lane.tokens.clone();
        let prompt = &generated[..lane.prompt_tokens];
        let rendered = match &lane.request.prompt {
            Prompt::Messages(messages) => {
                let mut channels = self.channels(&lane.request, prompt);
                let mut said = channels.push(&lane.text);
                said.extend(channels.finish(true));
                let mut answer = json!({"role": "assistant", "content": said.content});
                let calls = CallFormatter::new(false).format(&said.calls);
                if !calls.is_empty() {
                    answer["tool_calls"] = json!(calls);
                }
                let chat = [messages.as_slice(), &[answer]].concat();
                let tokenizer = &self.target.tokenizer;
                tokenizer
                    .apply_chat_template(&chat, false, &template_variables(&lane.request))
                    .ok()
                    .and_then(|text| tokenizer.encode(&text, false).ok())
            }
            Prompt::Text(_) | Prompt::Tokens(_) => None,
        };
        let next = match rendered {
            Some(mut r) if r.len() > prompt.len() + 1 && r.starts_with(prompt) => {
                r.pop();
                r
            }
            _ => generated.clone(),
        };
        let mut splits = self.prefill_splits(&lane.request, prompt);
        splits.push(prompt.len() - 1);
        Answered {
            prompt_tokens: prompt.len(),
            generated,
            next,
            splits,
        }
    }

    /// Stores caches holding a finished request's `next` tokens but the last
    /// ([`Engine::answered`]) in the prefix cache, so that the next turn of a conversation
    /// prefills only what it adds. A plain row's own KV and recurrent caches are kept first,
    /// under what they hold, when `next` goes on from it (they hold the same bits whether a
    /// token was decoded or prefilled, on the CPU). Then the rest of `next` is prefilled onto
    /// the entry that holds the most of it, after the client has its response: the few tokens
    /// the template adds after a kept row (its end of turn), or the whole answer onto the
    /// prompt's entry where the row's own caches are not what a prefill makes (a rotating
    /// cache holds a decoded window in another order, a quantized one was quantized at other
    /// points, a verify forward's rows are not a prefill's, a lone request's caches were
    /// consumed by its decode) or the answer the client carries back is other tokens than
    /// those generated.
    fn keep_answer(&self, answered: &Answered, caches: Option<Vec<LayerCache>>) {
        let held = &answered.generated[..answered.generated.len() - 1];
        let own = caches.filter(|caches| {
            answered.next.starts_with(held)
                && caches.iter().all(|c| {
                    matches!(c, LayerCache::Kv(_) | LayerCache::Recurrent(_))
                        && c.offset() == held.len()
                })
        });
        if let Some(caches) = own {
            let mut prefix = self.prefix.borrow_mut();
            prefix.insert(&self.namespace, held, &caches, None);
            self.metrics.prefix_held(prefix.len(), prefix.bytes());
        }
        self.prefill_answer(&answered.next, answered.prompt_tokens, &answered.splits);
    }

    /// Where a chat's system messages end in `prompt` (the tokens it shares with the system
    /// messages rendered before an empty user message, as mlx_lm.server's `_tokenize` splits
    /// its prompt), when the model's caches cannot be cut back: there the prefix cache keeps a
    /// checkpoint, so that conversations that share a system prompt share its prefill. KV
    /// caches need none, a longer entry is cut back to what prompts share.
    fn system_end(&self, request: &GenRequest, prompt: &[u32]) -> Option<usize> {
        let Prompt::Messages(messages) = &request.prompt else {
            return None;
        };
        let systems = messages
            .iter()
            .take_while(|m| m["role"] == "system")
            .count();
        if self.trims || systems == 0 || messages.last()?["role"] != "user" {
            return None;
        }
        let opening = [
            &messages[..systems],
            &[json!({"role": "user", "content": ""})],
        ]
        .concat();
        let tokenizer = &self.target.tokenizer;
        let text = tokenizer
            .apply_chat_template(&opening, false, &template_variables(request))
            .ok()?;
        let opening = tokenizer.encode(&text, false).ok()?;
        let end = opening
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        (end > 0 && end + 1 < prompt.len()).then_some(end)
    }

    /// Prefills `tokens` but the last onto the prefix cache's entry that holds the most of
    /// them, at least the first `prompt_tokens` but one (the prompt's), and keeps the result.
    /// Nothing happens when no entry holds the prompt any more: the next turn would prefill
    /// all of it anyway.
    fn prefill_answer(&self, tokens: &[u32], prompt_tokens: usize, splits: &[usize]) {
        let hit = self.prefix.borrow_mut().lookup(&self.namespace, tokens);
        if let Some(hit) = hit.filter(|h| h.cached + 1 >= prompt_tokens) {
            self.keep_prefill(tokens, Some(hit), splits);
        }
    }

    /// Prefills `tokens` but the last from `hit` (fresh caches without one), its chunks cut at
    /// `splits` as a request's are ([`Engine::prefill_splits`]), and keeps the result in the
    /// prefix cache, through the decode a request takes (a drafter's caches are prefilled with
    /// the target's); the one token that decode then emits is dropped.
    fn keep_prefill(&self, tokens: &[u32], hit: Option<Hit>, splits: &[usize]) {
        if hit.as_ref().is_some_and(|h| h.cached + 1 == tokens.len()) {
            return;
        }
        let start = Hit::start(hit);
        let params = GenerateParams {
            prefill_step_size: self.config.prefill_step_size,
            prefill_splits: splits.to_vec(),
            max_kv_size: self.config.max_kv_size,
            kv_quantization: self.config.kv_quantization,
            ..GenerateParams::greedy(1, self.target.eos_token_ids.clone())
        };
        let mut keep = |target: &[LayerCache], draft: Option<&DraftPrefix>| {
            self.keep_prefix(tokens, target, draft)
        };
        let mut stop = |_: &GeneratedToken| Control::Stop;
        let hooks = Hooks {
            on_token: &mut stop,
            on_chunk: None,
            on_prefilled: Some(&mut keep),
        };
        let request = Request {
            prompt: tokens,
            params: &params,
            constraint: None,
            num_draft_tokens: None,
        };
        let prefilled = panic::catch_unwind(AssertUnwindSafe(|| {
            decode(
                self.target.model(),
                self.drafter.as_ref(),
                start,
                request,
                hooks,
            )
        }));
        if !matches!(prefilled, Ok(Ok(_))) {
            warn!("a prefill for the prefix cache failed; the next request prefills it");
        }
    }

    /// Stores the caches of `prompt` but its last token in the prefix cache.
    fn keep_prefix(&self, prompt: &[u32], target: &[LayerCache], draft: Option<&DraftPrefix>) {
        let head = &prompt[..prompt.len() - 1];
        let mut prefix = self.prefix.borrow_mut();
        prefix.insert(&self.namespace, head, target, draft);
        self.metrics.prefix_held(prefix.len(), prefix.bytes());
    }

    /// Admits `job` and prefills it into `batch` as row `id`, the running rows (`lanes`)
    /// stepping once after each prefill chunk.
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
            lane,
            prompt,
            params,
            constraint,
            start,
        } = admitted;
        let mut between_chunks = |batch: &mut Batch<'s>, _| {
            if !lanes.is_empty() {
                self.step(batch, lanes);
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
            num_draft_tokens: lane.request.num_draft_tokens.or(self.num_draft_tokens),
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
        let mut gone = |_| {
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
        *answered = lane.answered().then(|| self.answered(&lane));
        lane.outcome(decoded.speculation.as_ref())
    }

    /// The grammar of the request's tool calls: a call `tool_choice` forces, or under "auto"
    /// (without a response_format grammar) every call the model starts.
    fn call_grammar(&self, request: &GenRequest) -> Result<Option<Grammar>, ApiError> {
        let forced = matches!(
            request.tool_choice,
            ToolChoice::Required | ToolChoice::Function(_)
        );
        let auto = request.tool_choice == ToolChoice::Auto && request.grammar.is_none();
        let Some(tools) = request.tools.as_deref().filter(|_| forced || auto) else {
            return Ok(None);
        };
        match self.target.tokenizer.tool_call_markers() {
            Some(markers) => Ok(tools::call_grammar(tools, &request.tool_choice, markers)),
            None if forced => Err(ApiError::invalid(
                "tool_choice",
                "tool_choice forces a tool call, but the model's chat template has no tool-call \
                 format verity parses (Qwen's <tool_call>{json}</tool_call>)",
            )),
            None => Ok(None),
        }
    }

    /// The splitter of a chat answer: the tokenizer's markers, starting in reasoning when the
    /// prompt's last think marker opens a block (mlx_lm.server's initial state, server.py:693).
    /// Completions' text is not split.
    fn channels(&self, request: &GenRequest, prompt: &[u32]) -> Channels {
        let tokenizer = &self.target.tokenizer;
        if !matches!(request.prompt, Prompt::Messages(_)) {
            return Channels::new(None, None, false);
        }
        let think = tokenizer.thinking_markers();
        let last = |text: &str| {
            let ids = tokenizer.encode(text, false).unwrap_or_default();
            (!ids.is_empty())
                .then(|| prompt.windows(ids.len()).rposition(|w| w == ids))
                .flatten()
        };
        let open = think
            .is_some_and(|t| last(&t.start).is_some_and(|s| last(&t.end).is_none_or(|e| s > e)));
        Channels::new(think.cloned(), tokenizer.tool_call_markers().cloned(), open)
    }

    /// The prompt as mlx_lm.server builds it (server.py:618): chat messages (as its
    /// `process_message_content` leaves them) through the chat template with the generation
    /// prompt, the request's tools and template variables, encoded without special tokens; raw
    /// text encoded with them.
    fn prompt_tokens(&self, request: &GenRequest) -> crate::Result<Vec<u32>> {
        let tokenizer = &self.target.tokenizer;
        Ok(match &request.prompt {
            Prompt::Messages(messages) => {
                let extra = template_variables(request);
                let text = tokenizer.apply_chat_template(messages, true, &extra)?;
                tokenizer.encode(&text, false)?
            }
            Prompt::Text(text) => tokenizer.encode(text, true)?,
            Prompt::Tokens(ids) => ids.clone(),
        })
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

    /// Where a chat's prefill cuts its chunks, where the caches cannot be cut back (none
    /// otherwise): wherever the prefix cache may hold an entry of this conversation (the end of
    /// its system messages, and for each earlier turn the end of its prompt but the last token
    /// and the end of its history entry, [`Engine::answered`]), so that a prefill resumed from
    /// any of them and one from the start feed the same chunks. Earlier turns' renderings are
    /// prefixes of this prompt, so their splits are this prompt's below them.
    fn prefill_splits(&self, request: &GenRequest, prompt: &[u32]) -> Vec<usize> {
        let Prompt::Messages(messages) = &request.prompt else {
            return Vec::new();
        };
        if self.trims {
            return Vec::new();
        }
        let (tokenizer, extra) = (&self.target.tokenizer, template_variables(request));
        let tokens = |chat: &[serde_json::Value], generation: bool| {
            let text = tokenizer
                .apply_chat_template(chat, generation, &extra)
                .ok()?;
            tokenizer.encode(&text, false).ok().map(|t| t.len())
        };
        let mut splits: Vec<usize> = self.system_end(request, prompt).into_iter().collect();
        for (i, _) in messages
            .iter()
            .enumerate()
            .filter(|(_, m)| m["role"] == "assistant")
        {
            splits.extend(tokens(&messages[..i], true).map(|n| n.saturating_sub(1)));
            splits.extend(tokens(&messages[..=i], false).map(|n| n.saturating_sub(2)));
        }
        splits.retain(|&s| s > 0 && s < prompt.len());
        splits.sort_unstable();
        splits.dedup();
        splits
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

/// The chat template's variables a request sets: its tools and its `chat_template_kwargs`.
fn template_variables(request: &GenRequest) -> Map<String, serde_json::Value> {
    let mut extra = Map::new();
    if let Some(tools) = &request.tools {
        extra.insert("tools".into(), serde_json::Value::Array(tools.clone()));
    }
    extra.extend(request.chat_template_kwargs.clone());
    extra
}

/// An engine result as a lane sees it: cancelled during the prefill is no error (`None`).
fn checked<T>(result: crate::Result<T>) -> Result<Option<T>, ApiError> {
    match result {
        Ok(v) => Ok(Some(v)),
        Err(Error::Cancelled) => Ok(None),
        Err(e) => Err(refusal(e)),
    }
}

/// A finished request, as the prefix cache keeps it ([`Engine::answered`]).
struct Answered {
    prompt_tokens: usize,
    /// The prompt and every generated token.
    generated: Vec<u32>,
    /// What the next turn of its conversation starts with.
    next: Vec<u32>,
    /// Where prefilling `next` cuts its chunks: the request's splits and the end of its
    /// prompt's entry, which it resumes from.
    splits: Vec<usize>,
}

/// A validated request whose client was told it started, and what its decode needs.
struct Admitted {
    lane: Lane,
    prompt: Vec<u32>,
    params: GenerateParams,
    constraint: Option<Constraint>,
    start: Start,
}
