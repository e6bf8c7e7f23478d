//! The OpenAI response bodies, shaped as mlx_lm.server shapes them (server.py:1409
//! `generate_response`, server.py:1720 `completion_usage_response`): a whole completion, a
//! streaming chunk, the usage chunk. A chat answer's message carries its content (null when
//! empty, in a whole answer), its reasoning as `reasoning` (mlx-lm's name) and again as
//! `reasoning_content` (the name vLLM's and DeepSeek's clients read), and its `tool_calls`,
//! each only when there is some. Two deliberate differences: a logprobs entry is the
//! chosen token's (mlx-lm 0.32.2 reports the top-1 alternative as the token when top_logprobs
//! is set, server.py:1470), and the request's statistics ride next to usage as `verity_stats`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::api::{Endpoint, GenRequest};
use super::engine::{Finish, Summary, TokenInfo};
use crate::request::FinishReason;

/// A chat answer's parts ready to send (tool calls formatted); a completion's text is `content`.
#[derive(Debug, Default)]
pub struct Said {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<Value>,
}

/// mlx_lm.server's finish reason: "tool_calls" for an answer that stopped after a tool call.
pub fn finish_reason(finish: Finish, made_call: bool) -> String {
    match finish {
        Finish::Decoded(FinishReason::Stop) if made_call => "tool_calls".into(),
        other => other.to_string(),
    }
}

/// What every body of one response shares.
#[derive(Clone, Debug)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl Meta {
    pub fn new(request: &GenRequest) -> Meta {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let prefix = match request.endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        };
        Meta {
            id: format!(
                "{prefix}-{created}-{}",
                NEXT_ID.fetch_add(1, Ordering::Relaxed)
            ),
            created,
            model: request.model.clone(),
            endpoint: request.endpoint,
        }
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.endpoint, stream) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, stream: bool, choices: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(self.object(stream)));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m.insert(
            "system_fingerprint".into(),
            json!(concat!("verity-", env!("CARGO_PKG_VERSION"))),
        );
        m.insert("choices".into(), choices);
        m
    }

    /// The choice with its text: a chat `message` or `delta`, or a completion's `text`.
    fn choice(&self, stream: bool, said: &Said, finish: Option<String>) -> Map<String, Value> {
        let mut c = Map::new();
        c.insert("index".into(), json!(0));
        c.insert("finish_reason".into(), json!(finish));
        if self.endpoint == Endpoint::Completion {
            c.insert("text".into(), json!(said.content));
            return c;
        }
        let mut m = Map::new();
        m.insert("role".into(), json!("assistant"));
        if !stream {
            let content = Some(&said.content).filter(|t| !t.is_empty());
            m.insert("content".into(), json!(content));
        } else if !said.content.is_empty() {
            m.insert("content".into(), json!(said.content));
        }
        if !said.reasoning.is_empty() {
            m.insert("reasoning".into(), json!(said.reasoning));
            m.insert("reasoning_content".into(), json!(said.reasoning));
        }
        if !said.tool_calls.is_empty() {
            m.insert("tool_calls".into(), json!(said.tool_calls));
        }
        let key = if stream { "delta" } else { "message" };
        c.insert(key.into(), Value::Object(m));
        c
    }

    /// A whole (non-streaming) response.
    pub fn complete(
        &self,
        request: &GenRequest,
        said: &Said,
        tokens: &[TokenInfo],
        s: &Summary,
        finish: String,
    ) -> Value {
        let mut choice = self.choice(false, said, Some(finish));
        if request.logprobs {
            choice.insert("logprobs".into(), self.logprobs(tokens));
        }
        let mut body = self.envelope(false, json!([choice]));
        body.insert("usage".into(), usage(s));
        body.insert("verity_stats".into(), json!(s.stats));
        Value::Object(body)
    }

    /// A streaming chunk: released text and the tokens it came with; `finish` on the last.
    pub fn chunk(
        &self,
        request: &GenRequest,
        said: &Said,
        tokens: &[TokenInfo],
        finish: Option<String>,
    ) -> Value {
        let mut choice = self.choice(true, said, finish);
        if request.logprobs && !tokens.is_empty() {
            choice.insert("logprobs".into(), self.logprobs(tokens));
        }
        Value::Object(self.envelope(true, json!([choice])))
    }

    /// The chunk after the last when `stream_options.include_usage`: no choices, the usage.
    pub fn usage_chunk(&self, s: &Summary) -> Value {
        let mut body = self.envelope(true, json!([]));
        body.insert("usage".into(), usage(s));
        body.insert("verity_stats".into(), json!(s.stats));
        Value::Object(body)
    }

    /// Chat: `{"content": [{id, token, logprob, bytes, top_logprobs}]}`; completions: the
    /// legacy `{tokens, token_logprobs, top_logprobs, token_ids}`.
    fn logprobs(&self, tokens: &[TokenInfo]) -> Value {
        match self.endpoint {
            Endpoint::Chat => json!({"content": tokens.iter().map(|t| json!({
                "id": t.id,
                "token": t.token,
                "logprob": t.logprob,
                "bytes": t.token.as_bytes(),
                "top_logprobs": t.top.iter().map(|a| json!({
                    "id": a.id,
                    "token": a.token,
                    "logprob": a.logprob,
                    "bytes": a.token.as_bytes(),
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()}),
            Endpoint::Completion => json!({
                "tokens": tokens.iter().map(|t| &t.token).collect::<Vec<_>>(),
                "token_ids": tokens.iter().map(|t| t.id).collect::<Vec<_>>(),
                "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                "top_logprobs": tokens.iter().map(|t| {
                    t.top.iter().map(|a| (a.token.clone(), json!(a.logprob))).collect::<Map<_, _>>()
                }).collect::<Vec<_>>(),
            }),
        }
    }
}

/// mlx-lm's usage (server.py:1489): completion tokens count a stopping EOS.
fn usage(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    })
}
