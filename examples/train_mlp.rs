//! `cargo run --release --example train_mlp` — train an MLP classifier on the GPU.
//!
//! With no arguments it trains on the handwritten digits embedded in the crate (8x8 images,
//! 1,797 samples) and prints the adapter, a progress bar per epoch, the test accuracy and where
//! the device memory went. `--help` lists the flags; `--json` ends stdout with one JSON object;
//! `--report report.html` (and `--report-json report.json`) writes a page with the memory
//! timeline of a step, the loss, accuracy and throughput curves and the memory table.

use clap::Parser;
use fitgrad::checkpoint::Expect;
use fitgrad::cli::{self, MAX_BATCH, MAX_EPOCHS};
use fitgrad::compress::{PruneConfig, PruneSchedule, Pruner, QuantizedMlp};
use fitgrad::distributed::{Job, Zero};
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::optim::quant8::f32_adamw_state_bytes;
use fitgrad::optim::{AdamW, LrSchedule, Optimizer, Sgd};
use fitgrad::report::{StepCapture, TrainingReport};
use fitgrad::train::data;
use fitgrad::train::shard::TempShardFile;
use fitgrad::train::{Phase, Precision, ShardedView, Trainer, TrainerConfig};
use fitgrad::{Bytes, DType, Device, DeviceOptions};
use indicatif::{ProgressBar, ProgressStyle};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Train an MLP classifier with fitgrad")]
pub struct Args {
    /// digits (embedded), fashion-mnist, mnist, or a path (a CSV file with a label column, or a
    /// folder of IDX files).
    #[arg(long, default_value = "digits")]
    dataset: String,
    /// The label column of a CSV --dataset, by its header name (default: the column named
    /// "label", else the last one).
    #[arg(long)]
    label_column: Option<String>,
    /// Hidden layer widths, comma separated.
    #[arg(long, default_value = "256,256", value_delimiter = ',')]
    hidden: Vec<usize>,
    #[arg(long, default_value_t = 20)]
    epochs: u64,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Batches whose gradients add up before each optimizer step.
    #[arg(long, default_value_t = 1)]
    accum_steps: usize,
    /// Learning rate (default: 1e-3 for adamw, 0.05 for sgd).
    #[arg(long)]
    lr: Option<f32>,
    /// adamw, adamw8bit (both moments in 8 bits) or sgd (sgd uses momentum 0.9).
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// none, or optimizer: f32 master weights and AdamW's state in host memory (the device
    /// keeps parameters and gradients; each step reads the gradients back and uploads the
    /// parameters). `parameters` is refused: the MLP names no units (custom_model and
    /// train_gpt stream theirs).
    #[arg(long, default_value = "none", value_parser = ["none", "optimizer", "parameters"])]
    offload: String,
    /// relu, gelu, tanh or sigmoid.
    #[arg(long, default_value = "relu")]
    activation: String,
    /// Cosine decay with 5% linear warm-up instead of a constant learning rate.
    #[arg(long)]
    cosine: bool,
    /// Clip the gradients' total L2 norm to this before each update.
    #[arg(long)]
    clip_grad_norm: Option<f32>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Substring of the adapter name to use (see --list-adapters).
    #[arg(long)]
    adapter: Option<String>,
    /// Print the adapters wgpu finds and exit.
    #[arg(long)]
    list_adapters: bool,
    /// End stdout with one JSON object describing the run.
    #[arg(long)]
    json: bool,
    /// f32, f16, or mixed (f32 master weights and optimizer state, f16 activations and
    /// matmuls, dynamic loss scaling).
    #[arg(long, default_value = "f32")]
    precision: String,
    /// Hard limit on device memory (e.g. 48MiB). The micro-batch is chosen to fit, with
    /// gradient accumulation keeping the effective batch.
    #[arg(long)]
    memory_budget: Option<String>,
    /// `auto`: let --memory-budget choose the micro-batch, activation checkpointing and mixed
    /// precision (cheapest first), and print each planned candidate.
    #[arg(long)]
    fit: Option<String>,
    /// Print the planned peak memory of a training step, by category, and exit.
    #[arg(long)]
    plan: bool,
    /// Reserve the planned peak before training, so no buffer is created afterwards.
    #[arg(long)]
    prealloc: bool,
    /// Recompute gelu layers in backward instead of keeping their pre-activations.
    #[arg(long)]
    checkpoint_activations: bool,
    /// Stream the training set through the device in shards of this many samples, read from a
    /// file on disk (written once to the temp folder), so a dataset larger than the memory
    /// budget trains.
    #[arg(long)]
    shard_size: Option<usize>,
    /// Save a checkpoint (safetensors, written atomically) after every epoch.
    #[arg(long)]
    save: Option<std::path::PathBuf>,
    /// Save a sharded checkpoint into this folder after every epoch: each rank writes its
    /// shard of the parameters and optimizer state, rank 0 an index (index.json), so any
    /// number of ranks, or one process, resumes from it (--resume DIR).
    #[arg(long)]
    save_sharded: Option<std::path::PathBuf>,
    /// Resume from a checkpoint written by --save (same model flags), or from the folder of
    /// --save-sharded, on any number of ranks.
    #[arg(long)]
    resume: Option<std::path::PathBuf>,
    /// Write an HTML report (memory timeline of a step, loss / accuracy / throughput, memory
    /// table) to this file; the test set is then evaluated after every epoch.
    #[arg(long)]
    report: Option<std::path::PathBuf>,
    /// Write the report's data as JSON to this file.
    #[arg(long)]
    report_json: Option<std::path::PathBuf>,
    /// `mpi`: this process is one rank of data-parallel training started by mpirun (built with
    /// `--features mpi`). The batch flags give the whole job's batch, split across the ranks,
    /// so the weights are those of one process with the same flags; rank 0 prints, evaluates
    /// and saves.
    #[arg(long)]
    distributed: Option<String>,
    /// ZeRO stage under --distributed mpi: 0 replicates everything (plain data parallelism),
    /// 1 keeps each rank's shard of the optimizer state only, 2 also its shard of the summed
    /// gradients; the weights are those of stage 0. 3 also keeps its shard of each layer's
    /// parameters (each layer an nn::Unit at this stage), gathered around the layer's forward
    /// and backward. One process holds every shard, so the stage changes nothing there.
    #[arg(long)]
    zero: Option<String>,
    /// Prune the weights by magnitude to this sparsity in [0, 1) during training (cubic
    /// schedule from 5% to 60% of the steps), and report the sparsity of each layer.
    #[arg(long)]
    prune: Option<f32>,
    /// After training, quantize every layer to int8 (per-output-channel scales) and evaluate
    /// that model too: its weight bytes and accuracy next to the trained model's.
    #[arg(long)]
    quantize: bool,
}

pub fn run(args: Args, dist: &Job) -> fitgrad::Result<()> {
    // Rank 0 reports; the other ranks train quietly.
    let root = dist.rank() == 0;
    macro_rules! say {
        ($($t:tt)*) => { if root { println!($($t)*); } };
    }
    if args.list_adapters {
        for a in Device::adapters() {
            println!("{a}");
        }
        return Ok(());
    }
    // Every argument is checked before any device work.
    let precision: Precision = args.precision.parse()?;
    let zero = Zero::from_flag(args.zero.as_deref())?;
    dist.check_zero(
        zero,
        &[
            ("--prune", args.prune.is_some()),
            ("--quantize", args.quantize),
        ],
    )?;
    let act: Activation = args.activation.parse()?;
    let budget = args
        .memory_budget
        .as_deref()
        .map(|b| b.parse::<Bytes>().map(|b| b.0))
        .transpose()?;
    let invalid = |reason: String| fitgrad::Error::InvalidArgument {
        op: "train_mlp",
        reason,
    };
    // The Mlp's layers are no units: streaming is refused with how to mark them.
    let (offload_optimizer, _) = cli::check_offload("train_mlp", &args.offload, false, &[])?;
    let n = |v: usize| v as u64;
    let mut counts = vec![
        ("--epochs", args.epochs, 1, MAX_EPOCHS),
        ("--batch-size", n(args.batch_size), 1, MAX_BATCH),
        ("--accum-steps", n(args.accum_steps), 1, MAX_BATCH),
        (
            "--shard-size",
            n(args.shard_size.unwrap_or(1)),
            1,
            MAX_BATCH,
        ),
    ];
    // A hidden width of 0 is refused with its place in the list.
    counts.extend(
        args.hidden
            .iter()
            .map(|&w| ("--hidden", n(w), 1, cli::MAX_WIDTH)),
    );
    cli::check_counts("train_mlp", &counts)?;
    cli::check_environment()?;
    let eff = args
        .batch_size
        .checked_mul(args.accum_steps)
        .ok_or_else(|| invalid("--batch-size x --accum-steps overflows".into()))?;
    let fit_auto =
        match args.fit.as_deref() {
            None => false,
            Some("auto") if budget.is_none() => {
                return Err(invalid(
                    "--fit auto fits a budget: add --memory-budget".into(),
                ))
            }
            Some("auto") if args.checkpoint_activations => return Err(invalid(
                "--fit auto chooses activation checkpointing itself: drop --checkpoint-activations"
                    .into(),
            )),
            Some("auto") => true,
            Some(other) => return Err(invalid(format!("--fit {other}: the one mode is 'auto'"))),
        };
    if budget == Some(0) {
        return Err(invalid("--memory-budget must be more than 0 bytes".into()));
    }
    if args.checkpoint_activations && act != Activation::Gelu {
        return Err(invalid(format!(
            "--checkpoint-activations recomputes gelu layers in backward; {} layers keep \
             nothing it could drop: use --activation gelu, or drop --checkpoint-activations",
            args.activation
        )));
    }
    // No output may overwrite the dataset's files, the checkpoint resumed from, or another
    // output (--save may replace --resume: a run continued in place).
    let data_files = data::input_files(&args.dataset);
    let mut inputs: Vec<(&'static str, &std::path::Path)> = data_files
        .iter()
        .map(|p| ("--dataset", p.as_path()))
        .collect();
    inputs.extend(args.resume.as_deref().map(|p| ("--resume", p)));
    let outputs: Vec<(&'static str, &std::path::Path)> = [
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
    if !matches!(args.optimizer.as_str(), "adamw" | "adamw8bit" | "sgd") {
        return Err(invalid(format!(
            "unknown optimizer '{}' (adamw, adamw8bit or sgd)",
            args.optimizer
        )));
    }
    if let Some(lr) = args.lr {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(invalid(format!(
                "--lr must be a finite number >= 0, got {lr}"
            )));
        }
    }
    let prune = args.prune.map(PruneConfig::new);
    if let Some(cfg) = &prune {
        cfg.validate()?;
    }
    let (train, test) =
        data::load_with_label(&args.dataset, args.seed, args.label_column.as_deref())?;
    if train.dim != test.dim {
        return Err(invalid(format!(
            "the training set has {} features per sample and the test set {}",
            train.dim, test.dim
        )));
    }
    let mut widths = vec![train.dim];
    widths.extend(args.hidden.iter().copied());
    widths.push(train.classes);
    let param_dtype = match precision {
        Precision::F16 => DType::F16,
        _ => DType::F32,
    };
    let identity = vec![("dataset".to_string(), format!("{:016x}", train.hash()))];
    // The checkpoint is checked on the host, before any device work, naming the flags.
    let nothing_to_train = match &args.resume {
        Some(path) => {
            let ckpt = fitgrad::distributed::load_checkpoint(path)?;
            let widths: Vec<String> = widths.iter().map(usize::to_string).collect();
            ckpt.expect_config(
                &[
                    Expect::new(
                        "kind",
                        "mlp",
                        "resume an MLP checkpoint written by train_mlp",
                    ),
                    Expect::new(
                        "widths",
                        widths.join(","),
                        "set --hidden as it was saved, on the --dataset it was trained on",
                    ),
                    Expect::new("activation", act.name(), "set --activation as it was saved"),
                    Expect::new("dtype", param_dtype, "set --precision as it was saved"),
                ],
                "train_mlp",
            )?;
            ckpt.check_extra(&[Expect::new(
                "data.dataset",
                &identity[0].1,
                "another dataset: resume with the --dataset (and --seed) it was trained on, or \
                 start a new run without --resume",
            )])?;
            ckpt.check_finite()?;
            cli::check_resume_progress(path, ckpt.training_state()?.epoch, args.epochs, "--epochs")?
        }
        None => false,
    };
    let mut options = DeviceOptions::default();
    options.adapter = args.adapter.clone();
    options.memory_budget = budget;
    let device = Device::with_options(options)?;
    let info = device.info();
    say!("adapter: {}", info.adapter);
    say!(
        "dataset: {} ({} train, {} test, {} features, {} classes)",
        train.name,
        train.len(),
        test.len(),
        train.dim,
        train.classes
    );

    let lr = args
        .lr
        .unwrap_or(if args.optimizer == "sgd" { 0.05 } else { 1e-3 });
    let steps_per_epoch = train.len().div_ceil(eff) as u64;
    let total_steps = steps_per_epoch * args.epochs;
    let schedule = if args.cosine {
        LrSchedule::WarmupCosine {
            warmup_steps: total_steps / 20,
            total_steps,
            min_lr_ratio: 0.0,
        }
    } else {
        LrSchedule::Constant
    };
    let mut config = TrainerConfig::new(args.batch_size, args.accum_steps, lr)
        .schedule(schedule)
        .precision(precision);
    config.clip_grad_norm = args.clip_grad_norm;
    config.offload_optimizer = offload_optimizer;
    // The model and trainer at stage `zero`, built inside the budget logic (at each stage fit
    // auto tries over MPI): a budget too small for the model itself gets the smallest budget
    // that works, like one too small for a step.
    let build = |zero: Zero| {
        // ZeRO stage 3 on several ranks: each layer goes to host memory as it is made, so no
        // device holds the whole model (each rank keeps its shard of it). 8-bit state does not
        // shard.
        let born = zero.number() == 3 && dist.size() > 1 && args.optimizer != "adamw8bit";
        let make = || Mlp::with_dtype(&device, &widths, act, param_dtype, args.seed);
        let mut model = match born {
            true => fitgrad::residency::born_on_host(&device, make)?,
            false => make()?,
        };
        model.checkpoint_activations = args.checkpoint_activations;
        // Stage 3 shards the parameters of the model's units: each layer one.
        model.units = zero.number() == 3;
        let params = model.parameters();
        let optimizer: Box<dyn Optimizer> = if args.optimizer == "sgd" {
            Box::new(Sgd::new(params, lr)?.momentum(0.9)?)
        } else if args.optimizer == "adamw8bit" {
            Box::new(AdamW::new(params, lr)?.eight_bit())
        } else {
            Box::new(AdamW::new(params, lr)?)
        };
        Trainer::new(model, optimizer, config.clone())
    };
    // The planner sees the training set as the run trains it: with --shard-size, with the
    // shards the epoch keeps on the device.
    let view = ShardedView::new(&train, args.shard_size, eff)?;
    // Under MPI, fit auto first tries the stages (0 to 3, or the stage 3 given) at this
    // rank's share.
    let given = args.zero.is_some().then_some(zero);
    let staged = match fit_auto {
        true => dist.fit_auto_stage(&device, &view, given, build)?,
        false => None,
    };
    let (mut trainer, choice, zero, all_reduce) = if let Some(s) = staged {
        if root {
            print!("{}", s.choice);
        }
        (s.trainer, Some(s.choice), s.zero, Some(s.stats))
    } else {
        let (mut trainer, choice) = if fit_auto {
            // Planned alike on every rank (the whole batch, before joining): when nothing
            // fits, every rank ends with the error.
            let fitted = Trainer::build_fit_auto(&device, &view, || build(zero));
            let (trainer, choice) = dist.together(fitted)?;
            if root {
                print!("{choice}");
            }
            (trainer, Some(choice))
        } else {
            (
                Trainer::build_within_budget(&device, &view, || build(zero))?,
                None,
            )
        };
        // No stage fitted alone: the ladder's choice at the stage that keeps the least.
        let zero = match fit_auto && args.zero.is_none() && dist.size() > 1 {
            true => Zero::stage(2)?,
            false => zero,
        };
        // Fitted to the whole batch as on one process; a rank refits to its share.
        let all_reduce = dist.join_zero(&mut trainer, &view, zero)?;
        (trainer, choice, zero, all_reduce)
    };
    trainer.set_data_identity(identity);
    // Every rank's device peak so far: what making the model and joining the job held.
    let start_memory = dist.start_memory(&device, &trainer.model)?;
    // The pruner's masks (as many bytes as the weights) are made now, so the plan counts them;
    // under a budget the micro-batch is chosen again with them in use.
    let mut pruner = prune
        .map(|mut cfg| {
            cfg.schedule = PruneSchedule::gradual(total_steps);
            Pruner::new(&trainer.model, cfg)
        })
        .transpose()?;
    if let (Some(b), Some(_)) = (budget, &pruner) {
        trainer.fit_to_budget(&view, b)?;
    }
    let mut report =
        TrainingReport::new(format!("train_mlp on {}", train.name), &device, "samples/s");
    if let Some(b) = budget {
        let micro = trainer.micro_batch();
        report.set_budget(b, args.batch_size, micro, choice);
        say!(
            "memory budget {}: micro-batch {micro} of {} ({} accumulated micro-batches per step)",
            Bytes(b),
            args.batch_size,
            args.batch_size.div_ceil(micro) * args.accum_steps
        );
    }
    let planning = Instant::now();
    // The whole run: steps, then the test set at the training micro-batch under a budget
    // (a batch that does not fit is split) or in large batches; rank 0 alone evaluates.
    let budgeted = budget.is_some();
    let eval_batch = move |t: &Trainer<Mlp>| if budgeted { t.micro_batch() } else { 1024 };
    let mut phases: Vec<Phase<'_, Mlp>> = Vec::new();
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
    let run_plan = trainer.plan_whole_run(&view, &mut phases)?;
    drop(phases);
    let plan = run_plan.step.clone();
    if args.plan {
        dist.print_plan(&trainer, &run_plan, zero, args.json, planning.elapsed())?;
        return Ok(());
    }
    if args.prealloc {
        let reserved = trainer.prealloc(&view)?;
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
                "MLP {widths:?}, {} ({} parameters)",
                args.activation,
                trainer.model.num_parameters()
            ),
        ),
        (
            "optimizer",
            format!(
                "{} lr {lr}{}",
                args.optimizer,
                if args.cosine { ", cosine" } else { "" }
            ),
        ),
        ("epochs", args.epochs.to_string()),
        (
            "batch",
            format!(
                "{} x {} accumulation steps, micro-batch {}",
                args.batch_size,
                args.accum_steps,
                trainer.micro_batch()
            ),
        ),
        ("precision", trainer.config().precision.name().to_string()),
        (
            "activation checkpointing",
            trainer.model.checkpoint_activations.to_string(),
        ),
        (
            "memory budget",
            budget.map_or("none".into(), |b| Bytes(b).to_string()),
        ),
        ("preallocation", args.prealloc.to_string()),
        (
            "shard size",
            args.shard_size
                .map_or("in memory".into(), |s| s.to_string()),
        ),
        (
            "clip grad norm",
            args.clip_grad_norm.map_or("off".into(), |c| c.to_string()),
        ),
        ("seed", args.seed.to_string()),
    ] {
        report.setting(key, value);
    }
    say!(
        "model: MLP {widths:?} ({} parameters), {}, {}, batch {} x {} accumulation steps{}",
        trainer.model.num_parameters(),
        args.optimizer,
        trainer.config().precision.name(),
        args.batch_size,
        args.accum_steps,
        if trainer.model.checkpoint_activations {
            ", activation checkpointing"
        } else {
            ""
        }
    );

    let mut first_epoch = 0;
    if let Some(path) = &args.resume {
        first_epoch = dist.resume_from(&mut trainer, path)?;
        if let Some(p) = &mut pruner {
            // The masks are not in the checkpoint; the pruned weights are its zeros.
            p.mask_zeros()?;
        }
        say!(
            "resumed from {} after {first_epoch} epochs ({} steps)",
            path.display(),
            trainer.steps()
        );
        if nothing_to_train {
            say!(
                "nothing left to train: the checkpoint holds {first_epoch} epochs and --epochs is {}; evaluating it as it is",
                args.epochs
            );
        }
    }
    // The shard file is unique to this process and removed when `run` returns, error or not
    // (the guard is dropped with the other locals), on Ctrl-C or SIGTERM, or by the next run
    // after a kill.
    let (sharded, _shard_file) = match args.shard_size {
        Some(size) => {
            let file = TempShardFile::new(&format!("{}-seed{}", train.name, args.seed));
            fitgrad::train::shard::ShardedDataset::create(&train, file.path())?;
            let s = fitgrad::train::shard::ShardedDataset::open(file.path(), size)?;
            say!(
                "sharded: {} shards of up to {size} samples from {}",
                s.num_shards(),
                file.path().display()
            );
            (Some(s), Some(file))
        }
        None => (None, None),
    };
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
    for epoch in first_epoch..args.epochs {
        let bar = if root {
            ProgressBar::new(steps_per_epoch)
        } else {
            ProgressBar::hidden()
        }
        .with_style(style.clone())
        .with_prefix(format!("{}", epoch + 1));
        if epoch == first_epoch {
            // On a new machine the first steps compile every kernel (lavapipe: tens of
            // seconds); the driver caches them on disk for the next run.
            bar.set_message("compiling GPU kernels (first run on this machine only)...");
            bar.tick();
        }
        let epoch_start = Instant::now();
        let mut samples = 0usize;
        let on_step = |t: &mut Trainer<Mlp>, done: usize, total: usize| {
            if let Some(p) = &mut pruner {
                p.step(t.steps())?;
            }
            samples = (done * eff).min(train.len());
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
                let rate = samples as f64 / epoch_start.elapsed().as_secs_f64();
                bar.set_message(format!("loss {final_loss:.4}, {rate:.0} samples/s"));
                report.log_step(t.steps(), loss, Some(rate));
            }
            Ok(())
        };
        match &sharded {
            Some(s) => trainer.train_epoch_sharded(s, args.seed, epoch, on_step)?,
            None => trainer.train_epoch(&train, args.seed, epoch, on_step)?,
        }
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
        // ZeRO stage 3: the layers gathered on every rank, so one rank evaluates alone.
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
    // And each rank's whole-run peak reserved beside its plan: the plan holds on every rank.
    let rank_peaks = match dist.size() > 1 {
        true => Some(dist.rank_peaks(run_plan.peak_reserved, &device)?),
        false => None,
    };
    if !root {
        return Ok(());
    }
    let train_secs = started.elapsed().as_secs_f64() - eval_secs;
    let epochs_run = args.epochs.saturating_sub(first_epoch);
    let samples_per_s = (train.len() as u64 * epochs_run) as f64 / train_secs.max(1e-9);
    // Training's memory, before evaluation's larger batches count.
    let summary = trainer.memory_summary();
    let eval_batch = eval_batch(&trainer);
    let eval = trainer
        .evaluate(&test, eval_batch)?
        .finite(trainer.steps(), "test")?;
    let (test_loss, test_accuracy) = (eval.loss, eval.accuracy.unwrap_or(f32::NAN));
    println!(
        "test: loss {test_loss:.4}, accuracy {:.2}% ({:.1} s training, {samples_per_s:.0} samples/s)",
        100.0 * test_accuracy,
        train_secs
    );
    let int8 = if args.quantize {
        let q = QuantizedMlp::from_mlp(&trainer.model)?;
        let e = q.evaluate(&test, eval_batch)?;
        let dense: u64 = trainer
            .model
            .layers
            .iter()
            .map(|l| l.weight.allocated_bytes())
            .sum();
        let quantized = q.model().weight_bytes();
        println!(
            "int8: weights {} ({:.3}x the {} {param_dtype} weights), test loss {:.4}, accuracy {:.2}% ({:+.2} points)",
            Bytes(quantized),
            quantized as f64 / dense as f64,
            Bytes(dense),
            e.loss,
            100.0 * e.accuracy.unwrap_or(f32::NAN),
            100.0 * (e.accuracy.unwrap_or(f32::NAN) - test_accuracy)
        );
        Some((dense, quantized, e.accuracy))
    } else {
        None
    };
    let sparsity = match &pruner {
        Some(p) => {
            let sparsity = p.report()?;
            println!(
                "\npruned to {:.2}% sparsity:\n{sparsity}",
                100.0 * sparsity.sparsity()
            );
            Some(sparsity.sparsity())
        }
        None => None,
    };
    println!("\n{summary}");
    println!(
        "planned peak in use {} / measured {}",
        Bytes(plan.peak),
        Bytes(summary.stats.peak_bytes_in_use)
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
        .result("test loss", format!("{test_loss:.4}"))
        .result("test accuracy", format!("{:.2}%", 100.0 * test_accuracy))
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
            "hidden": args.hidden,
            "optimizer": args.optimizer,
            "lr": lr,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "accum_steps": args.accum_steps,
            "micro_batch": trainer.micro_batch(),
            "precision": trainer.config().precision.name(),
            "checkpoint_activations": trainer.model.checkpoint_activations,
            "memory_budget": budget,
            "planned_peak_bytes": plan.peak,
            "planned_host_bytes": plan.host_bytes,
            "planned_bytes_moved": plan.bytes_moved,
            "planned_peak_reserved": plan.peak_reserved,
            "skipped_steps": trainer.scaler().map_or(0, |s| s.skipped_steps()),
            "seed": args.seed,
            "final_loss": final_loss,
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
            "sparsity": sparsity,
            "weight_bytes": int8.map(|q| q.0),
            "int8_weight_bytes": int8.map(|q| q.1),
            "int8_test_accuracy": int8.and_then(|q| q.2),
            "planned_run_peak_reserved": run_plan.peak_reserved,
            "peak_bytes": run.peak_bytes_reserved,
            "peak_bytes_in_use": run.peak_bytes_in_use,
            "step_peak_bytes": s.peak_bytes_reserved,
            "buffers_created": run.buffers_created,
            "parameter_bytes": summary.parameter_bytes,
            "optimizer_state_bytes": summary.optimizer_state_bytes,
            "offload": args.offload,
            "host_bytes": summary.host_bytes,
            "optimizer_state_bytes_f32": f32_adamw_state_bytes(&trainer.model.parameters()),
            "steps": trainer.steps(),
            "train_seconds": train_secs,
            "samples_per_s": samples_per_s,
        });
        dist.add_to_json(&mut j, all_reduce.as_ref());
        dist.add_traffic_to_json(&mut j, &trainer, zero)?;
        j["zero_stage"] = zero.number().into();
        j["start"] = start_memory;
        j["rank_weight_hashes"] = rank_hashes.into();
        j["rank_peaks"] = rank_peaks.into();
        println!("{j}");
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    Job::main(args.distributed.clone().as_deref(), |dist| {
        run(args, dist).map_err(|e| {
            cli::name_flags(
                "train_mlp",
                e,
                "lower --batch-size or the --hidden widths, or give --memory-budget, which \
                 trains in smaller micro-batches",
            )
        })
    })
}
