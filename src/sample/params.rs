//! What a request asks of sampling: mlx-lm's `make_sampler` and `make_logits_processors`
//! arguments, under their names and with their defaults (so a trace's or a request's JSON
//! deserializes into them). Temperatures and probabilities stay f64 because Python computes
//! with doubles (`1/temp` is a double cast to f32 when it multiplies).

use serde::{Deserialize, Deserializer};

/// mlx-lm `make_sampler` arguments.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
pub struct SamplerParams {
    pub temp: f64,
    pub top_p: f64,
    pub min_p: f64,
    pub min_tokens_to_keep: usize,
    pub top_k: usize,
    pub xtc_probability: f64,
    pub xtc_threshold: f64,
    pub xtc_special_tokens: Vec<u32>,
}

impl Default for SamplerParams {
    /// `make_sampler()`'s defaults: greedy.
    fn default() -> SamplerParams {
        SamplerParams {
            temp: 0.0,
            top_p: 0.0,
            min_p: 0.0,
            min_tokens_to_keep: 1,
            top_k: 0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            xtc_special_tokens: Vec::new(),
        }
    }
}

/// mlx-lm `make_logits_processors` arguments.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
pub struct ProcessorParams {
    /// (token id, additive bias), in the order given. In JSON an object from token ids (as
    /// strings, the way mlx-lm and OpenAI write them) to biases, or null.
    #[serde(deserialize_with = "logit_bias")]
    pub logit_bias: Vec<(u32, f64)>,
    pub repetition_penalty: Option<f64>,
    pub repetition_context_size: usize,
    pub presence_penalty: Option<f64>,
    pub presence_context_size: usize,
    pub frequency_penalty: Option<f64>,
    pub frequency_context_size: usize,
}

impl Default for ProcessorParams {
    /// `make_logits_processors()`'s defaults: no processor.
    fn default() -> ProcessorParams {
        ProcessorParams {
            logit_bias: Vec::new(),
            repetition_penalty: None,
            repetition_context_size: 20,
            presence_penalty: None,
            presence_context_size: 20,
            frequency_penalty: None,
            frequency_context_size: 20,
        }
    }
}

/// `{"<token id>": bias, ...}` or null as (id, bias) pairs; a key that is not a token id is an
/// error naming it.
fn logit_bias<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(u32, f64)>, D::Error> {
    let map: Option<serde_json::Map<String, serde_json::Value>> = Option::deserialize(d)?;
    map.into_iter()
        .flatten()
        .map(|(key, bias)| {
            let id = key.parse().map_err(|_| {
                serde::de::Error::custom(format!("logit_bias key {key:?} is not a token id"))
            })?;
            let bias = bias.as_f64().ok_or_else(|| {
                serde::de::Error::custom(format!("logit_bias[{key:?}] is not a number: {bias}"))
            })?;
            Ok((id, bias))
        })
        .collect()
}
