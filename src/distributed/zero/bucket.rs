//! Gradients taken off the device bucket by bucket (ZeRO stage 2): a backward pass's hook
//! reads a bucket's gradients into the step's flat host buffer, adding to what earlier
//! micro-batches left there, and frees them on the device as soon as the last of them is
//! complete, so the full gradient set never exists on the device at once. What the hook did
//! not take (stage 1, parameters without a gradient in some bucket, any gradient added after
//! its bucket was read) is read the same way when the exchange starts.

use super::{ShardLayout, Zero};
use crate::distributed::allreduce::gather;
use crate::{Device, Result, Tensor};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// The step's gradients gathered so far on the host.
#[derive(Default)]
pub(super) struct Pending {
    /// The step they belong to (`None` before its first micro-batch).
    pub step: Option<u64>,
    /// The flat, padded sums of this replica's micro-batches.
    pub flat: Vec<f32>,
    /// Which parameters had a gradient.
    pub has: Vec<bool>,
}

impl Pending {
    /// Starts step `step` with zeros for `len` elements of `params` parameters.
    pub fn reset(&mut self, step: u64, len: usize, params: usize) {
        self.step = Some(step);
        self.flat = vec![0.0; len];
        self.has = vec![false; params];
    }
}

/// Consecutive parameter ranges, last parameters first (backward's order), of about `bucket`
/// elements each (stage 2), or one range of all of them (stage 1).
pub(super) fn buckets(numels: &[usize], zero: Zero) -> Vec<Range<usize>> {
    if zero.number() < 2 {
        return std::iter::once(0..numels.len()).collect();
    }
    let mut out = Vec::new();
    let mut end = numels.len();
    while end > 0 {
        let mut start = end - 1;
        let mut n = numels[start];
        while start > 0 && n + numels[start - 1] <= zero.bucket() {
            start -= 1;
            n += numels[start];
        }
        out.push(start..end);
        end = start;
    }
    out
}

/// Reads the gradients of bucket `b` of `params` (those there are) into `pending`'s flat
/// buffer, adding, and frees them on the device. While planning only the staging buffer is
/// counted.
pub(super) fn read_bucket(
    dev: &Device,
    layout: &ShardLayout,
    params: &[Tensor],
    b: Range<usize>,
    pending: &mut Pending,
    planning: bool,
) -> Result<()> {
    let grads: Vec<Option<Tensor>> = params[b.clone()].iter().map(Tensor::grad).collect();
    if grads.iter().all(Option::is_none) {
        return Ok(());
    }
    let lo = layout.offsets()[b.start];
    let hi = layout.offsets()[b.end - 1] + layout.numels()[b.end - 1];
    let rel: Vec<usize> = layout.offsets()[b.clone()].iter().map(|o| o - lo).collect();
    let values = gather(dev, &grads, &rel, hi - lo, None)?;
    let had: Vec<bool> = grads.iter().map(Option::is_some).collect();
    drop(grads);
    for p in &params[b.clone()] {
        p.zero_grad();
    }
    if !planning {
        for (i, h) in b.zip(had) {
            pending.has[i] |= h;
        }
        // The f32 additions the device's in-place accumulation would make, in the same order.
        for (s, v) in pending.flat[lo..hi].iter_mut().zip(&values) {
            *s += v;
        }
    }
    Ok(())
}

/// The hook of one micro-batch's backward at stage 2: each leaf of `params` counted off its
/// bucket, the bucket read and freed when its last leaf is complete.
pub(super) fn hook(
    dev: Device,
    layout: Arc<ShardLayout>,
    params: Vec<Tensor>,
    zero: Zero,
    pending: Arc<Mutex<Pending>>,
) -> crate::tensor::autograd::LeafHook {
    let planning = dev.is_planning();
    let of_leaf: HashMap<usize, usize> = params
        .iter()
        .enumerate()
        .filter_map(|(i, p)| crate::tensor::autograd::leaf_id(p).map(|id| (id, i)))
        .collect();
    let bks = buckets(layout.numels(), zero);
    let mut bucket_of = vec![0; params.len()];
    for (k, b) in bks.iter().enumerate() {
        b.clone().for_each(|i| bucket_of[i] = k);
    }
    let mut remaining: Vec<usize> = bks.iter().map(|b| b.len()).collect();
    Box::new(move |leaf| {
        let Some(&i) = of_leaf.get(&leaf) else {
            return Ok(());
        };
        let k = bucket_of[i];
        remaining[k] = remaining[k].saturating_sub(1);
        if remaining[k] > 0 {
            return Ok(());
        }
        let mut p = crate::device::lock(&pending);
        read_bucket(&dev, &layout, &params, bks[k].clone(), &mut p, planning)
    })
}
