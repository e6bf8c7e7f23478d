//! config.json, read the way mlx-lm's load_config reads it.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::LoadError;

/// A model's config.json with generation_config.json's eos_token_id folded in (as
/// mlx_lm.utils.load_config does), plus the folder it came from for error messages.
#[derive(Clone, Debug)]
pub struct Config {
    pub path: PathBuf,
    pub json: Map<String, Value>,
}

/// Reads `<dir>/config.json` and `<dir>/generation_config.json` if present.
pub fn load_config(dir: &Path) -> Result<Config, LoadError> {
    if !dir.is_dir() {
        return Err(LoadError::MissingFolder(dir.to_path_buf()));
    }
    let path = dir.join("config.json");
    if !path.is_file() {
        return Err(LoadError::MissingConfig(path));
    }
    let mut json = read_object(&path)?;
    let generation = dir.join("generation_config.json");
    if generation.is_file() {
        // mlx-lm ignores a generation config it cannot parse; so do we.
        if let Ok(g) = read_object(&generation) {
            if let Some(eos) = g.get("eos_token_id").filter(|v| !v.is_null()) {
                json.insert("eos_token_id".into(), eos.clone());
            }
        }
    }
    Ok(Config { path, json })
}

fn read_object(path: &Path) -> Result<Map<String, Value>, LoadError> {
    let bad = |message: String| LoadError::BadConfig {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    match serde_json::from_str::<Value>(&text).map_err(|e| bad(format!("invalid JSON: {e}")))? {
        Value::Object(map) => Ok(map),
        _ => Err(bad("expected a JSON object".into())),
    }
}

impl Config {
    /// The `model_type`.
    pub fn model_type(&self) -> Result<&str, LoadError> {
        self.json
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| self.error("no \"model_type\""))
    }

    pub fn error(&self, message: impl Into<String>) -> LoadError {
        LoadError::BadConfig {
            path: self.path.clone(),
            message: message.into(),
        }
    }

    /// Deserializes the config into a model's argument struct, naming the file on failure.
    /// Keys the config lacks are taken from `defaults` (a JSON object of the Python dataclass's
    /// defaults, or `{}` where every argument is required).
    pub fn args<T: DeserializeOwned>(&self, defaults: Value) -> Result<T, LoadError> {
        self.deserialize(self.json.clone(), defaults, "")
    }

    /// Like [`Config::args`], on `text_config` when the config nests one (vision-language
    /// checkpoints such as qwen3_5), else on the whole config.
    pub fn text_args<T: DeserializeOwned>(&self, defaults: Value) -> Result<T, LoadError> {
        match self.json.get("text_config") {
            Some(Value::Object(text)) => self.deserialize(text.clone(), defaults, "text_config."),
            _ => self.args(defaults),
        }
    }

    /// Deserializes `args` (completed from `defaults`); a value of the wrong type is named by
    /// its key path, `prefix` first.
    fn deserialize<T: DeserializeOwned>(
        &self,
        mut args: Map<String, Value>,
        defaults: Value,
        prefix: &str,
    ) -> Result<T, LoadError> {
        if let Value::Object(defaults) = defaults {
            for (key, value) in defaults {
                args.entry(key).or_insert(value);
            }
        }
        let object = Value::Object(args.clone());
        serde_path_to_error::deserialize(object).map_err(|e| {
            let path = e.path().to_string();
            let message = e.into_inner().to_string();
            let key = match path.as_str() {
                "." => culprit::<T>(&args, &message),
                _ => Some(path),
            };
            self.error(match key {
                Some(key) => format!("bad model arguments: {prefix}{key}: {message}"),
                None => format!("bad model arguments: {message}"),
            })
        })
    }

    /// The EOS token ids the config names (an int or a list), in order.
    pub fn eos_token_ids(&self) -> Result<Vec<u32>, LoadError> {
        let bad = || self.error("eos_token_id must be an integer or a list of integers");
        match self.json.get("eos_token_id") {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Number(n)) => Ok(vec![n.as_u64().ok_or_else(bad)? as u32]),
            Some(Value::Array(list)) => list
                .iter()
                .map(|v| v.as_u64().map(|n| n as u32).ok_or_else(bad))
                .collect(),
            Some(_) => Err(bad()),
        }
    }
}

/// The key a type error is about, when serde could not say: inside a `#[serde(flatten)]` field
/// (the model argument structs flatten their shared dimensions) the path is lost. A type error
/// is raised while the bad key is visited, so it is the one key whose removal changes the error.
fn culprit<T: DeserializeOwned>(args: &Map<String, Value>, message: &str) -> Option<String> {
    args.keys()
        .find(|key| {
            let mut without = args.clone();
            without.remove(*key);
            serde_json::from_value::<T>(Value::Object(without))
                .map_or_else(|e| e.to_string() != message, |_| true)
        })
        .cloned()
}
