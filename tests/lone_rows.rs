//! The lone-row kernels (`verity::model::lone_rows`) compute the function the ordinary kernels
//! compute. On the GPU they exist to give each row its one-token bits (`verity bench rows`
//! measures that on the device); on a reference-BLAS CPU every kernel is already
//! row-independent, so there the lone-row path must give the ordinary path's bits exactly: a
//! wrong key extent, row order or chunk boundary shows as a difference.
#![cfg(target_os = "linux")]

mod support;

use mlx::{ops, random, Array, Dtype};
use support::bundle;
use verity::batch::Batch;
use verity::cache::Recurrence;
use verity::decode::{decode, Hooks, Request, Start};
use verity::generate::{Control, GenerateParams, GeneratedToken};
use verity::model::{lone_rows, row_products, stacked_recurrence};
use verity::speculative::{Drafter, DrafterSpec};

fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, &random::key(seed).unwrap()).unwrap()
}

#[test]
fn dense_and_quantized_products_have_the_ordinary_bits_at_every_row_count() {
    support::on_cpu();
    let w = normal(&[96, 128], 1);
    // A one-output product (qwen3_next's shared-expert gate) takes its own form.
    let gate = normal(&[1, 128], 2);
    let packed = ops::quantize(&w, 64, 4, "affine").unwrap();
    let (wq, scales, biases) = (&packed[0], &packed[1], &packed[2]);
    // Row counts around gather_qmm's chunk of QMV_ROWS rows, in a (1, T, K) packed batch.
    for rows in [1, 2, 6, 7, 8, 15] {
        let x = normal(&[1, rows, 128], 10 + rows as u64);
        for w in [&w, &gate] {
            let want = x.matmul(&w.transpose(&[]).unwrap()).unwrap();
            let got = lone_rows::dense(&x, &w.transpose(&[]).unwrap()).unwrap();
            assert_eq!(got.shape(), want.shape(), "{rows} rows");
            assert_eq!(
                got.to_bytes().unwrap(),
                want.to_bytes().unwrap(),
                "dense, {rows} rows, {} outputs",
                w.dim(0)
            );
        }
        let want =
            ops::quantized_matmul(&x, wq, scales, Some(biases), true, 64, 4, "affine").unwrap();
        let got = lone_rows::quantized(&x, wq, scales, Some(biases), 64, 4, "affine", 96).unwrap();
        assert_eq!(got.shape(), want.shape(), "{rows} rows");
        assert_eq!(
            got.to_bytes().unwrap(),
            want.to_bytes().unwrap(),
            "quantized, {rows} rows"
        );
    }
}

/// On CUDA the one-call quantized product (`verity::model::row_products`) must pass its own
/// check at the shapes of a model's projections and give each row its lone product's bits (the
/// gpu profile runs this there); elsewhere it is never taken.
#[test]
fn the_one_call_products_give_each_row_its_lone_product() {
    support::on_invariant_device();
    let cuda = mlx::default_is_cuda();
    // qmv's 16- and 8-element tiles, K with and without a remainder past whole warp steps
    // (640 = 512 + 128), each group size, 4 and 8 bits; row counts around the kernel's groups.
    for (k, n, dtype, group_size, bits) in [
        (1024, 3072, Dtype::Bfloat16, 64, 4),
        (640, 200, Dtype::Bfloat16, 32, 4),
        (512, 96, Dtype::Float16, 128, 8),
        (256, 64, Dtype::Float32, 64, 4),
    ] {
        let w = normal(&[n, k], 4).astype(dtype).unwrap();
        let q = ops::quantize(&w, group_size, bits, "affine").unwrap();
        let (w, scales, biases) = (&q[0], &q[1], &q[2]);
        for rows in [1, 2, 3, 8, 9, 32] {
            let x = normal(&[rows, k], 40 + rows as u64).astype(dtype).unwrap();
            let got = row_products::quantized(&x, w, scales, biases, group_size, bits).unwrap();
            let what = format!("{bits}-bit, group {group_size}, K {k} N {n} {dtype:?}");
            assert_eq!(got.is_some(), cuda, "{what}: taken on CUDA only");
            let Some(got) = got else { continue };
            for r in 0..rows {
                let row = x.slice_axis(0, r, r + 1).unwrap();
                let alone = ops::quantized_matmul(
                    &row,
                    w,
                    scales,
                    Some(biases),
                    true,
                    group_size,
                    bits,
                    "affine",
                )
                .unwrap();
                assert_eq!(
                    got.slice_axis(0, r, r + 1).unwrap().to_bytes().unwrap(),
                    alone.to_bytes().unwrap(),
                    "{what}, row {r} of {rows}"
                );
            }
        }
    }
}

/// (token, logprob bits) of each emitted token of each row.
type Rows = Vec<Vec<(u32, Vec<u8>)>>;

/// Three prompts decoded alone, then together in a batch: with a drafter, speculatively beside a
/// plain row; without, every row plain (a hybrid batch step's recurrence then runs over the
/// rows' stacked states).
fn decode_all(fixture: &str, drafter: Option<&DrafterSpec>) -> Rows {
    let b = bundle(fixture);
    let model = b.model();
    let drafter = drafter.map(|d| Drafter::load(d, &b).unwrap());
    let prompts: [&[u32]; 3] = [&[5, 9, 17, 33, 8], &[100, 4, 4, 61], &[7; 12]];
    let params = GenerateParams::greedy(12, Vec::new());
    let request = |prompt| Request {
        prompt,
        params: &params,
        constraint: None,
        num_draft_tokens: drafter.is_some().then_some(3),
    };
    let mut out = Rows::new();
    for prompt in prompts {
        let mut steps = Vec::new();
        let mut on_token = |t: &GeneratedToken| {
            steps.push((t.token, t.logprobs.to_bytes().unwrap()));
            Control::Continue
        };
        let hooks = Hooks::tokens(&mut on_token);
        decode(
            model,
            drafter.as_ref(),
            Start::Fresh,
            request(prompt),
            hooks,
        )
        .unwrap();
        out.push(steps);
    }
    let mut batch = Batch::new(model);
    for (i, prompt) in prompts.into_iter().enumerate() {
        let drafter = drafter.as_ref().filter(|_| i > 0);
        batch
            .add(i, drafter, Start::Fresh, request(prompt), None, None)
            .unwrap();
    }
    let mut rows = vec![Vec::new(); prompts.len()];
    while !batch.is_empty() {
        batch
            .step(&mut |i, t| {
                rows[i].push((t.token, t.logprobs.to_bytes().unwrap()));
                Control::Continue
            })
            .unwrap();
    }
    out.extend(rows);
    out
}

fn check(fixture: &str, drafter: Option<DrafterSpec>) {
    support::on_cpu();
    let ordinary = decode_all(fixture, drafter.as_ref());
    let lone = lone_rows::on_any_device(|| decode_all(fixture, drafter.as_ref()));
    assert!(
        ordinary.iter().all(|r| r.len() == 12),
        "{fixture}: every row runs 12 tokens"
    );
    assert_eq!(
        lone, ordinary,
        "{fixture}: lone-row kernels changed the bits"
    );
    assert_eq!(
        lone[3..],
        lone[..3],
        "{fixture}: a batch row differs from its request alone"
    );
}

#[test]
fn verify_and_batch_rows_of_a_dense_model_have_the_ordinary_bits() {
    check(
        "qwen3-target",
        Some(DrafterSpec::Model(support::model_dir("qwen3-draft"))),
    );
}

#[test]
fn verify_and_batch_rows_of_a_4bit_model_have_the_ordinary_bits() {
    check(
        "qwen3-target-4bit",
        Some(DrafterSpec::Model(support::model_dir("qwen3-draft-4bit"))),
    );
}

#[test]
fn verify_and_batch_rows_of_a_hybrid_model_have_the_ordinary_bits() {
    check("qwen3_5", Some(DrafterSpec::Ngram { min: 1, max: 2 }));
}

#[test]
fn plain_batch_rows_of_a_hybrid_model_have_the_ordinary_bits() {
    check("qwen3_5", None);
}

/// A hybrid batch step runs its rows' recurrence in one call where a check finds that every row
/// keeps its lone bits that way (`verity::model::stacked_recurrence`): on the CPU, whose kernels
/// are row-independent, at every shape and row count.
#[test]
fn the_stacked_recurrence_check_passes_on_the_cpu() {
    support::on_cpu();
    let (k_heads, v_heads, k_dim, v_dim, conv_kernel) = (2, 4, 16, 8, 4);
    let channels = 2 * k_heads * k_dim + v_heads * v_dim;
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        let recurrence = Recurrence {
            conv_weight: normal(&[channels, conv_kernel, 1], 1)
                .astype(dtype)
                .unwrap(),
            a_log: normal(&[v_heads], 2),
            dt_bias: normal(&[v_heads], 3),
            k_heads,
            v_heads,
            k_dim,
            v_dim,
            conv_kernel,
        };
        for rows in [1, 2, 3, 8] {
            assert!(
                stacked_recurrence::exact(&recurrence, dtype, rows),
                "{dtype:?}, {rows} rows"
            );
        }
    }
}
