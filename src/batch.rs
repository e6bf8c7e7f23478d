//! Plain requests decoded together. Each step runs one packed forward over every row's next
//! token ([`crate::model::rows`]); each row then samples from its own logits with its own
//! processors, grammar, random keys and stop conditions. Rows join between steps (prefilled
//! alone, their first token coming with the next step) and leave when they finish or are
//! removed.
//!
//! A row emits what its request emits alone through [`crate::decode::decode`], token for token
//! and logprob bit for bit, wherever the packed forward gives each row its lone bits (on the
//! CPU: tests/batch.rs). What differs is only when work happens: a lone request enqueues its
//! next step before its current token is read (generate_step's pipelining); a batch reads every
//! row's token at the end of each step, since its rows' next inputs are those tokens.

use mlx::{Array, Dtype};

use crate::cache::{quantize_due, LayerCache};
use crate::decode::{Request, Start};
use crate::generate::{
    logprobs_after, prefill_request, token_array, Control, GenerateParams, GeneratedToken,
    OnPrefilled, Prefilled, Resume,
};
use crate::model::LanguageModel;
use crate::sample::StepSampler;
use crate::{error::contract, Result};

/// One request in the batch.
struct Row {
    id: usize,
    caches: Vec<LayerCache>,
    sampler: StepSampler,
    params: GenerateParams,
    /// The token this row feeds next: its prompt's last, then each emitted one.
    next: u32,
    emitted: usize,
}

/// The rows decoding together on one model.
pub struct Batch<'m> {
    model: &'m dyn LanguageModel,
    rows: Vec<Row>,
}

impl<'m> Batch<'m> {
    pub fn new(model: &'m dyn LanguageModel) -> Batch<'m> {
        Batch {
            model,
            rows: Vec::new(),
        }
    }

    /// Validates `request`, prefills its prompt but the last token alone, and adds it as row
    /// `id` (unique among the rows); its first token comes with the next [`Batch::step`].
    /// `on_chunk` sees the prompt tokens prefilled after each chunk (`Stop` cancels with
    /// [`crate::Error::Cancelled`]); `on_prefilled` the caches once prefilled.
    pub fn add(
        &mut self,
        id: usize,
        start: Start,
        request: Request<'_>,
        on_chunk: Option<&mut dyn FnMut(usize) -> Control>,
        on_prefilled: Option<OnPrefilled<'_>>,
    ) -> Result<()> {
        if self.rows.iter().any(|r| r.id == id) {
            return Err(contract(format!("row {id} is already in the batch")));
        }
        let (caches, _, cached) = start.into_caches(self.model, false, request.params)?;
        let (mut go_on, mut keep_nothing) = (
            |_: usize| Control::Continue,
            |_: &[LayerCache], _: Option<&[LayerCache]>| {},
        );
        let resume = Resume {
            caches,
            cached,
            on_prefilled: on_prefilled.unwrap_or(&mut keep_nothing),
            on_chunk: on_chunk.unwrap_or(&mut go_on),
        };
        let Prefilled {
            caches,
            sampler,
            last,
        } = prefill_request(
            self.model,
            resume,
            request.prompt,
            request.params,
            request.constraint,
        )?;
        self.rows.push(Row {
            id,
            caches,
            sampler,
            params: request.params.clone(),
            next: last,
            emitted: 0,
        });
        Ok(())
    }

    /// The ids of the rows still decoding, in the order they joined.
    pub fn ids(&self) -> Vec<usize> {
        self.rows.iter().map(|r| r.id).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Takes row `id` out (its request was cancelled); false when there is no such row.
    pub fn remove(&mut self, id: usize) -> bool {
        let before = self.rows.len();
        self.rows.retain(|r| r.id != id);
        self.rows.len() < before
    }

    /// One decode step of every row: one packed forward, each row's next token sampled and
    /// handed to `on_token(id, token)`. A row leaves the batch after its last token (EOS or
    /// max_tokens, the finish reason on it) or when its callback answers `Stop`.
    pub fn step(
        &mut self,
        on_token: &mut dyn FnMut(usize, &GeneratedToken) -> Control,
    ) -> Result<()> {
        if self.rows.is_empty() {
            return Ok(());
        }
        let inputs: Vec<Array> = self
            .rows
            .iter()
            .map(|r| token_array(&[r.next]))
            .collect::<mlx::Result<_>>()?;
        let ids = token_array(&self.rows.iter().map(|r| r.next).collect::<Vec<_>>())?;
        let lens = vec![1; self.rows.len()];
        let out = {
            let mut caches: Vec<&mut [LayerCache]> =
                self.rows.iter_mut().map(|r| &mut r.caches[..]).collect();
            self.model
                .forward_rows(&ids.expand_dims(&[0])?, &mut caches, &lens, &[])?
        };
        let mut sampled = Vec::with_capacity(self.rows.len());
        for (i, (row, input)) in self.rows.iter_mut().zip(&inputs).enumerate() {
            quantize_due(&mut row.caches, row.params.kv_quantization.as_ref())?;
            let logits = out
                .logits
                .slice_axis(1, i as i32, i as i32 + 1)?
                .squeeze(&[1])?;
            let logprobs = logprobs_after(&mut row.sampler, input, &logits)?;
            let y = row.sampler.sample(&logprobs)?;
            sampled.push((y, logprobs.squeeze(&[0])?));
        }
        mlx::eval(sampled.iter().flat_map(|(y, lp)| [y, lp]))?;
        let mut leaving = Vec::new();
        for (row, (y, logprobs)) in self.rows.iter_mut().zip(sampled) {
            let token = y.astype(Dtype::Uint32)?.item::<u32>()?;
            if row.sampler.is_constrained() {
                row.sampler.advance_grammar(token)?;
            }
            row.emitted += 1;
            let finish = row.params.finish_for(token, row.emitted);
            let step = GeneratedToken {
                token,
                logprobs,
                from_draft: false,
                finish,
            };
            if on_token(row.id, &step) == Control::Stop || finish.is_some() {
                leaving.push(row.id);
            }
            row.next = token;
        }
        self.rows.retain(|r| !leaving.contains(&r.id));
        Ok(())
    }
}
