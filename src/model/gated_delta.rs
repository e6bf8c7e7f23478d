//! mlx_lm/models/gated_delta.py on the CPU path: q/k normalization and the gated delta rule as
//! a sequential loop of compiled single-token steps (the path Python takes off Metal).

use mlx::{compiled, fast, ops, Array, Dtype, Result};

/// `normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)`: L2-normalize q and k and fold the
/// readout scale into q (rms_norm adds eps to the mean square, so eps is scaled to match).
pub fn normalize_qk(q: &Array, k: &Array, head_k_dim: i32) -> Result<(Array, Array)> {
    let inv_scale = (head_k_dim as f64).powf(-0.5);
    let inv_scale_sq = inv_scale * inv_scale;
    let eps = (1e-6 * inv_scale_sq) as f32;
    let q = fast::rms_norm(q, None, eps)?.multiply_scalar(inv_scale_sq as f32)?;
    let k = fast::rms_norm(k, None, eps)?.multiply_scalar(inv_scale as f32)?;
    Ok((q, k))
}

/// `gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)` without a mask: q, k
/// (B, T, Hk, Dk), v (B, T, Hv, Dv), a and b (B, T, Hv). Returns (y (B, T, Hv, Dv), state).
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_update(
    q: &Array,
    k: &Array,
    v: &Array,
    a: &Array,
    b: &Array,
    a_log: &Array,
    dt_bias: &Array,
    state: Option<&Array>,
) -> Result<(Array, Array)> {
    let beta = b.sigmoid()?;
    let g = compiled::compute_g(a_log, a, dt_bias)?;
    let qs = q.shape();
    let (batch, steps, hk, dk) = (qs[0], qs[1], qs[2], qs[3]);
    let (hv, dv) = (v.dim(-2), v.dim(-1));
    let mut state = match state {
        Some(s) => s.clone(),
        None => Array::zeros(&[batch, hv, dv, dk], Dtype::Float32)?,
    };
    let (mut q, mut k) = (q.clone(), k.clone());
    let repeat = hv / hk;
    if repeat > 1 {
        q = q.repeat(repeat, -2)?;
        k = k.repeat(repeat, -2)?;
    }
    let at = |x: &Array, t: i32| x.slice_axis(1, t, t + 1).and_then(|s| s.squeeze(&[1]));
    let mut ys = Vec::with_capacity(steps as usize);
    for t in 0..steps {
        let (y, next) = compiled::gated_delta_step(
            &at(&q, t)?,
            &at(&k, t)?,
            &at(v, t)?,
            &at(&g, t)?,
            &at(&beta, t)?,
            &state,
        )?;
        ys.push(y);
        state = next;
    }
    let y = ops::stack(&ys.iter().collect::<Vec<_>>(), 1)?;
    Ok((y, state))
}
