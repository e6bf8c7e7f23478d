//! Tool calls: the text between a template's tool-call markers parsed into OpenAI's
//! `tool_calls` (mlx-lm's json_tools parser and server.py's `ToolCallFormatter`), and the
//! grammars calls are generated under, which mlx-lm does not have: `tool_choice` "required" or a
//! named function makes the answer one call, `<tool_call>` + a JSON object whose `name` is a
//! given tool's and whose `arguments` match that tool's `parameters` schema + `</tool_call>`;
//! under "auto" the answer is free text until the model writes the start marker, and each call
//! it starts is held to the same object.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::api::ToolChoice;
use crate::grammar::Grammar;
use crate::tokenizer::{json_dumps, Markers};

static NEXT_CALL: AtomicU64 = AtomicU64::new(0);

/// A fresh call id (mlx-lm uses a random UUID when the model gives none).
fn call_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "call_{nanos:08x}{:08x}",
        NEXT_CALL.fetch_add(1, Ordering::Relaxed)
    )
}

/// Numbers the calls of one streamed answer (`index`, counted over the whole stream).
#[derive(Debug, Default)]
pub struct CallFormatter {
    streaming: bool,
    next: usize,
}

impl CallFormatter {
    pub fn new(streaming: bool) -> CallFormatter {
        CallFormatter { streaming, next: 0 }
    }

    /// OpenAI's `tool_calls` entries for the texts of closed calls. A text that is not a JSON
    /// object (or a list of them) with a `name` and `arguments` is dropped with a warning, as
    /// mlx-lm drops a call it cannot parse (a call cut by max_tokens).
    pub fn format(&mut self, texts: &[String]) -> Vec<Value> {
        let mut calls = Vec::new();
        for text in texts {
            let parsed = match serde_json::from_str::<Value>(text.trim()) {
                Ok(Value::Array(items)) => items,
                Ok(v) => vec![v],
                Err(e) => {
                    tracing::warn!("dropped a tool call that is not JSON ({e}): {text:?}");
                    continue;
                }
            };
            for call in parsed {
                match self.entry(call) {
                    Some(entry) => calls.push(entry),
                    None => tracing::warn!("dropped a tool call without a name and arguments"),
                }
            }
        }
        calls
    }

    fn entry(&mut self, call: Value) -> Option<Value> {
        let Value::Object(mut function) = call else {
            return None;
        };
        if !function.get("name").is_some_and(Value::is_string) {
            return None;
        }
        let id = match function.remove("id") {
            Some(Value::String(id)) if !id.is_empty() => id,
            _ => call_id(),
        };
        let arguments = json_dumps(function.get("arguments")?);
        function.insert("arguments".into(), json!(arguments));
        let mut entry = json!({"function": function, "type": "function", "id": id});
        if self.streaming {
            entry["index"] = json!(self.next);
            self.next += 1;
        }
        Some(entry)
    }
}

/// The grammar of a forced call: one call of the named tool, or of any tool for "required";
/// under "auto", text in which every call the model starts is a call of a given tool. None
/// for "none".
pub fn call_grammar(tools: &[Value], choice: &ToolChoice, markers: &Markers) -> Option<Grammar> {
    let wanted = |t: &&Value| match choice {
        ToolChoice::Required | ToolChoice::Auto => true,
        ToolChoice::Function(name) => t["function"]["name"] == json!(name),
        ToolChoice::None => false,
    };
    let calls: Vec<Value> = tools.iter().filter(wanted).map(call_schema).collect();
    if calls.is_empty() {
        return None;
    }
    let mut schema = if calls.len() == 1 {
        calls.into_iter().next().expect("one call")
    } else {
        json!({"anyOf": calls})
    };
    schema["x-guidance"] =
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    let literal = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let open = literal(&format!("{}\n", markers.start));
    let close = literal(&format!("\n{}", markers.end));
    let call = format!("call: %json {schema}");
    Some(Grammar::Lark(if *choice == ToolChoice::Auto {
        // FREE is any text without the start marker; `opened` is lazy, so it ends at the
        // marker's first occurrence.
        let marker = regex_escape(&markers.start);
        format!(
            "start: free | opened call {close} start\n\
             free: FREE\n\
             FREE: /(?s:.*)/ & ~/(?s:.*{marker}.*)/\n\
             opened[suffix={open}]: /(?s:.*)/\n{call}"
        )
    } else {
        format!("start: {open} call {close}\n{call}")
    }))
}

/// `text` as a regex that matches it alone (inside a Lark `/.../`).
fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$#&-~/".contains(c);
            special.then_some('\\').into_iter().chain([c])
        })
        .collect()
}

/// `{"name": <the tool's>, "arguments": <its parameters>}`, in that order.
fn call_schema(tool: &Value) -> Value {
    let function = &tool["function"];
    let parameters = match function.get("parameters") {
        Some(p @ Value::Object(_)) => p.clone(),
        _ => json!({"type": "object", "properties": {}}),
    };
    let mut properties = Map::new();
    properties.insert("name".into(), json!({"const": function["name"]}));
    properties.insert("arguments".into(), parameters);
    json!({
        "type": "object",
        "properties": properties,
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}
