//! Dispatch for shaders/dropout.wgsl: `out = x * mask(seed, i) / (1 - p)`, the mask computed in
//! the shader from the seed and the element index (forward and backward alike).

use super::Operand;
use super::{pair_groups, Storage, DROPOUT};
use crate::Result;

/// The mask's parameters: elements whose 32-bit hash is below `threshold` are dropped, the
/// others scaled by `scale`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mask {
    pub threshold: u32,
    pub scale: f32,
    pub seed: u64,
}

impl Mask {
    /// Drops with probability `p` (in [0, 1), checked by the caller).
    pub(crate) fn new(p: f32, seed: u64) -> Mask {
        let t = (p as f64 * 4_294_967_296.0).round();
        Mask {
            threshold: t.min(u32::MAX as f64) as u32,
            scale: (1.0 / (1.0 - p as f64)) as f32,
            seed,
        }
    }
}

/// out = x * mask (same shape and dtype).
pub(crate) fn apply<T: Operand>(x: &T, mask: Mask, out: &T) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let s = Storage::of(dev, out.dtype());
    let k = DROPOUT.kernel(dev, &[s, s])?;
    let params = [
        n as u32,
        mask.threshold,
        mask.seed as u32,
        (mask.seed >> 32) as u32,
        mask.scale.to_bits(),
        0,
        0,
        0,
    ];
    dev.dispatch(&k, &params, &[x.block(), out.block()], pair_groups(n))
}
