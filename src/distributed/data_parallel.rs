//! [`DataParallel`]: one replica of a model per device in one process (several GPUs, or
//! several logical devices of one adapter), each a [`Trainer`] on a thread of its own with the
//! [`GradientAllReduce`](super::GradientAllReduce) over a [`LocalGroup`].
//!
//! A step hands the whole batch's indices to every replica; each runs its share (contiguous,
//! the first `n % replicas` one sample longer) with its own micro-batches, budget and planner,
//! and the summed gradients make every replica take the same update. The replicas therefore
//! stay bitwise identical, and the weights equal one device's with the same effective batch up
//! to float rounding (the sum of a batch's gradients is added in another order).

use super::allreduce::{parameter_values, AllReduceStats};
use super::comm::{LocalGroup, LOCAL_TIMEOUT};
use super::zero::{attach_zero, Zero};
use crate::nn::Module;
use crate::train::{BatchSource, Evaluation, Plan, TrainModel, Trainer};
use crate::{Device, Error, Result};
use std::sync::{Arc, Mutex};

/// Replicas of one model on several devices, trained on shares of each batch with their
/// gradients summed (see the module docs).
///
/// ```no_run
/// use fitgrad::distributed::DataParallel;
/// use fitgrad::nn::{Activation, Mlp, Module};
/// use fitgrad::optim::AdamW;
/// use fitgrad::train::{data, Trainer, TrainerConfig};
/// use fitgrad::Device;
/// # fn main() -> fitgrad::Result<()> {
/// let (train, _) = data::load("digits", 0)?;
/// // Two logical devices of one adapter; on a machine with two GPUs, one device on each.
/// let devices = [Device::new()?, Device::new()?];
/// let mut dp = DataParallel::new(&devices, |dev| {
///     let model = Mlp::new(dev, &[train.dim, 64, train.classes], Activation::Relu, 0)?;
///     let opt = Box::new(AdamW::new(model.parameters(), 1e-3)?);
///     Trainer::new(model, opt, TrainerConfig::new(64, 1, 1e-3))
/// })?;
/// dp.train_epoch(&train, 0, 0, |_, _, _| Ok(()))?;
/// dp.check_identical()?;
/// # Ok(()) }
/// ```
pub struct DataParallel<M> {
    replicas: Vec<Trainer<M>>,
    group: LocalGroup,
    stats: Vec<Arc<Mutex<AllReduceStats>>>,
    zero: Zero,
}

/// Runs `f` on every replica, each on its own thread, and returns the first replica's error
/// that started a failure (the others then report that replica). A replica that fails wakes
/// the others out of any collective they wait in; one that panics does too, and the panic is
/// passed on.
fn on_threads<M: Send>(
    replicas: &mut [Trainer<M>],
    group: &LocalGroup,
    f: impl Fn(usize, &mut Trainer<M>) -> Result<()> + Sync,
) -> Result<()> {
    /// Fails the group if dropped before `done` (a panic on the replica's thread).
    struct FailOnUnwind<'a>(&'a LocalGroup, usize, bool);
    impl Drop for FailOnUnwind<'_> {
        fn drop(&mut self) {
            if !self.2 {
                self.0.fail(self.1, "the replica's thread panicked");
            }
        }
    }
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = replicas
            .iter_mut()
            .enumerate()
            .map(|(i, t)| {
                let f = &f;
                s.spawn(move || {
                    let mut guard = FailOnUnwind(group, i, false);
                    let r = f(i, t);
                    if let Err(e) = &r {
                        group.fail(i, &e.to_string());
                    }
                    guard.2 = true;
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let first = group.failure().map(|(rank, _)| rank);
    let mut errors: Vec<(usize, Error)> = results
        .into_iter()
        .enumerate()
        .filter_map(|(i, r)| r.err().map(|e| (i, e)))
        .collect();
    match errors.iter().position(|(i, _)| Some(*i) == first) {
        Some(k) => Err(errors.swap_remove(k).1),
        None => errors.into_iter().next().map_or(Ok(()), |(_, e)| Err(e)),
    }
}

impl<M: Module + Send> DataParallel<M> {
    /// One replica per device, each built by `build` on its device (a trainer whose model
    /// lives there), then checked to hold the same model and settings as replica 0 (names,
    /// shapes, dtypes, precision, batch, learning rate, optimizer) and given replica 0's
    /// parameters. Each device keeps its own arena and budget.
    pub fn new(
        devices: &[Device],
        build: impl Fn(&Device) -> Result<Trainer<M>>,
    ) -> Result<DataParallel<M>> {
        Self::with_zero(devices, Zero::OFF, build)
    }

    /// [`DataParallel::new`] at ZeRO stage `zero` ([`attach_zero`]): each replica keeps the
    /// optimizer state (stage 1) and the gradients (stage 2) of its shard only; the
    /// parameters stay identical on every replica. At stage 3 (the parameters of the model's
    /// units sharded too) `build` may make the model inside
    /// [`born_on_host`](crate::residency::born_on_host), so no device ever holds it whole.
    pub fn with_zero(
        devices: &[Device],
        zero: Zero,
        build: impl Fn(&Device) -> Result<Trainer<M>>,
    ) -> Result<DataParallel<M>> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument {
                op: "DataParallel::new",
                reason: "data parallelism needs at least one device".into(),
            });
        }
        if let Some(i) = (1..devices.len()).find(|&i| devices[..i].contains(&devices[i])) {
            return Err(Error::InvalidArgument {
                op: "DataParallel::new",
                reason: format!(
                    "device {i} is the same device as an earlier one; open one Device per replica \
                     (several may share an adapter)"
                ),
            });
        }
        let mut replicas = Vec::with_capacity(devices.len());
        for (i, dev) in devices.iter().enumerate() {
            let t = build(dev)?;
            if t.device() != dev {
                return Err(Error::InvalidArgument {
                    op: "DataParallel::new",
                    reason: format!(
                        "the trainer built for device {i} ({}) lives on {}",
                        dev.info().adapter.name,
                        t.device().info().adapter.name
                    ),
                });
            }
            replicas.push(t);
        }
        let (group, members) = LocalGroup::new(devices.len(), LOCAL_TIMEOUT)?;
        let members = Mutex::new(members.into_iter().map(Some).collect::<Vec<_>>());
        let stats = Mutex::new(vec![None; devices.len()]);
        on_threads(&mut replicas, &group, |i, t| {
            let comm = crate::device::lock(&members)[i]
                .take()
                .expect("one member per replica");
            let s = attach_zero(t, comm, zero)?;
            crate::device::lock(&stats)[i] = Some(s);
            Ok(())
        })?;
        let stats = stats.into_inner().unwrap_or_else(|p| p.into_inner());
        Ok(DataParallel {
            replicas,
            group,
            stats: stats.into_iter().flatten().collect(),
            zero,
        })
    }

    /// One optimizer step over the samples `indices` of `data`, split across the replicas
    /// (see [`Trainer::step`]: each replica's micro-batching and out-of-memory retry apply to
    /// its share).
    pub fn step<D>(&mut self, data: &D, indices: &[usize]) -> Result<()>
    where
        D: BatchSource + Sync,
        M: TrainModel<D::Batch>,
    {
        on_threads(&mut self.replicas, &self.group, |_, t| {
            t.step(data, indices)
        })
    }

    /// Steps over one epoch of `data` in its seeded order, in effective batches, as
    /// [`Trainer::train_epoch`] does on one device; `on_step(self, done, total)` after each.
    pub fn train_epoch<D>(
        &mut self,
        data: &D,
        seed: u64,
        epoch: u64,
        mut on_step: impl FnMut(&mut Self, usize, usize) -> Result<()>,
    ) -> Result<()>
    where
        D: BatchSource + Sync,
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

    /// Each replica's planned step on `data` (its share of the first effective batch, with
    /// the all-reduce buffer), under its device's budget.
    pub fn plan<D>(&mut self, data: &D) -> Result<Vec<Plan>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        self.replicas.iter_mut().map(|t| t.plan(data)).collect()
    }

    /// Fits each replica's micro-batch to its own device's budget (replicas on devices without
    /// a budget keep theirs) and returns the micro-batches; see [`Trainer::fit_to_budget`].
    pub fn fit_to_budgets<D>(&mut self, data: &D) -> Result<Vec<usize>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        self.replicas
            .iter_mut()
            .map(|t| match t.device().memory_stats().budget {
                Some(b) => t.fit_to_budget(data, b),
                None => Ok(t.micro_batch()),
            })
            .collect()
    }

    /// Mean loss (and accuracy) over `data`, on replica 0 (every replica holds the same
    /// weights).
    pub fn evaluate<D>(&self, data: &D, batch: usize) -> Result<Evaluation>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        self.replicas[0].evaluate(data, batch)
    }

    /// The mean step loss of the whole batches since the last call (the all-reduce sums the
    /// replicas' shares, so every replica holds it), or NaN when no step ran.
    pub fn take_loss(&mut self) -> Result<f32> {
        let mut loss = f32::NAN;
        for (i, t) in self.replicas.iter_mut().enumerate() {
            let l = t.take_loss()?;
            if i == 0 {
                loss = l;
            }
        }
        Ok(loss)
    }

    /// Every replica's sharded parameters gathered into its model (ZeRO stage 3; see
    /// [`Trainer::gather_parameters`]).
    pub fn gather_parameters(&mut self) -> Result<()> {
        on_threads(&mut self.replicas, &self.group, |_, t| {
            t.gather_parameters()
        })
    }

    /// Reads every replica's parameters back and compares their bits with replica 0's; an
    /// [`Error::Distributed`] names the first replica and parameter that differ.
    pub fn check_identical(&self) -> Result<()> {
        let reference = parameter_values(&self.replicas[0].model)?;
        let names = self.replicas[0].model.named_parameters();
        for (r, t) in self.replicas.iter().enumerate().skip(1) {
            let values = parameter_values(&t.model)?;
            let mut start = 0;
            for (name, p) in &names {
                let range = start..start + p.numel();
                start = range.end;
                let same = values[range.clone()]
                    .iter()
                    .zip(&reference[range])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                if !same {
                    return Err(Error::Distributed {
                        rank: r,
                        reason: format!("parameter '{name}' differs from replica 0's"),
                    });
                }
            }
        }
        Ok(())
    }

    /// Saves replica 0's model, the optimizer and the position (see [`Trainer::save_checkpoint`]).
    /// Under ZeRO every replica joins in putting the optimizer state together (at stage 3 in
    /// gathering the units first, [`DataParallel::gather_parameters`]), and the file holds the
    /// whole state, as one device's trainer saves it.
    pub fn save_checkpoint(&mut self, path: &std::path::Path, epochs_done: u64) -> Result<()> {
        self.gather_parameters()?;
        on_threads(&mut self.replicas, &self.group, |i, t| match i {
            0 => t.save_checkpoint(path, epochs_done),
            _ => t.optimizer.checkpoint_state().map(drop),
        })
    }

    /// Restores every replica from a checkpoint of [`DataParallel::save_checkpoint`] (or of
    /// one device's trainer with the same model), or a sharded checkpoint's folder of any
    /// number of ranks, and returns the epochs done.
    pub fn resume_from(&mut self, path: &std::path::Path) -> Result<u64> {
        let ckpt = super::load_checkpoint(path)?;
        let mut epochs = 0;
        for t in &mut self.replicas {
            epochs = t.resume_from_checkpoint(&ckpt)?;
        }
        Ok(epochs)
    }

    /// A sharded checkpoint in the folder `dir` ([`zero::checkpoint`](super::zero::checkpoint)):
    /// replica `i` writes the file of rank `i`, then the index is written.
    pub fn save_sharded(&self, dir: &std::path::Path, epochs_done: u64) -> Result<()> {
        let sharded = self.zero.number() > 0;
        super::zero::checkpoint::save_replicas(&self.replicas, dir, epochs_done, sharded)
    }

    /// The all-reduce's time and buffer size per replica, summed over the steps so far.
    pub fn all_reduce_stats(&self) -> Vec<AllReduceStats> {
        self.stats
            .iter()
            .map(|s| crate::device::lock(s).clone())
            .collect()
    }

    /// The replicas, replica 0 first.
    pub fn replicas(&self) -> &[Trainer<M>] {
        &self.replicas
    }

    /// Replica `i`, to change its settings (a micro-batch, a scaler); changes that alter the
    /// math must be made on every replica alike.
    pub fn replica_mut(&mut self, i: usize) -> Option<&mut Trainer<M>> {
        self.replicas.get_mut(i)
    }

    /// Replica 0's model (every replica holds the same weights).
    pub fn model(&self) -> &M {
        &self.replicas[0].model
    }

    /// Samples per optimizer step, over all replicas together.
    pub fn effective_batch(&self) -> usize {
        self.replicas[0].effective_batch()
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.replicas[0].steps()
    }
}
