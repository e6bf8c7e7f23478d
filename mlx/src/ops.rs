//! `mlx::core` operations. Free functions follow mlx-rs's names; the most used ones are also
//! methods on [`Array`] so a model reads like its Python original.
//!
//! Scalars: Python MLX gives a Python float the dtype of the array it meets ("weak" typing).
//! [`scalar_like`] reproduces that, and the `*_scalar` helpers use it, so `x * 0.5` here rounds
//! exactly as `x * 0.5` does in mlx-lm.

use crate::array::List;
use crate::ffi::bridge::{self as ffi, BinaryOp, ReduceOp, UnaryOp};
use crate::{Array, Dtype, Result};

pub(crate) fn wrap(
    r: std::result::Result<cxx::UniquePtr<ffi::Array>, cxx::Exception>,
) -> Result<Array> {
    Ok(Array::wrap(r?))
}

/// An optional array as the shim takes it: a raw pointer, null when absent.
pub(crate) fn ptr(a: Option<&Array>) -> *const ffi::Array {
    a.map_or(std::ptr::null(), |a| a.ffi() as *const ffi::Array)
}

/// A 0-d array holding `value` typed as Python MLX types a Python float next to `like`: in
/// `like`'s dtype when that is floating, else float32.
pub fn scalar_like(value: f32, like: &Array) -> Result<Array> {
    let dtype = like.dtype();
    Array::scalar(
        value,
        if dtype.is_floating() {
            dtype
        } else {
            Dtype::Float32
        },
    )
}

macro_rules! unary_ops {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(
            #[doc = concat!("`mx.", stringify!($name), "`")]
            pub fn $name(a: &Array) -> Result<Array> {
                wrap(ffi::unary(UnaryOp::$op, a.ffi()))
            }
        )*
        impl Array {
            $(
                #[doc = concat!("`mx.", stringify!($name), "`")]
                pub fn $name(&self) -> Result<Array> {
                    $name(self)
                }
            )*
        }
    };
}

unary_ops! {
    negative => Negative, abs => Abs, exp => Exp, expm1 => Expm1, log => Log, log1p => Log1p,
    sqrt => Sqrt, rsqrt => Rsqrt, square => Square, reciprocal => Reciprocal,
    sigmoid => Sigmoid, tanh => Tanh, sin => Sin, cos => Cos, erf => Erf, floor => Floor,
    ceil => Ceil, round => Round, sign => Sign, logical_not => LogicalNot, isnan => IsNan,
    stop_gradient => StopGradient, contiguous => Contiguous,
}

macro_rules! binary_ops {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(
            #[doc = concat!("`mx.", stringify!($name), "` (broadcasting)")]
            pub fn $name(a: &Array, b: &Array) -> Result<Array> {
                wrap(ffi::binary(BinaryOp::$op, a.ffi(), b.ffi()))
            }
        )*
        impl Array {
            $(
                #[doc = concat!("`mx.", stringify!($name), "` (broadcasting)")]
                pub fn $name(&self, other: &Array) -> Result<Array> {
                    $name(self, other)
                }
            )*
        }
    };
}

binary_ops! {
    add => Add, subtract => Subtract, multiply => Multiply, divide => Divide, power => Power,
    maximum => Maximum, minimum => Minimum, remainder => Remainder,
    floor_divide => FloorDivide, logaddexp => LogAddExp, equal => Equal,
    not_equal => NotEqual, less => Less, less_equal => LessEqual, greater => Greater,
    greater_equal => GreaterEqual, logical_and => LogicalAnd, logical_or => LogicalOr,
    matmul => Matmul,
}

macro_rules! reductions {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(
            #[doc = concat!("`mx.", stringify!($name), "` over `axes` (empty: all axes)")]
            pub fn $name(a: &Array, axes: &[i32], keepdims: bool) -> Result<Array> {
                wrap(ffi::reduce(ReduceOp::$op, a.ffi(), axes, keepdims))
            }
        )*
        impl Array {
            $(
                #[doc = concat!("`mx.", stringify!($name), "` over `axes` (empty: all axes)")]
                pub fn $name(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
                    $name(self, axes, keepdims)
                }
            )*
        }
    };
}

reductions! {
    sum => Sum, mean => Mean, prod => Prod, max => Max, min => Min, logsumexp => LogSumExp,
    all => All, any => Any, std => Std,
}

macro_rules! scalar_ops {
    ($($name:ident => $op:ident),* $(,)?) => {
        impl Array {
            $(
                #[doc = concat!("`", stringify!($op), "` with a weakly typed Python-style scalar")]
                pub fn $name(&self, value: f32) -> Result<Array> {
                    $op(self, &scalar_like(value, self)?)
                }
            )*
        }
    };
}

scalar_ops! {
    add_scalar => add, subtract_scalar => subtract, multiply_scalar => multiply,
    divide_scalar => divide, power_scalar => power, maximum_scalar => maximum,
    minimum_scalar => minimum,
}

pub fn argmax(a: &Array, axis: i32, keepdims: bool) -> Result<Array> {
    wrap(ffi::argmax(a.ffi(), axis, keepdims))
}

pub fn argmin(a: &Array, axis: i32, keepdims: bool) -> Result<Array> {
    wrap(ffi::argmin(a.ffi(), axis, keepdims))
}

/// `mx.where(cond, x, y)`.
pub fn r#where(cond: &Array, x: &Array, y: &Array) -> Result<Array> {
    wrap(ffi::where_(cond.ffi(), x.ffi(), y.ffi()))
}

/// `mx.clip(a, lo, hi)`; either bound may be absent.
pub fn clip(a: &Array, lo: Option<&Array>, hi: Option<&Array>) -> Result<Array> {
    // SAFETY: the pointers are null or borrowed from live arrays for the call's duration.
    wrap(unsafe { ffi::clip(a.ffi(), ptr(lo), ptr(hi)) })
}

/// `mx.softmax(a, axes, precise)`.
pub fn softmax(a: &Array, axes: &[i32], precise: bool) -> Result<Array> {
    wrap(ffi::softmax(a.ffi(), axes, precise))
}

/// `mx.cumsum(a, axis, reverse, inclusive)`.
pub fn cumsum(a: &Array, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
    wrap(ffi::cumsum(a.ffi(), axis, reverse, inclusive))
}

/// `mx.addmm(c, a, b, alpha, beta)` = alpha * (a @ b) + beta * c.
pub fn addmm(c: &Array, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
    wrap(ffi::addmm(c.ffi(), a.ffi(), b.ffi(), alpha, beta))
}

/// `mx.concatenate(arrays, axis)`.
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    wrap(ffi::concatenate(
        &List::new(arrays.iter().copied()).raw,
        axis,
    ))
}

/// `mx.depends([input], [dependency])[0]`: `input` itself, scheduled only after `dependency`
/// has been computed. It orders work inside one evaluation without a host round trip.
pub fn depends(input: &Array, dependency: &Array) -> Result<Array> {
    wrap(ffi::depends(input.ffi(), dependency.ffi()))
}

/// `mx.stack(arrays, axis)`.
pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    wrap(ffi::stack(&List::new(arrays.iter().copied()).raw, axis))
}

/// `mx.split(a, indices, axis)` at the given section boundaries.
pub fn split_sections(a: &Array, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
    List::from_raw(ffi::split_sections(a.ffi(), indices, axis)?).into_vec()
}

/// `mx.split(a, parts, axis)` into equal parts.
pub fn split(a: &Array, parts: i32, axis: i32) -> Result<Vec<Array>> {
    List::from_raw(ffi::split_equal(a.ffi(), parts, axis)?).into_vec()
}

/// `mx.pad(a, [(low, high) per axis], constant_values=value)` on the listed axes.
pub fn pad(a: &Array, axes: &[i32], low: &[i32], high: &[i32], value: &Array) -> Result<Array> {
    wrap(ffi::pad(a.ffi(), axes, low, high, value.ffi()))
}

/// `mx.take_along_axis(a, indices, axis)`.
pub fn take_along_axis(a: &Array, indices: &Array, axis: i32) -> Result<Array> {
    wrap(ffi::take_along_axis(a.ffi(), indices.ffi(), axis))
}

/// `mx.put_along_axis(a, indices, values, axis)`.
pub fn put_along_axis(a: &Array, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
    wrap(ffi::put_along_axis(
        a.ffi(),
        indices.ffi(),
        values.ffi(),
        axis,
    ))
}

/// `mx.scatter(a, indices, updates, axes)`: what Python's `a[idx] = updates` lowers to.
pub fn scatter(a: &Array, indices: &[&Array], updates: &Array, axes: &[i32]) -> Result<Array> {
    let list = List::new(indices.iter().copied());
    wrap(ffi::scatter(a.ffi(), &list.raw, updates.ffi(), axes, false))
}

/// `mx.scatter_add(a, indices, updates, axes)`: what `a.at[idx].add(updates)` lowers to.
pub fn scatter_add(a: &Array, indices: &[&Array], updates: &Array, axes: &[i32]) -> Result<Array> {
    let list = List::new(indices.iter().copied());
    wrap(ffi::scatter(a.ffi(), &list.raw, updates.ffi(), axes, true))
}

/// `mx.sort(a, axis)` (ascending, stable).
pub fn sort(a: &Array, axis: i32) -> Result<Array> {
    wrap(ffi::sort(a.ffi(), axis))
}

/// `mx.argsort(a, axis)` (stable).
pub fn argsort(a: &Array, axis: i32) -> Result<Array> {
    wrap(ffi::argsort(a.ffi(), axis))
}

/// `mx.argpartition(a, kth, axis)`.
pub fn argpartition(a: &Array, kth: i32, axis: i32) -> Result<Array> {
    wrap(ffi::argpartition(a.ffi(), kth, axis))
}

/// `mx.topk(a, k, axis)`.
pub fn topk(a: &Array, k: i32, axis: i32) -> Result<Array> {
    wrap(ffi::topk(a.ffi(), k, axis))
}

/// `mx.tril(a, k)`.
pub fn tril(a: &Array, k: i32) -> Result<Array> {
    wrap(ffi::tril(a.ffi(), k))
}

/// `mx.conv1d(input, weight, stride, padding, dilation, groups)`; input (N, L, C_in), weight
/// (C_out, K, C_in / groups).
pub fn conv1d(
    input: &Array,
    weight: &Array,
    stride: i32,
    padding: i32,
    dilation: i32,
    groups: i32,
) -> Result<Array> {
    wrap(ffi::conv1d(
        input.ffi(),
        weight.ffi(),
        stride,
        padding,
        dilation,
        groups,
    ))
}

/// `mx.quantize(w, group_size, bits, mode)`: (packed weight, scales, biases) for affine mode,
/// (packed weight, scales) for the floating-point modes.
pub fn quantize(w: &Array, group_size: i32, bits: i32, mode: &str) -> Result<Vec<Array>> {
    List::from_raw(ffi::quantize(w.ffi(), group_size, bits, mode)?).into_vec()
}

/// `mx.dequantize(w, scales, biases, group_size, bits, mode)`.
pub fn dequantize(
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    group_size: i32,
    bits: i32,
    mode: &str,
) -> Result<Array> {
    // SAFETY: the pointer is null or borrowed from a live array for the call's duration.
    wrap(unsafe { ffi::dequantize(w.ffi(), scales.ffi(), ptr(biases), group_size, bits, mode) })
}

/// `mx.quantized_matmul(x, w, scales, biases, transpose, group_size, bits, mode)`.
#[allow(clippy::too_many_arguments)]
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    transpose: bool,
    group_size: i32,
    bits: i32,
    mode: &str,
) -> Result<Array> {
    // SAFETY: the pointer is null or borrowed from a live array for the call's duration.
    wrap(unsafe {
        ffi::quantized_matmul(
            x.ffi(),
            w.ffi(),
            scales.ffi(),
            ptr(biases),
            transpose,
            group_size,
            bits,
            mode,
        )
    })
}

/// `mx.gather_qmm(x, w, scales, biases, rhs_indices=rhs_indices, transpose, group_size, bits,
/// mode, sorted_indices)`: batch entry i of `x` times the matrix `w[rhs_indices[i]]`;
/// `sorted_indices` promises the indices ascend (mlx-lm's SwitchGLU sorts them for many tokens).
#[allow(clippy::too_many_arguments)]
pub fn gather_qmm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    rhs_indices: &Array,
    transpose: bool,
    group_size: i32,
    bits: i32,
    mode: &str,
    sorted_indices: bool,
) -> Result<Array> {
    // SAFETY: the pointer is null or borrowed from a live array for the call's duration.
    wrap(unsafe {
        ffi::gather_qmm(
            x.ffi(),
            w.ffi(),
            scales.ffi(),
            ptr(biases),
            rhs_indices.ffi(),
            transpose,
            group_size,
            bits,
            mode,
            sorted_indices,
        )
    })
}

/// `mx.gather_mm(a, b, rhs_indices=rhs_indices, sorted_indices)`: batch entry i of `a` times
/// the matrix `b[rhs_indices[i]]` (mlx-lm's SwitchLinear).
pub fn gather_mm(a: &Array, b: &Array, rhs_indices: &Array, sorted_indices: bool) -> Result<Array> {
    wrap(ffi::gather_mm(
        a.ffi(),
        b.ffi(),
        rhs_indices.ffi(),
        sorted_indices,
    ))
}

impl Array {
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        wrap(ffi::reshape(self.ffi(), shape))
    }

    /// `mx.transpose(a, axes)`; an empty `axes` reverses all axes.
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        wrap(ffi::transpose(self.ffi(), axes))
    }

    pub fn expand_dims(&self, axes: &[i32]) -> Result<Array> {
        wrap(ffi::expand_dims(self.ffi(), axes))
    }

    /// `mx.squeeze(a, axes)`; an empty `axes` removes every size-1 axis.
    pub fn squeeze(&self, axes: &[i32]) -> Result<Array> {
        wrap(ffi::squeeze(self.ffi(), axes))
    }

    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        wrap(ffi::broadcast_to(self.ffi(), shape))
    }

    pub fn flatten(&self, start: i32, end: i32) -> Result<Array> {
        wrap(ffi::flatten(self.ffi(), start, end))
    }

    pub fn moveaxis(&self, source: i32, destination: i32) -> Result<Array> {
        wrap(ffi::moveaxis(self.ffi(), source, destination))
    }

    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        wrap(ffi::astype(self.ffi(), dtype as u8))
    }

    /// `a[start:stop:strides]` over every axis (stop is clamped to the axis size).
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        wrap(ffi::slice(self.ffi(), start, stop, strides))
    }

    /// `a[..., start:stop, ...]` on one axis.
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32) -> Result<Array> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let axis = if axis < 0 { axis + n } else { axis } as usize;
        let mut lo = vec![0; shape.len()];
        let mut hi = shape.clone();
        lo[axis] = start;
        hi[axis] = stop;
        self.slice(&lo, &hi, &vec![1; shape.len()])
    }

    /// A copy of `self` with `update` written into `[start:stop:strides]`.
    pub fn slice_update(
        &self,
        update: &Array,
        start: &[i32],
        stop: &[i32],
        strides: &[i32],
    ) -> Result<Array> {
        wrap(ffi::slice_update(
            self.ffi(),
            update.ffi(),
            start,
            stop,
            strides,
        ))
    }

    /// `mx.take(a, indices, axis)`: what `a[indices]` lowers to for an array index.
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        wrap(ffi::take(self.ffi(), indices.ffi(), axis))
    }

    pub fn repeat(&self, repeats: i32, axis: i32) -> Result<Array> {
        wrap(ffi::repeat(self.ffi(), repeats, axis))
    }

    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        argmax(self, axis, keepdims)
    }
}
