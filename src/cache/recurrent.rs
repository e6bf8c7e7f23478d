//! mlx-lm's ArraysCache(size=2) as the gated-DeltaNet layers use it: the last K-1 conv inputs
//! (activation dtype) and the f32 recurrent state (B, Hv, Dv, Dk). It cannot be trimmed.

use mlx::Array;

#[derive(Default)]
pub struct RecurrentCache {
    pub conv: Option<Array>,
    pub state: Option<Array>,
    /// Tokens folded into the state so far.
    pub seen: usize,
}

impl RecurrentCache {
    pub fn state(&self) -> Vec<&Array> {
        self.conv.iter().chain(self.state.iter()).collect()
    }
}
