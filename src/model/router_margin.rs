//! How close a forward's expert routers came to another choice. A router keeps each token's k
//! best-scored experts; its margin is the k-th best score minus the next one. Another backend
//! rounds the scores differently, by far less than the fixtures' typical margins, so it picks
//! the same experts wherever the margin exceeds that rounding, and its logprobs differ from the
//! engine's by rounding only up to the first forward whose margin did not. Teacher-forced
//! replay across backends watches the margins to judge a trace up to there
//! (`verity_harness::judge::Cut`); nothing is computed unless it is watching.

use std::cell::RefCell;

use mlx::{ops, Array, Result};

thread_local! {
    /// The margins noted since the last [`take`], while watching.
    static NOTED: RefCell<Option<Vec<Array>>> = const { RefCell::new(None) };
}

/// Runs `f` with the routers' margins noted, for [`take`] inside it.
pub fn watch<T, E>(f: impl FnOnce() -> std::result::Result<T, E>) -> std::result::Result<T, E> {
    let before = NOTED.with(|n| n.replace(Some(Vec::new())));
    let out = f();
    NOTED.with(|n| n.replace(before));
    out
}

/// The smallest margin noted since the last call (None: no router ran, or not watching).
pub fn take() -> Result<Option<f32>> {
    let noted = NOTED.with(|n| n.borrow_mut().as_mut().map(std::mem::take));
    let Some(noted) = noted.filter(|n| !n.is_empty()) else {
        return Ok(None);
    };
    let all = ops::concatenate(&noted.iter().collect::<Vec<_>>(), 0)?;
    Ok(Some(all.min(&[], false)?.item::<f32>()?))
}

/// Notes the margin of a top-`k` choice over the last axis of `scores`, every token's.
pub(crate) fn note_top_k(scores: &Array, k: i32) -> Result<()> {
    let watching = NOTED.with(|n| n.borrow().is_some());
    let choices = scores.dim(-1);
    if !watching || k >= choices {
        return Ok(());
    }
    let sorted = ops::sort(&scores.astype(mlx::Dtype::Float32)?, -1)?;
    let kth = sorted.slice_axis(-1, choices - k, choices - k + 1)?;
    let next = sorted.slice_axis(-1, choices - k - 1, choices - k)?;
    let margin = kth.subtract(&next)?.min(&[], false)?.reshape(&[1])?;
    NOTED.with(|n| {
        if let Some(noted) = n.borrow_mut().as_mut() {
            noted.push(margin);
        }
    });
    Ok(())
}

/// Notes the margins of glm4_moe's grouped choice (`group_expert_select`): the groups kept by
/// their top-2 sums, then the top `k` of the kept groups' experts, on the biased sigmoid scores.
pub(crate) fn note_grouped(
    gates: &Array,
    bias: &Array,
    k: i32,
    n_group: i32,
    topk_group: i32,
) -> Result<()> {
    if NOTED.with(|n| n.borrow().is_none()) {
        return Ok(());
    }
    let scores = gates.astype(mlx::Dtype::Float32)?.sigmoid()?.add(bias)?;
    if n_group <= 1 {
        return note_top_k(&scores, k);
    }
    let mut shape = scores.shape();
    let experts = shape.pop().expect("scores have an expert axis");
    shape.extend([n_group, experts / n_group]);
    let grouped = scores.reshape(&shape)?;
    let group_scores = ops::topk(&grouped, 2, -1)?.sum(&[-1], false)?;
    note_top_k(&group_scores, topk_group)?;
    let kept_from = ops::sort(&group_scores, -1)?.slice_axis(
        -1,
        n_group - topk_group,
        n_group - topk_group + 1,
    )?;
    let kept = group_scores.greater_equal(&kept_from)?.expand_dims(&[-1])?;
    let masked = ops::r#where(&kept, &grouped, &ops::scalar_like(0.0, &grouped)?)?;
    note_top_k(&masked.flatten(-2, -1)?, k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores(values: &[f32], shape: &[i32]) -> Array {
        Array::from_slice(values, shape).unwrap()
    }

    #[test]
    fn a_top_k_margin_is_the_kth_best_score_less_the_next_over_every_token() {
        let s = scores(&[0.1, 0.5, 0.3, 0.45, 0.4, 0.1, 0.35, 0.15], &[2, 4]);
        let margin = watch(|| {
            note_top_k(&s, 2)?;
            take()
        })
        .unwrap()
        .unwrap();
        // Token 0: 0.45 - 0.3; token 1: 0.35 - 0.15.
        assert!((margin - 0.15).abs() < 1e-6, "{margin}");
    }

    #[test]
    fn nothing_is_noted_unless_watched_and_a_take_empties_the_notes() {
        let s = scores(&[0.1, 0.5, 0.3, 0.45], &[1, 4]);
        note_top_k(&s, 2).unwrap();
        assert_eq!(watch(take).unwrap(), None);
        watch(|| {
            note_top_k(&s, 2)?;
            assert!(take()?.is_some());
            assert_eq!(take()?, None);
            // Every expert picked: no other choice to come near.
            note_top_k(&s, 4)?;
            assert_eq!(take()?, None);
            Ok::<_, mlx::Error>(())
        })
        .unwrap();
    }

    #[test]
    fn a_grouped_choice_notes_the_group_margin_and_the_kept_experts_margin() {
        // Two groups of two; logits whose sigmoids (+ zero bias) rank group 1 above group 0.
        let gates = scores(&[0.0, 0.2, 1.0, 1.1], &[1, 4]);
        let bias = scores(&[0.0; 4], &[4]);
        let margin = watch(|| {
            note_grouped(&gates, &bias, 1, 2, 1)?;
            take()
        })
        .unwrap()
        .unwrap();
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        let group = (sig(1.0) + sig(1.1)) - (sig(0.0) + sig(0.2));
        let expert = sig(1.1) - sig(1.0);
        assert!((margin - group.min(expert)).abs() < 1e-6, "{margin}");
    }
}
