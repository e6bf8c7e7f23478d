//! Tokenizer, chat template and streaming detokenizer, matching what mlx-lm 0.32.2 does through
//! transformers 5.24 and tokenizers 0.23.
//!
//! Parity is judged token by token against mlx-lm, so every choice here follows the Python code
//! path mlx-lm takes rather than what would be "nicer": which chat template file wins, which
//! variables a template sees, how values print inside a template, and how generated text is cut
//! into streamed segments (including mlx-lm's quirks, which are called out where they occur).

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{
    escape_formatter, AutoEscape, Environment, Error as JinjaError, ErrorKind, Output, State, Value,
};
use serde_json::{Map, Value as Json};
use tokenizers::AddedToken;

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

/// mlx-lm's `_infer_thinking`: a model "has thinking" (and its template gets
/// `enable_thinking=True` by default) when the vocabulary holds one of these pairs.
const THINK_PAIRS: [(&str, &str); 4] = [
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
    ("<|channel>", "<channel|>"),
];

/// The vocabulary markers of mlx-lm's "xtml" format, which also implies thinking.
const XTML_TOKENS: [&str; 4] = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];

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
pub struct Tokenizer {
    dir: PathBuf,
    backend: Arc<Backend>,
    templates: Option<ChatTemplates>,
    /// Values of the special-token template variables (`bos_token`, `eos_token`, ...).
    special_tokens: Map<String, Json>,
    bos_token: Option<String>,
    eos_token_id: Option<u32>,
    has_thinking: bool,
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
        let has_thinking = THINK_PAIRS
            .iter()
            .any(|(start, end)| hf.token_to_id(start).is_some() && hf.token_to_id(end).is_some())
            || XTML_TOKENS.iter().all(|t| hf.token_to_id(t).is_some());

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
            has_thinking,
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

    /// Mirrors mlx-lm's `has_chat_template`, which also counts a config that names a Python
    /// renderer (applying it then fails with [`TokenizerError::UnsupportedRenderer`]).
    pub fn has_chat_template(&self) -> bool {
        self.templates.is_some() || self.renderer.is_some()
    }

    /// Renders the chat template like transformers' apply_chat_template(messages,
    /// tokenize=False, add_generation_prompt=..) as called through mlx-lm's wrapper.
    ///
    /// `messages` are JSON objects {role, content}; content may be a string or a list of parts
    /// [{"type":"text","text":..}]. `extra` holds additional template variables (e.g. tools,
    /// enable_thinking) and may be empty. As in mlx-lm, `enable_thinking` defaults to whether
    /// the vocabulary has thinking tokens, so it is always defined for the template; `tools`
    /// and `documents` default to none, as transformers passes them.
    pub fn apply_chat_template(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
        extra: &Map<String, Json>,
    ) -> Result<String, TokenizerError> {
        if let Some(kind) = &self.renderer {
            return Err(TokenizerError::UnsupportedRenderer {
                path: self.dir.join("tokenizer_config.json"),
                kind: kind.clone(),
            });
        }
        let templates = self
            .templates
            .as_ref()
            .ok_or_else(|| TokenizerError::NoChatTemplate(self.dir.clone()))?;
        if messages.is_empty() {
            return Err(TokenizerError::InvalidChat(
                "cannot apply a chat template to an empty conversation".into(),
            ));
        }
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| match m {
                Json::Object(map) => Ok(Json::Object(normalize_message(map))),
                _ => Err(TokenizerError::InvalidChat(format!(
                    "message {i} is not a JSON object: {m}"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;

        let mut context = self.special_tokens.clone();
        context.insert("enable_thinking".into(), Json::Bool(self.has_thinking));
        context.insert("tools".into(), Json::Null);
        context.insert("documents".into(), Json::Null);
        context.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        context.insert("messages".into(), Json::Array(messages));
        context.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        let has_tools = !context["tools"].is_null();
        templates.render(has_tools, &Json::Object(context))
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

    /// Added tokens included, so eos names from a model config (e.g. `<|im_end|>`) resolve.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.backend.hf.token_to_id(token)
    }

    /// A fresh streaming detokenizer with the strategy mlx-lm picks for this tokenizer.json.
    pub fn detokenizer(&self) -> StreamingDetokenizer {
        StreamingDetokenizer {
            state: match &self.detokenizer {
                DetokenizerKind::Bpe(tokens) => StreamState::Bpe {
                    tokens: Arc::clone(tokens),
                    unflushed: String::new(),
                },
                DetokenizerKind::Spm { pieces, trim_space } => StreamState::Spm {
                    pieces: Arc::clone(pieces),
                    trim_space: *trim_space,
                    unflushed: Vec::new(),
                },
                DetokenizerKind::Naive {
                    trim_trailing_space,
                } => StreamState::Naive {
                    backend: Arc::clone(&self.backend),
                    trim_trailing_space: *trim_trailing_space,
                    committed: 0,
                    current: Vec::new(),
                },
            },
            text: String::new(),
            offset: 0,
        }
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

/// transformers drops keys whose value is None and copies reasoning under the names templates
/// read (`thinking` first, `reasoning_content` last), keeping key order as Python does.
fn normalize_message(message: &Map<String, Json>) -> Map<String, Json> {
    let kept: Map<String, Json> = message
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| kept.get(*k))
        .cloned();
    match reasoning {
        None => kept,
        Some(r) => {
            let mut aliased = Map::new();
            aliased.insert("thinking".into(), r.clone());
            aliased.extend(kept);
            aliased.insert("reasoning_content".into(), r);
            aliased
        }
    }
}

/// The chat templates of a model folder, compiled into one environment set up like
/// transformers' sandbox.
struct ChatTemplates {
    env: Environment<'static>,
    /// Template role ("default", "tool_use", ...) to its origin, which is also its name in `env`.
    roles: BTreeMap<String, String>,
    /// Syntax errors by origin, reported when that template is used.
    broken: BTreeMap<String, String>,
}

impl ChatTemplates {
    fn load(
        dir: &Path,
        config: &Map<String, Json>,
        config_path: &Path,
    ) -> Result<Option<ChatTemplates>, TokenizerError> {
        let mut sources: Vec<(String, String, String)> = Vec::new(); // (role, origin, source)
        let file = dir.join("chat_template.jinja");
        if let Some(source) = read_text(&file)? {
            sources.push(("default".into(), file.display().to_string(), source));
        }
        let extra_dir = dir.join("additional_chat_templates");
        if extra_dir.is_dir() {
            let entries = fs::read_dir(&extra_dir).map_err(|source| TokenizerError::Io {
                path: extra_dir.clone(),
                source,
            })?;
            let mut paths = Vec::new();
            for entry in entries {
                let entry = entry.map_err(|source| TokenizerError::Io {
                    path: extra_dir.clone(),
                    source,
                })?;
                paths.push(entry.path());
            }
            paths.sort();
            for path in paths {
                let Some(role) = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".jinja"))
                else {
                    continue;
                };
                let role = role.to_string();
                if let Some(source) = read_text(&path)? {
                    sources.push((role, path.display().to_string(), source));
                }
            }
        }
        if sources.is_empty() {
            let origin = format!("{} (chat_template)", config_path.display());
            match config.get("chat_template") {
                None | Some(Json::Null) => {}
                Some(Json::String(s)) => sources.push(("default".into(), origin, s.clone())),
                Some(Json::Array(items)) => {
                    for item in items {
                        let (Some(name), Some(template)) = (
                            item.get("name").and_then(Json::as_str),
                            item.get("template").and_then(Json::as_str),
                        ) else {
                            return Err(TokenizerError::Config {
                                path: config_path.to_path_buf(),
                                problem: format!(
                                    "chat_template list entries need string \"name\" and \"template\", got {item}"
                                ),
                            });
                        };
                        sources.push((
                            name.to_string(),
                            format!("{} (chat_template {name:?})", config_path.display()),
                            template.to_string(),
                        ));
                    }
                }
                Some(other) => {
                    return Err(TokenizerError::Config {
                        path: config_path.to_path_buf(),
                        problem: format!("chat_template must be a string or a list, got {other}"),
                    })
                }
            }
        }
        if sources.is_empty() {
            return Ok(None);
        }

        let mut env = template_environment().map_err(|e| TokenizerError::TemplateSyntax {
            origin: "(environment)".into(),
            message: e.to_string(),
        })?;
        let mut roles = BTreeMap::new();
        let mut broken = BTreeMap::new();
        for (role, origin, source) in sources {
            if let Err(e) = env.add_template_owned(origin.clone(), rewrite_generation_tags(&source))
            {
                broken.insert(origin.clone(), e.to_string());
            }
            roles.insert(role, origin);
        }
        Ok(Some(ChatTemplates { env, roles, broken }))
    }

    /// transformers' `get_chat_template`: a single template is used as is; among named ones
    /// "tool_use" wins when tools are given, otherwise "default" must exist.
    fn pick(&self, has_tools: bool) -> Result<&str, TokenizerError> {
        if self.roles.len() == 1 && self.roles.contains_key("default") {
            return Ok(&self.roles["default"]);
        }
        let role = if has_tools && self.roles.contains_key("tool_use") {
            "tool_use"
        } else {
            "default"
        };
        self.roles.get(role).map(String::as_str).ok_or_else(|| {
            TokenizerError::InvalidChat(format!(
                "the tokenizer has named chat templates ({}) but none called \"default\"",
                self.roles.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })
    }

    fn render(&self, has_tools: bool, context: &Json) -> Result<String, TokenizerError> {
        let origin = self.pick(has_tools)?;
        if let Some(message) = self.broken.get(origin) {
            return Err(TokenizerError::TemplateSyntax {
                origin: origin.to_string(),
                message: message.clone(),
            });
        }
        let template =
            self.env
                .get_template(origin)
                .map_err(|source| TokenizerError::TemplateRender {
                    origin: origin.to_string(),
                    source,
                })?;
        template
            .render(Value::from(minijinja::value::Serde(context)))
            .map_err(|err| match raised_message(&err) {
                Some(message) => TokenizerError::TemplateRaised {
                    origin: origin.to_string(),
                    message,
                },
                None => TokenizerError::TemplateRender {
                    origin: origin.to_string(),
                    source: err,
                },
            })
    }
}

fn read_text(path: &Path) -> Result<Option<String>, TokenizerError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The error a template's `raise_exception(..)` call produces, kept as the source of the
/// render error so it can be told apart from engine errors.
#[derive(Debug)]
struct TemplateException(String);

impl fmt::Display for TemplateException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateException {}

fn raised_message(err: &JinjaError) -> Option<String> {
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<TemplateException>() {
            return Some(raised.0.clone());
        }
        source = e.source();
    }
    None
}

/// An environment that behaves like transformers' `ImmutableSandboxedEnvironment`: trim and
/// lstrip blocks, Python string methods, its `raise_exception`, `strftime_now` and `tojson`,
/// and Python's way of printing values.
fn template_environment() -> Result<Environment<'static>, JinjaError> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson);
    env.add_function(
        "raise_exception",
        |message: Value| -> Result<Value, JinjaError> {
            let message = message.to_string();
            Err(
                JinjaError::new(ErrorKind::InvalidOperation, message.clone())
                    .with_source(TemplateException(message)),
            )
        },
    );
    env.add_function("strftime_now", |format: String| {
        strftime_utc(&format, now_unix())
    });
    Ok(env)
}

/// transformers' `{% generation %}` blocks (an extension marking assistant text for training
/// masks) render their body unchanged when no mask is requested, which is exactly what
/// `{% if true %}` does; rewriting keeps the tags' whitespace control.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let body = &tag[2..];
        let marker_len = usize::from(body.starts_with(['-', '+']));
        let after_marker = &body[marker_len..];
        let word_start = after_marker.len() - after_marker.trim_start().len();
        let word_rest = &after_marker[word_start..];
        let replacement = [("endgeneration", "endif"), ("generation", "if true")]
            .into_iter()
            .find(|(word, _)| {
                word_rest.starts_with(word)
                    && word_rest[word.len()..].starts_with(|c: char| {
                        c.is_whitespace() || c == '-' || c == '+' || c == '%'
                    })
            });
        match replacement {
            Some((word, with)) => {
                let keep = 2 + marker_len + word_start;
                out.push_str(&tag[..keep]);
                out.push_str(with);
                rest = &tag[keep + word.len()..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Prints `{{ value }}` the way Jinja2 does, with Python's `str()`. minijinja's own printing is
/// already Python-like (`True`, `None`, `['a', 1]`) except for floats, which Python writes in
/// shortest form with exponents from 1e16 and below 1e-4 (`1e-05`, not `0.00001`). Floats
/// nested in printed containers keep minijinja's form.
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), JinjaError> {
    if value.kind() == ValueKind::Number && !value.is_integer() {
        if let Ok(x) = f64::try_from(value.clone()) {
            return out.write_str(&py_float(x)).map_err(JinjaError::from);
        }
    }
    escape_formatter(out, state, value)
}

fn map_pairs(value: &Value) -> Vec<(Value, Value)> {
    value
        .try_iter()
        .map(|keys| {
            keys.map(|k| {
                let v = value.get_item(&k).unwrap_or_default();
                (k, v)
            })
            .collect()
        })
        .unwrap_or_default()
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents -4..16,
/// otherwise scientific with a signed two-digit exponent (`1e+16`, `1.5e-05`).
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{x:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let sign = if mantissa.starts_with('-') { "-" } else { "" };
        let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
        let point = exponent + 1;
        if point <= 0 {
            format!(
                "{sign}0.{}{digits}",
                "0".repeat(point.unsigned_abs() as usize)
            )
        } else if point as usize >= digits.len() {
            format!(
                "{sign}{digits}{}.0",
                "0".repeat(point as usize - digits.len())
            )
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
    }
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`. Unlike minijinja's own filter it does not HTML-escape,
/// uses Python's `", "`/`": "` separators and keeps key order, all of which show up in prompts.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, JinjaError> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(JinjaError::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut options: [Option<Value>; 4] = Default::default();
    for (slot, arg) in options.iter_mut().zip(args.iter()) {
        *slot = Some(arg.clone());
    }
    for (slot, name) in options.iter_mut().zip(NAMES) {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            *slot = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = options;
    let indent = match indent.filter(|v| !v.is_none() && !v.is_undefined()) {
        None => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => {
            let n = v.as_i64().ok_or_else(|| {
                JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent must be an int or a string, got {v}"),
                )
            })?;
            Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
        }
    };
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        Some(v) => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .unwrap_or_default();
            match <[String; 2]>::try_from(parts) {
                Ok([item, key]) => (item, key),
                Err(_) => {
                    return Err(JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let dumper = JsonDumper {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    dumper.write(&mut out, value, 0)?;
    Ok(Value::from(out))
}

/// Python's `json.dumps` over template values.
struct JsonDumper {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonDumper {
    fn write(&self, out: &mut String, value: &Value, level: usize) -> Result<(), JinjaError> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
            ValueKind::Number => {
                let x = f64::try_from(value.clone())?;
                out.push_str(&if x.is_nan() {
                    "NaN".to_string()
                } else if x.is_infinite() {
                    if x > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
                } else {
                    py_float(x)
                });
            }
            ValueKind::String => self.write_string(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container(out, '[', ']', &items, level, |d, out, item, level| {
                    d.write(out, item, level)
                })?;
            }
            ValueKind::Map => {
                let mut pairs: Vec<(String, Value)> = Vec::new();
                for (k, v) in map_pairs(value) {
                    pairs.push((self.key_string(&k)?, v));
                }
                if self.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.write_container(out, '{', '}', &pairs, level, |d, out, (k, v), level| {
                    d.write_string(out, k);
                    out.push_str(&d.key_sep);
                    d.write(out, v, level)
                })?;
            }
            kind => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: object of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn write_container<T>(
        &self,
        out: &mut String,
        open: char,
        close: char,
        items: &[T],
        level: usize,
        mut write_item: impl FnMut(&Self, &mut String, &T, usize) -> Result<(), JinjaError>,
    ) -> Result<(), JinjaError> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(level + 1));
            }
            write_item(self, out, item, level + 1)?;
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(level));
        }
        out.push(close);
        Ok(())
    }

    /// Python converts non-string keys the way it prints them as JSON scalars.
    fn key_string(&self, key: &Value) -> Result<String, JinjaError> {
        match key.kind() {
            ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
            ValueKind::None | ValueKind::Bool | ValueKind::Number => {
                let mut s = String::new();
                self.write(&mut s, key, 0)?;
                Ok(s)
            }
            kind => Err(JinjaError::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            )),
        }
    }

    fn write_string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// transformers' `strftime_now` is `datetime.now().strftime(fmt)`. Without a time-zone database
/// this uses UTC, which equals local time on the machines this runs on (TZ unset / Etc/UTC).
/// Supports the C-locale directives chat templates use, plus glibc's `%-d` style unpadded forms.
fn strftime_utc(format: &str, unix: i64) -> Result<String, JinjaError> {
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let piece = match spec {
            Some('a') => DAYS[weekday][..3].to_string(),
            Some('A') => DAYS[weekday].to_string(),
            Some('b') | Some('h') => MONTHS[month as usize - 1][..3].to_string(),
            Some('B') => MONTHS[month as usize - 1].to_string(),
            Some('d') => num(day, 2),
            Some('e') => format!("{day:2}"),
            Some('m') => num(month, 2),
            Some('y') => num(year.rem_euclid(100), 2),
            Some('Y') => year.to_string(),
            Some('H') => num(hour, 2),
            Some('I') => num((hour + 11) % 12 + 1, 2),
            Some('p') => if hour < 12 { "AM" } else { "PM" }.to_string(),
            Some('M') => num(minute, 2),
            Some('S') => num(second, 2),
            Some('j') => num(yday, 3),
            Some('w') => weekday.to_string(),
            Some('F') => format!("{year}-{month:02}-{day:02}"),
            Some('T') => format!("{hour:02}:{minute:02}:{second:02}"),
            Some('%') => "%".to_string(),
            other => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Howard Hinnant's days-since-epoch to proleptic Gregorian (year, month, day).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Which streaming strategy mlx-lm's `load` picks, from the raw `decoder` of tokenizer.json.
enum DetokenizerKind {
    /// ByteLevel decoders: `BPEStreamingDetokenizer`, over the token strings.
    Bpe(Arc<Vec<String>>),
    /// SentencePiece-style decoders: `SPMStreamingDetokenizer`, over token bytes.
    Spm {
        pieces: Arc<Vec<Vec<u8>>>,
        trim_space: bool,
    },
    /// Anything else: `NaiveStreamingDetokenizer`, which re-decodes the current line.
    Naive { trim_trailing_space: bool },
}

impl DetokenizerKind {
    fn for_decoder(decoder: &Json, backend: &Backend) -> Result<DetokenizerKind, TokenizerError> {
        let spm_steps = serde_json::json!([
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]);
        let mut spm_with_strip = spm_steps.clone();
        if let Json::Array(steps) = &mut spm_with_strip {
            steps.push(serde_json::json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        let is_sequence_of =
            |steps: &Json| *decoder == serde_json::json!({"type": "Sequence", "decoders": steps});
        let n = backend.hf.get_vocab_size(true);
        let token = |id: usize| {
            u32::try_from(id)
                .ok()
                .and_then(|id| backend.hf.id_to_token(id))
        };
        if is_sequence_of(&spm_with_strip) || is_sequence_of(&spm_steps) {
            let pieces = (0..n)
                .map(|id| token(id).map(|t| spm_piece_bytes(&t)).unwrap_or_default())
                .collect();
            return Ok(DetokenizerKind::Spm {
                pieces: Arc::new(pieces),
                trim_space: is_sequence_of(&spm_with_strip),
            });
        }
        if decoder.get("type").and_then(Json::as_str) == Some("ByteLevel") {
            let tokens = (0..n)
                .map(|id| token(id).unwrap_or_else(|| BPE_UNKNOWN_TOKEN.to_string()))
                .collect();
            return Ok(DetokenizerKind::Bpe(Arc::new(tokens)));
        }
        // mlx-lm probes whether decode drops the space in "a ,b" to know if a trailing space
        // may still be cleaned away, and then holds trailing spaces back.
        let probe = backend
            .hf
            .encode("a ,b", false)
            .map_err(TokenizerError::Encode)?;
        let decoded = backend.decode(probe.get_ids())?;
        Ok(DetokenizerKind::Naive {
            trim_trailing_space: !decoded.contains(" ,"),
        })
    }
}

/// mlx-lm's SPM token map: `<0xNN>` byte tokens carry their byte, others their UTF-8.
fn spm_piece_bytes(token: &str) -> Vec<u8> {
    token
        .strip_prefix("<0x")
        .and_then(|rest| rest.get(..2))
        .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        .map_or_else(|| token.as_bytes().to_vec(), |b| vec![b])
}

/// mlx-lm substitutes "!" for ids its token map lacks (a padded model vocabulary can sample
/// ids the tokenizer does not have).
const BPE_UNKNOWN_TOKEN: &str = "!";

/// GPT-2's byte-to-character table, inverted: the byte a ByteLevel character stands for.
/// Printable Latin-1 bytes stand for themselves; the 68 others map, in order, to U+0100..U+0143.
fn byte_level_byte(c: char) -> Option<u8> {
    let code = u32::from(c);
    let byte = match code {
        0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff => code,
        0x100..=0x120 => code - 0x100,        // 0x00..=0x20
        0x121..=0x142 => code - 0x121 + 0x7f, // 0x7f..=0xa0
        0x143 => 0xad,
        _ => return None,
    };
    u8::try_from(byte).ok()
}

/// The bytes of ByteLevel token text as mlx-lm's `_decode_bytes` computes them while streaming.
/// Quirk kept for parity: byte 0 (U+0100) is falsy in its `if res:` test, so that character is
/// emitted as its own UTF-8 ("Ā") instead of a NUL byte; characters outside the table (as in
/// added tokens) also pass through as UTF-8.
fn bpe_stream_bytes(text: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(text.len());
    for c in text.chars() {
        match byte_level_byte(c) {
            Some(b) if b != 0 => bytes.push(b),
            _ => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    bytes
}

/// The bytes mlx-lm's `finalize` computes: the exact table (so U+0100 is a NUL byte here). Python
/// raises on characters outside the table; they pass through as UTF-8 instead.
fn bpe_final_bytes(text: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(text.len());
    for c in text.chars() {
        match byte_level_byte(c) {
            Some(b) => bytes.push(b),
            None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    bytes
}

/// Streams generated text the way mlx-lm's detokenizers do, so what the engine prints while
/// generating matches what `mlx_lm.generate` prints.
///
/// Like mlx-lm, the BPE and SPM strategies drop one leading space of the whole output, and text
/// is only released once it does not end in an incomplete UTF-8 character.
pub struct StreamingDetokenizer {
    state: StreamState,
    text: String,
    /// Bytes of `text` already handed out by `take_segment`.
    offset: usize,
}

enum StreamState {
    Bpe {
        tokens: Arc<Vec<String>>,
        unflushed: String,
    },
    Spm {
        pieces: Arc<Vec<Vec<u8>>>,
        trim_space: bool,
        unflushed: Vec<u8>,
    },
    Naive {
        backend: Arc<Backend>,
        trim_trailing_space: bool,
        /// Bytes of `text` that are final (everything up to the last completed line).
        committed: usize,
        /// Tokens of the current, still revisable line.
        current: Vec<u32>,
    },
}

const REPLACEMENT: char = '\u{fffd}';

/// mlx-lm's `_maybe_trim_space`: the very first text of an output loses one leading space.
fn trim_first_space(text: &str, output_so_far: &str) -> String {
    match text.strip_prefix(' ') {
        Some(rest) if output_so_far.is_empty() => rest.to_string(),
        _ => text.to_string(),
    }
}

impl StreamingDetokenizer {
    /// Feed every generated token except a stopping eos, which mlx-lm never adds.
    pub fn add_token(&mut self, id: u32) {
        match &mut self.state {
            StreamState::Bpe { tokens, unflushed } => {
                let token = tokens
                    .get(id as usize)
                    .map_or(BPE_UNKNOWN_TOKEN, String::as_str);
                unflushed.push_str(token);
                let text = String::from_utf8_lossy(&bpe_stream_bytes(unflushed)).into_owned();
                // Wait for incomplete characters, and keep a lone space token until the next
                // token shows whether it starts the output (and is trimmed).
                let lone_space = token == "\u{120}";
                if !text.ends_with(REPLACEMENT) && !lone_space {
                    let text = trim_first_space(&text, &self.text);
                    self.text.push_str(&text);
                    unflushed.clear();
                }
            }
            StreamState::Spm {
                pieces, unflushed, ..
            } => {
                if let Some(piece) = pieces.get(id as usize) {
                    unflushed.extend_from_slice(piece);
                }
                self.flush_spm(false);
            }
            StreamState::Naive {
                backend,
                trim_trailing_space,
                committed,
                current,
            } => {
                current.push(id);
                // A decoder error leaves the line as it was; the next token retries it.
                let Ok(mut line) = backend.decode(current) else {
                    return;
                };
                if line.ends_with(REPLACEMENT) {
                    line.truncate(line.trim_end_matches(REPLACEMENT).len());
                } else if *trim_trailing_space && line.ends_with(' ') {
                    line.pop();
                }
                self.text.truncate(*committed);
                self.text.push_str(&line);
                if line.ends_with('\n') {
                    *committed = self.text.len();
                    current.clear();
                }
            }
        }
    }

    fn flush_spm(&mut self, force: bool) {
        let StreamState::Spm {
            trim_space,
            unflushed,
            ..
        } = &mut self.state
        else {
            return;
        };
        let spaced = replace_bytes(unflushed, "\u{2581}".as_bytes(), b" ");
        let text = String::from_utf8_lossy(&spaced).into_owned();
        if !force && text.ends_with(REPLACEMENT) {
            return;
        }
        let text = if *trim_space {
            trim_first_space(&text, &self.text)
        } else {
            text
        };
        self.text.push_str(&text);
        unflushed.clear();
    }

    /// Text that became final since the last call; never ends inside a UTF-8 character.
    pub fn take_segment(&mut self) -> String {
        // Only the naive strategy revises text; if it shrank, resume from the new end.
        let mut start = self.offset.min(self.text.len());
        while !self.text.is_char_boundary(start) {
            start -= 1;
        }
        let segment = self.text[start..].to_string();
        self.offset = self.text.len();
        segment
    }

    /// Flushes whatever is held back (an incomplete trailing character becomes U+FFFD, as
    /// Python's errors="replace" decoding does) and returns the rest of the text.
    pub fn finalize(&mut self) -> String {
        match &mut self.state {
            StreamState::Bpe { unflushed, .. } => {
                let text = String::from_utf8_lossy(&bpe_final_bytes(unflushed)).into_owned();
                unflushed.clear();
                let text = trim_first_space(&text, &self.text);
                self.text.push_str(&text);
            }
            StreamState::Spm { .. } => self.flush_spm(true),
            StreamState::Naive {
                backend,
                committed,
                current,
                ..
            } => {
                if let Ok(line) = backend.decode(current) {
                    self.text.truncate(*committed);
                    self.text.push_str(&line);
                }
                *committed = self.text.len();
                current.clear();
            }
        }
        self.take_segment()
    }

    /// All text so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}

fn replace_bytes(haystack: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut i = 0;
    while i < haystack.len() {
        if haystack[i..].starts_with(needle) {
            out.extend_from_slice(with);
            i += needle.len();
        } else {
            out.push(haystack[i]);
            i += 1;
        }
    }
    out
}
