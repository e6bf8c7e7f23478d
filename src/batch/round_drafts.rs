//! A step's drafts as its rows feed them: read back to the host, or still on the device. Rows
//! that draft together with one draft model and whose verdicts do not read their drafts leave
//! them there: the step gathers its token ids from the drafts as sampled, so the host builds
//! the verify while the device drafts and waits once a step, for the drafts and the verdict
//! together. On a GPU a round otherwise waited twice: for its last draft, then for its verify,
//! the device idle while the host built the verify (docs/gpu-rows.md).

use mlx::{Array, Dtype};

use crate::bundle::ModelBundle;
use crate::generate::token_array;
use crate::speculative::draft_model::{SteppedDraft, UnreadDrafts};
use crate::speculative::DraftContext;
use crate::Result;

/// A speculative row's drafts for the step, drafted together with other rows'.
pub(super) enum Drafted {
    /// Read back.
    Read(Vec<u32>),
    /// Still on the device: row `row` of the step's unread group `group`.
    Unread { group: usize, row: usize },
}

/// The rows of a step that draft with one draft model: their indices in the batch, each one's
/// round (its draft model's steps, its context, the drafts it wants), their rows in the
/// model's shared draft caches, and whether a row's verdict reads its drafts before the step's
/// evaluation (then the group's drafts are read at once).
pub(super) struct DraftingRows<'a, 'm> {
    pub(super) model: &'m ModelBundle,
    pub(super) rows: Vec<usize>,
    pub(super) members: Vec<(&'a mut dyn SteppedDraft, DraftContext<'a>, usize)>,
    pub(super) in_buffer: Vec<usize>,
    pub(super) read_now: bool,
}

/// A step's unread drafts: each group's, with its tokens (None where no row drafted).
pub(super) struct Unread {
    groups: Vec<(UnreadDrafts, Option<Array>)>,
}

impl Unread {
    pub(super) fn new(groups: Vec<UnreadDrafts>) -> Result<Unread> {
        let groups = groups
            .into_iter()
            .map(|g| {
                let tokens = g.tokens()?;
                Ok((g, tokens))
            })
            .collect::<Result<_>>()?;
        Ok(Unread { groups })
    }

    /// How many drafts row `row` of group `group` feeds.
    pub(super) fn count(&self, group: usize, row: usize) -> usize {
        self.groups[group].0.positions(row).len()
    }

    /// The arrays the step's evaluation must compute for the drafts to be read.
    pub(super) fn tokens(&self) -> impl Iterator<Item = &Array> {
        self.groups.iter().filter_map(|(_, t)| t.as_ref())
    }

    /// The step's packed token ids (T,): each row's `inputs` (its tokens known on the host)
    /// followed by its unread drafts, if any, gathered from the groups' tokens on the device.
    pub(super) fn ids(&self, inputs: &[Vec<u32>], drafted: &[Option<Drafted>]) -> Result<Array> {
        let known = token_array(&inputs.concat())?;
        if self.groups.is_empty() {
            return Ok(known);
        }
        let mut sources = vec![known];
        let mut offsets = Vec::with_capacity(self.groups.len());
        let mut end = sources[0].dim(0) as usize;
        for (_, tokens) in &self.groups {
            offsets.push(end);
            if let Some(t) = tokens {
                end += t.dim(0) as usize;
                sources.push(t.astype(Dtype::Int32)?);
            }
        }
        let mut at = 0;
        let mut picked: Vec<i32> = Vec::with_capacity(end);
        for (input, drafts) in inputs.iter().zip(drafted) {
            picked.extend((at..at + input.len()).map(|i| i as i32));
            at += input.len();
            if let Some(Drafted::Unread { group, row }) = drafts {
                let positions = self.groups[*group].0.positions(*row);
                picked.extend(positions.iter().map(|p| (offsets[*group] + p) as i32));
            }
        }
        let all = mlx::ops::concatenate(&sources.iter().collect::<Vec<_>>(), 0)?;
        let picked = Array::from_slice(&picked, &[picked.len() as i32])?;
        Ok(all.take(&picked, 0)?)
    }

    /// Each group's drafts per row, read back after the step's evaluation.
    pub(super) fn read(&self) -> Result<Vec<Vec<Vec<u32>>>> {
        self.groups
            .iter()
            .map(|(g, tokens)| {
                let read = match tokens {
                    Some(t) => t.to_vec::<u32>()?,
                    None => Vec::new(),
                };
                Ok(g.split(&read))
            })
            .collect()
    }
}
