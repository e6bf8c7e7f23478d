//! Reading an mlx-lm style model folder: config.json (+ generation_config.json), the
//! safetensors weights, and the quantization config. Every error names the file and the key.

mod config;
mod quant;
mod weights;

pub use config::{load_config, Config};
pub use quant::{QuantConfig, QuantParams};
pub use weights::Weights;

use std::path::PathBuf;

/// What loading a model folder gives: the value, or the error naming the file and key.
pub type LoadResult<T> = Result<T, LoadError>;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}: no such model folder")]
    MissingFolder(PathBuf),
    #[error("{0}: missing (every model folder needs a config.json)")]
    MissingConfig(PathBuf),
    #[error("{path}: {message}")]
    BadConfig { path: PathBuf, message: String },
    #[error("{path}: unknown model_type {model_type:?} (verity knows: {known})")]
    UnknownModelType {
        path: PathBuf,
        model_type: String,
        known: String,
    },
    #[error("{0}: no model*.safetensors weight files")]
    NoWeights(PathBuf),
    #[error("{path}: not a valid safetensors file: {message}")]
    BadSafetensors { path: PathBuf, message: String },
    /// A weight file MLX cannot load; the message names it.
    #[error(transparent)]
    Weights(mlx::Error),
    #[error("{path}: tensor {key} {problem}")]
    BadTensor {
        path: PathBuf,
        key: String,
        problem: String,
    },
    #[error("{folder}: missing tensor {key}")]
    MissingTensor { folder: PathBuf, key: String },
    #[error("{folder}: tensor {key} has shape {found:?}, the config implies {expected:?}")]
    TensorShape {
        folder: PathBuf,
        key: String,
        expected: Vec<i32>,
        found: Vec<i32>,
    },
    #[error("{folder}: tensor {key} is {dtype}, must be {allowed}")]
    TensorDtype {
        folder: PathBuf,
        key: String,
        dtype: String,
        allowed: &'static str,
    },
    #[error("{folder}: unexpected tensors the model does not use: {keys}")]
    UnexpectedTensors { folder: PathBuf, keys: String },
    #[error("{folder}: MLX: {source}")]
    Mlx { folder: PathBuf, source: mlx::Error },
}
