//! The invariant behind verity's transposed dense weights on Linux CPUs
//! (`mlx::CPU_MATMUL_IS_REFERENCE_BLAS`): with the wheel's reference BLAS, `x @ w.T` and
//! `x @ t` with `t` the contiguous copy of `w.T` are the same bits. Should a future wheel bundle
//! another BLAS, this fails before any golden does. (macOS builds keep the stored layout.)
#![cfg(target_os = "linux")]

use mlx::{random, Array, Device, Dtype};

fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, &random::key(seed).unwrap()).unwrap()
}

fn bits(a: &Array) -> Vec<u32> {
    a.to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

#[test]
fn an_f32_matmul_has_the_same_bits_whichever_operand_layout_on_a_reference_blas_cpu() {
    mlx::set_default_device(Device::Cpu).unwrap();
    // (batch, rows, inner, out): decode, verify widths, prefill, and a 3-D input as models pass.
    for (i, &(batch, m, k, n)) in [
        (1, 1, 128, 384),
        (1, 2, 384, 128),
        (1, 5, 64, 1024),
        (2, 8, 96, 40),
        (1, 33, 1000, 7),
    ]
    .iter()
    .enumerate()
    {
        let x = normal(&[batch, m, k], 2 * i as u64);
        let w = normal(&[n, k], 2 * i as u64 + 1);
        let t = w.transpose(&[]).unwrap().contiguous().unwrap();
        let as_stored = x.matmul(&w.transpose(&[]).unwrap()).unwrap();
        let transposed = x.matmul(&t).unwrap();
        mlx::eval([&as_stored, &transposed]).unwrap();
        assert_eq!(
            bits(&as_stored),
            bits(&transposed),
            "x ({batch}, {m}, {k}) against w ({n}, {k})"
        );
    }
}
