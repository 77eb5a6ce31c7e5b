//! Seeded random crops and horizontal flips (`--crop-pad P --flip`, `--augment` for both with
//! P = 2): torchvision's `RandomCrop(S, padding=P)` then `RandomHorizontalFlip()`, drawn per
//! sample and epoch.
//!
//! What a sample becomes depends on (seed, epoch, sample index) alone, never on which batch or
//! micro-batch holds it, so the same seed gives the same batches, a budget that splits a batch
//! sees the same images, and a resumed run continues with the epoch's own draws.

use fitgrad::train::data::Dataset;
use fitgrad::train::{BatchSource, ClassBatch, Features};
use fitgrad::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};

/// What to do to each training image.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Augment {
    /// Zero padding on every side before an S x S crop (0: no crop).
    pub pad: usize,
    /// Mirror left-right with probability 1/2.
    pub flip: bool,
}

impl Augment {
    /// Whether any transform is on.
    pub fn is_on(&self) -> bool {
        self.pad > 0 || self.flip
    }
}

/// One sample's transform: the crop's top-left corner (dy, dx) in the padded image, each in
/// 0..=2 pad, and whether it is mirrored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Draw {
    pub dy: usize,
    pub dx: usize,
    pub flip: bool,
}

/// splitmix64's finalizer: a well-mixed 64-bit value from any input.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A dataset of square images seen through [`Augment`]: a [`BatchSource`] whose batches are
/// the augmented images. The epoch is the one of the last `epoch_order` call (the trainer
/// makes it at the start of each epoch), or `set_epoch`.
pub struct Augmented<'a> {
    data: &'a Dataset,
    side: usize,
    aug: Augment,
    seed: u64,
    epoch: AtomicU64,
}

impl<'a> Augmented<'a> {
    /// `data`'s rows as `side` x `side` images; a crop padding of `side` or more, or rows that
    /// are not `side` squared, are an `Error::InvalidArgument`.
    pub fn new(data: &'a Dataset, side: usize, aug: Augment, seed: u64) -> Result<Self> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "train_cnn --crop-pad",
            reason,
        };
        if side * side != data.dim {
            return Err(bad(format!(
                "{} features per sample are not {side} x {side} images",
                data.dim
            )));
        }
        if aug.pad >= side.max(1) {
            return Err(bad(format!(
                "a padding of {} needs images wider than it ({side} x {side} here)",
                aug.pad
            )));
        }
        Ok(Augmented {
            data,
            side,
            aug,
            seed,
            epoch: AtomicU64::new(0),
        })
    }

    /// Makes later batches the draws of `epoch`.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// The transform of sample `index` in `epoch`.
    pub fn draw(&self, epoch: u64, index: usize) -> Draw {
        let h = mix(mix(mix(self.seed ^ 0x6175_676d) ^ epoch) ^ index as u64);
        let span = 2 * self.aug.pad as u64 + 1;
        Draw {
            dy: (h % span) as usize,
            dx: ((h >> 20) % span) as usize,
            flip: self.aug.flip && (h >> 63) == 1,
        }
    }

    /// Writes `img` (side x side, row-major) through `d` into `out`: out(r, c) is the padded
    /// image at (r + dy, c' + dx) with c' = side - 1 - c when mirrored, zero in the padding.
    fn apply(&self, img: &[f32], d: Draw, out: &mut [f32]) {
        let (s, p) = (self.side, self.aug.pad);
        for r in 0..s {
            for c in 0..s {
                let c_src = if d.flip { s - 1 - c } else { c };
                let (y, x) = (r + d.dy, c_src + d.dx);
                let inside = (p..p + s).contains(&y) && (p..p + s).contains(&x);
                out[r * s + c] = if inside {
                    img[(y - p) * s + (x - p)]
                } else {
                    0.0
                };
            }
        }
    }
}

impl BatchSource for Augmented<'_> {
    type Batch = ClassBatch;

    fn len(&self) -> usize {
        self.data.len()
    }

    fn batch(&self, indices: &[usize]) -> Result<ClassBatch> {
        let mut batch = self.data.batch(indices)?;
        if !self.aug.is_on() {
            return Ok(batch);
        }
        let epoch = self.epoch.load(Ordering::Relaxed);
        let n = self.side * self.side;
        if let Features::Host { data, .. } = &mut batch.x {
            let mut img = vec![0.0f32; n];
            for (row, &i) in data.chunks_exact_mut(n).zip(indices) {
                img.copy_from_slice(row);
                self.apply(&img, self.draw(epoch, i), row);
            }
        }
        Ok(batch)
    }

    fn epoch_order(&self, seed: u64, epoch: u64) -> Vec<usize> {
        self.set_epoch(epoch);
        self.data.epoch_order(seed, epoch)
    }
}
