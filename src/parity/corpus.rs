//! Runs a MaskBench-format schema corpus (files of `{schema, tests: [{valid, data}]}`) through
//! the grammar engine: per schema, whether it compiles, whether greedy generation under it is
//! complete and valid, and whether every test instance is accepted exactly when it is valid.
//! The outcome is a stable JSON document, diffed against a committed one so coverage changes
//! show up in review.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use serde_json::Value;

use super::bound::{bounded_for_generation, Bounds};
use crate::bundle::ModelBundle;
use crate::generate::{FinishReason, GenerateParams, Generation};
use crate::grammar::{Constraint, Grammar};
use crate::tokenizer::UserTurn;
use crate::{Error, Result};

/// One schema's outcome.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SchemaOutcome {
    pub schema: String,
    /// "ok", or why llguidance refuses the schema.
    pub compile: String,
    /// "valid", "invalid: ...", "unfinished", or "-" when it did not compile.
    pub generation: String,
    pub valid_accepted: usize,
    pub valid_total: usize,
    pub invalid_rejected: usize,
    pub invalid_total: usize,
    /// Test instances judged wrongly, by index: "accepted invalid #i" / "rejected valid #i".
    pub wrong: Vec<String>,
}

/// Timings gathered while running a corpus (for `verity bench grammar`).
#[derive(Default)]
pub struct Timings {
    pub compile_ms: Vec<f64>,
    pub mask_us: Vec<f64>,
}

/// The generation budget of a corpus run: enough for the largest MaskBench objects (about 90
/// required keys with nested values) under the bounded schema.
pub const MAX_TOKENS: usize = 4096;

/// The model side of a corpus run: the model folder's tokenizer (for llguidance and for
/// tokenizing instances) and the model generating under each schema from a fixed chat prompt.
pub struct CorpusModel {
    bundle: ModelBundle,
    prompt: Vec<u32>,
    max_tokens: usize,
    /// Milliseconds spent building the token environment.
    pub env_ms: f64,
}

impl CorpusModel {
    pub fn load(dir: &Path, max_tokens: usize) -> Result<CorpusModel> {
        if max_tokens == 0 {
            return Err(crate::error::invalid("max_tokens", 0, "must be at least 1"));
        }
        let bundle = ModelBundle::load(dir)?;
        let start = Instant::now();
        bundle.token_env()?;
        let env_ms = start.elapsed().as_secs_f64() * 1e3;
        let prompt = bundle.tokenizer.encode_user_turn(&UserTurn {
            text: "Reply with JSON.",
            ..UserTurn::default()
        })?;
        Ok(CorpusModel {
            bundle,
            prompt,
            max_tokens,
            env_ms,
        })
    }

    fn constraint(&self, grammar: &Grammar) -> Result<Constraint> {
        self.bundle.constraint(grammar)
    }

    fn eos(&self) -> &[u32] {
        &self.bundle.eos_token_ids
    }
}

/// Whether the tokens of `text` are accepted by a fresh constraint for `grammar` and leave it
/// able to end.
fn accepts(m: &CorpusModel, grammar: &Grammar, text: &str) -> bool {
    let (Ok(mut c), Ok(tokens)) = (
        m.constraint(grammar),
        m.bundle.tokenizer.encode(text, false),
    ) else {
        return false;
    };
    for t in tokens {
        match c.allowed() {
            Ok(allowed) if allowed.get(t as usize).copied().unwrap_or(false) => {}
            _ => return false,
        }
        if c.consume(t).is_err() {
            return false;
        }
    }
    c.allowed().is_ok_and(|a| {
        m.eos()
            .iter()
            .any(|&e| a.get(e as usize).copied().unwrap_or(false))
    })
}

/// One corpus file, read and checked before any schema runs: an unreadable file, or a test
/// without a boolean `valid` and a `data`, is bad input, not an outcome to diff.
pub struct CorpusFile {
    pub name: String,
    schema: Value,
    /// (valid, data) per test instance.
    tests: Vec<(bool, Value)>,
}

impl CorpusFile {
    pub fn read(path: &Path) -> Result<CorpusFile> {
        let bad = |what: String| Error::Params(format!("corpus file {}: {what}", path.display()));
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let doc: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        // A MaskBench file wraps the schema with its tests; a bare schema file is the schema.
        let Some(schema) = doc.get("schema").cloned() else {
            return Ok(CorpusFile {
                name,
                schema: doc,
                tests: Vec::new(),
            });
        };
        let tests = match doc.get("tests") {
            None => Vec::new(),
            Some(Value::Array(tests)) => tests
                .iter()
                .enumerate()
                .map(|(i, t)| match (t.get("valid"), t.get("data")) {
                    (Some(Value::Bool(valid)), Some(data)) => Ok((*valid, data.clone())),
                    _ => Err(bad(format!(
                        "tests[{i}] needs a boolean \"valid\" and a \"data\""
                    ))),
                })
                .collect::<Result<_>>()?,
            Some(other) => return Err(bad(format!("\"tests\" is {other}, not an array"))),
        };
        Ok(CorpusFile {
            name,
            schema,
            tests,
        })
    }
}

/// Runs one corpus file.
pub fn run_schema(file: &CorpusFile, m: &CorpusModel, timings: &mut Timings) -> SchemaOutcome {
    let (name, schema) = (file.name.clone(), &file.schema);
    let grammar = Grammar::JsonSchema(schema.clone());
    let start = Instant::now();
    let constraint = match m.constraint(&grammar) {
        Ok(c) => c,
        Err(e) => return outcome(name, e.to_string()),
    };
    timings.compile_ms.push(start.elapsed().as_secs_f64() * 1e3);
    let mut out = outcome(name, "ok".into());
    let validator = jsonschema::validator_for(schema).ok();
    // Generate under the most bounded variant that compiles; judge against the original.
    let bounded = [Bounds::Strict, Bounds::Lenient]
        .into_iter()
        .find_map(|b| {
            m.constraint(&Grammar::JsonSchema(bounded_for_generation(schema, b)))
                .ok()
        })
        .unwrap_or(constraint);
    let (generation, tokens) = generate(m, bounded, validator.as_ref());
    out.generation = generation;
    time_masks(m, &grammar, &tokens, timings);
    for (i, &(valid, ref data)) in file.tests.iter().enumerate() {
        let text = serde_json::to_string(data).expect("JSON serializes");
        let accepted = accepts(m, &grammar, &text);
        if valid {
            out.valid_total += 1;
            out.valid_accepted += usize::from(accepted);
        } else {
            out.invalid_total += 1;
            out.invalid_rejected += usize::from(!accepted);
        }
        if accepted != valid {
            out.wrong.push(format!(
                "{} #{i}",
                if accepted {
                    "accepted invalid"
                } else {
                    "rejected valid"
                }
            ));
        }
    }
    out
}

fn outcome(schema: String, compile: String) -> SchemaOutcome {
    SchemaOutcome {
        schema,
        compile,
        generation: "-".into(),
        valid_accepted: 0,
        valid_total: 0,
        invalid_rejected: 0,
        invalid_total: 0,
        wrong: Vec::new(),
    }
}

/// Greedy generation under the grammar, judged by the jsonschema crate; also returns the
/// emitted tokens (EOS excluded).
fn generate(
    m: &CorpusModel,
    constraint: Constraint,
    validator: Option<&jsonschema::Validator>,
) -> (String, Vec<u32>) {
    let params = GenerateParams::greedy(m.max_tokens, m.eos().to_vec());
    let model = m.bundle.model();
    let caches = model.make_cache(None);
    let mut tokens = Vec::new();
    let mut finished = false;
    let generation = match Generation::start(model, caches, &m.prompt, &params, Some(constraint)) {
        Ok(g) => g,
        Err(e) => return (format!("error: {e}"), tokens),
    };
    for step in generation {
        let step = match step {
            Ok(s) => s,
            Err(e) => return (format!("error: {e}"), tokens),
        };
        finished = step.finish == Some(FinishReason::Stop);
        if !m.eos().contains(&step.token) {
            tokens.push(step.token);
        }
    }
    if !finished {
        let text = m.bundle.decode(&tokens);
        let tail: String = text
            .chars()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        return (format!("unfinished: ...{tail}"), tokens);
    }
    let status = match m
        .bundle
        .tokenizer
        .decode(&tokens)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| format!("not JSON ({e})")))
    {
        Err(e) => format!("invalid: {e}"),
        Ok(v) => match validator.map(|val| val.iter_errors(&v).next().map(|e| e.to_string())) {
            None => "valid (jsonschema cannot compile the schema)".into(),
            Some(None) => "valid".into(),
            Some(Some(e)) => format!("invalid: {e}"),
        },
    };
    (status, tokens)
}

/// Times the mask at every step of `tokens` on a fresh constraint: the masks the generation
/// computed, without the forward passes around them.
fn time_masks(m: &CorpusModel, grammar: &Grammar, tokens: &[u32], timings: &mut Timings) {
    let Ok(mut c) = m.constraint(grammar) else {
        return;
    };
    for &t in tokens {
        let start = Instant::now();
        if c.allowed().is_err() {
            return;
        }
        timings.mask_us.push(start.elapsed().as_secs_f64() * 1e6);
        if c.consume(t).is_err() {
            return;
        }
    }
}
