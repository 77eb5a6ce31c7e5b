//! The training loop. One optimizer step consumes an *effective batch* of
//! `batch_size * accum_steps` samples, run as micro-batches of `micro_batch` samples whose
//! gradients add up in place. Each micro-batch's mean loss is weighted by its share of the
//! effective batch, so the update is the same however the batch is split (up to float rounding):
//! `--batch-size 64` gives the same weights as `--batch-size 16 --accum-steps 4`.

use super::data::Dataset;
use crate::kernels::elementwise::{self, BinaryOp};
use crate::memory::plan::{self, OptimizerKind, Plan, PlanConfig, Precision};
use crate::nn::{self, Mlp, Module};
use crate::optim::{GradScaler, LrSchedule, Optimizer};
use crate::{DType, Device, Error, MemoryStats, Result, Tensor};

/// How batches are formed and the learning rate moves.
#[derive(Clone, Debug)]
pub struct TrainerConfig {
    /// Samples per batch (the data loader's batch).
    pub batch_size: usize,
    /// Batches whose gradients add up before one optimizer step.
    pub accum_steps: usize,
    /// Samples per forward/backward; at most `batch_size` (None: `batch_size`).
    pub micro_batch: Option<usize>,
    /// The learning rate the schedule scales.
    pub lr: f32,
    pub schedule: LrSchedule,
    /// f32, f16 (the model must be f16), or mixed (f32 parameters, f16 compute, loss scaling).
    pub precision: Precision,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            batch_size: 64,
            accum_steps: 1,
            micro_batch: None,
            lr: 1e-3,
            schedule: LrSchedule::Constant,
            precision: Precision::F32,
        }
    }
}

/// Where the device memory of training went, from the arena's statistics.
#[derive(Clone, Debug)]
pub struct MemorySummary {
    pub parameter_bytes: u64,
    pub gradient_bytes: u64,
    pub optimizer_state_bytes: u64,
    /// Peak live bytes minus parameters, gradients and optimizer state: activations, saved
    /// tensors and temporaries alive at the worst point of a step.
    pub activation_bytes: u64,
    pub stats: MemoryStats,
}

impl MemorySummary {
    /// What a step really needs at its worst point (= peak bytes in use).
    pub fn needed_bytes(&self) -> u64 {
        self.stats.peak_bytes_in_use
    }

    /// Peak bytes the arena held from the driver over what the step needed (1.0 = no waste).
    pub fn overhead(&self) -> f64 {
        self.stats.peak_bytes_reserved as f64 / self.needed_bytes().max(1) as f64
    }
}

impl std::fmt::Display for MemorySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::error::Bytes;
        writeln!(f, "training memory (peak of a step):")?;
        writeln!(f, "  parameters        {:>12}", Bytes(self.parameter_bytes))?;
        writeln!(f, "  gradients         {:>12}", Bytes(self.gradient_bytes))?;
        writeln!(
            f,
            "  optimizer state   {:>12}",
            Bytes(self.optimizer_state_bytes)
        )?;
        writeln!(
            f,
            "  activations etc.  {:>12}",
            Bytes(self.activation_bytes)
        )?;
        writeln!(f, "  = needed          {:>12}", Bytes(self.needed_bytes()))?;
        writeln!(
            f,
            "  reserved (peak)   {:>12}  ({:.2}x of needed)",
            Bytes(self.stats.peak_bytes_reserved),
            self.overhead()
        )
    }
}

pub struct Trainer {
    pub model: Mlp,
    pub optimizer: Box<dyn Optimizer>,
    config: TrainerConfig,
    device: Device,
    /// Optimizer steps taken.
    step: u64,
    /// Sum of step losses since the last `take_loss`, kept on the GPU so a step never waits for
    /// a readback.
    loss_sum: Tensor,
    /// The current step's loss, added to `loss_sum` only once the step succeeds (kept, so a step
    /// allocates no accumulator).
    step_loss: Tensor,
    loss_steps: u64,
    /// Host staging reused by every batch.
    xs: Vec<f32>,
    ys: Vec<u32>,
    /// Samples per forward/backward now (halved after an out-of-memory).
    micro: usize,
    scaler: Option<GradScaler>,
    /// What the trainer changed on its own (micro-batch halvings, skipped steps), for the log.
    events: Vec<String>,
}

impl Trainer {
    pub fn new(
        model: Mlp,
        optimizer: Box<dyn Optimizer>,
        config: TrainerConfig,
    ) -> Result<Trainer> {
        if config.batch_size == 0 || config.accum_steps == 0 || config.micro_batch == Some(0) {
            return Err(Error::InvalidArgument {
                op: "Trainer::new",
                reason: format!(
                    "batch_size, accum_steps and micro_batch must be positive, got {}, {}, {:?}",
                    config.batch_size, config.accum_steps, config.micro_batch
                ),
            });
        }
        let device = model.layers[0].weight.device().clone();
        let want = config.precision.param_dtype();
        if let Some(p) = model.parameters().iter().find(|p| p.dtype() != want) {
            return Err(Error::DType {
                op: "Trainer::new (parameters for this precision)",
                expected: want,
                got: p.dtype(),
            });
        }
        let loss_sum = Tensor::zeros(&device, &[], DType::F32)?;
        let step_loss = Tensor::zeros(&device, &[], DType::F32)?;
        let micro = config
            .micro_batch
            .unwrap_or(config.batch_size)
            .min(config.batch_size);
        let scaler = (config.precision == Precision::Mixed).then(GradScaler::new);
        Ok(Trainer {
            model,
            optimizer,
            config,
            device,
            step: 0,
            loss_sum,
            step_loss,
            loss_steps: 0,
            xs: Vec::new(),
            ys: Vec::new(),
            micro,
            scaler,
            events: Vec::new(),
        })
    }

    /// The planner's configuration for this trainer at micro-batch `micro`.
    pub fn plan_config(&self, micro: usize) -> PlanConfig {
        let kind = if self.optimizer.name() == "adamw" {
            OptimizerKind::AdamW
        } else {
            OptimizerKind::Sgd {
                momentum: self.optimizer.has_momentum(),
            }
        };
        PlanConfig {
            widths: self.model.widths(),
            act: self.model.act,
            micro_batch: micro,
            micro_steps: self.config.batch_size.div_ceil(micro) * self.config.accum_steps,
            precision: self.config.precision,
            optimizer: kind,
            checkpoint_activations: self.model.checkpoint_activations,
        }
    }

    /// The planned peak of one step at the current micro-batch.
    pub fn plan(&self) -> Plan {
        plan::plan(&self.plan_config(self.micro))
    }

    /// Chooses the largest micro-batch whose planned peak, with the arena's overhead, fits
    /// `budget` bytes (the effective batch stays: more micro-batches accumulate). A budget too
    /// small for one sample is [`Error::BudgetTooSmall`], before any step runs.
    pub fn fit_to_budget(&mut self, budget: u64) -> Result<usize> {
        let fits =
            |micro: usize| reserved_estimate(&plan::plan(&self.plan_config(micro))) <= budget;
        if !fits(1) {
            return Err(Error::BudgetTooSmall {
                budget,
                minimum: reserved_estimate(&plan::plan(&self.plan_config(1))),
                what: format!("MLP {:?}", self.model.widths()),
            });
        }
        // The planned peak grows with the micro-batch: binary search the largest that fits.
        let (mut lo, mut hi) = (1, self.config.batch_size);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        self.micro = lo;
        self.config.micro_batch = Some(lo);
        Ok(lo)
    }

    /// What the trainer decided on its own since the last call (micro-batch halvings after an
    /// out-of-memory, steps skipped by the loss scaler).
    pub fn take_events(&mut self) -> Vec<String> {
        std::mem::take(&mut self.events)
    }

    pub fn scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    pub fn scaler_mut(&mut self) -> Option<&mut GradScaler> {
        self.scaler.as_mut()
    }

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

    pub fn steps(&self) -> u64 {
        self.step
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// One optimizer step over `x` (n, dim) row-major and labels `y` (n): forward and backward
    /// per micro-batch, gradients accumulated, then the update and `zero_grad`.
    ///
    /// If the device runs out of memory mid-step (the budget, fragmentation, the driver), the
    /// step's gradients and activations are dropped, the micro-batch halves (so the number of
    /// accumulated micro-batches doubles) and the step starts over: no sample is lost or counted
    /// twice, and the weights are those an unconstrained run would reach.
    pub fn step(&mut self, x: &[f32], y: &[u32]) -> Result<()> {
        self.step_from(Input::Host(x), y)
    }

    /// [`Trainer::step`] with the inputs already on the device: `x` is (n, dim) f32, and each
    /// micro-batch is a row range of it (a sharded dataset's batches).
    pub fn step_on_device(&mut self, x: &Tensor, y: &[u32]) -> Result<()> {
        self.step_from(Input::Device(x), y)
    }

    fn step_from(&mut self, x: Input, y: &[u32]) -> Result<()> {
        let n = y.len();
        let dim = self.model.layers[0].in_features;
        let rows_ok = match x {
            Input::Host(x) => x.len() == n * dim,
            Input::Device(t) => t.dims() == [n, dim] && t.dtype() == DType::F32,
        };
        if n == 0 || !rows_ok {
            return Err(Error::Shape {
                op: "Trainer::step",
                lhs: match x {
                    Input::Host(x) => vec![x.len()],
                    Input::Device(t) => t.dims().to_vec(),
                },
                rhs: vec![n, dim],
                reason: format!("need {n} rows of {dim} features and at least one sample"),
            });
        }
        loop {
            match self.try_step(x, y) {
                Err(Error::OutOfMemory { requested, .. }) if self.micro > 1 => {
                    // try_step left no gradient behind; the weights are untouched.
                    self.optimizer.zero_grad();
                    let old = self.micro;
                    self.micro = old.div_ceil(2);
                    self.events.push(format!(
                        "step {}: out of memory (asked for {}); micro-batch {old} -> {}, redoing the step",
                        self.step,
                        crate::error::Bytes(requested),
                        self.micro
                    ));
                }
                other => return other,
            }
        }
    }

    fn try_step(&mut self, x: Input, y: &[u32]) -> Result<()> {
        let n = y.len();
        let dim = self.model.layers[0].in_features;
        let dtype = self.config.precision.compute_dtype();
        let mb = self.micro;
        let step_loss = self.step_loss.clone();
        elementwise::fill(&step_loss, 0.0)?;
        let result = (|| {
            let mut start = 0;
            while start < n {
                let end = (start + mb).min(n);
                let xt = match x {
                    Input::Host(x) => Tensor::from_slice(
                        &self.device,
                        &x[start * dim..end * dim],
                        &[end - start, dim],
                    )?,
                    Input::Device(t) if start == 0 && end == n => t.clone(),
                    Input::Device(t) => t.rows(start, end)?,
                };
                let logits = self.model.forward_in(&xt, dtype)?;
                drop(xt); // the graph keeps what backward needs
                let mut loss = nn::cross_entropy(&logits, &y[start..end])?;
                drop(logits);
                if end - start != n {
                    // This micro-batch's share of the effective batch's mean.
                    loss = loss.mul_scalar((end - start) as f32 / n as f32)?;
                }
                match &self.scaler {
                    Some(sc) => sc.scale_loss(&loss)?.backward()?,
                    None => loss.backward()?,
                }
                elementwise::binary(BinaryOp::Add, &step_loss, &loss.detach(), &step_loss)?;
                start = end;
            }
            Ok(())
        })();
        if let Err(e) = result {
            self.optimizer.zero_grad();
            return Err(e);
        }
        if let Some(sc) = &self.scaler {
            let params = self.model.parameters();
            let nonfinite = sc.unscale(&self.device, &params)?;
            let sc = self.scaler.as_mut().expect("checked above");
            sc.update(nonfinite);
            if nonfinite {
                self.optimizer.zero_grad();
                self.events.push(format!(
                    "step {}: gradients overflowed; step skipped, loss scale now {}",
                    self.step,
                    sc.scale()
                ));
                return Ok(());
            }
        }
        let lr = self.config.schedule.lr_at(self.config.lr, self.step);
        self.optimizer.set_lr(lr);
        if let Err(e) = self.optimizer.step() {
            self.optimizer.zero_grad();
            return Err(e);
        }
        self.optimizer.zero_grad();
        elementwise::binary(BinaryOp::Add, &self.loss_sum, &step_loss, &self.loss_sum)?;
        self.step += 1;
        self.loss_steps += 1;
        Ok(())
    }

    /// Steps over one epoch of `data` in a seeded order; `on_step(done, total)` after each.
    pub fn train_epoch(
        &mut self,
        data: &Dataset,
        seed: u64,
        epoch: u64,
        mut on_step: impl FnMut(&mut Trainer, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let order = data.shuffled_order(seed, epoch);
        let eff = self.effective_batch();
        let total = order.len().div_ceil(eff);
        let (mut xs, mut ys) = (std::mem::take(&mut self.xs), std::mem::take(&mut self.ys));
        let mut result = Ok(());
        for (i, idx) in order.chunks(eff).enumerate() {
            data.gather(idx, &mut xs, &mut ys);
            result = self
                .step(&xs, &ys)
                .and_then(|_| on_step(self, i + 1, total));
            if result.is_err() {
                break;
            }
        }
        (self.xs, self.ys) = (xs, ys);
        result
    }

    /// Saves the model, the optimizer state, the loss scaler and the position in training
    /// (`epochs_done` full epochs) to a safetensors file, atomically: a crash mid-save leaves the
    /// previous file intact.
    pub fn save_checkpoint(&self, path: &std::path::Path, epochs_done: u64) -> Result<()> {
        let state = crate::checkpoint::TrainingState {
            step: self.step,
            epoch: epochs_done,
            rng_state: 0,
            scaler: self
                .scaler
                .as_ref()
                .map(|s| crate::checkpoint::ScalerState {
                    scale: s.scale(),
                    growth_tracker: s.growth_tracker(),
                }),
            extra: Default::default(),
        };
        crate::checkpoint::save(path, &self.model, Some(self.optimizer.as_ref()), &state)
    }

    /// Restores what [`Trainer::save_checkpoint`] wrote into this trainer (same model shape
    /// and optimizer kind) and returns the epochs already done; training on from there gives
    /// the weights of an uninterrupted run (the data order depends only on seed and epoch).
    pub fn resume_from(&mut self, path: &std::path::Path) -> Result<u64> {
        let ckpt = crate::checkpoint::load(path)?;
        let state = ckpt.training_state()?;
        ckpt.apply_model(&self.model)?;
        ckpt.apply_optimizer(self.optimizer.as_mut())?;
        self.step = state.step;
        if let (Some(sc), Some(saved)) = (self.scaler.as_mut(), state.scaler) {
            sc.set_state(saved.scale, saved.growth_tracker);
        }
        Ok(state.epoch)
    }

    /// Steps over one epoch of a sharded dataset: shards stream through the device (at most two
    /// there at once), each split into effective batches that are row ranges of the shard.
    pub fn train_epoch_sharded(
        &mut self,
        data: &super::shard::ShardedDataset,
        seed: u64,
        epoch: u64,
        mut on_step: impl FnMut(&mut Trainer, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let eff = self.effective_batch();
        let total: usize = (0..data.num_shards())
            .map(|k| {
                let rows = data.shard_size.min(data.len - k * data.shard_size);
                rows.div_ceil(eff)
            })
            .sum();
        let device = self.device.clone();
        let mut done = 0;
        for shard in data.epoch(&device, seed, epoch) {
            let (x, y) = shard?;
            let rows = y.len();
            let mut start = 0;
            while start < rows {
                let end = (start + eff).min(rows);
                if start == 0 && end == rows {
                    self.step_on_device(&x, &y)?;
                } else {
                    let xb = x.rows(start, end)?;
                    self.step_on_device(&xb, &y[start..end])?;
                }
                done += 1;
                on_step(self, done, total)?;
                start = end;
            }
        }
        Ok(())
    }

    /// The mean step loss since the last call (one readback), or NaN when no step ran.
    pub fn take_loss(&mut self) -> Result<f32> {
        if self.loss_steps == 0 {
            return Ok(f32::NAN);
        }
        let v = self.loss_sum.item()? / self.loss_steps as f32;
        crate::kernels::elementwise::fill(&self.loss_sum, 0.0)?;
        self.loss_steps = 0;
        Ok(v)
    }

    /// Mean loss and accuracy over `data`, in batches of `batch` without recording.
    pub fn evaluate(&self, data: &Dataset, batch: usize) -> Result<(f32, f32)> {
        let _g = crate::no_grad();
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        let idx: Vec<usize> = (0..data.len()).collect();
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for chunk in idx.chunks(batch.max(1)) {
            data.gather(chunk, &mut xs, &mut ys);
            let xt = Tensor::from_slice(&self.device, &xs, &[ys.len(), data.dim])?;
            let logits = self
                .model
                .forward_in(&xt, self.config.precision.compute_dtype())?;
            loss += nn::cross_entropy(&logits, &ys)?.item()? as f64 * ys.len() as f64;
            correct += nn::correct(&logits, &ys)?;
        }
        let n = data.len().max(1) as f64;
        Ok(((loss / n) as f32, (correct as f64 / n) as f32))
    }

    /// Parameters, gradients, optimizer state and activations at the peak, from the arena.
    pub fn memory_summary(&self) -> MemorySummary {
        let stats = self.device.memory_stats();
        let parameter_bytes = self.model.parameter_bytes();
        let gradient_bytes = parameter_bytes;
        let optimizer_state_bytes = self.optimizer.state_bytes();
        let fixed = parameter_bytes + gradient_bytes + optimizer_state_bytes;
        MemorySummary {
            parameter_bytes,
            gradient_bytes,
            optimizer_state_bytes,
            activation_bytes: stats.peak_bytes_in_use.saturating_sub(fixed),
            stats,
        }
    }
}

/// The reserved bytes a planned peak needs: the arena rounds large blocks to 64 KiB segments and
/// keeps small ones in 2 MiB segments, and reuse leaves some holes. 15% plus one small segment
/// covers what the training-step benchmark measures (1.12x).
pub fn reserved_estimate(plan: &Plan) -> u64 {
    plan.peak + plan.peak / 100 * 15 + crate::memory::SMALL_SEGMENT
}

/// Where a step's inputs come from.
#[derive(Clone, Copy)]
enum Input<'a> {
    Host(&'a [f32]),
    Device(&'a Tensor),
}
