//! The token embedding table, which a tied model also uses as its output projection.

use mlx::{ops, Array, Result};

use super::linear::Weight;
use crate::load::{LoadResult, QuantConfig, Weights};

/// mlx.nn.Embedding / QuantizedEmbedding, including `as_linear` for tied output heads.
pub struct Embedding {
    table: Weight,
}

impl Embedding {
    /// Loads the (vocab x dims) table as stored, even where it is also the output head: the
    /// transposed form would speed that matmul up, but gathering rows from it costs a copy of
    /// the table or of the gathered rows, which shows in the peak memory.
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        vocab: i32,
        dims: i32,
    ) -> LoadResult<Embedding> {
        Ok(Embedding {
            table: Weight::load(w, q, path, (vocab, dims), false)?,
        })
    }

    /// Rows in the table: the vocabulary size.
    pub fn vocab(&self) -> usize {
        self.table.stored_shape().0
    }

    /// Columns of the table: the hidden size.
    pub fn width(&self) -> usize {
        self.table.stored_shape().1
    }

    /// `weight[ids]` (dequantizing the gathered rows when packed).
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        Ok(match &self.table {
            Weight::Dense(w) => w.take(ids, 0)?,
            Weight::Transposed(t) => t.transpose(&[])?.take(ids, 0)?,
            Weight::Packed(p) => {
                let biases = p.biases.as_ref().map(|b| b.take(ids, 0)).transpose()?;
                let q = &p.params;
                ops::dequantize(
                    &p.weight.take(ids, 0)?,
                    &p.scales.take(ids, 0)?,
                    biases.as_ref(),
                    q.group_size,
                    q.bits,
                    &q.mode,
                )?
            }
        })
    }

    /// `x @ weight.T`: the embedding used as the output projection.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        self.table.matmul_t(x)
    }
}
