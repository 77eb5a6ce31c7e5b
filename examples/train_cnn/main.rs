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

use augment::{Augment, Augmented};
use clap::Parser;
use fitgrad::distributed::Job;
use fitgrad::nn::Module;
use fitgrad::optim::{AdamW, LrSchedule, Optimizer, Sgd};
use fitgrad::report::{check_output_path, StepCapture, TrainingReport};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::Precision;
use fitgrad::train::{TrainEvent, Trainer, TrainerConfig};
use fitgrad::{Bytes, Device, DeviceOptions};
use fitgrad::{Error, Result};
use model::ResNet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Where `apt-get install dataset-fashion-mnist` puts the IDX files.
const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

#[derive(Parser, Debug)]
#[command(about = "Train a small ResNet defined in this example with fitgrad's Trainer")]
pub struct Args {
    /// auto (Fashion-MNIST when installed, else digits), digits, fashion-mnist, mnist, or a
    /// folder of IDX files.
    #[arg(long, default_value = "auto")]
    dataset: String,
    /// batch (BatchNorm2d) or group (GroupNorm, groups of 4 channels).
    #[arg(long, default_value = "batch")]
    norm: String,
    /// With group norm: add each micro-batch's weight gradients as separate sums (faster) instead
    /// of the batch-invariant sums that make a budgeted run end on the unbudgeted run's weights.
    #[arg(long)]
    fast_sums: bool,
    /// Channels of the first stage (the second and third have 2x and 4x); default 24 for
    /// images of 16 pixels a side or more (Fashion-MNIST), 16 for smaller ones (the digits).
    #[arg(long)]
    width: Option<usize>,
    /// The stem conv's stride: default 2 for images of 16 pixels a side or more (28x28 ->
    /// 14x14 before the first stage), 1 for smaller ones.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4))]
    stem_stride: Option<u64>,
    /// Residual blocks per stage after its first.
    #[arg(long, default_value_t = 0)]
    blocks: usize,
    /// Epochs (default: 3 on Fashion-MNIST, 10 on the digits).
    #[arg(long)]
    epochs: Option<u64>,
    /// Samples per batch; default 128 for images of 16 pixels a side or more, 64 for smaller
    /// ones.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Batches whose gradients add up before each optimizer step.
    #[arg(long, default_value_t = 1)]
    accum_steps: usize,
    /// adamw, or sgd (momentum 0.9).
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "sgd"])]
    optimizer: String,
    /// The learning rate; default 4e-3 for images of 16 pixels a side or more, 2e-3 for
    /// smaller ones.
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f64>,
    /// constant, or cosine (decay to 0 over the run after a warm-up of 5% of the steps);
    /// default cosine for images of 16 pixels a side or more, constant for smaller ones.
    #[arg(long, value_parser = ["constant", "cosine"])]
    schedule: Option<String>,
    /// The same as --schedule cosine.
    #[arg(long)]
    cosine: bool,
    /// Seeds the weights, the data split and order, and the augmentation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Random crops: pad every side with this many zeros, then crop back to the image size at a
    /// seeded offset (per sample and epoch).
    #[arg(long, default_value_t = 0)]
    crop_pad: usize,
    /// Random horizontal flips (seeded, per sample and epoch).
    #[arg(long)]
    flip: bool,
    /// Both: --crop-pad 2 --flip.
    #[arg(long)]
    augment: bool,
    /// Train on the first N samples of the training set only (a quick run).
    #[arg(long)]
    train_samples: Option<usize>,
    /// Hard limit on device memory (e.g. 16MiB): the micro-batch is chosen to fit.
    #[arg(long)]
    memory_budget: Option<String>,
    /// `auto` (needs --memory-budget): the budget picks micro-batch, activation
    /// checkpointing and precision, in that order.
    #[arg(long)]
    fit: Option<String>,
    /// Print the planned peak memory of a training step and exit.
    #[arg(long)]
    plan: bool,
    /// Reserve the planned peak before training.
    #[arg(long)]
    prealloc: bool,
    /// f32, or mixed (f32 master weights, f16 activations, loss scaling).
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Keep only each residual block's input; recompute the block in backward.
    #[arg(long)]
    checkpoint_activations: bool,
    /// Save a checkpoint after every epoch (running statistics included).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Resume from a checkpoint written by --save.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Substring of the adapter name to use.
    #[arg(long)]
    adapter: Option<String>,
    /// End stdout with one JSON object describing the run.
    #[arg(long)]
    json: bool,
    /// Write an HTML report of the run.
    #[arg(long)]
    report: Option<PathBuf>,
    /// `mpi`: one rank of data-parallel training started by mpirun (`--features mpi`).
    #[arg(long)]
    distributed: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

fn invalid(reason: String) -> Error {
    Error::InvalidArgument {
        op: "train_cnn",
        reason,
    }
}

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

pub fn run(args: Args, dist: &Job) -> Result<Outcome> {
    let root = dist.is_root();
    macro_rules! say {
        ($($t:tt)*) => { if root { println!($($t)*); } };
    }
    let precision: Precision = args.precision.parse()?;
    if precision == Precision::F16 {
        return Err(invalid("--precision f32 or mixed".into()));
    }
    let group = match args.norm.as_str() {
        "batch" => false,
        "group" => true,
        n => return Err(invalid(format!("--norm batch or group, got '{n}'"))),
    };
    if args.fast_sums && !group {
        return Err(invalid("--fast-sums applies to --norm group".into()));
    }
    if args.width == Some(0) || args.batch_size == Some(0) || args.accum_steps == 0 {
        return Err(invalid(
            "--width, --batch-size and --accum-steps must be positive".into(),
        ));
    }
    if args.cosine && args.schedule.as_deref() == Some("constant") {
        return Err(invalid("--cosine and --schedule constant disagree".into()));
    }
    if let Some(lr) = args.lr.filter(|lr| !(lr.is_finite() && *lr > 0.0)) {
        return Err(invalid(format!("--lr must be positive, got {lr}")));
    }
    let fit_auto = match args.fit.as_deref() {
        None => false,
        Some("auto") => true,
        Some(f) => return Err(invalid(format!("--fit takes 'auto', got '{f}'"))),
    };
    let budget = args
        .memory_budget
        .as_deref()
        .map(|b| b.parse::<Bytes>().map(|b| b.0))
        .transpose()?;
    if fit_auto && budget.is_none() {
        return Err(invalid("--fit auto needs --memory-budget".into()));
    }
    if let Some(p) = &args.report {
        check_output_path("--report", p)?;
    }
    if args.train_samples == Some(0) {
        return Err(invalid("--train-samples must be positive".into()));
    }
    let spec = match args.dataset.as_str() {
        "auto" if Path::new(FASHION_MNIST_DIR).is_dir() => "fashion-mnist",
        "auto" => "digits",
        s => s,
    };
    let (mut train, test): (Dataset, Dataset) = data::load(spec, args.seed)?;
    if let Some(n) = args.train_samples.filter(|&n| n < train.len()) {
        train.features.truncate(n * train.dim);
        train.labels.truncate(n);
    }
    let side = train.dim.isqrt();
    if side * side != train.dim {
        return Err(invalid(format!(
            "images must be square: {} features per sample",
            train.dim
        )));
    }
    let epochs = args
        .epochs
        .unwrap_or(if train.len() <= 10_000 { 10 } else { 3 });
    // Defaults by image size: 28x28 (Fashion-MNIST) gets a strided stem, a wider network, a
    // higher rate and cosine decay; the 8x8 digits keep every pixel, width 16 and a constant
    // rate.
    let large = side >= 16;
    let width = args.width.unwrap_or(if large { 24 } else { 16 });
    let lr_arg = args.lr.unwrap_or(if large { 4e-3 } else { 2e-3 });
    let batch_size = args.batch_size.unwrap_or(if large { 128 } else { 64 });
    let stem_stride = args
        .stem_stride
        .map_or(1 + usize::from(large), |s| s as usize);
    let cosine = match args.schedule.as_deref() {
        Some(s) => s == "cosine",
        None => args.cosine || large,
    };
    let aug = Augment {
        pad: if args.augment { 2 } else { args.crop_pad },
        flip: args.flip || args.augment,
    };
    let images = Augmented::new(&train, side, aug, args.seed)?;
    let mut options = DeviceOptions::default();
    options.adapter = args.adapter.clone();
    options.memory_budget = budget;
    let device = Device::with_options(options)?;
    say!("adapter: {}", device.info().adapter);
    say!(
        "dataset: {} ({} train, {} test, {side}x{side}, {} classes)",
        train.name,
        train.len(),
        test.len(),
        train.classes
    );
    let shape = model::Shape {
        width,
        stem_stride,
        blocks: args.blocks,
        group_norm: group,
        seed: args.seed,
    };
    let model = ResNet::new(&device, side, train.classes, shape)?;
    if args.checkpoint_activations {
        model.checkpoint.store(true, Ordering::Relaxed);
    }
    let lr = lr_arg as f32;
    let optimizer: Box<dyn Optimizer> = if args.optimizer == "sgd" {
        Box::new(Sgd::new(model.parameters(), lr)?.momentum(0.9)?)
    } else {
        Box::new(AdamW::new(model.parameters(), lr)?)
    };
    let total_steps = train.len().div_ceil(batch_size * args.accum_steps) as u64 * epochs;
    let schedule = if cosine {
        LrSchedule::WarmupCosine {
            warmup_steps: total_steps / 20,
            total_steps,
            min_lr_ratio: 0.0,
        }
    } else {
        LrSchedule::Constant
    };
    // Group norm mixes no samples: with batch-invariant sums a budget's micro-batches then give
    // the whole batch's bits (f32; mixed precision rounds each micro-batch's gradients to f16).
    let invariant = group && precision == Precision::F32 && !args.fast_sums;
    let config = TrainerConfig::new(batch_size, args.accum_steps, lr)
        .schedule(schedule)
        .precision(precision)
        .batch_invariant(invariant);
    let mut trainer = Trainer::new(model, optimizer, config)?;
    say!(
        "model: ResNet, stem stride {stem_stride}, {} stages of width {}, {}, {} ({} blocks, {} norm, {} parameters), {} lr {}, {}, batch {} x {}",
        3,
        width,
        2 * width,
        4 * width,
        trainer.model.blocks.len(),
        args.norm,
        trainer.model.num_parameters(),
        args.optimizer,
        lr_arg,
        args.precision,
        batch_size,
        args.accum_steps
    );
    if invariant {
        say!("group norm: batch-invariant sums (any micro-batch size gives the same weights)");
    }
    if aug.is_on() {
        say!(
            "augmentation: random crops (padding {}), {} (seeded per sample and epoch)",
            aug.pad,
            if aug.flip {
                "horizontal flips"
            } else {
                "no flips"
            }
        );
    }
    if cosine {
        say!(
            "learning rate: cosine to 0 over {total_steps} steps, warm-up {}",
            total_steps / 20
        );
    }
    if let Some(b) = budget {
        if fit_auto {
            let choice = trainer.fit_auto(&images, b)?;
            say!("fit auto: {choice}");
        } else {
            trainer.fit_to_budget(&images, b)?;
        }
    }
    let all_reduce = dist.join(&mut trainer, &images)?;
    if let Some(b) = budget {
        let micro = trainer.micro_batch();
        say!(
            "memory budget {}: micro-batch {micro} of {}",
            Bytes(b),
            batch_size
        );
        if !group && micro < batch_size {
            say!(
                "warning: batch norm's statistics are those of each micro-batch of {micro}, not of \
                 the batch of {} (as in PyTorch with accumulation); --norm group does not \
                 mix samples (its steps are the whole batch's, bit for bit)",
                batch_size
            );
        }
    }
    let plan = trainer.plan(&images)?;
    if args.plan {
        if root {
            print!("{plan}");
        }
        return Ok(Outcome {
            planned_peak: plan.peak,
            micro_batch: trainer.micro_batch(),
            ..Outcome::default()
        });
    }
    if args.prealloc {
        let reserved = trainer.prealloc(&images)?;
        say!("reserved {} up front", Bytes(reserved));
    }
    let mut report = TrainingReport::new(
        format!("train_cnn (ResNet, {} norm) on {}", args.norm, train.name),
        &device,
        "samples/s",
    );
    report.set_plan(plan.clone());
    let mut first_epoch = 0;
    if let Some(path) = &args.resume {
        first_epoch = trainer.resume_from(path)?;
        say!("resumed from {} after {first_epoch} epochs", path.display());
    }
    let eff = trainer.effective_batch();
    let steps_per_epoch = train.len().div_ceil(eff);
    let started = Instant::now();
    let mut final_loss = f32::NAN;
    let mut capture = StepCapture::new();
    let mut oom_retries = 0;
    for epoch in first_epoch..epochs {
        let epoch_start = Instant::now();
        trainer.train_epoch(&images, args.seed, epoch, |t, done, total| {
            if args.report.is_some() {
                capture.after_step(t, &images)?;
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
            say!("  {e}");
        }
        report.log_epoch(
            epoch,
            trainer.steps(),
            final_loss,
            train.len() as f64 / secs,
            secs,
        );
        if let (Some(path), true) = (&args.save, root) {
            trainer.save_checkpoint(path, epoch + 1)?;
        }
    }
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
    let eval = trainer.evaluate(&test, trainer.micro_batch())?;
    let accuracy = eval.accuracy.unwrap_or(f32::NAN);
    outcome.test_accuracy = accuracy;
    println!(
        "test: loss {:.4}, accuracy {:.2}% ({train_secs:.1} s training)",
        eval.loss,
        100.0 * accuracy
    );
    println!("\n{summary}");
    println!(
        "peak in use: planned {} / measured {} ({:+.2}%), peak reached at {}",
        Bytes(plan.peak),
        Bytes(measured),
        100.0 * (plan.peak as f64 / measured.max(1) as f64 - 1.0),
        plan.peak_op.as_deref().unwrap_or("?")
    );
    if let Some(path) = &args.report {
        report.set_step_memory(capture.finish());
        report.set_memory(summary.stats.clone());
        report
            .result("test accuracy", format!("{:.2}%", 100.0 * accuracy))
            .result("training time", format!("{train_secs:.1} s"));
        report.write_html(path)?;
        println!("report: {}", path.display());
    }
    if args.json {
        let mut j = serde_json::json!({
            "dataset": train.name,
            "norm": args.norm,
            "batch_invariant": trainer.config().batch_invariant,
            "width": width,
            "stem_stride": stem_stride,
            "parameters": trainer.model.num_parameters(),
            "epochs": epochs,
            "batch_size": batch_size,
            "micro_batch": trainer.micro_batch(),
            "precision": args.precision,
            "checkpoint_activations": args.checkpoint_activations,
            "crop_pad": aug.pad,
            "flip": aug.flip,
            "cosine": cosine,
            "memory_budget": budget,
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

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if e.use_stderr() => {
            eprint!("{e}");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    Job::main(args.distributed.clone().as_deref(), |dist| {
        run(args, dist).map(drop)
    })
}
