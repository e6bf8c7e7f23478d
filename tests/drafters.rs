//! Native drafters through the DraftSource seam: hidden-state taps against a plain forward and
//! the hidden rows the executor hands a source.

mod support;

use mlx::Array;
use support::{bundle, golden_input};
use verity::generate::{forward_tapped, prefill, token_array, Generation};
use verity::speculative::{
    generate_speculative, Control, DraftContext, DraftSource, PrefillMode, Verified,
};

fn bits(a: &Array) -> Vec<u8> {
    a.to_bytes().unwrap()
}

const ARCHITECTURES: [&str; 5] = ["llama", "qwen3", "gemma3", "qwen3_next", "qwen3_5"];

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
