//! Split MTP drafter folders (`--draft-mtp DIR`): the head of golden/models/qwen3_5-trained-mtp,
//! cut out of qwen3_5-trained by mlx-vlm's own splitter (oracles/split_mtp.py), loaded through
//! the drafter registry, drafts exactly what the target's in-folder head drafts, round by round,
//! greedy and seeded, with the same acceptance counters; its greedy drafts are mlx-vlm's; and
//! paired with a conversion that carries no `mtp.*` (qwen3_5-4bit) speculation still equals
//! plain decoding. (Mispaired folders are refused by the binary: tests/bad_input.rs.)

mod support;

use support::{bundle, golden_input, model_dir, plain_steps, speculative_steps};
use verity::bundle::ModelBundle;
use verity::generate::GenerateParams;
use verity::speculative::{
    DraftContext, DraftSource, Drafter, DrafterSpec, MtpDrafter, PrefillMode, SpeculationStats,
    Verified,
};

/// The split drafter folder of the trained fixture.
const SPLIT: &str = "qwen3_5-trained-mtp";

/// A registry source that records each round's drafts.
struct Recorder<'a> {
    inner: Box<dyn DraftSource + 'a>,
    drafts: Vec<Vec<u32>>,
}

impl DraftSource for Recorder<'_> {
    fn taps(&self) -> Vec<usize> {
        self.inner.taps()
    }

    fn prefill_mode(&self) -> PrefillMode {
        self.inner.prefill_mode()
    }

    fn prefill(&mut self, prompt: &[u32], ctx: &mut DraftContext<'_>) -> verity::Result<()> {
        self.inner.prefill(prompt, ctx)
    }

    fn draft(&mut self, n: usize, ctx: &mut DraftContext<'_>) -> verity::Result<Vec<u32>> {
        let drafts = self.inner.draft(n, ctx)?;
        self.drafts.push(drafts.clone());
        Ok(drafts)
    }

    fn commit(&mut self, round: &Verified<'_>) -> verity::Result<()> {
        self.inner.commit(round)
    }
}

/// What one speculative run shows: each round's drafts, each emitted token with its logprobs'
/// bits, and the counters.
type Run = (Vec<Vec<u32>>, Vec<(u32, Vec<u8>)>, SpeculationStats);

fn run(
    target: &ModelBundle,
    drafter: &Drafter,
    prompt: &[u32],
    params: &GenerateParams,
    k: usize,
) -> Run {
    let mut source = Recorder {
        inner: drafter.source(target.model(), None).unwrap(),
        drafts: Vec::new(),
    };
    let (steps, stats) = speculative_steps(target.model(), &mut source, prompt, params, k);
    (source.drafts, steps, stats)
}

fn split_spec() -> DrafterSpec {
    DrafterSpec::Mtp {
        dir: Some(model_dir(SPLIT)),
    }
}

#[test]
fn the_split_head_drafts_what_the_in_folder_head_drafts() {
    support::on_cpu();
    let target = bundle("qwen3_5-trained");
    let own = Drafter::load(&DrafterSpec::Mtp { dir: None }, &target).unwrap();
    let split = Drafter::load(&split_spec(), &target).unwrap();
    let (mut rounds, mut accepted) = (0, 0);
    for variant in ["vlm-mtp3", "vlm-mtp3-seed11"] {
        for prompt in ["code", "chat", "chat-sort", "unicode", "long"] {
            let id = format!("qwen3_5-trained/{variant}/{prompt}");
            let (tokens, params) = golden_input(&id, 48);
            for k in [1, 2, 3] {
                let want = run(&target, &own, &tokens, &params, k);
                let got = run(&target, &split, &tokens, &params, k);
                assert_eq!(got.0, want.0, "{id} k={k}: drafts differ");
                assert!(got.1 == want.1, "{id} k={k}: emitted tokens differ");
                assert_eq!(got.2, want.2, "{id} k={k}: counters differ");
                rounds += got.0.len();
                accepted += got.2.accepted;
            }
        }
    }
    assert!(rounds > 300, "{rounds} rounds");
    assert!(accepted > 100, "only {accepted} drafts accepted");
}

#[test]
fn the_split_heads_greedy_drafts_are_mlx_vlms() {
    support::on_cpu();
    let target = bundle("qwen3_5-trained");
    let Drafter::Mtp(Some(head)) = Drafter::load(&split_spec(), &target).unwrap() else {
        panic!("a split MTP folder loads as a split head");
    };
    for prompt in ["code", "chat", "chat-sort", "unicode", "long"] {
        let id = format!("qwen3_5-trained/vlm-mtp3/{prompt}");
        let source = MtpDrafter::with_head(target.model(), head.as_ref());
        let rounds = support::drafts_equal_mlx_vlm(&target, &id, "mtp_drafts", source, 3);
        assert!(!rounds.is_empty(), "{id}: no rounds");
    }
}

#[test]
fn a_split_head_on_a_target_without_mtp_weights_speculates_as_plain_decoding() {
    support::on_cpu();
    // The 4-bit conversion of qwen3_5 carries no mtp.* (as community conversions), and no
    // own head to fall back on.
    let target = bundle("qwen3_5-4bit");
    assert!(target.model().mtp_head().is_none());
    let split = Drafter::load(&split_spec(), &target).unwrap();
    for trace in ["qwen3_5/greedy/code", "qwen3_5/greedy/chat"] {
        let (prompt, params) = golden_input(trace, 40);
        let plain: Vec<(u32, Vec<u8>)> = plain_steps(target.model(), &prompt, &params);
        for k in [1, 3] {
            let (drafts, steps, stats) = run(&target, &split, &prompt, &params, k);
            assert!(
                steps == plain,
                "{trace} k={k}: speculation differs from plain"
            );
            assert!(!drafts.is_empty() && stats.drafted > 0, "{stats:?}");
        }
    }
}
