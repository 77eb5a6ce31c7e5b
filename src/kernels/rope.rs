//! Dispatch for rotary position embeddings, rotate-half form (shaders/rope.wgsl): the forward
//! rotates each (first half, second half) pair of a head by its position's angle, the backward
//! rotates it back.

use super::softmax::needs_f32_staging;
use super::Operand;
use super::{Storage, ROPE, WG};
use crate::Result;

/// y (M, T, D) = x (M, T, D) rotated by the angles of `cs` (2, T, D / 2; f32: cosines, then
/// sines); `inverse` rotates the other way (the backward). D is even and y needs no f32
/// staging (packed f16 with D / 2 odd is staged by the caller, see [`needs_staging`]).
pub(crate) fn rope<T: Operand>(
    x: &T,
    cs: &T,
    m: usize,
    t: usize,
    d: usize,
    inverse: bool,
    y: &T,
) -> Result<()> {
    let half = d / 2;
    let n = m * t * half.div_ceil(2);
    if n == 0 {
        return Ok(());
    }
    let dev = x.device();
    debug_assert!(!needs_staging(dev, y.dtype(), d), "stage packed rows");
    let storage = [
        Storage::of(dev, x.dtype()),
        Storage::F32,
        Storage::of(dev, y.dtype()),
    ];
    let k = ROPE.kernel(dev, &storage)?;
    let dir: f32 = if inverse { -1.0 } else { 1.0 };
    dev.dispatch(
        &k,
        &[n as u32, t as u32, half as u32, dir.to_bits()],
        &[x.block(), cs.block(), y.block()],
        (n as u32).div_ceil(WG),
    )
}

/// Whether an output of `dtype` with head dim `d` must be written to f32 first: packed f16
/// whose second halves start on odd elements.
pub(crate) fn needs_staging(dev: &crate::Device, dtype: crate::DType, d: usize) -> bool {
    needs_f32_staging(dev, dtype, d / 2)
}
