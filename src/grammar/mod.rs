//! Grammar-constrained decoding over llguidance: a JSON schema, a regex, a Lark grammar or a
//! choice list becomes a [`Constraint`] that masks the logits at every step. EOS is allowed
//! only where the grammar may end, and a finished grammar is never asked for a mask.

use std::path::Path;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use mlx::{ops, Array};
use serde_json::Value;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::tokenizer::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("{path}: {message}")]
    Tokenizer { path: String, message: String },
    /// The grammar cannot be compiled (for a JSON schema, llguidance names the unsupported
    /// feature, e.g. `Unimplemented keys: ["not"]`).
    #[error("cannot compile the {kind}: {message}")]
    Compile { kind: &'static str, message: String },
    #[error("the grammar rejected token {token}: {message}")]
    Rejected { token: u32, message: String },
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
}

/// What output must match.
#[derive(Clone, Debug)]
pub enum Grammar {
    JsonSchema(Value),
    Regex(String),
    Lark(String),
    /// One of these strings exactly.
    Choice(Vec<String>),
}

/// Compact JSON (no whitespace between tokens, "," and ":" separators): what constrained
/// generation emits, so a model cannot pad output with whitespace forever.
fn compact_json(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"})
        });
    }
    schema
}

impl Grammar {
    /// Reads a JSON schema file.
    pub fn json_schema_file(path: &Path) -> Result<Grammar, GrammarError> {
        let bad = |message: String| GrammarError::Compile {
            kind: "JSON schema",
            message: format!("{}: {message}", path.display()),
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        Ok(Grammar::JsonSchema(
            serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?,
        ))
    }

    /// Reads a Lark grammar file.
    pub fn lark_file(path: &Path) -> Result<Grammar, GrammarError> {
        let text = std::fs::read_to_string(path).map_err(|e| GrammarError::Compile {
            kind: "Lark grammar",
            message: format!("{}: {e}", path.display()),
        })?;
        Ok(Grammar::Lark(text))
    }

    fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonSchema(_) => "JSON schema",
            Grammar::Regex(_) => "regex",
            Grammar::Lark(_) => "Lark grammar",
            Grammar::Choice(_) => "choice list",
        }
    }

    fn to_llguidance(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact_json(schema.clone()))
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Grammar::Choice(options) => {
                // Lark string literals take JSON string escapes.
                let alternatives: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).expect("a string serializes"))
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
        }
    }
}

/// llguidance's view of a tokenizer: every token's bytes in a trie, built from the loaded
/// tokenizer (whose own encoder tokenizes arbitrary text, so no second tokenizers version is
/// compiled), and the parser factory over it. Shared by every constraint of a model.
#[derive(Clone)]
pub struct TokenEnv {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tokenizer.encode(s, false).unwrap_or_default()
        })
    }
}

impl TokenEnv {
    /// Builds the environment over `tokenizer`; `eos` is its EOS token and `model_vocab` the
    /// width of the model's logits (the mask width).
    pub fn new(
        tokenizer: &Tokenizer,
        eos: u32,
        model_vocab: usize,
    ) -> Result<TokenEnv, GrammarError> {
        let bad = |message: String| GrammarError::Tokenizer {
            path: tokenizer.dir().join("tokenizer.json").display().to_string(),
            message,
        };
        let json = tokenizer.to_json().map_err(|e| bad(e.to_string()))?;
        let words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| bad(e.to_string()))?;
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, eos), &words);
        let env: TokEnv = Arc::new(Env {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| bad(e.to_string()))?;
        factory.quiet();
        Ok(TokenEnv {
            factory: Arc::new(factory),
            vocab: model_vocab,
        })
    }

    /// Compiles `grammar` into a fresh constraint; `eos` are all the model's EOS ids.
    pub fn constraint(&self, grammar: &Grammar, eos: &[u32]) -> Result<Constraint, GrammarError> {
        let parser = self
            .factory
            .create_parser(grammar.to_llguidance())
            .map_err(|e| GrammarError::Compile {
                kind: grammar.kind(),
                message: e.to_string(),
            })?;
        let mut constraint = Constraint {
            matcher: Matcher::new(Ok(parser)),
            eos: eos.to_vec(),
            vocab: self.vocab,
            advanced: Vec::new(),
        };
        // A grammar that no token can start (and that does not accept the empty text) would
        // fail at the first token with llguidance's internal dump; refuse it here instead.
        let startable = constraint
            .allowed()
            .map(|allowed| allowed.contains(&true))
            .unwrap_or(false);
        if !startable {
            return Err(GrammarError::Compile {
                kind: grammar.kind(),
                message: "it matches no text this model's tokens can spell".into(),
            });
        }
        Ok(constraint)
    }
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
    eos: Vec<u32>,
    vocab: usize,
    /// For each consumed token, whether it advanced the matcher (EOS does not), so that
    /// rollback counts match.
    advanced: Vec<bool>,
}

impl Constraint {
    /// Whether the grammar is complete and nothing but EOS may follow.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The allowed tokens, as booleans over the model's vocabulary.
    pub fn allowed(&mut self) -> Result<Vec<bool>, GrammarError> {
        let mut allowed = vec![false; self.vocab];
        let accepting = if self.matcher.is_stopped() {
            true
        } else {
            let mask = self.matcher.compute_mask().map_err(|e| self.error(e))?;
            mask.iter_set_entries(|t| {
                if let Some(slot) = allowed.get_mut(t) {
                    *slot = true;
                }
            });
            self.matcher.is_accepting().map_err(|e| self.error(e))?
        };
        for &e in &self.eos {
            if let Some(slot) = allowed.get_mut(e as usize) {
                *slot = accepting;
            }
        }
        Ok(allowed)
    }

    /// `logits` (1, V) with every token the grammar forbids at -inf.
    pub fn mask(&mut self, logits: &Array) -> Result<Array, GrammarError> {
        let allowed = self.allowed()?;
        let mask = Array::from_slice(&allowed, &[1, allowed.len() as i32])?;
        let forbidden = Array::scalar(f32::NEG_INFINITY, logits.dtype())?;
        Ok(ops::r#where(&mask, logits, &forbidden)?)
    }

    /// Advances the grammar over an emitted token (EOS ends it).
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        let advance = !self.eos.contains(&token) && !self.matcher.is_stopped();
        if advance {
            self.matcher
                .consume_token(token)
                .map_err(|e| GrammarError::Rejected {
                    token,
                    message: first_line(&e.to_string()),
                })?;
        }
        self.advanced.push(advance);
        Ok(())
    }

    /// Takes back the last `n` consumed tokens.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        let keep = self.advanced.len().saturating_sub(n);
        let undo = self.advanced.drain(keep..).filter(|&a| a).count();
        self.matcher.rollback(undo).map_err(|e| self.error(e))
    }

    fn error(&self, e: impl std::fmt::Display) -> GrammarError {
        GrammarError::Rejected {
            token: 0,
            message: first_line(&e.to_string()),
        }
    }
}

/// The first line of an llguidance error (the rest is its parser state dump).
fn first_line(message: &str) -> String {
    message.lines().next().unwrap_or_default().to_string()
}
