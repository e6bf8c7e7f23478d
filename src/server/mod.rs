//! `verity serve`: an OpenAI-compatible HTTP server. The HTTP side (axum on tokio) reads and
//! checks requests ([`api`]) and shapes responses ([`response`], [`sse`]), a chat answer split
//! into content, reasoning and tool calls ([`channels`], [`tools`]); the one engine thread
//! ([`engine`]) owns MLX and batches requests from a bounded queue, each request's lane
//! (`lane`) releasing text through the stop-sequence matcher ([`stop`]) and keeping prompt prefixes across requests
//! ([`prefix_cache`]). A full queue answers 503 with Retry-After at
//! once; bad input answers 400 with an OpenAI error body naming the field. Both sides count
//! what `GET /metrics` serves ([`metrics`]) and log each request in its span (`request_log`).

pub mod api;
pub mod channels;
pub mod engine;
pub mod error;
mod lane;
pub mod metrics;
pub mod prefix_cache;
mod request_log;
pub mod response;
pub mod sse;
pub mod stop;
pub mod tools;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tracing::{Instrument, Span};

use api::{Defaults, Endpoint, GenRequest};
use channels::{Channels, Parts};
use engine::{EngineHandle, Event, Finish};
use error::ApiError;
use metrics::Tally;
use response::{Meta, Said};
use tools::CallFormatter;

/// What every handler needs.
#[derive(Clone)]
struct App {
    engine: EngineHandle,
    defaults: Defaults,
}

/// The routes, in front of a started engine.
pub fn router(engine: EngineHandle, default_max_tokens: usize) -> Router {
    let defaults = Defaults {
        max_tokens: default_max_tokens,
        model_id: engine.model_id.clone(),
    };
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .with_state(App { engine, defaults })
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn models(State(app): State<App>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": app.engine.model_id, "object": "model", "created": 0, "owned_by": "verity"}],
    }))
}

async fn metrics(State(app): State<App>) -> Response {
    let text = app.engine.metrics.render(app.engine.queued());
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response()
}

async fn chat(State(app): State<App>, body: Bytes) -> Response {
    let span = request_log::span(Endpoint::Chat);
    generate(app, Endpoint::Chat, body).instrument(span).await
}

async fn completions(State(app): State<App>, body: Bytes) -> Response {
    let span = request_log::span(Endpoint::Completion);
    generate(app, Endpoint::Completion, body)
        .instrument(span)
        .await
}

/// Reads the body, queues the request, and answers once the engine has accepted or refused
/// it: refusals come before any 200, so a stream never starts for a bad request. The request
/// is counted in the metrics under how it ended.
async fn generate(app: App, endpoint: Endpoint, body: Bytes) -> Response {
    let mut tally = Tally::new(app.engine.metrics.clone(), endpoint);
    let answered = match start(&app, endpoint, &body).await {
        Ok((request, events, channels)) => {
            let meta = Meta::new(&request);
            if request.stream {
                return sse::respond(events, meta, request, channels, tally);
            }
            whole(events, meta, request, channels).await
        }
        Err(e) => Err(e),
    };
    match answered {
        Ok((body, finish)) => {
            tally.finished(finish);
            Json(body).into_response()
        }
        Err(e) => {
            tally.refused(&e);
            e.into_response()
        }
    }
}

/// The request parsed, queued and started by the engine, and how its answer splits.
async fn start(
    app: &App,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(GenRequest, mpsc::UnboundedReceiver<Event>, Channels), ApiError> {
    let (request, mut events) = queue(app, endpoint, body).inspect_err(request_log::refused)?;
    match events.recv().await {
        Some(Event::Started { channels, .. }) => Ok((request, events, *channels)),
        Some(Event::Failed(e)) => Err(e),
        _ => Err(ApiError::internal(
            "the engine stopped before the request started",
        )),
    }
}

/// The request parsed and queued, or the HTTP side's own refusal (the engine logs its own).
fn queue(
    app: &App,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(GenRequest, mpsc::UnboundedReceiver<Event>), ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid("body", format!("the request body is not valid JSON: {e}"))
    })?;
    let request = api::parse(endpoint, &value, &app.defaults)?;
    let events = app.engine.submit(request.clone(), Span::current())?;
    Ok((request, events))
}

/// A non-streaming answer's body and finish reason, once the request has ended.
async fn whole(
    mut events: mpsc::UnboundedReceiver<Event>,
    meta: Meta,
    request: GenRequest,
    mut channels: Channels,
) -> Result<(Value, Finish), ApiError> {
    let (mut parts, mut tokens) = (Parts::default(), Vec::new());
    loop {
        match events.recv().await {
            Some(Event::Delta {
                text: t,
                tokens: ts,
            }) => {
                parts.extend(channels.push(&t));
                tokens.extend(ts);
            }
            Some(Event::Done(summary)) => {
                parts.extend(channels.finish(flushes(summary.finish_reason)));
                let said = Said {
                    tool_calls: CallFormatter::new(false).format(&parts.calls),
                    content: parts.content,
                    reasoning: parts.reasoning,
                };
                let finish = response::finish_reason(summary.finish_reason, channels.made_call());
                let body = meta.complete(&request, &said, &tokens, &summary, finish);
                return Ok((body, summary.finish_reason));
            }
            Some(Event::Failed(e)) => return Err(e),
            Some(Event::Started { .. }) => {}
            None => {
                return Err(ApiError::internal(
                    "the engine stopped before the request finished",
                ))
            }
        }
    }
}

/// Whether an answer's held-back text is kept at its end: mlx_lm.server flushes it at
/// max_tokens and drops it at a stop (a partial marker before EOS).
fn flushes(finish: Finish) -> bool {
    finish != Finish::Decoded(crate::request::FinishReason::Stop)
}
