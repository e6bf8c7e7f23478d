//! Speculative decoding where the oracle has no answer or a wrong one (tier C: verity's
//! speculative output ≡ its own plain output, tokens and logprob bits), and the executor's
//! invariants. The tier A speculative goldens are replayed by tests/goldens.rs.
//!
//! The invariants run on the invariant device: the GPU under the nextest `gpu` profile, where
//! they hold through the lone-row kernels, else the CPU. Those that run the oracle's kernels
//! or resume a prefix cache (whose prefill is a multi-row forward) pin the CPU, where a
//! prefill's bits are a decode's.

mod support;

use support::{bundle, golden_input};
use verity::bundle::ModelBundle;
use verity::cache::LayerCache;
use verity::decode::{decode, Hooks, Request, Start};
use verity::generate::{
    Control, FinishReason, GenerateParams, GeneratedToken, Generation, OnPrefilled,
};
use verity::model::lone_rows;
use verity::sample::KeySchedule;
use verity::speculative::{
    generate_speculative, DraftModel, DraftPrefix, DraftSource, Drafter, DrafterSpec, NgramLookup,
    SpeculationStats,
};

/// The trained target and its draft, on the invariant device (the GPU under the `gpu`
/// profile), with this test's MLX JIT cache isolated first.
fn trained_pair() -> (ModelBundle, ModelBundle) {
    support::on_invariant_device();
    (bundle("qwen3-target"), bundle("qwen3-draft"))
}

/// (token, logprob bits, finish) of each step.
type Steps = Vec<(u32, Vec<u8>, Option<FinishReason>)>;

fn plain(target: &ModelBundle, prompt: &[u32], params: &GenerateParams) -> Steps {
    Generation::new(target.model(), prompt, params)
        .unwrap()
        .map(|s| {
            let s = s.unwrap();
            (s.token, s.logprobs.to_bytes().unwrap(), s.finish)
        })
        .collect()
}

fn speculative(
    target: &ModelBundle,
    source: &mut dyn DraftSource,
    prompt: &[u32],
    params: &GenerateParams,
    k: usize,
    halt_after: Option<usize>,
) -> (Steps, SpeculationStats) {
    let mut steps = Vec::new();
    let mut on_token = |s: &GeneratedToken| {
        steps.push((s.token, s.logprobs.to_bytes().unwrap(), s.finish));
        if halt_after == Some(steps.len()) {
            Control::Stop
        } else {
            Control::Continue
        }
    };
    let (stats, _) = generate_speculative(
        target.model(),
        source,
        prompt,
        params,
        k,
        None,
        &mut on_token,
    )
    .unwrap();
    (steps, stats)
}

/// A fresh draft model source and a fresh n-gram source, in that order.
fn both_sources(draft: &ModelBundle) -> [Box<dyn DraftSource + '_>; 2] {
    [
        Box::new(DraftModel::new(draft.model())),
        Box::new(NgramLookup::new(1, 3).unwrap()),
    ]
}

/// Rounds rolled back and rounds refused, summed over runs.
#[derive(Debug, Default)]
struct Rollbacks {
    partial: usize,
    refused: usize,
}

/// Speculative ≡ plain with both sources over the first `prompt_len` tokens of a golden
/// prompt, on the device the caller pinned; returns how many rounds were rolled back and
/// refused.
fn spec_equals_plain(target_name: &str, trace: &str, prompt_len: usize) -> Rollbacks {
    let target = bundle(target_name);
    let draft = bundle("llama-draft");
    let (mut prompt, params) = golden_input(trace, 48);
    prompt.truncate(prompt_len);
    let want = plain(&target, &prompt, &params);
    let mut total = Rollbacks::default();
    for k in [2, 4] {
        for mut source in both_sources(&draft) {
            let (got, stats) = speculative(&target, source.as_mut(), &prompt, &params, k, None);
            assert!(
                got == want,
                "{target_name} {trace} k={k}: speculative output differs from plain"
            );
            assert_eq!(stats.generated, want.len());
            total.partial += stats.partial_rollbacks;
            total.refused += stats.refused_rounds;
        }
    }
    total
}

/// 6 prompt tokens and 48 generated: rounds run inside the window of 16 and past it, where the
/// verify writes the rotating caches one token at a time and a rejected tail is restored.
#[test]
fn gemma3_speculates_past_its_window_with_exact_rollbacks() {
    support::on_invariant_device();
    let r = spec_equals_plain("gemma3", "gemma3/greedy/code", 6);
    assert!(r.partial > 0, "no round was rolled back: {r:?}");
    assert_eq!(r.refused, 0, "a round was refused: {r:?}");
}

/// gemma4's sliding owners as gemma3's; its KV-shared layers read what their owners' one-token
/// steps read.
#[test]
fn gemma4_speculates_past_its_window_with_exact_rollbacks() {
    support::on_invariant_device();
    let r = spec_equals_plain("gemma4", "gemma4/greedy/code", 6);
    assert!(r.partial > 0, "no round was rolled back: {r:?}");
    assert_eq!(r.refused, 0, "a round was refused: {r:?}");
}

/// Under the oracle's kernels (golden replay; `--batched-kernels` alike) a verify is one
/// multi-token forward, as mlx-lm's, which a window past its size cannot take back: those
/// rounds are refused, and the output is still plain decoding's on the CPU (on a GPU those
/// kernels change a verified row's bits).
#[test]
fn gemma3_under_the_oracle_kernels_refuses_the_rounds_past_its_window() {
    support::on_cpu();
    let r = lone_rows::oracle_kernels(|| spec_equals_plain("gemma3", "gemma3/greedy/code", 6));
    assert!(r.partial > 0, "no round was rolled back: {r:?}");
    assert!(r.refused > 0, "no round was refused past the window: {r:?}");
}

#[test]
fn qwen3_next_speculation_equals_plain_with_real_rollbacks() {
    support::on_invariant_device();
    let r = spec_equals_plain("qwen3_next", "qwen3_next/greedy/code", usize::MAX);
    assert!(r.partial > 0, "no partial rollback happened: {r:?}");
    assert_eq!(r.refused, 0);
}

#[test]
fn qwen3_5_speculation_equals_plain_with_real_rollbacks() {
    support::on_invariant_device();
    let r = spec_equals_plain("qwen3_5", "qwen3_5/greedy/chat", usize::MAX);
    assert!(r.partial > 0, "no partial rollback happened: {r:?}");
    assert_eq!(r.refused, 0);
}

/// The mixture-of-experts families under both sources (mlx-lm's goldens cover only a draft
/// model on qwen3_moe and glm4_moe; it refuses the hybrid qwen3_5_moe, whose recurrent layers
/// roll back through snapshots here), and gemma4_moe inside its window.
#[test]
fn mixture_of_experts_speculation_equals_plain_with_both_sources() {
    support::on_invariant_device();
    for (family, trace, prompt_len) in [
        ("qwen3_moe", "qwen3_moe/greedy/code", usize::MAX),
        ("qwen3_5_moe", "qwen3_5_moe/greedy/chat", usize::MAX),
        ("glm4_moe", "glm4_moe/greedy/code", usize::MAX),
        ("gemma4_moe", "gemma4_moe/greedy/code", 6),
    ] {
        let r = spec_equals_plain(family, trace, prompt_len);
        assert!(
            r.partial > 0,
            "{family}: no partial rollback happened: {r:?}"
        );
    }
}

#[test]
fn greedy_speculation_with_logits_processors_equals_plain() {
    // mlx-lm hides the prompt from the processors when speculating (known-oracle-bugs.toml);
    // verity gives them plain decoding's history, so output does not change. (Seeded sampling
    // draws its random keys differently when speculating, in mlx-lm and here, so it is
    // compared greedy.)
    let (target, draft) = trained_pair();
    let (prompt, mut params) = golden_input("qwen3-target/all-processors/code", 48);
    params.sampler.temp = 0.0;
    let mut source = DraftModel::new(draft.model());
    let (got, stats) = speculative(&target, &mut source, &prompt, &params, 3, None);
    assert!(
        got == plain(&target, &prompt, &params),
        "speculation with processors differs from plain"
    );
    assert!(
        stats.accepted > 0 && stats.partial_rollbacks > 0,
        "{stats:?}"
    );
}

#[test]
fn positioned_keys_make_sampled_speculation_equal_plain() {
    // A key sequence (mlx-lm) draws differently when speculating; positioned keys (mlx-vlm:
    // one key per generated position) do not, so sampled speculation ≡ plain under them.
    let (target, draft) = trained_pair();
    let (prompt, mut params) = golden_input("qwen3-target/temp08/code", 48);
    assert!(params.sampler.temp > 0.0 && params.seed.is_some());
    params.keys = KeySchedule::Positioned;
    let want = plain(&target, &prompt, &params);
    for k in [2, 4] {
        for (i, mut source) in both_sources(&draft).into_iter().enumerate() {
            let (got, stats) = speculative(&target, source.as_mut(), &prompt, &params, k, None);
            assert!(got == want, "k={k}: sampled speculation differs from plain");
            assert!(stats.drafted > 0, "k={k}: {stats:?}");
            // The trained draft model both hits and misses.
            let draft_model = i == 0;
            assert!(
                !draft_model || (stats.accepted > 0 && stats.partial_rollbacks > 0),
                "{stats:?}"
            );
        }
    }
    params.keys = KeySchedule::Sequence;
    let mut source = DraftModel::new(draft.model());
    let (got, _) = speculative(&target, &mut source, &prompt, &params, 4, None);
    assert!(
        got != plain(&target, &prompt, &params),
        "a key sequence drew the same tokens speculating: the test proves nothing"
    );
}

#[test]
fn self_drafting_accepts_everything_and_equals_plain() {
    support::on_invariant_device();
    let target = bundle("qwen3-target");
    let (prompt, params) = golden_input("qwen3-target/greedy/code", 40);
    let mut source = DraftModel::new(target.model());
    let (got, stats) = speculative(&target, &mut source, &prompt, &params, 4, None);
    assert!(got == plain(&target, &prompt, &params));
    assert_eq!(stats.accepted, stats.drafted, "{stats:?}");
    assert!(stats.drafted > 0);
}

#[test]
fn max_tokens_cuts_exactly_and_a_halt_emits_exactly_what_was_allowed() {
    let (target, draft) = trained_pair();
    let (prompt, params) = golden_input("qwen3-target/greedy/code", 40);
    let mut long_source = DraftModel::new(draft.model());
    let (long, _) = speculative(&target, &mut long_source, &prompt, &params, 4, None);
    let mut short_params = params.clone();
    short_params.max_tokens = 5;
    let mut source = DraftModel::new(draft.model());
    let (short, _) = speculative(&target, &mut source, &prompt, &short_params, 4, None);
    assert_eq!(short.len(), 5);
    let tokens = |s: &Steps| s.iter().map(|t| t.0).collect::<Vec<_>>();
    assert_eq!(tokens(&short), tokens(&long)[..5]);
    assert_eq!(short[4].2, Some(FinishReason::Length));

    let mut source = DraftModel::new(draft.model());
    let (halted, _) = speculative(&target, &mut source, &prompt, &params, 4, Some(7));
    assert_eq!(halted.len(), 7, "a halt after 7 tokens must emit exactly 7");
    assert_eq!(tokens(&halted), tokens(&long)[..7]);
}

#[test]
fn identical_reruns_give_identical_statistics() {
    let (target, draft) = trained_pair();
    let (prompt, mut params) = golden_input("qwen3-target/greedy/chat", 40);
    params.sampler.temp = 0.8;
    params.seed = Some(5);
    let run = || {
        let mut source = DraftModel::new(draft.model());
        speculative(&target, &mut source, &prompt, &params, 3, None)
    };
    let (a, sa) = run();
    let (b, sb) = run();
    assert!(a == b);
    assert_eq!(sa, sb);
    assert!(sa.rounds > 0);
}

/// Every kind of drafter the registry knows, named by its spec, loaded and paired once, and run
/// through the one decode entry point with its default drafts per round, emits plain
/// decoding's tokens and logprob bits. qwen3_5 carries an MTP head and has a DFlash drafter,
/// and drafts for itself as a draft model.
#[test]
fn every_registered_drafter_decodes_as_plain_through_the_front_door() {
    support::on_invariant_device();
    let target = bundle("qwen3_5");
    let (prompt, params) = golden_input("qwen3_5/greedy/code", 12);
    let (want, none) = front_door(
        &target,
        None,
        &prompt,
        &params,
        Start::Fresh,
        &mut |_, _| {},
    );
    assert!(none.is_none(), "plain decoding reports no speculation");
    assert_eq!(plain(&target, &prompt, &params), want);
    for (spec, default_k) in registered() {
        let drafter = Drafter::load(&spec, &target).unwrap();
        assert_eq!(drafter.default_num_draft_tokens(), default_k, "{spec:?}");
        let (got, stats) = front_door(
            &target,
            Some(&drafter),
            &prompt,
            &params,
            Start::Fresh,
            &mut |_, _| {},
        );
        assert_eq!(got, want, "{spec:?}");
        let stats = stats.expect("a drafter reports its speculation");
        assert_eq!(stats.generated, want.len(), "{spec:?}");
        assert!(stats.rounds > 0, "{spec:?}");
    }
}

#[test]
fn every_registered_drafter_resumes_a_prefix_as_a_fresh_decode_would() {
    // What a prefix cache keeps after a prompt's prefill (the target's caches and the draft
    // side's state: a draft model's caches, a DFlash drafter's taps over the prompt), restored
    // under a longer prompt, decodes what that prompt decodes from nothing.
    support::on_cpu();
    let target = bundle("qwen3_5");
    let (prompt, params) = golden_input("qwen3_5/greedy/code", 8);
    for (spec, _) in registered() {
        let drafter = Drafter::load(&spec, &target).unwrap();
        let run = |prompt: &[u32], start, keep: OnPrefilled<'_>| {
            front_door(&target, Some(&drafter), prompt, &params, start, keep).0
        };
        let mut kept = None;
        let first = run(&prompt, Start::Fresh, &mut |caches, draft| {
            kept = Some((caches.to_vec(), draft.cloned()));
        });
        let (caches, draft): (Vec<LayerCache>, Option<DraftPrefix>) =
            kept.expect("the prefill was seen");
        let keeps_state = matches!(spec, DrafterSpec::Model(_) | DrafterSpec::Dflash { .. });
        assert_eq!(draft.is_some(), keeps_state, "{spec:?}");
        let longer: Vec<u32> = prompt
            .iter()
            .chain(first.iter().map(|s| &s.0))
            .copied()
            .collect();
        let start = Start::Prefix {
            caches,
            draft,
            cached: prompt.len() - 1,
        };
        assert_eq!(
            run(&longer, start, &mut |_, _| {}),
            run(&longer, Start::Fresh, &mut |_, _| {}),
            "{spec:?}"
        );
    }
}

/// Every kind of drafter on the qwen3_5 fixture, with its default drafts per round.
fn registered() -> [(DrafterSpec, usize); 4] {
    [
        (DrafterSpec::Model(support::model_dir("qwen3_5")), 3),
        (DrafterSpec::Ngram { min: 1, max: 3 }, 3),
        (DrafterSpec::Mtp { dir: None }, 3),
        (
            DrafterSpec::Dflash {
                dir: support::model_dir("qwen3_5-dflash"),
                chain: false,
            },
            7, // its block_size (config.json) less the verified token
        ),
    ]
}

/// A request through [`decode`], the one entry point: its steps and speculation counters.
fn front_door(
    target: &ModelBundle,
    drafter: Option<&Drafter>,
    prompt: &[u32],
    params: &GenerateParams,
    start: Start,
    on_prefilled: OnPrefilled<'_>,
) -> (Steps, Option<SpeculationStats>) {
    let mut steps = Vec::new();
    let mut on_token = |s: &GeneratedToken| {
        steps.push((s.token, s.logprobs.to_bytes().unwrap(), s.finish));
        Control::Continue
    };
    let request = Request {
        prompt,
        params,
        constraint: None,
        num_draft_tokens: None,
    };
    let hooks = Hooks {
        on_token: &mut on_token,
        on_chunk: None,
        on_prefilled: Some(on_prefilled),
    };
    let out = decode(target.model(), drafter, start, request, hooks).unwrap();
    (steps, out.speculation)
}

/// glm4_moe_lite's one-token step takes MLA's absorbed path and a multi-token forward the
/// latent-expanding one. mlx-lm verifies drafts through the latter (its draft-model traces
/// replay at tier A through [`lone_rows::oracle_kernels`]), so there speculation is not plain
/// decoding to the bit: on two golden prompts it emits plain's tokens with logprobs within
/// 1e-5, and some bits differ. verity's verify takes each token as its one-token step, so with
/// a draft model and with n-gram lookup speculation equals plain decoding bit for bit.
#[test]
fn glm4_moe_lite_speculation_equals_plain_where_mlx_lms_verify_path_does_not() {
    support::on_cpu();
    let target = bundle("glm4_moe_lite");
    let draft = bundle("glm4_moe_lite-4bit");
    let (mut bit_differences, mut accepted) = (0, [0; 2]);
    for trace in ["glm4_moe_lite/greedy/code", "glm4_moe_lite/greedy/chat"] {
        let (prompt, params) = golden_input(trace, 48);
        let want = plain(&target, &prompt, &params);
        let mut sources = both_sources(&draft);
        for (i, source) in sources.iter_mut().enumerate() {
            let (got, stats) = speculative(&target, source.as_mut(), &prompt, &params, 3, None);
            assert!(got == want, "{trace}: speculation changed the output");
            accepted[i] += stats.accepted;
        }
        let mut source = DraftModel::new(draft.model());
        let (oracle, _) = lone_rows::oracle_kernels(|| {
            speculative(&target, &mut source, &prompt, &params, 3, None)
        });
        let tokens = |s: &Steps| s.iter().map(|t| (t.0, t.2)).collect::<Vec<_>>();
        assert_eq!(tokens(&oracle), tokens(&want), "{trace}: mlx-lm's path");
        for (g, w) in oracle.iter().zip(&want) {
            let (g, w) = (floats(&g.1), floats(&w.1));
            let worst = g
                .iter()
                .zip(&w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(
                worst <= 1e-5,
                "{trace}: mlx-lm's path is {worst:e} from plain"
            );
            bit_differences += usize::from(g != w);
        }
    }
    assert!(
        bit_differences > 0,
        "mlx-lm's verify path gave plain's bits at every step: the paths are not both taken"
    );
    assert!(
        accepted.iter().all(|&a| a > 0),
        "accepted drafts per source: {accepted:?}"
    );
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}
