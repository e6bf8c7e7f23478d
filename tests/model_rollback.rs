//! The rollback contract on real models, for every fixture architecture: feed a round of
//! tokens, take back its tail, continue — the next logits must be bit-identical to a fresh run
//! that only ever saw the kept tokens. On a GPU, whose kernels round differently for a different
//! number of tokens per call (the round fed more than the fresh run), they must agree within the
//! cross-backend step tolerance of the fixture's class instead (golden/tolerances.toml: the
//! same kind of rounding); a wrong rollback (a stale cache entry) moves them by more, which
//! `keeping_rejected_tokens_exceeds_the_gpu_tolerance` checks. Rounds a cache refuses (a
//! sliding window about to wrap) are fed without speculation, and at least one round per
//! architecture is really taken back. Written as a decode forward writes them (one token at a
//! time into a rotating cache), rounds past a sliding window are taken back too, and the next
//! logits equal those of one-token steps over the kept tokens, bit for bit.

mod support;

use mlx::Array;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use support::{model_dir, proptest_cases};
use verity::bundle::ModelBundle;
use verity::cache::{
    begin_round, end_round, quantize_due, rollback_plan, KvQuantization, LayerCache, Rollback,
};
use verity::model::{lone_rows, LanguageModel};
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

/// How a case's caches are made and its rounds written.
#[derive(Clone, Copy)]
struct Setup {
    /// Quantized KV caches from the start.
    kv: Option<KvQuantization>,
    /// mlx-lm's max_kv_size (rotating caches keeping 4 tokens, for a family without its own).
    max_kv_size: Option<usize>,
    /// Each round as a decode forward on the lone-row path writes it
    /// (`lone_rows::decode_rows`: a rotating cache takes its tokens one at a time), the fresh
    /// run feeding each kept token as a one-token step; else in one multi-token forward, as
    /// the fresh run feeds the kept tokens.
    one_at_a_time: bool,
}

const PLAIN: Setup = Setup {
    kv: None,
    max_kv_size: None,
    one_at_a_time: false,
};

fn cases(vocab: u32, prompt_lens: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Case> {
    let round =
        (prop::collection::vec(0..vocab, 1..=5), 0usize..=5).prop_map(|(tokens, r)| Round {
            reject: r.min(tokens.len()),
            tokens,
        });
    (
        prop::collection::vec(0..vocab, prompt_lens),
        prop::collection::vec(round, 1..=3),
        0..vocab,
    )
        .prop_map(|(prompt, rounds, next)| Case {
            prompt,
            rounds,
            next,
        })
}

/// The model's caches, converted to quantized KV caches from the start when `setup.kv` is set.
fn make_caches(model: &dyn LanguageModel, setup: Setup) -> Vec<LayerCache> {
    let mut caches = model.make_cache(setup.max_kv_size);
    quantize_due(&mut caches, setup.kv.as_ref()).unwrap();
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
/// really rolled back (rather than refused), and of those, how many past a sliding window.
fn speculative(model: &dyn LanguageModel, setup: Setup, case: &Case) -> (Vec<f32>, usize, usize) {
    let mut caches = make_caches(model, setup);
    forward(model, &mut caches, &case.prompt);
    let (mut rolled_back, mut restored) = (0, 0);
    for round in &case.rounds {
        let kept = &round.tokens[..round.tokens.len() - round.reject];
        match rollback_plan(&caches, round.tokens.len(), setup.one_at_a_time) {
            Rollback::Refuse(_) => feed_kept(model, setup, &mut caches, kept),
            plan => {
                begin_round(&mut caches);
                if setup.one_at_a_time {
                    lone_rows::decode_rows(|| forward(model, &mut caches, &round.tokens));
                } else {
                    forward(model, &mut caches, &round.tokens);
                }
                end_round(&mut caches, round.reject).unwrap();
                rolled_back += usize::from(round.reject > 0);
                restored += usize::from(round.reject > 0 && plan == Rollback::Restore);
            }
        }
    }
    let next = forward(model, &mut caches, &[case.next]);
    (next, rolled_back, restored)
}

/// Feeds a round's kept tokens as a fresh run does: in one call, or one token a call.
fn feed_kept(model: &dyn LanguageModel, setup: Setup, caches: &mut [LayerCache], kept: &[u32]) {
    if setup.one_at_a_time {
        kept.iter().for_each(|&t| {
            forward(model, caches, &[t]);
        });
    } else if !kept.is_empty() {
        forward(model, caches, kept);
    }
}

/// The same case with only the kept tokens ever fed.
fn fresh(model: &dyn LanguageModel, setup: Setup, case: &Case) -> Vec<f32> {
    let mut caches = make_caches(model, setup);
    forward(model, &mut caches, &case.prompt);
    for round in &case.rounds {
        feed_kept(
            model,
            setup,
            &mut caches,
            &round.tokens[..round.tokens.len() - round.reject],
        );
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
    check_cases(fixture, Setup { kv, ..PLAIN }, 1..=10, |case| case);
}

/// Rounds written one token at a time into the rotating caches from prompts that fill
/// `fixture`'s window of 16 (or `max_kv_size`): every round past the window is taken back
/// (none refused), at least one with rejected tokens.
fn check_past_the_window(fixture: &str, max_kv_size: Option<usize>) {
    let setup = Setup {
        max_kv_size,
        one_at_a_time: true,
        ..PLAIN
    };
    let restored = check_cases(fixture, setup, 12..=24, |case| case);
    assert!(
        restored > 0,
        "{fixture}: no round past the window was taken back; the property tested nothing"
    );
}

/// Checks the property over `fixture`'s cases (`prompt_lens` prompt tokens, `adapt`ed);
/// returns how many rounds past a sliding window were taken back.
fn check_cases(
    fixture: &str,
    setup: Setup,
    prompt_lens: std::ops::RangeInclusive<usize>,
    adapt: fn(Case) -> Case,
) -> usize {
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
    let (rolled_back, restored) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    runner
        .run(&cases(1024, prompt_lens).prop_map(adapt), |case| {
            let (spec, n, past) = speculative(model, setup, &case);
            rolled_back.set(rolled_back.get() + n);
            restored.set(restored.get() + past);
            let differs = agree(&spec, &fresh(model, setup, &case), tolerance).err();
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
    restored.get()
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
    check_cases("glm4_moe_lite", PLAIN, 1..=10, keeping_no_lone_token);
}

#[test]
fn glm4_moe_lite_4bit_rollback_equals_a_fresh_run() {
    check_cases("glm4_moe_lite-4bit", PLAIN, 1..=10, keeping_no_lone_token);
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
fn gemma3_rounds_past_the_window_written_one_token_at_a_time_roll_back_exactly() {
    check_past_the_window("gemma3", None);
}

/// The KV-shared layers attend what each one-token step of their owner read.
#[test]
fn gemma4_rounds_past_the_window_written_one_token_at_a_time_roll_back_exactly() {
    check_past_the_window("gemma4", None);
}

/// max_kv_size's rotating caches, which keep their first 4 tokens.
#[test]
fn qwen3_rounds_past_max_kv_size_written_one_token_at_a_time_roll_back_exactly() {
    check_past_the_window("qwen3", Some(16));
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
        let mut caches = make_caches(model, PLAIN);
        forward(model, &mut caches, &case.prompt);
        begin_round(&mut caches);
        forward(model, &mut caches, &case.rounds[0].tokens);
        end_round(&mut caches, 0).unwrap();
        let stale = forward(model, &mut caches, &[case.next]);
        let worst = worst_difference(&stale, &fresh(model, PLAIN, &case));
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
