//! A request's prompt as the chat template renders it, and how its answer is read back: the
//! template's variables, the tool-call grammar, the splitter of content, reasoning and calls.

use serde_json::Map;

use super::Engine;
use crate::grammar::Grammar;
use crate::server::api::{GenRequest, Prompt, ToolChoice};
use crate::server::channels::Channels;
use crate::server::error::ApiError;
use crate::server::tools;

impl Engine {
    /// The grammar of the request's tool calls: a call `tool_choice` forces, or under "auto"
    /// (without a response_format grammar) every call the model starts.
    pub(super) fn call_grammar(&self, request: &GenRequest) -> Result<Option<Grammar>, ApiError> {
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
    pub(super) fn channels(&self, request: &GenRequest, prompt: &[u32]) -> Channels {
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
    pub(super) fn prompt_tokens(&self, request: &GenRequest) -> crate::Result<Vec<u32>> {
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
}

/// The chat template's variables a request sets: its tools and its `chat_template_kwargs`.
pub(super) fn template_variables(request: &GenRequest) -> Map<String, serde_json::Value> {
    let mut extra = Map::new();
    if let Some(tools) = &request.tools {
        extra.insert("tools".into(), serde_json::Value::Array(tools.clone()));
    }
    extra.extend(request.chat_template_kwargs.clone());
    extra
}
