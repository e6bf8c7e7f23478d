//! The DFlash block drafter through the DraftSource seam: tier C (speculative ≡ plain, tokens
//! and logprob bits) on every fixture architecture it pairs with, the prompt rows it starts
//! from, its drafts against mlx-vlm's round by round, and the pairing check. The mlx-vlm DFlash
//! goldens are replayed by tests/goldens.rs.

mod support;

use support::{bits, bundle, golden_input, model_dir, plain_steps, speculative_steps};
use verity::generate::{token_array, Control, Generation};
use verity::model::dflash::DflashModel;
use verity::parity::acceptance::acceptance;
use verity::sample::KeySchedule;
use verity::speculative::{
    generate_speculative, DflashDrafter, DraftContext, DraftSource, PrefillMode, SpeculationStats,
    Verified,
};
use verity_harness::acceptance::{Baseline, Suite};

fn drafter(name: &str) -> DflashModel {
    if name == "two-layer" {
        return two_layer_drafter();
    }
    DflashModel::load(&model_dir(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// What a pair's runs must show besides equality with plain decoding.
#[derive(Clone, Copy)]
enum Expect {
    /// Drafts, and some accepted (a drafter trained on this target's own output).
    Accepted,
    /// Drafts (a drafter of the right width, untrained for this target or for a random one;
    /// on gemma3 past its window too, whose verify writes the rotating caches a token at a time).
    Drafted,
}

/// Each fixture with a drafter of its width: the one trained for it, or qwen3-target's
/// (tapping layers 1 and 3; "two-layer" is a copy tapping layers 0 and 1 instead).
const PAIRS: [(&str, &str, Expect); 6] = [
    ("qwen3-target", "qwen3-target-dflash", Expect::Accepted),
    ("gemma3", "qwen3-target-dflash", Expect::Drafted),
    ("qwen3_next", "qwen3-target-dflash", Expect::Drafted),
    ("qwen3_5", "qwen3_5-dflash", Expect::Drafted),
    ("qwen3", "two-layer", Expect::Drafted),
    ("llama", "two-layer", Expect::Drafted),
];

/// qwen3-target's drafter re-tapped at layers 0 and 1, for the two-layer fixtures.
fn two_layer_drafter() -> DflashModel {
    let src = model_dir("qwen3-target-dflash");
    let dir = std::env::temp_dir().join(format!("verity-dflash-two-layer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["dflash_config"]["target_layer_ids"] = serde_json::json!([0, 1]);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let model = DflashModel::load(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    model
}

#[test]
fn dflash_speculation_equals_plain_on_every_architecture_it_pairs_with() {
    support::on_cpu();
    for (name, drafter_name, expect) in PAIRS {
        let target = bundle(name);
        let model = drafter(drafter_name);
        for trace in ["greedy/code", "greedy/chat"] {
            let id = format!("{name}/{trace}");
            let (prompt, params) = golden_input(&id, 40);
            let want: Vec<(u32, Vec<u8>)> = plain_steps(target.model(), &prompt, &params);
            for k in [3, 7] {
                let mut source = DflashDrafter::new(target.model(), &model).unwrap();
                let (got, stats) =
                    speculative_steps(target.model(), &mut source, &prompt, &params, k);
                assert!(
                    got == want,
                    "{id} k={k}: DFlash speculation differs from plain"
                );
                check_stats(&id, k, &stats, expect);
            }
        }
    }
}

/// Seeded sampling with positioned keys (temperature alone, and with top-p and top-k): each
/// draft is drawn with the key of the position it proposes and the target draws every position
/// with its own key, so DFlash speculation samples plain decoding's tokens, logprob bits
/// included, while the trained drafter has drafts both accepted and rejected.
#[test]
fn sampled_dflash_speculation_with_positioned_keys_equals_plain() {
    support::on_cpu();
    let target = bundle("qwen3-target");
    let model = drafter("qwen3-target-dflash");
    let (prompt, mut params) = golden_input("qwen3-target/temp08/code", 48);
    assert!(params.sampler.temp > 0.0 && params.seed.is_some());
    params.keys = KeySchedule::Positioned;
    let mut filtered = params.clone();
    filtered.sampler.top_p = 0.9;
    filtered.sampler.top_k = 40;
    for (what, params) in [("temperature", params), ("top-p and top-k", filtered)] {
        let want: Vec<(u32, Vec<u8>)> = plain_steps(target.model(), &prompt, &params);
        for k in [3, 7] {
            let mut source = DflashDrafter::new(target.model(), &model).unwrap();
            let (got, stats) = speculative_steps(target.model(), &mut source, &prompt, &params, k);
            assert!(
                got == want,
                "{what} k={k}: sampled DFlash differs from plain"
            );
            check_stats(what, k, &stats, Expect::Accepted);
        }
    }
}

fn check_stats(id: &str, k: usize, stats: &SpeculationStats, expect: Expect) {
    assert!(
        stats.rounds > 0 && stats.drafted > 0,
        "{id} k={k}: {stats:?}"
    );
    assert_eq!(stats.refused_rounds, 0, "{id} k={k}: {stats:?}");
    // One block per round, never past the ceiling.
    assert!(stats.drafted <= stats.rounds * k, "{id} k={k}: {stats:?}");
    if let Expect::Accepted = expect {
        assert!(
            stats.from_draft > 0 && stats.partial_rollbacks > 0,
            "{id} k={k}: the trained drafter had nothing accepted, or everything: {stats:?}"
        );
    }
}

/// The DFlash drafter recording the context its prefill is given.
struct PrefillSpy<'m> {
    inner: DflashDrafter<'m>,
    context: Vec<Vec<u8>>,
    last: Option<u32>,
}

impl DraftSource for PrefillSpy<'_> {
    fn taps(&self) -> Vec<usize> {
        self.inner.taps()
    }

    fn prefill_mode(&self) -> PrefillMode {
        self.inner.prefill_mode()
    }

    fn prefill(&mut self, prompt: &[u32], ctx: &mut DraftContext<'_>) -> verity::Result<()> {
        self.context = ctx.anchor.iter().map(bits).collect();
        self.last = Some(ctx.last);
        self.inner.prefill(prompt, ctx)
    }

    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> verity::Result<Vec<u32>> {
        self.inner.draft(n, ctx)
    }

    fn commit(&mut self, round: &Verified<'_>) -> verity::Result<()> {
        self.inner.commit(round)
    }
}

#[test]
fn the_drafter_starts_from_the_taps_over_every_prompt_row() {
    support::on_cpu();
    for (name, drafter_name, id) in [
        (
            "qwen3-target",
            "qwen3-target-dflash",
            "qwen3-target/chunked-prefill/long",
        ),
        ("qwen3_5", "qwen3_5-dflash", "qwen3_5/vlm-plain/long"),
    ] {
        let target = bundle(name);
        let model = drafter(drafter_name);
        // A prompt longer than the prefill step, so the target takes it in several chunks.
        let (prompt, mut params) = golden_input(id, 4);
        params.prefill_step_size = 16;
        assert!(prompt.len() > 2 * params.prefill_step_size);
        let mut spy = PrefillSpy {
            inner: DflashDrafter::new(target.model(), &model).unwrap(),
            context: Vec::new(),
            last: None,
        };
        let mut first = None;
        generate_speculative(
            target.model(),
            &mut spy,
            &prompt,
            &params,
            3,
            None,
            &mut |t| {
                first.get_or_insert(t.token);
                Control::Continue
            },
        )
        .unwrap();
        assert_eq!(spy.last, first, "{name}: the prefill's last token");
        let ids = token_array(&prompt).unwrap().expand_dims(&[0]).unwrap();
        let taps = spy.taps();
        let whole = target
            .model()
            .forward(&ids, &mut target.model().make_cache(None), &taps)
            .unwrap();
        let want: Vec<Vec<u8>> = whole.hidden.iter().map(bits).collect();
        assert_eq!(want.len(), 2);
        assert!(
            spy.context == want,
            "{name}: the drafter's context is not one forward's taps over the whole prompt"
        );
    }
}

#[test]
fn dflash_drafts_equal_mlx_vlm_round_by_round() {
    support::on_cpu();
    let target = bundle("qwen3_5");
    let model = drafter("qwen3_5-dflash");
    let (mut traces, mut rounds, mut sizes) = (0, 0, std::collections::BTreeSet::new());
    for block in [4, 8] {
        for prompt in ["code", "chat", "chat-sort", "unicode", "long"] {
            let id = format!("qwen3_5/vlm-dflash{block}/{prompt}");
            let source = DflashDrafter::new(target.model(), &model).unwrap();
            let want = support::drafts_equal_mlx_vlm(&target, &id, "dflash_drafts", source, block);
            traces += 1;
            rounds += want.len();
            sizes.extend(want.iter().map(Vec::len));
        }
    }
    assert_eq!(traces, 10);
    assert!(rounds > 100, "{rounds} rounds");
    // The adaptive block size was exercised: more than one block size was drafted.
    assert!(sizes.len() > 1, "block sizes seen: {sizes:?}");
}

/// Sampled with positioned keys (temperature 0.8 seed 11; temperature 1.0 with top-p 0.9 seed
/// 3; a multi-turn chat), and on qwen3_5-4bit, a target without an MTP head (greedy and
/// sampled): mlx-vlm draws each draft from the drafter's logits with the key of the position it
/// proposes, so even this random-weight drafter has drafts accepted; verity's drafts and
/// acceptance equal its in every round.
#[test]
fn sampled_dflash_drafts_equal_mlx_vlm_round_by_round() {
    support::on_cpu();
    let model = drafter("qwen3_5-dflash");
    let mut cases: Vec<(&str, String, usize)> = [
        ("qwen3_5", "vlm-dflash4-seed11", 4),
        ("qwen3_5", "vlm-dflash8-seed11", 8),
        ("qwen3_5", "vlm-dflash4-seed3-topp0.9", 4),
        ("qwen3_5-4bit", "vlm-dflash4", 4),
        ("qwen3_5-4bit", "vlm-dflash4-seed11", 4),
        ("qwen3_5-4bit", "vlm-dflash8-seed11", 8),
    ]
    .into_iter()
    .flat_map(|(name, variant, block)| {
        ["code", "chat"].map(|prompt| (name, format!("{name}/{variant}/{prompt}"), block))
    })
    .collect();
    cases.push(("qwen3_5", "qwen3_5/vlm-dflash4-seed11/multi-turn".into(), 4));
    let targets = ["qwen3_5", "qwen3_5-4bit"].map(|name| (name, bundle(name)));
    let (mut traces, mut rounds, mut accepted) = (0, 0, 0);
    for (name, id, block) in cases {
        let (_, target) = targets.iter().find(|(t, _)| *t == name).unwrap();
        let source = DflashDrafter::new(target.model(), &model).unwrap();
        let want = support::drafts_equal_mlx_vlm(target, &id, "dflash_drafts", source, block);
        traces += 1;
        rounds += want.len();
        let trace = support::golden(&id);
        accepted += trace.steps.iter().filter(|s| s.from_draft).count();
    }
    assert_eq!(traces, 13);
    assert!(rounds > 100, "{rounds} rounds");
    assert!(accepted > 100, "only {accepted} accepted drafts");
}

#[test]
fn a_dflash_drafter_is_checked_against_its_target() {
    support::on_cpu();
    let model = drafter("qwen3-target-dflash");
    for (name, needle) in [
        ("qwen3", "target_layer_ids"),
        ("llama", "target_layer_ids"),
        ("qwen3-draft", "hidden_size"),
    ] {
        let target = bundle(name);
        let err = DflashDrafter::new(target.model(), &model)
            .err()
            .unwrap_or_else(|| panic!("{name}: paired"))
            .to_string();
        assert!(err.contains(needle), "{name}: {err}");
    }
}

/// The block-vs-chain probe: the trained drafter run as a block (one pass per round) and as a
/// chain (one pass per draft) over the `dflash` and `dflash-chain` suites. Both emit plain
/// decoding's tokens, and each measures exactly its committed baseline, which docs/speculative.md's
/// comparison quotes.
#[test]
fn the_block_vs_chain_probe_measures_both_ways() {
    support::on_cpu();
    let root = support::root();
    let mut models = verity::parity::Models::new(root);
    for name in ["dflash", "dflash-chain"] {
        let path = root.join(format!("golden/accept/{name}.toml"));
        let suite = Suite::load(&path).unwrap();
        let baseline = Baseline::load_for(&Suite::baseline_path(&path), &path, &suite).unwrap();
        let measured = verity::parity::acceptance::run_suite(&suite, &mut models).unwrap();
        for (k, stats) in &measured {
            assert_eq!(
                acceptance(stats),
                baseline.acceptance[k],
                "{name} k={k}: acceptance differs from the committed baseline"
            );
        }
    }
    let target = bundle("qwen3-target");
    let model = drafter("qwen3-target-dflash");
    let (prompt, params) = golden_input("qwen3-target/greedy/chat", 40);
    let want: Vec<u32> = Generation::new(target.model(), &prompt, &params)
        .unwrap()
        .map(|s| s.unwrap().token)
        .collect();
    let mut chain = DflashDrafter::chained(target.model(), &model).unwrap();
    let mut got = Vec::new();
    let (stats, _) = generate_speculative(
        target.model(),
        &mut chain,
        &prompt,
        &params,
        3,
        None,
        &mut |t| {
            got.push(t.token);
            Control::Continue
        },
    )
    .unwrap();
    assert_eq!(got, want, "the chained drafter changed the output");
    assert!(stats.from_draft > 0, "{stats:?}");
}
