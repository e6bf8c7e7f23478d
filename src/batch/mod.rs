//! Requests decoded together. Each step runs one packed forward over every row's next input
//! ([`crate::model::rows`]): a plain row's next token, a speculative row's round `[last,
//! drafts...]` (its drafts proposed by its own source). Each row then samples, or verifies and
//! accepts, from its own logits with its own processors, grammar, random keys, caches and stop
//! conditions, and a speculative row takes its rejected drafts back from its own caches. Rows
//! join between steps (prefilled alone, the running rows stepping between its chunks; their
//! first token comes with the next step, or the one after while the batch steps ahead) and leave
//! when they finish or are removed. Rows that
//! draft with the same draft model draft together, one packed forward per draft step
//! (crate::speculative::draft_model::draft_together).
//!
//! While every row's caches are plain KV caches (and no row's draft source reads them), the
//! rows' caches are gathered into one [`crate::cache::BatchKvCache`] per layer (rows joining
//! move in, rows leaving take theirs back out; a speculative row's rejected drafts are taken
//! back there), so that a step writes every row's keys in one op and, on CUDA, attends every
//! query, a verify's included, in one kernel: on a GPU a step's cost is the host's work per
//! graph node (`batch::shared`).
//!
//! A row emits what its request emits alone through [`crate::decode::decode`], token for token
//! and logprob bit for bit, wherever the packed forward gives each row its lone bits (on the
//! CPU: tests/batch.rs). What differs is only when work happens: while every row decodes plain,
//! the batch enqueues its next step before it reads the current one's tokens, as a lone request
//! does (`batch::ahead`); a step with a speculative or grammar-constrained row reads every row's
//! tokens at its end, since its rows' next inputs (drafts, masks) are built from them.

mod ahead;
mod draft_ahead;
mod draft_policy;
mod greedy;
mod round_drafts;
mod shared;

use std::time::{Duration, Instant};

use mlx::{Array, Dtype};

use crate::cache::{plan_step, quantize_due, LayerCache, RecurrentState};
use crate::decode::{Request, Start};
use crate::generate::{
    logprobs_after, prefill_request, token_array, Control, GenerateParams, GeneratedToken,
    OnPrefilled, Prefilled, Resume,
};
use crate::model::{lone_rows, Forward, LanguageModel};
use crate::sample::StepSampler;
use crate::speculative::{DraftPrefix, DraftSource, Drafter, SpeculationStats, Speculator};
use crate::{error::contract, Result};
pub use draft_policy::{Choice, DraftPolicy};
use greedy::GreedyRows;
use round_drafts::{Drafted, Unread};
use shared::DraftGroup;

/// A plain row between steps.
struct Plain {
    caches: Vec<LayerCache>,
    sampler: StepSampler,
    params: GenerateParams,
    /// The token this row feeds next: its prompt's last, then each emitted one.
    next: u32,
    /// Its position in the step enqueued ahead whose tokens are read next ([`ahead::Ahead`]),
    /// while that token is on the device only.
    ahead: Option<usize>,
    /// Its recurrent layers' states before the step enqueued last, by layer: what they give
    /// back if the row ends on the token before ([`ahead::give_back`]).
    recurrent_before: Vec<(usize, Option<RecurrentState>)>,
    emitted: usize,
}

impl Plain {
    /// The row's logprobs (V,) and sampled token (1,) from its logits (1, 1, V) after it fed
    /// `input` (its processors' history then holds it).
    fn sample(&mut self, input: &Array, logits: &Array) -> Result<(Array, Array)> {
        let logprobs = logprobs_after(&mut self.sampler, input, &logits.squeeze(&[1])?)?;
        let y = self.sampler.sample(&logprobs)?.astype(Dtype::Uint32)?;
        Ok((y, logprobs.squeeze(&[0])?))
    }

    /// Hands row `id`'s token of a step to `on_token`; true when the row ends with it (EOS,
    /// max_tokens, or its callback answered `Stop`).
    fn emit(
        &mut self,
        id: usize,
        token: u32,
        logprobs: Array,
        on_token: OnToken<'_>,
    ) -> Result<bool> {
        if self.sampler.is_constrained() {
            self.sampler.advance_grammar(token)?;
        }
        self.emitted += 1;
        self.next = token;
        let finish = self.params.finish_for(token, self.emitted);
        let step = GeneratedToken {
            token,
            logprobs,
            from_draft: false,
            finish,
        };
        Ok(on_token(id, &step) == Control::Stop || finish.is_some())
    }
}

/// What a step hands each row's tokens to.
type OnToken<'a> = &'a mut dyn FnMut(usize, &GeneratedToken) -> Control;

/// How a row decodes.
enum Decoder<'m> {
    Plain(Box<Plain>),
    Speculative {
        speculator: Box<Speculator>,
        source: Box<dyn DraftSource + 'm>,
        drafter: &'m Drafter,
    },
}

impl Decoder<'_> {
    /// The row's own caches (empty while it is in the batch's shared caches).
    fn caches(&self) -> &[LayerCache] {
        match self {
            Decoder::Plain(p) => &p.caches,
            Decoder::Speculative { speculator, .. } => &speculator.caches,
        }
    }

    fn caches_mut(&mut self) -> &mut Vec<LayerCache> {
        match self {
            Decoder::Plain(p) => &mut p.caches,
            Decoder::Speculative { speculator, .. } => &mut speculator.caches,
        }
    }
}

/// One request in the batch.
struct Row<'m> {
    id: usize,
    decoder: Decoder<'m>,
}

/// A row that left the batch at the end of a step.
pub struct Left {
    pub id: usize,
    /// A speculative row's counters.
    pub speculation: Option<SpeculationStats>,
    /// A plain row's caches as it left them: its prompt and every token it emitted but the last;
    /// None where they cannot give back the last, which the batch fed to its step ahead (a
    /// rotating window).
    pub caches: Option<Vec<LayerCache>>,
}

/// Called after each prefill chunk of a joining row with the batch and the prompt tokens
/// prefilled so far ([`Batch::add`]).
pub type BetweenChunks<'a, 'm> = &'a mut dyn FnMut(&mut Batch<'m>, usize) -> Control;

/// Where the batch's steps spent their time, summed over steps: what to make cheaper next
/// (on a GPU a step is bound by the host, which builds and launches every row's ops).
#[derive(Clone, Debug, Default)]
pub struct StepSplit {
    pub steps: usize,
    /// The rows of every step, summed (over `steps`: the mean width of the batch).
    pub rows: usize,
    /// Drafting the speculative rows' next rounds: draft models run their forwards here, but
    /// for drafts left on the device for the step's one evaluation (`round_drafts`), whose
    /// forwards this only enqueues; in a step drafting ahead (`draft_ahead`), also launching
    /// the step's evaluation and the next drafts' forward.
    pub draft: Duration,
    /// Building the step's graph: the packed forward and every row's sampling or verdict.
    pub build: Duration,
    /// The one evaluation of every row's tokens: launching the graph and waiting for it.
    pub eval: Duration,
    /// Reading each row's tokens back, acceptance, rollback, and the callbacks.
    pub settle: Duration,
    /// The steps whose rows shared one KV cache per attention layer
    /// ([`crate::cache::BatchKvCache`]).
    pub shared: usize,
    /// The steps some of whose rows drafted over shared draft caches.
    pub shared_drafts: usize,
    /// The steps whose greedy speculative rows decoded plain, as the measured choice between
    /// drafting and plain steps had it ([`Batch::adapt_drafts`]).
    pub undrafted: usize,
    /// The steps that fed a draft group its next drafts before reading its verdicts
    /// (`batch::draft_ahead`).
    pub drafted_ahead: usize,
}

impl StepSplit {
    /// The time in the four phases together.
    pub fn total(&self) -> Duration {
        self.draft + self.build + self.eval + self.settle
    }

    /// What the steps since `earlier` (this split as it stood then) cost.
    pub fn since(&self, earlier: &StepSplit) -> StepSplit {
        StepSplit {
            steps: self.steps - earlier.steps,
            rows: self.rows - earlier.rows,
            draft: self.draft - earlier.draft,
            build: self.build - earlier.build,
            eval: self.eval - earlier.eval,
            settle: self.settle - earlier.settle,
            shared: self.shared - earlier.shared,
            shared_drafts: self.shared_drafts - earlier.shared_drafts,
            undrafted: self.undrafted - earlier.undrafted,
            drafted_ahead: self.drafted_ahead - earlier.drafted_ahead,
        }
    }
}

/// The rows decoding together on one model.
pub struct Batch<'m> {
    model: &'m dyn LanguageModel,
    rows: Vec<Row<'m>>,
    /// While every row's caches are plain KV caches that may be shared ([`Batch::can_share`])
    /// and the model's attention reads a [`crate::cache::BatchKvCache`], their caches gathered
    /// into one per layer: row r of `rows` is row r of each, and the rows' own caches are empty
    /// meanwhile.
    shared: Option<Vec<LayerCache>>,
    /// The rows drafting with one draft model whose draft caches share one buffer per layer,
    /// per draft model.
    draft_groups: Vec<DraftGroup<'m>>,
    /// Whether rows may share their caches at all ([`Batch::share_caches`]).
    may_share: bool,
    /// Whether greedy speculative rows draft or decode plain, when measured
    /// ([`Batch::adapt_drafts`]).
    draft_policy: Option<DraftPolicy>,
    /// The step enqueued ahead whose tokens are not read yet.
    ahead: Option<ahead::Ahead>,
    /// The draft groups' next drafts, fed ahead of the last step's verdicts.
    drafts_ahead: Vec<draft_ahead::DraftsAhead<'m>>,
    /// Whether a row joined or a prompt chunk was prefilled since the last step: the next step
    /// pays for them (the row's caches moved into the shared ones, MLX's buffer cache released
    /// after a chunk and allocated again), so its time says nothing about drafting and the
    /// draft policy does not take it.
    prefilled: bool,
    split: StepSplit,
}

impl<'m> Batch<'m> {
    pub fn new(model: &'m dyn LanguageModel) -> Batch<'m> {
        Batch {
            model,
            rows: Vec::new(),
            shared: None,
            draft_groups: Vec::new(),
            may_share: true,
            draft_policy: None,
            ahead: None,
            drafts_ahead: Vec::new(),
            prefilled: false,
            split: StepSplit::default(),
        }
    }

    /// Validates `request`, prefills its prompt but the last token alone, and adds it as row
    /// `id` (unique among the rows), speculative when `drafter` (loaded for this model) is
    /// given; its first token comes with the next [`Batch::step`] (the one after, while the
    /// batch steps ahead). `between_chunks` is called
    /// after each prefill chunk with the batch (its running rows, not yet this one) and the
    /// prompt tokens prefilled so far: there a caller steps the running rows, so that a long
    /// prompt joining does not stall them (the chunks are the lone request's, so are the
    /// bits); `Stop` cancels with [`crate::Error::Cancelled`]. `on_prefilled` sees the caches
    /// once prefilled.
    pub fn add(
        &mut self,
        id: usize,
        drafter: Option<&'m Drafter>,
        start: Start,
        request: Request<'_>,
        mut between_chunks: Option<BetweenChunks<'_, 'm>>,
        on_prefilled: Option<OnPrefilled<'_>>,
    ) -> Result<()> {
        if self.rows.iter().any(|r| r.id == id) {
            return Err(contract(format!("row {id} is already in the batch")));
        }
        let model = self.model;
        let (caches, draft, cached) =
            start.into_caches(model, drafter.is_some(), request.params)?;
        let mut keep_nothing = |_: &[LayerCache], _: Option<&DraftPrefix>| {};
        let mut on_chunk = |done: usize| match between_chunks.as_mut() {
            Some(between) => {
                self.prefilled = true;
                between(self, done)
            }
            None => Control::Continue,
        };
        let resume = Resume {
            caches,
            cached,
            on_prefilled: on_prefilled.unwrap_or(&mut keep_nothing),
            on_chunk: &mut on_chunk,
        };
        let decoder = match drafter {
            Some(drafter) => {
                let mut source = drafter.source(model, draft.map(|d| (d, cached)))?;
                let speculation = request.speculation(drafter);
                let speculator = Speculator::start(model, source.as_mut(), resume, speculation)?;
                Decoder::Speculative {
                    speculator: Box::new(speculator),
                    source,
                    drafter,
                }
            }
            None => {
                let Prefilled {
                    caches,
                    sampler,
                    last,
                } = prefill_request(
                    model,
                    resume,
                    request.prompt,
                    request.params,
                    request.constraint,
                )?;
                Decoder::Plain(Box::new(Plain {
                    caches,
                    sampler,
                    params: request.params.clone(),
                    next: last,
                    ahead: None,
                    recurrent_before: Vec::new(),
                    emitted: 0,
                }))
            }
        };
        self.rows.push(Row { id, decoder });
        self.prefilled = true;
        Ok(())
    }

    /// Whether rows over plain KV caches share one cache per layer (the default) or keep their
    /// own: the same bits either way, so this is for measuring what sharing buys. Takes
    /// effect from the next step.
    pub fn share_caches(&mut self, share: bool) {
        self.may_share = share;
    }

    /// Whether greedy speculative rows draft at every step (None, the default) or as `policy`
    /// chooses, only while drafting measures faster than plain steps: their tokens are the
    /// same either way. Takes effect from the next step.
    pub fn adapt_drafts(&mut self, policy: Option<DraftPolicy>) {
        if policy.is_none() {
            for row in &mut self.rows {
                if let Decoder::Speculative { speculator, .. } = &mut row.decoder {
                    speculator.cap_drafts(None);
                }
            }
        }
        self.draft_policy = policy;
    }

    /// Caps the drafts of the rows whose tokens do not depend on them as the draft policy
    /// chooses for the next step; returns that choice if such a row is in the batch.
    fn choose_drafts(&mut self) -> Option<Choice> {
        let choice = self.draft_policy.as_ref()?.next();
        let cap = (choice == Choice::Plain).then_some(0);
        let mut any = false;
        for row in &mut self.rows {
            if let Decoder::Speculative { speculator, .. } = &mut row.decoder {
                if speculator.emits_as_plain() {
                    speculator.cap_drafts(cap);
                    any = true;
                }
            }
        }
        any.then_some(choice)
    }

    /// The ids of the rows still decoding, in the order they joined.
    pub fn ids(&self) -> Vec<usize> {
        self.rows.iter().map(|r| r.id).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The time split of every step so far.
    pub fn split(&self) -> &StepSplit {
        &self.split
    }

    /// Takes row `id` out (its request was cancelled); false when there is no such row.
    pub fn remove(&mut self, id: usize) -> Result<bool> {
        let Some(at) = self.rows.iter().position(|r| r.id == id) else {
            return Ok(false);
        };
        self.leave_shared(at, false)?;
        self.rows.remove(at);
        if self.rows.is_empty() {
            self.ahead = None;
        }
        Ok(true)
    }

    /// One step of every row: one packed forward over each row's next input, then each row's
    /// tokens handed to `on_token(id, token)` in order (while the batch steps ahead, those of
    /// the step enqueued the call before, `batch::ahead`). Returns the rows that left: after their
    /// last token (EOS or max_tokens, the finish reason on it) or when their callback answered
    /// `Stop`.
    pub fn step(&mut self, on_token: OnToken<'_>) -> Result<Vec<Left>> {
        if self.runs_ahead() {
            return self.step_ahead(on_token);
        }
        if let Some(ahead) = self.ahead.take() {
            // A row joined that the batch cannot step ahead: this step reads the one enqueued.
            return self.read_ahead(ahead, None, on_token);
        }
        if self.rows.is_empty() {
            return Ok(Vec::new());
        }
        let started = Instant::now();
        let choice = self.choose_drafts();
        let prefilled = std::mem::take(&mut self.prefilled);
        let mut emitted = 0;
        let mut on_token = |id: usize, t: &GeneratedToken| {
            emitted += 1;
            on_token(id, t)
        };
        self.arrange_shared()?;
        let claimed = self.claim_ahead()?;
        let (drafted, unread) = self.draft_shared(claimed)?;
        let unread = Unread::new(unread)?;
        let inputs: Vec<Vec<u32>> = self
            .rows
            .iter_mut()
            .zip(&drafted)
            .map(|(row, drafts)| match (&mut row.decoder, drafts) {
                (Decoder::Plain(p), _) => Ok(vec![p.next]),
                (Decoder::Speculative { speculator, .. }, Some(Drafted::Read(drafts))) => {
                    Ok(speculator.open_round(drafts))
                }
                (Decoder::Speculative { speculator, .. }, Some(Drafted::Unread { .. })) => {
                    Ok(vec![speculator.open_round_unread()])
                }
                (
                    Decoder::Speculative {
                        speculator, source, ..
                    },
                    None,
                ) => speculator.next_input(source.as_mut()),
            })
            .collect::<Result<_>>()?;
        let drafted_at = Instant::now();
        let lens: Vec<usize> = (inputs.iter().zip(&drafted))
            .map(|(input, drafts)| match drafts {
                Some(Drafted::Unread { group, row }) => input.len() + unread.count(*group, *row),
                _ => input.len(),
            })
            .collect();
        let mut taps: Vec<usize> = self
            .rows
            .iter()
            .flat_map(|row| match &row.decoder {
                Decoder::Plain(_) => &[][..],
                Decoder::Speculative { speculator, .. } => &speculator.taps[..],
            })
            .copied()
            .collect();
        taps.sort_unstable();
        taps.dedup();
        self.begin_shared_rounds();
        let out = self.forward(&unread.ids(&inputs, &drafted)?, &lens, &taps)?;
        let greedy = GreedyRows::sample(&self.rows, &lens, &out.logits)?;
        let mut sampled = Vec::new();
        let mut pending = Vec::new();
        let mut rounds = Vec::new();
        let mut start = 0;
        for (row, &len) in self.rows.iter_mut().zip(&lens) {
            let end = start + len as i32;
            let logits = out.logits.slice_axis(1, start, end)?;
            match &mut row.decoder {
                Decoder::Plain(p) => {
                    quantize_due(&mut p.caches, p.params.kv_quantization.as_ref())?;
                    if greedy.as_ref().and_then(|g| g.index(start)).is_none() {
                        sampled.push(p.sample(&token_array(&[p.next])?, &logits)?);
                    }
                }
                Decoder::Speculative { speculator, .. } => {
                    let hidden = speculator
                        .taps
                        .iter()
                        .map(|t| {
                            let at = taps.binary_search(t).expect("the union holds every tap");
                            out.hidden[at].slice_axis(1, start, end)
                        })
                        .collect::<mlx::Result<Vec<_>>>()?;
                    let together = greedy.as_ref().and_then(|g| g.index(start));
                    if together.is_none() {
                        pending.extend(speculator.enqueue_verdict(&logits)?);
                    }
                    rounds.push((logits, hidden, together));
                }
            }
            start = end;
        }
        if let Some(g) = &greedy {
            pending.push(g.tokens.clone());
            pending.extend(g.logprobs.iter().cloned());
        }
        // Every row's tokens at once: the host waits for the device once per step.
        let built_at = Instant::now();
        let enqueued: Vec<&Array> = (sampled.iter().flat_map(|(y, lp)| [y, lp]))
            .chain(&pending)
            .chain(unread.tokens())
            .collect();
        self.feed_ahead(greedy.as_ref(), &lens, &drafted, &unread, &enqueued)?;
        let fed_at = Instant::now();
        mlx::eval(enqueued)?;
        let evaluated_at = Instant::now();
        let read = unread.read()?;
        for (row, drafts) in self.rows.iter_mut().zip(&drafted) {
            let (
                Decoder::Speculative {
                    speculator, source, ..
                },
                Some(Drafted::Unread { group, row }),
            ) = (&mut row.decoder, drafts)
            else {
                continue;
            };
            let drafts = &read[*group][*row];
            speculator.read_drafts(drafts);
            source
                .stepped()
                .expect("a row drafting together steps its draft model")
                .close_round(drafts);
        }
        let greedy_tokens = greedy
            .as_ref()
            .map(|g| g.tokens.to_vec::<u32>())
            .transpose()?;
        let mut leaving = Vec::new();
        let mut rounds = rounds.into_iter();
        for ((at, row), &len) in self.rows.iter_mut().enumerate().zip(&lens) {
            let Decoder::Speculative {
                speculator, source, ..
            } = &mut row.decoder
            else {
                continue;
            };
            let (logits, hidden, together) = rounds.next().expect("one round per speculative row");
            if let (Some(i), Some(g), Some(tokens)) = (together, &greedy, &greedy_tokens) {
                let logprobs = g.logprobs[i..i + len].to_vec();
                speculator.read_verdict(tokens[i..i + len].to_vec(), logprobs);
            }
            let mut stopped = false;
            let rejected = speculator.settle(source.as_mut(), &logits, &hidden, &mut |t| {
                let control = on_token(row.id, t);
                stopped |= control == Control::Stop;
                control
            })?;
            if let Some(shared) = &mut self.shared {
                shared::end_round(shared, at, rejected)?;
            }
            let taken_back = source.stepped().map_or(0, |s| s.taken_back());
            let member = (self.draft_groups.iter_mut()).find_map(|g| Some((g.row_of(row.id)?, g)));
            if let Some((r, group)) = member {
                shared::trim(&mut group.caches, r, taken_back)?;
            }
            if stopped || speculator.is_done() {
                leaving.push(row.id);
            }
        }
        if let Some(tokens) = &greedy_tokens {
            self.settle_ahead(tokens, &leaving)?;
        }
        let mut sampled = sampled.into_iter();
        let mut start = 0;
        for (row, &len) in self.rows.iter_mut().zip(&lens) {
            let row_start = start;
            start += len;
            let Decoder::Plain(p) = &mut row.decoder else {
                continue;
            };
            let together = greedy.as_ref().and_then(|g| g.index(row_start as i32));
            let (token, logprobs) = match (together, &greedy, &greedy_tokens) {
                (Some(i), Some(g), Some(tokens)) => (tokens[i], g.logprobs[i].clone()),
                _ => {
                    let (y, logprobs) = sampled.next().expect("one sample per plain row");
                    (y.item::<u32>()?, logprobs)
                }
            };
            if p.emit(row.id, token, logprobs, &mut on_token)? {
                leaving.push(row.id);
            }
        }
        let split = &mut self.split;
        split.steps += 1;
        split.rows += lens.len();
        split.draft += (drafted_at - started) + (fed_at - built_at);
        split.build += built_at - drafted_at;
        split.eval += evaluated_at - fed_at;
        split.settle += evaluated_at.elapsed();
        split.shared += usize::from(self.shared.is_some());
        split.shared_drafts += usize::from(!self.draft_groups.is_empty());
        split.undrafted += usize::from(choice == Some(Choice::Plain));
        split.drafted_ahead += usize::from(!self.drafts_ahead.is_empty());
        if let (Some(policy), Some(_), false) = (&mut self.draft_policy, choice, prefilled) {
            policy.record(lens.len(), emitted, started.elapsed());
        }
        self.depart(&leaving, false)
    }

    /// One packed forward over `ids` (T,), row r feeding the next `lens[r]` of them, over the
    /// shared caches or each row's own; `taps` lists the hidden states wanted back.
    fn forward(&mut self, ids: &Array, lens: &[usize], taps: &[usize]) -> Result<Forward> {
        let model = self.model;
        let mut caches: Vec<&mut [LayerCache]> = match &mut self.shared {
            Some(shared) => {
                plan_step(shared, lens)?;
                vec![&mut shared[..]]
            }
            None => self
                .rows
                .iter_mut()
                .map(|row| &mut row.decoder.caches_mut()[..])
                .collect(),
        };
        let ids = ids.expand_dims(&[0])?;
        lone_rows::decode_rows(|| model.forward_rows(&ids, &mut caches, lens, taps))
    }

    /// The rows in `leaving` leave the batch, a plain row with its caches; `fed`: each of them
    /// fed its last token to a step enqueued ahead, which its caches give back first, so that
    /// they hold what they would had the batch waited (a row whose caches cannot leaves
    /// without them).
    fn depart(&mut self, leaving: &[usize], fed: bool) -> Result<Vec<Left>> {
        let mut not_given_back = Vec::new();
        for at in (0..self.rows.len()).rev() {
            if !leaving.contains(&self.rows[at].id) {
                continue;
            }
            if fed && !self.give_back(at)? {
                not_given_back.push(self.rows[at].id);
            }
            let plain = matches!(self.rows[at].decoder, Decoder::Plain(_));
            self.leave_shared(at, plain)?;
        }
        let (gone, staying) = std::mem::take(&mut self.rows)
            .into_iter()
            .partition(|row| leaving.contains(&row.id));
        self.rows = staying;
        if self.rows.is_empty() {
            self.ahead = None;
        }
        Ok(gone
            .into_iter()
            .map(|row| match row.decoder {
                Decoder::Plain(p) => Left {
                    id: row.id,
                    speculation: None,
                    caches: (!not_given_back.contains(&row.id)).then_some(p.caches),
                },
                Decoder::Speculative { speculator, .. } => Left {
                    id: row.id,
                    speculation: Some(speculator.stats().clone()),
                    caches: None,
                },
            })
            .collect())
    }
}
