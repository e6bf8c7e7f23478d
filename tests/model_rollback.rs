//! The rollback contract on real models, for every fixture architecture: feed a round of
//! tokens, take back its tail, continue — the next logits must be bit-identical to a fresh run
//! that only ever saw the kept tokens. On a GPU, whose kernels round differently for a different
//! number of tokens per call (the round fed more than the fresh run), they must agree within the
//! cross-backend step tolerance of the fixture's class instead (golden/tolerances.toml: the
//! same kind of rounding); a wrong rollback (a stale cache entry) moves them by more, which
//! `keeping_rejected_tokens_exceeds_the_gpu_tolerance` checks. Rounds a cache refuses (a
//! sliding window about to wrap) are fed without speculation, and at least one round per
//! architecture is really taken back.

mod support;

use mlx::Array;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use support::{model_dir, proptest_cases};
use verity::bundle::ModelBundle;
use verity::cache::{
    begin_round, end_round, quantize_due, rollback_plan, KvQuantization, LayerCache, Rollback,
};
use verity::model::LanguageModel;
use verity::parity::judge::model_class;
use verity_harness::registry::Registry;

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

/// How far logprobs after a rollback may be from a fresh run's on a GPU backend: the
/// per-step tolerance of the fixture's class between the CPU and that backend.
fn gpu_tolerance(bundle: &ModelBundle, backend: &str) -> f32 {
    let registry = Registry::load(&support::root().join("golden")).unwrap();
    registry
        .tolerance("cpu", backend, model_class(bundle))
        .limits
        .step
}

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

/// The largest difference between two logprob rows (infinite when their lengths differ).
fn worst_difference(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Bit-identical when `tolerance` is None (the CPU); within it otherwise. Returns the largest
/// difference when they disagree.
fn agree(a: &[f32], b: &[f32], tolerance: Option<f32>) -> Result<(), f32> {
    let same_bits = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let worst = worst_difference(a, b);
    match tolerance {
        _ if same_bits => Ok(()),
        Some(limit) if worst <= limit => Ok(()),
        _ => Err(worst),
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

/// The case with every round that keeps one of its several tokens made to keep two (or all,
/// for two): glm4_moe_lite computes a lone token by another path than a token among several
/// (mlx-lm's absorbed attention for one token), so such a round has no fresh run that feeds
/// the same computation; the rollback itself is what the property still checks.
fn keeping_no_lone_token(mut case: Case) -> Case {
    for round in &mut case.rounds {
        if round.tokens.len() > 1 && round.tokens.len() - round.reject == 1 {
            round.reject -= 1;
        }
    }
    case
}

fn check_architecture(fixture: &str, kv: Option<KvQuantization>) {
    check_cases(fixture, kv, |case| case)
}

fn check_cases(fixture: &str, kv: Option<KvQuantization>, adapt: fn(Case) -> Case) {
    mlx::jit::isolate_per_test_slot();
    let bundle = ModelBundle::load(&model_dir(fixture)).unwrap();
    let model = bundle.model.as_ref();
    let device = mlx::Device::best_available();
    let tolerance = (device != mlx::Device::Cpu).then(|| gpu_tolerance(&bundle, device.name()));
    let config = Config {
        cases: proptest_cases(32, 1000),
        source_file: Some(file!()),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let rolled_back = std::cell::Cell::new(0);
    runner
        .run(&cases(1024).prop_map(adapt), |case| {
            let (spec, n) = speculative(model, kv, &case);
            rolled_back.set(rolled_back.get() + n);
            let differs = agree(&spec, &fresh(model, kv, &case), tolerance).err();
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
fn qwen3_moe_rollback_equals_a_fresh_run() {
    check_architecture("qwen3_moe", None);
}

#[test]
fn qwen3_5_moe_rollback_equals_a_fresh_run() {
    check_architecture("qwen3_5_moe", None);
}

#[test]
fn glm4_moe_rollback_equals_a_fresh_run() {
    check_architecture("glm4_moe", None);
}

/// The latent KV cache (latent and RoPE part as one KV head of different widths) trimmed.
#[test]
fn glm4_moe_lite_rollback_equals_a_fresh_run() {
    check_cases("glm4_moe_lite", None, keeping_no_lone_token);
}

#[test]
fn glm4_moe_lite_4bit_rollback_equals_a_fresh_run() {
    check_cases("glm4_moe_lite-4bit", None, keeping_no_lone_token);
}

/// KV-shared layers: the rollback trims only the owning layers' caches (mlx-lm's make_cache),
/// and the shared layers read whatever their owners then hold.
#[test]
fn gemma4_rollback_equals_a_fresh_run() {
    check_architecture("gemma4", None);
}

#[test]
fn gemma4_moe_rollback_equals_a_fresh_run() {
    check_architecture("gemma4_moe", None);
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

/// The GPU tolerance is not so wide that it hides a broken rollback: on the CPU, a round whose
/// rejected tokens stay in the caches (as if the trim were skipped) must move the next logprobs
/// by more than the tolerance of every GPU backend, on every architecture.
#[test]
fn keeping_rejected_tokens_exceeds_the_gpu_tolerance() {
    support::on_cpu();
    let case = Case {
        prompt: vec![11, 12, 13, 14, 15, 16, 17, 18],
        rounds: vec![Round {
            tokens: vec![21, 22, 23, 24],
            reject: 3,
        }],
        next: 31,
    };
    for fixture in [
        "llama",
        "qwen3",
        "gemma3",
        "qwen3_next",
        "qwen3_5",
        "gemma4",
    ] {
        let bundle = ModelBundle::load(&model_dir(fixture)).unwrap();
        let model = bundle.model.as_ref();
        let mut caches = make_caches(model, None);
        forward(model, &mut caches, &case.prompt);
        begin_round(&mut caches);
        forward(model, &mut caches, &case.rounds[0].tokens);
        end_round(&mut caches, 0).unwrap();
        let stale = forward(model, &mut caches, &[case.next]);
        let worst = worst_difference(&stale, &fresh(model, None, &case));
        for backend in ["cuda", "metal"] {
            let limit = gpu_tolerance(&bundle, backend);
            assert!(
                worst > limit,
                "{fixture}: three stale tokens in the caches move logprobs by only {worst:e}, \
                 within the {backend} rollback tolerance {limit:e}"
            );
        }
    }
}
