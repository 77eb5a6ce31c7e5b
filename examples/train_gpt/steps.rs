//! train_gpt's steps: the windows of each step, a progress bar, the loss every 10 steps, the
//! first validation windows every `--eval-every` steps and the saves every rank joins.

use super::{Args, Setup};
use fitgrad::distributed::Job;
use fitgrad::nn::Gpt;
use fitgrad::report::{StepCapture, TrainingReport};
use fitgrad::run::StepOrder;
use fitgrad::train::{BatchSource, Trainer};
use fitgrad::Result;
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Instant;

/// What the steps ended with.
pub struct Trained {
    pub train_loss: f32,
    /// Seconds training took (evaluations left out), and the step it started from.
    pub secs: f64,
    pub first_step: u64,
    pub capture: StepCapture,
}

/// Trains from the trainer's step to `--steps`, a progress bar on rank 0, the loss every 10
/// steps, the first validation windows every `--eval-every` steps (and a save every rank
/// joins).
pub fn train_steps(
    args: &Args,
    setup: &Setup,
    trainer: &mut Trainer<Gpt>,
    report: &mut TrainingReport,
    dist: &Job,
) -> Result<Trained> {
    let root = dist.is_root();
    let eff = args.batch_size * args.run.accum_steps;
    let bar = match root {
        true => ProgressBar::new(args.steps),
        false => ProgressBar::hidden(),
    }
    .with_style(
        ProgressStyle::with_template("step {pos}/{len} [{bar:30}] {msg} ({elapsed})")
            .expect("valid template")
            .progress_chars("=> "),
    )
    .with_position(trainer.steps().min(args.steps));
    // On a new machine the first steps compile every kernel (lavapipe: tens of seconds); the
    // driver caches them on disk for the next run.
    bar.set_message("compiling GPU kernels (first run on this machine only)...");
    bar.tick();
    let mut order = StepOrder::new(args.run.seed);
    let mut train_loss = f32::NAN;
    let started = Instant::now();
    let first_step = trainer.steps();
    let reporting = args.report.report.is_some() || args.report.report_json.is_some();
    let mut capture = StepCapture::new();
    let mut eval_secs = 0.0;
    for step in first_step..args.steps {
        let idx = order.indices(&setup.train, step, eff);
        trainer.step(&setup.train, &idx)?;
        if reporting {
            capture.after_step(trainer, &setup.train)?;
        }
        let done = step + 1;
        bar.set_position(done);
        // A readback every 10 steps keeps the GPU busy between them.
        if done % 10 == 0 || done == args.steps {
            let loss = trainer.take_loss()?;
            if !loss.is_nan() {
                train_loss = loss;
            }
            let tokens = (done - first_step) as f64 * (eff * args.context) as f64;
            let rate = tokens / (started.elapsed().as_secs_f64() - eval_secs);
            bar.set_message(format!("loss {train_loss:.3}, {rate:.0} tokens/s"));
            report.log_step(done, loss, Some(rate));
        }
        if args.eval_every > 0 && done % args.eval_every == 0 && done < args.steps {
            let eval_start = Instant::now();
            evaluate_head(setup, trainer, report, dist, &bar, train_loss)?;
            eval_secs += eval_start.elapsed().as_secs_f64();
            // Every rank joins the save (a ZeRO rank holds a shard of the optimizer state);
            // rank 0, which evaluated, writes.
            if let Some(path) = &args.checkpoint.save {
                dist.save_checkpoint(trainer, path, 0)?;
            }
        }
        let events = trainer.take_events();
        for e in &events {
            bar.suspend(|| say_root(root, format_args!("  {e}")));
        }
        report.add_events(&events);
    }
    bar.finish();
    trainer.device().sync()?;
    Ok(Trained {
        train_loss,
        secs: started.elapsed().as_secs_f64() - eval_secs,
        first_step,
        capture,
    })
}

fn say_root(root: bool, line: std::fmt::Arguments<'_>) {
    if root {
        println!("{line}");
    }
}

/// The first validation windows during training, on rank 0 (every rank gathers ZeRO stage
/// 3's blocks first), printed above the bar.
fn evaluate_head(
    setup: &Setup,
    trainer: &mut Trainer<Gpt>,
    report: &mut TrainingReport,
    dist: &Job,
    bar: &ProgressBar,
    train_loss: f32,
) -> Result<()> {
    // ZeRO stage 3: the blocks gathered on every rank, so rank 0 evaluates alone.
    trainer.gather_parameters()?;
    if !dist.is_root() {
        return Ok(());
    }
    // At the training micro-batch: evaluation keeps no graph, so it stays below the step's
    // peak, and the summary's peak stays the training step's (the planned one). A blown-up
    // run stops here, before its checkpoint replaces a good one.
    let done = trainer.steps();
    let e = trainer
        .evaluate(&setup.valid_head, trainer.micro_batch())?
        .finite(done, "validation")?;
    report.log_eval(done, None, "validation (first windows)", &e);
    let v = e.loss;
    // Printed above the bar (or plainly, when stdout is not a terminal and the bar is hidden).
    bar.suspend(|| {
        println!(
            "step {done}: train {train_loss:.4}, validation {v:.4} nats/char (first {} windows)",
            setup.valid_head.len()
        )
    });
    Ok(())
}
