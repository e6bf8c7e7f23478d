//! The server's metrics, served by `GET /metrics` in the OpenMetrics text format (the format
//! Prometheus scrapes) through prometheus-client: how requests ended, the tokens they cost, how
//! full the engine is, how the prefix cache does, and how the drafter's guesses fare at each
//! draft position. docs/server.md lists every name.
//!
//! Every counter moves before the response that implies it is sent, so a scrape after a
//! response always sees it.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};

use super::api::Endpoint;
use super::error::ApiError;
use super::lane::{Finish, Summary};
use crate::batch::StepSplit;
use crate::speculative::DrafterSpec;

/// The media type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: &'static str,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneLabels {
    lane: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DraftPositionLabels {
    lane: &'static str,
    position: usize,
}

/// Every metric of one server, shared by the HTTP side and the engine thread.
pub struct Metrics {
    registry: Registry,
    /// The speculative lane's name (the drafter kind); "plain" without a drafter.
    lane: &'static str,
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Counter,
    cached_tokens: Counter,
    completion_tokens: Counter,
    queued: Gauge,
    queue_seconds: Counter<f64, AtomicU64>,
    running: Gauge,
    prefix_hits: Counter,
    prefix_misses: Counter,
    prefix_entries: Gauge,
    prefix_bytes: Gauge,
    steps: Counter,
    step_rows: Counter,
    shared_steps: Counter,
    shared_draft_steps: Counter,
    undrafted_steps: Counter,
    drafted_ahead_steps: Counter,
    step_seconds: Family<PhaseLabels, Counter<f64, AtomicU64>>,
    engine_seconds: Family<PhaseLabels, Counter<f64, AtomicU64>>,
    rounds: Family<LaneLabels, Counter>,
    drafted: Family<DraftPositionLabels, Counter>,
    accepted: Family<DraftPositionLabels, Counter>,
}

/// The lane a drafter makes, as the metrics label it.
fn lane_name(drafter: Option<&DrafterSpec>) -> &'static str {
    match drafter {
        None => "plain",
        Some(DrafterSpec::Model(_)) => "draft_model",
        Some(DrafterSpec::Ngram { .. }) => "ngram",
        Some(DrafterSpec::Mtp { .. }) => "mtp",
        Some(DrafterSpec::Dflash { .. }) => "dflash",
    }
}

/// A refusal's outcome label: the client's fault, a full or closing server, or ours.
fn refusal_name(e: &ApiError) -> &'static str {
    if e.status.is_client_error() {
        "invalid"
    } else if e.status == axum::http::StatusCode::SERVICE_UNAVAILABLE {
        "unavailable"
    } else {
        "error"
    }
}

/// A new metric, registered under `name`.
fn registered<M: Metric + Clone + Default>(registry: &mut Registry, name: &str, help: &str) -> M {
    let metric = M::default();
    registry.register(name, help, metric.clone());
    metric
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn level(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Metrics {
    /// The metrics of a server whose speculative lane `drafter` makes (None: plain).
    pub fn new(drafter: Option<&DrafterSpec>) -> Metrics {
        let mut registry = Registry::with_prefix("verity");
        let r = &mut registry;
        let position = "by lane and draft position (0: the first draft)";
        Metrics {
            lane: lane_name(drafter),
            requests: registered(
                r,
                "requests",
                "Generation requests by endpoint and outcome (a finish reason, cancelled, \
                 invalid, unavailable or error)",
            ),
            prompt_tokens: registered(r, "prompt_tokens", "Prompt tokens of finished requests"),
            cached_tokens: registered(
                r,
                "cached_prompt_tokens",
                "Prompt tokens of finished requests restored from the prefix cache",
            ),
            completion_tokens: registered(
                r,
                "completion_tokens",
                "Completion tokens of finished requests (their usage.completion_tokens)",
            ),
            queued: registered(r, "queue_depth", "Requests waiting in the queue"),
            queue_seconds: registered(
                r,
                "queue_seconds",
                "Time requests waited in the queue before the engine took them up, summed",
            ),
            running: registered(
                r,
                "running_requests",
                "Requests admitted by the engine and not finished: the rows of the batch",
            ),
            prefix_hits: registered(
                r,
                "prefix_cache_hits",
                "Prompts that restored a prefix from the prefix cache",
            ),
            prefix_misses: registered(
                r,
                "prefix_cache_misses",
                "Prompts that found no prefix in the prefix cache",
            ),
            prefix_entries: registered(
                r,
                "prefix_cache_entries",
                "Prefixes held by the prefix cache",
            ),
            prefix_bytes: registered(r, "prefix_cache_bytes", "Bytes held by the prefix cache"),
            steps: registered(r, "batch_steps", "Batch steps (one forward over every row)"),
            step_rows: registered(
                r,
                "batch_step_rows",
                "Rows of every batch step, summed (over the steps: the batch's mean width)",
            ),
            shared_steps: registered(
                r,
                "batch_shared_cache_steps",
                "Batch steps whose rows shared one KV cache per attention layer (every row over \
                 plain KV caches, a hybrid's beside its recurrent ones)",
            ),
            shared_draft_steps: registered(
                r,
                "batch_shared_draft_cache_steps",
                "Batch steps whose rows drafting with one draft model shared its KV caches",
            ),
            undrafted_steps: registered(
                r,
                "batch_undrafted_steps",
                "Batch steps whose greedy speculative rows decoded plain, plain steps having \
                 measured faster than drafting (--adaptive-drafts)",
            ),
            drafted_ahead_steps: registered(
                r,
                "batch_drafted_ahead_steps",
                "Batch steps that fed a draft group's next drafts before reading its verdicts \
                 (greedy rows of one draft a round)",
            ),
            step_seconds: registered(
                r,
                "batch_step_seconds",
                "Time in batch steps by phase: draft (the speculative rows' drafts), build (the \
                 step's graph), eval (launching it and waiting for every row's tokens), settle \
                 (reading them back, acceptance, rollback, the answers)",
            ),
            engine_seconds: registered(
                r,
                "engine_seconds",
                "Time the engine thread spent outside batch steps, by phase: join (admitting a \
                 request and prefilling its prompt, the running rows' steps between its chunks \
                 not included), keep (prefilling a finished chat's answer for the prefix \
                 cache), finish (the rest of a step's turn: the finished rows' caches taken \
                 out of the batch, their answers and reports) and idle (waiting for a request \
                 with no row running)",
            ),
            rounds: registered(
                r,
                "speculative_rounds",
                "Verify rounds of finished speculative requests, by lane",
            ),
            drafted: registered(
                r,
                "speculative_drafted",
                &format!("Drafted tokens of finished speculative requests, {position}"),
            ),
            accepted: registered(
                r,
                "speculative_accepted",
                &format!("Accepted drafts of finished speculative requests, {position}"),
            ),
            registry,
        }
    }

    /// Everything, as OpenMetrics text; `queued` is the queue's depth now.
    pub fn render(&self, queued: usize) -> String {
        self.queued.set(level(queued));
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }

    /// Counts one request under its outcome.
    fn request(&self, endpoint: Endpoint, outcome: String) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.name(),
                outcome,
            })
            .inc();
    }

    /// A finished request's tokens and speculation (the engine, before it sends the answer).
    pub fn finished(&self, s: &Summary) {
        self.prompt_tokens.inc_by(count(s.prompt_tokens));
        self.cached_tokens.inc_by(count(s.cached_tokens));
        self.completion_tokens.inc_by(count(s.completion_tokens));
        let Some(sp) = &s.stats.speculation else {
            return;
        };
        let lane = self.lane;
        self.rounds
            .get_or_create(&LaneLabels { lane })
            .inc_by(count(sp.rounds));
        for (position, (&drafted, &accepted)) in sp
            .drafted_by_position
            .iter()
            .zip(&sp.accepted_by_position)
            .enumerate()
        {
            let labels = DraftPositionLabels { lane, position };
            self.drafted.get_or_create(&labels).inc_by(count(drafted));
            self.accepted.get_or_create(&labels).inc_by(count(accepted));
        }
    }

    /// One batch step's split (the engine, after each step).
    pub fn stepped(&self, step: &StepSplit) {
        self.steps.inc_by(count(step.steps));
        self.step_rows.inc_by(count(step.rows));
        self.shared_steps.inc_by(count(step.shared));
        self.shared_draft_steps.inc_by(count(step.shared_drafts));
        self.undrafted_steps.inc_by(count(step.undrafted));
        self.drafted_ahead_steps.inc_by(count(step.drafted_ahead));
        for (phase, spent) in [
            ("draft", step.draft),
            ("build", step.build),
            ("eval", step.eval),
            ("settle", step.settle),
        ] {
            self.step_seconds
                .get_or_create(&PhaseLabels { phase })
                .inc_by(spent.as_secs_f64());
        }
    }

    /// A request waited `spent` in the queue before the engine took it up.
    pub fn waited(&self, spent: Duration) {
        self.queue_seconds.inc_by(spent.as_secs_f64());
    }

    /// Time the engine thread spent outside the steps in `phase` ("join", "keep", "finish" or
    /// "idle").
    pub fn outside_steps(&self, phase: &'static str, spent: Duration) {
        self.engine_seconds
            .get_or_create(&PhaseLabels { phase })
            .inc_by(spent.as_secs_f64());
    }

    /// A prefix cache lookup that restored `cached` tokens (0: a miss).
    pub fn prefix_lookup(&self, cached: usize) {
        if cached > 0 {
            self.prefix_hits.inc();
        } else {
            self.prefix_misses.inc();
        }
    }

    /// What the prefix cache holds after a change.
    pub fn prefix_held(&self, entries: usize, bytes: usize) {
        self.prefix_entries.set(level(entries));
        self.prefix_bytes.set(level(bytes));
    }

    /// Counts a request as running until the returned guard is dropped.
    pub fn running(self: &Arc<Self>) -> Running {
        self.running.inc();
        Running(self.clone())
    }
}

/// One admitted request, counted in `verity_running_requests` while it lives.
pub struct Running(Arc<Metrics>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.dec();
    }
}

/// One HTTP generation request, counted once in `verity_requests_total`: under its finish
/// reason or refusal when it is answered, or as "cancelled" when its client went away first
/// (the tally is dropped unanswered).
pub struct Tally {
    metrics: Arc<Metrics>,
    endpoint: Endpoint,
    counted: bool,
}

impl Tally {
    pub fn new(metrics: Arc<Metrics>, endpoint: Endpoint) -> Tally {
        Tally {
            metrics,
            endpoint,
            counted: false,
        }
    }

    fn count(&mut self, outcome: impl Into<String>) {
        if !self.counted {
            self.counted = true;
            self.metrics.request(self.endpoint, outcome.into());
        }
    }

    /// The request finished (its last chunk or its body is about to go out).
    pub fn finished(&mut self, finish: Finish) {
        self.count(finish.to_string());
    }

    /// The request was refused or failed.
    pub fn refused(&mut self, e: &ApiError) {
        self.count(refusal_name(e));
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        self.count("cancelled");
    }
}
