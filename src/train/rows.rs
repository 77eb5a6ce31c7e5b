//! Rows already in memory as data sources: host slices ([`HostRows`], for
//! [`Trainer::step_rows`](super::Trainer::step_rows)), row ranges of a device tensor (a
//! dataset shard), and the planner's view of a sharded epoch ([`ShardedView`]).

use super::data::Dataset;
use super::model::{BatchSource, ClassBatch, Features};
use crate::{DType, Device, Error, Result, Tensor};

/// Host rows and labels borrowed as a data source.
pub struct HostRows<'a> {
    x: &'a [f32],
    y: &'a [u32],
    dim: usize,
}

impl<'a> HostRows<'a> {
    /// `x` is (y.len(), dim) row-major; at least one row.
    pub fn new(x: &'a [f32], y: &'a [u32]) -> Result<HostRows<'a>> {
        let n = y.len();
        if n == 0 || !x.len().is_multiple_of(n) || x.is_empty() {
            return Err(Error::Shape {
                op: "Trainer::step",
                lhs: vec![x.len()],
                rhs: vec![n],
                reason: format!(
                    "need {n} rows of features and at least one sample, got {} values",
                    x.len()
                ),
            });
        }
        Ok(HostRows {
            x,
            y,
            dim: x.len() / n,
        })
    }
}

impl BatchSource for HostRows<'_> {
    type Batch = ClassBatch;
    fn len(&self) -> usize {
        self.y.len()
    }
    fn batch(&self, indices: &[usize]) -> Result<ClassBatch> {
        let (lo, hi) = contiguous("HostRows::batch", indices, self.y.len())?;
        Ok(ClassBatch {
            x: Features::Host {
                data: self.x[lo * self.dim..hi * self.dim].to_vec(),
                dims: vec![hi - lo, self.dim],
            },
            y: self.y[lo..hi].to_vec(),
        })
    }
    fn epoch_order(&self, _seed: u64, _epoch: u64) -> Vec<usize> {
        (0..self.y.len()).collect()
    }
}

/// Rows of a device tensor (a shard) and their labels as a data source; batches are row
/// ranges copied by the copy engine.
pub(super) struct DeviceRows<'a> {
    pub(super) x: &'a Tensor,
    pub(super) y: &'a [u32],
}

impl BatchSource for DeviceRows<'_> {
    type Batch = ClassBatch;
    fn len(&self) -> usize {
        self.y.len()
    }
    fn batch(&self, indices: &[usize]) -> Result<ClassBatch> {
        let (lo, hi) = contiguous("DeviceRows::batch", indices, self.y.len())?;
        let x = if lo == 0 && hi == self.y.len() {
            self.x.clone()
        } else {
            self.x.rows(lo, hi)?
        };
        Ok(ClassBatch {
            x: Features::Device(x),
            y: self.y[lo..hi].to_vec(),
        })
    }
    fn epoch_order(&self, _seed: u64, _epoch: u64) -> Vec<usize> {
        (0..self.y.len()).collect()
    }
}

/// An in-memory dataset as [`Trainer::train_epoch_sharded`](super::Trainer::train_epoch_sharded)
/// trains it in shards of `shard_size` samples: the same batches, plus the device memory the
/// epoch holds while a step runs, so plans, budgets and preallocation made on this view count
/// it. That memory is two shards, each (shard_size, dim) f32 (the one training and the next,
/// already uploaded; one when the epoch is a single shard), and, where a batch can span two
/// shards or the epoch ends in a short batch, that batch's rows joined on the device
/// (effective batch, dim). Without a shard size it is the dataset itself.
pub struct ShardedView<'a> {
    data: &'a Dataset,
    shard_size: Option<usize>,
    effective_batch: usize,
}

impl<'a> ShardedView<'a> {
    /// `data` trained in shards of `shard_size` samples (None: in memory) with effective
    /// batches of `effective_batch` samples; both at least 1.
    pub fn new(
        data: &'a Dataset,
        shard_size: Option<usize>,
        effective_batch: usize,
    ) -> Result<ShardedView<'a>> {
        if shard_size == Some(0) || effective_batch == 0 {
            return Err(Error::InvalidArgument {
                op: "ShardedView::new",
                reason: format!(
                    "the shard size and the effective batch must be at least 1, got {shard_size:?} and {effective_batch}"
                ),
            });
        }
        Ok(ShardedView {
            data,
            shard_size,
            effective_batch,
        })
    }
}

impl BatchSource for ShardedView<'_> {
    type Batch = ClassBatch;
    fn len(&self) -> usize {
        self.data.len()
    }
    fn batch(&self, indices: &[usize]) -> Result<ClassBatch> {
        self.data.batch(indices)
    }
    fn epoch_order(&self, seed: u64, epoch: u64) -> Vec<usize> {
        self.data.epoch_order(seed, epoch)
    }
    fn resident(&self, device: &Device) -> Result<Vec<Tensor>> {
        let (Some(shard), n) = (self.shard_size, self.data.len()) else {
            return Ok(Vec::new());
        };
        let (rows, shards) = (shard.min(n), n.div_ceil(shard));
        let eff = self.effective_batch.min(n);
        let mut held = Vec::new();
        for _ in 0..shards.min(2) {
            held.push(Tensor::zeros(device, &[rows, self.data.dim], DType::F32)?);
        }
        if !shard.is_multiple_of(eff) || !n.is_multiple_of(eff) {
            held.push(Tensor::zeros(device, &[eff, self.data.dim], DType::F32)?);
        }
        Ok(held)
    }
}

/// The range `indices` covers, which must be ascending and contiguous within `len`.
fn contiguous(op: &'static str, indices: &[usize], len: usize) -> Result<(usize, usize)> {
    let lo = indices.first().copied().unwrap_or(0);
    let hi = lo + indices.len();
    if hi > len || indices.iter().enumerate().any(|(k, &i)| i != lo + k) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("rows must be a contiguous range within 0..{len}"),
        });
    }
    Ok((lo, hi))
}
