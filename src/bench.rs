//! Timing generations for `verity bench speed`, measured exactly as oracles/bench_mlx_lm.py
//! measures mlx-lm's loop: from the call to the first token id on the host (time to first
//! token, which holds the prefill), then to the last one (decode), with the peak memory of the
//! run. Requests run greedy and without EOS, so both engines produce the same token count.

use std::time::Instant;

use mlx::{Array, Dtype};

use crate::decode::{decode, Hooks, Request, Start};
use crate::generate::{GeneratedToken, StepSplit};
use crate::grammar::Constraint;
use crate::model::LanguageModel;
use crate::request::{Control, GenerateParams};
use crate::speculative::Drafter;
use crate::Result;

/// One timed generation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Seconds from the call to the first token id on the host.
    pub ttft_s: f64,
    /// Seconds from the first token to the last.
    pub decode_s: f64,
    pub generated: usize,
    /// The peak memory until the first token (the prefill's), and over the whole run.
    pub prefill_peak_bytes: usize,
    pub peak_bytes: usize,
    /// Where plain decoding's host time went (speculative runs have no single step).
    pub split: Option<StepSplit>,
}

impl Timing {
    /// Prompt tokens per second, the first token's step included (mlx-lm's `prompt_tps`).
    pub fn prefill_tps(&self, prompt_tokens: usize) -> f64 {
        prompt_tokens as f64 / self.ttft_s
    }

    /// Tokens per second over the whole call, prefill included: how a speculative or
    /// constrained run compares with a plain one.
    pub fn end_to_end_tps(&self) -> f64 {
        self.generated as f64 / (self.ttft_s + self.decode_s)
    }

    /// Tokens per second after the first (mlx-lm's `generation_tps` counts from there too).
    pub fn decode_tps(&self) -> f64 {
        self.generated.saturating_sub(1) as f64 / self.decode_s
    }
}

/// Records when tokens arrive.
struct Clock {
    start: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    generated: usize,
    prefill_peak: usize,
}

impl Clock {
    fn start() -> Clock {
        mlx::memory::reset_peak();
        Clock {
            start: Instant::now(),
            first: None,
            last: None,
            generated: 0,
            prefill_peak: 0,
        }
    }

    fn token(&mut self) {
        let now = Instant::now();
        if self.first.is_none() {
            self.prefill_peak = mlx::memory::peak();
        }
        self.first.get_or_insert(now);
        self.last = Some(now);
        self.generated += 1;
    }

    fn stop(self) -> Timing {
        let first = self.first.unwrap_or(self.start);
        Timing {
            ttft_s: (first - self.start).as_secs_f64(),
            decode_s: (self.last.unwrap_or(first) - first).as_secs_f64(),
            generated: self.generated,
            prefill_peak_bytes: self.prefill_peak,
            peak_bytes: mlx::memory::peak(),
            split: None,
        }
    }
}

/// Times the decoding of `prompt` from fresh caches, speculative when `drafter` is given,
/// optionally under a grammar.
pub fn time_decode(
    model: &dyn LanguageModel,
    drafter: Option<&Drafter>,
    prompt: &[u32],
    params: &GenerateParams,
    num_draft_tokens: Option<usize>,
    constraint: Option<Constraint>,
) -> Result<Timing> {
    let mut clock = Clock::start();
    let mut on_token = |_: &GeneratedToken| {
        clock.token();
        Control::Continue
    };
    let request = Request {
        prompt,
        params,
        constraint,
        num_draft_tokens,
    };
    let decoded = decode(
        model,
        drafter,
        Start::Fresh,
        request,
        Hooks::tokens(&mut on_token),
    )?;
    Ok(Timing {
        split: decoded.step_split,
        ..clock.stop()
    })
}

/// The memory bandwidth MLX reaches on the default device, in bytes per second: the best of a
/// few passes reading and writing a 256 MiB buffer. Decode of a batch of one reads every
/// weight once per token, so weight bytes / bandwidth is the floor of a token's time.
pub fn memory_bandwidth() -> Result<f64> {
    const ELEMENTS: i32 = 64 << 20;
    let x = Array::zeros(&[ELEMENTS], Dtype::Float32)?;
    x.eval()?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        x.add_scalar(1.0)?.eval()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(2.0 * 4.0 * ELEMENTS as f64 / best)
}
