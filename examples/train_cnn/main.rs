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

use fitgrad::distributed::Job;
use fitgrad::nn::Module;
use fitgrad::optim::{AdamW, LrSchedule, Optimizer, Sgd};
use fitgrad::report::{StepCapture, TrainingReport};
use fitgrad::run::{self, finish};
use fitgrad::train::{TrainEvent, Trainer, TrainerConfig};
use fitgrad::{Bytes, Result};
use model::ResNet;
pub use setup::{prepare, Args, Setup};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
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
    let images = setup.images(args.seed)?;
    let device = run::open_device(args.run.adapter.as_deref(), setup.budget)?;
    say!("adapter: {}", device.info().adapter);
    say!(
        "dataset: {} ({} train, {} test, {side}x{side}, {} classes)",
        train.name,
        train.len(),
        setup.test.len(),
        train.classes
    );
    let mut trainer = build(&args, &setup, &device, total_steps)?;
    let invariant = trainer.config().batch_invariant;
    say!(
        "model: ResNet, stem stride {}, {} stages of width {}, {}, {} ({} blocks, {} norm, {} parameters), {} lr {}, {}, batch {} x {}",
        setup.stem_stride,
        3,
        setup.width,
        2 * setup.width,
        4 * setup.width,
        trainer.model.blocks.len(),
        args.norm,
        trainer.model.num_parameters(),
        args.optimizer,
        setup.lr,
        args.precision,
        setup.batch_size,
        args.run.accum_steps
    );
    if invariant {
        say!("group norm: batch-invariant sums (any micro-batch size gives the same weights)");
    }
    let aug = setup.aug;
    if aug.is_on() {
        let flips = if aug.flip {
            "horizontal flips"
        } else {
            "no flips"
        };
        say!(
            "augmentation: random crops (padding {}), {flips} (seeded per sample and epoch)",
            aug.pad
        );
    }
    if setup.cosine {
        say!(
            "learning rate: cosine to 0 over {total_steps} steps, warm-up {}",
            total_steps / 20
        );
    }
    if let Some(b) = setup.budget {
        if setup.fit_auto {
            let choice = trainer.fit_auto(&images, b)?;
            say!("fit auto: {choice}");
        } else {
            trainer.fit_to_budget(&images, b)?;
        }
    }
    let all_reduce = dist.join(&mut trainer, &images)?;
    if let Some(b) = setup.budget {
        let micro = trainer.micro_batch();
        say!(
            "memory budget {}: micro-batch {micro} of {}",
            Bytes(b),
            setup.batch_size
        );
        if !setup.group && micro < setup.batch_size {
            say!(
                "warning: batch norm's statistics are those of each micro-batch of {micro}, not of \
                 the batch of {} (as in PyTorch with accumulation); --norm group does not \
                 mix samples (its steps are the whole batch's, bit for bit)",
                setup.batch_size
            );
        }
    }
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
    let (final_loss, oom_retries, capture) = train_epochs(
        &args,
        &setup,
        &mut trainer,
        &images,
        first_epoch,
        &mut report,
        root,
    )?;
    device.sync()?;
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
    if !root {
        return Ok(outcome);
    }
    let train_secs = started.elapsed().as_secs_f64();
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
        let mut j = serde_json::json!({
            "dataset": train.name,
            "norm": args.norm,
            "batch_invariant": invariant,
            "width": setup.width,
            "stem_stride": setup.stem_stride,
            "parameters": trainer.model.num_parameters(),
            "epochs": setup.epochs,
            "batch_size": setup.batch_size,
            "micro_batch": trainer.micro_batch(),
            "precision": args.precision,
            "checkpoint_activations": args.fit.checkpoint_activations,
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

/// The model and its trainer as the flags ask: the optimizer, the schedule over
/// `total_steps`, batch-invariant sums with group norm in f32.
fn build(
    args: &Args,
    setup: &Setup,
    device: &fitgrad::Device,
    total_steps: u64,
) -> Result<Trainer<ResNet>> {
    let shape = model::Shape {
        width: setup.width,
        stem_stride: setup.stem_stride,
        blocks: args.blocks,
        group_norm: setup.group,
        seed: args.seed,
    };
    let model = ResNet::new(device, setup.side, setup.train.classes, shape)?;
    if args.fit.checkpoint_activations {
        model.checkpoint.store(true, Ordering::Relaxed);
    }
    let lr = setup.lr as f32;
    let optimizer: Box<dyn Optimizer> = match args.optimizer.as_str() {
        "sgd" => Box::new(Sgd::new(model.parameters(), lr)?.momentum(0.9)?),
        _ => Box::new(AdamW::new(model.parameters(), lr)?),
    };
    let schedule = match setup.cosine {
        true => LrSchedule::WarmupCosine {
            warmup_steps: total_steps / 20,
            total_steps,
            min_lr_ratio: 0.0,
        },
        false => LrSchedule::Constant,
    };
    // Group norm mixes no samples: with batch-invariant sums a budget's micro-batches then give
    // the whole batch's bits (f32; mixed precision rounds each micro-batch's gradients to f16).
    let invariant =
        setup.group && setup.precision == fitgrad::train::Precision::F32 && !args.fast_sums;
    let config = TrainerConfig::new(setup.batch_size, args.run.accum_steps, lr)
        .schedule(schedule)
        .precision(setup.precision)
        .batch_invariant(invariant);
    Trainer::new(model, optimizer, config)
}

/// Epochs `first..`: the loss every 50 steps on stderr, the events, a save after each epoch;
/// (the last loss, the steps redone after running out of memory, the step's memory).
fn train_epochs(
    args: &Args,
    setup: &Setup,
    trainer: &mut Trainer<ResNet>,
    images: &augment::Augmented<'_>,
    first: u64,
    report: &mut TrainingReport,
    root: bool,
) -> Result<(f32, usize, StepCapture)> {
    let train = &setup.train;
    let eff = trainer.effective_batch();
    let steps_per_epoch = train.len().div_ceil(eff);
    let mut final_loss = f32::NAN;
    let mut capture = StepCapture::new();
    let mut oom_retries = 0;
    for epoch in first..setup.epochs {
        let epoch_start = Instant::now();
        trainer.train_epoch(images, args.seed, epoch, |t, done, total| {
            if args.report.is_some() {
                capture.after_step(t, images)?;
            }
            if done.is_multiple_of(50) || done == total {
                let loss = t.take_loss()?;
                if !loss.is_nan() {
                    final_loss = loss;
                }
                let rate = (done * eff).min(train.len()) as f64 / epoch_start.elapsed().as_secs_f64();
                if root {
                    eprintln!(
                        "epoch {} step {done}/{steps_per_epoch}: loss {final_loss:.4}, {rate:.0} samples/s",
                        epoch + 1
                    );
                }
                report.log_step(t.steps(), loss, Some(rate));
            }
            Ok(())
        })?;
        let secs = epoch_start.elapsed().as_secs_f64();
        for e in trainer.take_events() {
            if matches!(e, TrainEvent::OomRetry { .. }) {
                oom_retries += 1;
            }
            if root {
                println!("  {e}");
            }
        }
        let rate = train.len() as f64 / secs;
        report.log_epoch(epoch, trainer.steps(), final_loss, rate, secs);
        if let (Some(path), true) = (&args.checkpoint.save, root) {
            trainer.save_checkpoint(path, epoch + 1)?;
        }
    }
    Ok((final_loss, oom_retries, capture))
}

fn main() -> ExitCode {
    // Flag errors exit with 1 and clap's message; --help prints and exits with 0.
    let args = match run::parse::<Args>() {
        Ok(a) => a,
        Err(code) => return code,
    };
    Job::main(args.distributed.clone().as_deref(), |dist| {
        run(args, dist).map(drop)
    })
}
