//! Plain rows one step ahead. While every row decodes plain, without a grammar, the batch
//! enqueues step n+1 over step n's tokens still on the
//! device before it reads them, as a lone request (generate_step) and mlx-lm's batch
//! (`GenerationBatch._step`, mlx_lm/generate.py:1429-1442) do: on a GPU the host builds and
//! launches a step while the device computes the one before. A row that ends has fed its last
//! token to the step ahead; its caches give that token back as it leaves (a KV cache trims it,
//! a recurrent layer returns to its state before the step), so that they hold what they would
//! had the batch waited, or, where a rotating window overwrote a key with it, the row leaves
//! without them. The forwards are the same, so are every row's bits.

use std::time::Instant;

use mlx::Array;

use super::greedy::GreedyRows;
use super::{Batch, Decoder, Left, OnToken, Plain};
use crate::cache::{quantize_due, LayerCache, RecurrentState};
use crate::error::contract;
use crate::generate::token_array;
use crate::Result;

/// A step enqueued whose tokens are not read yet.
pub(super) struct Ahead {
    /// Its token of each row, in the order of the rows it stepped (n,) uint32: the input of
    /// the step after it.
    tokens: Array,
    /// Each row's logprobs (V,), in the same order.
    logprobs: Vec<Array>,
}

/// A step dropped unread (its rows left or were removed, the batch dropped) may still be
/// running; waiting for it keeps MLX from writing into outputs nobody holds any more, as a lone
/// generation waits for its step after the last token.
impl Drop for Ahead {
    fn drop(&mut self) {
        let _ = mlx::eval(std::iter::once(&self.tokens).chain(&self.logprobs));
    }
}

impl Batch<'_> {
    /// Whether the next step runs ahead: every row decodes plain, without a grammar (which
    /// reads a token before it masks the next).
    pub(super) fn runs_ahead(&self) -> bool {
        !self.rows.is_empty()
            && self.rows.iter().all(|row| match &row.decoder {
                Decoder::Plain(p) => !p.sampler.is_constrained(),
                Decoder::Speculative { .. } => false,
            })
    }

    /// Row `at`, which fed its last token to the step ahead, takes that token back out of its
    /// caches, its own or its row of the shared ones; false (its caches untouched) when a
    /// rotating window of them cannot.
    pub(super) fn give_back(&mut self, at: usize) -> Result<bool> {
        let in_shared = at < self.shared_rows();
        let p = plain(&mut self.rows[at].decoder)?;
        let (caches, row) = match &mut self.shared {
            Some(shared) if in_shared => (&mut shared[..], at),
            _ => (&mut p.caches[..], 0),
        };
        if caches.iter().any(|c| matches!(c, LayerCache::Rotating(_))) {
            return Ok(false);
        }
        let mut before = std::mem::take(&mut p.recurrent_before).into_iter();
        for (layer, cache) in caches.iter_mut().enumerate() {
            let recurrent = match cache {
                LayerCache::Recurrent(c) => c,
                LayerCache::RecurrentRows(rows) => &mut rows[row],
                LayerCache::Batch(b) => {
                    b.trim(row, 1)?;
                    continue;
                }
                cache => {
                    cache.trim(1)?;
                    continue;
                }
            };
            let (at, state) = before.next().ok_or_else(|| contract("no state kept"))?;
            if at != layer {
                return Err(contract("a recurrent state kept for another layer"));
            }
            recurrent.restore(state, recurrent.seen - 1);
        }
        Ok(true)
    }

    /// Enqueues the next step over each row's unread token (or, for a row that joined since,
    /// its prompt's last), then reads the step before and hands its tokens out. With no step
    /// ahead yet, it enqueues two before it reads.
    pub(super) fn step_ahead(&mut self, on_token: OnToken<'_>) -> Result<Vec<Left>> {
        let started = Instant::now();
        self.prefilled = false;
        let previous = self.ahead.take();
        self.arrange_shared()?;
        let shared_rows = self.shared_rows();
        for (at, row) in self.rows.iter_mut().enumerate() {
            let p = plain(&mut row.decoder)?;
            p.recurrent_before = match &self.shared {
                Some(shared) if at < shared_rows => recurrent_states(shared, at),
                _ => recurrent_states(&p.caches, 0),
            };
        }
        let inputs = self.inputs_after(previous.as_ref())?;
        let lens = vec![1; self.rows.len()];
        let ids = match &inputs {
            Inputs::Whole(tokens) => tokens.clone(),
            Inputs::Rows(rows) => concatenate(rows)?,
        };
        let logits = self.forward(&ids, &lens, &[])?.logits;
        let greedy = GreedyRows::sample(&self.rows, &lens, &logits)?;
        let (mut sampled, mut logprobs) = (Vec::new(), Vec::new());
        for (at, row) in self.rows.iter_mut().enumerate() {
            let p = plain(&mut row.decoder)?;
            quantize_due(&mut p.caches, p.params.kv_quantization.as_ref())?;
            match greedy.as_ref().and_then(|g| Some((g.index(at as i32)?, g))) {
                Some((i, g)) => {
                    sampled.push(Err(i));
                    logprobs.push(g.logprobs[i].clone());
                }
                None => {
                    // A row that joined since feeds its prompt's last token as a lone request
                    // does (int32), so that its processors' history is that request's.
                    let input = match (&inputs, p.ahead) {
                        (Inputs::Whole(t), _) => t.slice_axis(0, at as i32, at as i32 + 1)?,
                        (Inputs::Rows(rows), Some(_)) => rows[at].clone(),
                        (Inputs::Rows(_), None) => token_array(&[p.next])?,
                    };
                    let (y, lp) =
                        p.sample(&input, &logits.slice_axis(1, at as i32, at as i32 + 1)?)?;
                    sampled.push(Ok(y));
                    logprobs.push(lp);
                }
            }
        }
        // Each row's token: its own sample, or (Err) its index among the greedy rows'.
        let tokens = match &greedy {
            Some(g) if sampled.iter().all(Result::is_err) => g.tokens.clone(),
            _ => {
                let rows = (sampled.into_iter())
                    .map(|t| match (t, &greedy) {
                        (Ok(y), _) => Ok(y),
                        (Err(i), Some(g)) => Ok(g.tokens.slice_axis(0, i as i32, i as i32 + 1)?),
                        (Err(_), None) => Err(contract("a greedy row without greedy rows")),
                    })
                    .collect::<Result<Vec<_>>>()?;
                concatenate(&rows)?
            }
        };
        let built_at = Instant::now();
        mlx::async_eval(std::iter::once(&tokens).chain(&logprobs))?;
        let split = &mut self.split;
        split.steps += 1;
        split.rows += lens.len();
        split.shared += usize::from(self.shared.is_some());
        split.build += built_at - started;
        split.eval += built_at.elapsed();
        let next = Ahead { tokens, logprobs };
        match previous {
            None => {
                self.enqueued(next);
                self.step_ahead(on_token)
            }
            Some(previous) => self.read_ahead(previous, Some(next), on_token),
        }
    }

    /// Reads the step enqueued ahead and hands each row's token out; the rows that joined
    /// since have none in it. `next`: the step enqueued after it, every row's last token fed to
    /// it, or None when the batch stops running ahead.
    pub(super) fn read_ahead(
        &mut self,
        mut ahead: Ahead,
        next: Option<Ahead>,
        on_token: OnToken<'_>,
    ) -> Result<Vec<Left>> {
        let started = Instant::now();
        let tokens = ahead.tokens.to_vec::<u32>()?;
        let read_at = Instant::now();
        let mut leaving = Vec::new();
        let logprobs = std::mem::take(&mut ahead.logprobs);
        let mut logprobs = logprobs.into_iter().map(Some).collect::<Vec<_>>();
        for row in &mut self.rows {
            let Decoder::Plain(p) = &mut row.decoder else {
                continue;
            };
            let Some(at) = p.ahead.take() else {
                continue;
            };
            let lp = (logprobs[at].take()).ok_or_else(|| contract("a row read twice"))?;
            if p.emit(row.id, tokens[at], lp, on_token)? {
                leaving.push(row.id);
            }
        }
        let fed = next.is_some();
        if let Some(next) = next {
            self.enqueued(next);
        }
        let left = self.depart(&leaving, fed)?;
        self.split.eval += read_at - started;
        self.split.settle += read_at.elapsed();
        Ok(left)
    }

    /// `step` is the step enqueued ahead, every row in it at its place.
    fn enqueued(&mut self, step: Ahead) {
        for (at, row) in self.rows.iter_mut().enumerate() {
            if let Decoder::Plain(p) = &mut row.decoder {
                p.ahead = Some(at);
            }
        }
        self.ahead = Some(step);
    }

    /// Each row's input to the step after `previous`: its token there, or its prompt's last.
    fn inputs_after(&self, previous: Option<&Ahead>) -> Result<Inputs> {
        let at = |row: &super::Row<'_>| match &row.decoder {
            Decoder::Plain(p) => p.ahead,
            Decoder::Speculative { .. } => None,
        };
        if let Some(previous) = previous {
            let same = previous.logprobs.len() == self.rows.len()
                && (self.rows.iter().enumerate()).all(|(i, row)| at(row) == Some(i));
            if same {
                return Ok(Inputs::Whole(previous.tokens.clone()));
            }
        }
        let rows = (self.rows.iter())
            .map(|row| match (at(row), previous, &row.decoder) {
                (Some(i), Some(previous), _) => {
                    Ok(previous.tokens.slice_axis(0, i as i32, i as i32 + 1)?)
                }
                (_, _, Decoder::Plain(p)) => Ok(Array::from_slice(&[p.next], &[1])?),
                _ => Err(contract("a speculative row in a step ahead")),
            })
            .collect::<Result<_>>()?;
        Ok(Inputs::Rows(rows))
    }
}

/// The token ids a step ahead feeds: the step before's tokens as they are, or each row's (1,),
/// all uint32 (the tokens' type), so that joining them converts none.
enum Inputs {
    Whole(Array),
    Rows(Vec<Array>),
}

/// The plain row a step ahead holds.
fn plain<'a>(decoder: &'a mut Decoder<'_>) -> Result<&'a mut Plain> {
    match decoder {
        Decoder::Plain(p) => Ok(p),
        Decoder::Speculative { .. } => Err(contract("a speculative row in a step ahead")),
    }
}

/// A row's state of each recurrent layer of `caches`, by layer: of its own caches, or of the
/// shared ones holding it as row `row`.
fn recurrent_states(caches: &[LayerCache], row: usize) -> Vec<(usize, Option<RecurrentState>)> {
    (caches.iter().enumerate())
        .filter_map(|(layer, c)| match c {
            LayerCache::Recurrent(c) => Some((layer, c.current().cloned())),
            LayerCache::RecurrentRows(rows) => Some((layer, rows[row].current().cloned())),
            _ => None,
        })
        .collect()
}

/// `pieces` end to end (1-D), or the one piece itself.
fn concatenate(pieces: &[Array]) -> Result<Array> {
    Ok(match pieces {
        [one] => one.clone(),
        _ => mlx::ops::concatenate(&pieces.iter().collect::<Vec<_>>(), 0)?,
    })
}
