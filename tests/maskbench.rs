//! The MaskBench schema corpus through the grammar engine, compared schema by schema with
//! golden/maskbench-expected.json (written by `verity grammar-corpus DIR --write-expected`):
//! compile status and reason, greedy output status, and instance judgements. No invalid
//! instance may ever be accepted, and greedy output under every schema that compiles must be
//! valid.
//!
//! The corpus is not part of the repository: it is the `maskbench/data` folder of
//! guidance-ai/jsonschemabench, named by $MASKBENCH_DIR, and these tests run in the nextest
//! `maskbench` profile (`MASKBENCH_DIR=... cargo nextest run --profile maskbench`). Without
//! MASKBENCH_DIR every chunk fails saying so. The corpus is split into chunks, one test each,
//! so the suite spreads over test slots.

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;

use libtest_mimic::{Failed, Trial};
use serde_json::Value;
use support::{model_dir, root};
use verity::parity::corpus::{run_schema, CorpusFile, CorpusModel, Timings, MAX_TOKENS};

const CHUNKS: usize = 8;

/// The corpus files, sorted, from $MASKBENCH_DIR.
fn corpus() -> Result<Vec<PathBuf>, Failed> {
    let dir = std::env::var_os("MASKBENCH_DIR").map(PathBuf::from).ok_or(
        "MASKBENCH_DIR is not set: point it at the maskbench/data folder of \
         guidance-ai/jsonschemabench (the MaskBench tests run only in the `maskbench` profile)",
    )?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("MASKBENCH_DIR={}: {e}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|x| x == "json"));
    files.sort();
    Ok(files)
}

/// golden/maskbench-expected.json by schema file name.
fn expected() -> Result<BTreeMap<String, Value>, Failed> {
    let text = std::fs::read_to_string(root().join("golden/maskbench-expected.json"))?;
    let list: Vec<Value> = serde_json::from_str(&text)?;
    list.into_iter()
        .map(|o| match o["schema"].as_str() {
            Some(name) => Ok((name.to_string(), o)),
            None => Err(format!("an expected outcome without a schema name: {o}").into()),
        })
        .collect()
}

fn check_chunk(index: usize) -> Result<(), Failed> {
    let files = corpus()?;
    let expected = expected()?;
    if expected.len() != files.len() {
        return Err(format!(
            "the corpus holds {} schemas, golden/maskbench-expected.json {}: another corpus?",
            files.len(),
            expected.len()
        )
        .into());
    }
    support::on_cpu();
    let model = CorpusModel::load(&model_dir("qwen3-target"), MAX_TOKENS)?;
    let size = files.len().div_ceil(CHUNKS);
    let mut problems = Vec::new();
    for f in files.chunks(size).nth(index).unwrap_or_default() {
        let got = run_schema(&CorpusFile::read(f)?, &model, &mut Timings::default());
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
        let got_value = serde_json::to_value(&got)?;
        match expected.get(&got.schema) {
            None => problems.push(format!(
                "{}: not in golden/maskbench-expected.json",
                got.schema
            )),
            Some(want) if *want != got_value => {
                problems.push(format!("{}: expected {want}, got {got_value}", got.schema))
            }
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
    let trials = (0..CHUNKS)
        .map(|i| Trial::test(format!("maskbench_chunk_{i}"), move || check_chunk(i)))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
