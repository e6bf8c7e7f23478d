//! The MaskBench schema corpus (../shared/data/maskbench, or $MASKBENCH_DIR) through the grammar
//! engine, compared schema by schema with golden/maskbench-expected.json (written by
//! `verity grammar-corpus DIR --write-expected`): compile status and reason, greedy output
//! status, and instance judgements. No invalid instance may ever be accepted, and greedy output
//! under every schema that compiles must be valid. The corpus is split into chunks, one test
//! each, so the suite spreads over test slots and CI shards.

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;

use libtest_mimic::{Failed, Trial};
use serde_json::Value;
use verity::grammar::corpus::{run_schema, CorpusModel, Timings, MAX_TOKENS};

const CHUNKS: usize = 8;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn corpus_dir() -> PathBuf {
    std::env::var_os("MASKBENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("../shared/data/maskbench"))
}

fn check_chunk(files: &[PathBuf], expected: &BTreeMap<String, Value>) -> Result<(), Failed> {
    mlx::jit::isolate_per_test_slot();
    let model = CorpusModel::load(&root().join("golden/models/qwen3-target"), MAX_TOKENS)?;
    let mut problems = Vec::new();
    for f in files {
        let got = run_schema(f, &model, &mut Timings::default());
        if got.invalid_rejected != got.invalid_total {
            problems.push(format!(
                "{}: accepted {} invalid instances",
                got.schema,
                got.invalid_total - got.invalid_rejected
            ));
        }
        if got.compile == "ok" && !got.generation.starts_with("valid") {
            problems.push(format!("{}: greedy output {}", got.schema, got.generation));
        }
        match expected.get(&got.schema) {
            None => problems.push(format!(
                "{}: not in golden/maskbench-expected.json",
                got.schema
            )),
            Some(want) if *want != serde_json::to_value(&got)? => problems.push(format!(
                "{}: expected {want}, got {}",
                got.schema,
                serde_json::to_value(&got)?
            )),
            Some(_) => {}
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n").into())
    }
}

fn main() {
    let args = support::main_thread_args();
    let dir = corpus_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "the MaskBench corpus is missing at {} ({e}); set MASKBENCH_DIR",
                dir.display()
            )
        })
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 500,
        "{} holds {} schemas, expected the 566 of the subset",
        dir.display(),
        files.len()
    );
    let expected_text =
        std::fs::read_to_string(root().join("golden/maskbench-expected.json")).unwrap();
    let expected: Vec<Value> = serde_json::from_str(&expected_text).unwrap();
    let expected: BTreeMap<String, Value> = expected
        .into_iter()
        .map(|o| (o["schema"].as_str().unwrap().to_string(), o))
        .collect();
    assert_eq!(
        expected.len(),
        files.len(),
        "golden/maskbench-expected.json covers another corpus"
    );
    let size = files.len().div_ceil(CHUNKS);
    let trials = files
        .chunks(size)
        .enumerate()
        .map(|(i, chunk)| {
            let (chunk, expected) = (chunk.to_vec(), expected.clone());
            Trial::test(format!("maskbench_chunk_{i}"), move || {
                check_chunk(&chunk, &expected)
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
