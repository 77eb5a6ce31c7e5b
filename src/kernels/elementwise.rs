//! Dispatch for binary (broadcast), unary / scalar / cast, and fill kernels.

use super::{pair_groups, Storage, BINARY, FILL, UNARY};
use crate::{Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BinaryOp {
    Add = 0,
    Sub = 1,
    Mul = 2,
    Div = 3,
}

/// Op codes of shaders/unary.wgsl.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UnaryOp {
    /// Copy, or cast when the output dtype differs.
    Identity = 0,
    Relu = 1,
    Neg = 2,
    AddScalar = 3,
    SubScalar = 4,
    MulScalar = 5,
    DivScalar = 6,
    /// s - x
    RSubScalar = 7,
    /// s / x
    RDivScalar = 8,
}

/// out = a (op) b with out's shape the broadcast of both; all three share a dtype.
pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let s = Storage::of(dev, out.dtype());
    let k = BINARY.kernel(dev, &[s, s, s])?;
    let shape = out.shape();
    let mut params = vec![n as u32, op as u32, 0, 0];
    params.extend(shape.dims4());
    params.extend(a.shape().broadcast_strides4(shape));
    params.extend(b.shape().broadcast_strides4(shape));
    dev.dispatch(
        &k,
        &params,
        &[a.block(), b.block(), out.block()],
        pair_groups(n),
    )
}

/// out = op(x, s); `out` may have another dtype than `x` (a cast).
pub(crate) fn unary(op: UnaryOp, x: &Tensor, s: f32, out: &Tensor) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let k = UNARY.kernel(
        dev,
        &[Storage::of(dev, x.dtype()), Storage::of(dev, out.dtype())],
    )?;
    let params = [n as u32, op as u32, s.to_bits(), 0];
    dev.dispatch(&k, &params, &[x.block(), out.block()], pair_groups(n))
}

pub(crate) fn fill(out: &Tensor, value: f32) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let k = FILL.kernel(dev, &[Storage::of(dev, out.dtype())])?;
    dev.dispatch(
        &k,
        &[n as u32, value.to_bits(), 0, 0],
        &[out.block()],
        pair_groups(n),
    )
}
