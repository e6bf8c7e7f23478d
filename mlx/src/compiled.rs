//! Functions traced once with `mx::compile` in the shim, each a literal copy of a function that
//! mlx-lm or mlx.nn wraps in `mx.compile`. Fused kernels may round differently from the same ops
//! unfused (FMA contraction on AVX2 builds, parity-feasibility.md G4), so verity takes the same
//! compiled path Python takes rather than relying on the two agreeing.

use crate::array::List;
use crate::ffi::bridge::{self as ffi, Kernel};
use crate::{Array, Error, Result};

fn call(kernel: Kernel, inputs: &[&Array]) -> Result<Array> {
    let out = List::from_raw(ffi::call_kernel(
        kernel,
        &List::new(inputs.iter().copied()).raw,
    )?);
    out.into_vec()?
        .into_iter()
        .next()
        .ok_or_else(|| Error::Invalid("compiled kernel returned nothing".into()))
}

/// `mlx.nn.silu`: `x * sigmoid(x)`.
pub fn silu(x: &Array) -> Result<Array> {
    call(Kernel::Silu, &[x])
}

/// `mlx_lm.models.activations.swiglu`: `silu(gate) * x`.
pub fn swiglu(gate: &Array, x: &Array) -> Result<Array> {
    call(Kernel::Swiglu, &[gate, x])
}

/// `mlx.nn.gelu_approx`: `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`.
pub fn gelu_approx(x: &Array) -> Result<Array> {
    call(Kernel::GeluApprox, &[x])
}

/// `mlx.nn.softplus`: `logaddexp(x, 0)`.
pub fn softplus(x: &Array) -> Result<Array> {
    call(Kernel::Softplus, &[x])
}

/// `mlx.nn.sigmoid` (the compiled module function, not `mx.sigmoid`).
pub fn sigmoid(x: &Array) -> Result<Array> {
    call(Kernel::Sigmoid, &[x])
}
