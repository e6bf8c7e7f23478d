//! The seam between a target and the multi-token-prediction head its checkpoint carries. A
//! family that ships such a head implements [`MtpHead`] in its own file; the MTP draft source
//! (crate::speculative::mtp) and the validation layer see only this trait, never a family.

use mlx::Array;

use crate::cache::LayerCache;
use crate::Result;

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
