//! A batch step's attention over one shared KV cache per layer (`BatchKvCache`) gives every
//! token the bits its lone one-token step gives it over a KV cache of its own: rows of head_dim
//! 32, 64, 96 and 128, in float32 and bfloat16, with grouped KV heads, some of whose keys pass 1024
//! (where a lone step on CUDA leaves the one-pass kernel that the batch's one attention call
//! repeats), speculative rows verifying several tokens and taking rejected ones back, rows
//! joining (growing the buffer's slots and capacity) and leaving between steps; and a lone
//! speculative verify over a cache of its own. On the CPU each row (each verified query) takes a
//! call over its own keys; under the nextest `gpu` profile on CUDA, one kernel for every row.

mod support;

use mlx::{random, Array, Dtype};
use verity::cache::{BatchKvCache, KvCache, LayerCache, Mask};
use verity::model::layers::{attend_rows, rows_kernel, Rope};
use verity::model::lone_rows;
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

/// Token `t` of a (1, H, T, D) array: its (1, H, 1, D).
fn token(x: &Array, t: usize) -> Array {
    x.slice_axis(2, t as i32, t as i32 + 1).unwrap()
}

/// One step of every row, row r taking `lens[r]` tokens (a plain row 1, a speculative row's
/// verify several): the batch over `batch`, as a batch step runs it, and each row alone over
/// its own cache in `lone`, one token at a time as plain decoding takes them; every token's
/// output bits must be equal.
fn step(
    rope: &Rope,
    batch: &mut LayerCache,
    lone: &mut [LayerCache],
    lens: &[usize],
    (d, dtype): (i32, Dtype),
    seed: u64,
) {
    let t = lens.iter().sum::<usize>() as i32;
    let q = normal(&[1, Q_HEADS, t, d], dtype, seed);
    let k = normal(&[1, KV_HEADS, t, d], dtype, seed + 1);
    let v = normal(&[1, KV_HEADS, t, d], dtype, seed + 2);
    let scale = (d as f64).powf(-0.5) as f32;
    let masks = [Mask::None];
    let together = lone_rows::decode_rows(|| {
        attend_rows(
            rope,
            scale,
            &q,
            &k,
            &v,
            &masks,
            &mut LayerRows::one(batch, lens),
        )
    })
    .unwrap();
    let mut at = 0;
    for (r, (cache, &n)) in lone.iter_mut().zip(lens).enumerate() {
        for i in 0..n {
            let offset = cache.offset();
            let alone = attend_rows(
                rope,
                scale,
                &token(&q, at),
                &token(&k, at),
                &token(&v, at),
                &masks,
                &mut LayerRows::one(cache, &[1]),
            )
            .unwrap();
            assert_eq!(
                support::bits(&token(&together, at)),
                support::bits(&alone),
                "head_dim {d}, {dtype:?}: row {r}'s token {i} of {n}, after {offset} keys, \
                 differs from its lone step"
            );
            at += 1;
        }
    }
}

/// Takes back each row's last `rejected[r]` tokens, in the batch and in its lone cache.
fn reject(batch: &mut LayerCache, lone: &mut [LayerCache], rejected: &[usize]) {
    let LayerCache::Batch(shared) = batch else {
        unreachable!()
    };
    for (r, (cache, &n)) in lone.iter_mut().zip(rejected).enumerate() {
        shared.trim(r, n).unwrap();
        cache.trim(n).unwrap();
    }
}

fn check(d: i32, dtype: Dtype) {
    support::on_invariant_device();
    // On CUDA the one kernel must have passed its own check, or the rows below would only prove
    // the call per row it falls back to.
    if mlx::default_is_cuda() {
        assert!(
            rows_kernel::verified(dtype, d),
            "head_dim {d}, {dtype:?}: the one-call batch attention differs from MLX's call"
        );
    }
    let rope = Rope::new(d, 10000.0, false, None).unwrap();
    let shape = (d, dtype);
    // Rows past 1024 keys where a shared buffer keeps every row's lone attention; on CUDA in
    // half precision only rows below cuDNN's decode kernel (256 keys) share one.
    let long = BatchKvCache::keeps_lone_attention(dtype, 1400);
    let (lens, joining) = if long {
        ([1, 31, 1000, 1022, 300], [1300, 7, 64, 2, 90])
    } else {
        ([1, 31, 100, 230, 150], [220, 7, 64, 2, 90])
    };
    let mut lone: Vec<LayerCache> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| filled(len, d, dtype, 100 + 10 * i as u64))
        .collect();
    let rows: Vec<&KvCache> = lone.iter().map(kv).collect();
    let mut batch = LayerCache::Batch(BatchKvCache::gather(&rows).unwrap());
    for s in 0..3 {
        step(&rope, &mut batch, &mut lone, &[1; 5], shape, 1000 + 10 * s);
    }
    // Speculative rounds: verifies of several tokens beside plain rows (one crossing 1024
    // keys), their rejected drafts taken back, then plain steps over what was kept.
    step(&rope, &mut batch, &mut lone, &[4, 1, 2, 3, 1], shape, 1100);
    reject(&mut batch, &mut lone, &[2, 0, 1, 3, 0]);
    step(&rope, &mut batch, &mut lone, &[1, 2, 1, 4, 1], shape, 1200);
    reject(&mut batch, &mut lone, &[0, 1, 0, 0, 0]);
    step(&rope, &mut batch, &mut lone, &[1; 5], shape, 1300);
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
    for (i, len) in joining.into_iter().enumerate() {
        let joining = filled(len, d, dtype, 500 + 10 * i as u64);
        shared.join(kv(&joining)).unwrap();
        lone.push(joining);
    }
    assert_eq!(shared.rows(), 9);
    for s in 0..2 {
        step(&rope, &mut batch, &mut lone, &[1; 9], shape, 2000 + 10 * s);
    }
    step(
        &rope,
        &mut batch,
        &mut lone,
        &[1, 3, 1, 1, 4, 1, 2, 1, 1],
        shape,
        2100,
    );
}

/// A lone speculative verify of `n` tokens after `len` keys, over its own KV cache (the lone-row
/// path: on CUDA one call of the rows kernels for all its queries, else a call per query), must
/// give every token the bits of its one-token step.
fn verify_alone(len: i32, n: usize, (d, dtype): (i32, Dtype), seed: u64) {
    let rope = Rope::new(d, 10000.0, false, None).unwrap();
    let mut verified = filled(len, d, dtype, seed);
    let mut stepped = filled(len, d, dtype, seed);
    let q = normal(&[1, Q_HEADS, n as i32, d], dtype, seed + 10);
    let k = normal(&[1, KV_HEADS, n as i32, d], dtype, seed + 11);
    let v = normal(&[1, KV_HEADS, n as i32, d], dtype, seed + 12);
    let scale = (d as f64).powf(-0.5) as f32;
    let lens = [n];
    let together = lone_rows::decode_rows(|| {
        let mut rows = LayerRows::one(&mut verified, &lens);
        attend_rows(&rope, scale, &q, &k, &v, &[Mask::Causal], &mut rows)
    })
    .unwrap();
    for t in 0..n {
        let alone = attend_rows(
            &rope,
            scale,
            &token(&q, t),
            &token(&k, t),
            &token(&v, t),
            &[Mask::None],
            &mut LayerRows::one(&mut stepped, &[1]),
        )
        .unwrap();
        assert_eq!(
            support::bits(&token(&together, t)),
            support::bits(&alone),
            "head_dim {d}, {dtype:?}: a lone verify's token {t} of {n} after {len} keys \
             differs from its one-token step"
        );
    }
}

fn check_verifies(d: i32, dtype: Dtype) {
    support::on_invariant_device();
    lone_rows::on_any_device(|| {
        let long = BatchKvCache::keeps_lone_attention(dtype, 1400);
        let lens = if long {
            [1, 31, 1000, 1022]
        } else {
            [1, 31, 100, 230]
        };
        for (i, (len, n)) in lens.into_iter().zip([2, 4, 3, 4]).enumerate() {
            verify_alone(len, n, (d, dtype), 3000 + 100 * i as u64);
        }
    });
}

/// Batch rows and lone verifies at head size `d` in each of `dtypes`.
fn rows_and_verifies(d: i32, dtypes: [Dtype; 2]) {
    for dtype in dtypes {
        check(d, dtype);
        check_verifies(d, dtype);
    }
}

/// Head_dim 32, which MLX attends unfused on CUDA: there a lone step and a batch both attend
/// through the rows kernels (`rows_kernel::alone`).
#[test]
fn head_dim_32_rows_equal_their_lone_steps() {
    rows_and_verifies(32, [Dtype::Float32, Dtype::Bfloat16]);
}

#[test]
fn head_dim_64_rows_equal_their_lone_steps() {
    rows_and_verifies(64, [Dtype::Float32, Dtype::Bfloat16]);
}

#[test]
fn head_dim_96_rows_equal_their_lone_steps() {
    rows_and_verifies(96, [Dtype::Float32, Dtype::Float16]);
}

#[test]
fn head_dim_128_rows_equal_their_lone_steps() {
    rows_and_verifies(128, [Dtype::Float32, Dtype::Bfloat16]);
}

/// On CUDA a lone step in half precision over 256 keys or more, sliced from a buffer of a
/// multiple of 256 positions, runs cuDNN's decode kernel, which no call over a shared buffer
/// repeats: golden replay (mlx-lm's buffers) keeps such rows apart, while verity's own decoding
/// keeps its buffers off those capacities and shares rows of any length. Everywhere else, and
/// in float32, rows of any length share.
#[test]
fn half_precision_rows_share_past_256_keys_unless_replaying_mlx_lms_buffers_on_cuda() {
    support::on_invariant_device();
    let cuda = mlx::default_is_cuda();
    for dtype in [Dtype::Float16, Dtype::Bfloat16] {
        assert!(BatchKvCache::keeps_lone_attention(dtype, 255));
        assert!(BatchKvCache::keeps_lone_attention(dtype, 256));
        lone_rows::oracle_kernels(|| {
            assert!(BatchKvCache::keeps_lone_attention(dtype, 255));
            assert_eq!(BatchKvCache::keeps_lone_attention(dtype, 256), !cuda);
        });
    }
    assert!(BatchKvCache::keeps_lone_attention(Dtype::Float32, 100_000));
}

/// The capacities a lone KV cache of `dtype` keys takes as it is fed `chunks` tokens at a time,
/// and the keys it then holds.
fn grown(dtype: Dtype, chunks: &[i32]) -> (Vec<i32>, Vec<u8>) {
    let mut cache = LayerCache::Kv(KvCache::default());
    let mut capacities = Vec::new();
    for (i, &n) in chunks.iter().enumerate() {
        let k = normal(&[1, KV_HEADS, n, 64], dtype, 700 + i as u64);
        cache.update_and_fetch(&k, &k).unwrap();
        capacities.push(kv(&cache).capacity());
    }
    let (keys, _) = cache.visible().unwrap().unwrap();
    (capacities, support::bits(&keys))
}

/// Verity's own decoding keeps a half-precision KV buffer's capacity off multiples of 256 (one
/// position more), so that its steps past 256 keys take MLX's vector kernel, which the shared
/// buffer's one call repeats, never cuDNN's decode kernel, whose bits change from run to run:
/// on CUDA, and on the CPU where the tests take CUDA's paths. Growth from every kind of offset
/// keeps every key; golden replay and float32 keep mlx-lm's capacities.
#[test]
fn half_precision_buffers_keep_off_cudnns_decode_kernel() {
    support::on_cpu();
    let chunks = [255, 1, 1, 254, 3, 256, 1];
    let (mlx_lm, keys) = lone_rows::oracle_kernels(|| grown(Dtype::Bfloat16, &chunks));
    assert_eq!(mlx_lm, [256, 256, 512, 512, 767, 770, 1026]);
    let (own, own_keys) = lone_rows::on_any_device(|| grown(Dtype::Bfloat16, &chunks));
    assert_eq!(own, [257, 257, 257, 513, 767, 770, 1026]);
    assert!(own.iter().all(|c| c % 256 != 0));
    assert_eq!(
        own_keys, keys,
        "a buffer grown with a position more lost a key"
    );
    let (f32, _) = lone_rows::on_any_device(|| grown(Dtype::Float32, &chunks));
    assert_eq!(f32, mlx_lm);
    assert_eq!(
        grown(Dtype::Bfloat16, &chunks).0,
        mlx_lm,
        "the CPU's own path"
    );

    // A row leaving a shared buffer takes the capacity its own cache would have.
    lone_rows::on_any_device(|| {
        let rows = [300, 40].map(|len| filled(len, 64, Dtype::Bfloat16, len as u64));
        let own: Vec<&KvCache> = rows.iter().map(kv).collect();
        let mut shared = BatchKvCache::gather(&own).unwrap();
        assert_eq!(shared.leave(0).unwrap().capacity(), 513);
    });
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
