//! The whole run's plan ([`Trainer::plan_whole_run`]): the training step, then what the run
//! does with the model besides steps — evaluation batches, generation with its KV cache —
//! planned in that order on one planning arena, so its peak is the run's and a budget bounds
//! all of it.
//!
//! Like the step's plan (train/plan.rs) it estimates nothing: each phase is the run's own code
//! (`Trainer::evaluate`, `Gpt::generate`, ...) run on the device's planning mode after two
//! planned steps, so the optimizer state, the cached segments and the fragmentation the steps
//! leave are what the phase starts from, as in the real run.

use super::budget::smallest_fitting;
use super::model::{BatchSource, TrainModel};
use super::plan::Plan;
use super::Trainer;
use crate::error::Bytes;
use crate::nn::Module;
use crate::{Error, Result};
use std::fmt;

/// One phase of a run besides its training steps, for [`Trainer::plan_whole_run`]: a name
/// ("evaluation", "generation") and the code it runs, called on the planning device.
pub type Phase<'a, M> = (
    &'static str,
    Box<dyn FnMut(&mut Trainer<M>) -> Result<()> + 'a>,
);

/// The planned peaks of one phase.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PhasePlan {
    /// What the phase does.
    pub name: String,
    /// Peak bytes in use during the phase.
    pub peak: u64,
    /// Peak bytes the arena holds from the driver during the phase (with what earlier phases
    /// left cached).
    pub peak_reserved: u64,
}

/// The planned peaks of a whole run: its training step, then each other phase in order.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunPlan {
    /// The training step's plan.
    pub step: Plan,
    /// The phases after the steps, in the order they were planned.
    pub phases: Vec<PhasePlan>,
    /// Peak bytes in use over the run: the largest of the step's and the phases'.
    pub peak: u64,
    /// Peak bytes reserved over the run, what a budget bounds and what the device's
    /// `peak_bytes_reserved` reaches.
    pub peak_reserved: u64,
}

impl fmt::Display for RunPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "planned peak of the whole run: {} in use, {} reserved",
            Bytes(self.peak),
            Bytes(self.peak_reserved)
        )?;
        let row = |f: &mut fmt::Formatter<'_>, name: &str, peak: u64, reserved: u64| {
            writeln!(
                f,
                "  {name:<28} {:>11} in use, {:>11} reserved",
                Bytes(peak).to_string(),
                Bytes(reserved).to_string()
            )
        };
        row(f, "training step", self.step.peak, self.step.peak_reserved)?;
        for p in &self.phases {
            row(f, &p.name, p.peak, p.peak_reserved)?;
        }
        Ok(())
    }
}

/// The plan of a step and of the whole run as one JSON line (`--plan --json`), else as their
/// tables and the time planning took.
pub fn print_plan(run: &RunPlan, json: bool, planned_in: std::time::Duration) {
    if json {
        println!("{}", plan_json(run, planned_in));
    } else {
        print!("{}{run}", run.step);
        println!(
            "  (planned by running the step and the run on the device's planning mode in {:.0} ms)",
            planned_in.as_secs_f64() * 1e3
        );
    }
}

/// The JSON object of [`print_plan`]: the step's fields at the top, the whole run's phases
/// and peaks under "run", and the planning time.
pub fn plan_json(run: &RunPlan, planned_in: std::time::Duration) -> serde_json::Value {
    let mut j = serde_json::to_value(&run.step).unwrap_or_default();
    j["run"] = serde_json::json!({
        "phases": run.phases,
        "peak": run.peak,
        "peak_reserved": run.peak_reserved,
    });
    j["planning_ms"] = (planned_in.as_secs_f64() * 1e3).into();
    j
}

impl<M: Module> Trainer<M> {
    /// Plans the whole run under the device's budget: a training step on `data` at the
    /// current micro-batch (as [`Trainer::plan`], with what the source keeps resident), then
    /// each of `phases` in order, all on one planning arena. Nothing runs on the device and
    /// the trainer is left as it was.
    ///
    /// Under a budget, a phase that does not fit first lowers the micro-batch (a smaller step
    /// leaves less cached for the phases; the largest whose whole run fits is kept); when not
    /// even one-sample micro-batches let the run fit, the error is [`Error::BudgetTooSmall`]
    /// naming the smallest budget for the whole run, exact to the byte.
    pub fn plan_whole_run<D>(&mut self, data: &D, phases: &mut [Phase<'_, M>]) -> Result<RunPlan>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let idx = self.plan_indices(data)?;
        let Some(budget) = self.device.memory_stats().budget else {
            return self.run_plan_at(data, &idx, self.micro, None, phases);
        };
        if let Some(p) = self.run_within(data, &idx, self.micro, budget, phases)? {
            return Ok(p);
        }
        // The step fitted alone (or the trainer would not be here): find the largest
        // micro-batch whose whole run fits, by bisection as for the step.
        let (mut lo, mut hi) = (1, self.micro.saturating_sub(1));
        if hi >= 1 && self.run_within(data, &idx, 1, budget, phases)?.is_some() {
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                if self.run_within(data, &idx, mid, budget, phases)?.is_some() {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            self.set_micro_batch(lo)?;
            return self.run_plan_at(data, &idx, lo, Some(budget), phases);
        }
        let free = self.run_plan_at(data, &idx, 1, None, phases)?;
        let minimum = smallest_fitting(0, free.peak_reserved, |b| {
            Ok(self.run_within(data, &idx, 1, b, phases)?.is_some())
        })?;
        let names: Vec<&str> = phases.iter().map(|p| p.0).collect();
        Err(Error::BudgetTooSmall {
            budget,
            minimum,
            what: format!(
                "the whole run ({} parameters; a training step of one-sample micro-batches, then {})",
                self.model.num_parameters(),
                names.join(", ")
            ),
        })
    }

    /// The whole run's plan at micro-batch `micro` under `budget`, or `None` when it does not
    /// fit (past the budget or an adapter limit).
    fn run_within<D>(
        &mut self,
        data: &D,
        idx: &[usize],
        micro: usize,
        budget: u64,
        phases: &mut [Phase<'_, M>],
    ) -> Result<Option<RunPlan>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        match self.run_plan_at(data, idx, micro, Some(budget), phases) {
            Ok(p) if p.peak_reserved <= budget => Ok(Some(p)),
            Ok(_) | Err(Error::OutOfMemory { .. } | Error::Limit { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Planned steps over `idx` at `micro` until the arena settles, then the phases, under
    /// `budget`.
    fn run_plan_at<D>(
        &mut self,
        data: &D,
        idx: &[usize],
        micro: usize,
        budget: Option<u64>,
        phases: &mut [Phase<'_, M>],
    ) -> Result<RunPlan>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        self.planned(budget, 0, micro, |t, scope| {
            let dev = t.device.clone();
            let before = scope.stats();
            let resident = data.resident(&dev)?;
            let (moved, first_step_peak) = t.planned_steps(data, idx, true, scope)?;
            drop(resident);
            t.optimizer.zero_grad();
            let mut step = t.step_plan(&scope.stats(), &before, idx.len());
            step.bytes_moved += moved;
            step.first_step_peak = first_step_peak;
            let mut run = RunPlan {
                peak: step.peak,
                peak_reserved: step.peak_reserved,
                step,
                phases: Vec::new(),
            };
            for (name, phase) in phases.iter_mut() {
                scope.reset_peak();
                phase(t)?;
                let s = scope.stats();
                run.peak = run.peak.max(s.peak_bytes_in_use);
                run.peak_reserved = run.peak_reserved.max(s.peak_bytes_reserved);
                run.phases.push(PhasePlan {
                    name: name.to_string(),
                    peak: s.peak_bytes_in_use,
                    peak_reserved: s.peak_bytes_reserved,
                });
            }
            Ok(run)
        })
    }
}
