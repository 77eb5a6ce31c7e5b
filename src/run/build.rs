//! The trainer a run builds: within the memory budget, or chosen by `--fit auto` (over the
//! ZeRO stages under MPI), then joined to the job at its stage; and the pruner it counts.

use crate::distributed::{AllReduceStats, Job, Zero};
use crate::train::{BatchSource, FitChoice, TrainModel, Trainer};
use crate::{Device, Result};
use std::sync::{Arc, Mutex};

/// A trainer built for a run ([`build_trainer`]) and how it joined the job.
pub struct Built<M: crate::nn::Module> {
    /// This rank's trainer, its micro-batch fitted to the budget and to this rank's share.
    pub trainer: Trainer<M>,
    /// What the run chose and joined with.
    pub job: Joined,
}

/// What building a run's trainer chose, beside the trainer.
pub struct Joined {
    /// What `--fit auto` chose (`None` without it).
    pub choice: Option<FitChoice>,
    /// The ZeRO stage the run trains at.
    pub zero: Zero,
    /// The replica's exchange statistics (under MPI).
    pub all_reduce: Option<Arc<Mutex<AllReduceStats>>>,
    /// Every rank's device peak after building and joining (the JSON's `start`).
    pub start_memory: serde_json::Value,
}

/// How a run's trainer is built.
pub struct Strategy {
    /// `--fit auto`: the budget chooses the micro-batch, checkpointing and precision.
    pub fit_auto: bool,
    /// The ZeRO stage asked for (`--zero`), or the default one.
    pub zero: Zero,
    /// Whether `--zero` was given (fit auto tries every stage otherwise).
    pub zero_given: bool,
    /// What the run trains on, stored in its checkpoints.
    pub identity: Vec<(String, String)>,
}

/// Builds the trainer `build` makes at a ZeRO stage, on `device` under its budget, as this
/// process's part of `dist`. With `fit_auto` the budget chooses (under MPI first over the
/// stages at this rank's share, [`Job::fit_auto_stage`]), and rank 0 prints the choice;
/// without it the trainer is built within the budget ([`Trainer::build_within_budget`]). The
/// trainer then joins the job at its stage ([`Job::join_zero`]), fitted to its share.
pub fn build_trainer<M, D>(
    dist: &Job,
    device: &Device,
    data: &D,
    strategy: Strategy,
    build: impl Fn(Zero) -> Result<Trainer<M>>,
) -> Result<Built<M>>
where
    D: BatchSource,
    M: TrainModel<D::Batch>,
{
    let Strategy {
        fit_auto,
        zero,
        zero_given,
        identity,
    } = strategy;
    let given = zero_given.then_some(zero);
    let staged = match fit_auto {
        true => dist.fit_auto_stage(device, data, given, &build)?,
        false => None,
    };
    let (mut trainer, choice, zero, all_reduce) = if let Some(s) = staged {
        if dist.is_root() {
            print!("{}", s.choice);
        }
        (s.trainer, Some(s.choice), s.zero, Some(s.stats))
    } else {
        let (mut trainer, choice) = if fit_auto {
            // Planned alike on every rank (the whole batch, before joining): when nothing
            // fits, every rank ends with the error.
            let fitted = Trainer::build_fit_auto(device, data, || build(zero));
            let (trainer, choice) = dist.together(fitted)?;
            if dist.is_root() {
                print!("{choice}");
            }
            (trainer, Some(choice))
        } else {
            (
                Trainer::build_within_budget(device, data, || build(zero))?,
                None,
            )
        };
        // No stage fitted alone: the ladder's choice at the stage that keeps the least.
        let zero = match fit_auto && !zero_given && dist.size() > 1 {
            true => Zero::stage(2)?,
            false => zero,
        };
        // Fitted to the whole batch as on one process; a rank refits to its share.
        let all_reduce = dist.join_zero(&mut trainer, data, zero)?;
        (trainer, choice, zero, all_reduce)
    };
    trainer.set_data_identity(identity);
    // Every rank's device peak so far: what making the model and joining the job held.
    let start_memory = dist.start_memory(device, &trainer.model)?;
    Ok(Built {
        trainer,
        job: Joined {
            choice,
            zero,
            all_reduce,
            start_memory,
        },
    })
}

/// The pruner `--prune` asks for, its schedule over the run's `total_steps`, made once the
/// trainer is built so the plan counts its masks (as many bytes as the weights); under a
/// budget the micro-batch is chosen again with them in use.
pub fn pruner<M, D>(
    trainer: &mut Trainer<M>,
    prune: Option<crate::compress::PruneConfig>,
    total_steps: u64,
    data: &D,
) -> Result<Option<crate::compress::Pruner>>
where
    D: BatchSource,
    M: TrainModel<D::Batch>,
{
    let Some(mut cfg) = prune else {
        return Ok(None);
    };
    cfg.schedule = crate::compress::PruneSchedule::gradual(total_steps);
    let pruner = crate::compress::Pruner::new(&trainer.model, cfg)?;
    if let Some(b) = trainer.device().memory_stats().budget {
        trainer.fit_to_budget(data, b)?;
    }
    Ok(Some(pruner))
}

/// The learning rate's schedule over a run of `total_steps`: with `cosine`, a linear warm-up
/// over the first 5% of the steps, then cosine decay to `min_lr_ratio` of the rate; else
/// constant.
pub fn lr_schedule(cosine: bool, total_steps: u64, min_lr_ratio: f32) -> crate::optim::LrSchedule {
    match cosine {
        true => crate::optim::LrSchedule::WarmupCosine {
            warmup_steps: total_steps / 20,
            total_steps,
            min_lr_ratio,
        },
        false => crate::optim::LrSchedule::Constant,
    }
}
