//! What surrounds a decoder's layers: the embedding, the final norm and the output head, and
//! the loop that runs the layers between them.

use mlx::{compiled, Array};

use super::{Dims, Embedding, Linear, RmsNorm};
use crate::cache::LayerCache;
use crate::load::{LoadResult, QuantConfig, Weights};
use crate::model::rows::{self, LayerRows};
use crate::model::Forward;

/// The output projection: a separate `lm_head`, or the embedding used as a linear layer.
pub enum Head {
    Tied,
    Separate(Linear),
}

/// What every decoder here has around its layers: the token embedding, the final norm, and the
/// output head.
pub struct OuterLayers {
    pub embed_tokens: Embedding,
    pub norm: RmsNorm,
    pub head: Head,
    /// gemma4_text's final_logit_softcapping: the head's logits go through the compiled
    /// `tanh(x / cap) * cap`, here so that a drafter borrowing the head gets them too.
    pub softcap: Option<f32>,
}

impl OuterLayers {
    /// Loads `<prefix>model.embed_tokens`, `<prefix>model.norm` and, unless `tied`,
    /// `<prefix>lm_head`.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        prefix: &str,
        d: &Dims,
        tied: bool,
    ) -> LoadResult<OuterLayers> {
        let (h, vocab) = (d.hidden_size, d.vocab_size);
        let path = |name: &str| format!("{prefix}{name}");
        Ok(OuterLayers {
            embed_tokens: Embedding::load(w, q, &path("model.embed_tokens"), vocab, h)?,
            norm: RmsNorm::load(w, &path("model.norm"), h, d.rms_norm_eps)?,
            head: if tied {
                Head::Tied
            } else {
                Head::Separate(Linear::load(w, q, &path("lm_head"), h, vocab, false)?)
            },
            softcap: None,
        })
    }

    /// Rows of the embedding: the width of the logits.
    pub fn vocab(&self) -> usize {
        self.embed_tokens.vocab()
    }

    /// Runs the embedded packed input `h` (1, T, H) of `rows` (model::rows) through the
    /// model's `layers` layers — `layer(i, h, rows)` is layer i with every row's cache of it —
    /// keeping the hidden states `taps` asks for (tap i < layers: layer i's output; tap =
    /// layers: the final normed state), then the final norm and head.
    pub fn run(
        &self,
        h: Array,
        rows: &mut [&mut [LayerCache]],
        lens: &[usize],
        layers: usize,
        taps: &[usize],
        layer: impl FnMut(usize, &Array, &mut LayerRows) -> crate::Result<Array>,
    ) -> crate::Result<Forward> {
        self.run_with_caches(h, rows, lens, (layers, layers), taps, layer)
    }

    /// [`OuterLayers::run`] for a model whose first `caches` of its `layers` layers own a cache
    /// each and whose later layers read an earlier layer's keys and values (gemma4_text's
    /// KV-shared layers): those get a view of the rows without caches.
    pub fn run_with_caches(
        &self,
        mut h: Array,
        rows: &mut [&mut [LayerCache]],
        lens: &[usize],
        (layers, caches): (usize, usize),
        taps: &[usize],
        mut layer: impl FnMut(usize, &Array, &mut LayerRows) -> crate::Result<Array>,
    ) -> crate::Result<Forward> {
        rows::check(rows, lens, caches, h.dim(1) as usize)?;
        let mut hidden: Vec<Option<Array>> = vec![None; taps.len()];
        let mut capture = |index: usize, h: &Array| {
            for (slot, _) in hidden.iter_mut().zip(taps).filter(|(_, &t)| t == index) {
                *slot = Some(h.clone());
            }
        };
        for i in 0..layers {
            let mut view = if i < caches {
                LayerRows::at(rows, lens, i)
            } else {
                LayerRows::without_caches(lens)
            };
            h = layer(i, &h, &mut view)?;
            capture(i, &h);
        }
        let h = self.norm.forward(&h)?;
        capture(layers, &h);
        Ok(Forward {
            logits: self.logits(&h)?,
            hidden: hidden.into_iter().flatten().collect(),
        })
    }

    /// The output head over final-normed hidden states (what a drafter borrowing the target's
    /// head, such as an MTP head, projects its own states with).
    pub fn logits(&self, h: &Array) -> mlx::Result<Array> {
        let logits = match &self.head {
            Head::Tied => self.embed_tokens.as_linear(h)?,
            Head::Separate(lm_head) => lm_head.forward(h)?,
        };
        match self.softcap {
            Some(cap) => compiled::logit_softcap(&logits, &Array::scalar(cap, logits.dtype())?),
            None => Ok(logits),
        }
    }
}
