//! An answer's text split into content, reasoning and tool calls where mlx_lm.server splits it
//! (its `TextStateMachine`, generate.py:940, built by `make_text_state_machine`): the
//! tokenizer's reasoning markers move between "normal" and "reasoning", its tool-call markers
//! into and out of "tool", and the markers themselves are dropped. Text that could still be the
//! start of a marker is held back until the next text shows whether it is.

use crate::tokenizer::Markers;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Normal,
    Reasoning,
    Tool,
}

/// What some text added to each part of the answer.
#[derive(Debug, Default)]
pub struct Parts {
    pub content: String,
    pub reasoning: String,
    /// The text of each tool call that closed (its markers dropped).
    pub calls: Vec<String>,
}

impl Parts {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.reasoning.is_empty() && self.calls.is_empty()
    }

    /// Appends `other`, as mlx_lm.server's accumulators do between chunks.
    pub fn extend(&mut self, other: Parts) {
        self.content.push_str(&other.content);
        self.reasoning.push_str(&other.reasoning);
        self.calls.extend(other.calls);
    }
}

/// One answer's splitter.
#[derive(Clone, Debug)]
pub struct Channels {
    think: Option<Markers>,
    tool: Option<Markers>,
    state: State,
    /// Text not yet known to be outside a marker.
    pending: String,
    /// The open tool call's text so far.
    call: String,
    made_call: bool,
}

impl Channels {
    /// A splitter over the tokenizer's markers; `reasoning` when the prompt leaves a think
    /// block open (the template started it), as mlx-lm's initial state.
    pub fn new(think: Option<Markers>, tool: Option<Markers>, reasoning: bool) -> Channels {
        Channels {
            state: if reasoning && think.is_some() {
                State::Reasoning
            } else {
                State::Normal
            },
            think,
            tool,
            pending: String::new(),
            call: String::new(),
            made_call: false,
        }
    }

    /// The markers that leave the current state, and where each goes.
    fn edges(&self) -> Vec<(&str, State)> {
        let mut edges = Vec::new();
        match self.state {
            State::Normal | State::Reasoning => {
                if let Some(t) = &self.think {
                    edges.push(if self.state == State::Normal {
                        (t.start.as_str(), State::Reasoning)
                    } else {
                        (t.end.as_str(), State::Normal)
                    });
                }
                if let Some(t) = &self.tool {
                    edges.push((t.start.as_str(), State::Tool));
                }
            }
            State::Tool => edges.extend(self.tool.iter().map(|t| (t.end.as_str(), State::Normal))),
        }
        edges
    }

    /// Whether the answer is inside a tool call (mlx_lm.server sends no chunk then).
    pub fn in_tool_call(&self) -> bool {
        self.state == State::Tool
    }

    /// Whether a tool call was made, closed or cut by the end (the finish reason becomes
    /// "tool_calls" at a stop).
    pub fn made_call(&self) -> bool {
        self.made_call
    }

    fn say(&mut self, parts: &mut Parts, text: &str) {
        match self.state {
            State::Normal => parts.content.push_str(text),
            State::Reasoning => parts.reasoning.push_str(text),
            State::Tool => self.call.push_str(text),
        }
    }

    /// Takes `text`, returning what is now known to belong to each part.
    pub fn push(&mut self, text: &str) -> Parts {
        let mut parts = Parts::default();
        self.pending.push_str(text);
        loop {
            let found = self
                .edges()
                .into_iter()
                .filter_map(|(marker, to)| Some((self.pending.find(marker)?, marker.len(), to)))
                .min_by_key(|&(at, len, _)| (at + len, at));
            let Some((at, len, to)) = found else { break };
            let before = self.pending[..at].to_string();
            self.say(&mut parts, &before);
            self.pending.drain(..at + len);
            if self.state == State::Tool {
                parts.calls.push(std::mem::take(&mut self.call));
                self.made_call = true;
            }
            self.state = to;
        }
        let keep = self.held_back();
        let safe: String = self.pending.drain(..self.pending.len() - keep).collect();
        self.say(&mut parts, &safe);
        parts
    }

    /// The length of the longest end of the pending text that begins a marker.
    fn held_back(&self) -> usize {
        let edges = self.edges();
        (1..=self.pending.len())
            .rev()
            .filter(|&n| self.pending.is_char_boundary(self.pending.len() - n))
            .find(|&n| {
                let tail = &self.pending[self.pending.len() - n..];
                edges
                    .iter()
                    .any(|(m, _)| m.len() > n && m.starts_with(tail))
            })
            .unwrap_or(0)
    }

    /// The end of the answer: held-back text is kept when `flush` (mlx-lm flushes at
    /// max_tokens) and dropped otherwise (at a stop), and a tool call still open ends there.
    pub fn finish(&mut self, flush: bool) -> Parts {
        let mut parts = Parts::default();
        let pending = std::mem::take(&mut self.pending);
        if flush {
            self.say(&mut parts, &pending);
        }
        if self.state == State::Tool && !self.call.is_empty() {
            parts.calls.push(std::mem::take(&mut self.call));
            self.made_call = true;
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen(reasoning: bool) -> Channels {
        let m = |s: &str, e: &str| Markers {
            start: s.into(),
            end: e.into(),
        };
        Channels::new(
            Some(m("<think>", "</think>")),
            Some(m("<tool_call>", "</tool_call>")),
            reasoning,
        )
    }

    /// Every way of cutting an answer into pieces splits it the same way.
    #[test]
    fn pieces_do_not_change_the_split() {
        let answer = "<think>\nhm <b>\n</think>\n\nok <tool_call>\n{\"a\": 1}\n</tool_call>x<thi";
        for cut in 0..answer.len() {
            let mut c = qwen(false);
            let mut parts = c.push(&answer[..cut]);
            parts.extend(c.push(&answer[cut..]));
            parts.extend(c.finish(false));
            assert_eq!(parts.reasoning, "\nhm <b>\n", "cut at {cut}");
            assert_eq!(parts.content, "\n\nok x", "cut at {cut}");
            assert_eq!(parts.calls, ["\n{\"a\": 1}\n"], "cut at {cut}");
            assert!(c.made_call());
        }
    }

    #[test]
    fn an_open_think_block_starts_in_reasoning_and_length_flushes() {
        let mut c = qwen(true);
        let mut parts = c.push("a</think>b<tool");
        assert_eq!(
            (parts.reasoning.as_str(), parts.content.as_str()),
            ("a", "b")
        );
        parts.extend(c.finish(true));
        assert_eq!(parts.content, "b<tool");
        let mut open = qwen(false);
        open.push("<tool_call>{\"name\"");
        assert!(open.in_tool_call());
        assert_eq!(open.finish(false).calls, ["{\"name\""]);
    }
}
