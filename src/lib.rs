//! verity: an LLM inference engine on MLX that generates exactly what mlx-lm generates.
//!
//! Layers, each importing only those before it: `load` and `tokenizer` read a model folder;
//! `cache` holds per-layer state and the rollback contract; `model` runs the families;
//! `grammar` compiles output constraints; `sample` turns logits into tokens; `request` holds
//! what a caller asks for and `validate` checks it (and every other value from outside)
//! against the model before it reaches MLX; `bundle` ties a loaded folder together; `generate`
//! is the plain decode loop and `speculative` the one verify/accept executor with the drafter
//! registry that loads every kind of draft source; `decode` is the one entry point over both
//! loops; `server` and `parity` (which replays the harness's traces and suites) sit on top.

pub mod batch;
pub mod bench;
pub mod bundle;
pub mod cache;
pub mod decode;
pub mod error;
pub mod generate;
pub mod grammar;
pub mod load;
pub mod model;
pub mod parity;
pub mod request;
pub mod sample;
pub mod server;
pub mod speculative;
pub mod tokenizer;
pub mod validate;

pub use error::{Error, Result};
