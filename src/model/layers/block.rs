//! The pre-norm residual block around a token mixer, shared by the families whose layers
//! differ only in that mixer.

use mlx::Array;

use super::{Activation, Dims, GatedMlp, Mlp, MoeShape, RmsNorm, SparseMoe};
use crate::load::{LoadResult, QuantConfig, Weights};

/// The pre-norm residual block llama, the qwen3 hybrids and the mixture-of-experts families
/// share around their token mixer:
/// `h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))`, the MLP
/// dense or (the layers with experts) sparse.
pub struct PreNormBlock {
    pub input_layernorm: RmsNorm,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: Mlp,
}

impl PreNormBlock {
    /// Loads the norms and the SwiGLU MLP of the layer at `path`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        d: &Dims,
        mlp_bias: bool,
    ) -> LoadResult<PreNormBlock> {
        let mlp = GatedMlp::load(
            w,
            q,
            &format!("{path}.mlp"),
            d.hidden_size,
            d.intermediate_size,
            mlp_bias,
            Activation::Swiglu,
        )?;
        PreNormBlock::with_mlp(w, path, d, Mlp::Dense(mlp))
    }

    /// Loads the norms and the sparse MLP `moe` (or, without one, the SwiGLU MLP without
    /// biases) of the layer at `path`.
    pub fn load_moe(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        d: &Dims,
        moe: Option<MoeShape>,
    ) -> LoadResult<PreNormBlock> {
        match moe {
            Some(s) => {
                let mlp = SparseMoe::load(w, q, &format!("{path}.mlp"), s)?;
                PreNormBlock::with_mlp(w, path, d, Mlp::Sparse(mlp))
            }
            None => PreNormBlock::load(w, q, path, d, false),
        }
    }

    fn with_mlp(w: &mut Weights, path: &str, d: &Dims, mlp: Mlp) -> LoadResult<PreNormBlock> {
        let (h, eps) = (d.hidden_size, d.rms_norm_eps);
        Ok(PreNormBlock {
            input_layernorm: RmsNorm::load(w, &format!("{path}.input_layernorm"), h, eps)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                &format!("{path}.post_attention_layernorm"),
                h,
                eps,
            )?,
            mlp,
        })
    }

    pub fn forward(
        &self,
        x: &Array,
        mixer: impl FnOnce(&Array) -> crate::Result<Array>,
    ) -> crate::Result<Array> {
        let h = x.add(&mixer(&self.input_layernorm.forward(x)?)?)?;
        let r = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?)?;
        Ok(h.add(&r)?)
    }
}
