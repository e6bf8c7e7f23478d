//! `make_sampler`: greedy argmax at temp 0; otherwise top-p, min-p, XTC and top-k filters in
//! that order, then categorical sampling at the temperature, each expression as mlx-lm writes
//! it. Filtered entries become -inf; temperature is applied last.

use mlx::random::{self, KeySequence};
use mlx::{ops, Array, Dtype};

use super::keys::{position_key, SampleKeys};
use super::SamplerParams;
use crate::{Error, Result};

pub struct Sampler {
    p: SamplerParams,
}

fn invalid(message: String) -> Error {
    Error::Params(message)
}

fn neg_inf_like(a: &Array) -> mlx::Result<Array> {
    Array::scalar(f32::NEG_INFINITY, a.dtype())
}

impl Sampler {
    /// A sampler for parameters the validation layer accepted (crate::validate).
    pub fn new(p: SamplerParams) -> Sampler {
        Sampler { p }
    }

    pub fn is_greedy(&self) -> bool {
        self.p.temp == 0.0
    }

    /// Samples from (rows, V) logprobs; returns (rows,) uint32 token ids. With a key sequence
    /// each random draw takes its next key, in mlx-lm's program order (XTC's, then
    /// categorical's); with positioned keys row i is drawn alone at the next position + i.
    pub(crate) fn sample(&self, logprobs: &Array, keys: Option<&mut SampleKeys>) -> Result<Array> {
        if self.is_greedy() {
            return Ok(ops::argmax(logprobs, -1, false)?);
        }
        match keys {
            Some(SampleKeys::Sequence(keys)) => self.sample_sequence(logprobs, keys),
            Some(SampleKeys::Positioned { seed, next }) => {
                let rows = logprobs.dim(0);
                let tokens = self.sample_positioned(logprobs, *seed, *next)?;
                *next += rows as usize;
                Ok(tokens)
            }
            None => Err(invalid("sampling at temperature > 0 needs a seed".into())),
        }
    }

    /// mlx-lm's make_sampler chain with the global key sequence.
    fn sample_sequence(&self, logprobs: &Array, keys: &mut KeySequence) -> Result<Array> {
        let p = &self.p;
        let mut lp = logprobs.clone();
        if 0.0 < p.top_p && p.top_p < 1.0 {
            lp = top_p(&lp, p.top_p)?;
        }
        if p.min_p != 0.0 {
            lp = min_p(&lp, p.min_p, p.min_tokens_to_keep)?;
        }
        if p.xtc_probability > 0.0 {
            lp = xtc(
                &lp,
                p.xtc_probability,
                p.xtc_threshold,
                &p.xtc_special_tokens,
                &keys.next_key()?,
            )?;
        }
        if p.top_k > 0 {
            lp = top_k(&lp, p.top_k)?;
        }
        // categorical_sampling: `categorical(logits * (1.0 / temp))`, 1/temp in double.
        let scaled = lp.multiply_scalar((1.0 / p.temp) as f32)?;
        Ok(random::categorical(&scaled, -1, &keys.next_key()?)?)
    }

    /// `_PositionedTargetSampler.sample_target` over (rows, V) scores: top-k, then row i drawn
    /// alone with the key of position `first + i`, at the temperature mlx-vlm clamps to at least
    /// 0.01 (`clamp_temperature`); with top-p as `top_p_sampling` writes it (the row divided by
    /// the temperature, renormalised, the nucleus kept, then drawn unscaled), otherwise
    /// `categorical(row * (1 / temp))`. A (V,) row takes MLX's Gumbel path, as mlx-vlm's vmap
    /// over rows does; a (1, V) row would not (mlx::random::categorical). min-p and XTC are
    /// refused up front (crate::validate), as mlx-vlm falls back to its key sequence for them.
    pub(crate) fn sample_positioned(
        &self,
        scores: &Array,
        seed: u64,
        first: usize,
    ) -> Result<Array> {
        let vocab = scores.dim(-1);
        let tokens = (0..scores.dim(0))
            .map(|i| {
                let row = scores.slice_axis(0, i, i + 1)?.reshape(&[vocab])?;
                self.draw_with_key(&row, &position_key(seed, first + i as usize)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ops::stack(&tokens.iter().collect::<Vec<_>>(), 0)?)
    }

    /// One draw of mlx-vlm's positioned sampler over `scores` (its last axis the vocabulary)
    /// with `key`: top-k, then top-p as `top_p_sampling` writes it, or `categorical(scores *
    /// (1 / temp))`, at the temperature clamped to at least 0.01 (`clamp_temperature`). Its
    /// target draws take a position's key; its plain `__call__`, which drafters sample
    /// through, the next key of MLX's global sequence.
    pub(crate) fn draw_with_key(&self, scores: &Array, key: &Array) -> Result<Array> {
        let p = &self.p;
        let lp = if p.top_k > 0 {
            top_k(scores, p.top_k)?
        } else {
            scores.clone()
        };
        let temp = p.temp.max(MIN_POSITIONED_TEMP);
        Ok(if 0.0 < p.top_p && p.top_p < 1.0 {
            let scaled = lp.astype(Dtype::Float32)?.divide_scalar(temp as f32)?;
            let normed = scaled.subtract(&scaled.logsumexp(&[-1], true)?)?;
            random::categorical(&top_p(&normed, p.top_p)?, -1, key)?
        } else {
            random::categorical(&lp.multiply_scalar((1.0 / temp) as f32)?, -1, key)?
        })
    }
}

/// mlx-vlm's MIN_SAMPLING_TEMPERATURE (sample_utils.py): positive temperatures below it are
/// raised to it.
const MIN_POSITIONED_TEMP: f64 = 0.01;

/// apply_top_p: keep the smallest set of top tokens whose mass reaches `top_p` (ties kept).
fn top_p(lp: &Array, top_p: f64) -> mlx::Result<Array> {
    let sorted = ops::sort(lp, -1)?;
    let probs = sorted.astype(Dtype::Float32)?.exp()?;
    let mass_above = ops::cumsum(&probs, -1, true, false)?;
    let total = mass_above
        .slice_axis(-1, 0, 1)?
        .add(&probs.slice_axis(-1, 0, 1)?)?;
    let dropped = mass_above
        .greater_equal(&total.multiply_scalar(top_p as f32)?)?
        .sum(&[-1], true)?;
    let threshold = ops::take_along_axis(&sorted, &dropped, -1)?;
    ops::r#where(&lp.less(&threshold)?, &neg_inf_like(lp)?, lp)
}

/// apply_min_p: drop tokens less likely than `min_p` times the top one, keeping at least
/// `keep` tokens.
fn min_p(lp: &Array, min_p: f64, keep: usize) -> mlx::Result<Array> {
    let top = lp.max(&[-1], true)?;
    let scaled = top.add_scalar(min_p.ln() as f32)?;
    let mut remove = lp.less(&scaled)?;
    if keep > 1 {
        let keep = keep as i32;
        let idx = ops::argpartition(lp, -keep, -1)?;
        let idx = idx.slice_axis(-1, idx.dim(-1) - keep, idx.dim(-1))?;
        let no = Array::scalar_int(0, Dtype::Bool)?;
        remove = ops::put_along_axis(&remove, &idx, &no, -1)?;
    }
    ops::r#where(&remove, &neg_inf_like(lp)?, lp)
}

/// apply_xtc: with probability `prob`, exclude every token above `threshold` except the least
/// likely of them (special tokens are never excluded). Draws one uniform with `key`.
fn xtc(lp: &Array, prob: f64, threshold: f64, special: &[u32], key: &Array) -> mlx::Result<Array> {
    let probs = ops::softmax(lp, &[-1], false)?;
    let inf = Array::scalar(f32::INFINITY, probs.dtype())?;
    let above = probs.greater(&ops::scalar_like(threshold as f32, &probs)?)?;
    let least = ops::r#where(&above, &probs, &inf)?.min(&[-1], true)?;
    let mut mask = probs.greater(&least)?;
    if !special.is_empty() {
        let ids: Vec<i32> = special.iter().map(|&t| t as i32).collect();
        let rows = mask.dim(0);
        let idx = Array::from_slice(&ids, &[1, ids.len() as i32])?
            .broadcast_to(&[rows, ids.len() as i32])?;
        mask = ops::put_along_axis(&mask, &idx, &Array::scalar_int(0, Dtype::Bool)?, -1)?;
    }
    let draw = random::uniform(&[], Dtype::Float32, key)?;
    let keep_all = draw.greater(&Array::from_f32(prob as f32))?;
    let excluded = ops::r#where(&mask, &neg_inf_like(lp)?, lp)?;
    ops::r#where(&keep_all, lp, &excluded)
}

/// apply_top_k: -inf outside the `k` most likely tokens.
fn top_k(lp: &Array, k: usize) -> Result<Array> {
    let vocab = lp.dim(-1) as usize;
    if k == 0 || k >= vocab {
        return Err(invalid(format!(
            "`top_k` has to be an integer in the (0, {vocab}) interval, but is {k}"
        )));
    }
    let idx = ops::argpartition(&lp.negative()?, k as i32 - 1, -1)?;
    let idx = idx.slice_axis(-1, k as i32, idx.dim(-1))?;
    Ok(ops::put_along_axis(lp, &idx, &neg_inf_like(lp)?, -1)?)
}
