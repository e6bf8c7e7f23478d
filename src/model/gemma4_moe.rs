//! mlx_lm/models/gemma4_text.py's MoE block: with `enable_moe_block`, each layer adds a sparse
//! block beside its MLP, its own router (a scaled RMS norm, a projection, argpartition's top k,
//! softmax, a per-expert scale) over SwitchGLU experts with the GeGLU activation.

use mlx::{fast, ops, Array};

use super::layers::{Activation, Linear, RmsNorm, SwitchGlu};
use super::router_margin;
use crate::load::{LoadError, LoadResult, QuantConfig, Weights};

/// The MoE block's sizes, checked (mlx-lm takes them unchecked: a top k outside 1..=experts
/// makes argpartition fail or pick every expert).
#[derive(Clone, Copy)]
pub struct MoeSizes {
    experts: i32,
    top_k: i32,
    hidden: i32,
}

impl MoeSizes {
    /// The sizes `enable_moe_block` asks for from the config's `num_experts`, `top_k_experts`
    /// and `moe_intermediate_size`; None without the block.
    pub fn from_config(
        enabled: bool,
        num_experts: Option<i32>,
        top_k_experts: Option<i32>,
        moe_intermediate_size: Option<i32>,
    ) -> std::result::Result<Option<MoeSizes>, String> {
        if !enabled {
            return Ok(None);
        }
        let need = |key: &str, v: Option<i32>| match v {
            Some(v) if v >= 1 => Ok(v),
            Some(v) => Err(format!(
                "{key} is {v}, must be at least 1 when enable_moe_block is true"
            )),
            None => Err(format!(
                "{key} is missing, needed when enable_moe_block is true"
            )),
        };
        let experts = need("num_experts", num_experts)?;
        let top_k = need("top_k_experts", top_k_experts)?;
        if top_k > experts {
            return Err(format!(
                "top_k_experts is {top_k}, must be between 1 and num_experts ({experts})"
            ));
        }
        let hidden = need("moe_intermediate_size", moe_intermediate_size)?;
        Ok(Some(MoeSizes {
            experts,
            top_k,
            hidden,
        }))
    }
}

/// The MoE block of a layer: Router, Experts and its three extra norms.
pub struct Moe {
    proj: Linear,
    /// `scale * hidden_size**-0.5`, the product Python forms on every call.
    norm_weight: Array,
    per_expert_scale: Array,
    top_k: i32,
    eps: f32,
    experts: SwitchGlu,
    pub post_feedforward_layernorm_1: RmsNorm,
    pub post_feedforward_layernorm_2: RmsNorm,
    pub pre_feedforward_layernorm_2: RmsNorm,
}

impl Moe {
    /// The block of the layer at `p` (`model.layers.N`), `h` wide, with `eps` for its norms.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        p: &str,
        h: i32,
        m: MoeSizes,
        eps: f64,
    ) -> LoadResult<Moe> {
        let router = format!("{p}.router");
        let mut experts = SwitchGlu::load(
            w,
            q,
            &format!("{p}.experts.switch_glu"),
            h,
            m.hidden,
            m.experts,
        )?;
        experts.activation = Activation::Geglu;
        let scale = w.take_shaped(&format!("{router}.scale"), &[h])?;
        let root = (f64::from(h).powf(-0.5)) as f32;
        let norm = |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), h, eps);
        Ok(Moe {
            proj: Linear::load(w, q, &format!("{router}.proj"), h, m.experts, false)?,
            norm_weight: scale.multiply_scalar(root).map_err(mlx_error(w))?,
            per_expert_scale: w.take_shaped(&format!("{router}.per_expert_scale"), &[m.experts])?,
            top_k: m.top_k,
            eps: eps as f32,
            experts,
            post_feedforward_layernorm_1: norm(w, "post_feedforward_layernorm_1")?,
            post_feedforward_layernorm_2: norm(w, "post_feedforward_layernorm_2")?,
            pre_feedforward_layernorm_2: norm(w, "pre_feedforward_layernorm_2")?,
        })
    }

    /// Router.__call__ on the residual `h`, then Experts.__call__ on `x` (its normed copy).
    pub fn forward(&self, h: &Array, x: &Array) -> mlx::Result<Array> {
        let h = fast::rms_norm(h, Some(&self.norm_weight), self.eps)?;
        let scores = self.proj.forward(&h)?;
        let (e, k) = (scores.dim(-1), self.top_k);
        router_margin::note_top_k(&scores, k)?;
        let inds = ops::argpartition(&scores, -k, -1)?
            .slice_axis(-1, e - k, e)?
            .stop_gradient()?;
        let weights = ops::softmax(&ops::take_along_axis(&scores, &inds, -1)?, &[-1], false)?;
        let weights = weights.multiply(&self.per_expert_scale.take(&inds, 0)?)?;
        let y = self.experts.forward(x, &inds)?;
        weights.expand_dims(&[-1])?.multiply(&y)?.sum(&[-2], false)
    }
}

/// mlx-lm's sanitize for a Hugging Face checkpoint's fused experts: `experts.gate_up_proj`
/// (experts, 2 x hidden, dims) split in two along its middle axis, and `experts.down_proj`,
/// under SwitchGLU's names.
pub fn split_experts(w: &mut Weights) -> LoadResult<()> {
    let fused: Vec<String> = w
        .keys()
        .filter(|k| k.ends_with(".experts.gate_up_proj") || k.ends_with(".experts.down_proj"))
        .cloned()
        .collect();
    for key in fused {
        let v = w.take(&key)?;
        if let Some(base) = key.strip_suffix(".gate_up_proj") {
            let halves = ops::split(&v, 2, -2).map_err(mlx_error(w))?;
            for (name, half) in ["gate_proj", "up_proj"].iter().zip(halves) {
                w.insert(format!("{base}.switch_glu.{name}.weight"), half);
            }
        } else if let Some(base) = key.strip_suffix(".down_proj") {
            w.insert(format!("{base}.switch_glu.down_proj.weight"), v);
        }
    }
    Ok(())
}

/// An MLX failure while preparing `w`'s tensors, as a load error naming the folder.
fn mlx_error(w: &Weights) -> impl Fn(mlx::Error) -> LoadError + '_ {
    |source| LoadError::Mlx {
        folder: w.folder().into(),
        source,
    }
}
