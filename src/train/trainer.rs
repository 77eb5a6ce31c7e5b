//! The training loop. One optimizer step consumes an *effective batch* of
//! `batch_size * accum_steps` samples, run as micro-batches of `micro_batch` samples whose
//! gradients add up in place. Each micro-batch's mean loss is weighted by its share of the
//! effective batch, so the update is the same however the batch is split (up to float rounding):
//! `--batch-size 64` gives the same weights as `--batch-size 16 --accum-steps 4`.
//!
//! The trainer is generic: any [`TrainModel`] on any [`BatchSource`]. The planner
//! (train/plan.rs) runs this same step code on the device's planning mode; the loops over a
//! dataset that feed the step are in train/epoch.rs.

use super::config::TrainerConfig;
use super::events::TrainEvent;
use super::model::{Batch, BatchSource, StepContext, TrainModel};
use super::summary::{MemorySummary, REMEDY};
use super::sync::GradientSync;
use super::Precision;
use crate::memory::Category;
use crate::nn::Module;
use crate::optim::{GradScaler, Optimizer};
use crate::{DType, Device, Error, Result, Tensor};

/// Trains `model` with `optimizer`: micro-batches under a budget, accumulation, mixed precision
/// with loss scaling, out-of-memory retry, checkpoints. `Send` when the model is.
pub struct Trainer<M> {
    /// The model being trained.
    pub model: M,
    /// The optimizer over the model's parameters.
    pub optimizer: Box<dyn Optimizer>,
    pub(super) config: TrainerConfig,
    pub(super) device: Device,
    /// Optimizer steps taken.
    pub(super) step: u64,
    /// Sum of step losses since the last `take_loss`, kept on the GPU so a step never waits for
    /// a readback.
    pub(super) loss_sum: Tensor,
    /// The current step's loss, added to `loss_sum` only once the step succeeds (kept, so a step
    /// allocates no accumulator).
    pub(super) step_loss: Tensor,
    pub(super) loss_steps: u64,
    /// Samples per forward/backward now (halved after an out-of-memory).
    pub(super) micro: usize,
    pub(super) scaler: Option<GradScaler>,
    /// What the trainer changed on its own (micro-batch halvings, skipped steps), for the log.
    pub(super) events: Vec<TrainEvent>,
    /// Data-parallel training: this replica's share of each batch and the gradient all-reduce.
    pub(super) sync: Option<Box<dyn GradientSync>>,
    /// What the run trains on (`set_data_identity`), stored in checkpoints and checked on
    /// resume.
    pub(super) data_identity: Vec<(String, String)>,
    /// Streamed parameters (`offload_parameters`), while on.
    pub(super) streaming: Option<crate::residency::Streaming>,
    /// What the model's birth in host memory turned on that the configuration did not ask
    /// for (ZeRO stage 3 turns it off again: its units stream from the ranks).
    pub(super) born: super::born::BornOnHost,
}

impl<M: Module> Trainer<M> {
    /// A trainer for `model`, whose parameters `optimizer` updates. The parameters' dtype must
    /// be the precision's (f16 for [`Precision::F16`], else f32).
    ///
    /// A model made inside [`born_on_host`](crate::residency::born_on_host) (its units in host
    /// memory) is streamed: `offload_parameters` (and so `offload_optimizer`) is turned on; an
    /// optimizer whose state cannot live in host memory (SGD) keeps it on the device, and steps
    /// are refused until a ZeRO stage 3 attach ends the streaming.
    /// Made a ZeRO stage-3 replica ([`attach_zero`](crate::distributed::attach_zero)), its
    /// units stream from the ranks instead, and what its birth turned on is off again.
    pub fn new(
        model: M,
        mut optimizer: Box<dyn Optimizer>,
        mut config: TrainerConfig,
    ) -> Result<Self> {
        let invalid = |reason: String| {
            Err(Error::InvalidArgument {
                op: "Trainer::new",
                reason,
            })
        };
        if config.batch_size == 0 || config.accum_steps == 0 || config.micro_batch == Some(0) {
            return invalid(format!(
                "batch_size, accum_steps and micro_batch must be positive, got {}, {}, {:?}",
                config.batch_size, config.accum_steps, config.micro_batch
            ));
        }
        if config.batch_size.checked_mul(config.accum_steps).is_none() {
            return invalid(format!(
                "batch_size {} x accum_steps {} overflows",
                config.batch_size, config.accum_steps
            ));
        }
        if config.batch_invariant && config.precision != Precision::F32 {
            return invalid(format!(
                "batch_invariant needs f32 precision, got {:?}: f16 weights and gradients round \
                 each micro-batch's sums apart",
                config.precision
            ));
        }
        if let Some(c) = config.clip_grad_norm {
            if !(c.is_finite() && c > 0.0) {
                return invalid(format!("clip_grad_norm must be a positive number, got {c}"));
            }
        }
        let params = model.parameters();
        let Some(first) = params.first() else {
            return invalid("the model has no parameters".into());
        };
        let device = first.device().clone();
        let mut born = super::born::BornOnHost::of(&params, &config);
        if crate::residency::made_on_host(&params) {
            config.offload_parameters = true;
            config.offload_optimizer = true;
        }
        let want = config.precision.param_dtype();
        if let Some(p) = params.iter().find(|p| p.dtype() != want) {
            return Err(Error::DType {
                op: "Trainer::new (parameters for this precision)",
                expected: want,
                got: p.dtype(),
            });
        }
        for p in &params {
            device.retag(p, Category::Parameters);
        }
        let loss_sum = Tensor::zeros(&device, &[], DType::F32)?;
        let step_loss = Tensor::zeros(&device, &[], DType::F32)?;
        let micro = config
            .micro_batch
            .unwrap_or(config.batch_size)
            .min(config.batch_size);
        if config.offload_optimizer || config.offload_parameters {
            born.offload(optimizer.as_mut(), &mut config)?;
        }
        let streaming = if config.offload_parameters {
            Some(Self::start_streaming(&model, &device)?)
        } else {
            None
        };
        let scaler = (config.precision == Precision::Mixed).then(GradScaler::new);
        crate::tensor::invariant::set_batch_invariant(&device, config.batch_invariant);
        Ok(Trainer {
            model,
            optimizer,
            config,
            device,
            step: 0,
            loss_sum,
            step_loss,
            loss_steps: 0,
            micro,
            scaler,
            events: Vec::new(),
            sync: None,
            data_identity: Vec::new(),
            streaming,
            born,
        })
    }

    /// The tensors whose gradients the step reads after the gradient exchange: the model's
    /// parameters, or (ZeRO) views of this replica's shard of them.
    pub(crate) fn step_tensors(&self) -> Vec<Tensor> {
        self.sync
            .as_ref()
            .and_then(|s| s.step_tensors())
            .unwrap_or_else(|| self.model.parameters())
    }

    /// Whether `local` holds on any replica ([`GradientSync::any`]); `local` alone.
    fn any_replica(&mut self, local: bool) -> Result<bool> {
        match self.sync.as_mut() {
            Some(s) => s.any(local),
            None => Ok(local),
        }
    }

    /// Makes this trainer one replica of data-parallel training (see [`GradientSync`]; the
    /// `distributed` module installs it), or a single-device trainer again with `None`.
    pub fn set_gradient_sync(&mut self, sync: Option<Box<dyn GradientSync>>) {
        self.sync = sync;
    }

    /// Brings sharded parameters to the model (ZeRO stage 3: every unit gathered from the
    /// ranks) so reading it sees the trained values; every replica calls it at once.
    pub fn gather_parameters(&self) -> Result<()> {
        match self.sync.as_ref() {
            Some(s) => s.gather_parameters(),
            None => Ok(()),
        }
    }

    /// The optimizer's parameters in the groups a replica lays out over the ranks
    /// ([`GradientSync::shard_groups`]): one group of all of them unless ZeRO stage 3 shards
    /// the units apart.
    pub fn shard_groups(&self) -> Vec<Vec<usize>> {
        self.sync
            .as_ref()
            .and_then(|s| s.shard_groups())
            .unwrap_or_else(|| vec![(0..self.optimizer.params().len()).collect()])
    }

    /// What its last step's collectives moved for parameters sharded by unit (ZeRO stage 3),
    /// planned or run; `None` without such sharding.
    pub fn unit_traffic(&self) -> Option<crate::train::UnitTraffic> {
        self.sync.as_ref().and_then(|s| s.unit_traffic())
    }

    /// Whether a [`GradientSync`] is installed.
    pub fn has_gradient_sync(&self) -> bool {
        self.sync.is_some()
    }

    /// This replica's positions in a batch of `n` samples: all of them on one device.
    pub(super) fn share(&self, n: usize) -> std::ops::Range<usize> {
        self.sync.as_ref().map_or(0..n, |s| s.share(n))
    }

    /// What the trainer decided on its own since the last call (micro-batch changes after an
    /// out-of-memory, steps skipped and scales grown by the loss scaler).
    pub fn take_events(&mut self) -> Vec<TrainEvent> {
        std::mem::take(&mut self.events)
    }

    /// The loss scaler (mixed precision only).
    pub fn scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    /// The loss scaler, to change its settings.
    pub fn scaler_mut(&mut self) -> Option<&mut GradScaler> {
        self.scaler.as_mut()
    }

    /// The configuration (with the micro-batch a budget chose).
    pub fn config(&self) -> &TrainerConfig {
        &self.config
    }

    /// Samples per optimizer step.
    pub fn effective_batch(&self) -> usize {
        self.config.batch_size * self.config.accum_steps
    }

    /// Samples per forward/backward (smaller than the batch after fitting a budget or an
    /// out-of-memory).
    pub fn micro_batch(&self) -> usize {
        self.micro
    }

    /// Sets the samples per forward/backward (at most the batch size).
    pub fn set_micro_batch(&mut self, micro: usize) -> Result<()> {
        if micro == 0 {
            return Err(Error::InvalidArgument {
                op: "Trainer::set_micro_batch",
                reason: "the micro-batch must hold at least one sample".into(),
            });
        }
        self.micro = micro.min(self.config.batch_size);
        self.config.micro_batch = Some(self.micro);
        Ok(())
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The device training runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The mean step loss since the last call (one readback), or NaN when no step ran.
    pub fn take_loss(&mut self) -> Result<f32> {
        if self.loss_steps == 0 {
            return Ok(f32::NAN);
        }
        let v = self.loss_sum.item()? / self.loss_steps as f32;
        self.loss_sum.fill_(0.0)?;
        self.loss_steps = 0;
        Ok(v)
    }

    /// Parameters, gradients, optimizer state and activations at the peak, from the arena.
    pub fn memory_summary(&self) -> MemorySummary {
        let stats = self.device.memory_stats();
        // Streamed parameters are on the device a unit or two at a time (in the activations'
        // figure); their home is host memory.
        let device_params = self.device_params();
        let parameter_bytes = device_params.iter().map(Tensor::allocated_bytes).sum();
        // The gradients the device held at the in-use peak, as the arena counted them: none
        // where the peak falls in the forward, a shard and a bucket or two under ZeRO.
        let gradient_bytes = stats.peak_by_category.get(Category::Gradients);
        let optimizer_state_bytes = self.optimizer.state_bytes();
        let host_bytes = self.optimizer.host_bytes() + self.streamed_host_bytes();
        let fixed = parameter_bytes + gradient_bytes + optimizer_state_bytes;
        MemorySummary {
            parameter_bytes,
            gradient_bytes,
            optimizer_state_bytes,
            host_bytes,
            activation_bytes: stats.peak_bytes_in_use.saturating_sub(fixed),
            stats,
        }
    }

    pub(super) fn context(&self, training: bool) -> StepContext {
        StepContext {
            device: self.device.clone(),
            dtype: self.config.precision.compute_dtype(),
            training,
        }
    }

    /// Loss scaling skipped more than `max_skipped_in_a_row` tries in a row with the scale
    /// already below 65,536 / 2^that: the weights or the loss have blown up. A run started
    /// above the default scale (`set_state`) first halves its way down to it uncounted.
    pub(super) fn scaling_blew_up(&self) -> bool {
        let most = self.config.max_skipped_in_a_row;
        self.scaler.as_ref().is_some_and(|sc| {
            let floor = 65536.0 / 2f64.powi(most.min(1000) as i32);
            most > 0 && sc.skipped_in_a_row() > most && f64::from(sc.scale()) < floor
        })
    }
}

impl<M: Module> Trainer<M> {
    /// One optimizer step over the samples `indices` of `data`: forward and backward per
    /// micro-batch, gradients accumulated, then the update and `zero_grad`.
    ///
    /// If the device runs out of memory mid-step (the budget, fragmentation, the driver), the
    /// step's gradients and activations are dropped, the micro-batch shrinks (to the largest
    /// the planner finds fitting under a budget, else half) and the step starts over: no sample
    /// is lost or counted twice, and the weights are those an unconstrained run would reach.
    pub fn step<D>(&mut self, data: &D, indices: &[usize]) -> Result<()>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        if indices.is_empty() {
            return Err(Error::InvalidArgument {
                op: "Trainer::step",
                reason: "a step needs at least one sample".into(),
            });
        }
        loop {
            match self.try_step(data, indices, false) {
                Err(Error::OutOfMemory { requested, .. }) if self.micro > 1 => {
                    // try_step left no gradient behind; the weights are untouched.
                    self.optimizer.zero_grad();
                    let old = self.micro;
                    let budget = self.device.memory_stats().budget;
                    let planned = budget.and_then(|b| {
                        self.largest_fitting(data, indices, Some(b), old - 1)
                            .ok()
                            .flatten()
                    });
                    self.micro = planned.unwrap_or(old.div_ceil(2)).min(old - 1).max(1);
                    self.events.push(TrainEvent::OomRetry {
                        step: self.step,
                        requested,
                        micro_before: old,
                        micro_after: self.micro,
                        planned: planned.is_some(),
                    });
                }
                other => return other,
            }
        }
    }

    /// One step. With `planning`, only the micro-batches that can set the peak run (the
    /// first, the second — the first with gradients to add to — and a smaller last one), so a
    /// plan costs the same for any batch or accumulation count.
    pub(super) fn try_step<D>(&mut self, data: &D, indices: &[usize], planning: bool) -> Result<()>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        if !planning {
            self.born.check_step(self.optimizer.name())?;
        }
        // Each micro-batch's loss is weighted by its share of all `n` samples, including those
        // other replicas run (data-parallel), so the summed gradients are the batch mean's.
        let n = indices.len();
        let indices = &indices[self.share(n)];
        let mb = self.micro.max(1);
        let step_loss = self.step_loss.clone();
        step_loss.fill_(0.0)?;
        let ctx = self.context(true);
        let dev = self.device.clone();
        let _step = dev.step_scope();
        let chunks: Vec<&[usize]> = indices.chunks(mb).collect();
        let last = chunks.len().saturating_sub(1);
        if self.streaming.is_some() && self.sync.is_some() {
            return Err(super::born::not_with_streaming("data-parallel training"));
        }
        // While planning, the skipped micro-batches move what the second one moved (each
        // after the first finds the units the one before left).
        let mut skipped = 0u64;
        let mut second_moved = crate::residency::Moved::default();
        let result = (|| {
            for (i, chunk) in chunks.iter().enumerate() {
                if planning && i > 1 && i != last {
                    skipped += 1;
                    continue;
                }
                let moved_before = crate::residency::moved(&dev);
                let batch = data.batch(chunk)?;
                if batch.len() != chunk.len() {
                    return Err(Error::InvalidArgument {
                        op: "Trainer::step",
                        reason: format!(
                            "the data source made a batch of {} samples for {} indices",
                            batch.len(),
                            chunk.len()
                        ),
                    });
                }
                let _c = dev.category_scope(Category::Activations);
                let invariant = self.config.batch_invariant;
                let mut loss = {
                    let _p = dev.phase_scope("forward");
                    // Batch-invariant: the loss weighs each sample by 1 / n itself.
                    let scope = invariant.then(|| crate::tensor::invariant::weigh_samples(n));
                    let loss = self.model.forward_loss(&batch, &ctx)?;
                    if let Some(scope) = &scope {
                        scope.check("Trainer::step (batch_invariant)", &loss)?;
                    }
                    loss
                };
                if loss.numel() != 1 {
                    return Err(Error::Shape {
                        op: "TrainModel::forward_loss",
                        lhs: loss.dims().to_vec(),
                        rhs: vec![],
                        reason: "the loss must be a one-element tensor".into(),
                    });
                }
                let _p = dev.phase_scope("backward");
                if loss.dtype() != DType::F32 {
                    loss = loss.to_dtype(DType::F32)?;
                }
                if chunk.len() != n && !invariant {
                    // This micro-batch's share of the effective batch's mean.
                    loss = loss.mul_scalar(chunk.len() as f32 / n as f32)?;
                }
                let hook = match self.sync.as_mut() {
                    Some(sync) => {
                        sync.backward_hook(self.step, &self.model.parameters(), i == 0)?
                    }
                    None => None,
                };
                let hooked = hook.map(crate::tensor::autograd::LeafHookGuard::set);
                match &self.scaler {
                    Some(sc) => sc.scale_loss(&loss)?.backward()?,
                    None => loss.backward()?,
                }
                drop(hooked);
                step_loss.add_(&loss.detach())?;
                if i == 1 {
                    second_moved = crate::residency::moved(&dev).since(moved_before);
                }
            }
            crate::residency::add_moved(&dev, second_moved.times(skipped));
            // Every streamed unit's gradients to the host, no unit left on the device.
            crate::residency::finish(&dev, true)
        })();
        if result.is_err() {
            let _ = crate::residency::finish(&dev, false);
        }
        let result = result.and_then(|()| match self.sync.as_mut() {
            Some(sync) => {
                let _p = dev.phase_scope("gradient all-reduce");
                sync.reduce(self.step, &self.model.parameters(), &step_loss)?;
                let buffers: Vec<Tensor> = self
                    .model
                    .named_buffers()
                    .into_iter()
                    .map(|(_, b)| b)
                    .collect();
                sync.sync_buffers(&buffers)
            }
            None => Ok(()),
        });
        if let Err(e) = result {
            self.optimizer.zero_grad();
            return Err(e);
        }
        if let Some(sc) = &self.scaler {
            let _p = dev.phase_scope("unscale");
            let params: Vec<Tensor> = self
                .step_tensors()
                .into_iter()
                .filter(|p| !p.is_streamed())
                .collect();
            let nonfinite = sc.unscale(&self.device, &params)? | self.unscale_host(sc.scale());
            let nonfinite = self.any_replica(nonfinite)?;
            let sc = self.scaler.as_mut().expect("checked above");
            let (step, scale_before) = (self.step, sc.scale());
            sc.update(nonfinite);
            let scale_after = sc.scale();
            if nonfinite {
                self.optimizer.zero_grad();
                self.events.push(TrainEvent::StepSkipped {
                    step,
                    scale_before,
                    scale_after,
                });
                let in_a_row = sc.skipped_in_a_row();
                if self.scaling_blew_up() {
                    return Err(Error::NonFinite {
                        step,
                        what: format!(
                            "the gradients overflowed on {in_a_row} tries in a row (loss scale \
                             now {scale_after}): the weights or the loss have blown up, and \
                             every later step would be skipped too"
                        ),
                        remedy: REMEDY.into(),
                    });
                }
                return Ok(());
            }
            if scale_after != scale_before {
                self.events.push(TrainEvent::ScaleGrew {
                    step,
                    scale_before,
                    scale_after,
                });
            }
        }
        if let Some(max_norm) = self.config.clip_grad_norm {
            let _p = dev.phase_scope("gradient clipping");
            let with_grad: Vec<Tensor> = self
                .step_tensors()
                .into_iter()
                .filter(|p| p.grad().is_some())
                .collect();
            if self.streaming.is_some() {
                self.clip_streamed(max_norm)?;
            } else {
                match self.sync.as_mut() {
                    // Sharded gradients: every replica joins the norm, with or without its own.
                    Some(sync) if sync.step_tensors().is_some() => {
                        crate::optim::clip_grad_norm_sharded(
                            &dev,
                            &with_grad,
                            max_norm,
                            &mut |l| sync.global_norm(l),
                        )?
                    }
                    _ if !with_grad.is_empty() => {
                        crate::optim::clip_grad_norm_tensor(&with_grad, max_norm)?;
                    }
                    _ => {}
                }
            }
        }
        let every = self.config.check_finite_every;
        if self.scaler.is_none() && every > 0 && self.step.is_multiple_of(every) {
            let _p = dev.phase_scope("finite check");
            let grads: Vec<Tensor> = self
                .step_tensors()
                .iter()
                .filter_map(Tensor::grad)
                .collect();
            let mut all: Vec<&Tensor> = vec![&step_loss];
            all.extend(grads.iter());
            let nonfinite = dev.nonfinite(&all)? || self.host_grads_nonfinite();
            if self.any_replica(nonfinite)? {
                drop(grads);
                self.optimizer.zero_grad();
                let what = if dev.nonfinite(&[&step_loss])? {
                    "the loss"
                } else {
                    "a gradient"
                };
                return Err(Error::NonFinite {
                    step: self.step,
                    what: format!("{what} is not finite (NaN or infinity)"),
                    remedy: format!(
                        "{REMEDY}, or use mixed precision (--precision mixed), whose loss \
                         scaling skips such steps"
                    ),
                });
            }
        }
        let lr = self.config.schedule.lr_at(self.config.lr, self.step);
        self.optimizer.set_lr(lr);
        let stepped = {
            let _c = dev.category_scope(Category::OptimizerState);
            let _p = dev.phase_scope("optimizer step");
            self.optimizer.step()
        };
        self.optimizer.zero_grad();
        stepped?;
        self.loss_sum.add_(&step_loss)?;
        self.step += 1;
        self.loss_steps += 1;
        Ok(())
    }
}
