//! How a trainer forms batches and moves the learning rate: [`TrainerConfig`], its defaults
//! and chained setters.

use super::Precision;
use crate::optim::LrSchedule;

/// How batches are formed and the learning rate moves. Built with [`TrainerConfig::new`] (or
/// [`Default`]) and the chained setters (new options may be added):
///
/// ```
/// use fitgrad::train::{Precision, TrainerConfig};
/// let config = TrainerConfig::new(64, 4, 1e-3)
///     .micro_batch(16)
///     .precision(Precision::Mixed)
///     .clip_grad_norm(1.0);
/// assert_eq!(config.micro_batch, Some(16));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TrainerConfig {
    /// Samples per batch (the data loader's batch).
    pub batch_size: usize,
    /// Batches whose gradients add up before one optimizer step.
    pub accum_steps: usize,
    /// Samples per forward/backward; at most `batch_size` (None: `batch_size`).
    pub micro_batch: Option<usize>,
    /// The learning rate the schedule scales.
    pub lr: f32,
    /// How the learning rate moves with the step.
    pub schedule: LrSchedule,
    /// f32, f16 (the model must be f16), or mixed (f32 parameters, f16 compute, loss scaling).
    pub precision: Precision,
    /// Without loss scaling, check the loss and the gradients for NaN or infinity every this many
    /// steps, before the update (one small readback each time), and stop with
    /// [`Error::NonFinite`](crate::Error::NonFinite); 0 turns the check off. Loss scaling checks
    /// every step anyway and skips overflowing steps.
    pub check_finite_every: u64,
    /// Clip the gradients' total L2 norm to this before each update (torch's
    /// `clip_grad_norm_`, after loss scaling is undone), on the GPU without a readback.
    pub clip_grad_norm: Option<f32>,
    /// Keep the optimizer's master weights and state in host memory
    /// ([`Optimizer::offload_to_host`](crate::optim::Optimizer::offload_to_host); AdamW's
    /// [`offload`](crate::optim::AdamW::offload)): the device holds only parameters and gradients.
    pub offload_optimizer: bool,
    /// Keep the parameters of the model's units ([`Module::units`](crate::nn::Module::units)) in
    /// host memory and stream them through the device unit by unit (src/residency/); implies
    /// `offload_optimizer`. Units train checkpointed.
    pub offload_parameters: bool,
    /// Loss scaling: more steps than this skipped in a row for overflowing gradients stops training
    /// with [`Error::NonFinite`](crate::Error::NonFinite) (the weights or the loss have blown up,
    /// and every later step would be skipped too), once the scale is also below 65,536 / 2^this; 0
    /// never stops. The default, 24, lets the scale fall from its start of 65,536 to 1/256, past
    /// what any start-up overflow needs.
    pub max_skipped_in_a_row: u64,
    /// Batch-invariant sums (src/tensor/invariant.rs): every weight gradient adds the samples
    /// one after another in order, continuing across micro-batches, and each sample's loss
    /// weighs 1 / batch, so a step's gradients are the same bits for any micro-batch size. For
    /// f32 models that mix no samples (group norm, not batch norm) whose loss is one
    /// `cross_entropy`; slower, since a weight's sum over the batch is one invocation's loop.
    /// Needs [`Precision::F32`] (`Trainer::new` refuses another), and `fit_auto` then keeps it.
    pub batch_invariant: bool,
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
            check_finite_every: 1,
            clip_grad_norm: None,
            offload_optimizer: false,
            offload_parameters: false,
            max_skipped_in_a_row: 24,
            batch_invariant: false,
        }
    }
}

impl TrainerConfig {
    /// A configuration with this batch and accumulation, the rest default.
    pub fn new(batch_size: usize, accum_steps: usize, lr: f32) -> TrainerConfig {
        TrainerConfig {
            batch_size,
            accum_steps,
            lr,
            ..Default::default()
        }
    }

    /// Sets batch-invariant sums ([`TrainerConfig::batch_invariant`]).
    pub fn batch_invariant(mut self, on: bool) -> Self {
        self.batch_invariant = on;
        self
    }

    /// Sets the samples per batch (the data loader's batch).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// Sets how many batches add their gradients up before one optimizer step.
    pub fn accum_steps(mut self, accum_steps: usize) -> Self {
        self.accum_steps = accum_steps;
        self
    }

    /// Sets the samples per forward/backward (at most `batch_size`).
    pub fn micro_batch(mut self, micro_batch: usize) -> Self {
        self.micro_batch = Some(micro_batch);
        self
    }

    /// Sets the learning rate the schedule scales.
    pub fn lr(mut self, lr: f32) -> Self {
        self.lr = lr;
        self
    }

    /// Sets how the learning rate moves with the step.
    pub fn schedule(mut self, schedule: LrSchedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// Sets the precision (f32, f16, or mixed with loss scaling).
    pub fn precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Sets how often (in steps) an unscaled run checks the loss and gradients for NaN or
    /// infinity; 0 turns the check off.
    pub fn check_finite_every(mut self, steps: u64) -> Self {
        self.check_finite_every = steps;
        self
    }

    /// Keeps the optimizer's master weights and state in host memory (see
    /// [`TrainerConfig::offload_optimizer`]).
    pub fn offload_optimizer(mut self, on: bool) -> Self {
        self.offload_optimizer = on;
        self
    }

    /// Streams the parameters of the model's units from host memory (see
    /// [`TrainerConfig::offload_parameters`]); implies optimizer offload.
    pub fn offload_parameters(mut self, on: bool) -> Self {
        self.offload_parameters = on;
        self
    }

    /// Clips the gradients' total L2 norm to `max_norm` before each update.
    pub fn clip_grad_norm(mut self, max_norm: f32) -> Self {
        self.clip_grad_norm = Some(max_norm);
        self
    }
}
