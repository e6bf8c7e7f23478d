//! The validation layer under random input: token ids (inside and past the vocabulary, up to
//! u32::MAX), logit biases (finite, NaN, infinite) and option values (in and out of range)
//! reach the engine's entry points, plain and speculative. Every request is either refused
//! before it runs, as bad input (what the CLI exits 2 on) or as a combination mlx-lm refuses
//! too, or it runs to completion and gives the same tokens when run again.

mod support;

use std::cell::Cell;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use support::{bundle, proptest_cases};
use verity::cache::KvQuantization;
use verity::generate::{Control, GenerateParams, Generation};
use verity::model::LanguageModel;
use verity::sample::{KeySchedule, ProcessorParams, SamplerParams};
use verity::speculative::{generate_speculative, NgramLookup};
use verity::Error;

/// What a request asks for, before validation.
#[derive(Clone, Debug)]
struct Request {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampler: SamplerParams,
    processors: ProcessorParams,
    max_kv_size: Option<usize>,
    kv: Option<(i32, i32)>,
    keys: KeySchedule,
    /// Speculate with n-gram lookup: (num_draft_tokens, ngram_min, ngram_max).
    ngram: Option<(usize, usize, usize)>,
}

/// Mostly ids of the fixture's 1,024-token vocabulary, sometimes any u32.
fn token_id() -> impl Strategy<Value = u32> {
    prop_oneof![30 => 0u32..1024, 1 => 1024u32..2048, 1 => any::<u32>()]
}

/// Mostly in range, sometimes out of it or not a number.
fn number(range: std::ops::Range<f64>, outside: f64) -> impl Strategy<Value = f64> {
    prop_oneof![
        40 => range,
        1 => Just(outside),
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
    ]
}

/// Mostly `valid`, sometimes `invalid`.
fn count(
    valid: std::ops::Range<usize>,
    invalid: std::ops::Range<usize>,
) -> impl Strategy<Value = usize> {
    prop_oneof![20 => valid, 1 => invalid]
}

fn request() -> impl Strategy<Value = Request> {
    let sampler = (
        prop_oneof![2 => Just(0.0), 3 => number(0.0..1.5, -1.0)],
        number(0.0..1.0, 2.0),
        number(0.0..0.3, 1.5),
        count(0..50, 1025..1100),
        count(1..3, 0..1),
        number(0.0..1.0, 1.5),
        number(0.0..0.5, 0.9),
        proptest::collection::vec(token_id(), 0..2),
    )
        .prop_map(
            |(temp, top_p, min_p, top_k, keep, xtc_p, xtc_t, xtc_ids)| SamplerParams {
                temp,
                top_p,
                min_p,
                min_tokens_to_keep: keep,
                top_k,
                xtc_probability: xtc_p,
                xtc_threshold: xtc_t,
                xtc_special_tokens: xtc_ids,
            },
        );
    let penalty = || proptest::option::of(number(0.5..1.5, -1.0));
    let processors = (
        proptest::collection::vec((token_id(), number(-5.0..5.0, 1e40)), 0..3),
        penalty(),
        penalty(),
        penalty(),
        count(1..25, 0..1),
    )
        .prop_map(|(bias, rep, pres, freq, context)| ProcessorParams {
            logit_bias: bias,
            repetition_penalty: rep,
            repetition_context_size: context,
            presence_penalty: pres,
            presence_context_size: context,
            frequency_penalty: freq,
            frequency_context_size: context,
        });
    (
        prop_oneof![
            20 => proptest::collection::vec(token_id(), 1..8),
            1 => Just(Vec::new()),
        ],
        count(1..5, 0..1),
        sampler,
        processors,
        proptest::option::weighted(0.2, count(5..40, 0..5)),
        proptest::option::weighted(
            0.2,
            (
                prop_oneof![4 => Just(4), 4 => Just(8), 1 => Just(0), 1 => Just(16)],
                prop_oneof![4 => Just(32), 1 => Just(0), 1 => Just(48), 1 => Just(64)],
            ),
        ),
        proptest::option::weighted(
            0.4,
            (
                count(1..6, 257..300),
                count(1..3, 0..1),
                count(2..5, 65..70),
            ),
        ),
        prop_oneof![Just(KeySchedule::Sequence), Just(KeySchedule::Positioned)],
    )
        .prop_map(
            |(prompt, max_tokens, sampler, processors, max_kv_size, kv, ngram, keys)| Request {
                prompt,
                max_tokens,
                sampler,
                processors,
                max_kv_size,
                kv,
                keys,
                ngram,
            },
        )
}

/// Runs the request to completion: its tokens, or the refusal.
fn run(model: &dyn LanguageModel, eos: &[u32], r: &Request) -> Result<Vec<u32>, Error> {
    let params = GenerateParams {
        max_tokens: r.max_tokens,
        sampler: r.sampler.clone(),
        processors: r.processors.clone(),
        seed: Some(7),
        keys: r.keys,
        prefill_step_size: 4,
        prefill_splits: Vec::new(),
        max_kv_size: r.max_kv_size,
        kv_quantization: r.kv.map(|(bits, group_size)| KvQuantization {
            bits,
            group_size,
            start: 2,
        }),
        eos_token_ids: eos.to_vec(),
    };
    let mut tokens = Vec::new();
    match r.ngram {
        None => {
            let caches = model.make_cache(params.max_kv_size);
            for step in Generation::start(model, caches, &r.prompt, &params, None)? {
                tokens.push(step?.token);
            }
        }
        Some((k, min_n, max_n)) => {
            let mut source = NgramLookup::new(min_n, max_n)?;
            let mut emit = |t: &verity::generate::GeneratedToken| {
                tokens.push(t.token);
                Control::Continue
            };
            generate_speculative(model, &mut source, &r.prompt, &params, k, None, &mut emit)?;
        }
    }
    Ok(tokens)
}

#[test]
fn every_request_is_refused_as_bad_input_or_runs_the_same_twice() {
    support::on_cpu();
    let b = bundle("qwen3");
    let config = Config {
        cases: proptest_cases(96, 5_000),
        source_file: Some(file!()),
        ..Config::default()
    };
    let (refused, ran) = (Cell::new(0usize), Cell::new(0usize));
    // A fixed seed: the case list, and so the assertion that both outcomes occur, is the same
    // on every run.
    TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha))
        .run(&request(), |r| {
            match run(b.model(), &b.eos_token_ids, &r) {
                Err(e) => {
                    let refusal = e.is_bad_input() || matches!(e, Error::Unsupported(_));
                    prop_assert!(refusal, "not a refusal of bad input: {e}");
                    refused.set(refused.get() + 1);
                }
                Ok(first) => {
                    let again = run(b.model(), &b.eos_token_ids, &r)
                        .map_err(|e| TestCaseError::fail(format!("second run failed: {e}")))?;
                    prop_assert_eq!(first, again);
                    ran.set(ran.get() + 1);
                }
            }
            Ok(())
        })
        .unwrap();
    // Both outcomes must occur, or the strategy tests only one side of the layer.
    let (refused, ran) = (refused.get(), ran.get());
    eprintln!("validation proptest: {refused} refused, {ran} ran twice alike");
    assert!(refused > 0 && ran > 0, "refused {refused}, ran {ran}");
}
