//! The engine's one error type. Boundary errors (a model folder, a tokenizer, a prompt cache
//! file, a grammar) keep their own types, which name the file or input at fault, and convert
//! into this one; the CLI prints any of them as one line and exits 2.

use crate::grammar::GrammarError;
use crate::load::LoadError;
use crate::parity::derived::DerivedError;
use crate::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An MLX call failed, with MLX's own message. Every outside value is validated before MLX
    /// sees it, so this names a gap in that layer (or an MLX failure such as memory), and says
    /// it came from MLX rather than passing MLX's text off as verity's own refusal.
    #[error("MLX failed: {0}")]
    Mlx(#[from] mlx::Error),
    /// A request's parameters are invalid: the message names the parameter, the value and what
    /// is allowed.
    #[error("{0}")]
    Params(String),
    /// A combination mlx-lm refuses as well (for example quantizing a rotating KV cache).
    #[error("{0}")]
    Unsupported(String),
    /// A caller broke an engine contract (a round closed that was never opened, a layer given
    /// the wrong kind of cache). Always a bug in the caller, never bad input.
    #[error("engine contract violated: {0}")]
    Contract(String),
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    PromptCache(#[from] PromptFileError),
    /// A fixture folder whose weights are derived could not be materialised (its
    /// derivation.json, its source, or a result that is not the recorded one).
    #[error(transparent)]
    Derived(#[from] DerivedError),
    /// The caller asked to stop (a server's client went away) before the work was done.
    #[error("the request was cancelled")]
    Cancelled,
    /// An error with what it happened in (a trace id, a suite and k).
    #[error("{what}: {source}")]
    Context { what: String, source: Box<Error> },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A prompt cache file (mlx-lm's format) that cannot be read or written, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum PromptFileError {
    #[error("{path}: {message}")]
    Format { path: String, message: String },
    #[error("{path}: {source}")]
    Mlx { path: String, source: mlx::Error },
    /// A file MLX cannot load; the message names it.
    #[error(transparent)]
    Unreadable(mlx::Error),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl Error {
    /// Whether this error is a refusal of bad input (a value, a model folder, a tokenizer, a
    /// prompt cache or a grammar), as opposed to a failure of the engine or of MLX.
    pub fn is_bad_input(&self) -> bool {
        match self {
            Error::Params(_)
            | Error::Grammar(_)
            | Error::Load(_)
            | Error::Tokenizer(_)
            | Error::PromptCache(_) => true,
            // MLX failing mid-derivation is not the folder's fault; everything else is.
            Error::Derived(e) => !matches!(e, DerivedError::Mlx { .. }),
            Error::Context { source, .. } => source.is_bad_input(),
            Error::Mlx(_) | Error::Unsupported(_) | Error::Contract(_) | Error::Cancelled => false,
        }
    }

    /// This error, prefixed with what it happened in.
    pub fn context(self, what: impl Into<String>) -> Error {
        Error::Context {
            what: what.into(),
            source: Box::new(self),
        }
    }
}

/// A value from outside that the validation layer refuses: `input` names it (a parameter, a
/// field, a token position), `value` is what was given, `allowed` says what would be accepted.
pub(crate) fn invalid(input: &str, value: impl std::fmt::Display, allowed: &str) -> Error {
    Error::Params(format!("{input} is {value}, {allowed}"))
}

/// A contract violation, for `Err(contract(..))`.
pub(crate) fn contract(message: impl Into<String>) -> Error {
    Error::Contract(message.into())
}
