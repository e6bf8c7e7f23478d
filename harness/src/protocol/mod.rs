//! The judge protocol `verity-judge/1` (docs/judge.md): how any engine is held to the golden
//! traces without verity's replay. `verity judge export` writes one [`Request`] per golden case,
//! what an engine must compute; the engine writes one [`Response`] per request; `verity judge
//! score` validates each response against its request and judges it against its trace exactly
//! as `verity check` judges verity's own run ([`crate::judge`]).
//!
//! Both files are JSON Lines. A response that no log-softmax could have produced, or that does
//! not answer its request, is refused as bad input naming the case, never judged as a
//! divergence: a broken adapter must not read as a broken engine.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::compare::Generation;
use crate::judge::{scores_drafts, Judgement, Plan};
use crate::registry::{ModelClass, Registry};
use crate::trace::{
    Batch, Draft, FinishReason, Oracle, Params, Parity, Prompt, PromptCacheRef, Step, Tier, Trace,
    TRACE_FORMAT,
};

mod answer;

pub use answer::{judge_answer, validate, Answer};

/// The only protocol version this harness writes and reads.
pub const JUDGE_FORMAT: &str = "verity-judge/1";

/// How many of the best entries a response gives per step: as many as the traces record.
pub const TOP_K: usize = 5;

/// What a request asks the engine for (see [`Plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Generate free-running from the prompt with the params.
    Generate,
    /// Score the oracle's `tokens` teacher-forced.
    Score,
    /// Generate with the draft and again without it (a known oracle bug: tier C).
    TierC,
    /// The backend cannot run the case; no response is expected.
    Skip,
}

/// The tier a case is judged at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JudgedTier {
    /// Identical tokens, finish reason and logprob bits.
    A,
    /// Same tokens (generated) or the oracle's distribution within a tolerance (scored).
    B,
    /// The engine's speculative tokens equal its plain ones.
    C,
}

/// One golden case: everything an engine needs to compute its answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub format: String,
    /// The case: the set folder's name and the trace id (`traces-cuda/qwen3/greedy/chat`), as
    /// trace ids repeat across the sets of different backends.
    pub id: String,
    pub suite: String,
    /// Repository-relative trace folder (the golden set) and trace file.
    pub set: String,
    pub trace: String,
    /// The oracle that recorded the case, and the backend the engine is judged on.
    pub oracle: Oracle,
    pub backend: String,
    pub mode: Mode,
    /// Absent for a skipped case.
    pub tier: Option<JudgedTier>,
    /// Skip: why the backend cannot run it. Tier C: the oracle bug. Score: the engine gap
    /// that lowered a trace of this backend to tier B, if one did.
    pub reason: Option<String>,
    /// Repository-relative model folder, and its vocabulary (the logits' length).
    pub model: String,
    pub vocab_size: usize,
    /// How many best entries each step's `top` must list.
    pub top_k: usize,
    /// The prompt token ids, exactly as fed (after any prompt cache's prefix).
    pub prompt: Vec<u32>,
    pub prompt_cache: Option<PromptCacheRef>,
    /// mlx-lm's sampler and processor arguments, seed, max_tokens, prefill step and KV
    /// settings, as the trace has them (docs/trace-format.md).
    pub params: Params,
    pub eos_token_ids: Vec<u32>,
    pub draft: Option<Draft>,
    pub batch: Option<Batch>,
    /// Score: the oracle's tokens, one per step to score.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<u32>>,
    /// Score: the draft model's greedy choice at every step is wanted too.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draft_tokens: bool,
}

impl Request {
    /// The request for `trace` (from the file `trace_file` of the set `set`, both
    /// repository-relative) judged on `backend` the way `plan` says. `vocab_size` and
    /// `eos_token_ids` are the model's; a trace's recorded EOS set wins over the latter.
    pub fn new(
        trace: &Trace,
        set: String,
        trace_file: String,
        backend: &str,
        plan: &Plan,
        vocab_size: usize,
        eos_token_ids: Vec<u32>,
    ) -> Request {
        let (mode, tier, reason) = match plan {
            Plan::Skip(why) => (Mode::Skip, None, Some(why.clone())),
            Plan::TierC { bug } => (Mode::TierC, Some(JudgedTier::C), Some(bug.clone())),
            Plan::Generate => (
                Mode::Generate,
                Some(match trace.parity.tier {
                    Tier::A => JudgedTier::A,
                    Tier::B => JudgedTier::B,
                }),
                None,
            ),
            Plan::Score { lowered_by } => (Mode::Score, Some(JudgedTier::B), lowered_by.clone()),
        };
        let score = mode == Mode::Score;
        Request {
            format: JUDGE_FORMAT.to_string(),
            id: format!("{}/{}", set.rsplit('/').next().unwrap_or(&set), trace.id),
            suite: trace.suite().to_string(),
            set,
            trace: trace_file,
            oracle: trace.oracle.clone(),
            backend: backend.to_string(),
            mode,
            tier,
            reason,
            model: trace.model.clone(),
            vocab_size,
            top_k: TOP_K.min(vocab_size),
            prompt: trace.prompt.tokens.clone(),
            prompt_cache: trace.prompt_cache.clone(),
            params: trace.params.clone(),
            eos_token_ids: trace.eos_token_ids.clone().unwrap_or(eos_token_ids),
            draft: trace.draft.clone(),
            batch: trace.batch.clone(),
            tokens: score.then(|| trace.tokens()),
            draft_tokens: score && scores_drafts(trace),
        }
    }

    /// Fails unless this request is `expected` (what its trace gives now), naming the first
    /// field that differs: a stale or edited requests file would judge answers to other
    /// questions.
    pub fn matches(&self, expected: &Request) -> Result<(), String> {
        let (got, want) = (to_map(self), to_map(expected));
        let keys: BTreeSet<String> = got.keys().chain(want.keys()).cloned().collect();
        let differs = keys.into_iter().find(|k| got.get(k) != want.get(k));
        match differs {
            None => Ok(()),
            Some(k) => Err(format!(
                "field {k:?} is {}, but its trace {} gives {} (export the requests again)",
                shown(got.get(&k)),
                self.trace,
                shown(want.get(&k))
            )),
        }
    }

    /// The case as a trace without the oracle's outputs, for engines that replay traces: a
    /// scored case's steps carry only its tokens (logprob 0, no top entries).
    pub fn replay_trace(&self) -> Trace {
        let steps: Vec<Step> = self
            .tokens
            .iter()
            .flatten()
            .map(|&token| Step {
                token,
                logprob: 0.0,
                top: Vec::new(),
                from_draft: false,
            })
            .collect();
        Trace {
            format: TRACE_FORMAT.to_string(),
            id: self.id.clone(),
            suite: Some(self.suite.clone()),
            oracle: self.oracle.clone(),
            model: self.model.clone(),
            draft: self.draft.clone(),
            prompt: Prompt {
                tokens: self.prompt.clone(),
                text: None,
                chat: false,
                rendered: None,
            },
            prompt_cache: self.prompt_cache.clone(),
            batch: self.batch.clone(),
            params: self.params.clone(),
            parity: Parity::default(),
            eos_token_ids: Some(self.eos_token_ids.clone()),
            generation_tokens: steps.len(),
            steps,
            finish_reason: FinishReason::Length,
        }
    }
}

fn to_map(r: &Request) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::to_value(r) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    }
}

/// A JSON value for a message, cut short when long (token lists).
fn shown(v: Option<&serde_json::Value>) -> String {
    let text = v.map_or("absent".to_string(), |v| v.to_string());
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
}

/// A logprob as a response gives it: a JSON number, or the `NaN` / `Infinity` / `-Infinity`
/// that Python's json module writes for non-finite floats, read so that the refusal can name
/// the case and the value instead of failing to parse the line.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Logprob(pub f32);

impl<'de> Deserialize<'de> for Logprob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(f32),
            Word(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(x) => Ok(Logprob(x)),
            Raw::Word(w) => match w.as_str() {
                NAN => Ok(Logprob(f32::NAN)),
                INFINITY => Ok(Logprob(f32::INFINITY)),
                MINUS_INFINITY => Ok(Logprob(f32::NEG_INFINITY)),
                _ => Err(serde::de::Error::custom(format!(
                    "a logprob must be a number, not {w:?}"
                ))),
            },
        }
    }
}

const NAN: &str = "NaN";
const INFINITY: &str = "Infinity";
const MINUS_INFINITY: &str = "-Infinity";

/// One generated step: the token, its logprob, the best entries, whether it was a draft.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GeneratedStep {
    pub token: u32,
    pub logprob: Logprob,
    pub top: Vec<(u32, Logprob)>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub from_draft: bool,
}

/// A free-running generation: its steps and why it ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Generated {
    pub steps: Vec<GeneratedStep>,
    pub finish_reason: FinishReason,
}

/// One scored step: the logprob of the request's token there, and the best entries.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoredStep {
    pub logprob: Logprob,
    pub top: Vec<(u32, Logprob)>,
}

/// An engine's answer to one request. Which fields it has depends on the request's mode:
/// generate `steps` and `finish_reason`; score `scored` (and `draft_tokens` when asked); tier C
/// `steps`, `finish_reason` and `plain`; any mode `unsupported` alone.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unsupported: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<GeneratedStep>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<FinishReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scored: Option<Vec<ScoredStep>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_tokens: Option<Vec<u32>>,
    /// Tier C: the same request generated without its draft.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plain: Option<Generated>,
}

fn generated_steps(steps: &[Step]) -> Vec<GeneratedStep> {
    steps
        .iter()
        .map(|s| GeneratedStep {
            token: s.token,
            logprob: Logprob(s.logprob),
            top: s.top.iter().map(|&(id, lp)| (id, Logprob(lp))).collect(),
            from_draft: s.from_draft,
        })
        .collect()
}

fn generated(run: &Generation) -> Generated {
    Generated {
        steps: generated_steps(&run.steps),
        finish_reason: run.finish_reason,
    }
}

impl Response {
    /// The engine cannot run the case: why.
    pub fn unsupported(id: &str, why: String) -> Response {
        Response {
            id: id.to_string(),
            unsupported: Some(why),
            ..Response::default()
        }
    }

    /// A generate request's answer.
    pub fn generated(id: &str, run: &Generation) -> Response {
        let g = generated(run);
        Response {
            id: id.to_string(),
            steps: Some(g.steps),
            finish_reason: Some(g.finish_reason),
            ..Response::default()
        }
    }

    /// A tier C request's answer: the run with the draft and the one without.
    pub fn tier_c(id: &str, speculative: &Generation, plain: &Generation) -> Response {
        Response {
            plain: Some(generated(plain)),
            ..Response::generated(id, speculative)
        }
    }

    /// A score request's answer: per step the engine's logprob of the token and its best
    /// entries, and the draft model's choices where asked.
    pub fn scored(id: &str, scored: &[Step], draft_tokens: Option<Vec<u32>>) -> Response {
        let scored = scored
            .iter()
            .map(|s| ScoredStep {
                logprob: Logprob(s.logprob),
                top: s.top.iter().map(|&(id, lp)| (id, Logprob(lp))).collect(),
            })
            .collect();
        Response {
            id: id.to_string(),
            scored: Some(scored),
            draft_tokens,
            ..Response::default()
        }
    }
}

/// A bad requests or responses file, or a response that does not answer its request.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct ProtocolError {
    pub file: PathBuf,
    pub message: String,
}

impl ProtocolError {
    fn new(file: &Path, message: String) -> ProtocolError {
        ProtocolError {
            file: file.to_path_buf(),
            message,
        }
    }
}

/// Reads a requests file (`file` only names it in errors): one request per non-empty line,
/// each of this protocol's version, no id twice.
pub fn parse_requests(text: &str, file: &Path) -> Result<Vec<Request>, ProtocolError> {
    let mut requests: Vec<Request> = Vec::new();
    let mut seen = BTreeMap::new();
    for (n, line) in lines(text) {
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| ProtocolError::new(file, format!("line {n}: not JSON: {e}")))?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(JUDGE_FORMAT) => {}
            other => {
                return Err(ProtocolError::new(
                    file,
                    format!(
                        "line {n}: format {:?}, this harness reads {JUDGE_FORMAT:?} requests",
                        other.unwrap_or("<missing>")
                    ),
                ))
            }
        }
        let request: Request = serde_json::from_value(value)
            .map_err(|e| ProtocolError::new(file, format!("line {n}: not a request: {e}")))?;
        if let Some(first) = seen.insert(request.id.clone(), n) {
            return Err(ProtocolError::new(
                file,
                format!(
                    "case {:?} is requested twice (lines {first} and {n})",
                    request.id
                ),
            ));
        }
        requests.push(request);
    }
    if requests.is_empty() {
        return Err(ProtocolError::new(file, "no requests".to_string()));
    }
    Ok(requests)
}

fn lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty())
}

/// Rewrites the bare `NaN`, `Infinity` and `-Infinity` Python writes outside strings as
/// strings, which [`Logprob`] reads, so a non-finite logprob is refused by name.
fn quote_non_finite(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some(word) = [MINUS_INFINITY, INFINITY, NAN]
            .into_iter()
            .find(|w| rest.starts_with(w))
        {
            out.push('"');
            out.push_str(word);
            out.push('"');
            rest = &rest[word.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Reads a responses file and pairs it with `requests`: each response's request, by position
/// in `requests` (`None` for a skipped case). Refuses an unknown case, a case answered twice,
/// an answer to a skipped case and a request left unanswered, each by name.
pub fn pair_responses(
    text: &str,
    file: &Path,
    requests: &[Request],
) -> Result<Vec<Option<Response>>, ProtocolError> {
    let index: BTreeMap<&str, usize> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id.as_str(), i))
        .collect();
    let mut paired: Vec<Option<(usize, Response)>> = vec![None; requests.len()];
    for (n, line) in lines(text) {
        let response: Response = serde_json::from_str(&quote_non_finite(line)).map_err(|e| {
            let id = serde_json::from_str::<serde_json::Value>(&quote_non_finite(line))
                .ok()
                .and_then(|v| v.get("id").and_then(|id| id.as_str()).map(str::to_string));
            let case = id.map_or(String::new(), |id| format!(" (case {id:?})"));
            ProtocolError::new(file, format!("line {n}{case}: not a response: {e}"))
        })?;
        let Some(&i) = index.get(response.id.as_str()) else {
            return Err(ProtocolError::new(
                file,
                format!(
                    "line {n}: case {:?} is not in the requests (an id of another export?)",
                    response.id
                ),
            ));
        };
        if let Some((first, _)) = &paired[i] {
            return Err(ProtocolError::new(
                file,
                format!(
                    "case {:?} is answered twice (lines {first} and {n})",
                    response.id
                ),
            ));
        }
        if requests[i].mode == Mode::Skip {
            return Err(ProtocolError::new(
                file,
                format!(
                    "line {n}: case {:?} is skipped on {} and takes no response",
                    response.id, requests[i].backend
                ),
            ));
        }
        paired[i] = Some((n, response));
    }
    let missing: Vec<&str> = requests
        .iter()
        .zip(&paired)
        .filter(|(r, p)| p.is_none() && r.mode != Mode::Skip)
        .map(|(r, _)| r.id.as_str())
        .collect();
    if let Some(first) = missing.first() {
        return Err(ProtocolError::new(
            file,
            format!(
                "case {first:?} has no response ({} of {} requests unanswered)",
                missing.len(),
                requests.len()
            ),
        ));
    }
    Ok(paired.into_iter().map(|p| p.map(|(_, r)| r)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_words_are_quoted_outside_strings_only() {
        let line = r#"{"id": "a NaN \"Infinity\"", "x": [NaN, -Infinity, Infinity]}"#;
        assert_eq!(
            quote_non_finite(line),
            r#"{"id": "a NaN \"Infinity\"", "x": ["NaN", "-Infinity", "Infinity"]}"#
        );
    }
}
