//! Dispatch for 2-D pooling (shaders/pool2d_fwd.wgsl, shaders/pool2d_bwd.wgsl): max, average
//! and adaptive average over (planes, h, w). The max's backward finds each window's largest
//! input again from x, so nothing but x is kept.

use super::{pair_groups, Operand, Storage, POOL2D_BWD, POOL2D_FWD};
use crate::Result;

/// What a window reduces and how windows are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolMode {
    Max,
    /// `include_pad`: divide by the kernel's size (torch's count_include_pad), else by the
    /// window's inputs.
    Avg {
        include_pad: bool,
    },
    /// Windows from the output size alone (torch's adaptive_avg_pool2d).
    AdaptiveAvg,
}

/// The geometry of one pooling: x (planes, h, w) to (planes, oh, ow) with kernel, stride and
/// padding (unused by the adaptive mode). Checked by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pool {
    pub mode: PoolMode,
    pub planes: usize,
    pub h: usize,
    pub w: usize,
    pub oh: usize,
    pub ow: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

impl Pool {
    /// The uniform words of include/pool2d_window.wgsl for an output of `n` elements.
    fn params(&self, n: usize) -> [u32; 16] {
        let (mode, include_pad) = match self.mode {
            PoolMode::Max => (0, false),
            PoolMode::Avg { include_pad } => (1, include_pad),
            PoolMode::AdaptiveAvg => (2, false),
        };
        [
            n,
            mode,
            self.h,
            self.w,
            self.oh,
            self.ow,
            self.kernel[0],
            self.kernel[1],
            self.stride[0],
            self.stride[1],
            self.padding[0],
            self.padding[1],
            usize::from(include_pad),
            0,
            0,
            0,
        ]
        .map(|v| v as u32)
    }
}

/// out (planes, oh, ow) = the pooling of x (planes, h, w); same dtype.
pub(crate) fn forward<T: Operand>(x: &T, pool: &Pool, out: &T) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = x.device();
    let s = Storage::of(dev, x.dtype());
    let k = POOL2D_FWD.kernel(dev, &[s, s])?;
    dev.dispatch(
        &k,
        &pool.params(n),
        &[x.block(), out.block()],
        pair_groups(n),
    )
}

/// dx (planes, h, w) = the pooling's input gradient from x and dy (planes, oh, ow); one dtype.
pub(crate) fn backward<T: Operand>(x: &T, dy: &T, pool: &Pool, dx: &T) -> Result<()> {
    let n = dx.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = x.device();
    let s = Storage::of(dev, x.dtype());
    let k = POOL2D_BWD.kernel(dev, &[s, s, s])?;
    dev.dispatch(
        &k,
        &pool.params(n),
        &[x.block(), dy.block(), dx.block()],
        pair_groups(n),
    )
}
