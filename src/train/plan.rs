//! The planner: a step's peak memory, known before the step runs, for any model.
//!
//! It does not model anything. It runs the trainer's own step code — forward, backward, loss
//! scaling, the optimizer step, at least twice so lazily created optimizer state counts, and
//! until the arena's layout repeats so later steps need nothing more — on the
//! device's planning mode ([`Device::planning`]), where every allocation goes through a copy of
//! the real arena (same segments, rounding, reuse and budget) but no buffer is created and
//! nothing runs. The peak it reports is the peak that step reaches, by construction; when an
//! op changes what it allocates, the plan changes with it.
//!
//! Budget fitting ([`Trainer::fit_to_budget`]), preallocation ([`Trainer::prealloc`]), both in
//! train/budget.rs, and the micro-batch chosen after an out-of-memory all ask it. [`Trainer::plan_timeline`] records
//! the planned step's memory [`Timeline`], event by event.
//!
//! [`Device::planning`]: crate::Device::planning

use super::model::{BatchSource, TrainModel};
use super::Trainer;
use crate::device::PlanScope;
use crate::error::Bytes;
use crate::memory::{Category, Timeline};
use crate::nn::Module;
use crate::{Error, Result, Tensor};
use std::fmt;

/// The most steps a plan runs while waiting for the arena's layout to repeat (a plan that
/// reaches it without a repeat reports the peaks of those steps).
pub(super) const MAX_PLANNED_STEPS: usize = 8;

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
    /// Peak bytes in use of a step whose optimizer holds no state yet (a run's first step, or
    /// the only one): the optimizer makes its state during that step's update, so the
    /// forward and backward run without it. At most `peak`; equal when the state is made
    /// before the step's worst point or there is none.
    #[serde(default)]
    pub first_step_peak: u64,
    /// Peak bytes the arena holds from the driver (segments, with rounding and free ranges).
    pub peak_reserved: u64,
    /// Segments (wgpu buffers) the step would create.
    pub new_buffers: u64,
    /// The op being recorded at the peak, with the phase of the step.
    pub peak_op: Option<String>,
    /// Host memory the run keeps, beside the device figures: the offloaded optimizer's
    /// master weights and moments, and the streamed units' values and gradient sums.
    #[serde(default)]
    pub host_bytes: u64,
    /// Bytes moved between host and device by one step: streamed units' parameters up and
    /// gradients back, and an offloaded optimizer's gradients back and parameters up.
    #[serde(default)]
    pub bytes_moved: u64,
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
        if self.first_step_peak != self.peak {
            writeln!(
                f,
                "  first step        {:>12} in use (before the optimizer state exists)",
                Bytes(self.first_step_peak)
            )?;
        }
        writeln!(f, "  peak reserved     {:>12}", Bytes(self.peak_reserved))?;
        if let Some(op) = &self.peak_op {
            writeln!(f, "  peak reached at   {op}")?;
        }
        if self.host_bytes > 0 {
            writeln!(
                f,
                "  host memory       {:>12} (offload)",
                Bytes(self.host_bytes)
            )?;
        }
        if self.bytes_moved > 0 {
            writeln!(
                f,
                "  moved per step    {:>12} (host <-> device)",
                Bytes(self.bytes_moved)
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
        self.planned(budget, reserve, micro, |t, scope| {
            let dev = t.device.clone();
            let before = scope.stats();
            // What the source keeps on the device while steps run (a sharded epoch's shards)
            // lives through the planned step.
            let resident = data.resident(&dev)?;
            if record {
                dev.start_timeline()?;
            }
            let result = t.planned_steps(data, indices, !record, scope);
            let timeline = if record { dev.take_timeline() } else { None };
            let (moved, first_step_peak) = result?;
            drop(resident);
            t.optimizer.zero_grad();
            let stats = scope.stats();
            let mut plan = t.step_plan(&stats, &before, indices.len());
            plan.bytes_moved += moved;
            plan.first_step_peak = first_step_peak;
            Ok((plan, timeline))
        })
    }

    /// Planned steps over `indices` (the first makes the optimizer's lazy state; `skip`: only
    /// the micro-batches that can set the peak) on `scope`, whose peak was reset before, at
    /// least two, until the arena's layout stops changing (at most [`MAX_PLANNED_STEPS`]); the
    /// bytes streaming moved in the last, and the peak in use of the first. The real run's
    /// counters are kept.
    pub(super) fn planned_steps<D>(
        &mut self,
        data: &D,
        indices: &[usize],
        skip: bool,
        scope: &PlanScope,
    ) -> Result<(u64, u64)>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let real = self.take_bytes_moved();
        let (mut moved, mut first_peak) = (0, 0);
        // The arena's free ranges after a step decide where the next one's blocks go, so a
        // step after the second may still need a segment the first two did not (a tight
        // budget splits the segments finely). Steps go on until one ends with the layout the
        // step before it ended with: from there every step repeats it exactly.
        let mut previous = None;
        let mut result = Ok(());
        for i in 0..MAX_PLANNED_STEPS {
            self.take_bytes_moved();
            result = self.try_step(data, indices, skip);
            moved = self.take_bytes_moved().total();
            if i == 0 {
                first_peak = scope.stats().peak_bytes_in_use;
            }
            let layout = self.device.arena_layout();
            if result.is_err() || previous.as_ref() == Some(&layout) {
                break;
            }
            previous = Some(layout);
        }
        crate::residency::add_moved(&self.device, real);
        result.map(|()| (moved, first_peak))
    }

    /// The plan of a step from the planning arena's statistics at its end (`before`: at its
    /// start) over `n` samples.
    pub(super) fn step_plan(
        &self,
        stats: &crate::memory::MemoryStats,
        before: &crate::memory::MemoryStats,
        n: usize,
    ) -> Plan {
        let at = |c| stats.peak_by_category.get(c);
        Plan {
            parameters: at(Category::Parameters),
            gradients: at(Category::Gradients),
            optimizer_state: at(Category::OptimizerState),
            activations: at(Category::Activations),
            workspace: at(Category::Workspace),
            communication: at(Category::Communication),
            all_reduce_buffer: stats.category_peaks.get(Category::Communication),
            peak: stats.peak_bytes_in_use,
            first_step_peak: stats.peak_bytes_in_use,
            peak_reserved: stats.peak_bytes_reserved,
            new_buffers: stats.buffers_created - before.buffers_created,
            peak_op: stats.peak_op.clone(),
            host_bytes: self.optimizer.host_bytes() + self.streamed_host_bytes(),
            bytes_moved: self.offload_bytes_moved(),
            micro_batch: self.micro,
            micro_batches: self.share(n).len().div_ceil(self.micro),
        }
    }

    /// Runs `body` on the device's planning mode under `budget`, after reserving `reserve`
    /// bytes, at micro-batch `micro`, with a stateless copy of the optimizer (so its lazily
    /// made state counts; the real state and the gradients held now are set aside) and the
    /// trainer's step counters, scaler and events restored afterwards, error or not.
    pub(super) fn planned<R>(
        &mut self,
        budget: Option<u64>,
        reserve: u64,
        micro: usize,
        body: impl FnOnce(&mut Self, &PlanScope) -> Result<R>,
    ) -> Result<R> {
        let dev = self.device.clone();
        let scope = dev.planning()?;
        scope.set_budget(budget);
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
        let fresh = self.optimizer.fresh();
        let real_optimizer = std::mem::replace(&mut self.optimizer, fresh);
        let saved = (
            self.scaler.clone(),
            self.step,
            self.loss_steps,
            self.events.len(),
            self.micro,
        );
        self.micro = micro.min(self.config.batch_size).max(1);
        let result = reserved.and_then(|()| body(self, &scope));
        // No unit stays resident from the plan (a planned phase such as generation ends with
        // its units on the planning device): the run fetches its own, as every rank does.
        let ended = crate::residency::finish(&dev, false);
        let result = result.and_then(|r| ended.map(|()| r));
        self.optimizer.zero_grad();
        let planned_optimizer = std::mem::replace(&mut self.optimizer, real_optimizer);
        (self.scaler, self.step, self.loss_steps) = (saved.0, saved.1, saved.2);
        self.events.truncate(saved.3);
        self.micro = saved.4;
        drop(planned_optimizer);
        drop(scope);
        for (p, g) in params.iter().zip(held) {
            if g.is_some() {
                p.set_grad(g)?;
            }
        }
        result
    }
}
