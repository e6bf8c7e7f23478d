//! Chat templates as transformers renders them through mlx-lm's wrapper: which template file
//! wins, which variables a template sees, how messages are normalized, and how
//! `mlx_lm.generate` turns a user's text into prompt tokens.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::Path;

use minijinja::{Environment, Value};
use serde_json::{json, Map, Value as Json};

use super::jinja::{raised_message, rewrite_generation_tags, template_environment};
use super::{markers, Markers, Tokenizer, TokenizerError};

/// One user turn, as `mlx_lm.generate` turns its `--prompt` into tokens.
#[derive(Clone, Debug, Default)]
pub struct UserTurn<'a> {
    pub text: &'a str,
    /// A system message before the user's (chat template only).
    pub system: Option<&'a str>,
    /// Encode the text as it is, with special tokens, instead of through the chat template.
    pub raw: bool,
    /// The prompt continues a prompt cache that holds the conversation so far.
    pub continues_cache: bool,
}

impl Tokenizer {
    /// Mirrors mlx-lm's `has_chat_template`, which also counts a config that names a Python
    /// renderer (applying it then fails with [`TokenizerError::UnsupportedRenderer`]).
    pub fn has_chat_template(&self) -> bool {
        self.templates.is_some() || self.renderer.is_some()
    }

    /// The tokenizer with `source` as its only chat template, as mlx_lm.server's
    /// `--chat-template` sets it (tokenizer_config's `chat_template`): the tool-call format is
    /// inferred again from it.
    pub fn with_chat_template(&self, source: &str, origin: &str) -> Tokenizer {
        let templates = ChatTemplates::from_sources(vec![(
            "default".into(),
            origin.to_string(),
            source.to_string(),
        )]);
        Tokenizer {
            tool_calls: markers::tool_calls(self.tool_parser_type.as_deref(), Some(source)),
            templates: Some(templates),
            renderer: None,
            ..self.clone()
        }
    }

    /// The reasoning markers mlx-lm separates an answer's reasoning by, if the model has any.
    pub fn thinking_markers(&self) -> Option<&Markers> {
        self.thinking.as_ref()
    }

    /// The tool-call markers mlx-lm parses tool calls between, if the model's format is Qwen's
    /// `<tool_call>{json}</tool_call>` (mlx-lm's json_tools).
    pub fn tool_call_markers(&self) -> Option<&Markers> {
        self.tool_calls.as_ref()
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
        context.insert(
            "enable_thinking".into(),
            Json::Bool(self.thinking.is_some()),
        );
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

    /// The prompt tokens of `turn`, as mlx_lm.generate computes them: the chat template (with
    /// the generation prompt) when the tokenizer has one and the turn is not raw, else the text
    /// encoded with special tokens. A turn that continues a prompt cache keeps only what the
    /// template adds from the user's message on (mlx-lm renders the chat once more with the
    /// message replaced by a marker and cuts at the marker), since the cache holds the rest.
    pub fn encode_user_turn(&self, turn: &UserTurn<'_>) -> Result<Vec<u32>, TokenizerError> {
        if turn.raw || !self.has_chat_template() {
            return self.encode(turn.text, true);
        }
        let mut messages = Vec::new();
        if let Some(system) = turn.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": turn.text}));
        let no_extra = Map::new();
        let mut rendered = self.apply_chat_template(&messages, true, &no_extra)?;
        if turn.continues_cache {
            const MARKER: &str = "<query>";
            messages.last_mut().expect("a user message")["content"] = json!(MARKER);
            let marked = self.apply_chat_template(&messages, true, &no_extra)?;
            let start = marked.find(MARKER).ok_or_else(|| {
                TokenizerError::InvalidChat("the chat template drops the user's message".into())
            })?;
            rendered = rendered[start..].to_string();
        }
        self.encode(&rendered, false)
    }
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
#[derive(Clone)]
pub(super) struct ChatTemplates {
    env: Environment<'static>,
    /// Template role ("default", "tool_use", ...) to its origin, which is also its name in `env`.
    roles: BTreeMap<String, String>,
    /// Syntax errors by origin, reported when that template is used.
    broken: BTreeMap<String, String>,
    /// The template's text when there is one only (transformers' `chat_template` is then a
    /// string, which mlx-lm reads the tool-call format from).
    single: Option<String>,
}

impl ChatTemplates {
    pub(super) fn load(
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
        Ok(Some(ChatTemplates::from_sources(sources)))
    }

    /// Compiles (role, origin, source) templates; a syntax error is kept for when it is used.
    fn from_sources(sources: Vec<(String, String, String)>) -> ChatTemplates {
        let single = match sources.as_slice() {
            [(role, _, source)] if role == "default" => Some(source.clone()),
            _ => None,
        };
        let mut env = template_environment().expect("the environment's syntax settings are valid");
        let mut roles = BTreeMap::new();
        let mut broken = BTreeMap::new();
        for (role, origin, source) in sources {
            if let Err(e) = env.add_template_owned(origin.clone(), rewrite_generation_tags(&source))
            {
                broken.insert(origin.clone(), e.to_string());
            }
            roles.insert(role, origin);
        }
        ChatTemplates {
            env,
            roles,
            broken,
            single,
        }
    }

    pub(super) fn single_source(&self) -> Option<&str> {
        self.single.as_deref()
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
