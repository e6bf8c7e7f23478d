//! The text that opens and closes a model's reasoning and its tool calls, as mlx-lm infers them
//! (tokenizer_utils.py `_infer_thinking` from the vocabulary, `_infer_tool_parser` from the chat
//! template's text), so that the server can split an answer into reasoning, content and tool
//! calls where mlx_lm.server does.

/// Reasoning markers: a vocabulary that holds one of these pairs has thinking.
const THINK_PAIRS: [(&str, &str); 3] = [
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
];

/// The vocabulary markers of mlx-lm's "xtml" format, which also implies thinking.
const XTML_TOKENS: [&str; 4] = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];

/// mlx-lm's tool parsers in the order `_infer_tool_parser` tries them, each with what the
/// template must contain. Only `json_tools` (Qwen's `<tool_call>{json}</tool_call>`) is
/// parsed here; a template of another format gets no tool-call parsing.
const TEMPLATE_FORMATS: [(&str, &[&str]); 13] = [
    ("minimax_m2", &["<minimax:tool_call>"]),
    ("gemma4", &["<|tool_call>", "<tool_call|>"]),
    ("function_gemma", &["<start_function_call>"]),
    ("longcat", &["<longcat_tool_call>"]),
    ("glm47", &["<arg_key>"]),
    ("pythonic", &["<|tool_list_start|>"]),
    ("pythonic", &["<|tool_call_start|>"]),
    ("qwen3_coder", &["<tool_call>\n<function="]),
    ("qwen3_coder", &["<tool_call>\\n<function="]),
    ("kimi_k2", &["<|tool_calls_section_begin|>"]),
    ("minicpm5", &["<function name=\"", "<param name=\""]),
    ("mistral", &["[TOOL_CALLS]"]),
    ("json_tools", &["<tool_call>", "tool_call.name"]),
];

/// A start and an end marker, as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Markers {
    pub start: String,
    pub end: String,
}

impl Markers {
    fn new(start: &str, end: &str) -> Markers {
        Markers {
            start: start.into(),
            end: end.into(),
        }
    }
}

/// `_infer_thinking`: the reasoning markers when the vocabulary (`has` says whether it holds a
/// token) has them. mlx-lm's multi-token forms open with more than the token itself.
pub(super) fn thinking(has: impl Fn(&str) -> bool) -> Option<Markers> {
    if let Some((start, end)) = THINK_PAIRS.iter().find(|(s, e)| has(s) && has(e)) {
        return Some(Markers::new(start, end));
    }
    if has("<|channel>") && has("<channel|>") {
        return Some(Markers::new("<|channel>thought", "<channel|>"));
    }
    if XTML_TOKENS.iter().all(|t| has(t)) {
        return Some(Markers::new(
            "<|open|>think<|sep|>",
            "<|close|>think<|sep|>",
        ));
    }
    None
}

/// `_infer_tool_parser`'s choice: the config's `tool_parser_type` if it names one, else the
/// first format the (single) chat template's text shows. The tool-call markers when that format
/// is `json_tools`, the one parsed here.
pub(super) fn tool_calls(parser_type: Option<&str>, template: Option<&str>) -> Option<Markers> {
    let format = parser_type.or_else(|| {
        let template = template?;
        TEMPLATE_FORMATS
            .iter()
            .find(|(_, needles)| needles.iter().all(|n| template.contains(n)))
            .map(|(name, _)| *name)
    });
    (format == Some("json_tools")).then(|| Markers::new("<tool_call>", "</tool_call>"))
}
