//! Dispatch for the axis reduction (sum, mean).

use super::Operand;
use super::{Storage, REDUCE, WG};
use crate::Result;

/// Rows at least this long get a workgroup each (tree sum); shorter rows are summed by one
/// invocation each, which wastes no lanes when there are many of them.
const ROW_PER_WORKGROUP: usize = 64;
/// From this many contiguous outputs (`inner`), one invocation per output is better even for
/// long rows: neighbouring invocations read neighbouring addresses at every step and no barrier
/// runs (a bias gradient, (128, 512) summed over rows, is 3x faster this way on lavapipe).
const COLUMNS_PER_INVOCATION: usize = 64;

/// out (f32, outer * inner elements) = sum over the middle dim of x viewed as (outer, len, inner),
/// divided by `div`.
pub(crate) fn reduce<T: Operand>(
    x: &T,
    outer: usize,
    len: usize,
    inner: usize,
    div: f32,
    out: &T,
) -> Result<()> {
    let outputs = outer * inner;
    if outputs == 0 {
        return Ok(());
    }
    let dev = out.device();
    let k = REDUCE.kernel(dev, &[Storage::of(dev, x.dtype()), Storage::F32])?;
    let (mode, groups) = if len >= ROW_PER_WORKGROUP && inner < COLUMNS_PER_INVOCATION {
        (0, outputs as u32)
    } else {
        (1, (outputs as u32).div_ceil(WG))
    };
    let params = [
        outputs as u32,
        len as u32,
        inner as u32,
        mode,
        div.to_bits(),
        0,
        0,
        0,
    ];
    dev.dispatch(&k, &params, &[x.block(), out.block()], groups)
}

/// out (f32, `inner` elements) = the sum over `len` of x viewed as (len, inner), one invocation
/// per output adding k in order, from zero or (`onto`) from what out holds: folding the runs of
/// a split of len one after another gives the bits of folding len whole.
pub(crate) fn fold<T: Operand>(x: &T, len: usize, inner: usize, onto: bool, out: &T) -> Result<()> {
    if inner == 0 {
        return Ok(());
    }
    let dev = out.device();
    let k = REDUCE.kernel(dev, &[Storage::of(dev, x.dtype()), Storage::F32])?;
    let mode = if onto { 2 } else { 1 };
    let params = [
        inner as u32,
        len as u32,
        inner as u32,
        mode,
        1f32.to_bits(),
        0,
        0,
        0,
    ];
    let groups = (inner as u32).div_ceil(WG);
    dev.dispatch(&k, &params, &[x.block(), out.block()], groups)
}
