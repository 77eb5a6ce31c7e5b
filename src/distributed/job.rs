//! [`Job`]: how a process takes part in training, alone or as one rank of an MPI job, as a
//! `--distributed` flag chooses it; what the examples share so that each needs a few lines:
//! the command's end ([`Job::main`]), joining the job after the trainer is built and fitted as
//! on one process ([`Job::join`]), this rank's share of a batch, and the JSON fields.

use super::allreduce::AllReduceStats;
use super::comm::share_of;
use super::zero::{Collective, RankPlans, StepCollectives, Zero};
use crate::nn::Module;
use crate::train::{BatchSource, Plan, RunPlan, TrainModel, Trainer};
use crate::{Device, Error, Result};
use std::io::Write;
use std::ops::Range;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// This process's part in a training run.
#[non_exhaustive]
pub enum Job {
    /// The only process.
    Single,
    /// One rank of an MPI job (the `mpi` feature).
    #[cfg(feature = "mpi")]
    Mpi(super::mpi::Mpi),
}

impl Job {
    /// The job a `--distributed` flag names: none (or "none") for one process, "mpi" for an
    /// MPI rank (initializes MPI; without the `mpi` feature an error says how to build it).
    pub fn from_flag(flag: Option<&str>) -> Result<Job> {
        match flag {
            None | Some("none") => Ok(Job::Single),
            #[cfg(feature = "mpi")]
            Some("mpi") => Ok(Job::Mpi(super::mpi::Mpi::init()?)),
            #[cfg(not(feature = "mpi"))]
            Some("mpi") => Err(Error::InvalidArgument {
                op: "--distributed",
                reason: "this program was built without MPI; build it with `--features mpi` \
                         (e.g. cargo build --release --features mpi --example train_mlp)"
                    .into(),
            }),
            Some(other) => Err(Error::InvalidArgument {
                op: "--distributed",
                reason: format!("unknown mode '{other}' (mpi, or none)"),
            }),
        }
    }

    /// A command's whole run as this process's part of the job `flag` names, and its exit
    /// code: `body` runs in the job; a flag or body error is printed to stderr, and on an MPI
    /// rank a body error stops every rank ([`Job::fail`]).
    pub fn main(flag: Option<&str>, body: impl FnOnce(&Job) -> Result<()>) -> ExitCode {
        let job = match Job::from_flag(flag) {
            Ok(j) => j,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        match body(&job) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                // An MPI rank prints its error itself (with its rank).
                job.fail(&e);
                if matches!(job, Job::Single) {
                    eprintln!("error: {e}");
                }
                ExitCode::FAILURE
            }
        }
    }

    /// Refuses, before any device work, what ZeRO stage 3 does not do yet on this job's ranks:
    /// `others` (a flag, and whether it is given). One process holds every shard, so nothing
    /// is refused there. (`--fit auto` at stage 3 fits without host-streamed parameters:
    /// [`Job::fit_auto_stage`].)
    pub fn check_zero(&self, zero: Zero, others: &[(&str, bool)]) -> Result<()> {
        if zero.number() < 3 || self.size() < 2 {
            return Ok(());
        }
        match others.iter().find(|(_, on)| *on) {
            Some((flag, _)) => Err(Error::InvalidArgument {
                op: "--zero 3",
                reason: format!(
                    "{flag} is not built yet at ZeRO stage 3 (sharded parameters); use --zero \
                     2, or leave {flag} out"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Agrees, at start-up and before any other collective, on every setting that shapes the
    /// run: `settings` are (flag, resolved value) pairs, the same flags in the same order on
    /// every rank (steps, batch, accumulation, model, data, precision, `--zero`, ...). On a
    /// mismatch every rank returns the same [`Error::Distributed`] naming the first flag that
    /// differs and ends on it together (each prints it once and exits non-zero; none is left
    /// waiting). One process agrees with itself. See [`agree_settings`](super::agree_settings).
    pub fn agree_settings(&self, settings: &[(&str, String)]) -> Result<()> {
        match self {
            Job::Single => {
                let _ = settings;
                Ok(())
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => {
                match super::settings::disagreement_of(&mut m.communicator()?, settings)? {
                    Some(e) => {
                        // Every rank found the same difference: each ends on it, none aborts.
                        self.fail_together();
                        Err(e)
                    }
                    None => Ok(()),
                }
            }
        }
    }

    /// This process's rank (0 alone); rank 0 prints, evaluates and writes checkpoints.
    pub fn rank(&self) -> usize {
        match self {
            Job::Single => 0,
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => m.rank(),
        }
    }

    /// Processes in the job.
    pub fn size(&self) -> usize {
        match self {
            Job::Single => 1,
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => m.size(),
        }
    }

    /// Whether this process reports (rank 0).
    pub fn is_root(&self) -> bool {
        self.rank() == 0
    }

    /// The positions of this rank's share of a batch of `n` samples (all of them alone): the
    /// samples its trainer runs of each step.
    pub fn share(&self, n: usize) -> Range<usize> {
        share_of(n, self.rank(), self.size())
    }

    /// Makes `trainer` this rank's replica ([`attach`](super::attach)) and returns its all-reduce statistics;
    /// nothing for one process.
    pub fn attach<M: Module>(
        &self,
        trainer: &mut Trainer<M>,
        zero: Zero,
    ) -> Result<Option<Arc<Mutex<AllReduceStats>>>> {
        match self {
            Job::Single => {
                let _ = (trainer, zero);
                Ok(None)
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => Ok(Some(super::attach_zero(trainer, m.communicator()?, zero)?)),
        }
    }

    /// Joins the job with a trainer built (and fitted to its device's budget) as on one
    /// process: [`Job::attach`], then, under a budget, the micro-batch fitted again to this
    /// rank's share, and the rank's start-up line on stderr (`rank R of N: pid P, ...`, what
    /// a launcher's log shows). Nothing changes for one process. Call it on every rank at the
    /// same point, before planning, preallocating or resuming: a `--fit auto` choice made
    /// before it is one process's, the same on every rank.
    pub fn join<M, D>(
        &self,
        trainer: &mut Trainer<M>,
        data: &D,
    ) -> Result<Option<Arc<Mutex<AllReduceStats>>>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        self.join_zero(trainer, data, Zero::OFF)
    }

    /// [`Job::join`] at ZeRO stage `zero` ([`attach_zero`](super::attach_zero)); one process
    /// ignores the stage (it holds every shard).
    pub fn join_zero<M, D>(
        &self,
        trainer: &mut Trainer<M>,
        data: &D,
        zero: Zero,
    ) -> Result<Option<Arc<Mutex<AllReduceStats>>>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let stats = self.attach(trainer, zero)?;
        if stats.is_some() {
            if let Some(budget) = trainer.device().memory_stats().budget {
                trainer.fit_to_budget(data, budget)?;
            }
            self.announce(trainer, zero);
        }
        Ok(stats)
    }

    /// This rank's start-up line on stderr (`rank R of N: pid P, ...`), with its stage.
    pub(super) fn announce<M: Module>(&self, trainer: &Trainer<M>, zero: Zero) {
        let line = format!(
            "rank {} of {}: pid {}, {}, ZeRO stage {}, training on its share of every batch \
             of {}\n",
            self.rank(),
            self.size(),
            std::process::id(),
            trainer.device().info().adapter.name,
            zero.number(),
            trainer.effective_batch()
        );
        // One write: the ranks share the launcher's stderr, and a line written in pieces
        // (as `eprintln!` writes its arguments) can interleave with another rank's.
        let _ = std::io::stderr().write_all(line.as_bytes());
    }

    /// Whether `local` holds on every rank (one small all-gather; `local` alone).
    pub(super) fn all_agree(&self, local: bool) -> Result<bool> {
        match self {
            Job::Single => Ok(local),
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => {
                use super::comm::Communicator as _;
                let all = m.communicator()?.all_gather(&[u64::from(local)])?;
                Ok(all.iter().all(|&v| v != 0))
            }
        }
    }

    /// `result` of work every rank did with no collective inside (so every rank reaches this
    /// call), agreed: when it failed on every rank, each returns its own error and ends
    /// without stopping the others ([`Job::fail_together`]); when it failed on some, those
    /// stop every rank as usual and the others wait here for that. One small all-gather: call
    /// it on every rank at the same point.
    pub fn together<T>(&self, result: Result<T>) -> Result<T> {
        if self.size() < 2 {
            return result;
        }
        if self.all_agree(result.is_err())? {
            self.fail_together();
        }
        result
    }

    /// Marks this rank's coming error as one every rank returns at the same point: [`Job::fail`]
    /// then lets the rank end with it (printing it, exit code non-zero) instead of stopping the
    /// others, which end the same way.
    pub fn fail_together(&self) {
        #[cfg(feature = "mpi")]
        if let Job::Mpi(m) = self {
            m.fail_together();
        }
    }

    /// The collectives of one step of `trainer` at stage `zero` among this job's ranks, with
    /// the bytes each rank sends in them as a ring moves them (none for one process).
    pub fn step_collectives<M: Module>(
        &self,
        trainer: &Trainer<M>,
        zero: Zero,
    ) -> Result<Vec<Collective>> {
        if self.size() < 2 {
            return Ok(Vec::new());
        }
        let (numels, step) = step_shape(trainer, zero);
        zero.collectives_with_units(&numels, self.size(), step, trainer.unit_traffic())
    }

    /// Every rank's planned and measured device bytes of parameters, gradients and optimizer
    /// state at its step's in-use peak, rank 0 first, as JSON objects (`rank`, `planned`,
    /// `measured`): `plan` is this rank's step plan, the measured figure its device's in-use
    /// peak so far (call it after training, before evaluating). One small all-gather: call
    /// it on every rank at the same point.
    pub fn rank_state_bytes(&self, device: &Device, plan: &Plan) -> Result<serde_json::Value> {
        use crate::memory::Category::{Gradients, OptimizerState, Parameters};
        let at = device.memory_stats().peak_by_category;
        let measured = at.get(Parameters) + at.get(Gradients) + at.get(OptimizerState);
        let planned = plan.parameters + plan.gradients + plan.optimizer_state;
        self.rank_pairs(planned, measured)
    }

    /// Every rank's planned and measured device peak reserved over the whole run, rank 0
    /// first, as JSON objects (`rank`, `planned`, `measured`): `planned` is this rank's run
    /// plan's, the measured figure its device's peak so far (call it after training). One
    /// small all-gather: call it on every rank at the same point.
    pub fn rank_peaks(&self, planned: u64, device: &Device) -> Result<serde_json::Value> {
        self.rank_pairs(planned, device.memory_stats().peak_bytes_reserved)
    }

    /// Every rank's `planned` and `measured` figures as JSON objects, rank 0 first.
    fn rank_pairs(&self, planned: u64, measured: u64) -> Result<serde_json::Value> {
        let all = match self {
            Job::Single => vec![planned, measured],
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => {
                use super::comm::Communicator as _;
                m.communicator()?.all_gather(&[planned, measured])?
            }
        };
        let ranks: Vec<serde_json::Value> = all
            .chunks(2)
            .enumerate()
            .map(|(rank, w)| serde_json::json!({"rank": rank, "planned": w[0], "measured": w[1]}))
            .collect();
        Ok(ranks.into())
    }

    /// Each rank's device peak in use so far, rank 0 first, and the model's parameter bytes, as
    /// a JSON object (`rank_peak_bytes_in_use`, `model_parameter_bytes`). Taken after the
    /// model is made and the trainer has joined, before the first step, it shows whether a
    /// device held the whole model: at ZeRO stage 3 over a model made inside
    /// [`born_on_host`](crate::residency::born_on_host) no rank's peak reaches it. One small
    /// all-gather: call it on every rank at the same point.
    pub fn start_memory(&self, device: &Device, model: &dyn Module) -> Result<serde_json::Value> {
        let own = device.memory_stats().peak_bytes_in_use;
        let peaks = match self {
            Job::Single => vec![own],
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => {
                use super::comm::Communicator as _;
                m.communicator()?.all_gather(&[own])?
            }
        };
        let model_bytes: u64 = model
            .parameters()
            .iter()
            .map(|p| (p.numel() * p.dtype().size()) as u64)
            .sum();
        Ok(serde_json::json!({
            "rank_peak_bytes_in_use": peaks,
            "model_parameter_bytes": model_bytes,
        }))
    }

    /// Adds `bytes_sent_per_step` (each rank's bytes per step, all collectives together, as
    /// a ring moves them; 0 for one process) and `collectives` to a run's JSON object `j`.
    pub fn add_traffic_to_json<M: Module>(
        &self,
        j: &mut serde_json::Value,
        trainer: &Trainer<M>,
        zero: Zero,
    ) -> Result<()> {
        let c = self.step_collectives(trainer, zero)?;
        j["bytes_sent_per_step"] = c.iter().map(|c| c.sent_bytes).sum::<u64>().into();
        j["collectives"] = serde_json::to_value(&c).unwrap_or_default();
        let (numels, _) = step_shape(trainer, Zero::OFF);
        j["parameter_elements"] = numels.iter().sum::<usize>().into();
        // What the reduce-scatter and the all-gather carry: the shards, padding included (at
        // stage 3, of the parameters in no unit).
        let (flat, _) = step_shape(trainer, zero);
        j["padded_elements"] = match zero.number() {
            0 => numels.iter().sum::<usize>(),
            _ => super::zero::ShardLayout::new(&flat, self.size().max(1))?.padded_len(),
        }
        .into();
        Ok(())
    }

    /// Saves a checkpoint of `trainer` on rank 0 ([`Trainer::save_checkpoint`]); the other
    /// ranks join in putting a sharded optimizer state together (ZeRO), and at stage 3 the
    /// sharded units' parameters ([`Trainer::gather_parameters`]), so the file holds the whole
    /// model and state, loadable by one process or any number of ranks. Call it on every rank.
    pub fn save_checkpoint<M: Module>(
        &self,
        trainer: &Trainer<M>,
        path: &std::path::Path,
        epochs_done: u64,
    ) -> Result<()> {
        trainer.gather_parameters()?;
        if self.is_root() {
            trainer.save_checkpoint(path, epochs_done)
        } else {
            trainer.optimizer.checkpoint_state().map(drop)
        }
    }

    /// A sharded checkpoint of `trainer` in the folder `dir` ([`zero::checkpoint`](super::zero::checkpoint)):
    /// every rank writes its shard (at stage 3 its shard of each unit too, from its own
    /// pieces: nothing is gathered), rank 0 the index; one process writes one shard. Call it
    /// on every rank with the stage the job trains at.
    pub fn save_sharded<M: Module>(
        &self,
        trainer: &Trainer<M>,
        dir: &std::path::Path,
        epochs_done: u64,
        zero: Zero,
    ) -> Result<()> {
        match self {
            Job::Single => {
                let _ = zero;
                super::zero::checkpoint::save_replicas(
                    std::slice::from_ref(trainer),
                    dir,
                    epochs_done,
                    false,
                )
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => super::zero::checkpoint::save_sharded(
                trainer,
                &mut m.communicator()?,
                dir,
                epochs_done,
                zero.number() > 0,
            ),
        }
    }

    /// Restores `trainer` from a checkpoint file or a sharded checkpoint's folder (written by
    /// any number of ranks; [`load_checkpoint`](super::load_checkpoint)) and returns the
    /// epochs done. Under ZeRO each rank keeps its own shard of the state.
    pub fn resume_from<M: Module>(
        &self,
        trainer: &mut Trainer<M>,
        path: &std::path::Path,
    ) -> Result<u64> {
        trainer.resume_from_checkpoint(&super::load_checkpoint(path)?)
    }

    /// Prints the run's plan (`--plan`) on rank 0 ([`crate::train::print_plan`]); on an MPI
    /// rank also every rank's planned device bytes and the step's collectives ([`RankPlans`],
    /// under `per_rank` in the JSON). Call it on every rank at the same point.
    pub fn print_plan<M: Module>(
        &self,
        trainer: &Trainer<M>,
        run: &RunPlan,
        zero: Zero,
        json: bool,
        planned_in: Duration,
    ) -> Result<()> {
        let ranks = self.rank_plans(trainer, &run.step, zero)?;
        if !self.is_root() {
            return Ok(());
        }
        let note = self.zero_note(zero);
        if json {
            let mut j = crate::train::plan_json(run, planned_in);
            if let Some(r) = &ranks {
                j["per_rank"] = serde_json::to_value(r).unwrap_or_default();
            }
            if let Some(n) = &note {
                j["zero_note"] = n.clone().into();
            }
            println!("{j}");
        } else {
            if let Some(n) = &note {
                println!("{n}");
            }
            crate::train::print_plan(run, false, planned_in);
            if let Some(r) = &ranks {
                print!("{r}");
            }
        }
        Ok(())
    }

    /// What a plan at ZeRO stage `zero` is on this job, where the stage changes nothing: on
    /// one process (no `--distributed`) every shard is held by the one rank, so the plan is a
    /// plain run's, said rather than left for the reader to assume (issue 43 item 4).
    pub fn zero_note(&self, zero: Zero) -> Option<String> {
        (zero.number() > 0 && self.size() < 2).then(|| {
            format!(
                "ZeRO stage {} asked for on one process: it holds every shard, so this is a \
                 plain run's plan; start the ranks with mpirun and --distributed mpi to plan \
                 each rank's share",
                zero.number()
            )
        })
    }

    /// Every rank's plan of its step (`plan` is this rank's) and the step's collectives at
    /// stage `zero`; nothing for one process. Call it on every rank at the same point.
    pub fn rank_plans<M: Module>(
        &self,
        trainer: &Trainer<M>,
        plan: &Plan,
        zero: Zero,
    ) -> Result<Option<RankPlans>> {
        match self {
            Job::Single => {
                let _ = (plan, zero, trainer);
                Ok(None)
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => {
                let collectives = self.step_collectives(trainer, zero)?;
                let mut comm = m.communicator()?;
                RankPlans::gather_with(&mut comm, plan, zero, collectives).map(Some)
            }
        }
    }

    /// A hash of every rank's parameter values (FNV-1a over their bits), rank after rank: the
    /// same on every rank when the replicas hold the same bits. Call it on every rank at the
    /// same point (one small all-gather); one process gets its own hash.
    pub fn weight_hashes(&self, model: &dyn Module) -> Result<Vec<u64>> {
        let own = super::allreduce::hash_values(&super::allreduce::parameter_values(model)?);
        match self {
            Job::Single => Ok(vec![own]),
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => {
                use super::comm::Communicator as _;
                m.communicator()?.all_gather(&[own])
            }
        }
    }

    /// Adds the job to a run's JSON object `j`: `ranks`, and with `stats` (an MPI rank's)
    /// `all_reduce` (steps, buffer bytes, milliseconds per step of the round trip and of its
    /// gather, communication and scatter).
    pub fn add_to_json(
        &self,
        j: &mut serde_json::Value,
        stats: Option<&Arc<Mutex<AllReduceStats>>>,
    ) {
        j["ranks"] = self.size().into();
        if let Some(s) = stats {
            let s = crate::device::lock(s).clone();
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / s.steps.max(1) as f64;
            j["all_reduce"] = serde_json::json!({
                "steps": s.steps,
                "buffer_bytes": s.buffer_bytes,
                "round_trip_ms_per_step": ms(s.round_trip()),
                "gather_ms_per_step": ms(s.gather),
                "communicate_ms_per_step": ms(s.communicate),
                "scatter_ms_per_step": ms(s.scatter),
            });
        }
    }

    /// What a process does with the error it stops on: an MPI rank stops every rank with its
    /// message (the others would wait for it), unless every rank stops on it at the same point
    /// ([`Job::fail_together`]); one process returns and reports it itself.
    pub fn fail(&self, error: &Error) {
        match self {
            Job::Single => {
                let _ = error;
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) if m.failing_together() => {
                let line = format!(
                    "fitgrad rank {} of {}: error: {error} (every rank stops on it)\n",
                    m.rank(),
                    m.size()
                );
                // One write: the ranks share the launcher's stderr.
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => m.abort(&format!("error: {error}; stopping every rank")),
        }
    }
}

/// The element counts of the parameters the flat shards hold at `zero` (all of them; at
/// stage 3 those in no unit) and what a step's collectives depend on besides the stage.
fn step_shape<M: Module>(trainer: &Trainer<M>, zero: Zero) -> (Vec<usize>, StepCollectives) {
    let units = match zero.number() {
        3 => trainer.model.units(),
        _ => Vec::new(),
    };
    let in_unit = |p: &crate::Tensor| units.iter().flat_map(|(_, u)| u).any(|u| u.is_same(p));
    let numels: Vec<usize> = trainer
        .model
        .parameters()
        .iter()
        .filter(|p| !in_unit(p))
        .map(|p| p.numel())
        .collect();
    let step = StepCollectives {
        clipping: trainer.config().clip_grad_norm.is_some(),
        finite_check_every: match trainer.scaler() {
            Some(_) => 1,
            None => trainer.config().check_finite_every,
        },
    };
    (numels, step)
}
