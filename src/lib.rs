//! verity: an LLM inference engine on MLX that generates exactly what mlx-lm generates.

pub mod accept;
pub mod cache;
pub mod generate;
pub mod grammar;
pub mod load;
pub mod model;
pub mod replay;
pub mod sample;
pub mod spec;
pub mod tokenizer;
