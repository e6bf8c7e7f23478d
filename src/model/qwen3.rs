//! mlx_lm/models/qwen3.py: llama's architecture plus per-head q/k RMSNorm before RoPE, no
//! biases, and no make_cache of its own (so max_kv_size gives rotating caches).

use serde::Deserialize;
use serde_json::Value;

use super::layers::Rope;
use super::llama::{Model, Shape};
use crate::load::{Config, LoadError, QuantConfig, Weights};

#[derive(Deserialize)]
struct Args {
    hidden_size: i32,
    num_hidden_layers: usize,
    intermediate_size: i32,
    num_attention_heads: i32,
    rms_norm_eps: f64,
    vocab_size: i32,
    num_key_value_heads: i32,
    head_dim: i32,
    tie_word_embeddings: bool,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
}

pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> Result<Model, LoadError> {
    let a: Args = config.parse()?;
    // transformers >= 5 nests rope_theta and rope_scaling under rope_parameters.
    let params = a
        .rope_parameters
        .as_ref()
        .filter(|p| p.as_object().is_some_and(|o| !o.is_empty()));
    let theta = a
        .rope_theta
        .or_else(|| {
            params
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
        })
        .ok_or_else(|| config.error("rope_theta is missing from the model config"))?;
    let scaling = a.rope_scaling.as_ref().or(params);
    let rope = Rope::new(a.head_dim, theta, false, scaling).map_err(|m| config.error(m))?;
    if a.tie_word_embeddings {
        w.take_optional("lm_head.weight");
    }
    Model::build(
        Shape {
            hidden: a.hidden_size,
            layers: a.num_hidden_layers,
            intermediate: a.intermediate_size,
            heads: a.num_attention_heads,
            kv_heads: a.num_key_value_heads,
            head_dim: a.head_dim,
            eps: a.rms_norm_eps,
            vocab: a.vocab_size,
            bias: false,
            mlp_bias: false,
            rope,
            tied: a.tie_word_embeddings,
            qk_norm: true,
            layer_types: vec!["full_attention".into(); a.num_hidden_layers],
            sliding_window: None,
            own_make_cache: false,
            config,
        },
        w,
        q,
    )
}
