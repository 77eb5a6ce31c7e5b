//! Rows already in memory as data sources: host slices ([`HostRows`], for
//! [`Trainer::step_rows`](super::Trainer::step_rows)) and row ranges of a device tensor (a
//! dataset shard).

use super::model::{BatchSource, ClassBatch, Features};
use crate::{Error, Result, Tensor};

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
