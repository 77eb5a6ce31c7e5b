//! `cargo run --release --example train_mlp` — train an MLP classifier on the GPU.
//!
//! With no arguments it trains on the handwritten digits embedded in the crate (8x8 images,
//! 1,797 samples) and prints the adapter, a progress bar per epoch, the test accuracy and where
//! the device memory went. `--help` lists the flags; `--json` ends stdout with one JSON object;
//! `--report report.html` (and `--report-json report.json`) writes a page with the memory
//! timeline of a step, the loss, accuracy and throughput curves and the memory table.

use fitgrad::compress::Pruner;
use fitgrad::distributed::{Job, Zero};
use fitgrad::nn::{Mlp, Module};
use fitgrad::optim::{AdamW, Optimizer, Sgd};
use fitgrad::report::TrainingReport;
use fitgrad::run::{self, finish, EpochRun, Strategy};
use fitgrad::train::{Evaluation, RunPlan, ShardedView, Trainer, TrainerConfig};
use fitgrad::Device;
use std::process::ExitCode;

mod results;
mod setup;
use results::{quantized, settings};
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
    let setup = prepare(&args, dist)?;
    let (train, test) = (&setup.train, &setup.test);
    let total_steps = run::total_steps("train_mlp", train.len(), setup.eff, args.epochs)?;
    let device = run::open_device(args.run.adapter.as_deref(), setup.budget)?;
    say!("adapter: {}", device.info().adapter);
    say!("{}", run::dataset_line(train, test));
    let lr = args
        .lr
        .unwrap_or(if args.optimizer == "sgd" { 0.05 } else { 1e-3 });
    // The planner sees the training set as the run trains it: with --shard-size, with the
    // shards the epoch keeps on the device.
    let view = ShardedView::new(train, args.shard_size, setup.eff)?;
    let built = build(&args, &setup, &device, dist, &view, lr, total_steps)?;
    let run::Built { mut trainer, job } = built;
    let mut pruner = run::pruner(&mut trainer, setup.prune.clone(), total_steps, &view)?;
    let title = format!("train_mlp on {}", train.name);
    let mut report = TrainingReport::new(title, &device, "samples/s");
    if let Some(b) = setup.budget {
        let (batch, micro) = (args.batch_size, trainer.micro_batch());
        report.set_budget(b, batch, micro, job.choice.clone());
        say!(
            "{}",
            run::budget_line(b, batch, micro, args.run.accum_steps, true)
        );
    }
    let epochs = EpochRun {
        save_sharded: args.save_sharded.as_deref(),
        compiling_note: true,
        ..EpochRun::new(dist, &args.common, (train, test), args.epochs)
    };
    let (plan, json) = (args.run.plan, args.run.json);
    let Some(run_plan) = epochs.plan(&mut trainer, &view, job.zero, plan, json)? else {
        return Ok(());
    };
    if args.checkpoint.prealloc {
        epochs.prealloc(&mut trainer, &view)?;
    }
    report.set_plan(run_plan.step.clone());
    settings(&mut report, &args, &setup, &trainer, lr);
    let checkpointing = match trainer.model.checkpoint_activations {
        true => ", activation checkpointing",
        false => "",
    };
    say!(
        "model: MLP {:?} ({} parameters), {}, {}, batch {} x {} accumulation steps{checkpointing}",
        setup.widths,
        trainer.model.num_parameters(),
        args.optimizer,
        trainer.config().precision.name(),
        args.batch_size,
        args.run.accum_steps,
    );
    let pruning = pruner.as_mut();
    let first_epoch = match &args.checkpoint.resume {
        Some(path) => epochs.resume(&mut trainer, path, pruning, setup.nothing_to_train)?,
        None => 0,
    };
    // The shard file is removed when `run` returns (the guard is dropped with the locals).
    let (sharded, _shard_file) = run::temp_shards(dist, train, args.run.seed, args.shard_size)?;
    let (pruning, zero) = (pruner.as_mut(), job.zero);
    let trained = epochs.train(
        &mut trainer,
        first_epoch,
        pruning,
        &mut report,
        zero,
        sharded.as_ref(),
    )?;
    let end = End {
        trainer,
        job,
        run_plan,
        pruner,
        report,
        trained,
        lr,
    };
    finish_run(&args, &setup, &epochs, end)
}

/// The model and trainer: built at each ZeRO stage inside the budget logic (at each stage fit
/// auto tries over MPI), so a budget too small for the model itself gets the smallest budget
/// that works, like one too small for a step.
fn build(
    args: &Args,
    setup: &Setup,
    device: &Device,
    dist: &Job,
    view: &ShardedView<'_>,
    lr: f32,
    total_steps: u64,
) -> fitgrad::Result<run::Built<Mlp>> {
    let mut config = TrainerConfig::new(args.batch_size, args.run.accum_steps, lr)
        .schedule(run::lr_schedule(args.cosine, total_steps, 0.0))
        .precision(setup.precision);
    config.clip_grad_norm = args.clip_grad_norm;
    config.offload_optimizer = setup.offload_optimizer;
    let build = |zero: Zero| {
        // ZeRO stage 3 on several ranks: each layer goes to host memory as it is made, so no
        // device holds the whole model (each rank keeps its shard of it). 8-bit state does not
        // shard.
        let born = zero.number() == 3 && dist.size() > 1 && args.optimizer != "adamw8bit";
        let (widths, dtype) = (&setup.widths, setup.param_dtype);
        let make = || Mlp::with_dtype(device, widths, setup.act, dtype, args.run.seed);
        let mut model = match born {
            true => fitgrad::residency::born_on_host(device, make)?,
            false => make()?,
        };
        model.checkpoint_activations = args.fit.checkpoint_activations;
        // Stage 3 shards the parameters of the model's units: each layer one.
        model.units = zero.number() == 3;
        let params = model.parameters();
        let optimizer: Box<dyn Optimizer> = match args.optimizer.as_str() {
            "sgd" => Box::new(Sgd::new(params, lr)?.momentum(0.9)?),
            "adamw8bit" => Box::new(AdamW::new(params, lr)?.eight_bit()),
            _ => Box::new(AdamW::new(params, lr)?),
        };
        Trainer::new(model, optimizer, config.clone())
    };
    let strategy = Strategy {
        fit_auto: setup.fit_auto,
        zero: setup.zero,
        zero_given: args.job.zero.is_some(),
        identity: setup.identity.clone(),
    };
    run::build_trainer(dist, device, view, strategy, build)
}

/// What the epochs leave for the end of the run.
struct End {
    trainer: Trainer<Mlp>,
    job: run::Joined,
    run_plan: RunPlan,
    pruner: Option<Pruner>,
    report: TrainingReport,
    trained: run::Trained,
    lr: f32,
}

/// The end of the run: every rank's hashes and peaks; rank 0 evaluates the test set (and the
/// int8 model), prints the memory beside its plan, writes the report and the JSON line.
fn finish_run(args: &Args, setup: &Setup, epochs: &EpochRun<'_>, end: End) -> fitgrad::Result<()> {
    let End {
        trainer,
        job,
        run_plan,
        pruner,
        mut report,
        trained,
        lr,
    } = end;
    let (dist, device) = (epochs.dist, trainer.device());
    let hashes = finish::rank_hashes(dist, &trainer.model)?;
    // And each rank's whole-run peak reserved beside its plan: the plan holds on every rank.
    let rank_peaks = match dist.size() > 1 {
        true => Some(dist.rank_peaks(run_plan.peak_reserved, device)?),
        false => None,
    };
    if !dist.is_root() {
        return Ok(());
    }
    // `--quantize`: the int8 model's figures beside the trained model's.
    let int8 = |eval: &Evaluation| match args.quantize {
        true => quantized(&trainer, setup, eval, epochs.eval_batch(&trainer)).map(Some),
        false => Ok(None),
    };
    let pruner = pruner.as_ref();
    let ended = epochs.end(&trainer, trained, pruner, &run_plan, &mut report, int8)?;
    if !args.run.json {
        return Ok(());
    }
    let int8 = ended.extra;
    let own = serde_json::json!({
        "dataset": setup.train.name,
        "hidden": args.hidden,
        "optimizer": args.optimizer,
        "lr": lr,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "accum_steps": args.run.accum_steps,
        "precision": trainer.config().precision.name(),
        "checkpoint_activations": trainer.model.checkpoint_activations,
        "memory_budget": setup.budget,
        "seed": args.run.seed,
        "weight_bytes": int8.map(|q| q.0),
        "int8_weight_bytes": int8.map(|q| q.1),
        "int8_test_accuracy": int8.and_then(|q| q.2),
        "parameter_bytes": ended.summary.parameter_bytes,
    });
    let mut j = ended.json(&trainer, &run_plan, &args.offload, own);
    finish::add_job_json(&mut j, dist, &job, &trainer, hashes)?;
    j["rank_peaks"] = rank_peaks.into();
    println!("{j}");
    Ok(())
}

fn main() -> ExitCode {
    // Flag errors exit with 1 and clap's message (a negative number names its flag).
    let args = match run::parse::<Args>() {
        Ok(a) => a,
        Err(code) => return code,
    };
    Job::main(args.job.distributed.clone().as_deref(), |dist| {
        run::agree_flags::<Args>(dist)?;
        run(args, dist).map_err(|e| {
            run::name_flags(
                "train_mlp",
                e,
                "lower --batch-size or the --hidden widths, or give --memory-budget, which \
                 trains in smaller micro-batches",
            )
        })
    })
}
