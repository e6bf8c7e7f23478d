//! The model dimensions every family reads from config.json: a file of their own because the
//! attention, block and outer loaders take them as well as every family's config.

use serde::Deserialize;

/// The dimensions every family reads from config.json, under mlx-lm's names.
#[derive(Clone, Debug, Deserialize)]
pub struct Dims {
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: Option<i32>,
    pub head_dim: Option<i32>,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub tie_word_embeddings: Option<bool>,
}

impl Dims {
    /// `head_dim`, or `hidden_size // num_attention_heads` where the config leaves it out.
    pub fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// `num_key_value_heads`, or one per attention head where the config leaves it out.
    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
}
