//! `make_logits_processors`: logit bias, then repetition, presence and frequency penalties
//! over the last `context_size` tokens of the history, each as mlx-lm computes it.

use mlx::{ops, Array};

use super::ProcessorParams;
use crate::Result;

enum Processor {
    /// `logits.at[:, ids].add(values)`.
    Bias { ids: Array, values: Array },
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
            list.push(Processor::Bias {
                ids: Array::from_slice(&ids, &[n])?,
                values: Array::from_slice(&values, &[n, 1, 1])?,
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

    /// Applies every processor in order to (1, V) logits given the 1-D token history.
    pub fn apply(&self, history: &Array, logits: &Array) -> Result<Array> {
        let mut logits = logits.clone();
        for p in &self.list {
            logits = match p {
                Processor::Bias { ids, values } => {
                    ops::scatter_add(&logits, &[ids], &values.astype(logits.dtype())?, &[1])?
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
