//! A decoder of causal attention layers over pre-norm blocks with the default caches (no
//! make_cache of its own): what a family whose layers differ only in how they load computes
//! (qwen3_moe and glm4_moe: their attention and sparse or dense blocks are the shared layers).

use mlx::Array;

use super::{Attention, OuterLayers, PreNormBlock};
use crate::cache::LayerCache;
use crate::model::{rows, Forward, LanguageModel};
use crate::Result;

/// One decoder layer: attention inside a pre-norm block.
pub struct DecoderLayer {
    pub attn: Attention,
    pub block: PreNormBlock,
}

pub struct Decoder {
    pub outer: OuterLayers,
    pub layers: Vec<DecoderLayer>,
    pub head_dim: usize,
}

impl LanguageModel for Decoder {
    fn forward_rows(
        &self,
        ids: &Array,
        rows: &mut [&mut [LayerCache]],
        lens: &[usize],
        taps: &[usize],
    ) -> Result<Forward> {
        let h = self.outer.embed_tokens.forward(ids)?;
        let masks = rows::masks(rows, lens, 0, None)?;
        let layers = self.layers.len();
        self.outer.run(h, rows, lens, layers, taps, |i, x, rows| {
            let layer = &self.layers[i];
            layer
                .block
                .forward(x, |x| layer.attn.forward(x, &masks, rows))
        })
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn attends_batch_caches(&self) -> bool {
        true
    }

    fn attention_head_dim(&self) -> usize {
        self.head_dim
    }

    fn own_caches(&self) -> Option<Vec<LayerCache>> {
        None
    }

    fn outer(&self) -> &OuterLayers {
        &self.outer
    }
}
