//! Fixture model folders whose weights are derived rather than shipped. Such a folder holds a
//! `derivation.json` next to its config and tokenizer files, and no weights: the noisy copies of
//! qwen3-target (oracles/derive_trained.py) are the target plus seeded Gaussian noise, so
//! shipping their 3.7 MB each would only spend golden/'s size budget on bytes any checkout can
//! recompute. Before such a folder is opened, its weights are recomputed here with the oracle's
//! exact MLX graph, on the CPU, into `<root>/target/derived-models/<name>/` (a loadable copy of
//! the folder), and the file's sha256 must equal the line golden/models/SHA256SUMS keeps for
//! `models/<name>/model.safetensors`. Same libmlx build, same graph, same backend: same bits,
//! and the hash proves it on every checkout (docs/goldens.md, "Derived fixtures").
//!
//! Concurrent test processes may materialise the same folder at once: every file is written
//! whole through a temporary file and a rename, and all writers write the same bytes.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use mlx::{Array, Device, Dtype};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The file that marks a folder as derived and says how.
pub const DERIVATION: &str = "derivation.json";

/// Where materialised copies live, relative to the repository root (ignored by git, kept
/// between runs).
pub const CACHE: &str = "target/derived-models";

/// The weights file a derived folder stands for.
const WEIGHTS: &str = "model.safetensors";

/// The one derivation verity knows, word for word as derive_trained.py records it: another
/// method must not be silently computed as this one.
const NOISE_METHOD: &str = "per tensor, sorted by name: w + sigma*std(w)*N(0,1), \
                            key = mx.random.split chain from mx.random.key(seed)";

#[derive(Debug, thiserror::Error)]
pub enum DerivedError {
    /// derivation.json is unreadable, not the expected JSON, or has a value out of range; the
    /// message names the field and its value.
    #[error("{path}: {message}")]
    BadDerivation { path: PathBuf, message: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    /// SHA256SUMS has no line for the derived weights, so nothing could vouch for them.
    #[error("{sums}: no sha256 listed for {key}, which the derived weights are checked against")]
    NotListed { sums: PathBuf, key: String },
    #[error("deriving {path}: MLX failed: {source}")]
    Mlx { path: PathBuf, source: mlx::Error },
    /// The recomputed weights are not the recorded ones (a different libmlx build or backend,
    /// changed source weights, or a stale SHA256SUMS); nothing is written.
    #[error(
        "{path}: derived weights have sha256 {got}, but {sums} lists {want}; \
         the derivation does not reproduce the recorded fixture"
    )]
    Mismatch {
        path: PathBuf,
        sums: PathBuf,
        got: String,
        want: String,
    },
}

/// A derived folder's derivation.json.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Derivation {
    /// The sibling fixture folder whose weights are perturbed.
    source: String,
    /// The noise scale, relative to each tensor's standard deviation.
    sigma: f64,
    /// The seed of the MLX key chain.
    seed: u64,
    method: String,
}

/// The folder `dir` as it can be loaded: `dir` itself, or, when it holds a derivation.json,
/// its materialised copy under `cache` (created or repaired here, and always verified).
pub fn resolve(dir: &Path, cache: &Path) -> Result<PathBuf, DerivedError> {
    if !dir.join(DERIVATION).exists() {
        return Ok(dir.to_path_buf());
    }
    materialise(dir, cache)
}

/// Makes `<cache>/<name>/` a loadable copy of the derived folder `dir`: its files, and the
/// derived weights verified against SHA256SUMS. A copy already there is kept only if its hash
/// is the listed one.
fn materialise(dir: &Path, cache: &Path) -> Result<PathBuf, DerivedError> {
    let spec_path = dir.join(DERIVATION);
    let derivation = read_derivation(&spec_path)?;
    let Some(name) = dir.file_name() else {
        return Err(DerivedError::BadDerivation {
            path: spec_path,
            message: "its folder must be named by a path that ends in the folder's name".into(),
        });
    };
    let source = source_weights(dir, &spec_path, &derivation)?;
    let (sums, want) = listed_hash(dir)?;
    let out = cache.join(name);
    fs::create_dir_all(&out).map_err(|source| DerivedError::Io {
        path: out.clone(),
        source,
    })?;
    copy_files(dir, &out)?;
    let weights = out.join(WEIGHTS);
    if weights.is_file() && sha256_of(&weights)? == want {
        return Ok(out);
    }
    let tensors =
        on_cpu(|| noisy_copy(&source, &derivation)).map_err(|source| DerivedError::Mlx {
            path: weights.clone(),
            source,
        })?;
    let metadata = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
    let mut got = None;
    let written = verity_harness::atomic::write_with(&weights, "", |tmp| {
        mlx::io::save_safetensors(tmp, &tensors, &metadata).map_err(io::Error::other)?;
        let hash = format!("{:x}", Sha256::digest(fs::read(tmp)?));
        let matches = hash == want;
        got = Some(hash);
        // Failing here removes the temporary file: a mismatch never becomes the cached copy.
        match matches {
            true => Ok(()),
            false => Err(io::Error::other("hash mismatch")),
        }
    });
    match (written, got) {
        (Ok(()), _) => Ok(out),
        (Err(_), Some(got)) if got != want => Err(DerivedError::Mismatch {
            path: weights,
            sums,
            got,
            want,
        }),
        (Err(source), _) => Err(DerivedError::Io {
            path: weights,
            source,
        }),
    }
}

fn read_derivation(path: &Path) -> Result<Derivation, DerivedError> {
    let bad = |message: String| DerivedError::BadDerivation {
        path: path.to_path_buf(),
        message,
    };
    let text = fs::read(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    let d: Derivation = serde_json::from_slice(&text).map_err(|e| {
        bad(format!(
            "not a derivation (source, sigma, seed, method): {e}"
        ))
    })?;
    if !(d.sigma.is_finite() && d.sigma > 0.0) {
        return Err(bad(format!(
            "sigma is {}, must be a finite number above 0",
            d.sigma
        )));
    }
    if d.method != NOISE_METHOD {
        return Err(bad(format!(
            "method is {:?}; verity derives only {NOISE_METHOD:?}",
            d.method
        )));
    }
    Ok(d)
}

/// The weights of the derivation's source: a sibling folder that ships its own.
fn source_weights(dir: &Path, spec: &Path, d: &Derivation) -> Result<PathBuf, DerivedError> {
    let plain = !d.source.is_empty()
        && d.source != "."
        && d.source != ".."
        && !d.source.contains(['/', '\\']);
    let weights = dir.with_file_name(&d.source).join(WEIGHTS);
    if !plain || !weights.is_file() {
        return Err(DerivedError::BadDerivation {
            path: spec.to_path_buf(),
            message: format!(
                "source is {:?}, must name a fixture folder beside it that has a {WEIGHTS}",
                d.source
            ),
        });
    }
    Ok(weights)
}

/// SHA256SUMS beside the fixture folders, and its hash of `dir`'s weights (listed by the path
/// relative to golden/, as `models/<name>/model.safetensors`).
fn listed_hash(dir: &Path) -> Result<(PathBuf, String), DerivedError> {
    let models = dir.parent().unwrap_or(Path::new("."));
    let sums = models.join("SHA256SUMS");
    let key = format!(
        "{}/{}/{WEIGHTS}",
        models.file_name().unwrap_or_default().to_string_lossy(),
        dir.file_name().unwrap_or_default().to_string_lossy()
    );
    let text = fs::read_to_string(&sums).map_err(|source| DerivedError::Io {
        path: sums.clone(),
        source,
    })?;
    let want = text
        .lines()
        .filter_map(|l| l.split_once("  "))
        .find(|(_, path)| *path == key)
        .map(|(hash, _)| hash.to_string());
    match want {
        Some(want) => Ok((sums, want)),
        None => Err(DerivedError::NotListed { sums, key }),
    }
}

/// Copies every file of `dir` into `out` where `out` lacks it or holds other bytes.
fn copy_files(dir: &Path, out: &Path) -> Result<(), DerivedError> {
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DerivedError::Io { path, source }
    };
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let from = entry.map_err(io_err(dir))?.path();
        if !from.is_file() {
            continue;
        }
        let to = out.join(from.file_name().expect("a directory entry has a name"));
        let bytes = fs::read(&from).map_err(io_err(&from))?;
        if fs::read(&to).ok().as_deref() != Some(&bytes[..]) {
            verity_harness::atomic::write(&to, &bytes).map_err(io_err(&to))?;
        }
    }
    Ok(())
}

/// derive_trained.py's `noisy_copy`, op for op: per tensor in name order, with the next key of
/// the split chain, `(w + sigma * std(w) * normal(w.shape)).astype(w.dtype)`. `sigma` meets
/// `std(w)` as Python's float does (a weak scalar in std's dtype), and the noise is float32.
fn noisy_copy(source: &Path, d: &Derivation) -> mlx::Result<BTreeMap<String, Array>> {
    let weights = mlx::io::load_safetensors(source)?.tensors;
    let mut key = mlx::random::key(d.seed)?;
    let mut out = BTreeMap::new();
    for (name, w) in weights {
        let (next, sub) = mlx::random::split_pair(&key)?;
        key = next;
        let noise = mlx::random::normal(&w.shape(), Dtype::Float32, &sub)?;
        let scale = w.std(&[], false)?.multiply_scalar(d.sigma as f32)?;
        let noisy = w.add(&scale.multiply(&noise)?)?.astype(w.dtype())?;
        out.insert(name, noisy);
    }
    mlx::eval(out.values())?;
    Ok(out)
}

/// Runs `f` with the CPU as MLX's default device, as the oracle built the fixtures, then puts
/// the caller's device back: a GPU's kernels would round differently.
fn on_cpu<T>(f: impl FnOnce() -> mlx::Result<T>) -> mlx::Result<T> {
    let before = mlx::default_device();
    mlx::set_default_device(Device::Cpu)?;
    let result = f();
    mlx::set_default_device(before)?;
    result
}

fn sha256_of(path: &Path) -> Result<String, DerivedError> {
    let bytes = fs::read(path).map_err(|source| DerivedError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(format!("{:x}", Sha256::digest(bytes)))
}
