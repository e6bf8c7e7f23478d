//! The seam between a target and the multi-token-prediction head its checkpoint carries. A
//! family that ships such a head implements [`MtpHead`] in its own file; the MTP draft source
//! (crate::speculative::mtp) and the validation layer see only this trait, never a family.
//! A head cut out of its target into a folder of its own is loaded here too ([`load_folder`]),
//! dispatched on the folder's `model_type` as mlx-vlm dispatches its drafters.

use std::path::Path;

use mlx::Array;

use crate::cache::LayerCache;
use crate::load::load_config;
use crate::Result;

/// What a split head's folder declares about the target it was cut from, which the target
/// must match (crate::validate::mtp_folder).
pub struct Pairing {
    pub hidden_size: usize,
    pub vocab_size: usize,
}

/// Loads the MTP head of a split drafter folder (mlx-vlm's `split_mtp` output), after `pair`
/// has accepted what its config declares.
pub fn load_folder(
    dir: &Path,
    pair: impl FnOnce(&Pairing) -> Result<()>,
) -> Result<Box<dyn MtpHead>> {
    let config = load_config(dir)?;
    match config.model_type()? {
        "qwen3_5_mtp" => super::qwen3_5_mtp::load_split(&config, pair),
        other => Err(config
            .error(format!(
                "model_type {other:?} is not a split MTP drafter folder (verity knows \
                 \"qwen3_5_mtp\", the folders mlx-vlm's split_mtp writes)"
            ))
            .into()),
    }
}

/// A native MTP head: a small stack that reads a token's embedding and the target's hidden
/// state it follows, and yields a state whose output-head logits predict the token after.
pub trait MtpHead {
    /// The width of the hidden states the head consumes and yields.
    fn hidden_size(&self) -> usize;

    /// Fresh caches for the head's own layers.
    fn make_cache(&self) -> Vec<LayerCache>;

    /// One pass over L entries: `embedded` (1, L, H) are the embedded tokens t_{i+1}, `hidden`
    /// (1, L, H) the states h_i they follow. Returns the states (1, L, H) whose output-head
    /// logits predict t_{i+2}. Positions continue from the caches' offset.
    fn forward(&self, embedded: &Array, hidden: &Array, caches: &mut [LayerCache])
        -> Result<Array>;
}
