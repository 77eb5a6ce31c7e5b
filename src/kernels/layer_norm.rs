//! Dispatch for layer norm and RMS norm (the same shaders with `RMS` specialized): the fused
//! forward (shaders/layer_norm.wgsl), the input's gradient
//! (shaders/layer_norm_dx.wgsl) and the weight's and bias's gradients (column sums in chunks,
//! shaders/layer_norm_dwdb.wgsl, then the reduce kernel over the chunks).

use super::softmax::needs_f32_staging;
use super::Operand;
use super::{reduce, Storage, LAYER_NORM, LAYER_NORM_DWDB, LAYER_NORM_DX, WG};
use crate::Result;

/// Rows at least this long are shared by several invocations; shorter ones get one each.
const ROW_PER_LANES: usize = 64;
/// Rows per chunk of the weight and bias gradients' column sums: enough chunks to keep the
/// GPU busy for tall inputs, few enough that the second pass is small.
const ROWS_PER_CHUNK: usize = 64;

/// log2 of the invocations per row of length `c`. Each lane adds c / lanes elements and then
/// the row's `lanes` partial sums, so about sqrt(c) lanes balance the two.
fn lane_shift(c: usize) -> u32 {
    if c < ROW_PER_LANES {
        return 0;
    }
    c.isqrt()
        .next_power_of_two()
        .min(WG as usize)
        .trailing_zeros()
}

/// The uniform words and workgroups of a (rows, c) row kernel.
fn row_launch(rows: usize, c: usize, eps: f32) -> ([u32; 4], u32) {
    let shift = lane_shift(c);
    let per_group = (WG >> shift) as usize;
    (
        [rows as u32, c as u32, shift, eps.to_bits()],
        rows.div_ceil(per_group) as u32,
    )
}

/// y (rows, c) = layer norm of x with weight w and bias b (c, x's dtype); mean and rstd
/// (rows, f32) get each row's statistics. With `rms`, RMS norm: no mean (0 is written) and no
/// bias (b is not read). y may have any dtype that needs no f32 staging (see
/// [`needs_f32_staging`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<T: Operand>(
    rms: bool,
    x: &T,
    w: &T,
    b: &T,
    rows: usize,
    c: usize,
    eps: f32,
    y: &T,
    mean: &T,
    rstd: &T,
) -> Result<()> {
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let dev = x.device();
    debug_assert!(!needs_f32_staging(dev, y.dtype(), c), "stage packed rows");
    let s = Storage::of(dev, x.dtype());
    let storage = [
        s,
        s,
        s,
        Storage::of(dev, y.dtype()),
        Storage::F32,
        Storage::F32,
    ];
    let k = LAYER_NORM.kernel_with(dev, &storage, &[("RMS", u32::from(rms))])?;
    let (params, groups) = row_launch(rows, c, eps);
    dev.dispatch(
        &k,
        &params,
        &[
            x.block(),
            w.block(),
            b.block(),
            y.block(),
            mean.block(),
            rstd.block(),
        ],
        groups,
    )
}

/// dx (rows, c, any dtype) = the gradient of layer norm's input, from the output's gradient dy
/// and x (rows, c), w (c) in x's dtype, and the forward's mean and rstd. Like y, dx needs no f32
/// staging. With `rms`, RMS norm's (mean 0).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_dx<T: Operand>(
    rms: bool,
    dy: &T,
    x: &T,
    w: &T,
    mean: &T,
    rstd: &T,
    rows: usize,
    c: usize,
    dx: &T,
) -> Result<()> {
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let dev = x.device();
    debug_assert!(!needs_f32_staging(dev, dx.dtype(), c), "stage packed rows");
    let s = Storage::of(dev, x.dtype());
    let storage = [
        s,
        s,
        s,
        Storage::F32,
        Storage::F32,
        Storage::of(dev, dx.dtype()),
    ];
    let k = LAYER_NORM_DX.kernel_with(dev, &storage, &[("RMS", u32::from(rms))])?;
    let (params, groups) = row_launch(rows, c, 0.0);
    dev.dispatch(
        &k,
        &params,
        &[
            dy.block(),
            x.block(),
            w.block(),
            mean.block(),
            rstd.block(),
            dx.block(),
        ],
        groups,
    )
}

/// The dims of the f32 partial column sums [`backward_dwdb`] needs for (rows, c): (chunks, c)
/// with several chunks of rows; `None` when one chunk (or an empty row) writes the gradients
/// directly.
pub(crate) fn dwdb_partials(rows: usize, c: usize) -> Option<[usize; 2]> {
    let chunks = rows.div_ceil(ROWS_PER_CHUNK).max(1);
    (c > 0 && chunks > 1).then_some([chunks, c])
}

/// dw and db (c, f32): the gradients of layer norm's weight (`sum_rows dy * xhat`) and bias
/// (`sum_rows dy`), from dy and x (rows, c) and the forward's mean and rstd. `partials` are the
/// weight's and bias's partial sums, f32 of the dims [`dwdb_partials`] gives (where it gives
/// any).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_dwdb<T: Operand>(
    dy: &T,
    x: &T,
    mean: &T,
    rstd: &T,
    rows: usize,
    c: usize,
    partials: Option<&[T; 2]>,
    dw: &T,
    db: &T,
) -> Result<()> {
    if c == 0 {
        return Ok(());
    }
    let dev = x.device();
    let chunks = rows.div_ceil(ROWS_PER_CHUNK).max(1);
    debug_assert_eq!(
        partials.map(|[p, _]| p.dims()),
        dwdb_partials(rows, c).as_ref().map(|d| &d[..])
    );
    // With one chunk the partial sums are the result; otherwise they are (chunks, c).
    let (pw, pb) = match partials {
        Some([pw, pb]) => (pw, pb),
        None => (dw, db),
    };
    let s = Storage::of(dev, x.dtype());
    let f = Storage::F32;
    let k = LAYER_NORM_DWDB.kernel(dev, &[s, s, f, f, f, f])?;
    let n = chunks * c;
    dev.dispatch(
        &k,
        &[rows as u32, c as u32, ROWS_PER_CHUNK as u32, n as u32],
        &[
            dy.block(),
            x.block(),
            mean.block(),
            rstd.block(),
            pw.block(),
            pb.block(),
        ],
        (n as u32).div_ceil(WG),
    )?;
    if partials.is_some() {
        reduce::reduce(pw, 1, chunks, c, 1.0, dw)?;
        reduce::reduce(pb, 1, chunks, c, 1.0, db)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_grow_with_the_square_root_of_the_row() {
        assert_eq!(lane_shift(1), 0);
        assert_eq!(lane_shift(63), 0);
        // 64 -> 8 lanes, 1000 -> 32 (31.6 rounded up), 4096 -> 64, long rows 256.
        assert_eq!(lane_shift(64), 3);
        assert_eq!(lane_shift(1000), 5);
        assert_eq!(lane_shift(4096), 6);
        assert_eq!(lane_shift(1 << 20), 8);
        let (params, groups) = row_launch(33, 1000, 1e-5);
        assert_eq!(params[2], 5);
        // 8 rows per workgroup.
        assert_eq!(groups, 5);
    }

    /// The RMS forms validate in every storage the registry builds.
    #[test]
    fn rms_variants_validate() {
        use crate::kernels::{assemble, specialize, storage_variants, validate_wgsl};
        for file in [&LAYER_NORM, &LAYER_NORM_DX] {
            for storage in storage_variants(file) {
                let body = specialize(file.body, &[("RMS", 1)]);
                let src = assemble(&body, &file.with_storage(&storage));
                if let Err(e) = validate_wgsl(&src) {
                    panic!("{} RMS {storage:?}: {e}", file.name);
                }
            }
        }
    }
}
