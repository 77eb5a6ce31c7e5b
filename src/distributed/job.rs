//! [`Job`]: how a process takes part in training, alone or as one rank of an MPI job, as a
//! `--distributed` flag chooses it; what the examples share so that each needs a few lines:
//! the command's end ([`Job::main`]), joining the job after the trainer is built and fitted as
//! on one process ([`Job::join`]), this rank's share of a batch, and the JSON fields.

use super::allreduce::AllReduceStats;
use super::comm::share_of;
use super::zero::{RankPlans, StepCollectives, Zero};
use crate::cli;
use crate::nn::Module;
use crate::train::{BatchSource, Plan, RunPlan, TrainModel, Trainer};
use crate::{Error, Result};
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
                job.fail(&e);
                eprintln!("error: {e}");
                ExitCode::FAILURE
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
            let line = format!(
                "rank {} of {}: pid {}, {}, training on its share of every batch of {}\n",
                self.rank(),
                self.size(),
                std::process::id(),
                trainer.device().info().adapter.name,
                trainer.effective_batch()
            );
            // One write: the ranks share the launcher's stderr, and a line written in pieces
            // (as `eprintln!` writes its arguments) can interleave with another rank's.
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
        Ok(stats)
    }

    /// Saves a checkpoint of `trainer` on rank 0 ([`Trainer::save_checkpoint`]); the other
    /// ranks join in putting a sharded optimizer state together (ZeRO), so the file holds the
    /// whole state, loadable by one process or any number of ranks. Call it on every rank.
    pub fn save_checkpoint<M: Module>(
        &self,
        trainer: &Trainer<M>,
        path: &std::path::Path,
        epochs_done: u64,
    ) -> Result<()> {
        if self.is_root() {
            trainer.save_checkpoint(path, epochs_done)
        } else {
            trainer.optimizer.checkpoint_state().map(drop)
        }
    }

    /// A sharded checkpoint of `trainer` in the folder `dir` ([`zero::checkpoint`](super::zero::checkpoint)):
    /// every rank writes its shard, rank 0 the index; one process writes one shard. Call it on
    /// every rank with the stage the job trains at.
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

    /// Prints the run's plan (`--plan`) on rank 0 ([`cli::print_plan`]); on an MPI rank also
    /// every rank's planned device bytes and the step's collectives ([`RankPlans`], under
    /// `per_rank` in the JSON). Call it on every rank at the same point.
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
        if json {
            let mut j = cli::plan_json(run, planned_in);
            if let Some(r) = &ranks {
                j["per_rank"] = serde_json::to_value(r).unwrap_or_default();
            }
            println!("{j}");
        } else {
            cli::print_plan(run, false, planned_in);
            if let Some(r) = &ranks {
                print!("{r}");
            }
        }
        Ok(())
    }

    /// Every rank's plan of its step (`plan` is this rank's) and the step's collectives at
    /// stage `zero`; nothing for one process. Call it on every rank at the same point.
    pub fn rank_plans<M: Module>(
        &self,
        trainer: &Trainer<M>,
        plan: &Plan,
        zero: Zero,
    ) -> Result<Option<RankPlans>> {
        let numels: Vec<usize> = trainer
            .model
            .parameters()
            .iter()
            .map(|p| p.numel())
            .collect();
        let step = StepCollectives {
            clipping: trainer.config().clip_grad_norm.is_some(),
            finite_check_every: match trainer.scaler() {
                Some(_) => 1,
                None => trainer.config().check_finite_every,
            },
        };
        match self {
            Job::Single => {
                let _ = (plan, zero, numels, step);
                Ok(None)
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => {
                let mut comm = m.communicator()?;
                RankPlans::gather(&mut comm, plan, &numels, zero, step).map(Some)
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
    /// message (the others would wait for it); one process returns and reports it itself.
    pub fn fail(&self, error: &Error) {
        match self {
            Job::Single => {
                let _ = error;
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => m.abort(&format!("error: {error}; stopping every rank")),
        }
    }
}
