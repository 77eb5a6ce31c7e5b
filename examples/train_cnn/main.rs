//! `cargo run --release --example train_cnn` — a small ResNet defined here with `module!`,
//! trained by the generic `Trainer` with every memory feature.
//!
//! The model: a 3x3 stem conv (1 -> W channels; stride 2 on 28x28 images), then residual blocks
//! `relu(x + norm(conv(relu(norm(conv(x))))))`, the second and third stages entered by a
//! strided block (3x3 stride 2, the skip a 1x1 stride-2 conv and norm) that doubles the
//! channels, a global average pool and a Linear head. `--norm batch` (the default) uses
//! BatchNorm2d, whose batch statistics mix the samples of a micro-batch (so a budget that
//! splits the batch changes the numbers, as in PyTorch); `--norm group` uses GroupNorm, which
//! does not, so a budgeted run ends with the unbudgeted run's weights.
//!
//! Data: Fashion-MNIST when `/usr/share/datasets/fashion-mnist` holds it (`apt-get install
//! dataset-fashion-mnist`), else the 8x8 digits embedded in the crate (`--dataset` chooses).
//! Images come as rows of pixels and are seen as (B, 1, S, S).
//!
//! Memory flags as custom_model: `--memory-budget` (micro-batches fitted to it), `--fit auto`
//! (with a budget: micro-batch, then checkpointing, then mixed precision), `--plan`,
//! `--prealloc`, `--precision mixed`, `--checkpoint-activations` (each residual block keeps
//! only its input), `--save` / `--resume`, `--report`, `--json`, `--distributed mpi`. It prints
//! the planned peak of a step beside the measured one.

pub mod augment;
pub mod model;
mod setup;
mod train;

use augment::Augmented;
use fitgrad::distributed::AllReduceStats;
use fitgrad::distributed::Job;
use fitgrad::nn::Module;
use fitgrad::report::{StepCapture, TrainingReport};
use fitgrad::run::{self, finish};
use fitgrad::train::{Plan, Trainer};
use fitgrad::{Bytes, Result};
use model::ResNet;
pub use setup::{prepare, Args, Setup};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What a run ends with: the planned and measured peak bytes in use of its steps, the
/// micro-batch it ran, its test accuracy (the root only), and the model's parameters and
/// buffers by name (what the tests compare).
#[derive(Debug, Default)]
pub struct Outcome {
    pub planned_peak: u64,
    pub measured_peak: u64,
    pub micro_batch: usize,
    /// Steps that ran out of memory and were redone at a smaller micro-batch.
    pub oom_retries: usize,
    pub test_accuracy: f32,
    pub tensors: Vec<(String, Vec<f32>)>,
}

/// The model's parameters and buffers, read back.
fn tensors_of(model: &ResNet) -> Result<Vec<(String, Vec<f32>)>> {
    let mut all = model.named_parameters();
    all.extend(model.named_buffers());
    all.into_iter()
        .map(|(n, t)| Ok((n, t.to_vec_f32()?)))
        .collect()
}

/// Checks the flags ([`prepare`]), then trains, evaluates and reports as this process's part
/// of `dist` (rank 0 prints, evaluates and saves).
pub fn run(args: Args, dist: &Job) -> Result<Outcome> {
    let root = dist.is_root();
    macro_rules! say {
        ($($t:tt)*) => { if root { println!($($t)*); } };
    }
    let setup = prepare(&args)?;
    let (train, side) = (&setup.train, setup.side);
    let total_steps = setup::total_steps(&setup, args.run.accum_steps)?;
    let images = setup.images(args.run.seed)?;
    let device = run::open_device(args.run.adapter.as_deref(), setup.budget)?;
    say!("adapter: {}", device.info().adapter);
    say!(
        "dataset: {} ({} train, {} test, {side}x{side}, {} classes)",
        train.name,
        train.len(),
        setup.test.len(),
        train.classes
    );
    let (mut trainer, all_reduce) = fit_budget(&args, &setup, &device, total_steps, &images, dist)?;
    let plan = trainer.plan(&images)?;
    if args.run.plan {
        if root {
            print!("{plan}");
        }
        return Ok(Outcome {
            planned_peak: plan.peak,
            micro_batch: trainer.micro_batch(),
            ..Outcome::default()
        });
    }
    if args.checkpoint.prealloc {
        let reserved = trainer.prealloc(&images)?;
        say!("reserved {} up front", Bytes(reserved));
    }
    let title = format!("train_cnn (ResNet, {} norm) on {}", args.norm, train.name);
    let mut report = TrainingReport::new(title, &device, "samples/s");
    report.set_plan(plan.clone());
    let mut first_epoch = 0;
    if let Some(path) = &args.checkpoint.resume {
        first_epoch = trainer.resume_from(path)?;
        say!("resumed from {} after {first_epoch} epochs", path.display());
    }
    let started = Instant::now();
    let (final_loss, oom_retries, capture) = train::train_epochs(
        &args,
        &setup,
        &mut trainer,
        &images,
        first_epoch,
        &mut report,
        root,
    )
    .map_err(|e| run::own_remedy(e, REMEDY))?;
    device.sync()?;
    let figures = (
        plan,
        final_loss,
        oom_retries,
        started.elapsed().as_secs_f64(),
    );
    finish_run(
        &args,
        &setup,
        trainer,
        report,
        (capture, all_reduce),
        dist,
        figures,
    )
}

/// The replica's exchange statistics under MPI.
type Exchange = Option<Arc<Mutex<AllReduceStats>>>;

/// The trainer built under the budget as the flags ask (`--fit auto`'s choice, else the
/// micro-batch fitted to it), the model made afresh for each budget tried so a too-small
/// budget names the smallest that works ([`Trainer::build_within_budget`],
/// [`Trainer::build_fit_auto`]); the job joined, and the micro-batch said, with batch norm's
/// warning when it splits a batch.
fn fit_budget(
    args: &Args,
    setup: &Setup,
    device: &fitgrad::Device,
    total_steps: u64,
    images: &Augmented<'_>,
    dist: &Job,
) -> Result<(Trainer<ResNet>, Exchange)> {
    let root = dist.is_root();
    let build = || train::build(args, setup, device, total_steps);
    let mut trainer = if setup.fit_auto && setup.budget.is_some() {
        // Planned alike on every rank: when nothing fits, every rank ends with the error.
        let (trainer, choice) = dist.together(Trainer::build_fit_auto(device, images, build))?;
        if root {
            print!("{choice}");
        }
        trainer
    } else {
        Trainer::build_within_budget(device, images, build)?
    };
    if root {
        train::describe(args, setup, &trainer, total_steps);
    }
    let all_reduce = dist.join(&mut trainer, images)?;
    let (Some(b), true) = (setup.budget, root) else {
        return Ok((trainer, all_reduce));
    };
    let (micro, batch) = (trainer.micro_batch(), setup.batch_size);
    println!("memory budget {}: micro-batch {micro} of {batch}", Bytes(b));
    if !setup.group && micro < batch {
        println!(
            "warning: batch norm's statistics are those of each micro-batch of {micro}, not of \
             the batch of {batch} (as in PyTorch with accumulation); --norm group does not \
             mix samples (its steps are the whole batch's, bit for bit)"
        );
    }
    Ok((trainer, all_reduce))
}

/// The end of the run: the outcome on every rank; on rank 0 the test set, the memory beside
/// its plan, the report and the JSON line. `figures`: the step's plan, the last loss, the
/// steps redone after running out of memory, the seconds training took.
fn finish_run(
    args: &Args,
    setup: &Setup,
    trainer: Trainer<ResNet>,
    mut report: TrainingReport,
    (capture, all_reduce): (StepCapture, Option<Arc<Mutex<AllReduceStats>>>),
    dist: &Job,
    (plan, final_loss, oom_retries, train_secs): (Plan, f32, usize, f64),
) -> Result<Outcome> {
    let summary = trainer.memory_summary();
    let measured = summary.stats.peak_bytes_in_use;
    let mut outcome = Outcome {
        planned_peak: plan.peak,
        measured_peak: measured,
        micro_batch: trainer.micro_batch(),
        oom_retries,
        test_accuracy: f32::NAN,
        tensors: tensors_of(&trainer.model)?,
    };
    if !dist.is_root() {
        return Ok(outcome);
    }
    let eval = trainer.evaluate(&setup.test, trainer.micro_batch())?;
    let accuracy = eval.accuracy.unwrap_or(f32::NAN);
    outcome.test_accuracy = accuracy;
    println!(
        "test: loss {:.4}, accuracy {:.2}% ({train_secs:.1} s training)",
        eval.loss,
        100.0 * accuracy
    );
    println!("\n{summary}");
    finish::print_step_peak_detail(&plan, measured);
    if let Some(path) = &args.report {
        report.set_step_memory(capture.finish());
        report.set_memory(summary.stats.clone());
        report
            .result("test accuracy", format!("{:.2}%", 100.0 * accuracy))
            .result("training time", format!("{train_secs:.1} s"));
        finish::write_reports(&report, Some(path), None)?;
    }
    if args.run.json {
        let aug = setup.aug;
        let mut j = serde_json::json!({
            "dataset": setup.train.name,
            "norm": args.norm,
            "batch_invariant": trainer.config().batch_invariant,
            "width": setup.width,
            "stem_stride": setup.stem_stride,
            "parameters": trainer.model.num_parameters(),
            "epochs": setup.epochs,
            "batch_size": setup.batch_size,
            "micro_batch": trainer.micro_batch(),
            // What the run trained with: --fit auto's choice, else the flags.
            "precision": format!("{:?}", trainer.config().precision).to_lowercase(),
            "checkpoint_activations": trainer.model.checkpoint.load(Ordering::Relaxed),
            "crop_pad": aug.pad,
            "flip": aug.flip,
            "cosine": setup.cosine,
            "memory_budget": setup.budget,
            "planned_peak_bytes": plan.peak,
            "peak_bytes_in_use": measured,
            "steps": trainer.steps(),
            "final_loss": final_loss,
            "test_loss": eval.loss,
            "test_accuracy": accuracy,
            "train_seconds": train_secs,
        });
        dist.add_to_json(&mut j, all_reduce.as_ref());
        println!("{j}");
    }
    Ok(outcome)
}

/// What to change when training diverges, in this command's flags.
const REMEDY: &str = "lower the learning rate (--lr), or resume (--resume) from a checkpoint \
                      saved (--save) before it diverged";

fn main() -> ExitCode {
    // Flag errors exit with 1 and clap's message; --help prints and exits with 0.
    let args = match run::parse::<Args>() {
        Ok(a) => a,
        Err(code) => return code,
    };
    Job::main(args.distributed.clone().as_deref(), |dist| {
        run::agree_flags::<Args>(dist)?;
        run(args, dist).map(drop)
    })
}
