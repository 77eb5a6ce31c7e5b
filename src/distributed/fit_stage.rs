//! `--fit auto` over the ZeRO stages on the ranks of a [`Job`]: the stages in order of the
//! bytes they send, each rung's verdict agreed by every rank ([`Job::fit_auto_stage`]).

use super::allreduce::AllReduceStats;
use super::zero::Zero;
use super::Job;
use crate::nn::Module;
use crate::train::{BatchSource, Candidate, FitChoice, Plan, Residence, TrainModel, Trainer};
use crate::{Device, Error, Result};
use std::sync::{Arc, Mutex};

impl Job {
    /// `--fit auto` over the ZeRO stages on an MPI rank, cheapest communication first: with
    /// no stage `given`, stages 0, 1 and 2 in turn (1 and 2 send the bytes of 0; all three
    /// exact), each fitted to this rank's share by the exact micro-batch search alone
    /// ([`Trainer::fit_to_budget`]), then stage 3 (its all-gathers send half as much again)
    /// with the ladder's rungs that keep every byte on the device: micro-batch, checkpointing,
    /// mixed precision ([`Trainer::fit_auto_on_device`]; host-streamed parameters are what
    /// stage 3 replaces). Stage 3 is skipped when the model `build` makes at it has no units.
    /// With `given` stage 3, that stage alone. Each candidate is a trainer built by
    /// `build(stage)` (the budget lifted while it builds; at stage 3 the caller makes the model
    /// inside [`born_on_host`](crate::residency::born_on_host)) and made a replica at that
    /// stage ([`Job::attach`]); every verdict is agreed through the communicator (one
    /// all-gather each), so every rank takes the same stage and rung.
    ///
    /// `None` for one process, with `given` stages 0 to 2 (the caller runs fit auto as on one
    /// process, then joins at that stage), or with no stage given when none fits so: the
    /// caller then runs fit auto's whole ladder at stage 2, whose later rungs move state to
    /// host memory (when that fails too on every rank, [`Job::fail_together`]). With `given`
    /// stage 3, nothing fitting is the ladder's [`Error::BudgetTooSmall`], on every rank
    /// (which then ends without stopping the others: [`Job::fail_together`]). Call it on
    /// every rank at the same point.
    pub fn fit_auto_stage<M, D>(
        &self,
        device: &Device,
        data: &D,
        given: Option<Zero>,
        build: impl Fn(Zero) -> Result<Trainer<M>>,
    ) -> Result<Option<StageChoice<M>>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let stages: &[u8] = match given.map(|z| z.number()) {
            None => &[0, 1, 2, 3],
            Some(3) => &[3],
            Some(_) => return Ok(None),
        };
        if self.size() < 2 {
            return Ok(None);
        }
        let Some(budget) = device.memory_stats().budget else {
            return Err(Error::InvalidArgument {
                op: "--fit auto",
                reason: "fit auto needs a memory budget to fit: add --memory-budget".into(),
            });
        };
        let mut candidates = Vec::new();
        for &stage in stages {
            let zero = Zero::stage(stage)?;
            device.set_memory_budget(None)?;
            let built = build(zero);
            device.set_memory_budget(Some(budget))?;
            let mut t = built?;
            if stage == 3 && !t.model.units().iter().any(|(_, p)| !p.is_empty()) {
                // Nothing to shard beyond stage 2's: not a rung of this model. (The same
                // model, hence the same verdict, on every rank.)
                drop(t);
                device.empty_cache();
                continue;
            }
            let stats = self.attach(&mut t, zero)?;
            let fitted = match stage {
                3 => match self.fit_stage_3(&mut t, data, budget, &mut candidates) {
                    Ok(choice) => Some(choice),
                    Err(e @ Error::BudgetTooSmall { .. }) if given.is_some() => {
                        // Every rank planned every rung and none fitted everywhere.
                        self.fail_together();
                        return Err(e);
                    }
                    Err(Error::BudgetTooSmall { .. }) => None,
                    Err(e) => return Err(e),
                },
                _ => self.fit_micro_batch(&mut t, data, budget, stage, &mut candidates)?,
            };
            if let Some(choice) = fitted {
                self.announce(&t, zero);
                return Ok(stats.map(|stats| StageChoice {
                    trainer: t,
                    zero,
                    choice,
                    stats,
                }));
            }
            drop(t);
            device.empty_cache();
        }
        Ok(None)
    }

    /// Stage `stage` (0 to 2) of [`Job::fit_auto_stage`]: the micro-batch search alone, its
    /// candidate appended to `candidates` (and then all of them in the choice); `None` when
    /// it does not fit on every rank.
    fn fit_micro_batch<M, D>(
        &self,
        t: &mut Trainer<M>,
        data: &D,
        budget: u64,
        stage: u8,
        candidates: &mut Vec<Candidate>,
    ) -> Result<Option<FitChoice>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let fits = match t.fit_to_budget(data, budget) {
            Ok(_) => true,
            Err(Error::BudgetTooSmall { .. }) => false,
            Err(e) => return Err(e),
        };
        let plan = match fits {
            true => t.plan(data).unwrap_or_default(),
            false => Plan::default(),
        };
        let everywhere = self.all_agree(fits)?;
        candidates.push(Candidate {
            description: format!(
                "ZeRO stage {stage}, micro-batch {} of this rank's share{}",
                t.micro_batch(),
                if fits && !everywhere {
                    " (fits here, not on every rank)"
                } else {
                    ""
                }
            ),
            micro_batch: t.micro_batch(),
            checkpointing: false,
            precision: t.config().precision,
            planned_peak: plan.peak,
            planned_reserved: plan.peak_reserved,
            fits: everywhere,
            residence: Residence::Device,
            host_bytes: 0,
            bytes_moved: 0,
        });
        Ok(everywhere.then(|| FitChoice {
            budget,
            batch_size: t.config().batch_size,
            micro_batch: t.micro_batch(),
            checkpointing: false,
            precision: t.config().precision,
            residence: Residence::Device,
            candidates: candidates.clone(),
        }))
    }

    /// Stage 3 of [`Job::fit_auto_stage`]: the device-only rungs of fit auto's ladder at this
    /// rank's share, each verdict agreed by every rank; its candidates, named by the stage,
    /// appended to `candidates`.
    fn fit_stage_3<M, D>(
        &self,
        t: &mut Trainer<M>,
        data: &D,
        budget: u64,
        candidates: &mut Vec<Candidate>,
    ) -> Result<FitChoice>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let before = candidates.len();
        let mut choice =
            t.fit_auto_on_device(data, budget, candidates, &mut |fits| self.all_agree(fits));
        for c in &mut candidates[before..] {
            c.description = format!("ZeRO stage 3, {}", c.description);
        }
        if let Ok(choice) = &mut choice {
            choice.candidates = candidates.clone();
        }
        choice
    }
}

/// What [`Job::fit_auto_stage`] chose: the trainer, already this rank's replica at `zero`.
pub struct StageChoice<M: Module> {
    /// The trainer, a replica at `zero`, its micro-batch fitted to this rank's share.
    pub trainer: Trainer<M>,
    /// The stage chosen.
    pub zero: Zero,
    /// The stages planned, for printing and the JSON.
    pub choice: FitChoice,
    /// The replica's exchange statistics.
    pub stats: Arc<Mutex<AllReduceStats>>,
}
