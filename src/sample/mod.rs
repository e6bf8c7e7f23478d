//! mlx-lm's sampling (sample_utils.py): the request's parameters, the sampler's filter chain,
//! the logits processors, and the step sampler that joins them with the grammar mask so plain
//! and speculative decoding sample through one path.

mod keys;
mod params;
mod processors;
mod rows;
mod sampler;
mod step;

pub use keys::{position_seed, KeySchedule};
pub use params::{ProcessorParams, SamplerParams};
pub use processors::LogitsProcessors;
pub use rows::{argmax_rows, row_views};
pub use sampler::Sampler;
pub use step::{Masking, StepSampler};
