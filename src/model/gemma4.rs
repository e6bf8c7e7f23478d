//! mlx_lm/models/gemma4.py: a Gemma 4 checkpoint as published (model_type "gemma4", the
//! multimodal model) loaded as text. The text model's arguments sit under `text_config`, with
//! the top-level `vocab_size` (262144 unless given) written over them and mlx-lm's defaults for
//! the head counts; the weights drop the vision and audio towers and their embedders, and the
//! language model's keys lose their wrapper prefix (Hugging Face's `model.language_model.*` or
//! mlx's `language_model.model.*`), so that gemma4_text loads what is left; so do the
//! quantization's per-module entries.

use serde_json::{json, Map, Value};

use super::gemma4_text;
use crate::load::{Config, LoadResult, QuantConfig, Weights};

/// The multimodal parts mlx-lm's sanitize drops (after any `model.` prefix).
const MULTIMODAL: &[&str] = &[
    "vision_tower",
    "multi_modal_projector",
    "audio_tower",
    "embed_audio",
    "embed_vision",
    "vision_embedder",
];

pub fn load(config: &Config, w: &mut Weights) -> LoadResult<gemma4_text::Model> {
    let mut text = match config.json.get("text_config") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(t)) => t.clone(),
        Some(other) => {
            return Err(config.error(format!("text_config is {other}, must be an object")))
        }
    };
    let vocab = config.json.get("vocab_size").cloned();
    text.insert("vocab_size".into(), vocab.unwrap_or(json!(262144)));
    text.entry("num_attention_heads").or_insert(json!(8));
    text.entry("num_key_value_heads").or_insert(json!(1));
    // The quantization's per-module entries name the wrapper's paths (`language_model.model.*`).
    if let Some(Value::Object(q)) = config.json.get("quantization") {
        let renamed = q.iter().map(|(k, v)| {
            let k = k.strip_prefix("language_model.").unwrap_or(k);
            (k.to_string(), v.clone())
        });
        text.insert("quantization".into(), Value::Object(renamed.collect()));
    }
    let text_config = Config {
        path: config.path.clone(),
        json: text,
    };
    let q = QuantConfig::from_config(&text_config)?;
    w.rename(|k| {
        let (hf, bare) = match k.strip_prefix("model.") {
            Some(rest) => (true, rest),
            None => (false, k),
        };
        if MULTIMODAL.iter().any(|p| bare.starts_with(p)) {
            return None;
        }
        Some(match bare.strip_prefix("language_model.") {
            Some(rest) if hf => format!("model.{rest}"),
            Some(rest) => rest.to_string(),
            None => k.to_string(),
        })
    });
    gemma4_text::Model::load(&text_config, w, &q)
}
