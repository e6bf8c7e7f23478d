//! `make_logits_processors`: logit bias, then repetition, presence and frequency penalties
//! over the last `context_size` tokens of the history, each as mlx-lm computes it.

use std::cell::RefCell;

use mlx::{ops, Array, Dtype};

use super::ProcessorParams;
use crate::Result;

enum Processor {
    /// `logits.at[:, ids].add(values)`. When the ids are distinct, `dense` keeps the bias as
    /// one (1, V) row per vocabulary size and dtype asked for ([`LogitsProcessors::as_bias`]).
    Bias {
        ids: Array,
        values: Array,
        distinct: bool,
        dense: RefCell<Vec<(i32, Dtype, Array)>>,
    },
    /// Negative logits times `penalty`, positive ones divided by it, once per distinct token.
    Repetition { penalty: f32, context: usize },
    /// `logits[:, tokens] -= penalty`: once per distinct token.
    Presence { penalty: f32, context: usize },
    /// `logits.at[:, tokens].subtract(penalty)`: once per occurrence.
    Frequency { penalty: f32, context: usize },
}

pub struct LogitsProcessors {
    list: Vec<Processor>,
}

impl LogitsProcessors {
    /// A penalty takes part only when set and non-zero (so 1.0 repetition still runs, as in
    /// mlx-lm, and changes no value).
    pub fn new(p: &ProcessorParams) -> Result<LogitsProcessors> {
        let mut list = Vec::new();
        if !p.logit_bias.is_empty() {
            let ids: Vec<i32> = p.logit_bias.iter().map(|&(id, _)| id as i32).collect();
            let values: Vec<f32> = p.logit_bias.iter().map(|&(_, b)| b as f32).collect();
            let n = ids.len() as i32;
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            sorted.dedup();
            list.push(Processor::Bias {
                ids: Array::from_slice(&ids, &[n])?,
                values: Array::from_slice(&values, &[n, 1, 1])?,
                distinct: sorted.len() == ids.len(),
                dense: RefCell::new(Vec::new()),
            });
        }
        let active = |v: Option<f64>| v.filter(|&x| x != 0.0).map(|x| x as f32);
        if let Some(penalty) = active(p.repetition_penalty) {
            list.push(Processor::Repetition {
                penalty,
                context: p.repetition_context_size,
            });
        }
        if let Some(penalty) = active(p.presence_penalty) {
            list.push(Processor::Presence {
                penalty,
                context: p.presence_context_size,
            });
        }
        if let Some(penalty) = active(p.frequency_penalty) {
            list.push(Processor::Frequency {
                penalty,
                context: p.frequency_context_size,
            });
        }
        Ok(LogitsProcessors { list })
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Whether a processor reads the token history (a penalty; a logit bias does not), so that
    /// a draft must be read before the next is sampled.
    pub fn reads_history(&self) -> bool {
        self.list
            .iter()
            .any(|p| !matches!(p, Processor::Bias { .. }))
    }

    /// Whether the processors are a logit bias over distinct ids and nothing else: one row
    /// added to the logits ([`LogitsProcessors::as_bias`]).
    pub fn is_bias(&self) -> bool {
        matches!(&self.list[..], [Processor::Bias { distinct: true, .. }])
    }

    /// The processors as one (1, V) row of `dtype` to add to logits of V = `vocab`, when they
    /// are a logit bias over distinct ids and nothing else; None otherwise. Every other entry
    /// is -0.0, so that adding it gives every logit the bits [`LogitsProcessors::apply`]
    /// gives (x + -0.0 is x, a signed zero included; a biased x gets x + b, once), to rows
    /// processed together: one add over many rows' logits in place of a scatter per row.
    pub fn as_bias(&self, vocab: i32, dtype: Dtype) -> Result<Option<Array>> {
        let [Processor::Bias {
            ids,
            values,
            distinct: true,
            dense,
        }] = &self.list[..]
        else {
            return Ok(None);
        };
        let mut dense = dense.borrow_mut();
        if let Some((_, _, row)) = dense.iter().find(|(v, d, _)| *v == vocab && *d == dtype) {
            return Ok(Some(row.clone()));
        }
        let neutral = Array::full(&[1, vocab], &Array::from_f32(-0.0), dtype)?;
        let row = ops::scatter_add(&neutral, &[ids], &values.astype(dtype)?, &[1])?;
        dense.push((vocab, dtype, row.clone()));
        Ok(Some(row))
    }

    /// Applies every processor in order to (1, V) logits given the 1-D token history; a logit
    /// bias alone also to (n, V) logits, every row alike (a block drafter's positions).
    pub fn apply(&self, history: &Array, logits: &Array) -> Result<Array> {
        let mut logits = logits.clone();
        for p in &self.list {
            logits = match p {
                Processor::Bias { ids, values, .. } => {
                    let rows = [values.dim(0), logits.dim(0), 1];
                    let updates = values.astype(logits.dtype())?.broadcast_to(&rows)?;
                    ops::scatter_add(&logits, &[ids], &updates, &[1])?
                }
                Processor::Repetition { penalty, context } => {
                    let t = last(history, *context)?;
                    let selected = logits.take(&t, 1)?;
                    let negative = selected.less(&Array::scalar(0.0, selected.dtype())?)?;
                    let penalized = ops::r#where(
                        &negative,
                        &selected.multiply_scalar(*penalty)?,
                        &selected.divide_scalar(*penalty)?,
                    )?;
                    set_columns(&logits, &t, &penalized)?
                }
                Processor::Presence { penalty, context } => {
                    let t = last(history, *context)?;
                    let lowered = logits.take(&t, 1)?.subtract_scalar(*penalty)?;
                    set_columns(&logits, &t, &lowered)?
                }
                Processor::Frequency { penalty, context } => {
                    let t = last(history, *context)?;
                    let n = t.dim(0);
                    let minus =
                        Array::full(&[n, 1, 1], &Array::from_f32(-penalty), logits.dtype())?;
                    ops::scatter_add(&logits, &[&t], &minus, &[1])?
                }
            };
        }
        Ok(logits)
    }
}

/// `tokens[-context:]`.
fn last(history: &Array, context: usize) -> mlx::Result<Array> {
    let n = history.dim(0);
    history.slice_axis(0, (n - context as i32).max(0), n)
}

/// `logits[:, ids] = values` for (1, V) logits and (1, n) values.
fn set_columns(logits: &Array, ids: &Array, values: &Array) -> mlx::Result<Array> {
    let n = ids.dim(0);
    let updates = values.transpose(&[])?.reshape(&[n, 1, 1])?;
    ops::scatter(logits, &[ids], &updates, &[1])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The processors of `p` applied to (1, V) `logits` after `history`.
    fn apply(p: ProcessorParams, logits: &[f32], history: &[i32]) -> Vec<f32> {
        let procs = LogitsProcessors::new(&p).unwrap();
        let logits = Array::from_slice(logits, &[1, logits.len() as i32]).unwrap();
        let history = Array::from_slice(history, &[history.len() as i32]).unwrap();
        let out = procs.apply(&history, &logits).unwrap();
        out.to_vec::<f32>().unwrap()
    }

    /// docs/parity-notes.md, "Logits processors", checked against mlx-lm: logits
    /// [1, -2, 3, .5], history [0, 1, 1, 3], repetition penalty 2 -> [.5, -4, 3, .25].
    #[test]
    fn repetition_penalizes_each_distinct_token_once() {
        let p = ProcessorParams {
            repetition_penalty: Some(2.0),
            ..ProcessorParams::default()
        };
        let out = apply(p, &[1.0, -2.0, 3.0, 0.5], &[0, 1, 1, 3]);
        assert_eq!(out, vec![0.5, -4.0, 3.0, 0.25]);
    }

    #[test]
    fn presence_counts_once_and_frequency_counts_every_occurrence() {
        let (logits, history) = ([0.0; 4], [1, 1, 1, 2]);
        let presence = ProcessorParams {
            presence_penalty: Some(0.5),
            ..ProcessorParams::default()
        };
        let frequency = ProcessorParams {
            frequency_penalty: Some(0.5),
            ..ProcessorParams::default()
        };
        assert_eq!(
            apply(presence, &logits, &history),
            vec![0.0, -0.5, -0.5, 0.0]
        );
        assert_eq!(
            apply(frequency, &logits, &history),
            vec![0.0, -1.5, -0.5, 0.0]
        );
    }

    #[test]
    fn context_size_limits_the_history() {
        let p = ProcessorParams {
            presence_penalty: Some(1.0),
            presence_context_size: 2,
            ..ProcessorParams::default()
        };
        let out = apply(p, &[0.0; 4], &[0, 1, 2, 3]);
        assert_eq!(out, vec![0.0, 0.0, -1.0, -1.0]);
    }

    /// A bias over distinct ids added as one row gives every logit the bits the scatter
    /// gives, a negative zero and an infinity included, in f32 and bf16; a block of rows is
    /// biased as each row alone; duplicate ids or a penalty beside it make no row.
    #[test]
    fn a_bias_row_adds_what_the_scatter_adds() {
        let bias = |ids: &[u32]| ProcessorParams {
            logit_bias: ids
                .iter()
                .map(|&id| (id, 0.37 * f64::from(id) - 1.0))
                .collect(),
            ..ProcessorParams::default()
        };
        let logits = [-0.0f32, 0.0, 1.3e-3, -7.25, f32::NEG_INFINITY, 3.0e4];
        let history = Array::from_slice(&[1i32], &[1]).unwrap();
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let x = Array::from_slice(&logits, &[1, 6])
                .unwrap()
                .astype(dtype)
                .unwrap();
            let procs = LogitsProcessors::new(&bias(&[0, 3, 5])).unwrap();
            assert!(procs.is_bias() && !procs.reads_history());
            let row = procs.as_bias(6, dtype).unwrap().unwrap();
            let want = procs.apply(&history, &x).unwrap().to_bytes().unwrap();
            assert_eq!(x.add(&row).unwrap().to_bytes().unwrap(), want, "{dtype:?}");
            let unbiased = LogitsProcessors::new(&bias(&[2])).unwrap();
            let row = unbiased.as_bias(6, dtype).unwrap().unwrap();
            let kept: Vec<u8> = x.add(&row).unwrap().to_bytes().unwrap();
            let x_bytes = x.to_bytes().unwrap();
            let width = x_bytes.len() / 6;
            let column = |b: &[u8], c: usize| b[c * width..(c + 1) * width].to_vec();
            for c in [0, 1, 3, 4, 5] {
                assert_eq!(
                    column(&kept, c),
                    column(&x_bytes, c),
                    "{dtype:?} column {c}"
                );
            }
        }
        // A block of rows is biased as each row alone.
        let procs = LogitsProcessors::new(&bias(&[0, 3, 5])).unwrap();
        let block: Vec<f32> = logits.iter().chain(logits.iter().rev()).copied().collect();
        let block = Array::from_slice(&block, &[2, 6]).unwrap();
        let rows: Vec<f32> = (0..2)
            .flat_map(|r| {
                let row = block.slice_axis(0, r, r + 1).unwrap();
                procs
                    .apply(&history, &row)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap()
            })
            .collect();
        let whole = procs
            .apply(&history, &block)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(
            whole.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            rows.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let doubled = LogitsProcessors::new(&bias(&[4, 4])).unwrap();
        assert!(!doubled.is_bias());
        assert!(doubled.as_bias(6, Dtype::Float32).unwrap().is_none());
        let penalized = LogitsProcessors::new(&ProcessorParams {
            repetition_penalty: Some(1.2),
            ..bias(&[1])
        })
        .unwrap();
        assert!(penalized.reads_history() && !penalized.is_bias());
    }

    #[test]
    fn zero_penalties_add_no_processor() {
        let p = ProcessorParams {
            repetition_penalty: Some(0.0),
            frequency_penalty: Some(0.0),
            ..ProcessorParams::default()
        };
        assert!(LogitsProcessors::new(&p).unwrap().is_empty());
    }
}
