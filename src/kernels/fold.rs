//! Dispatch for the batch-invariant weight gradient (shaders/fold_outer.wgsl): lᵀ · r summed
//! over the rows in order, from zero or continuing from the gradient already held.

use super::{Operand, Storage, FOLD_OUTER};
use crate::{Error, Result};

/// Output invocations per workgroup along each grid axis, as in the shader.
const TILE: usize = 16;

/// c (f32, (ni, nj)) = Σ_k l[k, i] r[k, j] over the `rows` of l (rows, ni) and r (rows, nj),
/// k in order, from zero or (`onto`) from what c holds.
pub(crate) fn outer<T: Operand>(l: &T, r: &T, rows: usize, onto: bool, c: &T) -> Result<()> {
    let (ni, nj) = (c.dims()[0], c.dims()[1]);
    if ni * nj == 0 {
        return Ok(());
    }
    let grid = [nj.div_ceil(TILE), ni.div_ceil(TILE)];
    if grid.iter().any(|&g| g > 65_535) || rows > u32::MAX as usize {
        return Err(Error::Limit {
            op: "batch-invariant weight gradient",
            what: "workgroups per dimension",
            value: grid[0].max(grid[1]) as u64,
            limit: 65_535,
        });
    }
    let dev = c.device();
    let s = Storage::of(dev, l.dtype());
    let k = FOLD_OUTER.kernel(dev, &[s, Storage::of(dev, r.dtype()), Storage::F32])?;
    let params = [rows as u32, ni as u32, nj as u32, u32::from(onto)];
    dev.dispatch3(
        &k,
        &params,
        &[l.block(), r.block(), c.block()],
        [grid[0] as u32, grid[1] as u32, 1],
    )
}
