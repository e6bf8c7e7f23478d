//! Qwen3.5's multi-token-prediction head, from either place a checkpoint may keep it: the
//! target's own `mtp.*` tensors (crate::model::qwen3_5 loads those with the target), or a split
//! drafter folder in mlx-vlm's layout ([`load_split`]), which common community conversions
//! need because they strip `mtp.*` from the target. Both build the same [`QwenMtpHead`], so a
//! split head drafts exactly what the in-folder head drafts.

use mlx::ops;

use super::layers::{Linear, RmsNorm, Rope};
use super::mtp::{MtpHead, Pairing};
use super::qwen3_5::{self, TextArgs};
use super::qwen3_next::AttentionLayer;
use crate::cache::{default_caches, LayerCache};
use crate::load::{Config, LoadResult, QuantConfig, Weights};
use crate::Result;

/// The `mtp.*` norms mlx-vlm shifts by +1 (zero-centred in HF checkpoints): the suffix list of
/// mlx_vlm/speculative/drafters/qwen3_5_mtp/split.py:14-22 ("norm.weight" is `mtp.norm`; the
/// pre-fc norms end in "embedding.weight" and "hidden.weight", so they are listed apart).
pub(crate) const MTP_SHIFTED_NORMS: [&str; 7] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
];

/// Loads the head of a split drafter folder, mlx-vlm's `qwen3_5_mtp` layout as
/// MTPSplitter.split writes it (mlx_vlm/speculative/drafters/mtp_split.py:298-328): config.json
/// holds `model_type: "qwen3_5_mtp"` and the source's whole `text_config` (plus `block_size`
/// and `tie_word_embeddings`), model.safetensors the head's tensors without the `mtp.` prefix,
/// norms already shifted. `pair` sees what the config declares before any weight is read, so a
/// folder cut from another model is refused for what it is, not by a shape error.
pub(crate) fn load_split(
    config: &Config,
    pair: impl FnOnce(&Pairing) -> Result<()>,
) -> Result<Box<dyn MtpHead>> {
    let a = qwen3_5::text_args(config)?;
    if a.num_experts > 0 {
        return Err(config
            .error(format!(
                "text_config.num_experts is {}: mixture-of-experts MTP heads are not supported \
                 yet (must be 0)",
                a.num_experts
            ))
            .into());
    }
    pair(&Pairing {
        hidden_size: a.dims.hidden_size as usize,
        vocab_size: a.dims.vocab_size as usize,
    })?;
    let q = QuantConfig::from_config(config)?;
    let rope = qwen3_5::rope(config, &a)?;
    let dir = config.path.parent().unwrap_or(config.path.as_path());
    let mut w = Weights::load(dir)?;
    sanitize(&mut w)?;
    let head = QwenMtpHead::load(&mut w, &q, &a, rope, config, "")?;
    w.finish()?;
    Ok(Box::new(head))
}

/// Qwen3_5MTPDraftModel.sanitize (qwen3_5_mtp.py:441-459): a key still carrying `mtp.` is in
/// HF layout, so the prefix goes and its norms get + 1; the split layout's keys pass as they
/// are.
fn sanitize(w: &mut Weights) -> LoadResult<()> {
    w.map(|k, v| {
        let hf = k.starts_with("mtp.");
        if hf && v.ndim() == 1 && MTP_SHIFTED_NORMS.iter().any(|s| k.ends_with(s)) {
            v.add_scalar(1.0)
        } else {
            Ok(v)
        }
    })?;
    w.rename(|k| Some(k.strip_prefix("mtp.").unwrap_or(k).to_string()));
    Ok(())
}

/// Qwen3.5's multi-token-prediction head, mlx-vlm's Qwen3_5MTPDraftModel
/// (mlx_vlm/speculative/drafters/qwen3_5_mtp/qwen3_5_mtp.py:23-66, `_forward_hidden` at
/// 155-179): `fc(concat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)))`, then
/// full-attention decoder layers with their own KV caches, then `norm`. The embedding and the
/// output head are the target's; `h_i` is the target's final post-norm hidden state (mlx-vlm's
/// `return_hidden` appends `self.norm(h)`, mlx_vlm/models/qwen3_5/language.py:1406, 1841-1844)
/// or, later in a chain, this head's own output.
pub(crate) struct QwenMtpHead {
    fc: Linear,
    pre_fc_norm_embedding: RmsNorm,
    pre_fc_norm_hidden: RmsNorm,
    layers: Vec<AttentionLayer>,
    norm: RmsNorm,
    hidden_size: i32,
}

impl QwenMtpHead {
    /// The head's tensors under `prefix` (`"mtp."` in the target, `""` in a split folder).
    pub(crate) fn load(
        w: &mut Weights,
        q: &QuantConfig,
        a: &TextArgs,
        rope: Rope,
        config: &Config,
        prefix: &str,
    ) -> LoadResult<QwenMtpHead> {
        if a.mtp_num_hidden_layers == 0 {
            return Err(config.error(
                "the checkpoint has MTP weights but mtp_num_hidden_layers is 0 (must be >= 1)",
            ));
        }
        let d = &a.dims;
        let (h, eps) = (d.hidden_size, d.rms_norm_eps);
        let layers = (0..a.mtp_num_hidden_layers)
            .map(|i| AttentionLayer::load(w, q, &format!("{prefix}layers.{i}"), d, rope, false))
            .collect::<LoadResult<_>>()?;
        let norm =
            |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{prefix}{name}"), h, eps);
        Ok(QwenMtpHead {
            fc: Linear::load(w, q, &format!("{prefix}fc"), 2 * h, h, false)?,
            pre_fc_norm_embedding: norm(w, "pre_fc_norm_embedding")?,
            pre_fc_norm_hidden: norm(w, "pre_fc_norm_hidden")?,
            layers,
            norm: norm(w, "norm")?,
            hidden_size: h,
        })
    }
}

impl MtpHead for QwenMtpHead {
    fn hidden_size(&self) -> usize {
        self.hidden_size as usize
    }

    /// One plain KV cache per layer (qwen3_5_mtp.py:99-116).
    fn make_cache(&self) -> Vec<LayerCache> {
        default_caches(self.layers.len(), None)
    }

    /// The head's positions are mlx-vlm's own `_next_position` counter, which starts at 0 and
    /// moves with the caches' offset on trim; the output is post-norm.
    fn forward(
        &self,
        embedded: &mlx::Array,
        hidden: &mlx::Array,
        caches: &mut [LayerCache],
    ) -> Result<mlx::Array> {
        let x = ops::concatenate(
            &[
                &self.pre_fc_norm_embedding.forward(embedded)?,
                &self.pre_fc_norm_hidden.forward(hidden)?,
            ],
            -1,
        )?;
        let mut h = self.fc.forward(&x)?;
        for (layer, cache) in self.layers.iter().zip(caches) {
            h = layer.forward(&h, cache)?;
        }
        Ok(self.norm.forward(&h)?)
    }
}
