//! Gemma 4's assistant drafter (src/speculative/gemma4_assistant.rs): its drafts and its
//! acceptance per draft position against mlx-vlm's, round by round (the `drafters` profile);
//! speculation with it against plain decoding (tier C: tokens and logprob bits), alone and in
//! a batch (tests/batch.rs); its reading of the target's caches without writing them; the
//! pairing checks (a folder that does not fit its target is exit 2); and the multimodal
//! `gemma4` wrapper loading the text model. The mlx-vlm traces' tokens are replayed by
//! tests/goldens.rs.

mod support;

use std::path::{Path, PathBuf};

use support::{bits, bundle, golden, golden_input, model_dir, plain_steps, speculative_steps};
use verity::bundle::ModelBundle;
use verity::generate::GenerateParams;
use verity::model::gemma4_assistant::Gemma4Assistant;
use verity::parity::replay;
use verity::speculative::{AssistantDrafter, Drafter, DrafterSpec, SpeculationStats};
use verity::Error;

fn assistant() -> Gemma4Assistant {
    Gemma4Assistant::load(&model_dir("gemma4-assistant")).unwrap()
}

#[test]
fn assistant_drafts_equal_mlx_vlm_round_by_round() {
    support::on_cpu();
    let target = bundle("gemma4-vlm");
    let model = assistant();
    let mut cases: Vec<(usize, String)> = [2, 3, 4]
        .into_iter()
        .flat_map(|b| ["code", "chat"].map(|p| (b, format!("vlm-assistant{b}/{p}"))))
        .collect();
    // Above the drafter's block_size (4): mlx-vlm's adaptive ceiling; and sampled (the target
    // through positioned keys, the drafts through the drafter's own seeded key sequence), at a
    // temperature alone, with top-k 20 and with top-p 0.9.
    cases.push((6, "vlm-assistant6/code".into()));
    cases.push((3, "vlm-assistant3-seed11/code".into()));
    cases.push((3, "vlm-assistant3-seed12/code".into()));
    cases.push((3, "vlm-assistant3-seed11-topp0.9/code".into()));
    let (mut rounds, mut accepted) = (0, 0);
    for (block, case) in cases {
        let id = format!("gemma4-vlm/{case}");
        let source = AssistantDrafter::new(target.model(), &model).unwrap();
        let want = support::drafts_equal_mlx_vlm(&target, &id, "mtp_drafts", source, block);
        assert!(
            want.iter().all(|d| d.len() < 4),
            "{id}: more than block_size - 1 drafts"
        );
        // Acceptance per draft position: mlx-vlm's, read from the trace's from_draft runs (a
        // round emits its accepted drafts, then the target's token), against verity's counters.
        let trace = golden(&id);
        let runs: Vec<usize> = trace.steps[1..]
            .split(|s| !s.from_draft)
            .map(<[_]>::len)
            .take(want.len())
            .collect();
        let by_pos = |counts: &mut Vec<usize>, n: usize| {
            counts.resize(counts.len().max(n), 0);
            counts[..n].iter_mut().for_each(|c| *c += 1);
        };
        let (mut drafted, mut accepted_by_pos) = (Vec::new(), Vec::new());
        for (d, &a) in want.iter().zip(&runs) {
            by_pos(&mut drafted, d.len());
            by_pos(&mut accepted_by_pos, a);
        }
        accepted_by_pos.resize(drafted.len(), 0);
        let params = replay::params(&trace, target.eos_token_ids.clone()).unwrap();
        let (_, stats) = speculate(&target, &model, &trace.prompt.tokens, &params, block - 1);
        assert_eq!(stats.drafted_by_pos, drafted, "{id}: drafts per position");
        assert_eq!(
            stats.accepted_by_pos, accepted_by_pos,
            "{id}: accepted per position"
        );
        rounds += want.len();
        accepted += trace.steps.iter().filter(|s| s.from_draft).count();
    }
    assert!(rounds > 150, "{rounds} rounds");
    assert!(accepted > 10, "only {accepted} accepted drafts");
}

/// Speculative decoding of `trace`'s prompt with the assistant at `k` drafts a round.
fn speculate(
    target: &ModelBundle,
    model: &Gemma4Assistant,
    prompt: &[u32],
    params: &GenerateParams,
    k: usize,
) -> (Vec<(u32, Vec<u8>)>, SpeculationStats) {
    let mut source = AssistantDrafter::new(target.model(), model).unwrap();
    let (steps, stats) = speculative_steps(target.model(), &mut source, prompt, params, k);
    (steps, stats)
}

#[test]
fn assistant_speculation_equals_plain_decoding() {
    support::on_cpu();
    let model = assistant();
    // gemma4-vlm: every round fits its window of 512; gemma4 (the same text model with a
    // window of 16), from 8 prompt tokens: rounds run past the window too, the drafter reading
    // the window's last 16 keys and the target taking rejected drafts back exactly.
    for (name, trace, len) in [
        ("gemma4-vlm", "gemma4-vlm/greedy/code", None),
        ("gemma4", "gemma4/greedy/chat", Some(8)),
    ] {
        let target = bundle(name);
        let (mut prompt, params) = golden_input(trace, 40);
        prompt.truncate(len.unwrap_or(prompt.len()));
        let want: Vec<(u32, Vec<u8>)> = plain_steps(target.model(), &prompt, &params);
        for k in [1, 2, 3] {
            let (got, stats) = speculate(&target, &model, &prompt, &params, k);
            assert!(
                got == want,
                "{name} k={k}: speculation differs from plain decoding"
            );
            assert!(stats.drafted > 0, "{name} k={k}: {stats:?}");
            assert_eq!(stats.refused_rounds, 0, "{name} k={k}: {stats:?}");
            if name == "gemma4" {
                assert!(stats.partial_rollbacks > 0, "{name} k={k}: {stats:?}");
            } else {
                assert!(
                    stats.accepted > 0 && stats.partial_rollbacks > 0,
                    "{name} k={k}: {stats:?}"
                );
            }
        }
    }
}

#[test]
fn the_drafter_reads_the_target_caches_without_writing_them() {
    support::on_cpu();
    let target = bundle("gemma4-vlm");
    let model = assistant();
    let (prompt, params) = golden_input("gemma4-vlm/greedy/code", 8);
    let mut caches = target.model().make_cache(None);
    let out = target
        .model()
        .forward(
            &verity::generate::token_array(&prompt)
                .unwrap()
                .expand_dims(&[0])
                .unwrap(),
            &mut caches,
            &[target.model().num_layers()],
        )
        .unwrap();
    let before: Vec<Vec<u8>> = caches
        .iter()
        .map(|c| {
            let (k, v) = c.visible().unwrap().unwrap();
            [bits(&k), bits(&v)].concat()
        })
        .collect();
    let l = out.hidden[0].dim(1);
    let anchor = [out.hidden[0].slice_axis(1, l - 1, l).unwrap()];
    let mut sampler = params.step_sampler(target.model(), &prompt, None).unwrap();
    let mut ctx = verity::speculative::DraftContext::new(&mut sampler, &params, 7, &anchor)
        .with_target(&caches);
    let mut source = AssistantDrafter::new(target.model(), &model).unwrap();
    let drafts = verity::speculative::DraftSource::draft(&mut source, 3, &mut ctx).unwrap();
    assert_eq!(drafts.len(), 3);
    for (c, b) in caches.iter().zip(&before) {
        let (k, v) = c.visible().unwrap().unwrap();
        assert_eq!(&[bits(&k), bits(&v)].concat(), b);
        assert_eq!(c.offset(), prompt.len());
    }
}

/// A copy of the assistant folder with `edit` applied to its config.json and `cut` to its
/// tensors (name, rows, columns kept), so that the folder loads but pairs differently.
fn edited(label: &str, edit: impl Fn(&mut serde_json::Value), cut: &[(&str, i32, i32)]) -> PathBuf {
    let src = model_dir("gemma4-assistant");
    let dir = std::env::temp_dir().join(format!("verity-assistant-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = mlx::io::load_safetensors(&src.join("model.safetensors")).unwrap();
    let mut tensors = file.tensors;
    for &(name, rows, cols) in cut {
        let t = &tensors[name];
        let t = t
            .slice_axis(0, 0, rows)
            .unwrap()
            .slice_axis(-1, 0, cols)
            .unwrap();
        tensors.insert(name.to_string(), t);
    }
    mlx::io::save_safetensors(&dir.join("model.safetensors"), &tensors, &file.metadata).unwrap();
    let path = src.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

fn load_error(target: &str, dir: &Path) -> String {
    let target = bundle(target);
    match Drafter::load(
        &DrafterSpec::Mtp {
            dir: Some(dir.to_path_buf()),
        },
        &target,
    ) {
        Ok(_) => panic!("{} paired with its target", dir.display()),
        Err(e) => {
            assert!(matches!(e, Error::Params(_)), "not a bad-input error: {e}");
            e.to_string()
        }
    }
}

#[test]
fn an_assistant_that_does_not_fit_its_target_is_refused() {
    support::on_cpu();
    let fits = model_dir("gemma4-assistant");
    assert!(Drafter::load(
        &DrafterSpec::Mtp {
            dir: Some(fits.clone())
        },
        &bundle("gemma4-vlm")
    )
    .is_ok());
    // Not a Gemma 4 target.
    let e = load_error("qwen3", &fits);
    assert!(e.contains("must be a Gemma 4 model"), "{e}");
    // Width: projections for a target of 32.
    let narrow = edited(
        "width",
        |c| c["backbone_hidden_size"] = 32.into(),
        &[
            ("pre_projection.weight", 32, 64),
            ("post_projection.weight", 32, 32),
        ],
    );
    let e = load_error("gemma4-vlm", &narrow);
    assert!(
        e.contains("backbone_hidden_size is 32") && e.contains("hidden size, 64"),
        "{e}"
    );
    // Vocabulary: an output head of 512 tokens.
    let vocab = edited(
        "vocab",
        |c| c["text_config"]["vocab_size"] = 512.into(),
        &[("model.embed_tokens.weight", 512, 32)],
    );
    let e = load_error("gemma4-vlm", &vocab);
    assert!(e.contains("vocab_size is 512") && e.contains("1024"), "{e}");
    // Layer kinds: a full layer with heads of 32, where the target's full layers have 64.
    let kinds = edited(
        "kinds",
        |c| c["text_config"]["global_head_dim"] = 32.into(),
        &[
            ("model.layers.1.self_attn.q_proj.weight", 64, 32),
            ("model.layers.1.self_attn.q_norm.weight", 32, 32),
            ("model.layers.1.self_attn.o_proj.weight", 32, 64),
        ],
    );
    let e = load_error("gemma4-vlm", &kinds);
    assert!(
        e.contains("layer 1 (full_attention)") && e.contains("head dimension, 64"),
        "{e}"
    );
    // Through the CLI: exit 2, naming the value.
    let out = support::verity_cpu(&[
        "generate",
        "--model",
        model_dir("gemma4-vlm").to_str().unwrap(),
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--draft-mtp",
        narrow.to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("backbone_hidden_size is 32"));
    for dir in [narrow, vocab, kinds] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn the_gemma4_wrapper_loads_the_text_model() {
    support::on_cpu();
    // gemma4-vlm holds gemma4's text weights under model.language_model.* beside a vision
    // tower; its window is 512, gemma4's 16, so on a prompt within 16 tokens they agree.
    let prompt: Vec<u32> = golden("gemma4/greedy/chat").prompt.tokens[..12].to_vec();
    let ids = verity::generate::token_array(&prompt)
        .unwrap()
        .expand_dims(&[0])
        .unwrap();
    let logits: Vec<Vec<u8>> = ["gemma4", "gemma4-vlm"]
        .map(|m| {
            let b = bundle(m);
            let mut caches = b.model().make_cache(None);
            bits(&b.model().forward(&ids, &mut caches, &[]).unwrap().logits)
        })
        .into();
    assert_eq!(logits[0], logits[1]);
}
