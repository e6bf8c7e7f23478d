//! A draft group's next drafts, enqueued before its round's verdict is read. Plain rows step
//! ahead (`batch::ahead`); a speculative round cannot, since the next round's input is built
//! from this round's verdict, so on a GPU the device idled while the host built the next
//! drafts and the host idled while the device verified. For greedy rows of one draft (k = 1)
//! whose draft caches share a buffer, the next draft needs no verdict on the host: whatever
//! is accepted, the draft model next takes the target's greedy tokens at the round's two
//! positions (the accepted draft and the bonus token, or the correction and a token to take
//! back), and the next draft is the one after the second where the draft was accepted, after
//! the first where not, chosen on the device. So the batch launches the verify, builds and
//! launches that forward while the device verifies, then reads the verdict; the next round
//! verifies the draft as it lies on the device (`round_drafts`). The forward is the catch-up
//! the next round would run, with the rejected case's extra token taken back once read: each
//! row drafts what it drafts alone (on the CPU: tests/batch.rs compares acceptance counters),
//! and its tokens are the target's as before.

use std::ptr;

use mlx::{Array, Dtype};

use super::greedy::GreedyRows;
use super::round_drafts::{Drafted, Unread};
use super::{shared, Batch, Decoder};
use crate::bundle::ModelBundle;
use crate::error::contract;
use crate::speculative::draft_model::draft_ahead;
use crate::Result;

/// A draft group's rows' next drafts, fed ahead of a verdict.
pub(super) struct DraftsAhead<'m> {
    model: &'m ModelBundle,
    /// The rows fed ahead, by id, in the order of `drafts`.
    ids: Vec<usize>,
    /// Each row's index in the step's greedy tokens, where its two fed tokens start.
    at: Vec<usize>,
    /// (R,) uint32: each row's next draft (None once a round takes them).
    drafts: Option<Array>,
}

/// Drafts dropped unread may still be computing; waiting keeps MLX from writing into outputs
/// nobody holds any more (as `batch::ahead`'s steps do).
impl Drop for DraftsAhead<'_> {
    fn drop(&mut self) {
        if let Some(drafts) = &self.drafts {
            let _ = drafts.eval();
        }
    }
}

/// A draft group's next drafts as the next round takes them: (R,) uint32 in the group's row
/// order.
pub(super) struct Claimed<'m> {
    pub(super) model: &'m ModelBundle,
    pub(super) drafts: Array,
}

impl<'m> Batch<'m> {
    /// Before the verdicts of the step whose inputs are `drafted` (rows of `lens` tokens) are
    /// read: launches `enqueued` (the step's evaluation) and, for every draft group whose rows
    /// all verify one draft left on the device and are sampled with `greedy`, feeds their
    /// greedy tokens to the group's draft caches and launches the next drafts.
    pub(super) fn feed_ahead(
        &mut self,
        greedy: Option<&GreedyRows>,
        lens: &[usize],
        drafted: &[Option<Drafted>],
        unread: &Unread,
        enqueued: &[&Array],
    ) -> Result<()> {
        let Some(greedy) = greedy else {
            return Ok(());
        };
        let starts: Vec<i32> = (lens.iter())
            .scan(0, |start, &len| {
                let at = *start;
                *start += len as i32;
                Some(at)
            })
            .collect();
        let mut launched = false;
        for g in 0..self.draft_groups.len() {
            // Each row's (index in the batch, index in the greedy tokens, unread group, row
            // there), in the group's order.
            let mut members = Vec::new();
            for id in &self.draft_groups[g].ids {
                let Some(at) = self.rows.iter().position(|r| r.id == *id) else {
                    break;
                };
                let (Some(i), Some(Drafted::Unread { group, row })) =
                    (greedy.index(starts[at]), &drafted[at])
                else {
                    break;
                };
                if lens[at] != 2 || unread.count(*group, *row) != 1 {
                    break;
                }
                members.push((at, i, *group, *row));
            }
            let group = &self.draft_groups[g];
            let unread_group = members.first().map(|m| m.2);
            if members.len() != group.ids.len() || members.iter().any(|m| Some(m.2) != unread_group)
            {
                continue;
            }
            if !launched {
                mlx::async_eval(enqueued.iter().copied())?;
                launched = true;
            }
            let index = |at: Vec<i32>| Array::from_slice(&at, &[at.len() as i32]);
            let fed = (members.iter())
                .flat_map(|m| [m.1 as i32, m.1 as i32 + 1])
                .collect();
            let fed = greedy.tokens.take(&index(fed)?, 0)?;
            let firsts = greedy
                .tokens
                .take(&index(members.iter().map(|m| m.1 as i32).collect())?, 0)?;
            let rows: Vec<usize> = members.iter().map(|m| m.3).collect();
            let accepted = firsts.equal(&unread.drafts(members[0].2, &rows)?)?;
            let ids = group.ids.clone();
            let model = group.model;
            let rows = &self.rows;
            let biases = |vocab: i32, dtype: Dtype| {
                (members.iter())
                    .map(|m| match &rows[m.0].decoder {
                        Decoder::Speculative { speculator, .. } => {
                            speculator.argmax_bias(vocab, dtype)
                        }
                        Decoder::Plain(_) => Err(contract("a draft group's row speculates")),
                    })
                    .collect()
            };
            let drafts = draft_ahead(
                model.model(),
                &mut self.draft_groups[g].caches,
                &fed.astype(Dtype::Int32)?.expand_dims(&[0])?,
                &accepted,
                &biases,
            )?;
            mlx::async_eval([&drafts])?;
            self.drafts_ahead.push(DraftsAhead {
                model,
                ids,
                at: members.iter().map(|m| m.1).collect(),
                drafts: Some(drafts),
            });
        }
        Ok(())
    }

    /// Once the step's greedy `tokens` are read and its rows settled: every row fed ahead that
    /// does not leave (`leaving`) tells its draft model what it was fed, and takes back the
    /// token past the kept ones; its draft caches then hold one token more than its target's
    /// (the last emitted, which the target takes next), or the batch fails loudly.
    pub(super) fn settle_ahead(&mut self, tokens: &[u32], leaving: &[usize]) -> Result<()> {
        let mut fed = Vec::new();
        for ahead in &self.drafts_ahead {
            for (id, &i) in ahead.ids.iter().zip(&ahead.at) {
                if leaving.contains(id) {
                    continue;
                }
                let at = (self.rows.iter())
                    .position(|r| r.id == *id)
                    .ok_or_else(|| contract("a row fed ahead is gone before its verdict"))?;
                fed.push((ahead.model, at, i, self.target_offset(at)));
            }
        }
        for (model, at, i, target) in fed {
            let (id, row) = (self.rows[at].id, &mut self.rows[at]);
            let Decoder::Speculative { source, .. } = &mut row.decoder else {
                return Err(contract("a row fed ahead speculates"));
            };
            let stepped = source
                .stepped()
                .ok_or_else(|| contract("a row fed ahead steps a draft model"))?;
            let extra = stepped.fed_ahead(&tokens[i..i + 2])?;
            let (r, group) = (self.draft_groups.iter_mut())
                .filter(|g| ptr::eq(g.model, model))
                .find_map(|g| Some((g.row_of(id)?, g)))
                .ok_or_else(|| contract("a row fed ahead left its group before its verdict"))?;
            shared::trim(&mut group.caches, r, extra)?;
            if group.offset(r) != target + 1 {
                return Err(contract(format!(
                    "row {id}'s draft caches hold {} tokens after feeding ahead, its target's {target}",
                    group.offset(r)
                )));
            }
        }
        Ok(())
    }

    /// At the start of a step, once the rows are arranged: the drafts fed ahead that the step's
    /// rounds take, a draft group's where each of its rows was fed ahead and drafts one token
    /// (their rounds then feed nothing first). Every other row fed ahead drops its draft: its
    /// last fed token is pending again and leaves its draft caches.
    pub(super) fn claim_ahead(&mut self) -> Result<Vec<Claimed<'m>>> {
        let mut claimed = Vec::new();
        for mut ahead in std::mem::take(&mut self.drafts_ahead) {
            let group = (self.draft_groups.iter()).find(|g| ptr::eq(g.model, ahead.model));
            // Every row drafting with the model is in the group, and every row fed ahead too.
            let whole = group.is_some_and(|g| {
                self.rows.iter().all(|r| {
                    let drafts = r.draft_model().is_some_and(|m| ptr::eq(m, ahead.model));
                    g.ids.contains(&r.id) || !(drafts || ahead.ids.contains(&r.id))
                })
            });
            let order: Option<Vec<i32>> = group.filter(|_| whole).and_then(|g| {
                (g.ids.iter())
                    .map(|id| {
                        let row = self.rows.iter().find(|r| r.id == *id)?;
                        let Decoder::Speculative { speculator, .. } = &row.decoder else {
                            return None;
                        };
                        let j = ahead.ids.iter().position(|i| i == id)?;
                        (speculator.next_drafts() == 1).then_some(j as i32)
                    })
                    .collect()
            });
            if let Some(order) = order {
                if self.take_ahead(&ahead.ids)? {
                    let index = Array::from_slice(&order, &[order.len() as i32])?;
                    let drafts = ahead.drafts.take().expect("drafts not taken yet");
                    claimed.push(Claimed {
                        model: ahead.model,
                        drafts: drafts.take(&index, 0)?,
                    });
                    continue;
                }
            }
            self.drop_ahead(&ahead.ids)?;
        }
        Ok(claimed)
    }

    /// Whether the rows of `ids` in the batch held tokens fed ahead, which their next rounds
    /// now take; false, taking nothing, where none did (a group's rows are fed together).
    fn take_ahead(&mut self, ids: &[usize]) -> Result<bool> {
        let mut taken = false;
        for row in self.rows.iter_mut().filter(|r| ids.contains(&r.id)) {
            let Decoder::Speculative { source, .. } = &mut row.decoder else {
                continue;
            };
            let stepped = source.stepped().ok_or_else(|| contract("no draft model"))?;
            if !stepped.take_ahead() {
                if taken {
                    return Err(contract("rows of one group fed ahead apart"));
                }
                return Ok(false);
            }
            taken = true;
        }
        Ok(true)
    }

    /// The rows of `ids` drop the drafts fed ahead for them: each takes its last fed token back
    /// from its draft caches (its group's buffer, or its own), to feed it again.
    fn drop_ahead(&mut self, ids: &[usize]) -> Result<()> {
        for row in self.rows.iter_mut().filter(|r| ids.contains(&r.id)) {
            let id = row.id;
            let Decoder::Speculative { source, .. } = &mut row.decoder else {
                continue;
            };
            let stepped = source.stepped().ok_or_else(|| contract("no draft model"))?;
            if !stepped.drop_ahead() {
                continue;
            }
            match (self.draft_groups.iter_mut()).find_map(|g| Some((g.row_of(id)?, g))) {
                Some((r, group)) => shared::trim(&mut group.caches, r, 1)?,
                None => {
                    for cache in stepped.caches_mut() {
                        cache.trim(1)?;
                    }
                }
            }
        }
        Ok(())
    }
}
