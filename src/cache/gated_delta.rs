//! mlx_lm/models/gated_delta.py on the CPU path: q/k normalization and the gated delta rule as
//! a sequential loop of compiled single-token steps (the path Python takes off Metal), plus the
//! causal conv in front of it, packaged as a [`Recurrence`] a recurrent cache can replay. It
//! lives with the cache rather than the models because a rollback replays it without a model.

use mlx::{compiled, fast, ops, Array, Dtype, Result};

use super::RecurrentState;

/// The recurrent part of a gated-DeltaNet layer: causal depthwise conv over the last K inputs,
/// then the gated delta rule. Cloning is cheap (arrays share their buffers); a recurrent cache
/// keeps a clone so it can replay tokens after a rollback without the model.
#[derive(Clone)]
pub struct Recurrence {
    pub conv_weight: Array,
    pub a_log: Array,
    pub dt_bias: Array,
    pub k_heads: i32,
    pub v_heads: i32,
    pub k_dim: i32,
    pub v_dim: i32,
    pub conv_kernel: i32,
}

/// What [`Recurrence::run`] leaves behind.
pub struct RecurrentStep {
    /// (B, S, Hv, Dv) outputs.
    pub y: Array,
    /// The last K-1 conv inputs.
    pub conv: Array,
    /// The f32 delta-rule state.
    pub state: Array,
}

impl Recurrence {
    /// The conv's channels: q, k and v side by side.
    pub fn conv_dim(&self) -> i32 {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// The depthwise conv over `conv_input` (B, K - 1 + S, conv_dim): (B, S, conv_dim).
    pub fn conv(&self, conv_input: &Array) -> Result<Array> {
        ops::conv1d(conv_input, &self.conv_weight, 1, 0, 1, self.conv_dim())
    }

    /// Feeds S tokens' projected inputs — `mixed_qkv` (B, S, conv_dim), `a` and `b` (B, S, Hv)
    /// — through the conv and the delta rule, starting from `from` (zeros if None).
    pub fn run(
        &self,
        from: Option<&RecurrentState>,
        mixed_qkv: &Array,
        a: &Array,
        b: &Array,
    ) -> Result<RecurrentStep> {
        let (bsz, s) = (mixed_qkv.dim(0), mixed_qkv.dim(1));
        let conv_state = match from {
            Some(f) => f.conv.clone(),
            None => Array::zeros(
                &[bsz, self.conv_kernel - 1, self.conv_dim()],
                mixed_qkv.dtype(),
            )?,
        };
        let conv_input = ops::concatenate(&[&conv_state, mixed_qkv], 1)?;
        let n = conv_input.dim(1);
        let conv = conv_input
            .slice_axis(1, n - (self.conv_kernel - 1), n)?
            .contiguous()?;
        let conv_out = compiled::silu(&self.conv(&conv_input)?)?;
        let kd = self.k_heads * self.k_dim;
        let parts = ops::split_sections(&conv_out, &[kd, 2 * kd], -1)?;
        let q = parts[0].reshape(&[bsz, s, self.k_heads, self.k_dim])?;
        let k = parts[1].reshape(&[bsz, s, self.k_heads, self.k_dim])?;
        let v = parts[2].reshape(&[bsz, s, self.v_heads, self.v_dim])?;
        let (q, k) = normalize_qk(&q, &k, self.k_dim)?;
        let state = from.map(|f| &f.state);
        let (y, state) = gated_delta_update(&q, &k, &v, a, b, &self.a_log, &self.dt_bias, state)?;
        Ok(RecurrentStep { y, conv, state })
    }
}

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
