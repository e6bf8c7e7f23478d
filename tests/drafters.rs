//! Native drafters through the DraftSource seam: hidden-state taps against a plain forward,
//! the hidden rows the executor hands a source, the Qwen3.5 MTP head as a source (tier C:
//! speculative ≡ plain, with real rollbacks of the target and of the head's own cache), its
//! weights loaded alike from "pt"- and "mlx"-tagged checkpoints, and the pairing check. The
//! mlx-vlm MTP goldens are replayed by tests/goldens.rs.

mod support;

use std::collections::BTreeMap;

use mlx::Array;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use support::{bits, bundle, golden_input, model_dir, plain_steps, speculative_steps};
use verity::bundle::ModelBundle;
use verity::generate::{forward_tapped, prefill, token_array, Control, GenerateParams, Generation};
use verity::parity::acceptance::{acceptance, run_suite};
use verity::parity::Models;
use verity::speculative::{
    generate_speculative, DraftContext, DraftSource, MtpDrafter, PrefillMode, SpeculationStats,
    Verified,
};
use verity_harness::acceptance::Suite;

const ARCHITECTURES: [&str; 11] = [
    "llama",
    "qwen3",
    "gemma3",
    "qwen3_next",
    "qwen3_5",
    "qwen3_moe",
    "qwen3_5_moe",
    "glm4_moe",
    "glm4_moe_lite",
    "gemma4",
    "gemma4_moe",
];

#[test]
fn taps_are_the_plain_forward_bit_for_bit() {
    support::on_cpu();
    for name in ARCHITECTURES {
        let b = bundle(name);
        let model = b.model();
        let n = model.num_layers();
        let ids = token_array(&[5, 77, 301, 9, 12, 640, 3])
            .unwrap()
            .expand_dims(&[0])
            .unwrap();
        let plain = model
            .forward(&ids, &mut model.make_cache(None), &[])
            .unwrap();
        let taps: Vec<usize> = (0..=n).rev().collect();
        let tapped = model
            .forward(&ids, &mut model.make_cache(None), &taps)
            .unwrap();
        assert!(plain.hidden.is_empty());
        assert_eq!(tapped.hidden.len(), n + 1, "{name}: one state per tap");
        assert_eq!(
            bits(&plain.logits),
            bits(&tapped.logits),
            "{name}: tapping changed the logits"
        );
        // Taps come back in the order asked: the final state first, then layer n-1's output.
        let (last, final_state) = (&tapped.hidden[1], &tapped.hidden[0]);
        assert_eq!(
            bits(&model.outer().norm.forward(last).unwrap()),
            bits(final_state),
            "{name}: the final tap is not the last layer's output normed"
        );
        assert_eq!(
            bits(&model.outer().logits(final_state).unwrap()),
            bits(&plain.logits),
            "{name}: the output head over the final tap is not the forward's logits"
        );
        let width = model.outer().embed_tokens.width() as i32;
        assert_eq!(final_state.shape(), vec![1, 7, width]);
    }
}

/// A source that proposes the plain continuation (so every draft is accepted and the target's
/// caches only grow) and records what the seam hands it.
struct Recorder {
    script: Vec<u32>,
    at: usize,
    taps: Vec<usize>,
    prefill_anchor: Option<(u32, Vec<Vec<u8>>)>,
    rounds: Vec<Round>,
}

/// What a round handed the source, as bits per tap.
struct Round {
    anchor: Vec<Vec<u8>>,
    /// The verify input [last, drafts...].
    input: Vec<u32>,
    verified: Vec<Vec<u8>>,
}

impl DraftSource for Recorder {
    fn taps(&self) -> Vec<usize> {
        self.taps.clone()
    }

    fn prefill_mode(&self) -> PrefillMode {
        PrefillMode::Full
    }

    fn prefill(&mut self, _prompt: &[u32], ctx: &mut DraftContext<'_>) -> verity::Result<()> {
        self.prefill_anchor = Some((ctx.last, ctx.anchor.iter().map(bits).collect()));
        self.at = 1;
        Ok(())
    }

    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> verity::Result<Vec<u32>> {
        let drafts: Vec<u32> = self.script[self.at..].iter().take(n).copied().collect();
        let input = std::iter::once(ctx.last).chain(drafts.clone()).collect();
        self.rounds.push(Round {
            anchor: ctx.anchor.iter().map(bits).collect(),
            input,
            verified: Vec::new(),
        });
        Ok(drafts)
    }

    fn commit(&mut self, round: &Verified<'_>) -> verity::Result<()> {
        self.at += round.accepted + usize::from(round.next.is_some());
        let last = self.rounds.last_mut().expect("commit after draft");
        last.verified = round.hidden.iter().map(bits).collect();
        Ok(())
    }
}

#[test]
fn a_source_gets_the_rows_of_plain_forwards_over_the_same_tokens() {
    support::on_cpu();
    for name in ["qwen3", "qwen3_5"] {
        let b = bundle(name);
        let model = b.model();
        let (prompt, params) = golden_input(&format!("{name}/greedy/code"), 20);
        let script: Vec<u32> = Generation::new(model, &prompt, &params)
            .unwrap()
            .map(|s| s.unwrap().token)
            .collect();
        let taps = vec![model.num_layers(), 1];
        let mut source = Recorder {
            script: script.clone(),
            at: 0,
            taps: taps.clone(),
            prefill_anchor: None,
            rounds: Vec::new(),
        };
        let mut emitted = Vec::new();
        generate_speculative(model, &mut source, &prompt, &params, 3, None, &mut |t| {
            emitted.push(t.token);
            Control::Continue
        })
        .unwrap();
        assert_eq!(
            emitted, script,
            "{name}: speculative output differs from plain"
        );
        assert!(source.rounds.len() > 3, "{name}: too few rounds");

        // The same forwards by hand on fresh caches: the prompt minus its last token, the last
        // token alone, then each round's input.
        let mut caches = model.make_cache(None);
        let (&last, head) = prompt.split_last().unwrap();
        prefill(
            model,
            &mut caches,
            &token_array(head).unwrap(),
            &params,
            |_| Ok(()),
        )
        .unwrap();
        let mut forward = |input: &[u32]| {
            let out = forward_tapped(
                model,
                &mut caches,
                &token_array(input).unwrap(),
                None,
                &taps,
            )
            .unwrap();
            assert_eq!(out.hidden.len(), taps.len());
            out.hidden
        };
        let first = forward(&[last]);
        let (first_token, anchor) = source.prefill_anchor.clone().unwrap();
        assert_eq!(first_token, script[0]);
        assert_eq!(anchor, first.iter().map(bits).collect::<Vec<_>>());
        let mut previous = first;
        for (i, round) in source.rounds.iter().enumerate() {
            // The anchor is the row the round's first token was sampled from: the previous
            // forward's last row (every draft was accepted).
            let rows = previous[0].dim(1);
            let want: Vec<Vec<u8>> = previous
                .iter()
                .map(|h| bits(&h.slice_axis(1, rows - 1, rows).unwrap()))
                .collect();
            assert_eq!(round.anchor, want, "{name}: anchor of round {i}");
            let out = forward(&round.input);
            let want: Vec<Vec<u8>> = out.iter().map(bits).collect();
            assert_eq!(round.verified, want, "{name}: verified rows of round {i}");
            previous = out;
        }
    }
}

fn mtp_run(
    target: &ModelBundle,
    prompt: &[u32],
    params: &GenerateParams,
    k: usize,
) -> (Vec<(u32, Vec<u8>)>, SpeculationStats, usize) {
    let mut source = MtpDrafter::new(target.model()).unwrap();
    let (steps, stats) = speculative_steps(target.model(), &mut source, prompt, params, k);
    let head_entries = source.caches()[0].offset();
    (steps, stats, head_entries)
}

#[test]
fn mtp_speculation_equals_plain_with_rollbacks_of_target_and_head() {
    support::on_cpu();
    let target = bundle("qwen3_5");
    for trace in ["qwen3_5/greedy/code", "qwen3_5/greedy/chat"] {
        let (prompt, params) = golden_input(trace, 40);
        let want: Vec<(u32, Vec<u8>)> = plain_steps(target.model(), &prompt, &params);
        for k in [1, 2, 3] {
            let (got, stats, head_entries) = mtp_run(&target, &prompt, &params, k);
            assert!(
                got == want,
                "{trace} k={k}: MTP speculation differs from plain"
            );
            assert_eq!(stats.generated, want.len());
            assert!(stats.rounds > 0 && stats.drafted > 0, "{stats:?}");
            assert!(
                stats.partial_rollbacks > 0,
                "{trace} k={k}: no rollback: {stats:?}"
            );
            // The head holds one entry per emitted token (each paired with the row it was
            // sampled from), whatever it drafted and took back.
            assert_eq!(
                head_entries,
                want.len(),
                "{trace} k={k}: head cache entries"
            );
        }
    }
}

/// A copy of the qwen3_5 fixture whose model.safetensors is rewritten by `edit` and tagged
/// with `format`.
fn qwen3_5_copy(label: &str, format: &str, edit: impl Fn(&str, Array) -> Array) -> ModelBundle {
    let src = model_dir("qwen3_5");
    let dir = std::env::temp_dir().join(format!("verity-mtp-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e != "safetensors") {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    let loaded = mlx::io::load_safetensors(&src.join("model.safetensors")).unwrap();
    let tensors: BTreeMap<String, Array> = loaded
        .tensors
        .into_iter()
        .map(|(k, v)| {
            let v = edit(&k, v);
            (k, v)
        })
        .collect();
    let metadata = BTreeMap::from([("format".to_string(), format.to_string())]);
    mlx::io::save_safetensors(&dir.join("model.safetensors"), &tensors, &metadata).unwrap();
    let b = ModelBundle::load(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    b
}

/// The MTP head's output bits on a fixed input (a fresh cache, three entries).
fn head_output(b: &ModelBundle) -> Vec<u8> {
    let model = b.model();
    let head = model.mtp_head().expect("the fixture has an MTP head");
    let ids = token_array(&[3, 500, 41])
        .unwrap()
        .expand_dims(&[0])
        .unwrap();
    let embedded = model.outer().embed_tokens.forward(&ids).unwrap();
    let hidden = model
        .forward(&ids, &mut model.make_cache(None), &[model.num_layers()])
        .unwrap()
        .hidden
        .remove(0);
    bits(
        &head
            .forward(&embedded, &hidden, &mut head.make_cache())
            .unwrap(),
    )
}

/// The mtp norms as their names say (every 1-D mtp tensor here is a norm weight).
fn is_mtp_norm(k: &str) -> bool {
    k.starts_with("mtp.") && (k.ends_with("norm.weight") || k.contains(".pre_fc_norm_"))
}

#[test]
fn mtp_weights_load_alike_from_pt_and_mlx_saved_checkpoints() {
    support::on_cpu();
    let fixture = bundle("qwen3_5");
    let want = head_output(&fixture);
    // As mlx-vlm would save the split drafter: zero-centred mtp norms already shifted by +1.
    let converted = qwen3_5_copy("mlx", "mlx", |k, v| {
        if is_mtp_norm(k) {
            v.add_scalar(1.0).unwrap()
        } else {
            v
        }
    });
    assert_eq!(
        head_output(&converted),
        want,
        "an mlx-saved head loads differently"
    );
    // An explicit "pt" tag is the fixture's own.
    let pt = qwen3_5_copy("pt", "pt", |_, v| v);
    assert_eq!(head_output(&pt), want);
    // The tag is read: unshifted norms under "mlx" are taken as converted (as mlx-vlm does).
    let mislabelled = qwen3_5_copy("mislabelled", "mlx", |_, v| v);
    assert_ne!(
        head_output(&mislabelled),
        want,
        "the format tag was ignored"
    );
    // The target itself is read the mlx-lm way whatever the tag: same logits.
    let ids = token_array(&[7, 8, 9]).unwrap().expand_dims(&[0]).unwrap();
    let logits = |b: &ModelBundle| {
        bits(
            &b.model()
                .forward(&ids, &mut b.model().make_cache(None), &[])
                .unwrap()
                .logits,
        )
    };
    assert_eq!(logits(&converted), logits(&fixture));
}

#[test]
fn an_mtp_drafter_needs_a_target_with_an_mtp_head() {
    support::on_cpu();
    for name in ["qwen3", "qwen3_next", "qwen3_5-4bit"] {
        let b = bundle(name);
        let err = MtpDrafter::new(b.model())
            .err()
            .expect("no MTP head")
            .to_string();
        assert!(err.contains("mtp.* weights"), "{name}: {err}");
    }
    assert!(MtpDrafter::new(bundle("qwen3_5").model()).is_ok());
}

#[test]
fn mtp_drafts_equal_mlx_vlm_round_by_round() {
    support::on_cpu();
    let prompts = ["code", "chat", "chat-sort", "unicode", "long"];
    // The random head: greedy at every block size, then sampled with positioned keys (mlx-vlm
    // drafts greedily and samples the target per position). The trained head (whose drafts
    // are accepted, so rounds roll back and commit): greedy at block 3, and sampled.
    let mut cases: Vec<(&str, usize, String)> = [2, 3, 4]
        .into_iter()
        .flat_map(|block| prompts.map(|p| ("qwen3_5", block, format!("vlm-mtp{block}/{p}"))))
        .collect();
    cases.extend(prompts.map(|p| ("qwen3_5", 3, format!("vlm-mtp3-seed11/{p}"))));
    for block in [2, 4] {
        let seeded = ["code", "chat"].map(|p| format!("vlm-mtp{block}-seed5/{p}"));
        cases.extend(seeded.map(|case| ("qwen3_5", block, case)));
    }
    cases.extend(["code", "chat"].map(|p| ("qwen3_5", 3, format!("vlm-mtp3-seed3-topp0.9/{p}"))));
    cases.push(("qwen3_5-trained", 3, "vlm-mtp3/multi-turn".to_string()));
    for variant in ["vlm-mtp3", "vlm-mtp3-seed11"] {
        cases.extend(prompts.map(|p| ("qwen3_5-trained", 3, format!("{variant}/{p}"))));
    }
    let targets = BTreeMap::from(["qwen3_5", "qwen3_5-trained"].map(|t| (t, bundle(t))));
    let (mut traces, mut rounds, mut accepted) = (0, 0, 0);
    for (name, block, case) in cases {
        let target = &targets[name];
        let id = format!("{name}/{case}");
        let source = MtpDrafter::new(target.model()).unwrap();
        let want = support::drafts_equal_mlx_vlm(target, &id, "mtp_drafts", source, block);
        traces += 1;
        rounds += want.len();
        accepted += support::golden(&id)
            .steps
            .iter()
            .filter(|s| s.from_draft)
            .count();
    }
    assert_eq!(traces, 37);
    assert!(rounds > 600, "{rounds} rounds");
    assert!(
        accepted > 100,
        "only {accepted} accepted drafts: nothing was rolled back"
    );
}

#[test]
fn mtp_acceptance_per_position_equals_mlx_vlms() {
    support::on_cpu();
    let root = support::root();
    let path = root.join("golden/accept/mtp-trained.toml");
    let suite = Suite::load(&path).unwrap();
    let oracle = suite
        .oracle
        .clone()
        .expect("the suite records mlx-vlm's acceptance");
    let measured = run_suite(&suite, &mut Models::new(root)).unwrap();
    assert_eq!(measured.len(), 3);
    for (k, stats) in &measured {
        let a = acceptance(stats);
        let differs = oracle.by_position_mismatches(*k, &a);
        assert_eq!(differs, Some(Vec::new()), "k={k}");
        assert!(a.accepted_by_pos.iter().all(|&n| n > 0), "k={k}: {a:?}");
        let from_draft = format!("{:.12}", a.from_draft_fraction());
        assert_eq!(
            from_draft,
            format!("{:.12}", oracle.from_draft[&k.to_string()])
        );
    }
}

/// One round the property feeds the MTP drafter: drafts asked for, drafts accepted, and
/// whether the target's own token follows (false: the request ended inside the round).
#[derive(Clone, Debug)]
struct Outcome {
    drafts: usize,
    accepted: usize,
    next: bool,
}

fn outcomes() -> impl Strategy<Value = Vec<Outcome>> {
    let round = (1usize..=4)
        .prop_flat_map(|n| (Just(n), 0..=n))
        .prop_map(|(drafts, accepted)| Outcome {
            drafts,
            accepted,
            next: true,
        });
    (prop::collection::vec(round, 1..6), any::<bool>()).prop_map(|(mut rounds, ends)| {
        if let Some(last) = rounds.last_mut() {
            last.next = !ends;
        }
        rounds
    })
}

/// mlx-vlm's drafter state as plain data (qwen3_5_mtp.py, draft_block and
/// accept_verified_tokens): the entries its cache holds, each a token and the hidden state it
/// follows, recomputed from scratch with the head on a fresh cache whenever an output is needed.
struct Reference<'a> {
    target: &'a ModelBundle,
    entries: Vec<(u32, Array)>,
}

impl Reference<'_> {
    /// The head's outputs (1, L, H) over `entries` in one pass on a fresh cache, and the cache.
    fn run(&self, entries: &[(u32, Array)]) -> (Array, Vec<verity::cache::LayerCache>) {
        let model = self.target.model();
        let head = model.mtp_head().unwrap();
        let tokens: Vec<u32> = entries.iter().map(|e| e.0).collect();
        let ids = token_array(&tokens).unwrap().expand_dims(&[0]).unwrap();
        let embedded = model.outer().embed_tokens.forward(&ids).unwrap();
        let rows: Vec<&Array> = entries.iter().map(|e| &e.1).collect();
        let hidden = mlx::ops::concatenate(&rows, 1).unwrap();
        let mut caches = head.make_cache();
        let out = head.forward(&embedded, &hidden, &mut caches).unwrap();
        (out, caches)
    }

    fn last_output(&self, entries: &[(u32, Array)]) -> Array {
        let out = self.run(entries).0;
        let l = out.dim(1);
        out.slice_axis(1, l - 1, l).unwrap()
    }

    fn argmax(&self, h: &Array) -> u32 {
        let logits = self
            .target
            .model()
            .outer()
            .logits(&h.squeeze(&[1]).unwrap());
        mlx::ops::argmax(&logits.unwrap(), -1, false)
            .unwrap()
            .item::<u32>()
            .unwrap()
    }

    /// draft_block: the first draft from the seed, then chained entries; returns the drafts
    /// and the chained entries it appended.
    fn draft(&self, n: usize) -> (Vec<u32>, Vec<(u32, Array)>) {
        let mut h = self.last_output(&self.entries);
        let mut drafts = vec![self.argmax(&h)];
        let mut appended = Vec::new();
        while drafts.len() < n {
            appended.push((*drafts.last().unwrap(), h));
            let mut all = self.entries.clone();
            all.extend(appended.iter().cloned());
            h = self.last_output(&all);
            drafts.push(self.argmax(&h));
        }
        (drafts, appended)
    }
}

#[test]
fn mtp_cache_rollback_matches_a_recompute_of_mlx_vlms_entries() {
    support::on_cpu();
    let target = bundle("qwen3_5");
    let model = target.model();
    let width = model.outer().embed_tokens.width() as i32;
    let params = GenerateParams::greedy(64, target.eos_token_ids.clone());
    let prompt = [5u32, 9, 300];
    let config = Config {
        cases: support::proptest_cases(8, 300),
        source_file: Some(file!()),
        ..Config::default()
    };
    let rows = |seed: u64, n: i32| {
        mlx::random::normal(
            &[1, n, width],
            mlx::Dtype::Float32,
            &mlx::random::key(seed).unwrap(),
        )
        .unwrap()
    };
    let (kept_chained, all_accepted) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    TestRunner::new(config)
        .run(&(outcomes(), any::<u64>()), |(rounds, seed)| {
            let mut sampler = params.step_sampler(model, &prompt, None).unwrap();
            let mut drafter = MtpDrafter::new(model).unwrap();
            let anchor = [rows(seed, 1)];
            let mut reference = Reference {
                target: &target,
                entries: vec![(7, anchor[0].clone())],
            };
            let mut ctx = DraftContext::new(&mut sampler, &params, 7, &anchor);
            drafter.prefill(&prompt, &mut ctx).unwrap();
            for (r, round) in rounds.iter().enumerate() {
                let mut ctx = DraftContext::new(&mut sampler, &params, 11, &[]);
                let drafts = drafter.draft(round.drafts, &mut ctx).unwrap();
                let (want, chained) = reference.draft(round.drafts);
                prop_assert_eq!(&drafts, &want, "round {}: drafts", r);
                let verified = [rows(
                    seed.wrapping_add(r as u64 + 1),
                    round.drafts as i32 + 1,
                )];
                let next = round.next.then_some(40 + r as u32);
                drafter
                    .commit(&Verified {
                        drafted: round.drafts,
                        accepted: round.accepted,
                        next,
                        hidden: &verified,
                    })
                    .unwrap();
                // accept_verified_tokens: keep min(accepted, appended) chained entries, then the
                // accepted drafts after them and the target's token on the verified rows.
                let keep = round.accepted.min(chained.len());
                kept_chained.set(kept_chained.get() + keep);
                all_accepted.set(all_accepted.get() + usize::from(round.accepted == round.drafts));
                reference.entries.extend(chained.into_iter().take(keep));
                let row = |i: usize| verified[0].slice_axis(1, i as i32, i as i32 + 1).unwrap();
                for (i, &d) in drafts.iter().enumerate().take(round.accepted).skip(keep) {
                    reference.entries.push((d, row(i)));
                }
                if let Some(t) = next {
                    reference.entries.push((t, row(round.accepted)));
                }
                let (_, caches) = reference.run(&reference.entries);
                let visible = |c: &verity::cache::LayerCache| {
                    let (k, v) = c.visible().unwrap().unwrap();
                    (bits(&k), bits(&v))
                };
                prop_assert_eq!(drafter.caches().len(), caches.len());
                for (got, want) in drafter.caches().iter().zip(&caches) {
                    prop_assert!(visible(got) == visible(want), "round {}: head cache", r);
                }
            }
            Ok(())
        })
        .unwrap();
    assert!(kept_chained.get() > 0, "no chained entry was ever kept");
    assert!(all_accepted.get() > 0, "no round accepted every draft");
}
