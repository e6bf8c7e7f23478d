//! The OpenAI request bodies, read field by field from JSON into one [`GenRequest`], and the
//! error body every refusal is answered with. Reading by hand instead of through a derived
//! `Deserialize` is deliberate: each refusal must name the field, the value given and what is
//! allowed (`{"error": {"message", "type", "param", "code"}}`), and unknown fields must be
//! ignored as OpenAI ignores them. Checks that need the model (token ids against the
//! vocabulary, the prompt against the context, a schema's compilation) run on the engine thread
//! through `crate::validate`; these are the ones that need only the body.

use serde_json::{json, Map, Value};

use super::error::ApiError;
use crate::grammar::Grammar;

/// At most this many stop sequences (OpenAI allows 4; mlx-lm sets no limit).
pub const MAX_STOP_SEQUENCES: usize = 16;
/// At most this many alternatives per token in `top_logprobs` (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Which endpoint a request came to: the prompt's form and the response's shape differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    /// The endpoint's name in the log and the metrics' labels.
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completion",
        }
    }
}

/// What the model is asked to continue.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Chat messages, rendered through the model's chat template with the generation prompt.
    Messages(Vec<Value>),
    /// Raw text, encoded with the tokenizer's special tokens (mlx-lm's `tokenizer.encode`).
    Text(String),
    /// Token ids as given (checked against the vocabulary on the engine thread).
    Tokens(Vec<u32>),
}

/// Whether and which tool the model must call (`tool_choice`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default, and all mlx_lm.server does); a call it starts is held
    /// to a tool's schema.
    Auto,
    /// No grammar; verity does not keep a model from calling (neither does mlx_lm.server).
    None,
    /// One call of any given tool, generated under a grammar.
    Required,
    /// One call of this tool, generated under a grammar.
    Function(String),
}

/// One request, every field read and range-checked; what the engine thread runs.
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    pub model: String,
    pub prompt: Prompt,
    pub max_tokens: usize,
    /// Whether the request named max_tokens (else it is the server's default, which the
    /// engine shortens to what the model's context leaves).
    pub max_tokens_named: bool,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    pub min_p: f64,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub logit_bias: Vec<(u32, f64)>,
    pub repetition_penalty: Option<f64>,
    pub repetition_context_size: usize,
    pub presence_penalty: Option<f64>,
    pub presence_context_size: usize,
    pub frequency_penalty: Option<f64>,
    pub frequency_context_size: usize,
    /// Report the chosen token's logprob.
    pub logprobs: bool,
    /// Report this many alternatives per token (sorted by logprob, then id).
    pub top_logprobs: usize,
    pub grammar: Option<Grammar>,
    /// `tools` as given (each checked to be a function with a name), None when absent or empty
    /// (mlx-lm's `body.get("tools") or None`); the chat template renders them.
    pub tools: Option<Vec<Value>>,
    pub tool_choice: ToolChoice,
    /// Extra chat template variables (`enable_thinking`, ...), over the defaults.
    pub chat_template_kwargs: Map<String, Value>,
    pub xtc_probability: f64,
    pub xtc_threshold: f64,
    pub num_draft_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
}

/// Server-wide defaults a request may override (mlx_lm.server's command-line defaults).
#[derive(Clone, Debug)]
pub struct Defaults {
    pub max_tokens: usize,
    pub model_id: String,
}

/// The body's fields, null read as absent (as OpenAI and mlx-lm's `body.get` do).
struct Body<'a>(&'a Map<String, Value>);

impl<'a> Body<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn bool(&self, name: &str, default: bool) -> Result<bool, ApiError> {
        match self.get(name) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(ApiError::invalid(
                name,
                format!("{name} is {v}, must be true or false"),
            )),
        }
    }

    /// An integer within [min, max].
    fn uint(&self, name: &str, min: u64, max: u64) -> Result<Option<u64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        match v.as_u64() {
            Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(ApiError::invalid(
                name,
                format!("{name} is {v}, must be an integer from {min} to {max}"),
            )),
        }
    }

    /// A number within [min, max].
    fn number(&self, name: &str, min: f64, max: f64) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        match v.as_f64() {
            Some(x) if x.is_finite() && (min..=max).contains(&x) => Ok(Some(x)),
            _ => {
                let allowed = match (min == f64::MIN, max == f64::MAX) {
                    (true, true) => "a finite number".to_string(),
                    (false, true) => format!("a number >= {min}"),
                    (true, false) => format!("a number <= {max}"),
                    (false, false) => format!("a number from {min} to {max}"),
                };
                Err(ApiError::invalid(
                    name,
                    format!("{name} is {v}, must be {allowed}"),
                ))
            }
        }
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::invalid(
                name,
                format!("{name} is {v}, must be a string"),
            )),
        }
    }
}

/// Reads a request body sent to `endpoint`.
pub fn parse(
    endpoint: Endpoint,
    body: &Value,
    defaults: &Defaults,
) -> Result<GenRequest, ApiError> {
    let Value::Object(map) = body else {
        return Err(ApiError::invalid(
            "body",
            format!(
                "the request body is {}, must be a JSON object",
                kind_of(body)
            ),
        ));
    };
    let b = Body(map);
    let prompt = match endpoint {
        Endpoint::Chat => Prompt::Messages(messages(&b)?),
        Endpoint::Completion => prompt(&b)?,
    };
    if let Some(n) = b.uint("n", 0, u64::MAX)? {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("n is {n}, only 1 is supported"),
            ));
        }
    }
    let named = match b.uint("max_completion_tokens", 1, u32::MAX as u64)? {
        Some(n) => Some(n),
        None => b.uint("max_tokens", 1, u32::MAX as u64)?,
    };
    let max_tokens = named.map_or(defaults.max_tokens, |n| n as usize);
    let (logprobs, top_logprobs) = logprobs(endpoint, &b)?;
    let stream = b.bool("stream", false)?;
    let include_usage = match b.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Body(o).bool("include_usage", false).map_err(|mut e| {
            e.param = Some("stream_options.include_usage".into());
            e
        })?,
        Some(v) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("stream_options is {v}, must be an object"),
            ))
        }
    };
    // mlx-lm's make_logits_processors skips a penalty of 0 (sample_utils.py:126).
    let penalty = |name: &str, min: f64| -> Result<Option<f64>, ApiError> {
        Ok(b.number(name, min, f64::MAX)?.filter(|&p| p != 0.0))
    };
    let context = |name: &str| -> Result<usize, ApiError> {
        Ok(b.uint(name, 1, u32::MAX as u64)?.map_or(20, |n| n as usize))
    };
    let tools = tools(&b)?;
    let tool_choice = tool_choice(&b, tools.as_deref().unwrap_or_default())?;
    let grammar = response_format(&b)?;
    if grammar.is_some() && matches!(tool_choice, ToolChoice::Required | ToolChoice::Function(_)) {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice forces a tool call, which cannot be combined with a response_format grammar",
        ));
    }
    let chat_template_kwargs = match b.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(v) => {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                format!("chat_template_kwargs is {v}, must be an object of template variables"),
            ))
        }
    };
    Ok(GenRequest {
        endpoint,
        model: b.string("model")?.unwrap_or(&defaults.model_id).to_string(),
        prompt,
        max_tokens,
        max_tokens_named: named.is_some(),
        temperature: b.number("temperature", 0.0, f64::MAX)?.unwrap_or(0.0),
        top_p: b.number("top_p", 0.0, 1.0)?.unwrap_or(1.0),
        top_k: b.uint("top_k", 0, u32::MAX as u64)?.unwrap_or(0) as usize,
        min_p: b.number("min_p", 0.0, 1.0)?.unwrap_or(0.0),
        seed: b.uint("seed", 0, u64::MAX)?,
        stop: stop(&b)?,
        logit_bias: logit_bias(&b)?,
        repetition_penalty: penalty("repetition_penalty", 0.0)?,
        repetition_context_size: context("repetition_context_size")?,
        presence_penalty: penalty("presence_penalty", f64::MIN)?,
        presence_context_size: context("presence_context_size")?,
        frequency_penalty: penalty("frequency_penalty", f64::MIN)?,
        frequency_context_size: context("frequency_context_size")?,
        logprobs,
        top_logprobs,
        grammar,
        tools,
        tool_choice,
        chat_template_kwargs,
        // mlx-lm's apply_xtc allows a threshold up to 0.5 (its server's check says 1).
        xtc_probability: b.number("xtc_probability", 0.0, 1.0)?.unwrap_or(0.0),
        xtc_threshold: b.number("xtc_threshold", 0.0, 0.5)?.unwrap_or(0.1),
        num_draft_tokens: b
            .uint(
                "num_draft_tokens",
                1,
                crate::validate::MAX_DRAFT_TOKENS as u64,
            )?
            .map(|n| n as usize),
        stream,
        include_usage,
    })
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `messages`: a non-empty array of objects with a string `role` and a `content` that is a
/// string, a list of parts, or null.
fn messages(b: &Body) -> Result<Vec<Value>, ApiError> {
    let Some(v) = b.get("messages") else {
        return Err(ApiError::invalid(
            "messages",
            "messages is missing, must be a non-empty array of messages",
        ));
    };
    let Some(list) = v.as_array().filter(|l| !l.is_empty()) else {
        return Err(ApiError::invalid(
            "messages",
            format!("messages is {v}, must be a non-empty array of messages"),
        ));
    };
    for (i, m) in list.iter().enumerate() {
        let param = format!("messages[{i}]");
        let Some(obj) = m.as_object() else {
            return Err(ApiError::invalid(
                &param,
                format!("{param} is {m}, must be an object"),
            ));
        };
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::invalid(
                &format!("{param}.role"),
                format!(
                    "{param}.role is {}, must be a string",
                    obj.get("role").unwrap_or(&Value::Null)
                ),
            ));
        }
        match obj.get("content") {
            None | Some(Value::Null | Value::String(_) | Value::Array(_)) => {}
            Some(c) => {
                return Err(ApiError::invalid(
                    &format!("{param}.content"),
                    format!("{param}.content is {c}, must be a string or an array of parts"),
                ))
            }
        }
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| prepared(i, m))
        .collect()
}

/// A message as mlx_lm.server's `process_message_content` hands it to the template: no content
/// is empty content, and a tool call's arguments given as a JSON string are the object it holds.
fn prepared(i: usize, message: &Value) -> Result<Value, ApiError> {
    let mut m = message.clone();
    if m.get("content").is_none_or(Value::is_null) {
        m["content"] = json!("");
    }
    let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) else {
        return Ok(m);
    };
    for (j, call) in calls.iter_mut().enumerate() {
        let Some(arguments) = call.pointer_mut("/function/arguments") else {
            continue;
        };
        if let Some(text) = arguments.as_str().filter(|t| !t.is_empty()) {
            let parsed = serde_json::from_str(text).map_err(|e| {
                let param = format!("messages[{i}].tool_calls[{j}].function.arguments");
                ApiError::invalid(&param, format!("{param} is {text:?}, must be JSON: {e}"))
            })?;
            *arguments = parsed;
        }
    }
    Ok(m)
}

/// `prompt`: a string, an array of one string, or an array of token ids.
fn prompt(b: &Body) -> Result<Prompt, ApiError> {
    let bad = |v: &Value| {
        ApiError::invalid(
            "prompt",
            format!("prompt is {v}, must be a non-empty string or a non-empty array of token ids"),
        )
    };
    match b.get("prompt") {
        None => Err(ApiError::invalid(
            "prompt",
            "prompt is missing, must be a string or an array of token ids",
        )),
        Some(Value::String(s)) if !s.is_empty() => Ok(Prompt::Text(s.clone())),
        Some(v @ Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] if !s.is_empty() => Ok(Prompt::Text(s.clone())),
            [] => Err(bad(v)),
            _ => items
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .map(Prompt::Tokens)
                .ok_or_else(|| bad(v)),
        },
        Some(v) => Err(bad(v)),
    }
}

/// `stop`: a string or an array of non-empty strings.
fn stop(b: &Body) -> Result<Vec<String>, ApiError> {
    let list = match b.get("stop") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if items.len() <= MAX_STOP_SEQUENCES => items
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                ApiError::invalid(
                    "stop",
                    format!("stop is {}, must be strings", Value::Array(items.clone())),
                )
            })?,
        Some(v) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                "stop is {v}, must be a string or an array of at most {MAX_STOP_SEQUENCES} strings"
            ),
            ))
        }
    };
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "stop has an empty string, stop sequences must be non-empty",
        ));
    }
    Ok(list)
}

/// `logit_bias`: an object from token ids (as strings) to biases within [-100, 100], in the
/// order given. The ids are checked against the vocabulary on the engine thread.
fn logit_bias(b: &Body) -> Result<Vec<(u32, f64)>, ApiError> {
    let Some(v) = b.get("logit_bias") else {
        return Ok(Vec::new());
    };
    let Some(map) = v.as_object() else {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("logit_bias is {v}, must be an object from token ids to biases"),
        ));
    };
    map.iter()
        .map(|(key, bias)| {
            let id = key.parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias key {key:?} is not a token id"),
                )
            })?;
            match bias.as_f64() {
                Some(x) if (-100.0..=100.0).contains(&x) => Ok((id, x)),
                _ => Err(ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias[{key:?}] is {bias}, must be a number from -100 to 100"),
                )),
            }
        })
        .collect()
}

/// `logprobs` and `top_logprobs`. Chat: `logprobs` a boolean, `top_logprobs` needs it. Legacy
/// completions: `logprobs` an integer, the number of alternatives (0 for the chosen token only).
fn logprobs(endpoint: Endpoint, b: &Body) -> Result<(bool, usize), ApiError> {
    let top = MAX_TOP_LOGPROBS as u64;
    if endpoint == Endpoint::Completion && b.get("logprobs").is_some_and(Value::is_number) {
        let n = b.uint("logprobs", 0, top)?.unwrap_or(0);
        return Ok((true, n as usize));
    }
    let on = b.bool("logprobs", false)?;
    let n = b.uint("top_logprobs", 0, top)?.unwrap_or(0) as usize;
    if n > 0 && !on {
        return Err(ApiError::invalid(
            "top_logprobs",
            format!("top_logprobs is {n}, needs logprobs: true"),
        ));
    }
    Ok((on, n))
}

/// `response_format`: text, json_object (any JSON object) or json_schema (its `schema`),
/// compiled by the grammar engine on the engine thread (a schema that does not compile is a 400).
fn response_format(b: &Body) -> Result<Option<Grammar>, ApiError> {
    let Some(v) = b.get("response_format") else {
        return Ok(None);
    };
    let kind = v.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonSchema(json!({"type": "object"})))),
        Some("json_schema") => match v.get("json_schema").and_then(|s| s.get("schema")) {
            Some(schema @ Value::Object(_)) => Ok(Some(Grammar::JsonSchema(schema.clone()))),
            other => Err(ApiError::invalid(
                "response_format.json_schema.schema",
                format!(
                    "response_format.json_schema.schema is {}, must be a JSON schema object",
                    other.unwrap_or(&Value::Null)
                ),
            )),
        },
        _ => Err(ApiError::invalid(
            "response_format.type",
            format!(
                "response_format.type is {}, must be \"text\", \"json_object\" or \"json_schema\"",
                v.get("type").unwrap_or(&Value::Null)
            ),
        )),
    }
}

/// `tools`: an array of `{"type": "function", "function": {"name", "description"?,
/// "parameters"?}}`, the parameters a JSON schema object.
fn tools(b: &Body) -> Result<Option<Vec<Value>>, ApiError> {
    let list = match b.get("tools") {
        None => return Ok(None),
        Some(Value::Array(list)) => list,
        Some(v) => {
            return Err(ApiError::invalid(
                "tools",
                format!("tools is {v}, must be an array of function tools"),
            ))
        }
    };
    for (i, tool) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let bad = |field: &str, v: &Value, allowed: &str| {
            let name = format!("{param}{field}");
            ApiError::invalid(&name, format!("{name} is {v}, must be {allowed}"))
        };
        if tool.get("type") != Some(&json!("function")) {
            return Err(bad(
                ".type",
                tool.get("type").unwrap_or(&Value::Null),
                "\"function\"",
            ));
        }
        let Some(function) = tool.get("function").filter(|f| f.is_object()) else {
            return Err(bad(
                ".function",
                tool.get("function").unwrap_or(&Value::Null),
                "an object",
            ));
        };
        match function.get("name") {
            Some(Value::String(n)) if !n.is_empty() => {}
            other => {
                return Err(bad(
                    ".function.name",
                    other.unwrap_or(&Value::Null),
                    "a non-empty string",
                ))
            }
        }
        match function.get("parameters") {
            None | Some(Value::Null | Value::Object(_)) => {}
            Some(p) => return Err(bad(".function.parameters", p, "a JSON schema object")),
        }
    }
    Ok((!list.is_empty()).then(|| list.clone()))
}

/// `tool_choice`: "none", "auto", "required" or `{"type": "function", "function": {"name"}}`
/// naming one of `tools`.
fn tool_choice(b: &Body, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    let Some(v) = b.get("tool_choice") else {
        return Ok(ToolChoice::Auto);
    };
    let choice = match v {
        Value::String(s) if s == "auto" => return Ok(ToolChoice::Auto),
        Value::String(s) if s == "none" => return Ok(ToolChoice::None),
        Value::String(s) if s == "required" => ToolChoice::Required,
        _ => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(name) if v.get("type") == Some(&json!("function")) => {
                if !tools.iter().any(|t| t["function"]["name"] == json!(name)) {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("tool_choice names the function {name:?}, which is not in tools"),
                    ));
                }
                ToolChoice::Function(name.to_string())
            }
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice is {v}, must be \"none\", \"auto\", \"required\" or \
                         {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                    ),
                ))
            }
        },
    };
    if tools.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            format!("tool_choice is {v}, but the request has no tools to call"),
        ));
    }
    Ok(choice)
}
