//! Every cache kind against its reference model (verity_harness::cache_model): random
//! interleavings of appends, trims and speculative rounds, comparing what attention can see (or
//! the recurrent state) after every step. Keys written for token id t are all t, so the visible
//! keys spell out which tokens the cache holds, in order.

mod support;

use mlx::{random, Array, Dtype};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use support::proptest_cases;
use verity::cache::{
    rollback_plan, KvCache, LayerCache, Mask, QuantizedKvCache, Recurrence, RecurrentCache,
    Rollback, RotatingKvCache,
};
use verity_harness::cache_model::{ops, rotating_kind, Kind, Op, Plan, RefCache};

const HEAD_DIM: i32 = 32;

fn real_cache(kind: Kind) -> LayerCache {
    match kind {
        Kind::Kv => LayerCache::Kv(KvCache::default()),
        Kind::QuantizedKv => LayerCache::QuantizedKv(QuantizedKvCache::new(32, 8)),
        Kind::Rotating { max_size, keep } => {
            LayerCache::Rotating(RotatingKvCache::new(max_size, keep))
        }
        Kind::Recurrent => LayerCache::Recurrent(RecurrentCache::default()),
    }
}

/// A small gated-DeltaNet recurrence with fixed random parameters.
fn recurrence() -> Recurrence {
    let key = |s| random::key(s).unwrap();
    let (k_heads, v_heads, k_dim, v_dim, kernel) = (1, 2, 32, 16, 4);
    let conv_dim = 2 * k_heads * k_dim + v_heads * v_dim;
    let u = random::uniform(&[v_heads], Dtype::Float32, &key(2)).unwrap();
    Recurrence {
        conv_weight: random::normal(&[conv_dim, kernel, 1], Dtype::Float32, &key(1)).unwrap(),
        a_log: u
            .multiply_scalar(15.0)
            .unwrap()
            .add_scalar(1.0)
            .unwrap()
            .log()
            .unwrap(),
        dt_bias: Array::full(&[v_heads], &Array::from_f32(1.0), Dtype::Float32).unwrap(),
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        conv_kernel: kernel,
    }
}

/// The recurrence's inputs for the given token ids: rows drawn from a key per id, so a token's
/// inputs are the same whenever it is fed.
fn recurrent_inputs(rec: &Recurrence, ids: &[u32]) -> (Array, Array, Array) {
    let conv_dim = 2 * rec.k_heads * rec.k_dim + rec.v_heads * rec.v_dim;
    let rows = |width: i32, salt: u64| {
        let parts: Vec<Array> = ids
            .iter()
            .map(|&t| {
                random::normal(
                    &[1, 1, width],
                    Dtype::Float32,
                    &random::key(t as u64 * 3 + salt).unwrap(),
                )
                .unwrap()
            })
            .collect();
        mlx::ops::concatenate(&parts.iter().collect::<Vec<_>>(), 1).unwrap()
    };
    (
        rows(conv_dim, 0),
        rows(rec.v_heads, 1),
        rows(rec.v_heads, 2),
    )
}

/// Feeds tokens `ids` to the real cache in one call.
fn feed(cache: &mut LayerCache, rec: &Recurrence, ids: &[u32]) {
    match cache {
        LayerCache::Recurrent(c) => {
            let (qkv, a, b) = recurrent_inputs(rec, ids);
            c.advance(rec, &qkv, &a, &b).unwrap();
        }
        c => {
            let (keys, values) = rows(ids);
            c.update_and_fetch(&keys, &values).unwrap();
        }
    }
}

/// The keys (every element t) and values (-t) of tokens `ids`, (1, 1, S, HEAD_DIM).
fn rows(ids: &[u32]) -> (Array, Array) {
    let rows: Vec<f32> = ids
        .iter()
        .flat_map(|&t| std::iter::repeat_n(t as f32, HEAD_DIM as usize))
        .collect();
    let keys = Array::from_slice(&rows, &[1, 1, ids.len() as i32, HEAD_DIM]).unwrap();
    let values = keys.negative().unwrap();
    (keys, values)
}

/// Whether two caches hold the same offset and the same state arrays, bit for bit.
fn same_state(a: &LayerCache, b: &LayerCache) -> bool {
    let bytes = |c: &LayerCache| -> Vec<Vec<u8>> {
        c.state().iter().map(|s| s.to_bytes().unwrap()).collect()
    };
    a.offset() == b.offset() && bytes(a) == bytes(b)
}

/// Checks the real cache against the reference: visible ids (keys t, values -t) and offset, or
/// for a recurrent cache, conv and state bits equal to a fresh cache fed the same tokens.
fn check(real: &LayerCache, reference: &RefCache, rec: &Recurrence) -> Result<(), TestCaseError> {
    prop_assert_eq!(real.offset(), reference.offset, "offset");
    if let LayerCache::Recurrent(c) = real {
        let mut fresh = RecurrentCache::default();
        if !reference.visible().is_empty() {
            let (qkv, a, b) = recurrent_inputs(rec, reference.visible());
            fresh.advance(rec, &qkv, &a, &b).unwrap();
        }
        let bits = |c: &RecurrentCache| {
            c.current()
                .map(|s| (s.conv.to_bytes().unwrap(), s.state.to_bytes().unwrap()))
        };
        let (got, want) = (bits(c), bits(&fresh));
        prop_assert!(
            got.as_ref().map(|g| &g.0) == want.as_ref().map(|w| &w.0),
            "conv state differs from a fresh replay"
        );
        prop_assert!(
            got.as_ref().map(|g| &g.1) == want.as_ref().map(|w| &w.1),
            "recurrent state differs from a fresh replay"
        );
        return Ok(());
    }
    let (ids, negated) = match real.visible().unwrap() {
        Some((k, v)) => {
            let column = |a: &Array| -> Vec<f32> {
                let flat = a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                flat.chunks(HEAD_DIM as usize).map(|row| row[0]).collect()
            };
            (column(&k), column(&v))
        }
        None => (vec![], vec![]),
    };
    let want: Vec<f32> = reference.visible().iter().map(|&t| t as f32).collect();
    prop_assert_eq!(&ids, &want, "visible keys");
    prop_assert_eq!(
        negated,
        want.iter().map(|t| -t).collect::<Vec<_>>(),
        "visible values"
    );
    Ok(())
}

/// Applies `ops` to a real cache of `kind` and to the reference, checking after every step.
fn run_ops(kind: Kind, ops: &[Op]) -> Result<(), TestCaseError> {
    let rec = recurrence();
    let mut real = real_cache(kind);
    let mut reference = RefCache::new(kind);
    for op in ops {
        match op {
            Op::Append(k) => {
                let ids = reference.append(*k);
                feed(&mut real, &rec, &ids);
            }
            Op::Trim(n) => {
                prop_assert_eq!(real.trim(*n).unwrap(), reference.trim(*n));
            }
            Op::Round {
                chunks,
                reject,
                one_at_a_time,
            } => {
                let total: usize = chunks.iter().sum();
                let plan = match rollback_plan(std::slice::from_ref(&real), total, *one_at_a_time) {
                    Rollback::Trim => Plan::Trim,
                    Rollback::SnapshotReplay => Plan::SnapshotReplay,
                    Rollback::Restore => Plan::Restore,
                    Rollback::Refuse(_) => Plan::Refuse,
                };
                prop_assert_eq!(
                    &plan,
                    &reference.plan(total, *one_at_a_time),
                    "rollback plan for a round of {}",
                    total
                );
                if plan == Plan::Refuse {
                    continue;
                }
                let ids = reference.next_ids(total);
                let mut plain = real.clone();
                real.begin_round();
                let mut at = 0;
                for c in chunks {
                    let chunk = &ids[at..at + c];
                    match &mut real {
                        LayerCache::Rotating(r) if *one_at_a_time => {
                            let (keys, values) = rows(chunk);
                            r.update_each_token(&keys, &values).unwrap();
                        }
                        real => feed(real, &rec, chunk),
                    }
                    at += c;
                }
                prop_assert_eq!(real.end_round(*reject).unwrap(), *reject);
                reference.round(chunks, *reject, *one_at_a_time);
                if *one_at_a_time && matches!(real, LayerCache::Rotating(_)) {
                    // The ring its kept tokens left, to the bit: what one-token steps reach.
                    for &id in &ids[..total - reject] {
                        feed(&mut plain, &rec, &[id]);
                    }
                    prop_assert!(same_state(&real, &plain), "the restored ring differs");
                }
            }
        }
        check(&real, &reference, &rec)?;
    }
    Ok(())
}

fn fuzz(kind: impl Strategy<Value = Kind>, default_cases: u32, max_ops: usize) {
    support::on_cpu();
    // Failing cases are saved to tests/cache_rollback.proptest-regressions and replayed first.
    let config = Config {
        cases: proptest_cases(default_cases, 10_000),
        source_file: Some(file!()),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let strategy = kind.prop_flat_map(move |k| (Just(k), ops(k, max_ops)));
    runner
        .run(&strategy, |(kind, ops)| run_ops(kind, &ops))
        .unwrap();
}

#[test]
fn kv_cache_matches_its_reference() {
    fuzz(Just(Kind::Kv), 200, 24);
}

#[test]
fn quantized_kv_cache_matches_its_reference() {
    fuzz(Just(Kind::QuantizedKv), 200, 24);
}

#[test]
fn rotating_cache_matches_its_reference() {
    fuzz(rotating_kind(), 200, 24);
}

#[test]
fn recurrent_cache_matches_its_reference() {
    // Each check replays the whole history through a fresh cache, so sequences are shorter.
    fuzz(Just(Kind::Recurrent), 60, 12);
}

/// A speculative round fed in calls of `chunks` tokens, of which the last `reject` are taken
/// back.
fn round(chunks: &[usize], reject: usize) -> Op {
    Op::Round {
        chunks: chunks.to_vec(),
        reject,
        one_at_a_time: false,
    }
}

/// A rotating cache of `max_size` slots keeping the first `keep`.
fn rotating(max_size: usize, keep: usize) -> Kind {
    Kind::Rotating { max_size, keep }
}

// Named regressions: the failure shapes upstream engines reported (docs/prior-art.md,
// "Cache rollback bugs").

#[test]
fn multi_token_update_at_the_rotating_boundary() {
    let kind = rotating(8, 0);
    run_ops(
        kind,
        &[Op::Append(6), Op::Append(3), Op::Append(1), Op::Append(2)],
    )
    .unwrap();
    run_ops(kind, &[Op::Append(5), round(&[3], 2), Op::Append(1)]).unwrap();
}

#[test]
fn a_round_that_would_wrap_the_window_is_refused_before_it_starts() {
    let kind = rotating(4, 1);
    run_ops(kind, &[Op::Append(6), round(&[1], 1), Op::Append(1)]).unwrap();
    let mut real = real_cache(kind);
    let rec = recurrence();
    feed(&mut real, &rec, &[0, 1, 2]);
    assert!(matches!(real.rollback_plan(2, false), Rollback::Refuse(_)));
    // Asked to take back a round that wrapped anyway, the cache fails instead of trimming nothing.
    real.begin_round();
    feed(&mut real, &rec, &[3, 4]);
    assert!(real.end_round(1).is_err());
}

/// mlx-lm #1914's case made exact: a round past the window whose tokens the ring took one at a
/// time (a verify on the lone-row path) gives back the slots its rejected tokens overwrote.
#[test]
fn a_round_past_the_window_written_one_at_a_time_is_taken_back_exactly() {
    let one_at_a_time = |chunks: &[usize], reject| Op::Round {
        chunks: chunks.to_vec(),
        reject,
        one_at_a_time: true,
    };
    run_ops(
        rotating(4, 1),
        &[
            Op::Append(6),
            one_at_a_time(&[3], 2),
            Op::Append(1),
            one_at_a_time(&[1, 2], 3),
            Op::Append(2),
        ],
    )
    .unwrap();
}

/// The masks a round written one token at a time attends with (`step_masks`, worked out before
/// the round) are those each one-token step makes (`make_mask(1, window)` just before its
/// update): windows narrower than the ring included, whose masks are arrays.
#[test]
fn step_masks_are_the_masks_one_token_steps_make() {
    support::on_cpu();
    let mask_bits = |m: &Mask| match m {
        Mask::None => None,
        Mask::Array(a) => Some(a.astype(Dtype::Int32).unwrap().to_vec::<i32>().unwrap()),
        _ => panic!("a one-token step's mask is none or an array"),
    };
    let mut arrays = 0;
    for (max_size, keep, window) in [
        (8, 0, Some(5)),
        (6, 2, Some(4)),
        (8, 4, None),
        (5, 0, Some(5)),
    ] {
        for prompt in 1..12 {
            let mut cache = RotatingKvCache::new(max_size, keep);
            let ids: Vec<u32> = (0..prompt).collect();
            let (keys, values) = rows(&ids);
            cache.update_and_fetch(&keys, &values).unwrap();
            let planned = cache.step_masks(7, window).unwrap();
            for (t, planned) in planned.iter().enumerate() {
                let made = cache.make_mask(1, window).unwrap();
                assert_eq!(
                    mask_bits(planned),
                    mask_bits(&made),
                    "ring {max_size} keeping {keep}, window {window:?}, {prompt} prompt tokens, \
                     step {t}"
                );
                arrays += usize::from(matches!(made, Mask::Array(_)));
                let (k, v) = rows(&[prompt + t as u32]);
                cache.update_and_fetch(&k, &v).unwrap();
            }
        }
    }
    assert!(
        arrays > 0,
        "no step had an array mask; the test compared nothing but None"
    );
}

#[test]
fn quantized_trim_clamps_to_the_length() {
    run_ops(
        Kind::QuantizedKv,
        &[
            Op::Append(3),
            Op::Trim(10),
            Op::Append(2),
            Op::Trim(1),
            Op::Append(1),
        ],
    )
    .unwrap();
}

#[test]
fn rollback_after_a_recurrent_layer_replays_the_kept_tokens() {
    run_ops(
        Kind::Recurrent,
        &[
            Op::Append(3),
            round(&[2, 2], 3),
            Op::Append(1),
            round(&[3], 0),
        ],
    )
    .unwrap();
}

/// Rows of a batch step advance their recurrent states together (and, stepping again in the
/// same order, start from the last step's stacked states); each must hold what it holds advanced
/// alone, also after one of them put a state back (a row giving back a token) in between.
#[test]
fn recurrent_rows_stepped_together_hold_their_lone_states() {
    let rec = recurrence();
    let mut together: Vec<RecurrentCache> = Vec::new();
    for prompt in [&[1u32, 2][..], &[3], &[4, 5, 6]] {
        let mut c = RecurrentCache::default();
        let (qkv, a, b) = recurrent_inputs(&rec, prompt);
        c.advance(&rec, &qkv, &a, &b).unwrap();
        together.push(c);
    }
    let mut alone = together.clone();
    let mut before_last = alone[1].clone();
    let bits = |c: &RecurrentCache| {
        let s = c.current().unwrap();
        (
            s.conv.to_bytes().unwrap(),
            s.state.to_bytes().unwrap(),
            c.seen,
        )
    };
    for (step, tokens) in [[7u32, 8, 9], [10, 11, 12], [13, 14, 15], [16, 17, 18]]
        .iter()
        .enumerate()
    {
        if step == 3 {
            // Row 1 gives back the token of the step before: its state before it put back.
            let before: &RecurrentCache = &before_last;
            for c in [&mut together[1], &mut alone[1]] {
                c.restore(before.current().cloned(), before.seen);
            }
        }
        before_last = alone[1].clone();
        let (qkv, a, b) = recurrent_inputs(&rec, tokens);
        let each = |x: &Array| x.reshape(&[3, 1, -1]).unwrap();
        let mut rows: Vec<&mut RecurrentCache> = together.iter_mut().collect();
        let stacked =
            RecurrentCache::advance_together(&mut rows, &rec, &each(&qkv), &each(&a), &each(&b))
                .unwrap();
        assert!(stacked.is_some(), "step {step}: every row has a state");
        for (r, c) in alone.iter_mut().enumerate() {
            let (qkv, a, b) = recurrent_inputs(&rec, &tokens[r..r + 1]);
            c.advance(&rec, &qkv, &a, &b).unwrap();
            assert_eq!(bits(&together[r]), bits(c), "step {step}, row {r}");
        }
    }
}
