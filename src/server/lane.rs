//! One request's decode lane in the server: turns the engine's generated tokens into released
//! text and token details through the detokenizer and the stop matcher, sends them to the
//! client, decides when the request stops, and says how it ended.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tokio::sync::mpsc;
use tracing::Span;

use super::api::GenRequest;
use super::engine::Event;
use super::error::ApiError;
use super::metrics::Running;
use super::stop::{Pushed, StopMatcher};
use crate::bundle::ModelBundle;
use crate::generate::{Control, FinishReason, GeneratedToken};
use crate::speculative::SpeculationStats;
use crate::tokenizer::StreamingDetokenizer;
use crate::Error;

/// One alternative at a token position.
#[derive(Clone, Debug)]
pub struct TopLogprob {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
}

/// The chosen token of one step and, when asked, its logprob and the top alternatives.
#[derive(Clone, Debug)]
pub struct TokenInfo {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
    pub top: Vec<TopLogprob>,
}

/// What a request cost, reported next to usage and in the server log. Cached tokens are not
/// counted in the prompt rate.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RequestStats {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub prompt_seconds: f64,
    pub prompt_tokens_per_second: f64,
    pub completion_tokens: usize,
    pub decode_seconds: f64,
    pub decode_tokens_per_second: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculation: Option<SpeculationReport>,
}

/// The speculation counters, in the project's vocabulary (docs/DESIGN.md section 8).
#[derive(Clone, Debug, Serialize)]
pub struct SpeculationReport {
    pub rounds: usize,
    pub undrafted_steps: usize,
    pub drafted: usize,
    pub accepted: usize,
    pub drafted_by_position: Vec<usize>,
    pub accepted_by_position: Vec<usize>,
    pub target_calls: usize,
    pub from_draft: usize,
    pub refused_rounds: usize,
}

impl From<&SpeculationStats> for SpeculationReport {
    fn from(s: &SpeculationStats) -> SpeculationReport {
        SpeculationReport {
            rounds: s.rounds,
            undrafted_steps: s.undrafted_steps,
            drafted: s.drafted,
            accepted: s.accepted,
            drafted_by_position: s.drafted_by_pos.clone(),
            accepted_by_position: s.accepted_by_pos.clone(),
            target_calls: s.target_calls,
            from_draft: s.from_draft,
            refused_rounds: s.refused_rounds,
        }
    }
}

/// How a finished request ended.
#[derive(Clone, Debug)]
pub struct Summary {
    pub finish_reason: Finish,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub stats: RequestStats,
    /// The most rows the request decoded beside in one batch step (1: alone).
    pub batch_rows: usize,
    /// The chunks its prompt was prefilled in (0 when the prefix cache held all but its last
    /// token).
    pub prefill_chunks: usize,
    /// The batch steps the running rows took between those chunks: a long prompt joining
    /// delays them by a chunk at a time, not by its whole prefill.
    pub interleaved_steps: usize,
}

/// Why a request ended, as the API names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// EOS, a stop sequence or max_tokens.
    Decoded(FinishReason),
    /// The server shut down before the request ended (its drain timeout passed): "shutdown".
    Shutdown,
}

impl fmt::Display for Finish {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finish::Decoded(reason) => reason.fmt(f),
            Finish::Shutdown => f.write_str("shutdown"),
        }
    }
}

/// How a request left the engine.
pub(super) enum Outcome {
    Done(Box<Summary>),
    /// The client went away after this many tokens were generated.
    Cancelled {
        tokens: usize,
    },
    /// The client went away while the prompt was being prefilled.
    CancelledInPrefill,
}

/// An engine error as an HTTP error: bad input is the client's (400), anything else ours (500).
pub(super) fn refusal(e: Error) -> ApiError {
    if e.is_bad_input() {
        ApiError::bad_input(e.to_string())
    } else {
        ApiError::internal(e.to_string())
    }
}

/// One request's decode lane: turns generated tokens into released text through the
/// detokenizer and the stop matcher, sends them, and decides when to stop.
pub(super) struct Lane {
    pub(super) request: GenRequest,
    pub(super) events: mpsc::UnboundedSender<Event>,
    pub(super) detok: StreamingDetokenizer,
    pub(super) stop: StopMatcher,
    pub(super) count: usize,
    pub(super) started: Instant,
    pub(super) first_token_at: Option<Instant>,
    pub(super) prompt_tokens: usize,
    /// Prompt tokens restored from the prefix cache.
    pub(super) cached: usize,
    /// The prompt, then every token emitted: a plain row's caches hold all but the last.
    pub(super) tokens: Vec<u32>,
    /// Every text released to the client: the answer a conversation's next turn carries.
    pub(super) text: String,
    /// The widest batch step this lane took part in.
    pub(super) batch_rows: usize,
    pub(super) prefill_chunks: usize,
    pub(super) interleaved_steps: usize,
    pub(super) finish: Option<FinishReason>,
    /// Set by the server's shutdown (`EngineHandle::cut_running`): the lane ends at its next
    /// token, with its held-back text released.
    pub(super) shutdown: Arc<AtomicBool>,
    /// Counts the request as running while the lane lives.
    pub(super) _running: Running,
    /// The request's log span.
    pub(super) span: Span,
    /// Ended by the shutdown.
    pub(super) cut: bool,
    pub(super) cancelled: bool,
    pub(super) error: Option<ApiError>,
}

impl Lane {
    /// `Stop` once the client went away (asked after each prefill chunk).
    pub(super) fn gone(&self) -> Control {
        if self.events.is_closed() {
            Control::Stop
        } else {
            Control::Continue
        }
    }

    /// Whether the request ended with a finish reason of its own: not failed, cancelled or cut
    /// by the shutdown.
    pub(super) fn answered(&self) -> bool {
        self.finish.is_some() && self.error.is_none() && !self.cancelled && !self.cut
    }

    /// How the request ended, once its decode is over.
    pub(super) fn outcome(
        mut self,
        speculation: Option<&SpeculationStats>,
    ) -> Result<Outcome, ApiError> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if self.cancelled {
            return Ok(Outcome::Cancelled { tokens: self.count });
        }
        let finished = Instant::now();
        let first = self.first_token_at.unwrap_or(finished);
        let prompt_seconds = (first - self.started).as_secs_f64();
        let decode_seconds = (finished - first).as_secs_f64();
        let (prompt_tokens, cached) = (self.prompt_tokens, self.cached);
        let stats = RequestStats {
            prompt_tokens,
            cached_tokens: cached,
            prompt_seconds,
            prompt_tokens_per_second: (prompt_tokens - cached) as f64 / prompt_seconds.max(1e-9),
            completion_tokens: self.count,
            decode_seconds,
            decode_tokens_per_second: self.count.saturating_sub(1) as f64
                / decode_seconds.max(1e-9),
            speculation: speculation.map(SpeculationReport::from),
        };
        Ok(Outcome::Done(Box::new(Summary {
            finish_reason: if self.cut {
                Finish::Shutdown
            } else {
                Finish::Decoded(self.finish.unwrap_or(FinishReason::Length))
            },
            prompt_tokens,
            completion_tokens: self.count,
            cached_tokens: cached,
            stats,
            batch_rows: self.batch_rows,
            prefill_chunks: self.prefill_chunks,
            interleaved_steps: self.interleaved_steps,
        })))
    }

    /// One generated token. Counts it (a stopping EOS counts, as in mlx-lm, server.py:1640,
    /// but adds no text, server.py:976), releases its text through the stop matcher, and
    /// stops on a stop sequence, at the end, when the client is gone, or at the shutdown's cut.
    pub(super) fn on_token(&mut self, bundle: &ModelBundle, step: &GeneratedToken) -> Control {
        self.first_token_at.get_or_insert_with(Instant::now);
        if self.events.is_closed() {
            self.cancelled = true;
            return Control::Stop;
        }
        self.count += 1;
        self.tokens.push(step.token);
        let info = match self.token_info(bundle, step) {
            Ok(info) => info,
            Err(e) => {
                self.error = Some(refusal(e));
                return Control::Stop;
            }
        };
        let mut text = String::new();
        let mut stopped = false;
        let cut = step.finish.is_none() && self.shutdown.load(Ordering::Relaxed);
        if step.finish != Some(FinishReason::Stop) {
            self.detok.add_token(step.token);
            let mut segment = self.detok.take_segment();
            if step.finish.is_some() || cut {
                segment.push_str(&self.detok.finalize());
            }
            match self.stop.push(&segment) {
                Pushed::Text(t) => text = t,
                Pushed::Stopped(t) => {
                    text = t;
                    stopped = true;
                }
            }
        }
        if stopped {
            self.finish = Some(FinishReason::Stop);
        } else if let Some(f) = step.finish {
            self.finish = Some(f);
            text.push_str(&self.stop.finish());
        } else if cut {
            self.cut = true;
            text.push_str(&self.stop.finish());
        }
        let tokens = info.into_iter().collect();
        self.text.push_str(&text);
        if self.events.send(Event::Delta { text, tokens }).is_err() {
            self.cancelled = true;
            return Control::Stop;
        }
        if self.finish.is_some() || self.cut {
            Control::Stop
        } else {
            Control::Continue
        }
    }

    /// The token's logprob and its top alternatives (sorted by logprob, then id), when asked.
    pub(super) fn token_info(
        &self,
        bundle: &ModelBundle,
        step: &GeneratedToken,
    ) -> crate::Result<Option<TokenInfo>> {
        if !self.request.logprobs {
            return Ok(None);
        }
        let logprobs = step.logprobs.astype(mlx::Dtype::Float32)?.to_vec::<f32>()?;
        let mut order: Vec<u32> = (0..logprobs.len() as u32).collect();
        let n = self.request.top_logprobs.min(order.len());
        let by_rank = |a: &u32, b: &u32| {
            logprobs[*b as usize]
                .total_cmp(&logprobs[*a as usize])
                .then(a.cmp(b))
        };
        if n > 0 && n < order.len() {
            order.select_nth_unstable_by(n - 1, by_rank);
        }
        order.truncate(n);
        order.sort_by(by_rank);
        let text = |id: u32| bundle.decode(&[id]);
        Ok(Some(TokenInfo {
            id: step.token,
            token: text(step.token),
            logprob: logprobs[step.token as usize],
            top: order
                .into_iter()
                .map(|id| TopLogprob {
                    id,
                    token: text(id),
                    logprob: logprobs[id as usize],
                })
                .collect(),
        }))
    }
}
