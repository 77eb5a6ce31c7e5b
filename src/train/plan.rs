//! The planner: a step's peak memory, known before the step runs, for any model.
//!
//! It does not model anything. It runs the trainer's own step code — forward, backward, loss
//! scaling, the optimizer step, twice so lazily created optimizer state counts — on the
//! device's planning mode ([`Device::planning`]), where every allocation goes through a copy of
//! the real arena (same segments, rounding, reuse and budget) but no buffer is created and
//! nothing runs. The peak it reports is the peak that step reaches, by construction; when an
//! op changes what it allocates, the plan changes with it.
//!
//! Budget fitting ([`Trainer::fit_to_budget`]), preallocation ([`Trainer::prealloc`]) and the
//! micro-batch chosen after an out-of-memory all ask it. [`Trainer::plan_timeline`] records
//! the planned step's memory [`Timeline`], event by event.
//!
//! [`Device::planning`]: crate::Device::planning

use super::model::{BatchSource, TrainModel};
use super::Trainer;
use crate::error::Bytes;
use crate::memory::{Category, Timeline};
use crate::nn::Module;
use crate::{Device, Error, Result, Tensor};
use std::fmt;

/// The planned peak of a training step and what it is made of.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    /// Parameters alive at the peak.
    pub parameters: u64,
    /// Gradients alive at the peak.
    pub gradients: u64,
    /// Optimizer state alive at the peak.
    pub optimizer_state: u64,
    /// What forward and backward had allocated at the peak: activations, saved tensors, their
    /// gradients, the input batch.
    pub activations: u64,
    /// Everything else alive at the peak (scalars, tensors made outside the step).
    pub workspace: u64,
    /// Data-parallel training's flat gradient buffer for the all-reduce, where it is alive at
    /// the peak (0 on one device).
    pub communication: u64,
    /// The most bytes the all-reduce buffer took during the step, at the peak or not (0 on one
    /// device): one f32 per gradient element and one for the loss, read back once per step.
    pub all_reduce_buffer: u64,
    /// Peak bytes in use: the sum of the above at the worst point of the step.
    pub peak: u64,
    /// Peak bytes the arena holds from the driver (segments, with rounding and free ranges).
    pub peak_reserved: u64,
    /// Segments (wgpu buffers) the step would create.
    pub new_buffers: u64,
    /// The op being recorded at the peak, with the phase of the step.
    pub peak_op: Option<String>,
    /// Host memory the optimizer keeps (optimizer offload), beside the device figures.
    #[serde(default)]
    pub host_bytes: u64,
    /// Samples per forward/backward.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub micro_batches: usize,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "planned peak of a training step (micro-batch {}, {} per step):",
            self.micro_batch, self.micro_batches
        )?;
        writeln!(f, "  parameters        {:>12}", Bytes(self.parameters))?;
        writeln!(f, "  gradients         {:>12}", Bytes(self.gradients))?;
        writeln!(f, "  optimizer state   {:>12}", Bytes(self.optimizer_state))?;
        writeln!(f, "  activations       {:>12}", Bytes(self.activations))?;
        writeln!(f, "  workspace         {:>12}", Bytes(self.workspace))?;
        if self.communication > 0 {
            writeln!(f, "  communication     {:>12}", Bytes(self.communication))?;
        }
        writeln!(f, "  = peak in use     {:>12}", Bytes(self.peak))?;
        writeln!(f, "  peak reserved     {:>12}", Bytes(self.peak_reserved))?;
        if let Some(op) = &self.peak_op {
            writeln!(f, "  peak reached at   {op}")?;
        }
        if self.host_bytes > 0 {
            writeln!(
                f,
                "  host memory       {:>12} (optimizer offload)",
                Bytes(self.host_bytes)
            )?;
        }
        if self.all_reduce_buffer > 0 {
            writeln!(
                f,
                "  all-reduce buffer {:>12} (gradients and loss, read back once per step)",
                Bytes(self.all_reduce_buffer)
            )?;
        }
        Ok(())
    }
}

impl<M: Module> Trainer<M> {
    /// The samples a plan runs: the first effective batch of `data` (or all of it, if
    /// smaller).
    pub(super) fn plan_indices<D: BatchSource>(&self, data: &D) -> Result<Vec<usize>> {
        let n = self.effective_batch().min(data.len());
        if n == 0 {
            return Err(Error::InvalidArgument {
                op: "Trainer::plan",
                reason: "the data source holds no sample".into(),
            });
        }
        Ok((0..n).collect())
    }

    /// The planned peak of one step on `data` at the current micro-batch, under the device's
    /// budget.
    pub fn plan<D>(&mut self, data: &D) -> Result<Plan>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let idx = self.plan_indices(data)?;
        let budget = self.device.memory_stats().budget;
        self.plan_at(data, &idx, self.micro, budget, 0)
    }

    /// The planned peak of one step over `indices` at micro-batch `micro`, with the planning
    /// arena under `budget` (an [`Error::OutOfMemory`] means the step does not fit) and
    /// `reserve` bytes preallocated first.
    pub fn plan_at<D>(
        &mut self,
        data: &D,
        indices: &[usize],
        micro: usize,
        budget: Option<u64>,
        reserve: u64,
    ) -> Result<Plan>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        Ok(self
            .plan_run(data, indices, micro, budget, reserve, false)?
            .0)
    }

    /// The plan of one step on `data` at the current micro-batch under the device's budget
    /// (as [`Trainer::plan`]), with the memory timeline of that step: every allocation, free
    /// and op the next real step over an effective batch will record, from the memory held
    /// when it begins. Every micro-batch of the step is planned (a plain plan runs only those
    /// that can set the peak).
    pub fn plan_timeline<D>(&mut self, data: &D) -> Result<(Plan, Timeline)>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let idx = self.plan_indices(data)?;
        let budget = self.device.memory_stats().budget;
        let (plan, timeline) = self.plan_run(data, &idx, self.micro, budget, 0, true)?;
        let step = timeline.as_ref().and_then(Timeline::last_step);
        Ok((plan, step.unwrap_or_default()))
    }

    /// [`Trainer::plan_at`], recording the planning arena's timeline when `record`.
    fn plan_run<D>(
        &mut self,
        data: &D,
        indices: &[usize],
        micro: usize,
        budget: Option<u64>,
        reserve: u64,
        record: bool,
    ) -> Result<(Plan, Option<Timeline>)>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        if indices.is_empty() || micro == 0 {
            return Err(Error::InvalidArgument {
                op: "Trainer::plan",
                reason: "a plan needs at least one sample and a micro-batch of at least one".into(),
            });
        }
        let dev = self.device.clone();
        let scope = dev.planning()?;
        scope.set_budget(budget);
        // The plan steps a stateless copy of the optimizer: the real state does not count
        // (the copy makes its own), and gradients held now are set aside.
        for (_, t) in self.optimizer.state_tensors() {
            scope.forget(&t);
        }
        let params = self.model.parameters();
        let held: Vec<Option<Tensor>> = params.iter().map(Tensor::grad).collect();
        for (p, g) in params.iter().zip(&held) {
            if let Some(g) = g {
                scope.forget(g);
                p.zero_grad();
            }
        }
        let reserved = if reserve > 0 {
            dev.reserve(reserve)
        } else {
            Ok(())
        };
        scope.reset_peak();
        let before = scope.stats();
        let fresh = self.optimizer.fresh();
        let real_optimizer = std::mem::replace(&mut self.optimizer, fresh);
        let saved = (
            self.scaler.clone(),
            self.step,
            self.loss_steps,
            self.events.len(),
            self.micro,
        );
        self.micro = micro.min(self.config.batch_size);
        let result = reserved
            .and_then(|_| if record { dev.start_timeline() } else { Ok(()) })
            .and_then(|_| (0..2).try_for_each(|_| self.try_step(data, indices, !record)));
        let timeline = if record { dev.take_timeline() } else { None };
        self.optimizer.zero_grad();
        let planned_optimizer = std::mem::replace(&mut self.optimizer, real_optimizer);
        let micro_used = self.micro;
        (self.scaler, self.step, self.loss_steps) = (saved.0, saved.1, saved.2);
        self.events.truncate(saved.3);
        self.micro = saved.4;
        let stats = scope.stats();
        drop(planned_optimizer);
        drop(scope);
        for (p, g) in params.iter().zip(held) {
            if g.is_some() {
                p.set_grad(g)?;
            }
        }
        result?;
        let at = |c| stats.peak_by_category.get(c);
        let plan = Plan {
            parameters: at(Category::Parameters),
            gradients: at(Category::Gradients),
            optimizer_state: at(Category::OptimizerState),
            activations: at(Category::Activations),
            workspace: at(Category::Workspace),
            communication: at(Category::Communication),
            all_reduce_buffer: stats.category_peaks.get(Category::Communication),
            peak: stats.peak_bytes_in_use,
            peak_reserved: stats.peak_bytes_reserved,
            new_buffers: stats.buffers_created - before.buffers_created,
            peak_op: stats.peak_op,
            host_bytes: self.optimizer.host_bytes(),
            micro_batch: micro_used,
            micro_batches: self.share(indices.len()).len().div_ceil(micro_used),
        };
        Ok((plan, timeline))
    }

    /// Chooses the largest micro-batch whose planned step fits `budget` bytes (the effective
    /// batch stays: more micro-batches accumulate) and returns it. A budget too small for one
    /// sample is [`Error::BudgetTooSmall`] naming the smallest budget that works, before any
    /// step runs.
    pub fn fit_to_budget<D>(&mut self, data: &D, budget: u64) -> Result<usize>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let idx = self.plan_indices(data)?;
        match self.largest_fitting(data, &idx, budget, self.config.batch_size)? {
            Some(m) => {
                self.set_micro_batch(m)?;
                Ok(m)
            }
            None => {
                let minimum = self.smallest_budget(data, &idx)?;
                Err(Error::BudgetTooSmall {
                    budget,
                    minimum,
                    what: format!(
                        "a training step of {} parameters with micro-batches of one sample",
                        self.model.num_parameters()
                    ),
                })
            }
        }
    }

    /// Builds the model, its optimizer and the trainer with `build` on `device`, then fits the
    /// micro-batch to the device's budget (when it has one) with [`Trainer::fit_to_budget`]:
    /// the budget logic covers the model too. When the model itself does not fit the budget,
    /// it is built once more without the budget (so its exact needs are known), the smallest
    /// budget for the model and a step of one-sample micro-batches is planned, everything is
    /// dropped again, and the result is an [`Error::BudgetTooSmall`] naming that figure, not
    /// a bare out-of-memory. A model too big for the device at all keeps the driver's error.
    pub fn build_within_budget<D>(
        device: &Device,
        data: &D,
        build: impl Fn() -> Result<Trainer<M>>,
    ) -> Result<Trainer<M>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let Some(budget) = device.memory_stats().budget else {
            return build();
        };
        match build() {
            Ok(mut t) => {
                t.fit_to_budget(data, budget)?;
                Ok(t)
            }
            Err(Error::OutOfMemory { .. }) => {
                device.empty_cache();
                device.set_memory_budget(None)?;
                let minimum = build().and_then(|mut t| {
                    let idx = t.plan_indices(data)?;
                    let minimum = t.smallest_budget(data, &idx)?;
                    Ok((minimum, t.model.num_parameters()))
                });
                device.empty_cache();
                device.set_memory_budget(Some(budget))?;
                let (minimum, params) = minimum?;
                Err(Error::BudgetTooSmall {
                    budget,
                    minimum,
                    what: format!(
                        "the model ({params} parameters) with its optimizer and a training step \
                         of one-sample micro-batches"
                    ),
                })
            }
            Err(e) => Err(e),
        }
    }

    /// The smallest budget under which a step of one-sample micro-batches fits the arena as
    /// it is now: between the plan's peak in use (nothing fits below it) and its peak reserved
    /// without a budget (which fits), found by bisection on whole 256-byte blocks. A run with
    /// exactly this budget succeeds.
    pub(super) fn smallest_budget<D>(&mut self, data: &D, indices: &[usize]) -> Result<u64>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let free = self.plan_at(data, indices, 1, None, 0)?;
        let align = crate::memory::BLOCK_ALIGN;
        let (mut lo, mut hi) = (free.peak / align, free.peak_reserved.div_ceil(align));
        let fits = |t: &mut Self, blocks: u64| {
            Ok::<_, Error>(t.plan_within(data, indices, 1, blocks * align)?.is_some())
        };
        if !fits(self, hi)? {
            return Ok(free.peak_reserved);
        }
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if fits(self, mid)? {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Ok(hi * align)
    }

    /// The plan of a step over `indices` at micro-batch `micro` under `budget`, or `None` when
    /// it does not fit.
    pub(super) fn plan_within<D>(
        &mut self,
        data: &D,
        indices: &[usize],
        micro: usize,
        budget: u64,
    ) -> Result<Option<Plan>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        match self.plan_at(data, indices, micro, Some(budget), 0) {
            // The arena checks the budget only when it creates a segment: what it already
            // holds may be over it.
            Ok(p) if p.peak_reserved <= budget => Ok(Some(p)),
            Ok(_) | Err(Error::OutOfMemory { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The largest micro-batch up to `max` whose step over `indices` fits `budget` in the
    /// arena as it is now; `None` when not even one sample fits.
    pub(super) fn largest_fitting<D>(
        &mut self,
        data: &D,
        indices: &[usize],
        budget: u64,
        max: usize,
    ) -> Result<Option<usize>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let fits = |t: &mut Self, micro: usize| {
            Ok::<_, Error>(t.plan_within(data, indices, micro, budget)?.is_some())
        };
        let max = max.min(indices.len()).max(1);
        if fits(self, max)? {
            return Ok(Some(max));
        }
        if !fits(self, 1)? {
            return Ok(None);
        }
        // The planned peak grows with the micro-batch: binary search the largest that fits.
        let (mut lo, mut hi) = (1, max - 1);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(self, mid)? {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Ok(Some(lo))
    }

    /// Reserves, up front, the device memory a step on `data` will need, so training creates
    /// no buffer afterwards; returns the bytes reserved. The amount is planned: the step is
    /// planned on top of the reservation until it needs no new segment.
    pub fn prealloc<D>(&mut self, data: &D) -> Result<u64>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let idx = self.plan_indices(data)?;
        let budget = self.device.memory_stats().budget;
        let mut reserve = {
            let p = self.plan_at(data, &idx, self.micro, budget, 0)?;
            p.peak_reserved
                .saturating_sub(self.device.memory_stats().bytes_reserved)
        };
        for _ in 0..8 {
            if reserve == 0 {
                return Ok(0);
            }
            let p = self.plan_at(data, &idx, self.micro, budget, reserve)?;
            if p.new_buffers == 0 {
                self.device.reserve(reserve)?;
                return Ok(reserve);
            }
            // Fragmentation in the reserved segment: add what the step still created.
            let held = self.device.memory_stats().bytes_reserved + reserve;
            reserve += p
                .peak_reserved
                .saturating_sub(held)
                .max(crate::memory::LARGE_ROUND);
        }
        Err(Error::InvalidArgument {
            op: "Trainer::prealloc",
            reason: format!(
                "no reservation up to {} lets a step run without new buffers",
                Bytes(reserve)
            ),
        })
    }
}
