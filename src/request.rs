//! What a caller asks of a generation, besides the model and the prompt: the engine-owned
//! request parameters, what a caller's callback answers, and why a generation ends. The validation layer checks these against the
//! model; the decode loops read them.

use std::fmt;

use crate::cache::KvQuantization;
use crate::sample::{KeySchedule, ProcessorParams, SamplerParams};

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token was generated (and counts as generated).
    Stop,
    /// max_tokens were generated.
    Length,
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        })
    }
}

/// What a caller's token (or prefill chunk) callback tells a decode loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    /// Stop now (a stop sequence matched, the client went away): nothing more is emitted.
    Stop,
}

/// Everything a generation needs besides the model and the prompt.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampler: SamplerParams,
    pub processors: ProcessorParams,
    pub seed: Option<u64>,
    /// How the seed keys each draw: mlx-lm's sequence or mlx-vlm's per-position keys.
    pub keys: KeySchedule,
    pub prefill_step_size: usize,
    /// Cache offsets where a prefill chunk must end besides every `prefill_step_size` tokens:
    /// where a prefix cache may resume the prompt, so that a prefill resumed there and one from
    /// the start feed the same chunks. A sliding window's chunk attends the keys its cache
    /// kept, which depend on where the chunk starts, so its bits do too.
    pub prefill_splits: Vec<usize>,
    pub max_kv_size: Option<usize>,
    pub kv_quantization: Option<KvQuantization>,
    /// Tokens that end generation with finish reason "stop".
    pub eos_token_ids: Vec<u32>,
}

impl GenerateParams {
    /// Greedy, no processors, mlx-lm's defaults otherwise.
    pub fn greedy(max_tokens: usize, eos_token_ids: Vec<u32>) -> GenerateParams {
        GenerateParams {
            max_tokens,
            sampler: SamplerParams::default(),
            processors: ProcessorParams::default(),
            seed: None,
            keys: KeySchedule::Sequence,
            prefill_step_size: 2048,
            prefill_splits: Vec::new(),
            max_kv_size: None,
            kv_quantization: None,
            eos_token_ids,
        }
    }

    /// "stop" for an EOS, "length" for the `n`-th token at max_tokens.
    pub fn finish_for(&self, token: u32, n: usize) -> Option<FinishReason> {
        if self.eos_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if n == self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// The seed a request samples with: sampling without one uses seed 0, so that every run of
/// verity can be reproduced (greedy decoding draws nothing and needs none).
pub fn reproducible_seed(seed: Option<u64>, temp: f64) -> Option<u64> {
    seed.or((temp > 0.0).then_some(0))
}
