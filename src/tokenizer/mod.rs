//! Tokenizer loading, chat templates and streaming detokenization, matching what mlx-lm 0.32.2
//! does through transformers 5.24 and tokenizers 0.23. This file loads a folder's tokenizer and
//! its special tokens; `chat` renders templates (over the Python-flavoured Jinja of `jinja` and
//! `strftime`), `detokenizer` streams generated text.
//!
//! Parity is judged token by token against mlx-lm, so every choice here follows the Python code
//! path mlx-lm takes rather than what would be "nicer": which chat template file wins, which
//! variables a template sees, how values print inside a template, and how generated text is cut
//! into streamed segments (including mlx-lm's quirks, which are called out where they occur).

mod chat;
mod detokenizer;
mod jinja;
mod markers;
mod strftime;

pub use chat::UserTurn;
pub use detokenizer::StreamingDetokenizer;
pub use jinja::json_dumps;
pub use markers::Markers;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::Error as JinjaError;
use serde_json::{Map, Value as Json};
use tokenizers::AddedToken;

use chat::ChatTemplates;
use detokenizer::DetokenizerKind;

/// Everything that can go wrong loading a tokenizer or using it; each variant names the file or
/// the input at fault so a user can fix it without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("model folder {0} does not exist or is not a folder")]
    MissingDir(PathBuf),
    #[error("{0} is missing")]
    MissingFile(PathBuf),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path} is not a tokenizer the tokenizers library can load: {source}")]
    Load {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    #[error("{path}: {problem}")]
    Config { path: PathBuf, problem: String },
    #[error("{0} has no chat template (no chat_template.jinja and no chat_template in tokenizer_config.json)")]
    NoChatTemplate(PathBuf),
    #[error("chat template {origin} has a syntax error: {message}")]
    TemplateSyntax { origin: String, message: String },
    #[error("chat template {origin} failed to render: {source}")]
    TemplateRender {
        origin: String,
        #[source]
        source: JinjaError,
    },
    #[error("chat template {origin} raised an exception: {message}")]
    TemplateRaised { origin: String, message: String },
    #[error(
        "{path} sets chat_template_type = {kind:?}: mlx-lm renders such chats with its own Python \
         module, which verity does not implement"
    )]
    UnsupportedRenderer { path: PathBuf, kind: String },
    #[error("invalid chat: {0}")]
    InvalidChat(String),
    #[error("cannot encode text: {0}")]
    Encode(#[source] tokenizers::Error),
    #[error("cannot decode token ids: {0}")]
    Decode(#[source] tokenizers::Error),
}

/// The template variables transformers treats as special tokens. Any other `*_token` key of the
/// config joins them (transformers 5 "model specific special tokens", e.g. Gemma's image_token).
const NAMED_SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The tokenizers backend plus transformers' post-decode cleanup; shared with the naive
/// detokenizer because mlx-lm's naive strategy re-decodes through the full HF decode.
struct Backend {
    hf: tokenizers::Tokenizer,
    /// transformers' `clean_up_tokenization_spaces`, already resolved against its rule that BPE
    /// models skip the cleanup unless forced.
    clean_up_spaces: bool,
}

impl Backend {
    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let text = self.hf.decode(ids, false).map_err(TokenizerError::Decode)?;
        Ok(if self.clean_up_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }
}

/// transformers' `clean_up_tokenization` (a WordPiece-era cleanup some configs still enable).
fn clean_up_tokenization(text: &str) -> String {
    [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ]
    .iter()
    .fold(text.to_string(), |t, (from, to)| t.replace(from, to))
}

/// A model's tokenizer as mlx-lm loads it: tokenizers for the text/id mapping, transformers'
/// rules for special tokens and chat templates, mlx-lm's choice of streaming detokenizer.
/// Cloning is cheap enough to do once per grammar environment (the vocabulary is shared).
#[derive(Clone)]
pub struct Tokenizer {
    dir: PathBuf,
    backend: Arc<Backend>,
    templates: Option<ChatTemplates>,
    /// Values of the special-token template variables (`bos_token`, `eos_token`, ...).
    special_tokens: Map<String, Json>,
    bos_token: Option<String>,
    eos_token_id: Option<u32>,
    /// mlx-lm's reasoning markers, from the vocabulary.
    thinking: Option<Markers>,
    /// The config's `tool_parser_type`, which wins over what the template shows.
    tool_parser_type: Option<String>,
    /// mlx-lm's tool-call markers, from the config or the chat template (json_tools only).
    tool_calls: Option<Markers>,
    /// Set when the config asks mlx-lm for a Python chat renderer instead of a template.
    renderer: Option<String>,
    detokenizer: DetokenizerKind,
}

impl Tokenizer {
    /// Loads the tokenizer of a model folder the way `mlx_lm.tokenizer_utils.load` does.
    ///
    /// A `chat_template.jinja` (and `additional_chat_templates/*.jinja`) takes priority over the
    /// config's inline `chat_template`: that is what transformers 5.24's `_from_pretrained` does,
    /// so a folder carrying both renders with the file. Template syntax errors are reported by
    /// [`Tokenizer::apply_chat_template`], not here, so a model with a broken template can still
    /// run raw prompts, as in mlx-lm.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        if !dir.is_dir() {
            return Err(TokenizerError::MissingDir(dir.to_path_buf()));
        }
        let tokenizer_path = dir.join("tokenizer.json");
        let raw = read_json(&tokenizer_path)?
            .ok_or_else(|| TokenizerError::MissingFile(tokenizer_path.clone()))?;
        // mlx-lm picks the detokenizer from the raw JSON, so keep the bits it looks at.
        let decoder_json = raw.get("decoder").cloned().unwrap_or(Json::Null);
        let is_bpe_model = raw.pointer("/model/type").and_then(Json::as_str) == Some("BPE");
        let mut hf: tokenizers::Tokenizer =
            serde_json::from_value(raw).map_err(|e| TokenizerError::Load {
                path: tokenizer_path.clone(),
                source: Box::new(e),
            })?;
        // transformers only truncates or pads when asked; tokenizer.json may carry either.
        hf.with_truncation(None)
            .map_err(|source| TokenizerError::Load {
                path: tokenizer_path.clone(),
                source,
            })?;
        hf.with_padding(None);

        let config_path = dir.join("tokenizer_config.json");
        let config = match read_json(&config_path)? {
            None => Map::new(),
            Some(Json::Object(map)) => map,
            Some(_) => {
                return Err(TokenizerError::Config {
                    path: config_path,
                    problem: "expected a JSON object".into(),
                })
            }
        };
        let special = special_token_entries(dir, &config, &config_path)?;
        add_missing_special_tokens(&mut hf, &special, &config).map_err(|source| {
            TokenizerError::Load {
                path: tokenizer_path.clone(),
                source,
            }
        })?;

        let special_tokens: Map<String, Json> = special
            .iter()
            .map(|(name, token)| (name.clone(), Json::String(token.content.clone())))
            .collect();
        let named = |name: &str| {
            special
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t.content.clone())
        };
        let bos_token = named("bos_token");
        let eos_token_id = named("eos_token").and_then(|t| hf.token_to_id(&t));
        let thinking = markers::thinking(|t| hf.token_to_id(t).is_some());

        let clean_up_spaces = config
            .get("clean_up_tokenization_spaces")
            .is_some_and(truthy)
            && (!is_bpe_model
                || config
                    .get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
                    .is_some_and(truthy));
        let renderer = config
            .get("chat_template_type")
            .filter(|v| truthy(v))
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string));
        let templates = ChatTemplates::load(dir, &config, &config_path)?;
        let tool_parser_type = config
            .get("tool_parser_type")
            .and_then(Json::as_str)
            .map(str::to_string);
        let tool_calls = markers::tool_calls(
            tool_parser_type.as_deref(),
            templates.as_ref().and_then(ChatTemplates::single_source),
        );

        let backend = Arc::new(Backend {
            hf,
            clean_up_spaces,
        });
        let detokenizer = DetokenizerKind::for_decoder(&decoder_json, &backend)?;
        Ok(Tokenizer {
            dir: dir.to_path_buf(),
            backend,
            templates,
            special_tokens,
            bos_token,
            eos_token_id,
            thinking,
            tool_parser_type,
            tool_calls,
            renderer,
            detokenizer,
        })
    }

    /// `add_special_tokens` runs tokenizer.json's post-processor (e.g. prepending BOS), as HF
    /// encode does; mlx-lm passes false for rendered chats, whose template already has them.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .backend
            .hf
            .encode(text, add_special_tokens)
            .map_err(TokenizerError::Encode)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Like HF decode(ids, skip_special_tokens=False).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.backend.decode(ids)
    }

    /// The model folder the tokenizer came from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tokenizer as tokenizer.json would hold it (with the special tokens transformers
    /// registers), for llguidance's token table.
    pub fn to_json(&self) -> Result<Json, serde_json::Error> {
        serde_json::to_value(&self.backend.hf)
    }

    /// The tokenizer's own eos token id (tokenizer_config eos_token), if any.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// mlx-lm skips adding special tokens to a raw prompt that already starts with this.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// Including added tokens, like Python's `len(tokenizer)`.
    pub fn vocab_size(&self) -> usize {
        self.backend.hf.get_vocab_size(true)
    }

    /// Whether `other` maps every token string to the same id (added tokens included).
    pub fn same_vocabulary(&self, other: &Tokenizer) -> bool {
        self.backend.hf.get_vocab(true) == other.backend.hf.get_vocab(true)
    }

    /// Added tokens included, so eos names from a model config (e.g. `<|im_end|>`) resolve.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.backend.hf.token_to_id(token)
    }
}

/// Reads a JSON file; `Ok(None)` when it does not exist, because several of these files are
/// optional and their absence is not an error.
fn read_json(path: &Path) -> Result<Option<Json>, TokenizerError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// Python truthiness of a JSON value, as transformers tests config flags with `if value:`.
fn truthy(value: &Json) -> bool {
    match value {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64() != Some(0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

/// The special tokens transformers exposes to templates, by variable name, with the
/// AddedToken properties it would register them with if they are missing from tokenizer.json.
/// The order is transformers' (the standard names, then model-specific ones in config order),
/// because missing tokens get fresh ids in that order.
fn special_token_entries(
    dir: &Path,
    config: &Map<String, Json>,
    config_path: &Path,
) -> Result<Vec<(String, AddedToken)>, TokenizerError> {
    let mut merged = config.clone();
    // Legacy files: transformers reads special_tokens_map.json only when the config has no
    // added_tokens_decoder, and then lets it override the config.
    if !config.contains_key("added_tokens_decoder") {
        let map_path = dir.join("special_tokens_map.json");
        match read_json(&map_path)? {
            None => {}
            Some(Json::Object(map)) => merged.extend(map),
            Some(_) => {
                return Err(TokenizerError::Config {
                    path: map_path,
                    problem: "expected a JSON object".into(),
                })
            }
        }
    }
    let mut entries = Vec::new();
    for name in NAMED_SPECIAL_TOKENS {
        let Some(value) = merged.get(name).filter(|v| !v.is_null()) else {
            continue;
        };
        let token = added_token(value).ok_or_else(|| TokenizerError::Config {
            path: config_path.to_path_buf(),
            problem: format!("{name} must be a string or an AddedToken object, got {value}"),
        })?;
        entries.push((name.to_string(), token));
    }
    let model_specific = merged.iter().filter(|(key, _)| {
        key.ends_with("_token") && !NAMED_SPECIAL_TOKENS.contains(&key.as_str())
    });
    // A dict of extra special tokens names them like model-specific ones.
    let extra = merged
        .get("extra_special_tokens")
        .and_then(Json::as_object)
        .into_iter()
        .flatten();
    for (key, value) in model_specific.chain(extra) {
        if let Json::String(content) = value {
            let token = AddedToken::from(content.clone(), true);
            match entries.iter_mut().find(|(name, _)| name == key) {
                Some(entry) => entry.1 = token,
                None => entries.push((key.clone(), token)),
            }
        }
    }
    Ok(entries)
}

/// A string or a serialized AddedToken (`{"content": .., "lstrip": .., ...}`) as a special token.
fn added_token(value: &Json) -> Option<AddedToken> {
    match value {
        Json::String(s) => Some(AddedToken::from(s.clone(), true)),
        Json::Object(o) => {
            let flag = |k: &str, default: bool| o.get(k).and_then(Json::as_bool).unwrap_or(default);
            let content = o.get("content")?.as_str()?;
            Some(
                AddedToken::from(content.to_string(), true)
                    .single_word(flag("single_word", false))
                    .lstrip(flag("lstrip", false))
                    .rstrip(flag("rstrip", false))
                    .normalized(flag("normalized", false)),
            )
        }
        _ => None,
    }
}

/// transformers' backend `__init__` registers every named or extra special token that is not
/// already an added token, which makes it match atomically when encoding text.
fn add_missing_special_tokens(
    hf: &mut tokenizers::Tokenizer,
    special: &[(String, AddedToken)],
    config: &Map<String, Json>,
) -> Result<(), tokenizers::Error> {
    let extra = ["extra_special_tokens", "additional_special_tokens"]
        .iter()
        .filter_map(|k| config.get(*k))
        .filter_map(Json::as_array)
        .flat_map(|items| items.iter().filter_map(added_token));
    let existing: Vec<String> = hf
        .get_added_tokens_decoder()
        .into_values()
        .map(|t| t.content)
        .collect();
    let mut missing: Vec<AddedToken> = Vec::new();
    for token in special.iter().map(|(_, t)| t.clone()).chain(extra) {
        if !existing.contains(&token.content) && !missing.iter().any(|m| m.content == token.content)
        {
            missing.push(token);
        }
    }
    if !missing.is_empty() {
        hf.add_special_tokens(missing)?;
    }
    Ok(())
}
