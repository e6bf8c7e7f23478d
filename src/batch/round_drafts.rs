//! A step's drafts as its rows feed them: read back to the host, or still on the device. Rows
//! that draft together with one draft model and whose verdicts do not read their drafts leave
//! them there: the step gathers its token ids from the drafts as sampled, so the host builds
//! the verify while the device drafts and waits once a step, for the drafts and the verdict
//! together. On a GPU a round otherwise waited twice: for its last draft, then for its verify,
//! the device idle while the host built the verify (docs/gpu-rows.md). `Batch::draft_shared`
//! drafts a step's rows that share a draft model, each model's rows together.

use std::ptr;

use mlx::{Array, Dtype};

use super::draft_ahead::Claimed;
use super::{Batch, Decoder};
use crate::bundle::ModelBundle;
use crate::generate::token_array;
use crate::speculative::draft_model::{
    draft_together, draft_unread, SharedDraftCaches, SteppedDraft, UnreadDrafts,
};
use crate::speculative::DraftContext;
use crate::{error::contract, Result};

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

    /// The one draft of each of `rows` of group `group`, (R,) uint32 on the device.
    pub(super) fn drafts(&self, group: usize, rows: &[usize]) -> Result<Array> {
        let (g, tokens) = &self.groups[group];
        let tokens = tokens
            .as_ref()
            .ok_or_else(|| contract("a group without drafts"))?;
        let at: Vec<i32> = rows.iter().map(|&r| g.positions(r)[0] as i32).collect();
        Ok(tokens.take(&Array::from_slice(&at, &[at.len() as i32])?, 0)?)
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

impl<'m> Batch<'m> {
    /// The next round's drafts of every speculative row whose draft model another row drafts
    /// with too, each model's rows drafting together; None for the rows that draft alone. A
    /// model's rows whose verdicts do not read their drafts leave them on the device
    /// ([`Drafted::Unread`], rows of the returned [`UnreadDrafts`]).
    pub(super) fn draft_shared(
        &mut self,
        mut claimed: Vec<Claimed<'m>>,
    ) -> Result<(Vec<Option<Drafted>>, Vec<UnreadDrafts>)> {
        let models: Vec<Option<&'m ModelBundle>> = self
            .rows
            .iter()
            .map(|row| match &row.decoder {
                Decoder::Speculative { drafter, .. } => drafter.draft_model(),
                Decoder::Plain(_) => None,
            })
            .collect();
        let shared =
            |m: &ModelBundle| models.iter().flatten().filter(|o| ptr::eq(**o, m)).count() > 1;
        let mut out: Vec<Option<Drafted>> = (0..self.rows.len()).map(|_| None).collect();
        let mut groups: Vec<DraftingRows<'_, 'm>> = Vec::new();
        for ((i, row), model) in self.rows.iter_mut().enumerate().zip(&models) {
            let (
                Some(model),
                Decoder::Speculative {
                    speculator, source, ..
                },
            ) = (*model, &mut row.decoder)
            else {
                continue;
            };
            if !shared(model) {
                continue;
            }
            let Some(stepped) = source.stepped() else {
                continue;
            };
            let reads_drafts = speculator.verdict_reads_drafts();
            let Some((want, ctx)) = speculator.draft_request() else {
                out[i] = Some(Drafted::Read(Vec::new()));
                continue;
            };
            let g = match groups.iter().position(|g| ptr::eq(g.model, model)) {
                Some(g) => g,
                None => {
                    groups.push(DraftingRows {
                        model,
                        rows: Vec::new(),
                        members: Vec::new(),
                        in_buffer: Vec::new(),
                        read_now: false,
                    });
                    groups.len() - 1
                }
            };
            let in_buffer = self.draft_groups.iter().find_map(|g| g.row_of(row.id));
            let group = &mut groups[g];
            group.rows.push(i);
            group.members.push((stepped, ctx, want));
            group.in_buffer.extend(in_buffer);
            group.read_now |= reads_drafts;
        }
        let mut unread = Vec::new();
        for group in groups {
            let DraftingRows {
                model,
                rows,
                members,
                in_buffer,
                read_now,
            } = group;
            let shared = self
                .draft_groups
                .iter_mut()
                .find(|g| ptr::eq(g.model, model));
            // Over shared caches the rows draft in the buffer's order.
            let mut order: Vec<_> = rows.into_iter().zip(members).collect();
            let shared = match shared {
                Some(group) if in_buffer.len() == order.len() => {
                    let mut keyed: Vec<_> = in_buffer.into_iter().zip(order).collect();
                    keyed.sort_by_key(|(r, _)| *r);
                    let (in_buffer, sorted): (Vec<usize>, Vec<_>) = keyed.into_iter().unzip();
                    order = sorted;
                    Some(SharedDraftCaches {
                        len: group.ids.len(),
                        caches: &mut group.caches,
                        rows: in_buffer,
                    })
                }
                _ => None,
            };
            let (rows, mut members): (Vec<usize>, Vec<_>) = order.into_iter().unzip();
            if let Some(c) = claimed.iter().position(|c| ptr::eq(c.model, model)) {
                // Fed ahead: the caches hold every pending token, the drafts wait on the device.
                if shared.is_none() || members.iter().any(|(_, _, want)| *want != 1) {
                    return Err(contract("drafts fed ahead for other rounds"));
                }
                for (source, _, _) in &mut members {
                    if source
                        .open_round(1)
                        .is_none_or(|pending| !pending.is_empty())
                    {
                        return Err(contract("a round fed ahead has tokens to feed"));
                    }
                }
                let group = unread.len();
                unread.push(UnreadDrafts::one_each(claimed.swap_remove(c).drafts));
                for (row, i) in rows.into_iter().enumerate() {
                    out[i] = Some(Drafted::Unread { group, row });
                }
            } else if read_now {
                let drafts = draft_together(model.model(), &mut members, shared)?;
                for (i, drafts) in rows.into_iter().zip(drafts) {
                    out[i] = Some(Drafted::Read(drafts));
                }
            } else {
                let group = unread.len();
                unread.push(draft_unread(model.model(), &mut members, shared)?);
                for (row, i) in rows.into_iter().enumerate() {
                    out[i] = Some(Drafted::Unread { group, row });
                }
            }
        }
        Ok((out, unread))
    }
}
