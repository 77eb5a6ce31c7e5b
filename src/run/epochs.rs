//! A classifier's run in epochs over a [`Dataset`] and its test split: the whole run planned
//! (`--plan`), a resume, the epochs with a progress bar, pruning, the report's curves, saves
//! after each epoch, and the test set at the end.

use super::finish;
use crate::compress::Pruner;
use crate::distributed::{Job, Zero};
use crate::report::{StepCapture, TrainingReport};
use crate::train::data::Dataset;
use crate::train::shard::{ShardedDataset, TempShardFile};
use crate::train::{BatchSource, ClassBatch, Evaluation, MemorySummary, Phase, RunPlan};
use crate::train::{TrainModel, Trainer};
use crate::{Bytes, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::Path;
use std::time::Instant;

/// Samples per forward when evaluating without a budget: few large dispatches.
const EVAL_BATCH: usize = 1024;

/// The description of an epoch run: its data, length and outputs.
pub struct EpochRun<'a> {
    /// The job this process is part of (rank 0 prints, evaluates and saves).
    pub dist: &'a Job,
    /// The training set.
    pub train: &'a Dataset,
    /// The test set, evaluated at the end (and after every epoch with `reporting`).
    pub test: &'a Dataset,
    /// Seeds the epochs' orders.
    pub seed: u64,
    /// Epochs in all (a resumed run goes on to this many).
    pub epochs: u64,
    /// Under a memory budget: evaluation runs at the training micro-batch.
    pub budgeted: bool,
    /// A report is written: the test set after every epoch and the memory of a step.
    pub reporting: bool,
    /// `--save`: a checkpoint after every epoch.
    pub save: Option<&'a Path>,
    /// `--save-sharded`: a sharded checkpoint after every epoch.
    pub save_sharded: Option<&'a Path>,
    /// Say on the first epoch's bar that kernels are compiling.
    pub compiling_note: bool,
    /// `--report` (HTML) and `--report-json`: where the report is written at the end.
    pub report_files: (Option<&'a Path>, Option<&'a Path>),
    /// The end prints the step's peak with the op it is reached at and the peak reserved
    /// ([`finish::print_step_peak_detail`]), else the short line.
    pub peak_detail: bool,
}

/// What the end of a classifier run measured ([`EpochRun::end`]).
pub struct Ended<T> {
    /// Training's memory (before the final evaluation).
    pub summary: MemorySummary,
    /// The test set's loss and accuracy.
    pub eval: Evaluation,
    /// The pruned model's sparsity.
    pub sparsity: Option<f64>,
    /// The trained figures' JSON fields ([`Trained::json`]).
    pub figures: serde_json::Value,
    /// What the command's own step after the test returned.
    pub extra: T,
}

impl<T> Ended<T> {
    /// The `--json` fields of a classifier run: the memory ([`finish::memory_json`]), the
    /// figures, the test loss, accuracy and sparsity, then the command's `own` fields.
    pub fn json<M: crate::nn::Module>(
        &self,
        trainer: &Trainer<M>,
        run: &RunPlan,
        offload: &str,
        own: serde_json::Value,
    ) -> serde_json::Value {
        let memory = finish::memory_json(trainer, run, &self.summary, offload);
        let test = serde_json::json!({
            "test_loss": self.eval.loss,
            "test_accuracy": self.eval.accuracy.unwrap_or(f32::NAN),
            "sparsity": self.sparsity,
        });
        let j = finish::extend(finish::extend(memory, self.figures.clone()), test);
        finish::extend(j, own)
    }
}

/// What the epochs ended with.
pub struct Trained {
    /// The last training loss read back.
    pub final_loss: f32,
    /// Seconds training took (evaluations after each epoch left out).
    pub train_secs: f64,
    /// Training samples per second.
    pub samples_per_s: f64,
    /// The memory of a step, for the report.
    pub capture: StepCapture,
}

impl<'a> EpochRun<'a> {
    /// A run of `epochs` over `train` as the shared flags `args` ask: the seed, the budget,
    /// `--save`, `--report` and `--report-json`; no sharded saves, no note on compiling, the
    /// short peak line (set those fields after).
    pub fn new(
        dist: &'a Job,
        args: &'a super::TrainArgs,
        (train, test): (&'a Dataset, &'a Dataset),
        epochs: u64,
    ) -> EpochRun<'a> {
        EpochRun {
            dist,
            train,
            test,
            seed: args.run.seed,
            epochs,
            budgeted: args.run.memory_budget.is_some(),
            reporting: args.report.any(),
            save: args.checkpoint.save.as_deref(),
            save_sharded: None,
            compiling_note: false,
            report_files: (
                args.report.report.as_deref(),
                args.report.report_json.as_deref(),
            ),
            peak_detail: false,
        }
    }
}

impl EpochRun<'_> {
    fn say(&self, line: impl std::fmt::Display) {
        if self.dist.is_root() {
            println!("{line}");
        }
    }

    /// Samples per forward of the final evaluation: the micro-batch under a budget (a batch
    /// that does not fit is split), else large batches.
    pub fn eval_batch<M: crate::nn::Module>(&self, t: &Trainer<M>) -> usize {
        if self.budgeted {
            t.micro_batch()
        } else {
            EVAL_BATCH
        }
    }

    /// Plans the whole run on `data` (what the epochs train on): steps, then the test set
    /// after every epoch with a report, then at the end; rank 0 alone evaluates. With `plan`
    /// (`--plan`) the plan is printed ([`Job::print_plan`]) and `None` returned.
    pub fn plan<M, D>(
        &self,
        trainer: &mut Trainer<M>,
        data: &D,
        zero: Zero,
        plan: bool,
        json: bool,
    ) -> Result<Option<RunPlan>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch> + TrainModel<ClassBatch>,
    {
        let planning = Instant::now();
        let root = self.dist.is_root();
        let mut phases: Vec<Phase<'_, M>> = Vec::new();
        if root && self.reporting {
            phases.push((
                "evaluation after each epoch",
                Box::new(|t| t.evaluate(self.test, t.micro_batch()).map(drop)),
            ));
        }
        if root {
            phases.push((
                "evaluation",
                Box::new(|t| t.evaluate(self.test, self.eval_batch(t)).map(drop)),
            ));
        }
        let run_plan = trainer.plan_whole_run(data, &mut phases)?;
        drop(phases);
        if plan {
            let printed = self
                .dist
                .print_plan(trainer, &run_plan, zero, json, planning.elapsed());
            return printed.map(|_| None);
        }
        Ok(Some(run_plan))
    }

    /// Resumes `trainer` from `path` on every rank, the pruner's masks taken from the
    /// checkpoint's zeros, and says so; `nothing_to_train` (the checkpoint holds every
    /// epoch) is said too. Returns the epochs done.
    pub fn resume<M: crate::nn::Module>(
        &self,
        trainer: &mut Trainer<M>,
        path: &Path,
        pruner: Option<&mut Pruner>,
        nothing_to_train: bool,
    ) -> Result<u64> {
        let done = self.dist.resume_from(trainer, path)?;
        if let Some(p) = pruner {
            // The masks are not in the checkpoint; the pruned weights are its zeros.
            p.mask_zeros()?;
        }
        self.say(format_args!(
            "resumed from {} after {done} epochs ({} steps)",
            path.display(),
            trainer.steps()
        ));
        if nothing_to_train {
            self.say(format_args!(
                "nothing left to train: the checkpoint holds {done} epochs and --epochs is {}; evaluating it as it is",
                self.epochs
            ));
        }
        Ok(done)
    }

    /// Trains epochs `first..epochs` (from `sharded` when given), a progress bar per epoch
    /// on rank 0, `pruner` stepped after every step, the loss and throughput logged into
    /// `report` every 10 steps; after each epoch its events, the test set with a report, and
    /// the saves every rank joins.
    pub fn train<M>(
        &self,
        trainer: &mut Trainer<M>,
        first: u64,
        mut pruner: Option<&mut Pruner>,
        report: &mut TrainingReport,
        zero: Zero,
        sharded: Option<&ShardedDataset>,
    ) -> Result<Trained>
    where
        M: TrainModel<ClassBatch>,
    {
        let (train, root) = (self.train, self.dist.is_root());
        let style = ProgressStyle::with_template(
            "epoch {prefix:>3} [{bar:30}] {pos}/{len} steps {msg} ({elapsed})",
        )
        .expect("valid template")
        .progress_chars("=> ");
        let eff = trainer.effective_batch();
        let steps_per_epoch = train.len().div_ceil(eff) as u64;
        let started = Instant::now();
        let mut final_loss = f32::NAN;
        // With a report: the memory of the second step, and the test set after every epoch
        // (at the micro-batch, which needs less memory than a training step).
        let mut capture = StepCapture::new();
        let mut eval_secs = 0.0;
        for epoch in first..self.epochs {
            let bar = match root {
                true => ProgressBar::new(steps_per_epoch),
                false => ProgressBar::hidden(),
            }
            .with_style(style.clone())
            .with_prefix(format!("{}", epoch + 1));
            if epoch == first && self.compiling_note {
                // On a new machine the first steps compile every kernel (lavapipe: tens of
                // seconds); the driver caches them on disk for the next run.
                bar.set_message("compiling GPU kernels (first run on this machine only)...");
                bar.tick();
            }
            let epoch_start = Instant::now();
            let on_step = |t: &mut Trainer<M>, done: usize, total: usize| {
                if let Some(p) = pruner.as_deref_mut() {
                    p.step(t.steps())?;
                }
                bar.set_position(done as u64);
                if self.reporting {
                    capture.after_step(t, train)?;
                }
                // A readback every 10 steps keeps the GPU busy between them.
                if done.is_multiple_of(10) || done == total {
                    let loss = t.take_loss()?;
                    if !loss.is_nan() {
                        final_loss = loss;
                    }
                    let samples = (done * eff).min(train.len());
                    let rate = samples as f64 / epoch_start.elapsed().as_secs_f64();
                    bar.set_message(format!("loss {final_loss:.4}, {rate:.0} samples/s"));
                    report.log_step(t.steps(), loss, Some(rate));
                }
                Ok(())
            };
            match sharded {
                Some(s) => trainer.train_epoch_sharded(s, self.seed, epoch, on_step)?,
                None => trainer.train_epoch(train, self.seed, epoch, on_step)?,
            }
            bar.finish();
            let epoch_secs = epoch_start.elapsed().as_secs_f64();
            eval_secs += self.after_epoch(trainer, epoch, epoch_secs, final_loss, report, zero)?;
        }
        trainer.device().sync()?;
        let train_secs = started.elapsed().as_secs_f64() - eval_secs;
        let epochs_run = self.epochs.saturating_sub(first);
        let samples_per_s = (train.len() as u64 * epochs_run) as f64 / train_secs.max(1e-9);
        Ok(Trained {
            final_loss,
            train_secs,
            samples_per_s,
            capture,
        })
    }

    /// After epoch `epoch`: its events and figures into `report`, the test set with a report
    /// (the seconds it took are returned), the saves.
    fn after_epoch<M>(
        &self,
        trainer: &mut Trainer<M>,
        epoch: u64,
        secs: f64,
        loss: f32,
        report: &mut TrainingReport,
        zero: Zero,
    ) -> Result<f64>
    where
        M: TrainModel<ClassBatch>,
    {
        let events = trainer.take_events();
        for e in &events {
            self.say(format_args!("  {e}"));
        }
        report.add_events(&events);
        let rate = self.train.len() as f64 / secs;
        report.log_epoch(epoch, trainer.steps(), loss, rate, secs);
        // ZeRO stage 3: the layers gathered on every rank, so one rank evaluates alone.
        trainer.gather_parameters()?;
        let mut eval_secs = 0.0;
        if self.reporting {
            let eval_start = Instant::now();
            let e = trainer
                .evaluate(self.test, trainer.micro_batch())?
                .finite(trainer.steps(), "test")?;
            report.log_eval(trainer.steps(), Some(epoch), "test", &e);
            eval_secs = eval_start.elapsed().as_secs_f64();
        }
        // Every rank joins (a ZeRO rank holds a shard of the optimizer state); rank 0 writes.
        if let Some(path) = self.save {
            self.dist.save_checkpoint(trainer, path, epoch + 1)?;
        }
        if let Some(dir) = self.save_sharded {
            self.dist.save_sharded(trainer, dir, epoch + 1, zero)?;
        }
        Ok(eval_secs)
    }

    /// The test set at the end (rank 0): training's memory summary taken first (before
    /// evaluation's larger batches count), then the evaluation, then the `test:` line.
    pub fn test<M>(
        &self,
        trainer: &Trainer<M>,
        trained: &Trained,
    ) -> Result<(MemorySummary, Evaluation)>
    where
        M: TrainModel<ClassBatch>,
    {
        let summary = trainer.memory_summary();
        let eval = trainer
            .evaluate(self.test, self.eval_batch(trainer))?
            .finite(trainer.steps(), "test")?;
        println!(
            "test: loss {:.4}, accuracy {:.2}% ({:.1} s training, {:.0} samples/s)",
            eval.loss,
            100.0 * eval.accuracy.unwrap_or(f32::NAN),
            trained.train_secs,
            trained.samples_per_s
        );
        Ok((summary, eval))
    }

    /// The end of a classifier run on rank 0: the test set ([`EpochRun::test`]), the command's
    /// own step `after_test`, the sparsity, the memory summary and the step's and the whole
    /// run's peaks beside their plans, the device's memory report, and the report written.
    pub fn end<M, T>(
        &self,
        trainer: &Trainer<M>,
        trained: Trained,
        pruner: Option<&Pruner>,
        run: &RunPlan,
        report: &mut TrainingReport,
        after_test: impl FnOnce(&Evaluation) -> Result<T>,
    ) -> Result<Ended<T>>
    where
        M: TrainModel<ClassBatch>,
    {
        let (summary, eval) = self.test(trainer, &trained)?;
        let extra = after_test(&eval)?;
        let sparsity = finish::print_sparsity(pruner)?;
        println!("\n{summary}");
        let (plan, stats) = (&run.step, &summary.stats);
        match self.peak_detail {
            true => {
                finish::print_step_peak_detail(plan, stats.peak_bytes_in_use);
                println!(
                    "peak reserved: planned {} / measured {}",
                    Bytes(plan.peak_reserved),
                    Bytes(stats.peak_bytes_reserved)
                );
            }
            false => finish::print_step_peak(plan, &summary),
        }
        finish::print_whole_run(run, trainer.device());
        println!("{}", trainer.device().memory_report());
        let accuracy = eval.accuracy.unwrap_or(f32::NAN);
        report
            .result("test loss", format!("{:.4}", eval.loss))
            .result("test accuracy", format!("{:.2}%", 100.0 * accuracy))
            .result("training time", format!("{:.1} s", trained.train_secs))
            .result(
                "throughput",
                format!("{:.0} samples/s", trained.samples_per_s),
            )
            .result("steps", trainer.steps());
        let figures = trained.json();
        report.set_step_memory(trained.capture.finish());
        report.set_memory(summary.stats.clone());
        finish::write_reports(report, self.report_files.0, self.report_files.1)?;
        Ok(Ended {
            summary,
            eval,
            sparsity,
            figures,
            extra,
        })
    }

    /// Reserves the planned peak up front (`--prealloc`) and says how much.
    pub fn prealloc<M, D>(&self, trainer: &mut Trainer<M>, data: &D) -> Result<()>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let reserved = trainer.prealloc(data)?;
        self.say(format_args!("reserved {} up front", Bytes(reserved)));
        Ok(())
    }
}

/// `train` streamed from a shard file of `size` samples a shard (`--shard-size`), written once
/// to the temp folder under a name of `train` and `seed`, and said on rank 0. The file is
/// unique to this process and removed when the returned guard is dropped (error or not), on
/// Ctrl-C or SIGTERM, or by the next run after a kill.
pub fn temp_shards(
    dist: &Job,
    train: &Dataset,
    seed: u64,
    size: Option<usize>,
) -> Result<(Option<ShardedDataset>, Option<TempShardFile>)> {
    let Some(size) = size else {
        return Ok((None, None));
    };
    let file = TempShardFile::new(&format!("{}-seed{seed}", train.name));
    ShardedDataset::create(train, file.path())?;
    let s = ShardedDataset::open(file.path(), size)?;
    if dist.is_root() {
        println!(
            "sharded: {} shards of up to {size} samples from {}",
            s.num_shards(),
            file.path().display()
        );
    }
    Ok((Some(s), Some(file)))
}

impl Trained {
    /// The `--json` fields of the figures: `final_loss`, `train_seconds`, `samples_per_s`.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "final_loss": self.final_loss,
            "train_seconds": self.train_secs,
            "samples_per_s": self.samples_per_s,
        })
    }
}
