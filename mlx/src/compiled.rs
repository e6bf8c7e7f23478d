//! Functions traced once with `mx::compile` in the shim, each a literal copy of a function that
//! mlx-lm or mlx.nn wraps in `mx.compile`. Fused kernels may round differently from the same ops
//! unfused (FMA contraction on AVX2 builds, docs/parity-notes.md G4), so verity takes the same
//! compiled path Python takes rather than relying on the two agreeing.

use crate::array::List;
use crate::ffi::bridge::{self as ffi, Kernel};
use crate::{Array, Error, Result};

fn call_all(kernel: Kernel, inputs: &[&Array]) -> Result<Vec<Array>> {
    List::from_raw(ffi::call_kernel(
        kernel,
        &List::new(inputs.iter().copied()).raw,
    )?)
    .into_vec()
}

fn call(kernel: Kernel, inputs: &[&Array]) -> Result<Array> {
    call_all(kernel, inputs)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::Invalid("compiled kernel returned nothing".into()))
}

/// `mlx.nn.silu`: `x * sigmoid(x)`.
pub fn silu(x: &Array) -> Result<Array> {
    call(Kernel::Silu, &[x])
}

/// `mlx_lm.models.activations.swiglu`: `silu(gate) * x`.
pub fn swiglu(gate: &Array, x: &Array) -> Result<Array> {
    call(Kernel::Swiglu, &[gate, x])
}

/// `mlx.nn.gelu_approx`: `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`.
pub fn gelu_approx(x: &Array) -> Result<Array> {
    call(Kernel::GeluApprox, &[x])
}

/// `mlx_lm.models.gemma4_text.geglu(gate, x)`: `gelu_approx(gate) * x` as one compiled graph.
pub fn geglu(gate: &Array, x: &Array) -> Result<Array> {
    call(Kernel::Geglu, &[gate, x])
}

/// `mlx_lm.models.gemma4_text.logit_softcap(softcap, x)`: `tanh(x / softcap) * softcap`, with
/// `softcap` a scalar in `x`'s dtype.
pub fn logit_softcap(x: &Array, softcap: &Array) -> Result<Array> {
    call(Kernel::LogitSoftcap, &[x, softcap])
}

/// `mlx.nn.softplus`: `logaddexp(x, 0)`.
pub fn softplus(x: &Array) -> Result<Array> {
    call(Kernel::Softplus, &[x])
}

/// `mlx.nn.sigmoid` (the compiled module function, not `mx.sigmoid`).
pub fn sigmoid(x: &Array) -> Result<Array> {
    call(Kernel::Sigmoid, &[x])
}

/// `mlx_lm.models.activations.precise_swiglu(h, gate, x)`: `silu(gate) * x` in f32, cast to
/// `h`'s dtype.
pub fn precise_swiglu(h: &Array, gate: &Array, x: &Array) -> Result<Array> {
    call(Kernel::PreciseSwiglu, &[h, gate, x])
}

/// `mlx_lm.models.gated_delta.compute_g`: the per-head decay
/// `exp(-exp(A_log) * softplus(a + dt_bias))` in f32.
pub fn compute_g(a_log: &Array, a: &Array, dt_bias: &Array) -> Result<Array> {
    call(Kernel::ComputeG, &[a_log, a, dt_bias])
}

/// `mlx_lm.models.gated_delta._gated_delta_step_ops` for one token with a scalar gate per head
/// and no mask: q, k (B, H, Dk), v (B, H, Dv), g and beta (B, H), state (B, H, Dv, Dk) f32.
/// Returns (y (B, H, Dv) in q's dtype, the new state).
pub fn gated_delta_step(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array)> {
    let mut out = call_all(Kernel::GatedDeltaStep, &[q, k, v, g, beta, state])?.into_iter();
    match (out.next(), out.next()) {
        (Some(y), Some(s)) => Ok((y, s)),
        _ => Err(Error::Invalid("gated_delta_step returns (y, state)".into())),
    }
}

/// mlx-lm glm4_moe's `group_expert_select`: sigmoid router scores in f32, the
/// `e_score_correction_bias` added for the choice only, the `n_group - topk_group` groups with
/// the lowest top-2 sums zeroed, the top `top_k` experts of what is left, their uncorrected
/// scores (renormalised when `norm_topk_prob` and `top_k > 1`) times `routed_scaling_factor`.
/// Returns (indices (..., top_k) uint32, scores (..., top_k) f32).
pub fn group_expert_select(
    gates: &Array,
    bias: &Array,
    top_k: i32,
    n_group: i32,
    topk_group: i32,
    routed_scaling_factor: f32,
    norm_topk_prob: bool,
) -> Result<(Array, Array)> {
    let out = List::from_raw(ffi::group_expert_select(
        gates.ffi(),
        bias.ffi(),
        top_k,
        n_group,
        topk_group,
        routed_scaling_factor,
        norm_topk_prob,
    )?)
    .into_vec()?;
    let mut out = out.into_iter();
    match (out.next(), out.next()) {
        (Some(inds), Some(scores)) => Ok((inds, scores)),
        _ => Err(Error::Invalid(
            "group_expert_select returns (inds, scores)".into(),
        )),
    }
}
