//! A batch step's attention over one shared KV cache per layer (`BatchKvCache`) gives every row
//! the bits its lone step gives it over a KV cache of its own: rows of head_dim 64, 96 and 128,
//! in float32 and bfloat16, with grouped KV heads, some of whose keys pass 1024 (where a lone
//! step on CUDA leaves the one-pass kernel that the batch's one attention call repeats), rows
//! joining (growing the buffer's slots and capacity) and leaving between steps. On the CPU each
//! row takes a call over its own keys; under the nextest `gpu` profile on CUDA, one kernel for
//! every row.

mod support;

use mlx::{random, Array, Dtype};
use verity::cache::{BatchKvCache, KvCache, LayerCache, Mask};
use verity::model::layers::{attend_rows, rows_kernel, Rope};
use verity::model::rows::LayerRows;

const Q_HEADS: i32 = 4;
const KV_HEADS: i32 = 2;

fn normal(shape: &[i32], dtype: Dtype, seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, &random::key(seed).unwrap())
        .unwrap()
        .astype(dtype)
        .unwrap()
}

/// A lone KV cache holding `len` random tokens.
fn filled(len: i32, d: i32, dtype: Dtype, seed: u64) -> LayerCache {
    let mut cache = LayerCache::Kv(KvCache::default());
    let (k, v) = (
        normal(&[1, KV_HEADS, len, d], dtype, seed),
        normal(&[1, KV_HEADS, len, d], dtype, seed + 1),
    );
    cache.update_and_fetch(&k, &v).unwrap();
    cache
}

fn kv(cache: &LayerCache) -> &KvCache {
    match cache {
        LayerCache::Kv(c) => c,
        _ => panic!("a lone row holds a plain KV cache"),
    }
}

/// Token `r` of a (1, H, B, D) array: row r's (1, H, 1, D).
fn row(x: &Array, r: usize) -> Array {
    x.slice_axis(2, r as i32, r as i32 + 1).unwrap()
}

/// One step of every row: the batch over `batch`, and each row alone over its own cache in
/// `lone`; every row's output bits must be equal.
fn step(
    rope: &Rope,
    batch: &mut LayerCache,
    lone: &mut [LayerCache],
    d: i32,
    dtype: Dtype,
    seed: u64,
) {
    let b = lone.len() as i32;
    let q = normal(&[1, Q_HEADS, b, d], dtype, seed);
    let k = normal(&[1, KV_HEADS, b, d], dtype, seed + 1);
    let v = normal(&[1, KV_HEADS, b, d], dtype, seed + 2);
    let scale = (d as f64).powf(-0.5) as f32;
    let ones = vec![1; lone.len()];
    let masks = [Mask::None];
    let together = attend_rows(
        rope,
        scale,
        &q,
        &k,
        &v,
        &masks,
        &mut LayerRows::one(batch, &ones),
    )
    .unwrap();
    for (r, cache) in lone.iter_mut().enumerate() {
        let offset = cache.offset();
        let alone = attend_rows(
            rope,
            scale,
            &row(&q, r),
            &row(&k, r),
            &row(&v, r),
            &masks,
            &mut LayerRows::one(cache, &[1]),
        )
        .unwrap();
        assert_eq!(
            support::bits(&row(&together, r)),
            support::bits(&alone),
            "head_dim {d}, {dtype:?}: row {r} after {offset} keys differs from its lone step"
        );
    }
}

fn check(d: i32, dtype: Dtype) {
    support::on_invariant_device();
    // On CUDA the one kernel must have passed its own check, or the rows below would only prove
    // the call per row it falls back to.
    if mlx::default_device() == mlx::Device::Gpu && mlx::Device::Gpu.name() == "cuda" {
        assert!(
            rows_kernel::verified(dtype, d),
            "head_dim {d}, {dtype:?}: the one-call batch attention differs from MLX's call"
        );
    }
    let rope = Rope::new(d, 10000.0, false, None).unwrap();
    let mut lone: Vec<LayerCache> = [1, 31, 1000, 1022, 300]
        .iter()
        .enumerate()
        .map(|(i, &len)| filled(len, d, dtype, 100 + 10 * i as u64))
        .collect();
    let rows: Vec<&KvCache> = lone.iter().map(kv).collect();
    let mut batch = LayerCache::Batch(BatchKvCache::gather(&rows).unwrap());
    for s in 0..4 {
        step(&rope, &mut batch, &mut lone, d, dtype, 1000 + 10 * s);
    }
    // Row 1 leaves as the cache it would be alone; rows join past the buffer's capacity and
    // its slots (nine rows where it held eight).
    let LayerCache::Batch(shared) = &mut batch else {
        unreachable!()
    };
    let left = LayerCache::Kv(shared.leave(1).unwrap());
    let own = lone.remove(1);
    let visible = |c: &LayerCache| {
        let (k, v) = c.visible().unwrap().unwrap();
        (support::bits(&k), support::bits(&v))
    };
    assert_eq!(
        visible(&left),
        visible(&own),
        "a row that left kept other keys"
    );
    for (i, len) in [1300, 7, 64, 2, 90].into_iter().enumerate() {
        let joining = filled(len, d, dtype, 500 + 10 * i as u64);
        shared.join(kv(&joining)).unwrap();
        lone.push(joining);
    }
    assert_eq!(shared.rows(), 9);
    for s in 0..3 {
        step(&rope, &mut batch, &mut lone, d, dtype, 2000 + 10 * s);
    }
}

#[test]
fn head_dim_64_rows_equal_their_lone_steps() {
    check(64, Dtype::Float32);
    check(64, Dtype::Bfloat16);
}

#[test]
fn head_dim_96_rows_equal_their_lone_steps() {
    check(96, Dtype::Float32);
    check(96, Dtype::Float16);
}

#[test]
fn head_dim_128_rows_equal_their_lone_steps() {
    check(128, Dtype::Float32);
    check(128, Dtype::Bfloat16);
}

#[test]
fn rows_share_a_buffer_only_while_it_pads_them_at_most_twice() {
    assert!(BatchKvCache::fits(&[1000, 1000]));
    assert!(BatchKvCache::fits(&[1000, 10]));
    assert!(BatchKvCache::fits(&[100; 32]));
    assert!(!BatchKvCache::fits(&[2000, 100, 100, 100]));
    let mut lens = vec![100; 31];
    lens.push(8000);
    assert!(!BatchKvCache::fits(&lens));

    support::on_cpu();
    let rows: Vec<LayerCache> = [2000, 600, 700]
        .iter()
        .enumerate()
        .map(|(i, &len)| filled(len, 64, Dtype::Float32, 10 * i as u64))
        .collect();
    let own: Vec<&KvCache> = rows.iter().map(kv).collect();
    let mut shared = BatchKvCache::gather(&own).unwrap();
    assert!(!shared.outgrown());
    shared.leave(0).unwrap();
    assert!(
        shared.outgrown(),
        "rows of 600 and 700 keys held in slots of 2048"
    );
}
