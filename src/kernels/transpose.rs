//! Dispatch for the last-two-dims transpose.

use super::Operand;
use super::{pair_groups, Storage, TRANSPOSE};
use crate::Result;

/// out (B, C, R) = x (B, R, C) with the last two dims swapped.
pub(crate) fn transpose<T: Operand>(x: &T, r: usize, c: usize, out: &T) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let s = Storage::of(dev, x.dtype());
    let k = TRANSPOSE.kernel(dev, &[s, s])?;
    dev.dispatch(
        &k,
        &[n as u32, r as u32, c as u32, 0],
        &[x.block(), out.block()],
        pair_groups(n),
    )
}
