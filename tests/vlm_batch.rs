//! mlx-vlm's batched MTP rounds as the oracle of a batch of speculative rows: its
//! BatchGenerator with an MTP drafter (SpeculativeGenerationBatch over `_mtp_rounds_batch`)
//! recorded by oracles/record_vlm_batch.py into golden/vlm-batch/. Each row of verity's batch,
//! speculating with the same drafter and block, emits the tokens
//! mlx-vlm's row emitted (mlx-vlm reports no logprobs for these rows, so tokens are what there
//! is to hold), and so does the same request decoded plainly and alone. On a hybrid
//! (gated-DeltaNet) target mlx-vlm's batch rows are not its lone rows (known oracle bug
//! `vlm-batch-hybrid-rows`): there verity's rows are held to verity alone (tier C).

mod support;

use std::collections::BTreeMap;

use serde_json::Value;
use support::{bundle, model_dir};
use verity::batch::Batch;
use verity::decode::{decode, Hooks, Request, Start};
use verity::generate::{Control, FinishReason, GenerateParams, GeneratedToken};
use verity::parity::judge::model_class;
use verity::speculative::{Drafter, DrafterSpec};
use verity_harness::registry::ModelClass;

/// One recorded row: its prompt, max_tokens and the tokens mlx-vlm emitted.
struct Row {
    prompt: Vec<u32>,
    max_tokens: usize,
    tokens: Vec<u32>,
}

/// A golden/vlm-batch file: the target, the drafter folder (None: the target's own MTP head),
/// the block size and the rows.
struct Recorded {
    model: String,
    drafter: Option<String>,
    block_size: usize,
    rows: Vec<Row>,
}

fn read(path: &std::path::Path) -> Recorded {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(v["format"], "verity-vlm-batch/1", "{}", path.display());
    assert_eq!(v["oracle"]["tool"], "mlx-vlm", "{}", path.display());
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    Recorded {
        model: v["model"].as_str().unwrap().into(),
        drafter: match &v["drafter"] {
            Value::Null => None,
            d => Some(d.as_str().unwrap().into()),
        },
        block_size: v["block_size"].as_u64().unwrap() as usize,
        rows: v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| Row {
                prompt: ids(&r["prompt"]),
                max_tokens: r["max_tokens"].as_u64().unwrap() as usize,
                tokens: ids(&r["tokens"]),
            })
            .collect(),
    }
}

/// The known oracle bug under which a hybrid target's batch is judged.
const HYBRID_ROWS: &str = "vlm-batch-hybrid-rows";

/// Whether golden/known-oracle-bugs.toml lists the bug `id`.
fn oracle_bug_listed(id: &str) -> bool {
    let path = support::root().join("golden/known-oracle-bugs.toml");
    let bugs: toml::Value = toml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    bugs["bug"]
        .as_array()
        .unwrap()
        .iter()
        .any(|b| b["id"].as_str() == Some(id))
}

/// Each row's tokens as mlx-vlm's batch reports them: an EOS that stopped a row is not
/// reported.
fn as_reported(tokens: Vec<(u32, Option<FinishReason>)>) -> Vec<u32> {
    tokens
        .into_iter()
        .filter(|(_, finish)| *finish != Some(FinishReason::Stop))
        .map(|(t, _)| t)
        .collect()
}

#[test]
fn speculative_batch_rows_emit_mlx_vlms_batched_mtp_tokens() {
    support::on_cpu();
    let dir = support::root().join("golden/vlm-batch");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: no recorded batch", dir.display());
    for path in files {
        let recorded = read(&path);
        let target = bundle(&recorded.model);
        let drafter = Drafter::load(
            &DrafterSpec::Mtp {
                dir: recorded.drafter.as_deref().map(model_dir),
            },
            &target,
        )
        .unwrap();
        let params: Vec<GenerateParams> = recorded
            .rows
            .iter()
            .map(|r| GenerateParams::greedy(r.max_tokens, target.eos_token_ids.clone()))
            .collect();
        let request = |i: usize| Request {
            prompt: &recorded.rows[i].prompt,
            params: &params[i],
            constraint: None,
            num_draft_tokens: Some(recorded.block_size - 1),
        };
        let mut batch = Batch::new(target.model());
        for i in 0..recorded.rows.len() {
            batch
                .add(i, Some(&drafter), Start::Fresh, request(i), None, None)
                .unwrap();
        }
        let mut got: BTreeMap<usize, Vec<(u32, Option<FinishReason>)>> = BTreeMap::new();
        let mut drafted = 0;
        while !batch.is_empty() {
            let left = batch
                .step(&mut |i, t| {
                    got.entry(i).or_default().push((t.token, t.finish));
                    Control::Continue
                })
                .unwrap();
            drafted += left
                .iter()
                .filter_map(|l| l.speculation.as_ref())
                .map(|s| s.drafted)
                .sum::<usize>();
        }
        assert!(drafted > 0, "{}: no row drafted", path.display());
        let hybrid = model_class(&target) == ModelClass::Hybrid;
        if hybrid {
            assert!(
                oracle_bug_listed(HYBRID_ROWS),
                "{}: a hybrid's batch needs known oracle bug {HYBRID_ROWS}",
                path.display()
            );
        }
        for (i, row) in recorded.rows.iter().enumerate() {
            let name = format!("{} row {i}", path.display());
            let batched = as_reported(got.remove(&i).unwrap_or_default());
            if !hybrid {
                assert_eq!(
                    batched, row.tokens,
                    "{name}: verity's batch against mlx-vlm's"
                );
            }
            let mut alone = Vec::new();
            let mut on_token = |t: &GeneratedToken| {
                alone.push((t.token, t.finish));
                Control::Continue
            };
            let plain = Request {
                num_draft_tokens: None,
                ..request(i)
            };
            decode(
                target.model(),
                None,
                Start::Fresh,
                plain,
                Hooks::tokens(&mut on_token),
            )
            .unwrap();
            let alone = as_reported(alone);
            assert_eq!(
                batched, alone,
                "{name}: verity's batch against plain and alone"
            );
        }
    }
}
