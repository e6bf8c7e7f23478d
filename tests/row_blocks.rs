//! A long chunk's attention computed in blocks of query rows on a reference-BLAS CPU
//! (`verity::model::row_blocks`) must be the one-call attention's bits, under every mask a
//! cache hands the attention: causal (with and without earlier keys), a sliding-window array,
//! and none.
#![cfg(target_os = "linux")]

mod support;

use mlx::fast;
use mlx::{random, Array, Dtype};
use verity::cache::{create_causal_mask, Mask};
use verity::model::row_blocks::{attend_in_row_blocks, rows_per_block};

fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, &random::key(seed).unwrap()).unwrap()
}

#[test]
fn attention_in_row_blocks_has_the_one_call_bits() {
    support::on_cpu();
    let (heads, kv_heads, head_dim) = (4, 2, 32);
    // (queries, earlier keys, mask): a whole prompt, a later chunk, a sliding window, no mask.
    let cases: [(i32, i32, &str); 4] = [
        (400, 0, "causal"),
        (200, 1000, "causal"),
        (450, 50, "window"),
        (400, 0, "none"),
    ];
    for (i, &(rows, earlier, kind)) in cases.iter().enumerate() {
        let keys_len = rows + earlier;
        let seed = 3 * i as u64;
        let q = normal(&[1, heads, rows, head_dim], seed);
        let k = normal(&[1, kv_heads, keys_len, head_dim], seed + 1);
        let v = normal(&[1, kv_heads, keys_len, head_dim], seed + 2);
        let mask = match kind {
            "causal" => Mask::Causal,
            "window" => {
                Mask::Array(create_causal_mask(rows as usize, earlier as usize, Some(128)).unwrap())
            }
            _ => Mask::None,
        };
        let block = rows_per_block(&q).expect("a chunk this long is split");
        assert!(block < rows, "{kind}: block {block} of {rows} rows");
        let one_call =
            fast::scaled_dot_product_attention(&q, &k, &v, 0.125, mask.as_sdpa().unwrap(), None)
                .unwrap();
        let blocks = attend_in_row_blocks(&q, &k, &v, 0.125, &mask, block).unwrap();
        mlx::eval([&one_call, &blocks]).unwrap();
        assert_eq!(blocks.shape(), one_call.shape(), "{kind}, {rows} rows");
        assert!(
            blocks.to_bytes().unwrap() == one_call.to_bytes().unwrap(),
            "{kind}, {rows} rows after {earlier}: other bits"
        );
    }
}

#[test]
fn decode_and_verify_widths_attend_in_one_call() {
    support::on_cpu();
    for rows in [1, 2, 8, 32] {
        let q = normal(&[1, 4, rows, 32], 0);
        assert_eq!(rows_per_block(&q), None, "{rows} rows");
    }
}
