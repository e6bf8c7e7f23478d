//! The rollback contract on real models, for every fixture architecture: feed a round of
//! tokens, take back its tail, continue — the next logits must be bit-identical to a fresh run
//! that only ever saw the kept tokens. On a GPU, whose kernels round differently for a different
//! number of tokens per call (the round fed more than the fresh run), they must agree within
//! GPU_LOGPROB_TOLERANCE instead; a wrong rollback (a stale or missing cache entry) moves them
//! by orders of magnitude more. Rounds a cache refuses (a sliding window about to wrap)
//! are fed without speculation, and at least one round per architecture is really taken back.

mod support;

use mlx::Array;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use support::{model_dir, proptest_cases};
use verity::cache::{
    begin_round, end_round, quantize_due, rollback_plan, KvQuantization, LayerCache, Rollback,
};
use verity::model::{self, LanguageModel};

/// One speculative round: tokens fed in one call, of which the last `reject` are taken back.
#[derive(Clone, Debug)]
struct Round {
    tokens: Vec<u32>,
    reject: usize,
}

#[derive(Clone, Debug)]
struct Case {
    prompt: Vec<u32>,
    rounds: Vec<Round>,
    next: u32,
}

fn cases(vocab: u32) -> impl Strategy<Value = Case> {
    let round =
        (prop::collection::vec(0..vocab, 1..=5), 0usize..=5).prop_map(|(tokens, r)| Round {
            reject: r.min(tokens.len()),
            tokens,
        });
    (
        prop::collection::vec(0..vocab, 1..=10),
        prop::collection::vec(round, 1..=3),
        0..vocab,
    )
        .prop_map(|(prompt, rounds, next)| Case {
            prompt,
            rounds,
            next,
        })
}

/// The model's caches, converted to quantized KV caches from the start when `kv` is set.
fn make_caches(model: &dyn LanguageModel, kv: Option<KvQuantization>) -> Vec<LayerCache> {
    let mut caches = model.make_cache(None);
    quantize_due(&mut caches, kv.as_ref()).unwrap();
    caches
}

/// How far logprobs after a rollback may be from a fresh run's on a GPU.
const GPU_LOGPROB_TOLERANCE: f32 = 1e-3;

/// The last position's logprobs after feeding `tokens`.
fn forward(model: &dyn LanguageModel, caches: &mut [LayerCache], tokens: &[u32]) -> Vec<f32> {
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    let input = Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap();
    let logits = model.forward(&input, caches, &[]).unwrap().logits;
    let l = logits.dim(1);
    let last = logits.slice_axis(1, l - 1, l).unwrap();
    let logprobs = last
        .subtract(&last.logsumexp(&[-1], true).unwrap())
        .unwrap();
    logprobs.to_vec::<f32>().unwrap()
}

/// Bit-identical on the CPU; within GPU_LOGPROB_TOLERANCE on a GPU. Returns the largest
/// difference when they disagree.
fn agree(a: &[f32], b: &[f32]) -> Result<(), f32> {
    let exact = mlx::Device::best_available() == mlx::Device::Cpu;
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let same_bits = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    if a.len() == b.len() && (same_bits || (!exact && worst <= GPU_LOGPROB_TOLERANCE)) {
        Ok(())
    } else {
        Err(worst)
    }
}

/// Runs a case with rounds taken back; returns the final logprobs and how many rounds were
/// really rolled back (rather than refused).
fn speculative(
    model: &dyn LanguageModel,
    kv: Option<KvQuantization>,
    case: &Case,
) -> (Vec<f32>, usize) {
    let mut caches = make_caches(model, kv);
    forward(model, &mut caches, &case.prompt);
    let mut rolled_back = 0;
    for round in &case.rounds {
        let kept = &round.tokens[..round.tokens.len() - round.reject];
        match rollback_plan(&caches, round.tokens.len()) {
            Rollback::Refuse(_) => {
                if !kept.is_empty() {
                    forward(model, &mut caches, kept);
                }
            }
            _ => {
                begin_round(&mut caches);
                forward(model, &mut caches, &round.tokens);
                end_round(&mut caches, round.reject).unwrap();
                rolled_back += usize::from(round.reject > 0);
            }
        }
    }
    (forward(model, &mut caches, &[case.next]), rolled_back)
}

/// The same case with only the kept tokens ever fed.
fn fresh(model: &dyn LanguageModel, kv: Option<KvQuantization>, case: &Case) -> Vec<f32> {
    let mut caches = make_caches(model, kv);
    forward(model, &mut caches, &case.prompt);
    for round in &case.rounds {
        let kept = &round.tokens[..round.tokens.len() - round.reject];
        if !kept.is_empty() {
            forward(model, &mut caches, kept);
        }
    }
    forward(model, &mut caches, &[case.next])
}

fn check_architecture(fixture: &str, kv: Option<KvQuantization>) {
    mlx::jit::isolate_per_test_slot();
    let (model, _) = model::load(&model_dir(fixture)).unwrap();
    let model = model.as_ref();
    let config = Config {
        cases: proptest_cases(32, 1000),
        source_file: Some(file!()),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let rolled_back = std::cell::Cell::new(0);
    runner
        .run(&cases(1024), |case| {
            let (spec, n) = speculative(model, kv, &case);
            rolled_back.set(rolled_back.get() + n);
            let differs = agree(&spec, &fresh(model, kv, &case)).err();
            prop_assert!(
                differs.is_none(),
                "logprobs after rollback differ from a fresh run by up to {:e}",
                differs.unwrap_or_default()
            );
            Ok(())
        })
        .unwrap();
    assert!(
        rolled_back.get() > 0,
        "{fixture}: no round was taken back; the property tested nothing"
    );
}

#[test]
fn llama_rollback_equals_a_fresh_run() {
    check_architecture("llama", None);
}

#[test]
fn qwen3_rollback_equals_a_fresh_run() {
    check_architecture("qwen3", None);
}

#[test]
fn gemma3_rollback_equals_a_fresh_run() {
    check_architecture("gemma3", None);
}

#[test]
fn qwen3_next_rollback_equals_a_fresh_run() {
    check_architecture("qwen3_next", None);
}

#[test]
fn qwen3_5_rollback_equals_a_fresh_run() {
    check_architecture("qwen3_5", None);
}

#[test]
fn qwen3_4bit_with_quantized_kv_rollback_equals_a_fresh_run() {
    check_architecture(
        "qwen3-4bit",
        Some(KvQuantization {
            bits: 4,
            group_size: 32,
            start: 0,
        }),
    );
}
