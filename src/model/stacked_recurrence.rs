//! When a batch decode step on a GPU may run its gated-DeltaNet rows' recurrence in one call
//! over their stacked states (`RecurrentCache::advance_together`) with the lone-row kernels on.
//! Row by row, the host builds and launches the conv and the delta rule once per row and layer:
//! a hybrid fixture's 8-row step took 4.5-6.5 ms on an H100 against about 1 ms for a plain
//! model's (docs/gpu-rows.md). Stacked, its conv (cuDNN's on CUDA) and its reductions see R
//! rows where a lone step's see one, and MLX picks its GPU kernels by shape; so each process
//! checks, once per shape and row count, that random rows stacked get the bits each gets alone,
//! and a shape that does not keeps the rows apart.

use mlx::{ops, random, Array, Dtype, Result};

use crate::cache::{Recurrence, RecurrentState, RecurrentStep};
use crate::model::kernel_checks::KernelChecks;

/// Whether the check passed, per element type, heads and head sizes, conv kernel and rows.
static CHECKS: KernelChecks<(Dtype, [i32; 5], i32), ()> = KernelChecks::new(
    "one recurrence over stacked rows (element type, [Hk, Hv, Dk, Dv, conv kernel], rows)",
    "the rows of a batch step run their recurrence one by one",
);

/// Whether `rows` rows of one token each, their inputs in `dtype`, get their lone bits from
/// one run of `recurrence` over their stacked states (checked the first time it is asked).
pub fn exact(recurrence: &Recurrence, dtype: Dtype, rows: i32) -> bool {
    let r = recurrence;
    let shape = [r.k_heads, r.v_heads, r.k_dim, r.v_dim, r.conv_kernel];
    let check = || Ok(stacks_exactly(r, dtype, rows)?.then_some(()));
    CHECKS.outcome((dtype, shape, rows), check).is_some()
}

/// Whether random states and inputs of `rows` rows, run together, give each row's outputs and
/// next state the bits of its run alone.
fn stacks_exactly(r: &Recurrence, dtype: Dtype, rows: i32) -> Result<bool> {
    let normal = |shape: &[i32], seed: u64, dtype: Dtype| -> Result<Array> {
        random::normal(shape, Dtype::Float32, &random::key(seed)?)?.astype(dtype)
    };
    let width = r.conv_dim();
    let from = RecurrentState {
        conv: normal(&[rows, r.conv_kernel - 1, width], 1, dtype)?,
        state: normal(&[rows, r.v_heads, r.v_dim, r.k_dim], 2, Dtype::Float32)?,
    };
    let qkv = normal(&[rows, 1, width], 3, dtype)?;
    let (a, b) = (
        normal(&[rows, 1, r.v_heads], 4, dtype)?,
        normal(&[rows, 1, r.v_heads], 5, dtype)?,
    );
    let together = r.run(Some(&from), &qkv, &a, &b)?;
    let row = |x: &Array, i: i32| x.slice_axis(0, i, i + 1);
    let alone = (0..rows)
        .map(|i| {
            let from = RecurrentState {
                conv: row(&from.conv, i)?,
                state: row(&from.state, i)?,
            };
            r.run(Some(&from), &row(&qkv, i)?, &row(&a, i)?, &row(&b, i)?)
        })
        .collect::<Result<Vec<RecurrentStep>>>()?;
    let same = |stacked: &Array, pick: fn(&RecurrentStep) -> &Array| -> Result<bool> {
        let joined = ops::concatenate(&alone.iter().map(pick).collect::<Vec<_>>(), 0)?;
        Ok(stacked.to_bytes()? == joined.to_bytes()?)
    };
    let outputs = [
        same(&together.y, |s| &s.y)?,
        same(&together.conv, |s| &s.conv)?,
        same(&together.state, |s| &s.state)?,
    ];
    if outputs.contains(&false) {
        // Which op moved the bits: the conv on its own, or what follows it.
        let input = ops::concatenate(&[&from.conv, &qkv], 1)?;
        let conv = r.conv(&input)?.to_bytes()?;
        let conv_alone = (0..rows)
            .map(|i| r.conv(&row(&input, i)?)?.to_bytes())
            .collect::<Result<Vec<_>>>()?
            .concat();
        tracing::warn!(
            "{rows} stacked recurrent rows: outputs, conv state, state the same as alone: \
             {outputs:?}; the conv alone the same: {}",
            conv == conv_alone
        );
    }
    Ok(!outputs.contains(&false))
}
