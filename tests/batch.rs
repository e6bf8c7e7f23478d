//! Batch ≡ single: every row of a batch emits, token for token and logprob bit for bit, what
//! the same request emits alone, on the CPU. A property over random schedules (prompts of
//! different lengths, greedy and seeded rows, rows joining between steps, finishing at
//! different times and being cancelled), for every fixture architecture and cache kind: KV,
//! rotating (a sliding window, and --max-kv-size), quantized KV, recurrent, 4-bit weights.

mod support;

use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use support::{bundle, proptest_cases};
use verity::batch::Batch;
use verity::bundle::ModelBundle;
use verity::cache::KvQuantization;
use verity::decode::{decode, Hooks, Request, Start};
use verity::generate::{Control, FinishReason, GenerateParams, GeneratedToken};
use verity::grammar::Grammar;
use verity::model::LanguageModel;

/// (token, logprob bits, finish) of each emitted token.
type Steps = Vec<(u32, Vec<u8>, Option<FinishReason>)>;

fn record(steps: &mut Steps, t: &GeneratedToken) {
    steps.push((t.token, t.logprobs.to_bytes().unwrap(), t.finish));
}

/// One request of a schedule.
#[derive(Clone, Debug)]
struct Row {
    prompt: Vec<u32>,
    max_tokens: usize,
    /// Sampled at temperature 0.8 with this seed; greedy when None.
    seed: Option<u64>,
    /// The step before which it joins the batch.
    joins: usize,
    /// The step before which it is taken out, if it is still running then.
    cancelled: Option<usize>,
}

fn rows(vocab: u32) -> impl Strategy<Value = Vec<Row>> {
    let row = (
        prop::collection::vec(3..vocab, 1..=24),
        1usize..=10,
        prop::option::of(0u64..1000),
        0usize..=6,
        prop::option::of(1usize..=8),
    )
        .prop_map(|(prompt, max_tokens, seed, joins, cancel)| Row {
            prompt,
            max_tokens,
            seed,
            joins,
            cancelled: cancel.map(|c| joins + c),
        });
    prop::collection::vec(row, 1..=4)
}

/// How the fixture's requests set their caches.
#[derive(Clone, Copy)]
enum Caches {
    Plain,
    Rotating(usize),
    QuantizedKv,
}

fn params(model: &ModelBundle, row: &Row, caches: Caches) -> GenerateParams {
    let mut p = GenerateParams::greedy(row.max_tokens, model.eos_token_ids.clone());
    if let Some(seed) = row.seed {
        p.sampler.temp = 0.8;
        p.seed = Some(seed);
    }
    match caches {
        Caches::Plain => {}
        Caches::Rotating(size) => p.max_kv_size = Some(size),
        Caches::QuantizedKv => {
            p.kv_quantization = Some(KvQuantization {
                bits: 4,
                group_size: 32,
                start: 0,
            })
        }
    }
    p
}

/// The request decoded alone, through the one decode entry point.
fn alone(model: &dyn LanguageModel, prompt: &[u32], params: &GenerateParams) -> Steps {
    let mut steps = Steps::new();
    let mut on_token = |t: &GeneratedToken| {
        record(&mut steps, t);
        Control::Continue
    };
    let request = Request {
        prompt,
        params,
        constraint: None,
        num_draft_tokens: None,
    };
    decode(
        model,
        None,
        Start::Fresh,
        request,
        Hooks::tokens(&mut on_token),
    )
    .unwrap();
    steps
}

/// Runs the schedule as one batch; every row's emitted tokens by row index, and the most rows
/// that decoded in one step.
fn batched(
    model: &dyn LanguageModel,
    rows: &[Row],
    params: &[GenerateParams],
) -> (BTreeMap<usize, Steps>, usize) {
    let mut batch = Batch::new(model);
    let mut out: BTreeMap<usize, Steps> = BTreeMap::new();
    let mut widest = 0;
    let mut step = 0;
    while step <= rows.iter().map(|r| r.joins).max().unwrap() || !batch.is_empty() {
        for (i, row) in rows.iter().enumerate().filter(|(_, r)| r.joins == step) {
            let request = Request {
                prompt: &row.prompt,
                params: &params[i],
                constraint: None,
                num_draft_tokens: None,
            };
            batch.add(i, Start::Fresh, request, None, None).unwrap();
            out.insert(i, Steps::new());
        }
        for (i, _) in rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.cancelled == Some(step))
        {
            batch.remove(i);
        }
        widest = widest.max(batch.ids().len());
        batch
            .step(&mut |i, t| {
                record(out.get_mut(&i).unwrap(), t);
                Control::Continue
            })
            .unwrap();
        step += 1;
    }
    (out, widest)
}

fn check_fixture(fixture: &str, caches: Caches) {
    support::on_cpu();
    let b = bundle(fixture);
    let model = b.model();
    let config = Config {
        cases: proptest_cases(6, 300),
        source_file: Some(file!()),
        ..Config::default()
    };
    let vocab = model.vocab_size() as u32;
    let shared = std::cell::Cell::new(0usize);
    TestRunner::new(config)
        .run(&rows(vocab), |rows| {
            let params: Vec<GenerateParams> = rows.iter().map(|r| params(&b, r, caches)).collect();
            let (got, widest) = batched(model, &rows, &params);
            for (i, row) in rows.iter().enumerate() {
                let want = alone(model, &row.prompt, &params[i]);
                let got = &got[&i];
                let whole = row.cancelled.is_none_or(|c| c - row.joins >= want.len());
                prop_assert!(
                    got.len() <= want.len() && got[..] == want[..got.len()],
                    "row {i} of {rows:?}: the batch emitted {:?}, alone {:?}",
                    got.iter().map(|s| s.0).collect::<Vec<_>>(),
                    want.iter().map(|s| s.0).collect::<Vec<_>>()
                );
                prop_assert!(!whole || got.len() == want.len(), "row {i} stopped early");
            }
            if widest > 1 {
                shared.set(shared.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    assert!(shared.get() > 0, "{fixture}: no step decoded two rows");
}

#[test]
fn llama_batch_rows_equal_their_lone_requests() {
    check_fixture("llama", Caches::Plain);
}

#[test]
fn qwen3_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3", Caches::Plain);
}

#[test]
fn qwen3_rotating_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3", Caches::Rotating(12));
}

#[test]
fn gemma3_batch_rows_equal_their_lone_requests() {
    check_fixture("gemma3", Caches::Plain);
}

#[test]
fn qwen3_next_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3_next", Caches::Plain);
}

#[test]
fn qwen3_5_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3_5", Caches::Plain);
}

#[test]
fn qwen3_4bit_quantized_kv_batch_rows_equal_their_lone_requests() {
    check_fixture("qwen3-4bit", Caches::QuantizedKv);
}

/// A grammar-constrained row and a plain row decode together, each as alone: the grammar's
/// mask is the row's own.
#[test]
fn a_grammar_row_beside_a_plain_row_equals_both_alone() {
    support::on_cpu();
    let b = bundle("qwen3-target");
    let model = b.model();
    let prompt = b.tokenizer.encode("The answer is", true).unwrap();
    let grammar = Grammar::Regex("(yes|no), because [a-z ]{1,40}\\.".into());
    let params = GenerateParams::greedy(24, b.eos_token_ids.clone());
    let mut want_grammar = Steps::new();
    let request = Request {
        prompt: &prompt,
        params: &params,
        constraint: Some(b.constraint(&grammar).unwrap()),
        num_draft_tokens: None,
    };
    let mut on_token = |t: &GeneratedToken| {
        record(&mut want_grammar, t);
        Control::Continue
    };
    decode(
        model,
        None,
        Start::Fresh,
        request,
        Hooks::tokens(&mut on_token),
    )
    .unwrap();
    let want_plain = alone(model, &prompt[1..], &params);

    let mut batch = Batch::new(model);
    let constrained = Request {
        prompt: &prompt,
        params: &params,
        constraint: Some(b.constraint(&grammar).unwrap()),
        num_draft_tokens: None,
    };
    batch.add(0, Start::Fresh, constrained, None, None).unwrap();
    let plain = Request {
        prompt: &prompt[1..],
        params: &params,
        constraint: None,
        num_draft_tokens: None,
    };
    batch.add(1, Start::Fresh, plain, None, None).unwrap();
    let mut got = [Steps::new(), Steps::new()];
    while !batch.is_empty() {
        batch
            .step(&mut |i, t| {
                record(&mut got[i], t);
                Control::Continue
            })
            .unwrap();
    }
    assert_eq!(got[0], want_grammar);
    assert_eq!(got[1], want_plain);
    assert_ne!(
        want_grammar.iter().map(|s| s.0).collect::<Vec<_>>(),
        want_plain.iter().map(|s| s.0).collect::<Vec<_>>(),
        "the grammar changed nothing: the test would not see a shared mask"
    );
}
