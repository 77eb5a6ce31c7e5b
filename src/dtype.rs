//! Element types. f16 tensors use the same bytes whether the adapter computes in f16 or not:
//! element `i` is the low (even `i`) or high (odd `i`) half of 32-bit word `i / 2`.

use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 16-bit float (IEEE half); computed in f16 where the adapter has SHADER_F16, else in f32.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
        })
    }
}

/// A host element type that maps to a [`DType`].
pub trait Element: bytemuck::Pod + Copy + Send + Sync + 'static {
    /// The dtype of this element type.
    const DTYPE: DType;
    /// Converts from f32 (rounding to nearest for f16).
    fn from_f32(v: f32) -> Self;
    /// Converts to f32 (exact).
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}
