//! `cargo run --release --example train_mlp` — train an MLP classifier on the GPU.
//!
//! With no arguments it trains on the handwritten digits embedded in the crate (8x8 images,
//! 1,797 samples) and prints the adapter, a progress bar per epoch, the test accuracy and where
//! the device memory went. `--help` lists the flags; `--json` ends stdout with one JSON object;
//! `--report report.html` (and `--report-json report.json`) writes a page with the memory
//! timeline of a step, the loss, accuracy and throughput curves and the memory table.

use clap::Parser;
use fitgrad::cli;
use fitgrad::compress::{PruneSchedule, Pruner, QuantizedMlp};
use fitgrad::distributed::{Job, Zero};
use fitgrad::nn::{Mlp, Module};
use fitgrad::optim::quant8::f32_adamw_state_bytes;
use fitgrad::optim::{AdamW, LrSchedule, Optimizer, Sgd};
use fitgrad::report::{StepCapture, TrainingReport};
use fitgrad::train::shard::TempShardFile;
use fitgrad::train::{Phase, ShardedView, Trainer, TrainerConfig};
use fitgrad::{Bytes, Device, DeviceOptions};
use indicatif::{ProgressBar, ProgressStyle};
use std::process::ExitCode;
use std::time::Instant;

mod setup;
pub use setup::{prepare, Args, Setup};

/// Checks the flags ([`prepare`]), then trains, evaluates and reports as this process's part of
/// `dist` (rank 0 prints, evaluates and saves).
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
    let Setup {
        precision,
        zero,
        act,
        budget,
        offload_optimizer,
        eff,
        fit_auto,
        reporting,
        prune,
        train,
        test,
        widths,
        param_dtype,
        identity,
        nothing_to_train,
    } = prepare(&args, dist)?;
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
