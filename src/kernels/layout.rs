//! Dispatch for the layout kernels: the strided block copy (narrow, cat and narrow's backward) and
//! the axis permutation.

use super::{pair_groups, Storage, PERMUTE, STRIDED_COPY, WG};
use crate::{Result, Tensor};

/// Where a block sits along the middle axis of a tensor viewed as (outer, len, inner).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    /// The middle axis' length in the tensor.
    pub axis_len: usize,
    /// The block's first index along it.
    pub offset: usize,
}

/// Copies a block of (outer, len, inner) elements from `x` (viewed as (outer, from.axis_len,
/// inner), block at `from.offset`) into `out` (viewed as (outer, to.axis_len, inner), block at
/// `to.offset`). Elements of `out` outside the block are kept. Same dtype on both sides.
pub(crate) fn copy_block(
    x: &Tensor,
    from: Span,
    out: &Tensor,
    to: Span,
    (outer, len, inner): (usize, usize, usize),
) -> Result<()> {
    if outer * len * inner == 0 {
        return Ok(());
    }
    // The words of out from the block's first element (o = 0) to its last (o = outer - 1).
    let first = to.offset * inner;
    let last = ((outer - 1) * to.axis_len + to.offset + len) * inner - 1;
    let (w0, w1) = (first / 2, last / 2);
    let words = w1 - w0 + 1;
    let dev = out.device();
    let s = Storage::of(dev, out.dtype());
    let k = STRIDED_COPY.kernel(dev, &[s, s])?;
    let params = [
        out.numel() as u32,
        w0 as u32,
        words as u32,
        inner as u32,
        from.axis_len as u32,
        from.offset as u32,
        to.axis_len as u32,
        to.offset as u32,
        len as u32,
        0,
        0,
        0,
    ];
    dev.dispatch(
        &k,
        &params,
        &[x.block(), out.block()],
        (words as u32).div_ceil(WG),
    )
}

/// out = x with its axes permuted: out's axis j is x's axis `perm[j]` (out's shape is already
/// permuted; rank <= 4).
pub(crate) fn permute(x: &Tensor, perm: &[usize], out: &Tensor) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let strides = x.shape().strides();
    // x's stride along each of out's axes, left-padded to rank 4 (padded axes have length 1).
    let mut s = [0u32; 4];
    let pad = 4 - perm.len();
    for (j, &axis) in perm.iter().enumerate() {
        s[pad + j] = strides[axis] as u32;
    }
    let dev = out.device();
    let st = Storage::of(dev, x.dtype());
    let k = PERMUTE.kernel(dev, &[st, st])?;
    let mut params = vec![n as u32, 0, 0, 0];
    params.extend(out.shape().dims4());
    params.extend(s);
    dev.dispatch(&k, &params, &[x.block(), out.block()], pair_groups(n))
}
