//! mlx_lm/models/qwen3.py: llama's architecture plus per-head q/k RMSNorm before RoPE, no
//! biases, and no make_cache of its own (so max_kv_size gives rotating caches).

use serde::Deserialize;
use serde_json::{json, Value};

use super::layers::{Dims, Rope};
use super::llama::{Model, Shape};
use crate::load::{Config, LoadResult, QuantConfig, Weights};

#[derive(Deserialize)]
struct Args {
    #[serde(flatten)]
    dims: Dims,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
}

pub fn load(config: &Config, w: &mut Weights, q: &QuantConfig) -> LoadResult<Model> {
    let a: Args = config.args(json!({}))?;
    let d = &a.dims;
    // The Python dataclass requires these three (llama's loader derives the first two).
    let missing = |key: &str| config.error(format!("{key} is missing from the model config"));
    let head_dim = d.head_dim.ok_or_else(|| missing("head_dim"))?;
    d.num_key_value_heads
        .ok_or_else(|| missing("num_key_value_heads"))?;
    let tied = d
        .tie_word_embeddings
        .ok_or_else(|| missing("tie_word_embeddings"))?;
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
        .ok_or_else(|| missing("rope_theta"))?;
    let scaling = a.rope_scaling.as_ref().or(params);
    let rope = Rope::new(head_dim, theta, false, scaling).map_err(|m| config.error(m))?;
    if tied {
        w.take_optional("lm_head.weight");
    }
    Model::build(
        Shape {
            dims: d,
            rope,
            tied,
            attention_bias: false,
            mlp_bias: false,
            qk_norm: true,
            layer_types: vec!["full_attention".into(); d.num_hidden_layers],
            sliding_window: None,
            own_make_cache: false,
            config,
        },
        w,
        q,
    )
}
