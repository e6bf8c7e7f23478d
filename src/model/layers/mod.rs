//! Layers shared by the model families, each computing exactly what its mlx.nn / mlx-lm
//! counterpart computes (same ops, same order), since parity is decided at the bit level.
//!
//! One file per layer kind, as candle-nn has them; this module only re-exports them so that
//! `crate::model::layers::X` names every layer.

mod attention;
mod block;
mod decoder;
mod dims;
mod embedding;
mod linear;
mod mlp;
mod moe;
mod multi_linear;
mod norm;
mod outer;
mod rope;
pub mod rows_kernel;
mod switch;

pub use attention::{attend, attend_row, attend_rows, finfo_min, Attention, AttentionProjections};
pub use block::PreNormBlock;
pub use decoder::{Decoder, DecoderLayer};
pub use dims::Dims;
pub use embedding::Embedding;
pub use linear::Linear;
pub use mlp::{Activation, GatedMlp};
pub use moe::{Mlp, MoeShape, Router, SharedShape, SparseMoe};
pub use multi_linear::MultiLinear;
pub use norm::{QkNorm, RmsNorm};
pub use outer::{Head, OuterLayers};
pub use rope::Rope;
pub use switch::{SwitchGlu, SwitchLinear};
