//! The validation layer. MLX checks no bounds: a token id past the vocabulary in `take` or a
//! scatter reads or writes outside a buffer, a group size of 0 divides by zero, a NaN bias
//! poisons every logit. So every value that comes from outside (CLI flags, a trace's or a
//! suite's params, a prompt cache, later an HTTP request) passes through these checks, against
//! the model it will run on, before any of it reaches MLX. Each refusal names the input, the
//! value and what is allowed; the CLI turns it into exit 2, the server into HTTP 400.

mod prompt_cache;

pub use prompt_cache::prompt_cache;

use crate::error::invalid;
use crate::model::LanguageModel;
use crate::request::GenerateParams;
use crate::sample::{KeySchedule, ProcessorParams, SamplerParams};
use crate::Result;

/// The most drafts a round may propose (a block drafter's block is at most this long).
pub const MAX_DRAFT_TOKENS: usize = 256;

/// The tokens a rotating KV cache keeps at its start (mlx-lm's `keep=4`); a window must hold
/// more than these.
pub const ROTATING_KEEP: usize = 4;

/// KV cache quantization as mlx's `quantize` supports it.
pub const KV_BITS: &[i32] = &[2, 3, 4, 5, 6, 8];
pub const KV_GROUP_SIZES: &[i32] = &[32, 64, 128];

/// Checks a whole request against the model it runs on: the prompt, the sampler, the logits
/// processors, the cache settings and the stop tokens.
pub fn request(model: &dyn LanguageModel, prompt: &[u32], p: &GenerateParams) -> Result<()> {
    let vocab = model.vocab_size();
    if prompt.is_empty() {
        return Err(invalid("the prompt", "empty", "give at least one token"));
    }
    token_ids("prompt", prompt, vocab)?;
    token_ids("eos_token_ids", &p.eos_token_ids, vocab)?;
    at_least("max_tokens", p.max_tokens, 1)?;
    at_least("prefill_step_size", p.prefill_step_size, 1)?;
    sampler(&p.sampler, vocab)?;
    if p.keys == KeySchedule::Positioned {
        positioned(&p.sampler)?;
    }
    processors(&p.processors, vocab)?;
    if p.sampler.temp > 0.0 && p.seed.is_none() {
        return Err(invalid(
            "seed",
            "missing",
            &format!(
                "sampling at temperature {} needs one (unseeded sampling cannot be replayed)",
                p.sampler.temp
            ),
        ));
    }
    if let Some(size) = p.max_kv_size {
        if size <= ROTATING_KEEP {
            return Err(invalid(
                "max_kv_size",
                size,
                &format!("must be greater than {ROTATING_KEEP}, the tokens a rotating cache keeps"),
            ));
        }
    }
    if let Some(q) = &p.kv_quantization {
        kv_quantization(model, q.bits, q.group_size)?;
    }
    Ok(())
}

/// Every id of `ids` (named `input`) is a row of the embedding and a column of the logits.
pub fn token_ids(input: &str, ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(i) => Err(invalid(
            &format!("{input} token {i}"),
            ids[i],
            &format!("must be below the vocabulary size {vocab}"),
        )),
        None => Ok(()),
    }
}

/// KV quantization bits and group size mlx supports, with the group dividing the model's
/// attention head dimension (mx.quantize quantizes along it).
pub fn kv_quantization(model: &dyn LanguageModel, bits: i32, group_size: i32) -> Result<()> {
    if !model.quantizes_kv() {
        return Err(invalid(
            "kv_bits",
            bits,
            "this model's attention (glm4_moe_lite's latent KV) runs over plain KV caches only",
        ));
    }
    if !KV_BITS.contains(&bits) {
        return Err(invalid(
            "kv_bits",
            bits,
            &format!("must be one of {KV_BITS:?}"),
        ));
    }
    if !KV_GROUP_SIZES.contains(&group_size) {
        return Err(invalid(
            "kv_group_size",
            group_size,
            &format!("must be one of {KV_GROUP_SIZES:?}"),
        ));
    }
    let head_dim = model.attention_head_dim();
    if !head_dim.is_multiple_of(group_size as usize) {
        return Err(invalid(
            "kv_group_size",
            group_size,
            &format!("must divide the model's attention head dimension {head_dim}"),
        ));
    }
    Ok(())
}

/// Speculative decoding settings: drafts per round, and the draft model against the target
/// (the draft is fed the target's tokens and its logits are sampled with the target's
/// processors, so both must index the same vocabulary).
pub fn speculation(
    target: &dyn LanguageModel,
    draft: Option<&dyn LanguageModel>,
    num_draft_tokens: usize,
    p: &GenerateParams,
) -> Result<()> {
    within("num_draft_tokens", num_draft_tokens, 1, MAX_DRAFT_TOKENS)?;
    if let Some(draft) = draft {
        draft_vocabulary(target, draft)?;
        if let Some(q) = &p.kv_quantization {
            kv_quantization(draft, q.bits, q.group_size)
                .map_err(|e| e.context("the draft model"))?;
        }
    }
    Ok(())
}

/// A draft model indexes the target's vocabulary.
pub fn draft_vocabulary(target: &dyn LanguageModel, draft: &dyn LanguageModel) -> Result<()> {
    let (t, d) = (target.vocab_size(), draft.vocab_size());
    if t == d {
        Ok(())
    } else {
        Err(invalid(
            "the draft model's vocabulary size",
            d,
            &format!("must equal the target's, {t}"),
        ))
    }
}

/// An MTP drafter pairs with the target that carries it: the target has an MTP head
/// (`mtp.*` weights, Qwen3.5 only), whose states are as wide as the target's hidden states and
/// whose logits come from the target's own output head (so the vocabularies are one).
pub fn mtp(target: &dyn LanguageModel) -> Result<&dyn crate::model::mtp::MtpHead> {
    let head = target.mtp_head().ok_or_else(|| {
        invalid(
            "the MTP drafter's target",
            "a model without mtp.* weights",
            "must be a Qwen3.5 checkpoint that carries its MTP head (mtp_num_hidden_layers >= 1)",
        )
    })?;
    let width = target.outer().embed_tokens.width();
    if head.hidden_size() != width {
        return Err(invalid(
            "the MTP head's hidden size",
            head.hidden_size(),
            &format!("must equal the target's, {width}"),
        ));
    }
    Ok(head)
}

/// A split MTP head's folder pairs with a target as wide as the head (the check mlx-vlm makes,
/// speculative/drafters/__init__.py:94-112) and with the vocabulary the head was trained on:
/// the head's states go through the target's own output head, so a head cut from a model with
/// another vocabulary would draft ids that mean other text.
pub fn mtp_folder(
    dir: &std::path::Path,
    target: &dyn LanguageModel,
    pairing: &crate::model::mtp::Pairing,
) -> Result<()> {
    let folder = |field: &str| format!("the MTP drafter {}'s {field}", dir.display());
    let width = target.outer().embed_tokens.width();
    if pairing.hidden_size != width {
        return Err(invalid(
            &folder("text_config.hidden_size"),
            pairing.hidden_size,
            &format!("must equal the target's hidden size, {width}"),
        ));
    }
    let vocab = target.vocab_size();
    if pairing.vocab_size != vocab {
        return Err(invalid(
            &folder("text_config.vocab_size"),
            pairing.vocab_size,
            &format!("must equal the target's, {vocab}"),
        ));
    }
    Ok(())
}

/// A Gemma 4 assistant drafter pairs with a Gemma 4 target (its layers come in kinds that
/// share keys and values) as wide as the drafter's `backbone_hidden_size`, with its vocabulary
/// (the drafter's own head drafts ids the target verifies), and that has a layer of every kind
/// the drafter's layers attend over, with the same head dimension and a number of key-value
/// heads that divides the drafter's query heads. Returns, per drafter layer, the target cache
/// it reads, and the target's embedding scale.
pub fn gemma4_assistant(
    target: &dyn LanguageModel,
    drafter: &crate::model::gemma4_assistant::Gemma4Assistant,
) -> Result<(Vec<usize>, f32)> {
    let sharing = target.kv_sharing().ok_or_else(|| {
        invalid(
            "the Gemma 4 assistant drafter's target",
            "a model whose layers share no keys and values",
            "must be a Gemma 4 model (gemma4 or gemma4_text)",
        )
    })?;
    let width = target.outer().embed_tokens.width();
    if drafter.backbone_hidden_size != width {
        return Err(invalid(
            "the assistant drafter's backbone_hidden_size",
            drafter.backbone_hidden_size,
            &format!("must equal the target's hidden size, {width}"),
        ));
    }
    let vocab = target.vocab_size();
    if drafter.vocab_size != vocab {
        return Err(invalid(
            "the assistant drafter's text_config.vocab_size",
            drafter.vocab_size,
            &format!("must equal the target's, {vocab}"),
        ));
    }
    let mut caches = Vec::new();
    for (i, (kind, head_dim, heads)) in drafter.layer_shapes().enumerate() {
        let shared = sharing
            .kinds
            .iter()
            .find(|s| s.kind == kind)
            .ok_or_else(|| {
                invalid(
                    &format!("the assistant drafter's layer {i}"),
                    format!("a {kind} layer"),
                    "must be of a kind the target has",
                )
            })?;
        if head_dim != shared.head_dim || heads % shared.kv_heads != 0 {
            return Err(invalid(
                &format!("the assistant drafter's layer {i} ({kind})"),
                format!("{heads} heads of dimension {head_dim}"),
                &format!(
                    "must have the target's {kind} head dimension, {}, and a multiple of its {} \
                     key-value heads",
                    shared.head_dim, shared.kv_heads
                ),
            ));
        }
        caches.push(shared.cache);
    }
    Ok((caches, sharing.embed_scale))
}

/// A DFlash drafter pairs with a target whose hidden states are as wide as the drafter's,
/// that has every layer the drafter taps, and whose vocabulary (the drafter borrows the
/// target's embedding and output head) holds the drafter's vocabulary and mask token.
pub fn dflash(
    target: &dyn LanguageModel,
    drafter: &crate::model::dflash::DflashModel,
) -> Result<()> {
    let width = target.outer().embed_tokens.width();
    if drafter.hidden_size != width {
        return Err(invalid(
            "the DFlash drafter's hidden_size",
            drafter.hidden_size,
            &format!("must equal the target's hidden size, {width}"),
        ));
    }
    let vocab = target.vocab_size();
    if drafter.vocab_size != vocab {
        return Err(invalid(
            "the DFlash drafter's vocab_size",
            drafter.vocab_size,
            &format!("must equal the target's, {vocab}"),
        ));
    }
    if drafter.mask_token_id as usize >= vocab {
        return Err(invalid(
            "the DFlash drafter's mask_token_id",
            drafter.mask_token_id,
            &format!("must be a token id below the target's vocabulary size, {vocab}"),
        ));
    }
    let layers = target.num_layers();
    if let Some(&last) = drafter.target_layer_ids.last().filter(|&&l| l >= layers) {
        return Err(invalid(
            "the DFlash drafter's target_layer_ids",
            format!("{:?} (layer {last})", drafter.target_layer_ids),
            &format!("must name layers of the target, which has {layers}"),
        ));
    }
    Ok(())
}

/// An mlx-vlm block size (a trace's `draft.block_size`, MTP or DFlash): the round's last token
/// and its drafts, so at least 2 and at most one more than the draft limit.
pub fn draft_block_size(block_size: usize) -> Result<()> {
    within("draft.block_size", block_size, 2, MAX_DRAFT_TOKENS + 1)
}

/// n-gram prompt lookup: the shortest and longest match lengths.
pub fn ngram(min_n: usize, max_n: usize) -> Result<()> {
    within("ngram_min", min_n, 1, 64)?;
    within("ngram_max", max_n, min_n, 64)
}

/// mlx-lm's `make_sampler` arguments, with the ranges its filters assume (checked whatever the
/// temperature, so a request never carries a value that would be wrong once sampling starts).
fn sampler(p: &SamplerParams, vocab: usize) -> Result<()> {
    if !(p.temp.is_finite() && p.temp >= 0.0) {
        return Err(invalid(
            "temperature",
            p.temp,
            "must be a finite number >= 0",
        ));
    }
    // mlx-lm scales the logits by 1/temp as a float32: a smaller temperature overflows it to
    // infinity, and the draw is then that of no temperature at all.
    let smallest = 1.0 / f64::from(f32::MAX);
    if p.temp > 0.0 && p.temp < smallest {
        return Err(invalid(
            "temperature",
            format!("{:e}", p.temp),
            &format!("must be 0 or at least {smallest:e} (1/temperature must fit in a float32)"),
        ));
    }
    unit_interval("top_p", p.top_p)?;
    unit_interval("min_p", p.min_p)?;
    unit_interval("xtc_probability", p.xtc_probability)?;
    if !(0.0..=0.5).contains(&p.xtc_threshold) {
        return Err(invalid(
            "xtc_threshold",
            p.xtc_threshold,
            "must be within [0, 0.5]",
        ));
    }
    within("top_k", p.top_k, 0, vocab)?;
    within("min_tokens_to_keep", p.min_tokens_to_keep, 1, vocab)?;
    token_ids("xtc_special_tokens", &p.xtc_special_tokens, vocab)
}

/// Positioned keys key only temperature, top-k and top-p draws (mlx-vlm picks its positioned
/// sampler only then, mlx_vlm/generate/ar.py:292-305); min-p and XTC are refused.
fn positioned(p: &SamplerParams) -> Result<()> {
    let allowed = "must be left at its default with positioned keys (only temperature, top_k \
                   and top_p are sampled per position)";
    if p.min_p != 0.0 {
        return Err(invalid("min_p", p.min_p, allowed));
    }
    if p.xtc_probability != 0.0 {
        return Err(invalid("xtc_probability", p.xtc_probability, allowed));
    }
    Ok(())
}

/// mlx-lm's `make_logits_processors` arguments.
fn processors(p: &ProcessorParams, vocab: usize) -> Result<()> {
    for &(id, bias) in &p.logit_bias {
        if id as usize >= vocab {
            return Err(invalid(
                "logit_bias token id",
                id,
                &format!("must be below the vocabulary size {vocab}"),
            ));
        }
        if !bias.is_finite() {
            return Err(invalid(
                &format!("logit_bias[{id}]"),
                bias,
                "must be a finite number",
            ));
        }
    }
    let penalties = [
        (
            "repetition",
            p.repetition_penalty,
            p.repetition_context_size,
        ),
        ("presence", p.presence_penalty, p.presence_context_size),
        ("frequency", p.frequency_penalty, p.frequency_context_size),
    ];
    for (name, penalty, context) in penalties {
        if let Some(v) = penalty {
            if !v.is_finite() {
                return Err(invalid(
                    &format!("{name}_penalty"),
                    v,
                    "must be a finite number",
                ));
            }
        }
        at_least(&format!("{name}_context_size"), context, 1)?;
    }
    if let Some(v) = p.repetition_penalty.filter(|&v| v < 0.0) {
        return Err(invalid("repetition_penalty", v, "must be >= 0"));
    }
    Ok(())
}

fn unit_interval(input: &str, v: f64) -> Result<()> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(invalid(input, v, "must be within [0, 1]"))
    }
}

fn at_least(input: &str, v: usize, min: usize) -> Result<()> {
    if v >= min {
        Ok(())
    } else {
        Err(invalid(input, v, &format!("must be at least {min}")))
    }
}

fn within(input: &str, v: usize, min: usize, max: usize) -> Result<()> {
    if (min..=max).contains(&v) {
        Ok(())
    } else {
        Err(invalid(input, v, &format!("must be within [{min}, {max}]")))
    }
}
