//! The hook that data-parallel training plugs into the [`Trainer`](super::Trainer): which share
//! of each batch a replica runs, and the gradient all-reduce between its backward passes and
//! its update (src/distributed implements it, in one process and over MPI).
//!
//! With a hook set, a step over the indices of a whole batch of `n` samples runs only this
//! replica's share of them, weights each micro-batch's loss by its share of all `n` (so summed
//! gradients are those of the whole batch's mean), then calls [`GradientSync::reduce`] before
//! loss-scale unscaling, clipping, the finite check and the update. Every replica then sees the
//! same gradients and takes the same decisions. The model's buffers (running statistics) are
//! then made rank 0's on every replica ([`GradientSync::sync_buffers`]). Planning calls the hook too (on the device's
//! planning mode), so its buffer is part of the plan.

use crate::{Result, Tensor};
use std::ops::Range;

/// What a replica does to join a data-parallel step. `Send`, so a trainer holding one can run
/// on a worker thread.
pub trait GradientSync: Send {
    /// The positions, in a batch of `n` samples, of this replica's share (may be empty when
    /// `n` is smaller than the number of replicas).
    fn share(&self, n: usize) -> Range<usize>;

    /// Replaces the gradients of `params` (summed over this replica's micro-batches) and the
    /// step's `loss` (a one-element f32 tensor) by their sums over all replicas, identically
    /// on every replica. `step` is the trainer's step number: a call with the step of the last
    /// completed reduce (a step redone after an out-of-memory) reapplies that result. While
    /// the device is planning it allocates what it would, and communicates nothing.
    fn reduce(&mut self, step: u64, params: &[Tensor], loss: &Tensor) -> Result<()>;

    /// Makes the model's buffers (batch norm's running statistics) the same on every replica
    /// after a step's forwards updated each from its own share: rank 0's values, as PyTorch
    /// DDP's `broadcast_buffers`. Called after [`GradientSync::reduce`]; while planning it
    /// communicates nothing. Nothing by default.
    fn sync_buffers(&mut self, _buffers: &[Tensor]) -> Result<()> {
        Ok(())
    }

    /// Called before each micro-batch's backward of step `step` (`first`: the step's first
    /// micro-batch) with the model's parameters: a hook the backward pass calls with each
    /// leaf's id as soon as that leaf's gradient is complete for the pass, so a replica can
    /// take gradients off the device while backward still runs (ZeRO stage 2). `None` by
    /// default.
    fn backward_hook(
        &mut self,
        step: u64,
        params: &[Tensor],
        first: bool,
    ) -> Result<Option<crate::tensor::autograd::LeafHook>> {
        let _ = (step, params, first);
        Ok(None)
    }

    /// Brings every parameter of the model to this replica's host copies where they are
    /// sharded (ZeRO stage 3: each unit all-gathered from the ranks), so reading the model sees
    /// the trained values; every replica calls it at once. Nothing by default.
    fn gather_parameters(&self) -> Result<()> {
        Ok(())
    }

    /// The model's parameters were written from outside a step (a checkpoint resumed): where
    /// this replica keeps its own shard of them apart from the model (ZeRO stage 3's units),
    /// it takes that shard again from the values written. Nothing by default.
    fn parameters_written(&mut self) -> Result<()> {
        Ok(())
    }

    /// The groups of parameters laid out over the ranks together, each by its own
    /// `ShardLayout`, as indices into the optimizer's parameters, in the order the rest of the
    /// step's tensors ([`GradientSync::step_tensors`]) take their pieces: ZeRO stage 3's
    /// parameters in no unit, then each unit's. `None` (one group of every parameter) by
    /// default.
    fn shard_groups(&self) -> Option<Vec<Vec<usize>>> {
        None
    }

    /// The collectives its last step made for parameters sharded by unit (ZeRO stage 3: the
    /// units' all-gathers and reduce-scatters, as the step ran them, planned or real); `None`
    /// where nothing is sharded by unit.
    fn unit_traffic(&self) -> Option<UnitTraffic> {
        None
    }

    /// The tensors whose gradients the rest of the step reads (unscaling, clipping, the finite
    /// check) and the optimizer updates, when they are not the model's parameters: under ZeRO,
    /// views of this replica's shard. `None` by default.
    fn step_tensors(&self) -> Option<Vec<Tensor>> {
        None
    }

    /// Whether `local`, found on this replica's gradients, holds on any replica. Replicas
    /// holding different shards of the gradients must still take the same decision (skip a
    /// step, stop); replicated gradients need no exchange, so the default is `local`.
    fn any(&mut self, local: bool) -> Result<bool> {
        Ok(local)
    }

    /// The global gradient norm from this replica's `local` norm: the norm of every replica's
    /// norms when the gradients are sharded, `local` when they are replicated.
    fn global_norm(&mut self, local: f32) -> Result<f32> {
        Ok(local)
    }
}

/// What the collectives of sharded units moved (ZeRO stage 3): counts, and the bytes of their
/// results (the padded units, gathered or reduce-scattered), added up over a span of time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnitTraffic {
    /// All-gathers of a unit (before its forward, or its recomputation).
    pub gathers: u64,
    /// Bytes of the gathered units.
    pub gathered_bytes: u64,
    /// Reduce-scatters of a unit's gradients.
    pub scatters: u64,
    /// Bytes of the reduce-scattered gradients.
    pub scattered_bytes: u64,
}

impl UnitTraffic {
    /// What was moved between `earlier` and `self` (both cumulative).
    pub fn since(&self, earlier: &UnitTraffic) -> UnitTraffic {
        UnitTraffic {
            gathers: self.gathers - earlier.gathers,
            gathered_bytes: self.gathered_bytes - earlier.gathered_bytes,
            scatters: self.scatters - earlier.scatters,
            scattered_bytes: self.scattered_bytes - earlier.scattered_bytes,
        }
    }
}
