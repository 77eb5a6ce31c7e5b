//! Dispatch for batch norm in training: the per-channel statistics with the running update
//! (shaders/batch_norm_stats.wgsl), the output (shaders/batch_norm.wgsl), the backward's channel
//! sums (shaders/batch_norm_sums.wgsl) and the input gradient (shaders/batch_norm_dx.wgsl).
//! x is (N, C, HW); statistics and sums are f32 (2, C).

use super::BATCH_NORM_SUMS;
use super::{pair_groups, Operand, Storage, BATCH_NORM, BATCH_NORM_DX, BATCH_NORM_STATS};
use crate::Result;

/// The sizes of one batch norm: x is (n, c, hw).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Channels {
    pub n: usize,
    pub c: usize,
    pub hw: usize,
    pub eps: f32,
}

impl Channels {
    fn params(&self, momentum: f32, update: bool) -> [u32; 8] {
        [
            (self.n * self.c * self.hw) as u32,
            self.c as u32,
            self.hw as u32,
            (self.n * self.hw) as u32,
            self.eps.to_bits(),
            momentum.to_bits(),
            u32::from(update),
            0,
        ]
    }

    fn empty(&self) -> bool {
        self.n * self.c * self.hw == 0
    }
}

/// stats (f32, (2, C)) = each channel's mean and rstd over N and HW; where `running` holds
/// the running mean and variance (f32, (C)), they move by `momentum` as torch's do.
pub(crate) fn stats<T: Operand>(
    x: &T,
    ch: &Channels,
    running: Option<(&T, &T, f32)>,
    stats: &T,
) -> Result<()> {
    if ch.empty() {
        return Ok(());
    }
    let dev = x.device();
    let f = Storage::F32;
    let k = BATCH_NORM_STATS.kernel(dev, &[Storage::of(dev, x.dtype()), f, f, f])?;
    let (rm, rv, momentum) = running.unwrap_or((stats, stats, 0.0));
    dev.dispatch(
        &k,
        &ch.params(momentum, running.is_some()),
        &[x.block(), stats.block(), rm.block(), rv.block()],
        ch.c as u32,
    )
}

/// out = (x - mean) rstd w + b per channel; w and b (C) in x's dtype, as is out.
pub(crate) fn apply<T: Operand>(
    x: &T,
    w: &T,
    b: &T,
    stats: &T,
    ch: &Channels,
    out: &T,
) -> Result<()> {
    if ch.empty() {
        return Ok(());
    }
    let dev = x.device();
    let s = Storage::of(dev, x.dtype());
    let k = BATCH_NORM.kernel(dev, &[s, s, s, Storage::F32, s])?;
    let n = out.numel();
    dev.dispatch(
        &k,
        &ch.params(0.0, false),
        &[x.block(), w.block(), b.block(), stats.block(), out.block()],
        pair_groups(n),
    )
}

/// sums (f32, (2, C)) = per channel (sum dy, sum dy xhat): the bias's and weight's gradients.
pub(crate) fn sums<T: Operand>(dy: &T, x: &T, stats: &T, ch: &Channels, sums: &T) -> Result<()> {
    if ch.c == 0 {
        return Ok(());
    }
    let dev = x.device();
    let s = Storage::of(dev, x.dtype());
    let f = Storage::F32;
    let k = BATCH_NORM_SUMS.kernel(dev, &[s, s, f, f])?;
    dev.dispatch(
        &k,
        &ch.params(0.0, false),
        &[dy.block(), x.block(), stats.block(), sums.block()],
        ch.c as u32,
    )
}

/// dx (x's shape and dtype) = batch norm's input gradient in training.
pub(crate) fn backward_dx<T: Operand>(
    dy: &T,
    x: &T,
    w: &T,
    stats: &T,
    sums: &T,
    ch: &Channels,
    dx: &T,
) -> Result<()> {
    if ch.empty() {
        return Ok(());
    }
    let dev = x.device();
    let s = Storage::of(dev, x.dtype());
    let f = Storage::F32;
    let k = BATCH_NORM_DX.kernel(dev, &[s, s, s, f, f, s])?;
    dev.dispatch(
        &k,
        &ch.params(0.0, false),
        &[
            dy.block(),
            x.block(),
            w.block(),
            stats.block(),
            sums.block(),
            dx.block(),
        ],
        pair_groups(dx.numel()),
    )
}
