//! `Array`, `Dtype` and moving data between Rust slices and MLX.

use std::fmt;

use cxx::UniquePtr;

use crate::ffi::bridge as ffi;
use crate::{Error, Result};

/// MLX element types, in the order of `mlx::core::Dtype::Val` (the shim indexes by position).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    Bool = 0,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Float16,
    Float32,
    Float64,
    Bfloat16,
    Complex64,
}

impl Dtype {
    const ALL: [Dtype; 14] = [
        Dtype::Bool,
        Dtype::Uint8,
        Dtype::Uint16,
        Dtype::Uint32,
        Dtype::Uint64,
        Dtype::Int8,
        Dtype::Int16,
        Dtype::Int32,
        Dtype::Int64,
        Dtype::Float16,
        Dtype::Float32,
        Dtype::Float64,
        Dtype::Bfloat16,
        Dtype::Complex64,
    ];

    pub(crate) fn from_code(code: u8) -> Dtype {
        Self::ALL[code as usize]
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::Uint8 | Dtype::Int8 => 1,
            Dtype::Uint16 | Dtype::Int16 | Dtype::Float16 | Dtype::Bfloat16 => 2,
            Dtype::Uint32 | Dtype::Int32 | Dtype::Float32 => 4,
            Dtype::Uint64 | Dtype::Int64 | Dtype::Float64 | Dtype::Complex64 => 8,
        }
    }

    pub fn is_floating(self) -> bool {
        matches!(
            self,
            Dtype::Float16 | Dtype::Float32 | Dtype::Float64 | Dtype::Bfloat16
        )
    }

    /// The name Python MLX prints and safetensors headers use.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::Uint8 => "uint8",
            Dtype::Uint16 => "uint16",
            Dtype::Uint32 => "uint32",
            Dtype::Uint64 => "uint64",
            Dtype::Int8 => "int8",
            Dtype::Int16 => "int16",
            Dtype::Int32 => "int32",
            Dtype::Int64 => "int64",
            Dtype::Float16 => "float16",
            Dtype::Float32 => "float32",
            Dtype::Float64 => "float64",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Complex64 => "complex64",
        }
    }

    /// Parses a name as Python MLX prints it (`float32`, `bfloat16`, ...).
    pub fn from_name(name: &str) -> Option<Dtype> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Rust element types that map one-to-one onto an MLX dtype, so data can be copied in and out
/// without conversion. (f16 / bf16 data goes through f32 with `astype`, which is exact.)
pub trait Element: Copy {
    const DTYPE: Dtype;
    fn to_ne_bytes(self, out: &mut Vec<u8>);
    fn from_ne_bytes(bytes: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: Dtype = $d;
            fn to_ne_bytes(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&<$t>::to_ne_bytes(self));
            }
            fn from_ne_bytes(bytes: &[u8]) -> Self {
                <$t>::from_ne_bytes(bytes.try_into().expect("element width"))
            }
        }
    };
}
element!(f32, Dtype::Float32);
element!(f64, Dtype::Float64);
element!(i32, Dtype::Int32);
element!(u32, Dtype::Uint32);
element!(i64, Dtype::Int64);
element!(u64, Dtype::Uint64);
element!(u8, Dtype::Uint8);
element!(i8, Dtype::Int8);
element!(u16, Dtype::Uint16);
element!(i16, Dtype::Int16);

impl Element for bool {
    const DTYPE: Dtype = Dtype::Bool;
    fn to_ne_bytes(self, out: &mut Vec<u8>) {
        out.push(self as u8);
    }
    fn from_ne_bytes(bytes: &[u8]) -> Self {
        bytes[0] != 0
    }
}

/// An MLX array: a handle to a lazily evaluated node. Clone shares the buffer (as `mx.array`
/// assignment does in Python); the buffer is freed when the last handle drops.
///
/// `Array` is deliberately neither `Send` nor `Sync`: MLX ties an array to the stream of the
/// thread that built it, so arrays must never leave the engine thread (see [`crate::thread`]).
pub struct Array {
    pub(crate) raw: UniquePtr<ffi::Array>,
}

impl Array {
    pub(crate) fn wrap(raw: UniquePtr<ffi::Array>) -> Array {
        Array { raw }
    }

    pub(crate) fn ffi(&self) -> &ffi::Array {
        &self.raw
    }

    /// Copies `data` into a new array of the given shape.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        let mut bytes = Vec::with_capacity(std::mem::size_of_val(data));
        for &x in data {
            x.to_ne_bytes(&mut bytes);
        }
        Self::from_bytes(&bytes, shape, T::DTYPE)
    }

    /// Copies raw native-endian element bytes into a new array.
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        Ok(Array::wrap(ffi::from_bytes(bytes, shape, dtype as u8)?))
    }

    /// A 0-d array. `value` is rounded to f32 first and then cast to `dtype`, which is how
    /// Python MLX turns a Python float into an array of a given dtype.
    pub fn scalar(value: f32, dtype: Dtype) -> Result<Array> {
        Ok(Array::wrap(ffi::scalar_float(value, dtype as u8)?))
    }

    /// A 0-d integer (or bool) array.
    pub fn scalar_int(value: i64, dtype: Dtype) -> Result<Array> {
        Ok(Array::wrap(ffi::scalar_int(value, dtype as u8)?))
    }

    /// A 0-d f32 array.
    pub fn from_f32(value: f32) -> Array {
        Self::scalar(value, Dtype::Float32).expect("an f32 scalar is always constructible")
    }

    /// A 0-d int32 array.
    pub fn from_i32(value: i32) -> Array {
        Self::scalar_int(value.into(), Dtype::Int32).expect("an i32 scalar is always constructible")
    }

    pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
        Ok(Array::wrap(ffi::zeros(shape, dtype as u8)?))
    }

    /// An array of `shape` filled with `value` cast to `dtype`.
    pub fn full(shape: &[i32], value: &Array, dtype: Dtype) -> Result<Array> {
        Ok(Array::wrap(ffi::full(shape, value.ffi(), dtype as u8)?))
    }

    /// `mx.arange(start, stop, step, dtype)`.
    pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
        Ok(Array::wrap(ffi::arange(start, stop, step, dtype as u8)?))
    }

    pub fn shape(&self) -> Vec<i32> {
        ffi::shape(self.ffi())
    }

    /// The size of one dimension; negative indices count from the end.
    pub fn dim(&self, axis: i32) -> i32 {
        let shape = self.shape();
        let i = if axis < 0 {
            shape.len() as i32 + axis
        } else {
            axis
        };
        shape[i as usize]
    }

    pub fn ndim(&self) -> usize {
        self.shape().len()
    }

    pub fn size(&self) -> usize {
        self.shape().iter().map(|&d| d as usize).product()
    }

    pub fn dtype(&self) -> Dtype {
        Dtype::from_code(ffi::dtype(self.ffi()))
    }

    /// Evaluates the array (and its graph).
    pub fn eval(&self) -> Result<()> {
        crate::eval([self])
    }

    /// Evaluates and copies the elements out in row-major order. The array must already hold
    /// `T`'s dtype, except that f16 / bf16 arrays may be read as f32 (exact widening).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let dtype = self.dtype();
        let widened;
        let source =
            if T::DTYPE == Dtype::Float32 && matches!(dtype, Dtype::Float16 | Dtype::Bfloat16) {
                widened = self.astype(Dtype::Float32)?;
                &widened
            } else if dtype == T::DTYPE {
                self
            } else {
                return Err(Error::Invalid(format!(
                    "cannot read a {dtype} array as {}",
                    T::DTYPE
                )));
            };
        let bytes = ffi::to_bytes(source.ffi())?;
        Ok(bytes
            .chunks_exact(T::DTYPE.size())
            .map(T::from_ne_bytes)
            .collect())
    }

    /// Evaluates and copies out the raw element bytes (native endian).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        Ok(ffi::to_bytes(self.ffi())?)
    }

    /// The single element of a size-1 array.
    pub fn item<T: Element>(&self) -> Result<T> {
        let v = self.to_vec::<T>()?;
        match v.as_slice() {
            [x] => Ok(*x),
            _ => Err(Error::Invalid(format!(
                "item() needs one element, the array has {}",
                v.len()
            ))),
        }
    }
}

impl Clone for Array {
    fn clone(&self) -> Array {
        Array::wrap(ffi::clone_array(self.ffi()))
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&ffi::describe(self.ffi()))
    }
}

/// A list of arrays on the C++ side, for calls that take or return several.
pub(crate) struct List {
    pub(crate) raw: UniquePtr<ffi::ArrayList>,
}

impl List {
    pub(crate) fn new<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> List {
        let mut raw = ffi::list_new();
        for a in arrays {
            ffi::list_push(raw.pin_mut(), a.ffi());
        }
        List { raw }
    }

    pub(crate) fn from_raw(raw: UniquePtr<ffi::ArrayList>) -> List {
        List { raw }
    }

    pub(crate) fn into_vec(self) -> Result<Vec<Array>> {
        (0..ffi::list_len(&self.raw))
            .map(|i| Ok(Array::wrap(ffi::list_get(&self.raw, i)?)))
            .collect()
    }
}

/// Compile-time proof that `Array` is not `Send`: if it were, `<Array as NotSend<_>>` would be
/// ambiguous between the two impls below and this constant would not compile.
const _: fn() = || {
    trait NotSend<A> {
        fn check() {}
    }
    impl<T: ?Sized> NotSend<()> for T {}
    impl<T: ?Sized + Send> NotSend<u8> for T {}
    <Array as NotSend<_>>::check();
};
