//! Grammar-constrained decoding on every schema of golden/schemas and every fixture target:
//! greedy output is complete, parses, and is valid against the schema (jsonschema crate);
//! greedy grammar + speculation (draft model and n-gram) emits exactly the grammar-only tokens;
//! and after speculative rounds the grammar's state equals a fresh constraint fed exactly the
//! emitted tokens. The decoded outputs are insta snapshots
//! (tests/snapshots/grammar__<schema>.snap). One test per schema. The quick default run
//! speculates with k = 3; the `fuzz` profile sweeps k = 1..4.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use libtest_mimic::{Failed, Trial};
use serde_json::Value;
use support::{model_dir, root};
use verity::bundle::ModelBundle;
use verity::generate::{Control, FinishReason, GenerateParams, GeneratedToken, Generation};
use verity::grammar::{Constraint, Grammar};
use verity::speculative::{generate_speculative, DraftModel, DraftSource, NgramLookup};
use verity::tokenizer::UserTurn;

/// Target fixtures and the draft model each is paired with.
const TARGETS: [(&str, &str); 6] = [
    ("llama", "llama-draft"),
    ("qwen3", "llama-draft"),
    ("gemma3", "llama-draft"),
    ("qwen3_next", "llama-draft"),
    ("qwen3_5", "llama-draft"),
    ("qwen3-target", "qwen3-draft"),
];

const MAX_TOKENS: usize = 160;

/// The numbers of draft tokens each schema is speculated with.
fn draft_lengths() -> &'static [usize] {
    if std::env::var("NEXTEST_PROFILE").as_deref() == Ok("fuzz") {
        &[1, 2, 3, 4]
    } else {
        &[3]
    }
}

struct Target {
    name: String,
    bundle: ModelBundle,
    draft: ModelBundle,
}

impl Target {
    fn load(name: &str, draft: &str) -> Result<Target, Failed> {
        Ok(Target {
            name: name.to_string(),
            bundle: ModelBundle::load(&model_dir(name))?,
            draft: ModelBundle::load(&model_dir(draft))?,
        })
    }

    fn constraint(&self, grammar: &Grammar) -> Result<Constraint, Failed> {
        Ok(self.bundle.constraint(grammar)?)
    }

    fn prompt(&self, title: &str) -> Result<Vec<u32>, Failed> {
        let text = format!("Reply with a {title} as JSON.");
        Ok(self.bundle.tokenizer.encode_user_turn(&UserTurn {
            text: &text,
            ..UserTurn::default()
        })?)
    }
}

/// Greedy grammar-only generation: (tokens, finish).
fn plain(
    t: &Target,
    prompt: &[u32],
    params: &GenerateParams,
    grammar: &Grammar,
) -> Result<(Vec<u32>, Option<FinishReason>), Failed> {
    let model = t.bundle.model();
    let caches = model.make_cache(None);
    let mut tokens = Vec::new();
    let mut finish = None;
    for step in Generation::start(model, caches, prompt, params, Some(t.constraint(grammar)?))? {
        let step = step?;
        tokens.push(step.token);
        finish = step.finish;
    }
    Ok((tokens, finish))
}

/// Greedy grammar + speculation, optionally halted after `halt` tokens; returns the emitted
/// tokens and the constraint as the executor left it.
fn speculative(
    t: &Target,
    source: &mut dyn DraftSource,
    prompt: &[u32],
    params: &GenerateParams,
    k: usize,
    grammar: &Grammar,
    halt: Option<usize>,
) -> Result<(Vec<u32>, Constraint), Failed> {
    let mut tokens = Vec::new();
    let mut on_token = |s: &GeneratedToken| {
        tokens.push(s.token);
        if Some(tokens.len()) == halt {
            Control::Stop
        } else {
            Control::Continue
        }
    };
    let model = t.bundle.model();
    let constraint = Some(t.constraint(grammar)?);
    let (_, constraint) =
        generate_speculative(model, source, prompt, params, k, constraint, &mut on_token)?;
    Ok((
        tokens,
        constraint.ok_or("the executor hands the constraint back")?,
    ))
}

/// The grammar state of `live` must equal a fresh constraint fed exactly `emitted`.
fn same_state(
    t: &Target,
    grammar: &Grammar,
    live: &mut Constraint,
    emitted: &[u32],
) -> Result<bool, Failed> {
    let mut fresh = t.constraint(grammar)?;
    for &tok in emitted {
        fresh.consume(tok)?;
    }
    Ok(live.is_stopped() == fresh.is_stopped() && live.allowed()? == fresh.allowed()?)
}

fn check_schema(path: &Path, targets: &[Target]) -> Result<(), Failed> {
    support::on_cpu();
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let validator = jsonschema::validator_for(&schema)
        .map_err(|e| format!("schema does not compile in jsonschema: {e}"))?;
    let title = schema["title"].as_str().unwrap_or("value").to_string();
    let grammar = Grammar::JsonSchema(schema);
    let mut outputs = BTreeMap::new();
    for t in targets {
        let name = &t.name;
        let prompt = t.prompt(&title)?;
        let params = GenerateParams::greedy(MAX_TOKENS, t.bundle.eos_token_ids.clone());
        let (want, finish) = plain(t, &prompt, &params, &grammar)?;
        let body: Vec<u32> = want
            .iter()
            .copied()
            .filter(|tok| !t.bundle.eos_token_ids.contains(tok))
            .collect();
        let text = t.bundle.decode(&body);
        if finish != Some(FinishReason::Stop) {
            return Err(format!(
                "{name}: output did not finish within {MAX_TOKENS} tokens: {text}"
            )
            .into());
        }
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| format!("{name}: output is not JSON ({e}): {text}"))?;
        if let Some(err) = validator.iter_errors(&value).next() {
            return Err(format!("{name}: output violates the schema ({err}): {text}").into());
        }
        for &k in draft_lengths() {
            let sources: [Box<dyn DraftSource>; 2] = [
                Box::new(DraftModel::new(t.draft.model())),
                Box::new(NgramLookup::new(1, 3).unwrap()),
            ];
            for (which, mut source) in ["draft model", "n-gram"].into_iter().zip(sources) {
                let (got, mut live) =
                    speculative(t, source.as_mut(), &prompt, &params, k, &grammar, None)?;
                if got != want {
                    return Err(format!(
                        "{name}: grammar + {which} k={k} differs from grammar-only"
                    )
                    .into());
                }
                if !same_state(t, &grammar, &mut live, &got)? {
                    return Err(format!(
                        "{name}: grammar state after {which} k={k} differs from a fresh replay"
                    )
                    .into());
                }
            }
        }
        // Halted mid-round: the grammar holds exactly the emitted tokens.
        let halt = (want.len() / 2).max(1);
        let mut source = DraftModel::new(t.draft.model());
        let (got, mut live) =
            speculative(t, &mut source, &prompt, &params, 4, &grammar, Some(halt))?;
        if got.len() != halt.min(want.len()) || !same_state(t, &grammar, &mut live, &got)? {
            return Err(format!(
                "{name}: after a halt at {halt} the grammar state differs from a fresh replay"
            )
            .into());
        }
        outputs.insert(name.clone(), text);
    }
    let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
    insta::assert_json_snapshot!(stem, outputs);
    Ok(())
}

fn main() {
    let args = support::main_thread_args();
    let dir = root().join("golden/schemas");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    assert!(
        paths.len() >= 30,
        "golden/schemas holds {} schemas, expected at least 30",
        paths.len()
    );
    let trials = paths
        .into_iter()
        .map(|path| {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            Trial::test(name, move || {
                let targets = TARGETS
                    .iter()
                    .map(|(t, d)| Target::load(t, d))
                    .collect::<Result<Vec<_>, _>>()?;
                check_schema(&path, &targets)
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
