//! The gradient all-reduce of a data-parallel step ([`GradientAllReduce`], the trainer's
//! [`GradientSync`]) and what makes replicas start identical ([`attach`]: the same model and
//! settings on every member, checked by a hash; rank 0's parameters copied to the others).
//!
//! One step's round trip: every gradient (and the step's loss) is copied on the device into
//! one flat f32 buffer taken from the arena as [`Category::Communication`] (so the planner
//! counts it), read back once, summed over the members by the [`Communicator`] in one call,
//! and written back into the gradients in place. Each member's gradients were already weighted
//! by its share of the whole batch (the trainer's loss weights), so the sum is the gradient of
//! the batch mean and no scaling is left to do.

use super::comm::{share_of, Communicator};
use crate::kernels::layout::{copy_block, Span};
use crate::memory::Category;
use crate::nn::Module;
use crate::train::{GradientSync, Trainer};
use crate::{DType, Device, Error, Result, Shape, Tensor};
use std::collections::HashSet;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where the all-reduce time of data-parallel training goes, summed over its steps (what a
/// benchmark or a report reads; [`AllReduceStats::round_trip`] is the host round trip).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct AllReduceStats {
    /// Steps whose gradients went through the all-reduce.
    pub steps: u64,
    /// Bytes of the last step's host buffer (one f32 per gradient element, the loss, one flag
    /// per parameter).
    pub buffer_bytes: u64,
    /// Waiting for the device to finish the step's backward (not part of the round trip).
    pub backward_wait: Duration,
    /// Copying the gradients into the flat buffer on the device and reading it back.
    pub gather: Duration,
    /// The collective itself (all-reduce and the step check), including waiting for the
    /// slowest member.
    pub communicate: Duration,
    /// Writing the sums back into the gradients.
    pub scatter: Duration,
    /// Steps whose sums differed between members and were replaced by rank 0's.
    pub repaired: u64,
}

impl AllReduceStats {
    /// Gather, communication and scatter together, over all steps.
    pub fn round_trip(&self) -> Duration {
        self.gather + self.communicate + self.scatter
    }

    /// The mean round trip of one step.
    pub fn round_trip_per_step(&self) -> Duration {
        self.round_trip() / self.steps.max(1) as u32
    }
}

/// The start of each tensor's values in the flat buffer, and the values in all.
fn layout(tensors: &[Tensor]) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut total = 0;
    for t in tensors {
        offsets.push(total);
        total += t.numel();
    }
    (offsets, total)
}

/// Copies `tensors` (absent ones, and gaps between `offsets`, as zeros) and then `extra` into one f32 buffer of the arena
/// (counted as communication) and reads it back: `total + extra.len()` values, one readback.
pub(super) fn gather(
    device: &Device,
    tensors: &[Option<Tensor>],
    offsets: &[usize],
    total: usize,
    extra: Option<&Tensor>,
) -> Result<Vec<f32>> {
    let _c = device.category_scope(Category::Communication);
    let len = total + extra.map_or(0, Tensor::numel);
    let dense = offsets
        .iter()
        .zip(tensors)
        .all(|(&o, t)| t.as_ref().is_some_and(|t| o + t.numel() <= total))
        && tensors.iter().flatten().map(Tensor::numel).sum::<usize>() == total;
    let flat = if dense {
        Tensor::uninit(device, Shape::new(&[len])?, DType::F32)?
    } else {
        Tensor::zeros(device, &[len], DType::F32)?
    };
    let at = |t: &Tensor, offset: usize| -> Result<()> {
        let n = t.numel();
        // An f16 tensor goes through an f32 copy, freed as soon as its copy is recorded.
        let t32 = match t.dtype() {
            DType::F32 => t.clone(),
            _ => t.to_dtype(DType::F32)?,
        };
        let from = Span {
            axis_len: n,
            offset: 0,
        };
        let to = Span {
            axis_len: len,
            offset,
        };
        copy_block(&t32, from, &flat, to, (1, n, 1))
    };
    for (t, &offset) in tensors.iter().zip(offsets) {
        if let Some(t) = t {
            at(t, offset)?;
        }
    }
    if let Some(e) = extra {
        at(e, total)?;
    }
    flat.to_vec::<f32>()
}

/// The bytes of `values` in `dtype` (f16 rounded to nearest).
fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(values).to_vec(),
        _ => {
            let h: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
            bytemuck::cast_slice(&h).to_vec()
        }
    }
}

/// Writes `values` into `t`'s memory (same element count), in `t`'s dtype: a streamed
/// tensor's host values (and its device copy, when it has one), no device block of its own.
pub(super) fn write_into(t: &Tensor, values: &[f32]) -> Result<()> {
    t.write_bytes(&encode(values, t.dtype()))
}

/// Rank 0's values of `tensors` written into every other member's, in one broadcast (what
/// makes batch norm's running statistics agree across replicas). Nothing while planning.
pub(super) fn broadcast_from_rank0(comm: &mut dyn Communicator, tensors: &[Tensor]) -> Result<()> {
    let Some(first) = tensors.first() else {
        return Ok(());
    };
    if first.device().is_planning() {
        return Ok(());
    }
    let mut values = Vec::with_capacity(tensors.iter().map(Tensor::numel).sum());
    for t in tensors {
        match comm.rank() {
            0 => values.extend(t.to_vec_f32()?),
            _ => values.resize(values.len() + t.numel(), 0.0),
        }
    }
    comm.broadcast(bytemuck::cast_slice_mut(&mut values))?;
    if comm.rank() != 0 {
        let mut at = 0;
        for t in tensors {
            write_into(t, &values[at..at + t.numel()])?;
            at += t.numel();
        }
    }
    Ok(())
}

/// A new gradient for `p` holding `values`, in `p`'s dtype, counted as a gradient.
pub(super) fn new_grad(p: &Tensor, values: &[f32]) -> Result<Tensor> {
    let dev = p.device();
    let _c = dev.category_scope(Category::Gradients);
    match p.dtype() {
        DType::F32 => Tensor::from_slice(dev, values, p.dims()),
        _ => {
            let h: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
            Tensor::from_slice(dev, &h, p.dims())
        }
    }
}

/// FNV-1a over the bits of `values`: the same sums on every member give the same hash.
pub(super) fn hash_values(values: &[f32]) -> u64 {
    crate::hash::Fnv1a::default()
        .words(values.iter().map(|v| u64::from(v.to_bits())))
        .finish()
}

/// FNV-1a over bytes.
fn hash_bytes(bytes: &[u8]) -> u64 {
    crate::hash::fnv1a(bytes)
}

/// The trainer's [`GradientSync`] over a [`Communicator`]: this member's share of each batch
/// and the all-reduce of the step's gradients and loss. Installed by [`attach`].
pub struct GradientAllReduce<C> {
    comm: C,
    /// The last step reduced and its sums, reapplied when the trainer redoes that step.
    last: Option<(u64, Vec<f32>)>,
    stats: Arc<Mutex<AllReduceStats>>,
}

impl<C: Communicator> GradientAllReduce<C> {
    fn error(&self, reason: String) -> Error {
        Error::Distributed {
            rank: self.comm.rank(),
            reason,
        }
    }

    /// After the all-reduce: every member is at the same step with the same layout, and got
    /// the same sums (an MPI library may add in another order on each rank; rank 0's sums
    /// then replace the others', so replicas never drift apart).
    fn check(&mut self, step: u64, sums: &mut [f32]) -> Result<()> {
        let size = self.comm.size();
        let all = self
            .comm
            .all_gather(&[step, sums.len() as u64, hash_values(sums)])?;
        let at = |r: usize, k: usize| all[r * 3 + k];
        if let Some(r) = (0..size).find(|&r| at(r, 0) != step || at(r, 1) != sums.len() as u64) {
            return Err(self.error(format!(
                "rank {r} was at step {} with {} all-reduce values while rank {} was at step \
                 {step} with {}: the ranks no longer run the same steps",
                at(r, 0),
                at(r, 1),
                self.comm.rank(),
                sums.len()
            )));
        }
        if (0..size).any(|r| at(r, 2) != at(0, 2)) {
            self.comm.broadcast(bytemuck::cast_slice_mut(sums))?;
            crate::device::lock(&self.stats).repaired += 1;
            log::warn!("step {step}: the all-reduce gave other sums on some ranks; rank 0's used");
        }
        Ok(())
    }
}

impl<C: Communicator> GradientSync for GradientAllReduce<C> {
    fn share(&self, n: usize) -> Range<usize> {
        share_of(n, self.comm.rank(), self.comm.size())
    }

    fn reduce(&mut self, step: u64, params: &[Tensor], loss: &Tensor) -> Result<()> {
        let dev = loss.device().clone();
        let grads: Vec<Option<Tensor>> = params.iter().map(Tensor::grad).collect();
        let (offsets, total) = layout(params);
        if dev.is_planning() {
            // The buffer's memory is what the plan needs; nothing is exchanged.
            return gather(&dev, &grads, &offsets, total, Some(loss)).map(drop);
        }
        let sums = match self.last.take() {
            Some((s, sums)) if s == step => {
                self.last = Some((s, sums.clone()));
                sums
            }
            _ => {
                let t0 = Instant::now();
                dev.sync()?;
                let t1 = Instant::now();
                let mut buf = gather(&dev, &grads, &offsets, total, Some(loss))?;
                // One flag per parameter: which have a gradient anywhere (a parameter no
                // member's loss reached keeps none, as on one device).
                buf.extend(grads.iter().map(|g| f32::from(u8::from(g.is_some()))));
                let t2 = Instant::now();
                self.comm.all_reduce_sum(&mut buf)?;
                self.check(step, &mut buf)?;
                let t3 = Instant::now();
                let mut st = crate::device::lock(&self.stats);
                st.steps += 1;
                st.buffer_bytes = (buf.len() * 4) as u64;
                st.backward_wait += t1 - t0;
                st.gather += t2 - t1;
                st.communicate += t3 - t2;
                drop(st);
                buf
            }
        };
        let t3 = Instant::now();
        let mut written = HashSet::new();
        for (i, (p, g)) in params.iter().zip(&grads).enumerate() {
            if sums[total + 1 + i] == 0.0 {
                continue;
            }
            let values = &sums[offsets[i]..offsets[i] + p.numel()];
            match g {
                // In place, unless two parameters share one gradient block (set by hand):
                // the second then gets its own.
                Some(g)
                    if written.insert((g.block().plan_id, g.block().segment, g.block().offset)) =>
                {
                    write_into(g, values)?
                }
                _ => p.set_grad(Some(new_grad(p, values)?))?,
            }
        }
        write_into(loss, &sums[total..total + 1])?;
        crate::device::lock(&self.stats).scatter += t3.elapsed();
        self.last = Some((step, sums));
        Ok(())
    }

    fn sync_buffers(&mut self, buffers: &[Tensor]) -> Result<()> {
        broadcast_from_rank0(&mut self.comm, buffers)
    }
}

/// What must be equal on every member: the parameters' names, dtypes and shapes, the trainer's
/// settings that change the math (precision, batch, accumulation, learning rate, schedule,
/// clipping, finite checks) and the optimizer with its hyperparameters. One line each.
fn describe<M: Module>(trainer: &Trainer<M>, extra: &[String]) -> Vec<String> {
    let mut lines: Vec<String> = trainer
        .model
        .named_parameters()
        .iter()
        .map(|(name, p)| format!("parameter {name}: {} {:?}", p.dtype(), p.dims()))
        .collect();
    let c = trainer.config();
    lines.push(format!("precision {}", c.precision.name()));
    lines.push(format!(
        "batch {} x {} accumulation steps",
        c.batch_size, c.accum_steps
    ));
    lines.push(format!("learning rate {} ({})", c.lr, c.schedule));
    lines.push(format!("gradient clipping {:?}", c.clip_grad_norm));
    lines.push(format!("finite check every {} steps", c.check_finite_every));
    lines.push(format!("optimizer {}", trainer.optimizer.name()));
    for (k, v) in trainer.optimizer.hyperparameters() {
        lines.push(format!("optimizer {k} = {v}"));
    }
    lines.extend_from_slice(extra);
    lines
}

/// Every member's description hashes the same, or every member returns an error (rank 0's
/// description is sent to the others, which name their first difference).
pub(super) fn check_same_run<M: Module>(
    trainer: &Trainer<M>,
    comm: &mut dyn Communicator,
    extra: &[String],
) -> Result<()> {
    let lines = describe(trainer, extra);
    let text = lines.join("\n");
    let hashes = comm.all_gather(&[hash_bytes(text.as_bytes())])?;
    let differ: Vec<usize> = (0..comm.size())
        .filter(|&r| hashes[r] != hashes[0])
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    let mut len = (text.len() as u64).to_le_bytes();
    comm.broadcast(&mut len)?;
    let mut theirs = vec![0u8; u64::from_le_bytes(len) as usize];
    if comm.rank() == 0 {
        theirs.copy_from_slice(text.as_bytes());
    }
    comm.broadcast(&mut theirs)?;
    let theirs = String::from_utf8_lossy(&theirs).into_owned();
    let theirs: Vec<&str> = theirs.lines().collect();
    let first = (0..lines.len().max(theirs.len()))
        .find(|&i| lines.get(i).map(String::as_str) != theirs.get(i).copied());
    let detail = match first {
        Some(i) if comm.rank() != 0 => format!(
            "this rank has '{}' where rank 0 has '{}'",
            lines.get(i).map_or("nothing", String::as_str),
            theirs.get(i).copied().unwrap_or("nothing")
        ),
        _ => "each of them names its first difference".into(),
    };
    Err(Error::Distributed {
        rank: comm.rank(),
        reason: format!(
            "ranks {differ:?} hold another model or other training settings than rank 0 (a \
             hash of parameter names, shapes and dtypes and of the settings): {detail}; start \
             every rank with the same model and flags"
        ),
    })
}

/// The parameters' values in one host buffer, in `named_parameters` order, read tensor by
/// tensor so the device never holds a second copy of the model (one flat staging buffer would
/// double the parameters' bytes at a replica's start and whenever the weights are hashed).
/// Streamed parameters (ZeRO stage 3's units) are read from their host copies.
pub(crate) fn parameter_values(model: &dyn Module) -> Result<Vec<f32>> {
    let params = model.parameters();
    let (offsets, total) = layout(&params);
    let mut values = vec![0f32; total];
    for (p, &o) in params.iter().zip(&offsets) {
        values[o..o + p.numel()].copy_from_slice(&p.to_vec_f32()?);
    }
    Ok(values)
}

/// Replaces every member's parameters by rank 0's, bitwise. Parameters whose home is host
/// memory (a model made inside [`born_on_host`](crate::residency::born_on_host)) are read and
/// written there: the device never holds them.
pub(super) fn copy_from_rank0<M: Module>(
    trainer: &Trainer<M>,
    comm: &mut dyn Communicator,
) -> Result<()> {
    let params = trainer.model.parameters();
    let mut values = parameter_values(&trainer.model)?;
    comm.broadcast(bytemuck::cast_slice_mut(&mut values))?;
    if comm.rank() != 0 {
        let (offsets, _) = layout(&params);
        for (p, &o) in params.iter().zip(&offsets) {
            write_into(p, &values[o..o + p.numel()])?;
        }
    }
    Ok(())
}

/// Makes `trainer` one member of data-parallel training over `comm`: checks that every member
/// holds the same model and settings (an [`Error::Distributed`] on every member otherwise),
/// copies rank 0's parameters to the others, and installs the [`GradientAllReduce`]. Every
/// member calls it at the same point. From then on the trainer's own API (steps, epochs,
/// plans, budgets, checkpoints) runs this member's share of each batch and the all-reduce;
/// the returned statistics fill as it trains.
///
/// Optimizer state is not copied: attach fresh trainers, or ones resumed from the same
/// checkpoint.
pub fn attach<M: Module, C: Communicator + 'static>(
    trainer: &mut Trainer<M>,
    mut comm: C,
) -> Result<Arc<Mutex<AllReduceStats>>> {
    if trainer.has_gradient_sync() {
        return Err(Error::InvalidArgument {
            op: "distributed::attach",
            reason: "this trainer is already a data-parallel replica".into(),
        });
    }
    check_same_run(trainer, &mut comm, &[])?;
    copy_from_rank0(trainer, &mut comm)?;
    let stats = Arc::new(Mutex::new(AllReduceStats::default()));
    trainer.set_gradient_sync(Some(Box::new(GradientAllReduce {
        comm,
        last: None,
        stats: stats.clone(),
    })));
    Ok(stats)
}
