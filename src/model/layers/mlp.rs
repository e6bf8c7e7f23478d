//! The gated MLP and the activations it gates with.

use mlx::{compiled, Array, Result};

use super::Linear;
use crate::load::{LoadResult, QuantConfig, Weights};

/// The gated MLPs: `down(act(gate(x)) * up(x))`.
pub struct GatedMlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    pub activation: Activation,
}

#[derive(Clone, Copy, Debug)]
pub enum Activation {
    /// mlx-lm's compiled `swiglu(gate, x)`.
    Swiglu,
    /// `nn.gelu_approx(gate) * x` (gemma).
    GeluApprox,
    /// gemma4_text's compiled `geglu(gate, x)`: the same expression fused into one graph.
    Geglu,
}

impl Activation {
    /// The gated activation of `gate` and `up`.
    pub fn apply(self, gate: &Array, up: &Array) -> Result<Array> {
        match self {
            Activation::Swiglu => compiled::swiglu(gate, up),
            Activation::GeluApprox => compiled::gelu_approx(gate)?.multiply(up),
            Activation::Geglu => compiled::geglu(gate, up),
        }
    }
}

impl GatedMlp {
    pub fn load(
        w: &mut Weights,
        q: &QuantConfig,
        path: &str,
        dims: i32,
        hidden: i32,
        bias: bool,
        activation: Activation,
    ) -> LoadResult<GatedMlp> {
        Ok(GatedMlp {
            gate_proj: Linear::load(w, q, &format!("{path}.gate_proj"), dims, hidden, bias)?,
            up_proj: Linear::load(w, q, &format!("{path}.up_proj"), dims, hidden, bias)?,
            down_proj: Linear::load(w, q, &format!("{path}.down_proj"), hidden, dims, bias)?,
            activation,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let gate = self.gate_proj.forward(x)?;
        let up = self.up_proj.forward(x)?;
        self.down_proj.forward(&self.activation.apply(&gate, &up)?)
    }
}
