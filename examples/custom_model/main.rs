//! `cargo run --release --example custom_model` — a model the crate does not know, defined
//! in model.rs, trained by the generic `Trainer` with every memory feature.
//!
//! The model is a residual MLP: a stem Linear (in -> width), `--blocks` residual blocks
//! `x + fc2(dropout(gelu(fc1(layer_norm(x)))))`, a final LayerNorm and a Linear head to the
//! classes. Writing it takes three pieces: the structs, `fitgrad::module!` (which writes the
//! parameter list and the train / eval switch from the fields), and `TrainModel<ClassBatch>`
//! (the loss of a batch, in the step's dtype so `--precision mixed` works). Everything else —
//! micro-batches under `--memory-budget`, accumulation, loss scaling, the planner,
//! preallocation, checkpoints — comes from the trainer.
//!
//! Data: `--dataset auto` (the default) is Fashion-MNIST on a GPU when
//! `/usr/share/datasets/fashion-mnist` holds it (`apt-get install dataset-fashion-mnist`), and
//! the handwritten digits embedded in the crate otherwise — on a CPU adapter such as lavapipe
//! too, where an epoch of Fashion-MNIST's 60,000 images takes about a minute while 8 epochs of
//! digits take seconds. `--dataset fashion-mnist` (or `digits`, `mnist`, a path) chooses
//! explicitly. The default epochs are 8 on the digits and 2 on larger datasets.
//!
//! It prints the adapter, the dataset, the parameter count, a progress bar per epoch, the test
//! accuracy, where the memory went, and the planned peak of a step beside the measured one.
//! `--plan` prints the plan and exits; `--json` ends stdout with one JSON object; `--report
//! report.html` / `--report-json report.json` write the run's report (the memory timeline of a
//! step beside the planner's, loss, accuracy, throughput, the memory table).
//!
//! A budget can only cut what grows with the micro-batch (activations): at the default batch of
//! 64 the parameters, their gradients and AdamW's two moments are most of the peak. With
//! `--batch-size 1024` activations dominate, and `--memory-budget` at half the printed peak
//! trains the same model in smaller accumulated micro-batches.
//!
//! `--distributed mpi` runs it as one rank of an MPI job (`mpirun -np 2 ...`, built with
//! `--features mpi`): each rank trains its share of every batch; rank 0 prints, evaluates and
//! saves.

use clap::Parser;
use fitgrad::checkpoint::Expect;
use fitgrad::cli::{self, MAX_BATCH, MAX_EPOCHS, MAX_LAYERS, MAX_WIDTH};
use fitgrad::compress::{PruneConfig, PruneSchedule, Pruner};
use fitgrad::distributed::{Job, Zero};
use fitgrad::nn::Module;
use fitgrad::optim::quant8::f32_adamw_state_bytes;
use fitgrad::optim::{AdamW, Optimizer};
use fitgrad::report::{StepCapture, TrainingReport};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::{Phase, Precision};
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{Bytes, Device, DeviceOptions, Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// Where `apt-get install dataset-fashion-mnist` puts the IDX files.
const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

#[derive(Parser, Debug)]
#[command(about = "Train a residual MLP defined in this example with fitgrad's Trainer")]
pub struct Args {
    /// auto (Fashion-MNIST when installed and the adapter is a GPU, else digits), digits
    /// (embedded), fashion-mnist, mnist, or a path (a CSV file with a label column, or a folder
    /// of IDX files).
    #[arg(long, default_value = "auto")]
    dataset: String,
    /// The label column of a CSV --dataset, by its header name (default: the column named
    /// "label", else the last one).
    #[arg(long)]
    label_column: Option<String>,
    /// Features of the residual stream.
    #[arg(long, default_value_t = 128)]
    width: usize,
    /// Residual blocks.
    #[arg(long, default_value_t = 2)]
    blocks: usize,
    /// Dropout probability inside each block, in [0, 1).
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    dropout: f64,
    /// Epochs (default: 8 on digits, 2 on larger datasets).
    #[arg(long)]
    epochs: Option<u64>,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Batches whose gradients add up before each optimizer step.
    #[arg(long, default_value_t = 1)]
    accum_steps: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true)]
    lr: f64,
    /// adamw, or adamw8bit (both moments in 8 bits for tensors of 4096 elements or more).
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "adamw8bit"])]
    optimizer: String,
    /// none; optimizer: f32 master weights and AdamW's state in host memory (the device
    /// keeps parameters and gradients; each step reads the gradients back and uploads the
    /// parameters); parameters: that, and each block's parameters in host memory too (each
    /// block is an nn::Unit), on the device only around the block's forward and backward.
    #[arg(long, default_value = "none", value_parser = ["none", "optimizer", "parameters"])]
    offload: String,
    /// Seeds the weights, dropout masks, data split and order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hard limit on device memory (e.g. 4MiB): the micro-batch is chosen to fit, with
    /// gradient accumulation keeping the effective batch.
    #[arg(long)]
    memory_budget: Option<String>,
    /// Print the planned peak memory of a training step, by category, and exit.
    #[arg(long)]
    plan: bool,
    /// Reserve the planned peak before training, so no buffer is created afterwards.
    #[arg(long)]
    prealloc: bool,
    /// f32, or mixed (f32 master weights and optimizer state, f16 activations and matmuls,
    /// dynamic loss scaling).
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Save a checkpoint (safetensors, written atomically) after every epoch.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Save a sharded checkpoint into this folder after every epoch: each rank writes its
    /// shard of the parameters and optimizer state, rank 0 an index (index.json).
    #[arg(long)]
    save_sharded: Option<PathBuf>,
    /// Resume from a checkpoint written by --save (same model and batch flags), or from the
    /// folder of --save-sharded, on any number of ranks.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Substring of the adapter name to use.
    #[arg(long)]
    adapter: Option<String>,
    /// End stdout with one JSON object describing the run.
    #[arg(long)]
    json: bool,
    /// Write an HTML report (memory timeline of a step, loss / accuracy / throughput, memory
    /// table) to this file; the test set is then evaluated after every epoch.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write the report's data as JSON to this file.
    #[arg(long)]
    report_json: Option<PathBuf>,
    /// Prune the Linear weights by magnitude to this sparsity in [0, 1) during training
    /// (cubic schedule from 5% to 60% of the steps), and report the sparsity of each layer.
    #[arg(long)]
    prune: Option<f32>,
    /// `mpi`: this process is one rank of data-parallel training started by mpirun (built with
    /// `--features mpi`). The batch flags give the whole job's batch, split across the ranks;
    /// rank 0 prints, evaluates and saves. At --dropout 0 the weights are those of one process
    /// with the same flags; with dropout each rank draws its own masks, as micro-batches do.
    #[arg(long)]
    distributed: Option<String>,
    /// ZeRO stage under --distributed mpi: 0 replicates everything (plain data parallelism),
    /// 1 keeps each rank's shard of the optimizer state only, 2 also its shard of the summed
    /// gradients, 3 also its shard of each block's parameters (gathered around its forward and
    /// backward); the weights are those of stage 0. One process holds every shard, so the stage
    /// changes nothing there.
    #[arg(long)]
    zero: Option<String>,
}

mod model;
use model::ResMlp;

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

fn invalid(reason: String) -> Error {
    Error::InvalidArgument {
        op: "custom_model",
        reason,
    }
}

/// This rank's training forwards (= dropout calls per layer) in `epochs` epochs of `n`
/// samples, with `eff` samples per step, its share of them split into micro-batches of `micro`.
fn forwards_in(epochs: u64, n: usize, eff: usize, micro: usize, dist: &Job) -> u64 {
    let per_epoch: usize = (0..n)
        .step_by(eff)
        .map(|start| dist.share((n - start).min(eff)).len().div_ceil(micro))
        .sum();
    epochs * per_epoch as u64
}

pub fn run(args: Args, dist: &Job) -> Result<()> {
    // Rank 0 reports; the other ranks train quietly.
    let root = dist.is_root();
    macro_rules! say {
        ($($t:tt)*) => { if root { println!($($t)*); } };
    }
    let precision: Precision = args.precision.parse()?;
    let zero = Zero::from_flag(args.zero.as_deref())?;
    if zero.number() == 3 && args.blocks == 0 {
        return Err(invalid(format!(
            "--zero 3 shards the blocks (each an nn::Unit), and --blocks 0 has none: {}",
            fitgrad::residency::HOW_TO_MARK_UNITS
        )));
    }
    // custom_model has no --fit auto.
    dist.check_zero(zero, &[("--prune", args.prune.is_some())])?;
    if precision == Precision::F16 {
        return Err(invalid(
            "this example keeps f32 master weights: --precision f32 or mixed".into(),
        ));
    }
    let n = |v: usize| v as u64;
    cli::check_counts(
        "custom_model",
        &[
            ("--width", n(args.width), 1, MAX_WIDTH),
            ("--blocks", n(args.blocks), 0, MAX_LAYERS),
            ("--epochs", args.epochs.unwrap_or(1), 1, MAX_EPOCHS),
            ("--batch-size", n(args.batch_size), 1, MAX_BATCH),
            ("--accum-steps", n(args.accum_steps), 1, MAX_BATCH),
        ],
    )?;
    cli::check_environment()?;
    let offload = cli::check_offload(
        "custom_model",
        &args.offload,
        args.blocks > 0,
        &[
            ("--optimizer adamw8bit", args.optimizer == "adamw8bit"),
            ("--prune", args.prune.is_some()),
            ("--distributed", args.distributed.is_some()),
        ],
    )?;
    if !(0.0..1.0).contains(&args.dropout) {
        return Err(invalid(format!(
            "--dropout must be in [0, 1), got {}",
            args.dropout
        )));
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(invalid(format!(
            "--lr must be a positive number, got {}",
            args.lr
        )));
    }
    let budget = args
        .memory_budget
        .as_deref()
        .map(|b| b.parse::<Bytes>().map(|b| b.0))
        .transpose()?;
    // No output may overwrite the dataset's files, the checkpoint resumed from, or another
    // output (--save may replace --resume: a run continued in place). "auto" reads one of two
    // datasets: both are inputs.
    let data_files: Vec<std::path::PathBuf> = match args.dataset.as_str() {
        "auto" => ["digits", "fashion-mnist"]
            .iter()
            .flat_map(|d| data::input_files(d))
            .collect(),
        spec => data::input_files(spec),
    };
    let mut inputs: Vec<(&'static str, &Path)> = data_files
        .iter()
        .map(|p| ("--dataset", p.as_path()))
        .collect();
    inputs.extend(args.resume.as_deref().map(|p| ("--resume", p)));
    let outputs: Vec<(&'static str, &Path)> = [
        ("--save", &args.save),
        ("--report", &args.report),
        ("--report-json", &args.report_json),
    ]
    .into_iter()
    .filter_map(|(f, p)| Some((f, p.as_deref()?)))
    .collect();
    cli::check_paths(&inputs, &outputs, &[("--save", "--resume")])?;
    if let Some(dir) = &args.save_sharded {
        fitgrad::distributed::zero::checkpoint::check_folder("--save-sharded", dir)?;
    }
    let reporting = args.report.is_some() || args.report_json.is_some();
    let prune = args.prune.map(PruneConfig::new);
    if let Some(cfg) = &prune {
        cfg.validate()?;
    }
    let mut options = DeviceOptions::default();
    options.adapter = args.adapter.clone();
    options.memory_budget = budget;
    let device = Device::with_options(options)?;
    let info = device.info();
    say!("adapter: {}", info.adapter);
    let spec = match args.dataset.as_str() {
        "auto" if !Path::new(FASHION_MNIST_DIR).is_dir() => "digits",
        "auto" if info.adapter.is_cpu() => {
            say!("(a CPU adapter: training on the digits; --dataset fashion-mnist for more)");
            "digits"
        }
        "auto" => "fashion-mnist",
        s => s,
    };

    let (train, test): (Dataset, Dataset) =
        data::load_with_label(spec, args.seed, args.label_column.as_deref())?;
    say!(
        "dataset: {} ({} train, {} test, {} features, {} classes)",
        train.name,
        train.len(),
        test.len(),
        train.dim,
        train.classes
    );
    let epochs = args
        .epochs
        .unwrap_or(if train.len() <= 10_000 { 8 } else { 2 });
    let identity = vec![("dataset".to_string(), format!("{:016x}", train.hash()))];
    // The checkpoint is checked on the host before the model is built, naming the flags.
    let nothing_to_train = match &args.resume {
        Some(path) => {
            let ckpt = fitgrad::distributed::load_checkpoint(path)?;
            let as_saved = |flag: &str| format!("set {flag} as it was saved");
            let data = "resume on the --dataset it was trained on";
            ckpt.expect_config(
                &[
                    Expect::new(
                        "kind",
                        "res-mlp",
                        "resume a checkpoint written by custom_model",
                    ),
                    Expect::new("inputs", train.dim, data),
                    Expect::new("classes", train.classes, data),
                    Expect::new("width", args.width, as_saved("--width")),
                    Expect::new("blocks", args.blocks, as_saved("--blocks")),
                    Expect::new("dropout", args.dropout as f32, as_saved("--dropout")),
                ],
                "custom_model",
            )?;
            ckpt.check_extra(&[Expect::new(
                "data.dataset",
                &identity[0].1,
                "another dataset: resume with the --dataset (and --seed) it was trained on, or \
                 start a new run without --resume",
            )])?;
            ckpt.check_finite()?;
            let done = ckpt.training_state()?.epoch;
            cli::check_resume_progress(path, done, epochs, "--epochs")?
        }
        None => false,
    };

    let lr = args.lr as f32;
    let config = TrainerConfig::new(args.batch_size, args.accum_steps, lr)
        .precision(precision)
        .offload_optimizer(offload.0)
        .offload_parameters(offload.1);
    // The model is built inside the budget logic: a budget too small for the model itself
    // gets the smallest budget that works, as one too small for a step does.
    let build = || {
        let make = || {
            ResMlp::new(
                &device,
                train.dim,
                args.width,
                args.blocks,
                train.classes,
                args.dropout as f32,
                args.seed,
            )
        };
        // Streamed, or ZeRO stage 3 on several ranks (each keeps its shard): each block goes
        // to host memory as it is made, never all on the device. 8-bit state does not shard.
        let stage3 = zero.number() == 3 && dist.size() > 1 && args.optimizer == "adamw";
        let model = match offload.1 || stage3 {
            true => fitgrad::residency::born_on_host(&device, make)?,
            false => make()?,
        };
        let adamw = AdamW::new(model.parameters(), lr)?;
        let optimizer: Box<dyn Optimizer> = if args.optimizer == "adamw8bit" {
            Box::new(adamw.eight_bit())
        } else {
            Box::new(adamw)
        };
        Trainer::new(model, optimizer, config.clone())
    };
    let mut trainer = Trainer::build_within_budget(&device, &train, build)?;
    trainer.set_data_identity(identity);
    let mut report = TrainingReport::new(
        format!("custom_model (residual MLP) on {}", train.name),
        &device,
        "samples/s",
    );
    say!(
        "model: residual MLP {} -> {} x {} blocks (dropout {}) -> {} ({} parameters), AdamW lr {}, {}, batch {} x {} accumulation steps",
        train.dim,
        args.width,
        args.blocks,
        args.dropout,
        train.classes,
        trainer.model.num_parameters(),
        args.lr,
        args.precision,
        args.batch_size,
        args.accum_steps
    );
    let eff = trainer.effective_batch();
    let steps_per_epoch = train.len().div_ceil(eff) as u64;
    // The default filter prunes every 2-D weight: the stem, the blocks' fc1 and fc2, the head.
    // Made before the budget and the plan, so both count its masks.
    let mut pruner = prune
        .map(|mut cfg| {
            cfg.schedule = PruneSchedule::gradual(steps_per_epoch * epochs);
            Pruner::new(&trainer.model, cfg)
        })
        .transpose()?;
    // The masks count: under a budget the micro-batch is chosen again with them in use.
    if let (Some(b), Some(_)) = (budget, &pruner) {
        trainer.fit_to_budget(&train, b)?;
    }
    // Fitted to the whole batch as on one process; a rank refits to its share.
    let all_reduce = dist.join_zero(&mut trainer, &train, zero)?;
    // Every rank's device peak so far: what making the model and joining the job held.
    let start_memory = dist.start_memory(&device, &trainer.model)?;
    if let Some(b) = budget {
        let micro = trainer.micro_batch();
        say!(
            "memory budget {}: micro-batch {micro} of {} ({} micro-batches per step)",
            Bytes(b),
            args.batch_size,
            args.batch_size.div_ceil(micro) * args.accum_steps
        );
        report.set_budget(b, args.batch_size, micro, None);
    }
    // The whole run, planned by running it on the device's planning mode: the steady-state
    // step, then the test set at the training micro-batch under a budget (a batch that does
    // not fit is split) or in large batches; rank 0 alone evaluates.
    let planning = Instant::now();
    let budgeted = budget.is_some();
    let eval_batch = move |t: &Trainer<ResMlp>| if budgeted { t.micro_batch() } else { 1024 };
    let mut phases: Vec<Phase<'_, ResMlp>> = Vec::new();
    if root && reporting {
        phases.push((
            "evaluation after each epoch",
            Box::new(|t| t.evaluate(&test, t.micro_batch()).map(drop)),
        ));
    }
    if root {
        phases.push((
            "evaluation",
            Box::new(|t| t.evaluate(&test, eval_batch(t)).map(drop)),
        ));
    }
    let run_plan = trainer.plan_whole_run(&train, &mut phases)?;
    drop(phases);
    let plan = run_plan.step.clone();
    if args.plan {
        dist.print_plan(&trainer, &run_plan, zero, args.json, planning.elapsed())?;
        return Ok(());
    }
    if args.prealloc {
        let reserved = trainer.prealloc(&train)?;
        say!("reserved {} up front", Bytes(reserved));
    }
    report.set_plan(plan.clone());
    for (key, value) in [
        (
            "dataset",
            format!(
                "{} ({} train, {} test)",
                train.name,
                train.len(),
                test.len()
            ),
        ),
        (
            "model",
            format!(
                "residual MLP {} -> {} x {} blocks (dropout {}) -> {} ({} parameters)",
                train.dim,
                args.width,
                args.blocks,
                args.dropout,
                train.classes,
                trainer.model.num_parameters()
            ),
        ),
        ("optimizer", format!("{} lr {}", args.optimizer, args.lr)),
        ("epochs", epochs.to_string()),
        (
            "batch",
            format!(
                "{} x {} accumulation steps, micro-batch {}",
                args.batch_size,
                args.accum_steps,
                trainer.micro_batch()
            ),
        ),
        ("precision", args.precision.clone()),
        (
            "memory budget",
            budget.map_or("none".into(), |b| Bytes(b).to_string()),
        ),
        ("preallocation", args.prealloc.to_string()),
        ("seed", args.seed.to_string()),
    ] {
        report.setting(key, value);
    }

    let mut first_epoch = 0;
    if let Some(path) = &args.resume {
        first_epoch = dist.resume_from(&mut trainer, path)?;
        if let Some(p) = &mut pruner {
            // The masks are not in the checkpoint; the pruned weights are its zeros.
            p.mask_zeros()?;
        }
        let forwards = forwards_in(first_epoch, train.len(), eff, trainer.micro_batch(), dist);
        trainer.model.skip_dropout_masks(forwards);
        say!(
            "resumed from {} after {first_epoch} epochs ({} steps)",
            path.display(),
            trainer.steps()
        );
        if nothing_to_train {
            say!(
                "nothing left to train: the checkpoint holds {first_epoch} epochs and --epochs is {epochs}; evaluating it as it is"
            );
        }
    }
    let style = ProgressStyle::with_template(
        "epoch {prefix:>3} [{bar:30}] {pos}/{len} steps {msg} ({elapsed})",
    )
    .expect("valid template")
    .progress_chars("=> ");
    let started = Instant::now();
    let mut final_loss = f32::NAN;
    // With a report: the memory of the second step, and the test set after every epoch (at
    // the micro-batch, which needs less memory than a training step).
    let mut capture = StepCapture::new();
    let mut eval_secs = 0.0;
    for epoch in first_epoch..epochs {
        let bar = if root {
            ProgressBar::new(steps_per_epoch)
        } else {
            ProgressBar::hidden()
        }
        .with_style(style.clone())
        .with_prefix(format!("{}", epoch + 1));
        let epoch_start = Instant::now();
        trainer.train_epoch(&train, args.seed, epoch, |t, done, total| {
            if let Some(p) = &mut pruner {
                p.step(t.steps())?;
            }
            bar.set_position(done as u64);
            if reporting {
                capture.after_step(t, &train)?;
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
        })?;
        bar.finish();
        let epoch_secs = epoch_start.elapsed().as_secs_f64();
        let events = trainer.take_events();
        for e in &events {
            say!("  {e}");
        }
        report.add_events(&events);
        report.log_epoch(
            epoch,
            trainer.steps(),
            final_loss,
            train.len() as f64 / epoch_secs,
            epoch_secs,
        );
        // ZeRO stage 3: the blocks gathered on every rank, so one rank evaluates alone.
        trainer.gather_parameters()?;
        if reporting {
            let eval_start = Instant::now();
            let e = trainer
                .evaluate(&test, trainer.micro_batch())?
                .finite(trainer.steps(), "test")?;
            report.log_eval(trainer.steps(), Some(epoch), "test", &e);
            eval_secs += eval_start.elapsed().as_secs_f64();
        }
        // Every rank joins (a ZeRO rank holds a shard of the optimizer state); rank 0 writes.
        if let Some(path) = &args.save {
            dist.save_checkpoint(&trainer, path, epoch + 1)?;
        }
        if let Some(dir) = &args.save_sharded {
            dist.save_sharded(&trainer, dir, epoch + 1, zero)?;
        }
    }
    device.sync()?;
    // Each rank's weights, hashed: the report shows whether the replicas hold the same bits.
    let rank_hashes = match dist.size() > 1 {
        true => Some(dist.weight_hashes(&trainer.model)?),
        false => None,
    };
    if !root {
        return Ok(());
    }
    let train_secs = started.elapsed().as_secs_f64() - eval_secs;
    let epochs_run = epochs.saturating_sub(first_epoch);
    let samples_per_s = (train.len() as u64 * epochs_run) as f64 / train_secs.max(1e-9);
    // Training's memory, before evaluation's batches count.
    let summary = trainer.memory_summary();
    let measured = summary.stats.peak_bytes_in_use;
    let eval = trainer
        .evaluate(&test, eval_batch(&trainer))?
        .finite(trainer.steps(), "test")?;
    let accuracy = eval.accuracy.unwrap_or(f32::NAN);
    println!(
        "test: loss {:.4}, accuracy {:.2}% ({:.1} s training, {samples_per_s:.0} samples/s)",
        eval.loss,
        100.0 * accuracy,
        train_secs
    );
    let sparsity = match &pruner {
        Some(p) => {
            let report = p.report()?;
            println!(
                "\npruned to {:.2}% sparsity:\n{report}",
                100.0 * report.sparsity()
            );
            Some(report.sparsity())
        }
        None => None,
    };
    println!("\n{summary}");
    println!(
        "peak in use: planned {} / measured {} ({:+.2}%), peak reached at {}",
        Bytes(plan.peak),
        Bytes(measured),
        100.0 * (plan.peak as f64 / measured.max(1) as f64 - 1.0),
        plan.peak_op.as_deref().unwrap_or("?")
    );
    println!(
        "peak reserved: planned {} / measured {}",
        Bytes(plan.peak_reserved),
        Bytes(summary.stats.peak_bytes_reserved)
    );
    // The whole run's peak, evaluation included, beside its plan.
    let run = device.memory_stats();
    println!(
        "whole run: peak reserved planned {} / measured {}",
        Bytes(run_plan.peak_reserved),
        Bytes(run.peak_bytes_reserved)
    );
    println!("{}", device.memory_report());
    report.set_step_memory(capture.finish());
    report.set_memory(summary.stats.clone());
    report
        .result("test loss", format!("{:.4}", eval.loss))
        .result("test accuracy", format!("{:.2}%", 100.0 * accuracy))
        .result("training time", format!("{train_secs:.1} s"))
        .result("throughput", format!("{samples_per_s:.0} samples/s"))
        .result("steps", trainer.steps());
    if let Some(path) = &args.report {
        report.write_html(path)?;
        println!("report: {}", path.display());
    }
    if let Some(path) = &args.report_json {
        report.write_json(path)?;
        println!("report data: {}", path.display());
    }

    if args.json {
        let s = &summary.stats;
        let mut j = serde_json::json!({
            "adapter": info.adapter.name,
            "backend": info.adapter.backend,
            "dataset": train.name,
            "width": args.width,
            "blocks": args.blocks,
            "dropout": args.dropout,
            "parameters": trainer.model.num_parameters(),
            "epochs": epochs,
            "batch_size": args.batch_size,
            "accum_steps": args.accum_steps,
            "micro_batch": trainer.micro_batch(),
            "lr": args.lr,
            "optimizer": args.optimizer,
            "optimizer_state_bytes": summary.optimizer_state_bytes,
            "offload": args.offload,
            "host_bytes": summary.host_bytes,
            "optimizer_state_bytes_f32": f32_adamw_state_bytes(&trainer.model.parameters()),
            "precision": args.precision,
            "seed": args.seed,
            "memory_budget": budget,
            "planned_peak_bytes": plan.peak,
            "planned_host_bytes": plan.host_bytes,
            "planned_bytes_moved": plan.bytes_moved,
            "planned_peak_reserved": plan.peak_reserved,
            "planned_run_peak_reserved": run_plan.peak_reserved,
            "peak_bytes_in_use": run.peak_bytes_in_use,
            "peak_bytes": run.peak_bytes_reserved,
            "step_peak_bytes": s.peak_bytes_reserved,
            "buffers_created": run.buffers_created,
            "skipped_steps": trainer.scaler().map_or(0, |s| s.skipped_steps()),
            "steps": trainer.steps(),
            "final_loss": final_loss,
            "test_loss": eval.loss,
            "test_accuracy": accuracy,
            "sparsity": sparsity,
            "train_seconds": train_secs,
            "samples_per_s": samples_per_s,
        });
        dist.add_to_json(&mut j, all_reduce.as_ref());
        dist.add_traffic_to_json(&mut j, &trainer, zero)?;
        j["zero_stage"] = zero.number().into();
        j["start"] = start_memory;
        j["rank_weight_hashes"] = rank_hashes.into();
        println!("{j}");
    }
    Ok(())
}

fn main() -> ExitCode {
    // Flag errors exit with 1 and clap's message; --help prints and exits with 0.
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
        run(args, dist).map_err(|e| {
            cli::name_flags(
                "custom_model",
                e,
                "lower --batch-size or --width, or give --memory-budget, which trains in \
                 smaller micro-batches",
            )
        })
    })
}
