//! Dispatch for max and argmax along an axis.

use super::Operand;
use super::{assemble, specialize, Storage, MIN_LANES, REDUCE_MAX, WG};
use crate::Result;

/// Rows at least this long are shared by several invocations (mode 0); shorter rows get one
/// invocation each (mode 1).
const ROW_PER_WORKGROUP: usize = 64;

/// Elements each invocation of mode 0 aims to scan: with fewer invocations per output, several
/// outputs share a workgroup and its two barriers (docs/design-notes.md, "Measurements behind the
/// constants").
const PER_LANE: usize = 32;

/// With x viewed as (outer, len, inner), `max` and `idx` (both f32, outer * inner elements) get
/// the max along the middle dim and the first index where it is found. `len` >= 1.
pub(crate) fn max_axis<T: Operand>(
    x: &T,
    outer: usize,
    len: usize,
    inner: usize,
    max: &T,
    idx: &T,
) -> Result<()> {
    let outputs = outer * inner;
    if outputs == 0 {
        return Ok(());
    }
    debug_assert!(len >= 1, "max over an empty axis has no value");
    let dev = x.device();
    let wg = WG as usize;
    let (mode, lanes, groups) = if len >= ROW_PER_WORKGROUP {
        let lanes = len
            .div_ceil(PER_LANE)
            .next_power_of_two()
            .clamp(MIN_LANES, wg);
        (0, lanes, outputs.div_ceil(wg / lanes))
    } else {
        (1, 1, outputs.div_ceil(wg))
    };
    let s = Storage::of(dev, x.dtype());
    // The mode is specialized (see shaders/reduce_max.wgsl).
    let key = format!("reduce_max_{}_{mode}", s.tag());
    let k = dev.kernel(&key, &[], false, || {
        let bind = REDUCE_MAX.with_storage(&[s, Storage::F32, Storage::F32]);
        assemble(&specialize(REDUCE_MAX.body, &[("MODE", mode)]), &bind)
    })?;
    let params = [
        outputs as u32,
        len as u32,
        inner as u32,
        lanes.trailing_zeros(),
    ];
    dev.dispatch(
        &k,
        &params,
        &[x.block(), max.block(), idx.block()],
        groups as u32,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{validate_wgsl, variants};

    #[test]
    fn both_modes_validate() {
        for bind in variants(&REDUCE_MAX) {
            let src = assemble(&specialize(REDUCE_MAX.body, &[("MODE", 1)]), &bind);
            if let Err(e) = validate_wgsl(&src) {
                panic!("{bind:?}: {e}");
            }
        }
    }
}
