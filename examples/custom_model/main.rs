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

use fitgrad::distributed::{Job, Zero};
use fitgrad::nn::Module;
use fitgrad::optim::{AdamW, Optimizer};
use fitgrad::report::TrainingReport;
use fitgrad::run::{self, finish, EpochRun, Strategy};
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::Result;
use std::process::ExitCode;

mod model;
mod results;
mod setup;
use model::ResMlp;
use results::{describe, forwards_in, own_json, settings};
pub use setup::{load_data, prepare, Args, Data, Setup};

/// Checks the flags ([`prepare`]), then trains, evaluates and reports as this process's part of
/// `dist` (rank 0 prints, evaluates and saves).
pub fn run(args: Args, dist: &Job) -> Result<()> {
    // Rank 0 reports; the other ranks train quietly.
    let root = dist.is_root();
    let say = |line: &str| {
        if root {
            println!("{line}");
        }
    };
    let setup = prepare(&args, dist)?;
    let device = run::open_device(args.run.adapter.as_deref(), setup.budget)?;
    say(&format!("adapter: {}", device.info().adapter));
    let data = load_data(&args, device.info(), say)?;
    let (train, test) = (&data.train, &data.test);
    let run::Built { mut trainer, job } = build(&args, &setup, &data, &device, dist)?;
    let title = format!("custom_model (residual MLP) on {}", train.name);
    let mut report = TrainingReport::new(title, &device, "samples/s");
    say(&format!(
        "model: {}, AdamW lr {}, {}, batch {} x {} accumulation steps",
        describe(&args, &data, &trainer),
        args.lr,
        args.run.precision,
        args.batch_size,
        args.run.accum_steps
    ));
    let eff = trainer.effective_batch();
    let total_steps = run::total_steps("custom_model", train.len(), eff, data.epochs)?;
    // The default filter prunes every 2-D weight: the stem, the blocks' fc1 and fc2, the head.
    let mut pruner = run::pruner(&mut trainer, setup.prune.clone(), total_steps, train)?;
    if let Some(b) = setup.budget {
        let micro = trainer.micro_batch();
        say(&run::budget_line(
            b,
            args.batch_size,
            micro,
            args.run.accum_steps,
            false,
        ));
        report.set_budget(b, args.batch_size, micro, None);
    }
    let epochs = EpochRun {
        save_sharded: args.save_sharded.as_deref(),
        peak_detail: true,
        ..EpochRun::new(dist, &args.common, (train, test), data.epochs)
    };
    let Some(run_plan) =
        epochs.plan(&mut trainer, train, job.zero, args.run.plan, args.run.json)?
    else {
        return Ok(());
    };
    if args.checkpoint.prealloc {
        epochs.prealloc(&mut trainer, train)?;
    }
    let plan = &run_plan.step;
    report.set_plan(plan.clone());
    settings(&mut report, &args, &data, &trainer, setup.budget);
    let mut first_epoch = 0;
    if let Some(path) = &args.checkpoint.resume {
        // The dropout masks go on from where the run stopped: as many calls skipped.
        let skip = |done: u64, t: &Trainer<ResMlp>| {
            let forwards = forwards_in(done, train.len(), eff, t.micro_batch(), dist);
            t.model.skip_dropout_masks(forwards);
        };
        let nothing = data.nothing_to_train;
        first_epoch = epochs.resume(&mut trainer, path, pruner.as_mut(), nothing)?;
        skip(first_epoch, &trainer);
    }
    let trained = epochs.train(
        &mut trainer,
        first_epoch,
        pruner.as_mut(),
        &mut report,
        job.zero,
        None,
    )?;
    let hashes = finish::rank_hashes(dist, &trainer.model)?;
    if !root {
        return Ok(());
    }
    let pruner = pruner.as_ref();
    let ended = epochs.end(
        &trainer,
        trained,
        pruner,
        &run_plan,
        &mut report,
        |_| Ok(()),
    )?;
    if args.run.json {
        let own = own_json(&args, &data, &trainer, setup.budget);
        let mut j = ended.json(&trainer, &run_plan, &args.offload, own);
        finish::add_job_json(&mut j, dist, &job, &trainer, hashes)?;
        println!("{j}");
    }
    Ok(())
}

/// The model and trainer, built inside the budget logic: a budget too small for the model
/// itself gets the smallest budget that works, as one too small for a step does.
fn build(
    args: &Args,
    setup: &Setup,
    data: &Data,
    device: &fitgrad::Device,
    dist: &Job,
) -> Result<run::Built<ResMlp>> {
    let train = &data.train;
    let lr = args.lr as f32;
    let config = TrainerConfig::new(args.batch_size, args.run.accum_steps, lr)
        .precision(setup.precision)
        .offload_optimizer(setup.offload.0)
        .offload_parameters(setup.offload.1);
    let build = |zero: Zero| {
        let make = || {
            let dropout = args.dropout as f32;
            ResMlp::new(
                device,
                train.dim,
                args.width,
                args.blocks,
                train.classes,
                dropout,
                args.run.seed,
            )
        };
        // Streamed, or ZeRO stage 3 on several ranks (each keeps its shard): each block goes
        // to host memory as it is made, never all on the device. 8-bit state does not shard.
        let stage3 = zero.number() == 3 && dist.size() > 1 && args.optimizer == "adamw";
        let model = match setup.offload.1 || stage3 {
            true => fitgrad::residency::born_on_host(device, make)?,
            false => make()?,
        };
        let adamw = AdamW::new(model.parameters(), lr)?;
        let optimizer: Box<dyn Optimizer> = match args.optimizer.as_str() {
            "adamw8bit" => Box::new(adamw.eight_bit()),
            _ => Box::new(adamw),
        };
        Trainer::new(model, optimizer, config.clone())
    };
    let strategy = Strategy {
        fit_auto: false,
        zero: setup.zero,
        zero_given: args.job.zero.is_some(),
        identity: data.identity.clone(),
    };
    run::build_trainer(dist, device, train, strategy, build)
}

fn main() -> ExitCode {
    // Flag errors exit with 1 and clap's message; --help prints and exits with 0.
    let args = match run::parse::<Args>() {
        Ok(a) => a,
        Err(code) => return code,
    };
    Job::main(args.job.distributed.clone().as_deref(), |dist| {
        run::agree_flags::<Args>(dist)?;
        run(args, dist).map_err(|e| {
            run::name_flags(
                "custom_model",
                e,
                "lower --batch-size or --width, or give --memory-budget, which trains in \
                 smaller micro-batches",
            )
        })
    })
}
