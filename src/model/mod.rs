//! Model families, one file per family mirroring mlx-lm's model files, over shared layers.

pub mod dflash;
pub mod gemma3_text;
pub mod gemma4;
pub mod gemma4_assistant;
pub mod gemma4_moe;
pub mod gemma4_rope;
pub mod gemma4_text;
pub mod glm4_moe;
pub mod glm4_moe_lite;
pub mod kernel_checks;
pub mod layers;
pub mod llama;
pub mod lone_rows;
pub mod mtp;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_5_moe;
pub mod qwen3_5_mtp;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod router_margin;
pub mod row_blocks;
pub mod row_products;
pub mod rows;
pub mod stacked_recurrence;

use std::path::Path;

use mlx::Array;

use layers::OuterLayers;

use crate::cache::{default_caches, LayerCache};
use crate::load::{load_config, Config, LoadError, LoadResult, QuantConfig, Weights};
use crate::Result;

/// What one forward pass returns.
pub struct Forward {
    /// (B, L, vocab) logits in the model's dtype.
    pub logits: Array,
    /// Hidden states at the requested taps, in the order asked: tap `i < num_layers` is layer
    /// i's output; tap `num_layers` is the final (post-norm) hidden state.
    pub hidden: Vec<Array>,
}

/// A decoder-only language model.
pub trait LanguageModel {
    /// Runs the packed token ids `ids` (1, T) of several sequences through the model
    /// ([`rows`]): row r's `lens[r]` tokens follow row r - 1's, and `rows[r]` are row r's
    /// caches (one per layer), which it updates. Logits and taps cover all T tokens in order.
    /// `taps` lists the hidden states a caller (a drafter) wants back.
    fn forward_rows(
        &self,
        ids: &Array,
        rows: &mut [&mut [LayerCache]],
        lens: &[usize],
        taps: &[usize],
    ) -> Result<Forward>;

    /// Runs one sequence's `ids` (1, L token ids) through the model, updating `caches`.
    fn forward(&self, ids: &Array, caches: &mut [LayerCache], taps: &[usize]) -> Result<Forward> {
        let len = ids.dim(1) as usize;
        self.forward_rows(ids, &mut [caches], &[len], taps)
    }

    /// Whether every attention layer attends through attention's rows path
    /// (`layers::attend_rows`) and every recurrent layer reads its rows' caches side by side,
    /// so that a batch step may hand it its rows' caches as one
    /// [`crate::cache::BatchKvCache`] per attention layer and one
    /// [`LayerCache::RecurrentRows`] per recurrent layer.
    fn attends_batch_caches(&self) -> bool {
        false
    }

    /// Layers in the model (`len(model.layers)`), one cache each.
    fn num_layers(&self) -> usize;

    /// The caches one sequence holds: one per layer, except where later layers read an earlier
    /// layer's cache (gemma4_text's KV-shared layers, which mlx-lm's make_cache leaves out).
    fn num_caches(&self) -> usize {
        self.num_layers()
    }

    /// The caches of the Python class's own `make_cache`, for the families that define one;
    /// None where mlx-lm builds the default layout.
    fn own_caches(&self) -> Option<Vec<LayerCache>>;

    /// The token embedding, final norm and output head.
    fn outer(&self) -> &OuterLayers;

    /// mlx-lm's make_prompt_cache: the model's own caches when its class defines make_cache
    /// (which then ignores `max_kv_size`, as mlx-lm does), else rotating caches keeping 4
    /// tokens when `max_kv_size` is set and plain KV caches otherwise.
    fn make_cache(&self, max_kv_size: Option<usize>) -> Vec<LayerCache> {
        self.own_caches()
            .unwrap_or_else(|| default_caches(self.num_layers(), max_kv_size))
    }

    /// Whether `make_cache` ignores `max_kv_size` (the model builds its own caches).
    fn ignores_max_kv_size(&self) -> bool {
        self.own_caches().is_some()
    }

    /// The head dimension of the attention layers' keys and values (what a quantized KV
    /// cache's group size must divide).
    fn attention_head_dim(&self) -> usize;

    /// Whether its attention runs over a quantized KV cache (not glm4_moe_lite's latent
    /// attention, whose RoPE scores need the cached values unpacked; mlx-lm fails there).
    fn quantizes_kv(&self) -> bool {
        true
    }

    /// Whether a one-token forward computes its token otherwise than a longer forward does
    /// (MLA's absorbed attention, glm4_moe_lite). Then caches built by decode steps are not
    /// what a prefill builds, and a prefill's bits depend on where its chunks end, so a
    /// prefill may go on only from where one from the start ends a chunk.
    fn one_token_path(&self) -> bool {
        false
    }

    /// The width of the logits.
    fn vocab_size(&self) -> usize {
        self.outer().vocab()
    }

    /// The multi-token-prediction head the checkpoint carries, if any (Qwen3.5's `mtp.*`).
    fn mtp_head(&self) -> Option<&dyn mtp::MtpHead> {
        None
    }

    /// What a drafter reading this model's keys and values needs (Gemma 4's assistant): None
    /// for the families whose layers do not come in kinds that share caches.
    fn kv_sharing(&self) -> Option<KvSharing> {
        None
    }
}

/// A target's keys and values as mlx-vlm hands them to a Gemma 4 assistant drafter
/// (`shared_kv_states`: per layer kind, what the last layer of that kind attended over).
#[derive(Clone, Debug)]
pub struct KvSharing {
    /// The factor the target scales its token embeddings by (`embed_scale`).
    pub embed_scale: f32,
    pub kinds: Vec<SharedKv>,
}

/// One layer kind's keys and values in a [`KvSharing`].
#[derive(Clone, Debug)]
pub struct SharedKv {
    /// `"sliding_attention"` or `"full_attention"`.
    pub kind: String,
    /// The cache (in the model's cache list) the last layer of this kind reads.
    pub cache: usize,
    pub head_dim: usize,
    pub kv_heads: usize,
}

/// The model types verity can load, with the mlx-lm remaps it honours.
pub const MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "qwen3",
    "gemma3_text",
    "qwen3_next",
    "qwen3_5",
    "qwen3_moe",
    "qwen3_5_moe",
    "glm4_moe",
    "glm4_moe_lite",
    "gemma4_text",
    "gemma4",
];

/// Loads a model folder's config and weights (evaluated once, as mlx-lm does unless lazy)
/// through the family's sanitize step. Any unused tensor is an error.
pub fn load(dir: &Path) -> LoadResult<(Box<dyn LanguageModel>, Config)> {
    let config = load_config(dir)?;
    let model_type = config.model_type()?.to_string();
    let mut weights = Weights::load(dir)?;
    let quant = QuantConfig::from_config(&config)?;
    let model: Box<dyn LanguageModel> = match model_type.as_str() {
        "llama" | "mistral" => Box::new(llama::Model::load(&config, &mut weights, &quant)?),
        "qwen3" => Box::new(qwen3::load(&config, &mut weights, &quant)?),
        "gemma3_text" => Box::new(gemma3_text::Model::load(&config, &mut weights, &quant)?),
        "qwen3_next" => Box::new(qwen3_next::Model::load(&config, &mut weights, &quant)?),
        "qwen3_5" => Box::new(qwen3_5::load(&config, &mut weights, &quant)?),
        "qwen3_moe" => Box::new(qwen3_moe::load(&config, &mut weights, &quant)?),
        "qwen3_5_moe" => Box::new(qwen3_5_moe::load(&config, &mut weights, &quant)?),
        "glm4_moe" => Box::new(glm4_moe::load(&config, &mut weights, &quant)?),
        "glm4_moe_lite" => Box::new(glm4_moe_lite::Model::load(&config, &mut weights, &quant)?),
        "gemma4_text" => Box::new(gemma4_text::Model::load(&config, &mut weights, &quant)?),
        "gemma4" => Box::new(gemma4::load(&config, &mut weights)?),
        other => {
            return Err(LoadError::UnknownModelType {
                path: config.path.clone(),
                model_type: other.to_string(),
                known: MODEL_TYPES.join(", "),
            })
        }
    };
    weights.finish()?;
    Ok((model, config))
}
