//! `cargo run --release --example train_gpt` — train a small GPT on Shakespeare, one character
//! at a time.
//!
//! With no arguments it trains a 2-layer, 64-wide, 4-head GPT with a context of 32 characters on
//! the eight plays embedded in the crate (the last 10% held out), and prints the adapter, a
//! progress bar with the training loss and tokens/s, the validation loss in nats per character
//! beside the bigram baseline of the same split, where the device memory went, and a seeded
//! sample of generated text. `--help` lists the flags; `--json` ends stdout with one JSON
//! object; `--report report.html` / `--report-json report.json` write the run's report (the
//! memory timeline of a step beside the planner's, the loss curves, throughput, the memory
//! table). Every flag is checked before any device work. `--distributed mpi` runs it as one
//! rank of an MPI job (`mpirun -np 2 ...`, built with `--features mpi`): each rank trains its
//! share of every batch; rank 0 prints, evaluates, samples and saves.
//!
//! tests/it/train_gpt_cli.rs includes this file as a module and calls [`prepare`] and [`train`].

use fitgrad::distributed::{Job, Zero};
use fitgrad::nn::{Gpt, Module};
use fitgrad::optim::{decay_groups, AdamW};
use fitgrad::report::TrainingReport;
use fitgrad::run::{self, Strategy};
use fitgrad::train::{Phase, RunPlan, Trainer, TrainerConfig};
use fitgrad::{Bytes, Device, Result};
use std::process::ExitCode;
use std::time::Instant;

mod end;
mod setup;
mod steps;
use end::{describe, finish_run, settings, End};
pub use setup::{open_device, prepare, Args, Report, Setup};
use steps::train_steps;

/// Windows per forward when evaluating without a budget: few large dispatches.
const EVAL_BATCH: usize = 256;

/// Trains, evaluates, samples and prints, on `device`, as this process's part of `dist` (on
/// ranks other than 0: trains only, and the report has no validation loss or sample).
pub fn train(args: &Args, setup: Setup, device: &Device, dist: &Job) -> Result<Report> {
    let root = dist.is_root();
    macro_rules! say {
        ($($t:tt)*) => { if root { println!($($t)*); } };
    }
    say!("adapter: {}", device.info().adapter);
    let corpus = &setup.corpus;
    say!(
        "text: {} ({} characters, {} distinct; {} train, {} validation)",
        corpus.name,
        corpus.len(),
        corpus.vocab.len(),
        corpus.train.len(),
        corpus.valid.len()
    );
    let bigram = corpus.bigram_baseline()?;
    let strategy = Strategy {
        fit_auto: setup.fit_auto,
        zero: setup.zero,
        zero_given: args.job.zero.is_some(),
        identity: setup.identity.clone(),
    };
    let build = |zero: Zero| build(args, &setup, device, dist, zero);
    let run::Built { mut trainer, job } =
        run::build_trainer(dist, device, &setup.train, strategy, build)?;
    let mut report =
        TrainingReport::new(format!("train_gpt on {}", corpus.name), device, "tokens/s");
    if let Some(b) = setup.budget {
        let micro = trainer.micro_batch();
        report.set_budget(b, args.batch_size, micro, job.choice.clone());
        say!(
            "{}",
            run::budget_line(b, args.batch_size, micro, args.run.accum_steps, true)
        );
    } else if trainer.micro_batch() < args.batch_size {
        say!(
            "micro-batch {} of {}: a larger one would pass the adapter's per-buffer limit \
             (gradients accumulate, the result is unchanged)",
            trainer.micro_batch(),
            args.batch_size
        );
    }
    let planning = Instant::now();
    let run_plan = plan_run(args, &setup, &mut trainer, root)?;
    if args.run.plan {
        dist.print_plan(
            &trainer,
            &run_plan,
            job.zero,
            args.run.json,
            planning.elapsed(),
        )?;
        return Ok(Report {
            train_loss: f32::NAN,
            valid_loss: f32::NAN,
            sample: String::new(),
            peak_bytes: 0,
            planned_run_peak: run_plan.peak_reserved,
            bigram,
            steps: trainer.steps(),
        });
    }
    if args.checkpoint.prealloc {
        let reserved = trainer.prealloc(&setup.train)?;
        say!("reserved {} up front", Bytes(reserved));
    }
    let cfg = trainer.model.gpt_config();
    say!(
        "model: {}, {}, AdamW lr {}{}, batch {} x {} accumulation steps{}",
        describe(&trainer),
        trainer.config().precision.name(),
        args.lr,
        if args.cosine { " cosine" } else { "" },
        args.batch_size,
        args.run.accum_steps,
        if cfg.checkpoint_blocks {
            ", block checkpointing"
        } else {
            ""
        }
    );
    if let Some(path) = &args.checkpoint.resume {
        resume(args, &setup, &mut trainer, path, dist)?;
    }
    report.set_plan(run_plan.step.clone());
    settings(&mut report, args, &setup, &trainer);
    let trained = train_steps(args, &setup, &mut trainer, &mut report, dist)?;
    let end = End {
        bigram,
        run_plan,
        job,
        trained,
    };
    finish_run(args, &setup, trainer, report, dist, end)
}

/// Resumes from the checkpoint at `path` on every rank, and says so on rank 0.
fn resume(
    args: &Args,
    setup: &Setup,
    trainer: &mut Trainer<Gpt>,
    path: &std::path::Path,
    dist: &Job,
) -> Result<()> {
    dist.resume_from(trainer, path)?;
    if !dist.is_root() {
        return Ok(());
    }
    println!(
        "resumed from {} after {} steps",
        path.display(),
        trainer.steps()
    );
    if setup.nothing_to_train {
        println!(
            "nothing left to train: the checkpoint holds {} steps and --steps is {}; evaluating it as it is",
            trainer.steps(),
            args.steps
        );
    }
    Ok(())
}

/// The model and trainer at stage `zero` (the budget logic builds it, at each stage fit auto
/// tries over MPI).
fn build(
    args: &Args,
    setup: &Setup,
    device: &Device,
    dist: &Job,
    zero: Zero,
) -> Result<Trainer<Gpt>> {
    let mut config = TrainerConfig::new(args.batch_size, args.run.accum_steps, args.lr);
    config.schedule = run::lr_schedule(args.cosine, args.steps, 0.1);
    config.precision = setup.precision;
    (config.offload_optimizer, config.offload_parameters) = setup.offload;
    config.clip_grad_norm = (args.clip_grad_norm > 0.0).then_some(args.clip_grad_norm);
    let make = || Gpt::new(device, setup.cfg.clone());
    // Streamed, or ZeRO stage 3 on several ranks (each keeps its shard): each block goes to
    // host memory as it is made, never all on the device. 8-bit state does not shard.
    let stage3 = zero.number() == 3 && dist.size() > 1 && args.optimizer == "adamw";
    let model = match setup.offload.1 || stage3 {
        true => fitgrad::residency::born_on_host(device, make)?,
        false => make()?,
    };
    // No weight decay on biases, LayerNorms and embeddings' rank-1 parameters.
    let groups = decay_groups(model.named_parameters(), 0.1);
    let mut optimizer = AdamW::with_groups(groups, args.lr)?.betas(0.9, 0.95)?;
    if args.optimizer == "adamw8bit" {
        optimizer = optimizer.eight_bit();
    }
    Trainer::new(model, Box::new(optimizer), config)
}

/// Samples per forward of the final evaluation: the training micro-batch under a budget (it
/// splits a batch that does not fit), else few large forwards.
pub fn eval_batch(setup: &Setup, t: &Trainer<Gpt>) -> usize {
    match setup.budget {
        Some(_) => t.micro_batch(),
        None => EVAL_BATCH,
    }
}

/// The whole run, planned in order: steps, the evaluations, the sample with its KV cache;
/// rank 0 alone evaluates and samples.
fn plan_run(args: &Args, setup: &Setup, trainer: &mut Trainer<Gpt>, root: bool) -> Result<RunPlan> {
    let prompt = &setup.corpus.valid[..1];
    let mut phases: Vec<Phase<'_, Gpt>> = Vec::new();
    if root && args.eval_every > 0 && args.eval_every < args.steps {
        phases.push((
            "evaluation during training",
            Box::new(|t| t.evaluate(&setup.valid_head, t.micro_batch()).map(drop)),
        ));
    }
    if root {
        phases.push((
            "evaluation",
            Box::new(|t| t.evaluate(&setup.valid, eval_batch(setup, t)).map(drop)),
        ));
    }
    if root && args.sample_len > 0 {
        phases.push((
            "generation",
            Box::new(|t| {
                let g = t
                    .model
                    .generate(prompt, args.sample_len, args.temperature, args.run.seed);
                g.map(drop)
            }),
        ));
    }
    trainer.plan_whole_run(&setup.train, &mut phases)
}

/// [`prepare`], [`open_device`], [`train`].
pub fn run(args: &Args, dist: &Job) -> Result<Report> {
    let setup = prepare(args)?;
    let device = open_device(args, &setup)?;
    train(args, setup, &device, dist).map_err(|e| {
        run::name_flags(
            "train_gpt",
            e,
            "lower --batch-size or --context, or give --memory-budget, which trains in smaller micro-batches",
        )
    })
}

fn main() -> ExitCode {
    // Flag errors exit with 1 and clap's message (a negative number names its flag).
    let args = match run::parse::<Args>() {
        Ok(a) => a,
        Err(code) => return code,
    };
    Job::main(args.job.distributed.as_deref(), |dist| {
        run::agree_flags::<Args>(dist)?;
        run(&args, dist).map(drop)
    })
}
