//! Behaviour of the binding itself: data in and out, errors, dtypes, lists. Op values are
//! checked against Python MLX in ops_golden.rs.

use mlx::{Array, Dtype};

#[test]
fn matmul_round_trips_through_rust_slices() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let b = Array::from_slice(&[1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2]).unwrap();
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.shape(), vec![2, 2]);
    assert_eq!(c.dtype(), Dtype::Float32);
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![4.0, 5.0, 10.0, 11.0]);
}

#[test]
fn a_cxx_exception_becomes_an_error_with_mlx_message() {
    let a = Array::zeros(&[2, 3], Dtype::Float32).unwrap();
    let err = a.matmul(&a).unwrap_err().to_string();
    assert!(err.contains("[matmul]"), "{err}");
    assert!(err.contains("(2,3)"), "{err}");
}

#[test]
fn wrong_data_length_is_an_error() {
    let err = Array::from_slice(&[1.0f32, 2.0], &[3])
        .unwrap_err()
        .to_string();
    assert!(err.contains("8 bytes"), "{err}");
}

#[test]
fn reading_a_wrong_dtype_is_an_error_but_bf16_widens_to_f32() {
    let a = Array::from_slice(&[1i32, 2, 3], &[3]).unwrap();
    assert!(a.to_vec::<f32>().is_err());
    let b = Array::from_slice(&[1.5f32, -2.25], &[2])
        .unwrap()
        .astype(Dtype::Bfloat16)
        .unwrap();
    assert_eq!(b.dtype(), Dtype::Bfloat16);
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![1.5, -2.25]);
}

#[test]
fn clone_shares_and_drop_frees() {
    let a = Array::from_slice(&[3.0f32; 4], &[4]).unwrap();
    let b = a.clone();
    drop(a);
    assert_eq!(b.sum(&[], false).unwrap().item::<f32>().unwrap(), 12.0);
}

#[test]
fn std_is_the_population_deviation_over_every_axis() {
    // ddof 0 over all four elements: mean 2.5, variance (2.25 + 0.25) * 2 / 4 = 1.25.
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let std = a.std(&[], false).unwrap();
    assert_eq!(std.shape(), Vec::<i32>::new());
    assert_eq!(std.item::<f32>().unwrap(), 1.25f32.sqrt());
}

#[test]
fn split_and_concatenate_are_inverse() {
    let a = Array::arange(0.0, 10.0, 1.0, Dtype::Int32).unwrap();
    let parts = mlx::ops::split_sections(&a, &[3, 7], 0).unwrap();
    assert_eq!(
        parts.iter().map(|p| p.size()).collect::<Vec<_>>(),
        vec![3, 4, 3]
    );
    let refs: Vec<&Array> = parts.iter().collect();
    let joined = mlx::ops::concatenate(&refs, 0).unwrap();
    assert_eq!(joined.to_vec::<i32>().unwrap(), (0..10).collect::<Vec<_>>());
}

#[test]
fn dtype_names_match_python() {
    for d in [Dtype::Float32, Dtype::Bfloat16, Dtype::Uint32, Dtype::Bool] {
        assert_eq!(Dtype::from_name(d.name()), Some(d));
        let a = Array::zeros(&[1], d).unwrap();
        assert_eq!(a.dtype(), d);
    }
    assert_eq!(Dtype::from_name("float128"), None);
}

#[test]
fn version_is_the_pinned_one() {
    assert_eq!(mlx::version(), mlx::PINNED_VERSION);
}

#[test]
fn gather_mm_multiplies_each_row_by_its_indexed_matrix() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 1, 2]).unwrap();
    // Matrix 0 is the identity, matrix 1 swaps the two columns.
    let b = Array::from_slice(&[1.0f32, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0], &[2, 2, 2]).unwrap();
    // Indices in any order, then ascending (the promise `sorted_indices` makes).
    for (indices, sorted, expected) in [
        ([1u32, 0, 1], false, [2.0f32, 1.0, 3.0, 4.0, 6.0, 5.0]),
        ([0u32, 1, 1], true, [1.0f32, 2.0, 4.0, 3.0, 6.0, 5.0]),
    ] {
        let indices = Array::from_slice(&indices, &[3]).unwrap();
        let out = mlx::ops::gather_mm(&a, &b, &indices, sorted).unwrap();
        assert_eq!(out.shape(), vec![3, 1, 2]);
        assert_eq!(out.to_vec::<f32>().unwrap(), expected.to_vec());
    }
}

/// glm4_moe's router on 4 experts in 2 groups, top 2 of the best group: the group with the higher
/// top-2 sum wins, the correction bias steers that choice without entering the scores, and the
/// picked scores are renormalised and scaled.
#[test]
fn group_expert_select_keeps_the_best_groups_and_the_uncorrected_scores() {
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
    let gates = Array::from_slice(&[3.0f32, -3.0, 1.0, 1.0], &[1, 1, 4]).unwrap();
    // Group 0 sums to 1.0 (sigmoid(3) + sigmoid(-3)), group 1 to 2 sigmoid(1) = 1.46.
    for (bias, group) in [([0.0f32; 4], [2u32, 3]), ([0.0f32, 1.0, 0.0, 0.0], [0, 1])] {
        let bias = Array::from_slice(&bias, &[4]).unwrap();
        let (inds, scores) =
            mlx::compiled::group_expert_select(&gates, &bias, 2, 2, 1, 2.5, true).unwrap();
        let mut picked = inds.to_vec::<u32>().unwrap();
        let scores = scores.to_vec::<f32>().unwrap();
        let mut order: Vec<usize> = (0..2).collect();
        order.sort_by_key(|&i| picked[i]);
        picked.sort_unstable();
        assert_eq!(picked, group.to_vec());
        let raw: Vec<f32> = group
            .iter()
            .map(|&e| sigmoid([3.0, -3.0, 1.0, 1.0][e as usize]))
            .collect();
        let sum: f32 = raw.iter().sum();
        for (k, &i) in order.iter().enumerate() {
            assert!((scores[i] - raw[k] / sum * 2.5).abs() < 1e-5, "{scores:?}");
        }
    }
}
