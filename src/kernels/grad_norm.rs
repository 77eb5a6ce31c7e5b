//! Dispatch for gradient clipping by the global norm (shaders/grad_norm.wgsl): per gradient a
//! sum of squares into slots of one shared f32 buffer, one dispatch combining the slots into the
//! norm, and per gradient an in-place scale that reads the norm on the GPU. No atomics, no
//! readback.

use super::Operand;
use super::{assemble, specialize, Binding, Splits, Storage, GRAD_NORM, WG};
use crate::device::Kernel;
use crate::memory::Block;
use crate::{Device, Result};
use std::sync::Arc;

/// Quads each invocation of a sum-of-squares dispatch takes before another workgroup (slot) is
/// added: enough work per invocation to repay its workgroup's tree.
const QUADS_PER_INVOCATION: usize = 16;

/// Workgroups (slots) per gradient at most: 64K invocations keep a large GPU busy, and the
/// combining dispatch reads at most this many slots per gradient.
const MAX_PARTS: usize = 256;

/// `KIND` of the shader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    SumSquares = 0,
    Norm = 1,
    Scale = 2,
}

/// Slots a gradient of `n` elements writes (0 when it is empty). Depends on `n` alone, so the
/// order of every addition is fixed by the shapes.
pub(crate) fn parts(n: usize) -> usize {
    n.div_ceil(4)
        .div_ceil(WG as usize * QUADS_PER_INVOCATION)
        .min(MAX_PARTS)
}

fn kernel(
    dev: &Device,
    kind: Kind,
    storage: [Storage; 3],
    vec: bool,
    blocks: &[&Block; 3],
) -> Result<Arc<Kernel>> {
    let splits = Splits::of(dev, blocks)?;
    let key = format!(
        "grad_norm_k{}_{}_{}_{}{}{}",
        kind as u32,
        storage[0].tag(),
        storage[1].tag(),
        storage[2].tag(),
        if vec { "_x4" } else { "" },
        splits.key()
    );
    dev.kernel(&key, &[], false, || {
        let body = specialize(
            GRAD_NORM.body,
            &[("KIND", kind as u32), ("VEC", u32::from(vec))],
        );
        let bind: Vec<Binding> = GRAD_NORM
            .with_storage(&storage)
            .into_iter()
            .map(|b| Binding {
                vec4: vec && b.name == "g",
                ..b
            })
            .collect();
        assemble(&body, &splits.apply(bind))
    })
}

/// Writes the sum of the squares of `g` (any dtype, f32 sums) to `acc[slot..slot + parts(n)]`.
pub(crate) fn sum_squares<T: Operand>(g: &T, acc: &T, slot: usize) -> Result<()> {
    let n = g.numel();
    let groups = parts(n);
    if groups == 0 {
        return Ok(());
    }
    assert!(slot + groups <= acc.numel(), "grad_norm slots out of range");
    let dev = g.device();
    // Whole quads when every one is whole (a block starts 256-byte aligned).
    let vec = n.is_multiple_of(4);
    let st = [Storage::of(dev, g.dtype()), Storage::F32, Storage::F32];
    // The unused norm binding aliases acc.
    let blocks = [g.block(), acc.block(), acc.block()];
    let k = kernel(dev, Kind::SumSquares, st, vec, &blocks)?;
    let params = [n as u32, slot as u32, 0, 0];
    dev.dispatch(&k, &params, &blocks, groups as u32)
}

/// norm (one f32) = sqrt of the sum of `acc[0..slots]`.
pub(crate) fn norm<T: Operand>(acc: &T, slots: usize, norm: &T) -> Result<()> {
    let dev = acc.device();
    // The unused g binding aliases acc.
    let blocks = [acc.block(), acc.block(), norm.block()];
    let k = kernel(dev, Kind::Norm, [Storage::F32; 3], false, &blocks)?;
    dev.dispatch(&k, &[slots as u32, 0, 0, 0], &blocks, 1)
}

/// g *= max_norm / (norm + 1e-6) in place where that factor is below 1 and the norm (one f32,
/// on the GPU) is finite.
pub(crate) fn scale<T: Operand>(g: &T, norm: &T, max_norm: f32) -> Result<()> {
    let n = g.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = g.device();
    let vec = n.is_multiple_of(4);
    let st = [Storage::of(dev, g.dtype()), Storage::F32, Storage::F32];
    // The unused acc binding aliases norm.
    let blocks = [g.block(), norm.block(), norm.block()];
    let k = kernel(dev, Kind::Scale, st, vec, &blocks)?;
    let per_invocation = if vec { 4 } else { 2 };
    let groups = (n.div_ceil(per_invocation) as u32).div_ceil(WG);
    dev.dispatch(&k, &[n as u32, 0, max_norm.to_bits(), 0], &blocks, groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::validate_wgsl;
    use Storage::*;

    /// Every kind validates with every gradient storage, vec4 or not.
    #[test]
    fn every_kind_validates() {
        for kind in [Kind::SumSquares, Kind::Norm, Kind::Scale] {
            for vec in [0, 1] {
                let body = specialize(GRAD_NORM.body, &[("KIND", kind as u32), ("VEC", vec)]);
                assert!(body.contains(&format!("const KIND: u32 = {}u;", kind as u32)));
                for s in [F32, F16, F16Packed] {
                    let bind: Vec<Binding> = GRAD_NORM
                        .with_storage(&[s, F32, F32])
                        .into_iter()
                        .map(|b| Binding {
                            vec4: vec == 1 && b.name == "g",
                            ..b
                        })
                        .collect();
                    if let Err(e) = validate_wgsl(&assemble(&body, &bind)) {
                        panic!("{kind:?} {s:?} VEC {vec}: {e}");
                    }
                }
            }
        }
    }

    #[test]
    fn parts_grow_with_size_and_stop() {
        assert_eq!(parts(0), 0);
        assert_eq!(parts(1), 1);
        assert_eq!(parts(4 * 256 * 16), 1);
        assert_eq!(parts(4 * 256 * 16 + 1), 2);
        assert_eq!(parts(1 << 30), MAX_PARTS);
    }
}
