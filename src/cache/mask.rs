//! Attention masks as mlx-lm builds them (models/base.py create_causal_mask and
//! models/cache.py create_attention_mask).

use mlx::{fast::SdpaMask, Array, Dtype};

use crate::Result;

/// What a cache's make_mask returns: nothing, the string "causal", or a boolean array
/// (True = attend); or, for tokens a rotating cache takes one at a time
/// ([`super::RotatingKvCache::update_each_token`]), each one-token step's own mask.
pub enum Mask {
    None,
    Causal,
    Array(Array),
    Steps(Vec<Mask>),
}

impl Mask {
    /// The mask of one attention call; one-token steps' masks take a call each and have none.
    pub fn as_sdpa(&self) -> mlx::Result<SdpaMask<'_>> {
        match self {
            Mask::None => Ok(SdpaMask::None),
            Mask::Causal => Ok(SdpaMask::Causal),
            Mask::Array(a) => Ok(SdpaMask::Array(a)),
            Mask::Steps(_) => Err(mlx::Error::Invalid(
                "one-token steps' masks given to a single attention call".into(),
            )),
        }
    }
}

/// `create_causal_mask(N, offset, window_size)`: (N, offset + N) booleans.
pub fn create_causal_mask(n: usize, offset: usize, window: Option<usize>) -> Result<Array> {
    let rinds = Array::arange(0.0, (offset + n) as f64, 1.0, Dtype::Int32)?;
    let linds = if offset > 0 {
        Array::arange(offset as f64, (offset + n) as f64, 1.0, Dtype::Int32)?
    } else {
        rinds.clone()
    };
    let linds = linds.expand_dims(&[1])?;
    let rinds = rinds.expand_dims(&[0])?;
    let mut mask = linds.greater_equal(&rinds)?;
    if let Some(w) = window {
        let within = linds.less(&rinds.add(&Array::from_i32(w as i32))?)?;
        mask = mask.logical_and(&within)?;
    }
    Ok(mask)
}

/// models/cache.py `create_attention_mask(N, offset, return_array=False, window_size)`.
pub fn attention_mask(n: usize, offset: usize, window: Option<usize>) -> Result<Mask> {
    if window.is_some() {
        Ok(Mask::Array(create_causal_mask(n, offset, window)?))
    } else if n == 1 {
        Ok(Mask::None)
    } else {
        Ok(Mask::Causal)
    }
}
