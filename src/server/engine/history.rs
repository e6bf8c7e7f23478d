//! What the prefix cache keeps of a conversation beyond its prompts: the history a finished
//! request's next turn will carry (its own caches where they are what a prefill makes, a
//! prefill onto its prompt's entry otherwise), the end of a chat's system messages, and the
//! chunk splits that make a prefill resumed from any of them equal one from the start.

use std::panic::{self, AssertUnwindSafe};
use std::time::{Duration, Instant};

use serde_json::json;
use tracing::warn;

use super::prompt::template_variables;
use super::{Engine, Lane};
use crate::cache::LayerCache;
use crate::decode::{decode, Hooks, Request};
use crate::generate::{chunk_ends, Control, GenerateParams, GeneratedToken};
use crate::server::api::{GenRequest, Prompt};
use crate::server::prefix_cache::Hit;
use crate::server::tools::CallFormatter;
use crate::speculative::DraftPrefix;

impl Engine {
    /// A finished lane's prompt and generated tokens, and the tokens the next turn of its
    /// conversation starts with: the chat rendered (with the request's template variables)
    /// with the answer as the client carries it back as the assistant's message (its content
    /// and tool calls; reasoning is not sent back), but the template's last token (the next
    /// prompt goes on after the end of the turn), when that goes on from the prompt. Otherwise
    /// (a raw prompt, or a history the template renders otherwise) the prompt and the
    /// generated tokens.
    pub(super) fn answered(&self, lane: &Lane) -> Answered {
        let generated = lane.tokens.clone();
        let prompt = &generated[..lane.prompt_tokens];
        let rendered = match &lane.request.prompt {
            Prompt::Messages(messages) => {
                let mut channels = self.channels(&lane.request, prompt);
                let mut said = channels.push(&lane.text);
                said.extend(channels.finish(true));
                let mut answer = json!({"role": "assistant", "content": said.content});
                let calls = CallFormatter::new(false).format(&said.calls);
                if !calls.is_empty() {
                    answer["tool_calls"] = json!(calls);
                }
                let chat = [messages.as_slice(), &[answer]].concat();
                let tokenizer = &self.target.tokenizer;
                tokenizer
                    .apply_chat_template(&chat, false, &template_variables(&lane.request))
                    .ok()
                    .and_then(|text| tokenizer.encode(&text, false).ok())
            }
            Prompt::Text(_) | Prompt::Tokens(_) => None,
        };
        let next = match rendered {
            Some(mut r) if r.len() > prompt.len() + 1 && r.starts_with(prompt) => {
                r.pop();
                r
            }
            _ => generated.clone(),
        };
        let mut splits = self.prefill_splits(&lane.request, prompt);
        splits.push(prompt.len() - 1);
        Answered {
            prompt_tokens: prompt.len(),
            generated,
            next,
            splits,
        }
    }

    /// Stores caches holding a finished request's `next` tokens but the last
    /// ([`Engine::answered`]) in the prefix cache, so that the next turn of a conversation
    /// prefills only what it adds. A plain row's own KV and recurrent caches are kept first,
    /// under what they hold, when `next` goes on from it (they hold the same bits whether a
    /// token was decoded or prefilled, on the CPU). Then the rest of `next` is prefilled onto
    /// the entry that holds the most of it, after the client has its response: the few tokens
    /// the template adds after a kept row (its end of turn), or the whole answer onto the
    /// prompt's entry where the row's own caches are not what a prefill makes (a rotating
    /// cache holds a decoded window in another order, a quantized one was quantized at other
    /// points, a verify forward's rows are not a prefill's, a lone request's caches were
    /// consumed by its decode) or the answer the client carries back is other tokens than
    /// those generated. Returns the time it took.
    pub(super) fn keep_answer(
        &self,
        answered: &Answered,
        caches: Option<Vec<LayerCache>>,
    ) -> Duration {
        let started = Instant::now();
        let held = &answered.generated[..answered.generated.len() - 1];
        let own = caches.filter(|caches| {
            !self.target.model().one_token_path()
                && answered.next.starts_with(held)
                && caches.iter().all(|c| {
                    matches!(c, LayerCache::Kv(_) | LayerCache::Recurrent(_))
                        && c.offset() == held.len()
                })
        });
        if let Some(caches) = own {
            let mut prefix = self.prefix.borrow_mut();
            prefix.insert(&self.namespace, held, &caches, None);
            self.metrics.prefix_held(prefix.len(), prefix.bytes());
        }
        self.prefill_answer(&answered.next, answered.prompt_tokens, &answered.splits);
        let spent = started.elapsed();
        self.metrics.outside_steps("keep", spent);
        spent
    }

    /// Where a chat's system messages end in `prompt` (the tokens it shares with the system
    /// messages rendered before an empty user message, as mlx_lm.server's `_tokenize` splits
    /// its prompt), when the model's caches cannot be cut back: there the prefix cache keeps a
    /// checkpoint, so that conversations that share a system prompt share its prefill. KV
    /// caches need none, a longer entry is cut back to what prompts share.
    pub(super) fn system_end(&self, request: &GenRequest, prompt: &[u32]) -> Option<usize> {
        let Prompt::Messages(messages) = &request.prompt else {
            return None;
        };
        let systems = messages
            .iter()
            .take_while(|m| m["role"] == "system")
            .count();
        if self.trims || systems == 0 || messages.last()?["role"] != "user" {
            return None;
        }
        let opening = [
            &messages[..systems],
            &[json!({"role": "user", "content": ""})],
        ]
        .concat();
        let tokenizer = &self.target.tokenizer;
        let text = tokenizer
            .apply_chat_template(&opening, false, &template_variables(request))
            .ok()?;
        let opening = tokenizer.encode(&text, false).ok()?;
        let end = opening
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        (end > 0 && end + 1 < prompt.len()).then_some(end)
    }

    /// Prefills `tokens` but the last onto the prefix cache's entry that holds the most of
    /// them, at least the first `prompt_tokens` but one (the prompt's), and keeps the result.
    /// Nothing happens when no entry holds the prompt any more: the next turn would prefill
    /// all of it anyway.
    pub(super) fn prefill_answer(&self, tokens: &[u32], prompt_tokens: usize, splits: &[usize]) {
        let hit = self.lookup(tokens, splits);
        if let Some(hit) = hit.filter(|h| h.cached + 1 >= prompt_tokens) {
            self.keep_prefill(tokens, Some(hit), splits);
        }
    }

    /// Prefills `tokens` but the last from `hit` (fresh caches without one), its chunks cut at
    /// `splits` as a request's are ([`Engine::prefill_splits`]), and keeps the result in the
    /// prefix cache, through the decode a request takes (a drafter's caches are prefilled with
    /// the target's); the one token that decode then emits is dropped.
    pub(super) fn keep_prefill(&self, tokens: &[u32], hit: Option<Hit>, splits: &[usize]) {
        if hit.as_ref().is_some_and(|h| h.cached + 1 == tokens.len()) {
            return;
        }
        let start = Hit::start(hit);
        let params = GenerateParams {
            prefill_step_size: self.config.prefill_step_size,
            prefill_splits: splits.to_vec(),
            max_kv_size: self.config.max_kv_size,
            kv_quantization: self.config.kv_quantization,
            ..GenerateParams::greedy(1, self.target.eos_token_ids.clone())
        };
        let mut keep = |target: &[LayerCache], draft: Option<&DraftPrefix>| {
            self.keep_prefix(tokens, target, draft)
        };
        let mut stop = |_: &GeneratedToken| Control::Stop;
        let hooks = Hooks {
            on_token: &mut stop,
            on_chunk: None,
            on_prefilled: Some(&mut keep),
        };
        let request = Request {
            prompt: tokens,
            params: &params,
            constraint: None,
            num_draft_tokens: None,
        };
        let prefilled = panic::catch_unwind(AssertUnwindSafe(|| {
            decode(
                self.target.model(),
                self.drafter.as_ref(),
                start,
                request,
                hooks,
            )
        }));
        if !matches!(prefilled, Ok(Ok(_))) {
            warn!("a prefill for the prefix cache failed; the next request prefills it");
        }
    }

    /// The prefix cache's entry for `tokens` ([`crate::server::prefix_cache::PrefixCache::lookup`]), whose prefill cuts its
    /// chunks at `splits`.
    pub(super) fn lookup(&self, tokens: &[u32], splits: &[usize]) -> Option<Hit> {
        let resume = self.resume(tokens.len(), splits);
        self.prefix
            .borrow_mut()
            .lookup(&self.namespace, tokens, resume)
    }

    /// Where a prefill of a prompt of `len` tokens, its chunks cut at `splits`, may go on from,
    /// at most `n`: `n` itself, or where a prefill from the start ends a chunk at or before `n`
    /// when the model computes a token otherwise alone than among others
    /// ([`crate::model::LanguageModel::one_token_path`]): a resumed prefill then feeds the very
    /// chunks a cold one feeds.
    fn resume(&self, len: usize, splits: &[usize]) -> impl Fn(usize) -> usize {
        let ends = if self.target.model().one_token_path() {
            let step = self.config.prefill_step_size;
            Some(chunk_ends(len.saturating_sub(1), step, splits))
        } else {
            None
        };
        move |n| match &ends {
            Some(ends) => ends[..ends.partition_point(|&e| e <= n)]
                .last()
                .copied()
                .unwrap_or(0),
            None => n,
        }
    }

    /// Stores the caches of `prompt` but its last token in the prefix cache.
    pub(super) fn keep_prefix(
        &self,
        prompt: &[u32],
        target: &[LayerCache],
        draft: Option<&DraftPrefix>,
    ) {
        let head = &prompt[..prompt.len() - 1];
        let mut prefix = self.prefix.borrow_mut();
        prefix.insert(&self.namespace, head, target, draft);
        self.metrics.prefix_held(prefix.len(), prefix.bytes());
    }

    /// Where a chat's prefill cuts its chunks, where the caches cannot be cut back (none
    /// otherwise): wherever the prefix cache may hold an entry of this conversation (the end of
    /// its system messages, and for each earlier turn the end of its prompt but the last token
    /// and the end of its history entry, [`Engine::answered`]), so that a prefill resumed from
    /// any of them and one from the start feed the same chunks. Earlier turns' renderings are
    /// prefixes of this prompt, so their splits are this prompt's below them.
    pub(super) fn prefill_splits(&self, request: &GenRequest, prompt: &[u32]) -> Vec<usize> {
        let Prompt::Messages(messages) = &request.prompt else {
            return Vec::new();
        };
        if self.trims {
            return Vec::new();
        }
        let (tokenizer, extra) = (&self.target.tokenizer, template_variables(request));
        let tokens = |chat: &[serde_json::Value], generation: bool| {
            let text = tokenizer
                .apply_chat_template(chat, generation, &extra)
                .ok()?;
            tokenizer.encode(&text, false).ok().map(|t| t.len())
        };
        let mut splits: Vec<usize> = self.system_end(request, prompt).into_iter().collect();
        for (i, _) in messages
            .iter()
            .enumerate()
            .filter(|(_, m)| m["role"] == "assistant")
        {
            splits.extend(tokens(&messages[..i], true).map(|n| n.saturating_sub(1)));
            splits.extend(tokens(&messages[..=i], false).map(|n| n.saturating_sub(2)));
        }
        splits.retain(|&s| s > 0 && s < prompt.len());
        splits.sort_unstable();
        splits.dedup();
        splits
    }
}

/// A finished request, as the prefix cache keeps it ([`Engine::answered`]).
pub(super) struct Answered {
    prompt_tokens: usize,
    /// The prompt and every generated token.
    generated: Vec<u32>,
    /// What the next turn of its conversation starts with.
    next: Vec<u32>,
    /// Where prefilling `next` cuts its chunks: the request's splits and the end of its
    /// prompt's entry, which it resumes from.
    splits: Vec<usize>,
}
