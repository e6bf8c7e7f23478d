//! The invariant behind verity's batch decode step (src/model/layers/attention.rs,
//! `decode_rows`): `fast::rope_at` over B rows, row b at offset b's, gives every row the bits
//! `fast::rope` gives it alone at that offset, for contiguous and strided inputs, both
//! layouts, partial rotation and precomputed frequencies. On the CPU (verity's batch ≡ single
//! guarantee is the CPU's).

use mlx::fast::{rope, rope_at, RopeFreqs};
use mlx::{random, Array, Device, Dtype};

fn bits(a: &Array) -> Vec<u32> {
    a.to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

#[test]
fn rope_at_per_row_offsets_has_each_rows_lone_bits() {
    mlx::set_default_device(Device::Cpu).unwrap();
    let offsets = [17, 5, 40, 0, 1023];
    let b = offsets.len() as i32;
    let at = Array::from_slice(&offsets, &[b]).unwrap();
    let key = random::key(3).unwrap();
    let contiguous = random::normal(&[b, 4, 1, 32], Dtype::Float32, &key).unwrap();
    // As the decode step lays rows out: (1, B, heads, D) transposed to (B, heads, 1, D).
    let strided = random::normal(&[1, b, 4, 32], Dtype::Float32, &key)
        .unwrap()
        .transpose(&[1, 2, 0, 3])
        .unwrap();
    let freqs = Array::from_slice(&[1.0f32, 0.5, 0.25, 0.125], &[4]).unwrap();
    for x in [&contiguous, &strided] {
        for (dims, traditional, f) in [
            (32, false, RopeFreqs::Base(1e6)),
            (8, true, RopeFreqs::Base(1e4)),
            (8, false, RopeFreqs::Freqs(&freqs)),
        ] {
            let all = rope_at(x, dims, traditional, f, 1.0, &at).unwrap();
            for (r, &offset) in offsets.iter().enumerate() {
                let row = |a: &Array| a.slice_axis(0, r as i32, r as i32 + 1).unwrap();
                let alone = rope(&row(x), dims, traditional, f, 1.0, offset).unwrap();
                assert_eq!(
                    bits(&row(&all)),
                    bits(&alone),
                    "row {r} at offset {offset}, dims {dims}, traditional {traditional}"
                );
            }
        }
    }
}
