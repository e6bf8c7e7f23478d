//! Weight quantization settings, resolved per module the way mlx_lm.utils.load_model's
//! class_predicate resolves them.

use serde_json::{Map, Value};

use super::{Config, LoadError, Weights};

/// How one layer's weight is packed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantParams {
    pub group_size: i32,
    pub bits: i32,
    pub mode: String,
}

impl QuantParams {
    fn describe(&self) -> String {
        format!(
            "bits {}, group_size {}, mode {}",
            self.bits, self.group_size, self.mode
        )
    }
}

/// config.json's `quantization` block: defaults plus per-module overrides.
#[derive(Clone, Debug, Default)]
pub struct QuantConfig {
    block: Option<Map<String, Value>>,
}

/// Bits and group sizes mlx's quantized kernels support.
const QUANT_BITS: &[i64] = &[2, 3, 4, 5, 6, 8];
const QUANT_GROUP_SIZES: &[i64] = &[16, 32, 64, 128];

impl QuantConfig {
    /// Reads `quantization` from the config (absent: nothing is quantized).
    pub fn from_config(config: &Config) -> Result<QuantConfig, LoadError> {
        match config.json.get("quantization") {
            None | Some(Value::Null) => {
                if let Some(q) = config.json.get("quantization_config") {
                    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
                    return Err(config.error(format!(
                        "quantization_config with quant_method {method:?} is not supported; \
                         convert the model with mlx_lm.convert"
                    )));
                }
                Ok(QuantConfig { block: None })
            }
            Some(Value::Object(map)) => {
                for (key, allowed) in [("bits", QUANT_BITS), ("group_size", QUANT_GROUP_SIZES)] {
                    if let Some(v) = map.get(key) {
                        if !v.as_i64().is_some_and(|n| allowed.contains(&n)) {
                            return Err(config.error(format!(
                                "quantization.{key} is {v}, must be one of {allowed:?}"
                            )));
                        }
                    }
                }
                Ok(QuantConfig {
                    block: Some(map.clone()),
                })
            }
            Some(_) => Err(config.error("\"quantization\" must be an object")),
        }
    }

    /// The packing of the module at `path` (e.g. `model.layers.0.mlp.up_proj`) whose
    /// unquantized weight has `in_dims` inputs, or None when it is stored unquantized.
    pub fn for_module(
        &self,
        path: &str,
        in_dims: i32,
        weights: &Weights,
    ) -> Result<Option<QuantParams>, LoadError> {
        let Some(block) = &self.block else {
            return Ok(None);
        };
        let declared = match block.get(path) {
            Some(Value::Bool(false)) => return Ok(None),
            Some(Value::Object(o)) => Some(explicit(o, block, path, weights)?),
            Some(Value::Bool(true)) | None => None,
            Some(_) => {
                return Err(weights.config_error(format!("quantization.{path} is malformed")))
            }
        };
        let Some(scales) = weights.peek(&format!("{path}.scales")) else {
            return match declared {
                Some(_) => Err(weights.missing(&format!("{path}.scales"))),
                None => Ok(None),
            };
        };
        let stored = stored_packing(path, in_dims, scales, weights)?;
        let Some(declared) = declared else {
            for (key, inferred) in [("bits", stored.bits), ("group_size", stored.group_size)] {
                let declared = block.get(key).and_then(Value::as_i64);
                if stored.mode == "affine" && declared.is_some_and(|d| d != inferred as i64) {
                    return Err(weights.config_error(format!(
                        "quantization.{key} is {}, but {path} is stored with {key} {inferred}",
                        declared.unwrap_or_default()
                    )));
                }
            }
            return Ok(Some(stored));
        };
        // MLX checks these shapes only inside quantized_matmul, at the first forward.
        if declared != stored {
            return Err(weights.config_error(format!(
                "quantization.{path} declares {}, but {path} is stored as {}",
                declared.describe(),
                stored.describe()
            )));
        }
        Ok(Some(declared))
    }
}

/// The packing `path`'s stored weight and scales imply for `in_dims` inputs.
fn stored_packing(
    path: &str,
    in_dims: i32,
    scales: &mlx::Array,
    weights: &Weights,
) -> Result<QuantParams, LoadError> {
    let weight = weights
        .peek(&format!("{path}.weight"))
        .ok_or_else(|| weights.missing(&format!("{path}.weight")))?;
    let groups = scales.dim(-1);
    if groups <= 0 || in_dims % groups != 0 {
        return Err(weights.config_error(format!("{path}.scales does not divide {in_dims} inputs")));
    }
    let group_size = in_dims / groups;
    if !QUANT_GROUP_SIZES.contains(&(group_size as i64)) {
        return Err(weights.config_error(format!(
            "{path}.scales holds {groups} groups per row of {in_dims} inputs: group size \
             {group_size}, not one of {QUANT_GROUP_SIZES:?}"
        )));
    }
    let bits = weight.dim(-1) * 32 / in_dims;
    if weight.dim(-1) * 32 != bits * in_dims || !QUANT_BITS.contains(&(bits as i64)) {
        return Err(weights.config_error(format!(
            "{path}.weight packs {} uint32 words per row for {in_dims} inputs, which is no bit \
             width in {QUANT_BITS:?}",
            weight.dim(-1)
        )));
    }
    let mode = if scales.dtype() != mlx::Dtype::Uint8 {
        "affine"
    } else {
        match (bits, group_size) {
            (4, 16) => "nvfp4",
            (4, 32) => "mxfp4",
            (8, 32) => "mxfp8",
            _ => {
                return Err(weights.config_error(format!(
                    "cannot infer the quantization mode of {path}: {bits} bits, group size {group_size}"
                )))
            }
        }
    };
    Ok(QuantParams {
        group_size,
        bits,
        mode: mode.into(),
    })
}

fn explicit(
    o: &Map<String, Value>,
    block: &Map<String, Value>,
    path: &str,
    weights: &Weights,
) -> Result<QuantParams, LoadError> {
    let int = |key: &str| {
        o.get(key)
            .or_else(|| block.get(key))
            .and_then(Value::as_i64)
            .map(|v| v as i32)
            .ok_or_else(|| weights.config_error(format!("quantization.{path} lacks {key}")))
    };
    let mode = o
        .get("mode")
        .or_else(|| block.get("mode"))
        .and_then(Value::as_str)
        .unwrap_or("affine");
    Ok(QuantParams {
        group_size: int("group_size")?,
        bits: int("bits")?,
        mode: mode.into(),
    })
}
