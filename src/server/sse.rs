//! Server-sent events for `stream: true`: one chunk per token that released text (or carries
//! logprobs), then a chunk with the finish reason, the usage chunk when
//! `stream_options.include_usage`, and `data: [DONE]` (mlx_lm.server's order, server.py:1673).
//! The engine's event receiver lives inside the stream, so a client that disconnects drops it
//! and the engine sees the closed channel at its next token.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use tokio::sync::mpsc;

use super::api::GenRequest;
use super::channels::{Channels, Parts};
use super::engine::{Event, TokenInfo};
use super::error::ApiError;
use super::metrics::Tally;
use super::response::{self, Meta, Said};
use super::tools::CallFormatter;

struct State {
    /// First, so that it is dropped first: a request whose client left is counted before the
    /// engine can see the closed channel and go on.
    tally: Tally,
    events: mpsc::UnboundedReceiver<Event>,
    meta: Meta,
    request: GenRequest,
    channels: Channels,
    calls: CallFormatter,
    /// What the answer said since the last chunk, and the tokens it came with: held while a
    /// tool call is open (mlx_lm.server sends nothing then).
    said: Parts,
    tokens: Vec<TokenInfo>,
    out: VecDeque<SseEvent>,
    done: bool,
}

fn data(value: serde_json::Value) -> SseEvent {
    SseEvent::default().data(value.to_string())
}

impl State {
    /// What the answer said since the last chunk, its tool calls formatted.
    fn take(&mut self) -> Said {
        let parts = std::mem::take(&mut self.said);
        Said {
            tool_calls: self.calls.format(&parts.calls),
            content: parts.content,
            reasoning: parts.reasoning,
        }
    }

    /// Turns the next engine event into SSE events, marking the end after the last.
    async fn advance(&mut self) {
        match self.events.recv().await {
            Some(Event::Started { .. }) => {}
            Some(Event::Delta { text, tokens }) => {
                self.said.extend(self.channels.push(&text));
                self.tokens.extend(tokens);
                let logprobs = self.request.logprobs && !self.tokens.is_empty();
                if !self.channels.in_tool_call() && (!self.said.is_empty() || logprobs) {
                    let said = self.take();
                    let tokens = std::mem::take(&mut self.tokens);
                    let chunk = self.meta.chunk(&self.request, &said, &tokens, None);
                    self.out.push_back(data(chunk));
                }
            }
            Some(Event::Done(summary)) => {
                self.tally.finished(summary.finish_reason);
                let flush = super::flushes(summary.finish_reason);
                self.said.extend(self.channels.finish(flush));
                let finish =
                    response::finish_reason(summary.finish_reason, self.channels.made_call());
                let said = self.take();
                let tokens = std::mem::take(&mut self.tokens);
                let last = self.meta.chunk(&self.request, &said, &tokens, Some(finish));
                self.out.push_back(data(last));
                if self.request.include_usage {
                    self.out.push_back(data(self.meta.usage_chunk(&summary)));
                }
                self.out.push_back(SseEvent::default().data("[DONE]"));
                self.done = true;
            }
            Some(Event::Failed(e)) => {
                self.tally.refused(&e);
                self.out.push_back(data(e.body()));
                self.done = true;
            }
            None => {
                let e = ApiError::internal("the engine stopped before the request finished");
                self.tally.refused(&e);
                self.out.push_back(data(e.body()));
                self.done = true;
            }
        }
    }
}

/// The streaming response for a request the engine has started, counted by `tally` when it
/// ends (or as cancelled when its client goes away first).
pub fn respond(
    events: mpsc::UnboundedReceiver<Event>,
    meta: Meta,
    request: GenRequest,
    channels: Channels,
    tally: Tally,
) -> Response {
    let state = State {
        tally,
        events,
        calls: CallFormatter::new(request.stream),
        meta,
        request,
        channels,
        said: Parts::default(),
        tokens: Vec::new(),
        out: VecDeque::new(),
        done: false,
    };
    let events = stream::unfold(state, |mut st| async move {
        loop {
            if let Some(event) = st.out.pop_front() {
                return Some((Ok::<_, Infallible>(event), st));
            }
            if st.done {
                return None;
            }
            st.advance().await;
        }
    });
    Sse::new(events).into_response()
}
