//! The golden trace format `verity-trace/1` (docs/trace-format.md): what an oracle generated,
//! step by step, and every input needed to generate it again.
//!
//! Unknown fields are ignored so recorders may add more; a missing required field or another
//! `format` is an error naming the file.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The only format this harness reads.
pub const TRACE_FORMAT: &str = "verity-trace/1";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Trace {
    pub format: String,
    pub id: String,
    /// Group name used for reporting; defaults to the first component of `id`.
    #[serde(default)]
    pub suite: Option<String>,
    pub oracle: Oracle,
    /// Repository-relative model folder.
    pub model: String,
    #[serde(default)]
    pub draft: Option<Draft>,
    pub prompt: Prompt,
    /// A prompt cache file holding a prefix the oracle processed before `prompt` (whose tokens
    /// are then only the rest).
    #[serde(default)]
    pub prompt_cache: Option<PromptCacheRef>,
    /// The batch this trace's request decoded in (mlx-lm's BatchGenerator), when it did.
    #[serde(default)]
    pub batch: Option<Batch>,
    pub params: Params,
    #[serde(default)]
    pub parity: Parity,
    #[serde(default)]
    pub eos_token_ids: Option<Vec<u32>>,
    pub steps: Vec<Step>,
    pub finish_reason: FinishReason,
    pub generation_tokens: usize,
}

/// The requests that decoded together, this trace's among them (`rows[row]`); all rows share
/// the trace's params but their max_tokens.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Batch {
    pub rows: Vec<BatchRow>,
    pub row: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BatchRow {
    /// The row's prompt token ids.
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Oracle {
    pub tool: String,
    pub tool_version: String,
    pub mlx_version: String,
    pub device: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Draft {
    /// mlx-lm speculative decoding with a separate draft model.
    Model {
        model: String,
        num_draft_tokens: usize,
    },
    /// mlx-vlm's MTP loop: the target's native head, or the drafter folder `model` (a Gemma 4
    /// assistant, which mlx-vlm drives with the same loop).
    Mtp {
        block_size: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model: Option<String>,
    },
    /// mlx-vlm's DFlash block drafter (a drafter folder); `block_size` is mlx-vlm's
    /// draft_block_size, the ceiling its adaptive block size stays under.
    Dflash { model: String, block_size: usize },
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Prompt {
    /// Exactly what the oracle fed the model, chat template applied.
    pub tokens: Vec<u32>,
    /// The text before tokenization (and before the template when `chat`), when recorded.
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub chat: bool,
    /// For chat prompts: the rendered template the oracle tokenized.
    #[serde(default)]
    pub rendered: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PromptCacheRef {
    /// Repository-relative safetensors file in mlx-lm's save_prompt_cache format.
    pub file: String,
    /// The prefix tokens the cache holds.
    pub tokens: Vec<u32>,
}

/// What the oracle was asked for. The sampler and processor arguments are mlx-lm's, by name
/// (`make_sampler`, `make_logits_processors`; docs/trace-format.md): the harness only reads the
/// temperature, the replaying engine reads them all.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Params {
    pub max_tokens: usize,
    pub seed: Option<u64>,
    /// How the seed keys each draw; absent in mlx-lm's traces (a key sequence).
    #[serde(default, skip_serializing_if = "Keys::is_sequence")]
    pub keys: Keys,
    pub sampler: Map<String, Value>,
    pub processors: Map<String, Value>,
    pub prefill_step_size: usize,
    pub max_kv_size: Option<usize>,
    pub kv_bits: Option<u32>,
    pub kv_group_size: u32,
    pub quantized_kv_start: usize,
}

impl Params {
    /// The sampling temperature (0 when absent: greedy).
    pub fn temperature(&self) -> f64 {
        self.sampler
            .get("temp")
            .and_then(Value::as_f64)
            .unwrap_or(0.0)
    }
}

/// How a trace's oracle keyed its random draws from the seed.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Keys {
    /// mlx-lm: `mx.random.seed(seed)`, then one key split off per draw.
    #[default]
    Sequence,
    /// mlx-vlm's positioned sampler: generated position p draws with
    /// `key(_position_seed(seed, 0, p))` (mlx_vlm/generate/ar.py:75-148).
    Positioned,
}

impl Keys {
    fn is_sequence(&self) -> bool {
        *self == Keys::Sequence
    }
}

/// Which parity tier the replay enforces (docs/DESIGN.md, "Parity tiers").
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Parity {
    pub tier: Tier,
    /// Tier B: the largest allowed |logprob difference|.
    #[serde(default)]
    pub logprob_tolerance: Option<f64>,
    /// Tier B: the op that provably differs.
    #[serde(default)]
    pub reason: Option<String>,
}

impl Default for Parity {
    fn default() -> Self {
        Parity {
            tier: Tier::A,
            logprob_tolerance: None,
            reason: None,
        }
    }
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// Same tokens, finish reason, and chosen-token logprob and top-k bits.
    A,
    /// Same tokens and finish reason; logprobs within a tolerance.
    B,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Step {
    pub token: u32,
    /// The chosen token's logprob as the oracle reported it (f32 bits, written exactly).
    pub logprob: f32,
    /// The best entries as (token, logprob), logprob descending then id ascending.
    pub top: Vec<(u32, f32)>,
    #[serde(default)]
    pub from_draft: bool,
}

impl Step {
    /// Log-probabilities are finite and at most 0, and the best entries are distinct, in the
    /// documented order, and agree with the chosen token's logprob where they list it: what
    /// any log-softmax gives. A trace that breaks this was corrupted, not recorded (and an
    /// engine's response that breaks it is refused: [`crate::protocol`]).
    pub fn validate(&self) -> Result<(), String> {
        let logprob = |what: &str, lp: f32| match lp.is_finite() && lp <= 0.0 {
            true => Ok(()),
            false => Err(format!(
                "{what} is {lp}, a logprob must be finite and at most 0"
            )),
        };
        logprob("logprob", self.logprob)?;
        for (j, &(id, lp)) in self.top.iter().enumerate() {
            logprob(&format!("top[{j}]"), lp)?;
            if id == self.token && lp.to_bits() != self.logprob.to_bits() {
                return Err(format!(
                    "top[{j}] gives the chosen token {id} logprob {lp}, the step says {}",
                    self.logprob
                ));
            }
        }
        let mut ids: Vec<u32> = self.top.iter().map(|&(id, _)| id).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("top lists token {} twice", w[0]));
        }
        for (j, pair) in self.top.windows(2).enumerate() {
            let ((a, la), (b, lb)) = (pair[0], pair[1]);
            if !(la > lb || (la == lb && a < b)) {
                return Err(format!(
                    "top[{j}] ({a}, {la}) and top[{}] ({b}, {lb}) are not in order (logprob \
                     descending, then id ascending)",
                    j + 1
                ));
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    Stop,
    Length,
}

impl fmt::Display for FinishReason {
    /// The name the trace format uses.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = serde_json::to_value(self).map_err(|_| fmt::Error)?;
        f.write_str(name.as_str().unwrap_or_default())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a verity trace: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: unknown trace format {found:?} (this harness reads {TRACE_FORMAT:?})")]
    Format { path: PathBuf, found: String },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl Trace {
    /// Reads and validates one trace file.
    pub fn load(path: &Path) -> Result<Trace, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Trace::parse(&text, path)
    }

    /// Parses trace JSON; `path` only names the source in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Trace, TraceError> {
        let path_buf = || path.to_path_buf();
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|source| TraceError::Json {
                path: path_buf(),
                source,
            })?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(TRACE_FORMAT) => {}
            other => {
                return Err(TraceError::Format {
                    path: path_buf(),
                    found: other.unwrap_or("<missing>").to_string(),
                })
            }
        }
        let trace: Trace = serde_json::from_value(value).map_err(|source| TraceError::Json {
            path: path_buf(),
            source,
        })?;
        trace.validate().map_err(|message| TraceError::Invalid {
            path: path_buf(),
            message,
        })?;
        Ok(trace)
    }

    fn validate(&self) -> Result<(), String> {
        if self.prompt.tokens.is_empty() {
            return Err("the prompt has no tokens".into());
        }
        if self.steps.len() != self.generation_tokens {
            return Err(format!(
                "{} steps but generation_tokens is {}",
                self.steps.len(),
                self.generation_tokens
            ));
        }
        if self.finish_reason == FinishReason::Length && self.steps.len() != self.params.max_tokens
        {
            return Err(format!(
                "finish_reason is length after {} of {} tokens",
                self.steps.len(),
                self.params.max_tokens
            ));
        }
        for (i, step) in self.steps.iter().enumerate() {
            step.validate().map_err(|e| format!("steps[{i}]: {e}"))?;
            if step.from_draft && self.draft.is_none() {
                return Err(format!(
                    "steps[{i}] is from_draft, but the trace has no draft"
                ));
            }
        }
        if self.params.temperature() > 0.0 && self.params.seed.is_none() {
            return Err("sampling without a seed cannot be replayed".into());
        }
        if let Some(b) = &self.batch {
            self.validate_batch(b)?;
        }
        Ok(())
    }

    /// A batch names this trace's own request as its row `row`, and every row can run.
    fn validate_batch(&self, b: &Batch) -> Result<(), String> {
        let Some(own) = b.rows.get(b.row) else {
            return Err(format!(
                "batch.row is {}, but the batch has {} rows",
                b.row,
                b.rows.len()
            ));
        };
        if own.tokens != self.prompt.tokens || own.max_tokens != self.params.max_tokens {
            return Err(format!(
                "batch.rows[{}] is not this trace's request (prompt tokens and max_tokens)",
                b.row
            ));
        }
        if let Some(i) = b
            .rows
            .iter()
            .position(|r| r.tokens.is_empty() || r.max_tokens == 0)
        {
            return Err(format!(
                "batch.rows[{i}] has no prompt tokens or a max_tokens of 0"
            ));
        }
        if self.draft.is_some() || self.prompt_cache.is_some() {
            return Err("a batch trace has no draft and no prompt cache".into());
        }
        Ok(())
    }

    /// The reporting group: `suite`, else the first component of the id.
    pub fn suite(&self) -> &str {
        self.suite
            .as_deref()
            .unwrap_or_else(|| self.id.split('/').next().unwrap_or(&self.id))
    }

    /// The sampled token ids, in order.
    pub fn tokens(&self) -> Vec<u32> {
        self.steps.iter().map(|s| s.token).collect()
    }
}

/// Every `*.json` under `dir`, sorted, so reports list traces in a stable order.
pub fn find_traces(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "json") {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}
