//! The model dimensions every family reads from config.json: a file of their own because the
//! attention, block and outer loaders take them as well as every family's config.

use serde::Deserialize;

/// The dimensions every family reads from config.json, under mlx-lm's names. They are checked
/// as they are read (every count at least 1, the heads dividing as the reshapes need, a
/// positive finite norm epsilon), so no family divides by zero or builds a NaN norm from them.
#[derive(Clone, Debug, Deserialize)]
#[serde(try_from = "RawDims")]
pub struct Dims {
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: Option<i32>,
    pub head_dim: Option<i32>,
    pub rms_norm_eps: f64,
    pub vocab_size: i32,
    pub tie_word_embeddings: Option<bool>,
}

/// [`Dims`] as config.json spells them, before the checks.
#[derive(Deserialize)]
struct RawDims {
    hidden_size: i32,
    num_hidden_layers: usize,
    intermediate_size: i32,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    head_dim: Option<i32>,
    rms_norm_eps: f64,
    vocab_size: i32,
    tie_word_embeddings: Option<bool>,
}

impl TryFrom<RawDims> for Dims {
    type Error = String;

    fn try_from(r: RawDims) -> Result<Dims, String> {
        let at_least_one = [
            ("hidden_size", i64::from(r.hidden_size)),
            ("num_hidden_layers", r.num_hidden_layers as i64),
            ("intermediate_size", i64::from(r.intermediate_size)),
            ("num_attention_heads", i64::from(r.num_attention_heads)),
            ("vocab_size", i64::from(r.vocab_size)),
        ];
        let optional = [
            ("num_key_value_heads", r.num_key_value_heads),
            ("head_dim", r.head_dim),
        ];
        let given = optional
            .iter()
            .filter_map(|&(k, v)| v.map(|v| (k, i64::from(v))));
        if let Some((key, v)) = at_least_one.into_iter().chain(given).find(|&(_, v)| v < 1) {
            return Err(format!("{key} is {v}, must be at least 1"));
        }
        let kv_heads = r.num_key_value_heads.unwrap_or(r.num_attention_heads);
        if r.num_attention_heads % kv_heads != 0 {
            return Err(format!(
                "num_key_value_heads is {kv_heads}, must divide num_attention_heads ({})",
                r.num_attention_heads
            ));
        }
        if r.head_dim.is_none() && r.hidden_size % r.num_attention_heads != 0 {
            return Err(format!(
                "num_attention_heads is {}, must divide hidden_size ({}) when head_dim is not given",
                r.num_attention_heads, r.hidden_size
            ));
        }
        if !(r.rms_norm_eps.is_finite() && r.rms_norm_eps > 0.0) {
            return Err(format!(
                "rms_norm_eps is {}, must be a finite number > 0",
                r.rms_norm_eps
            ));
        }
        Ok(Dims {
            hidden_size: r.hidden_size,
            num_hidden_layers: r.num_hidden_layers,
            intermediate_size: r.intermediate_size,
            num_attention_heads: r.num_attention_heads,
            num_key_value_heads: r.num_key_value_heads,
            head_dim: r.head_dim,
            rms_norm_eps: r.rms_norm_eps,
            vocab_size: r.vocab_size,
            tie_word_embeddings: r.tie_word_embeddings,
        })
    }
}

impl Dims {
    /// `head_dim`, or `hidden_size // num_attention_heads` where the config leaves it out.
    pub fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// `num_key_value_heads`, or one per attention head where the config leaves it out.
    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
}
