//! What a request asks of sampling: mlx-lm's `make_sampler` and `make_logits_processors`
//! arguments, with their defaults. Temperatures and probabilities stay f64 because Python
//! computes with doubles (`1/temp` is a double cast to f32 when it multiplies).

/// mlx-lm `make_sampler` arguments.
#[derive(Clone, Debug, PartialEq)]
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

impl SamplerParams {
    /// `make_sampler()`'s defaults: greedy.
    pub fn greedy() -> SamplerParams {
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
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessorParams {
    /// (token id, additive bias), in the order given.
    pub logit_bias: Vec<(u32, f64)>,
    pub repetition_penalty: Option<f64>,
    pub repetition_context_size: usize,
    pub presence_penalty: Option<f64>,
    pub presence_context_size: usize,
    pub frequency_penalty: Option<f64>,
    pub frequency_context_size: usize,
}

impl ProcessorParams {
    /// `make_logits_processors()`'s defaults: no processor.
    pub fn none() -> ProcessorParams {
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
