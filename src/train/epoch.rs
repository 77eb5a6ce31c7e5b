//! The loops that feed [`Trainer::step`]: an epoch of a dataset in its seeded order, an epoch
//! of a sharded dataset streamed through the device, host or device rows as one batch, and the
//! evaluation over a dataset (split in halves where a batch runs out of memory).

use super::model::{BatchSource, ClassBatch, TrainModel};
use super::rows::{DeviceRows, HostRows};
use super::summary::Evaluation;
use super::trainer::Trainer;
use crate::nn::Module;
use crate::{DType, Error, Result, Tensor};

impl<M: Module> Trainer<M> {
    /// Steps over one epoch of `data` in its seeded order; `on_step(trainer, done, total)`
    /// after each step (progress, logging, evaluation callbacks).
    pub fn train_epoch<D>(
        &mut self,
        data: &D,
        seed: u64,
        epoch: u64,
        mut on_step: impl FnMut(&mut Self, usize, usize) -> Result<()>,
    ) -> Result<()>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let order = data.epoch_order(seed, epoch);
        let eff = self.effective_batch();
        let total = order.len().div_ceil(eff);
        for (i, idx) in order.chunks(eff).enumerate() {
            self.step(data, idx)?;
            on_step(self, i + 1, total)?;
        }
        Ok(())
    }

    /// Mean loss (and accuracy, where the model reports it) over `data`, in batches of
    /// `batch` without recording, with the model in eval mode. A batch that runs out of memory
    /// (a budget's typed error, raised before the driver is asked) is split in halves and the
    /// evaluation goes on from it, so a budget bounds evaluation too; only one sample that
    /// does not fit is an error. While planning, only the batches that can set the peak run
    /// (the first two and a shorter last one).
    pub fn evaluate<D>(&self, data: &D, batch: usize) -> Result<Evaluation>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let _g = crate::no_grad();
        self.model.set_training(false);
        let ctx = self.context(false);
        let planning = self.device.is_planning();
        let n = data.len();
        let result = (|| {
            let (mut loss, mut correct, mut counted) = (0.0f64, 0usize, true);
            let (mut at, mut size, mut done) = (0, batch.max(1), 0);
            while at < n {
                if planning && done >= 2 {
                    // The middle batches repeat the second's allocations: on to the last.
                    let rest = n - at;
                    let last = match rest % size {
                        0 => size,
                        r => r,
                    };
                    at = n - last.min(rest);
                }
                let len = size.min(n - at);
                let chunk: Vec<usize> = (at..at + len).collect();
                let e = match data
                    .batch(&chunk)
                    .and_then(|b| self.model.evaluate_batch(&b, &ctx))
                {
                    Err(Error::OutOfMemory { .. }) if size > 1 => {
                        size = len.div_ceil(2);
                        continue;
                    }
                    other => other?,
                };
                loss += e.loss as f64 * len as f64;
                match e.correct {
                    Some(c) => correct += c,
                    None => counted = false,
                }
                (at, done) = (at + len, done + 1);
            }
            let n = n.max(1) as f64;
            Ok(Evaluation {
                loss: (loss / n) as f32,
                accuracy: counted.then_some((correct as f64 / n) as f32),
            })
        })();
        self.model.set_training(true);
        crate::residency::finish(&self.device, false)?;
        result
    }

    /// Steps over one epoch of a sharded dataset, exactly as [`Trainer::train_epoch`] over the
    /// same samples in memory: the shards hold the in-memory epoch order in consecutive pieces,
    /// and effective batches span shard boundaries, so the batches, the number of steps
    /// (`len.div_ceil(effective batch)`) and the weights do not depend on the shard size.
    ///
    /// Shards stream through the device (at most two there at once). A batch inside one shard
    /// is a row range of it; a batch split between shards is assembled on the device with
    /// [`Tensor::cat`] from the tail of one and the head of the next (rows copied before the
    /// earlier shard is dropped). Either way the step runs on `DeviceRows`, so micro-batching
    /// and the out-of-memory retry apply.
    pub fn train_epoch_sharded(
        &mut self,
        data: &super::shard::ShardedDataset,
        seed: u64,
        epoch: u64,
        mut on_step: impl FnMut(&mut Self, usize, usize) -> Result<()>,
    ) -> Result<()>
    where
        M: TrainModel<ClassBatch>,
    {
        let eff = self.effective_batch();
        let total = data.len.div_ceil(eff);
        let device = self.device.clone();
        let mut done = 0;
        // The batch being assembled across shards: its row pieces (each a device tensor of
        // (rows, dim)) and their labels; fewer than `eff` rows in all.
        let mut pieces: Vec<Tensor> = Vec::new();
        let mut labels: Vec<u32> = Vec::new();
        for shard in data.epoch(&device, seed, epoch) {
            let (x, y) = shard?;
            let n = y.len();
            let mut lo = 0;
            while lo < n {
                let take = (eff - labels.len()).min(n - lo);
                if labels.is_empty() && take == eff {
                    // A whole batch inside this shard: a row range of it.
                    self.step_device_rows(&x, &y, lo, lo + eff)?;
                } else {
                    // Part of a batch that spans shards (or the epoch's short last batch).
                    pieces.push(if take == n {
                        x.clone()
                    } else {
                        x.rows(lo, lo + take)?
                    });
                    labels.extend_from_slice(&y[lo..lo + take]);
                    if labels.len() < eff {
                        lo += take;
                        continue;
                    }
                    self.step_pieces(&mut pieces, &mut labels)?;
                }
                lo += take;
                done += 1;
                on_step(self, done, total)?;
            }
        }
        // The epoch's last batch, shorter than the others.
        if !labels.is_empty() {
            self.step_pieces(&mut pieces, &mut labels)?;
            done += 1;
            on_step(self, done, total)?;
        }
        Ok(())
    }

    /// [`Trainer::step`] on rows `lo..hi` of the device tensor `x`, labelled by `y`.
    fn step_device_rows(&mut self, x: &Tensor, y: &[u32], lo: usize, hi: usize) -> Result<()>
    where
        M: TrainModel<ClassBatch>,
    {
        let idx: Vec<usize> = (lo..hi).collect();
        self.step(&DeviceRows { x, y }, &idx)
    }

    /// One step on a batch assembled from row pieces of consecutive shards (joined on the
    /// device; (sum of rows, dim)); empties `pieces` and `labels`.
    fn step_pieces(&mut self, pieces: &mut Vec<Tensor>, labels: &mut Vec<u32>) -> Result<()>
    where
        M: TrainModel<ClassBatch>,
    {
        let x = match pieces.as_slice() {
            [one] => one.clone(),
            many => Tensor::cat(&many.iter().collect::<Vec<_>>(), 0)?,
        };
        pieces.clear();
        let y = std::mem::take(labels);
        self.step_device_rows(&x, &y, 0, y.len())
    }

    /// [`Trainer::step`] on host rows: `x` is (n, dim) row-major, one label per row in `y`.
    pub fn step_rows(&mut self, x: &[f32], y: &[u32]) -> Result<()>
    where
        M: TrainModel<ClassBatch>,
    {
        let rows = HostRows::new(x, y)?;
        let all: Vec<usize> = (0..y.len()).collect();
        self.step(&rows, &all)
    }

    /// [`Trainer::step`] with the inputs already on the device: `x` is (n, ...) f32 and each
    /// micro-batch is a row range of it (a sharded dataset's batches).
    pub fn step_on_device(&mut self, x: &Tensor, y: &[u32]) -> Result<()>
    where
        M: TrainModel<ClassBatch>,
    {
        if x.dims().first() != Some(&y.len()) || x.dtype() != DType::F32 {
            return Err(Error::Shape {
                op: "Trainer::step_on_device",
                lhs: x.dims().to_vec(),
                rhs: vec![y.len()],
                reason: "need f32 inputs with one row per label".into(),
            });
        }
        let all: Vec<usize> = (0..y.len()).collect();
        self.step(&DeviceRows { x, y }, &all)
    }
}
