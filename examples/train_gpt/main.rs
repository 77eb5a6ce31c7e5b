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
//! tests/train_gpt_cli.rs includes this file as a module and calls [`prepare`] and [`train`].

use clap::Parser;
use fitgrad::cli;
use fitgrad::distributed::{Job, Zero};
use fitgrad::nn::{Gpt, Module};
use fitgrad::optim::quant8::f32_adamw_state_bytes;
use fitgrad::optim::{decay_groups, AdamW, LrSchedule};
use fitgrad::report::{StepCapture, TrainingReport};
use fitgrad::train::text::TextDataset;
use fitgrad::train::{BatchSource, Phase, Trainer, TrainerConfig};
use fitgrad::{Bytes, Device, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::process::ExitCode;
use std::time::Instant;

mod setup;
pub use setup::{open_device, prepare, Args, Report, Setup};

/// Windows per forward when evaluating without a budget: few large dispatches.
const EVAL_BATCH: usize = 256;

/// The windows of step `step` in a run of effective batch `eff`: positions `step * eff ..` of
/// the concatenated epoch orders (each epoch a seeded shuffle of every window), so a resumed
/// run continues with the windows the uninterrupted run would have seen.
struct StepOrder {
    seed: u64,
    epoch: u64,
    order: Vec<usize>,
}

impl StepOrder {
    fn new(seed: u64) -> StepOrder {
        StepOrder {
            seed,
            epoch: u64::MAX,
            order: Vec::new(),
        }
    }

    fn indices(&mut self, data: &TextDataset, step: u64, eff: usize) -> Vec<usize> {
        let n = data.len() as u64;
        (0..eff as u64)
            .map(|i| {
                let pos = step * eff as u64 + i;
                let epoch = pos / n;
                if epoch != self.epoch {
                    self.order = data.epoch_order(self.seed, epoch);
                    self.epoch = epoch;
                }
                self.order[(pos % n) as usize]
            })
            .collect()
    }
}

/// Trains, evaluates, samples and prints, on `device`, as this process's part of `dist` (on
/// ranks other than 0: trains only, and the report has no validation loss or sample).
pub fn train(args: &Args, setup: Setup, device: &Device, dist: &Job) -> Result<Report> {
    let root = dist.is_root();
    macro_rules! say {
        ($($t:tt)*) => { if root { println!($($t)*); } };
    }
    let info = device.info().clone();
    say!("adapter: {}", info.adapter);
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
    let eff = args.batch_size * args.accum_steps;
    let schedule = if args.cosine {
        LrSchedule::WarmupCosine {
            warmup_steps: args.steps / 20,
            total_steps: args.steps,
            min_lr_ratio: 0.1,
        }
    } else {
        LrSchedule::Constant
    };
    let mut config = TrainerConfig::new(args.batch_size, args.accum_steps, args.lr);
    config.schedule = schedule;
    config.precision = setup.precision;
    (config.offload_optimizer, config.offload_parameters) = setup.offload;
    config.clip_grad_norm = (args.clip_grad_norm > 0.0).then_some(args.clip_grad_norm);
    // The model and trainer at stage `zero` (the budget logic builds it, at each stage fit
    // auto tries over MPI).
    let build = |zero: Zero| {
        let make = || Gpt::new(device, setup.cfg.clone());
        // Streamed, or ZeRO stage 3 on several ranks (each keeps its shard): each block goes
        // to host memory as it is made, never all on the device. 8-bit state does not shard.
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
        Trainer::new(model, Box::new(optimizer), config.clone())
    };
    // Under MPI, fit auto first tries the stages (0 to 3, or the stage 3 given) at this
    // rank's share.
    let given = args.zero.is_some().then_some(setup.zero);
    let staged = match setup.fit_auto {
        true => dist.fit_auto_stage(device, &setup.train, given, build)?,
        false => None,
    };
    let (mut trainer, choice, zero, all_reduce) = if let Some(s) = staged {
        if root {
            print!("{}", s.choice);
        }
        (s.trainer, Some(s.choice), s.zero, Some(s.stats))
    } else {
        let (mut trainer, choice) = if setup.fit_auto {
            // Planned alike on every rank (the whole batch, before joining): when nothing
            // fits, every rank ends with the error.
            let fitted = Trainer::build_fit_auto(device, &setup.train, || build(setup.zero));
            let (trainer, choice) = dist.together(fitted)?;
            if root {
                print!("{choice}");
            }
            (trainer, Some(choice))
        } else {
            (
                Trainer::build_within_budget(device, &setup.train, || build(setup.zero))?,
                None,
            )
        };
        // No stage fitted alone: the ladder's choice at the stage that keeps the least.
        let zero = match setup.fit_auto && args.zero.is_none() && dist.size() > 1 {
            true => Zero::stage(2)?,
            false => setup.zero,
        };
        // Fitted to the whole batch as on one process; a rank refits to its share.
        let all_reduce = dist.join_zero(&mut trainer, &setup.train, zero)?;
        (trainer, choice, zero, all_reduce)
    };
    trainer.set_data_identity(setup.identity.clone());
    // Every rank's device peak so far: what making the model and joining the job held.
    let start_memory = dist.start_memory(device, &trainer.model)?;
    // What `--fit auto` chose, for the JSON line (null without it).
    let fit_json = choice.as_ref().map(|c| {
        serde_json::json!({
            "micro_batch": c.micro_batch,
            "checkpointing": c.checkpointing,
            "precision": c.precision.name(),
            "residence": format!("{:?}", c.residence),
            "candidates_planned": c.candidates.len(),
        })
    });
    let mut report =
        TrainingReport::new(format!("train_gpt on {}", corpus.name), device, "tokens/s");
    if let Some(b) = setup.budget {
        let micro = trainer.micro_batch();
        report.set_budget(b, args.batch_size, micro, choice);
        say!(
            "memory budget {}: micro-batch {micro} of {} ({} accumulated micro-batches per step)",
            Bytes(b),
            args.batch_size,
            args.batch_size.div_ceil(micro) * args.accum_steps
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
    // The whole run, planned in order: steps, the evaluations, the sample with its KV cache.
    // Evaluation runs at the training micro-batch under a budget (it splits a batch that
    // does not fit), else in few large forwards; rank 0 alone evaluates and samples.
    let budgeted = setup.budget.is_some();
    let eval_batch = move |t: &Trainer<Gpt>| {
        if budgeted {
            t.micro_batch()
        } else {
            EVAL_BATCH
        }
    };
    let prompt = &corpus.valid[..1];
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
            Box::new(|t| t.evaluate(&setup.valid, eval_batch(t)).map(drop)),
        ));
    }
    if root && args.sample_len > 0 {
        phases.push((
            "generation",
            Box::new(|t| {
                let g = t
                    .model
                    .generate(prompt, args.sample_len, args.temperature, args.seed);
                g.map(drop)
            }),
        ));
    }
    let run_plan = trainer.plan_whole_run(&setup.train, &mut phases)?;
    drop(phases);
    let plan = run_plan.step.clone();
    if args.plan {
        dist.print_plan(&trainer, &run_plan, zero, args.json, planning.elapsed())?;
        return Ok(Report {
            train_loss: f32::NAN,
            valid_loss: f32::NAN,
            bigram,
            steps: trainer.steps(),
            sample: String::new(),
            peak_bytes: 0,
            planned_run_peak: run_plan.peak_reserved,
        });
    }
    if args.prealloc {
        let reserved = trainer.prealloc(&setup.train)?;
        say!("reserved {} up front", Bytes(reserved));
    }
    let cfg = trainer.model.gpt_config();
    say!(
        "model: GPT {} layers, dim {}, {} heads, context {} ({} parameters), {}, AdamW lr {}{}, batch {} x {} accumulation steps{}",
        cfg.layers,
        cfg.dim,
        cfg.heads,
        cfg.context,
        trainer.model.num_parameters(),
        trainer.config().precision.name(),
        args.lr,
        if args.cosine { " cosine" } else { "" },
        args.batch_size,
        args.accum_steps,
        if cfg.checkpoint_blocks {
            ", block checkpointing"
        } else {
            ""
        }
    );
    if let Some(path) = &args.resume {
        dist.resume_from(&mut trainer, path)?;
        say!(
            "resumed from {} after {} steps",
            path.display(),
            trainer.steps()
        );
        if setup.nothing_to_train {
            say!(
                "nothing left to train: the checkpoint holds {} steps and --steps is {}; evaluating it as it is",
                trainer.steps(),
                args.steps
            );
        }
    }
    report.set_plan(plan.clone());
    for (key, value) in [
        (
            "text",
            format!(
                "{} ({} characters, {} distinct)",
                corpus.name,
                corpus.len(),
                corpus.vocab.len()
            ),
        ),
        (
            "model",
            format!(
                "GPT {} layers, dim {}, {} heads, context {} ({} parameters), attention {}",
                cfg.layers,
                cfg.dim,
                cfg.heads,
                cfg.context,
                trainer.model.num_parameters(),
                args.attention
            ),
        ),
        (
            "optimizer",
            format!(
                "{} lr {}{}",
                args.optimizer,
                args.lr,
                if args.cosine { ", cosine" } else { "" }
            ),
        ),
        ("steps", args.steps.to_string()),
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
        ("block checkpointing", cfg.checkpoint_blocks.to_string()),
        ("dropout", args.dropout.to_string()),
        ("clip grad norm", args.clip_grad_norm.to_string()),
        (
            "memory budget",
            setup.budget.map_or("none".into(), |b| Bytes(b).to_string()),
        ),
        ("seed", args.seed.to_string()),
    ] {
        report.setting(key, value);
    }

    let bar = if root {
        ProgressBar::new(args.steps)
    } else {
        ProgressBar::hidden()
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
    let mut order = StepOrder::new(args.seed);
    let mut train_loss = f32::NAN;
    let started = Instant::now();
    let first_step = trainer.steps();
    let reporting = args.report.is_some() || args.report_json.is_some();
    let mut capture = StepCapture::new();
    let mut eval_secs = 0.0;
    for step in first_step..args.steps {
        let idx = order.indices(&setup.train, step, eff);
        trainer.step(&setup.train, &idx)?;
        if reporting {
            capture.after_step(&mut trainer, &setup.train)?;
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
        let evaluating = args.eval_every > 0 && done % args.eval_every == 0 && done < args.steps;
        if evaluating {
            // ZeRO stage 3: the blocks gathered on every rank, so rank 0 evaluates alone.
            trainer.gather_parameters()?;
        }
        if root && evaluating {
            let eval_start = Instant::now();
            // At the training micro-batch: evaluation keeps no graph, so it stays below the
            // step's peak, and the summary's peak stays the training step's (the planned one).
            // A blown-up run stops here, before its checkpoint replaces a good one.
            let e = trainer
                .evaluate(&setup.valid_head, trainer.micro_batch())?
                .finite(trainer.steps(), "validation")?;
            eval_secs += eval_start.elapsed().as_secs_f64();
            report.log_eval(done, None, "validation (first windows)", &e);
            let v = e.loss;
            // Printed above the bar (or plainly, when stdout is not a terminal and the bar is
            // hidden).
            bar.suspend(|| {
                println!(
                    "step {done}: train {train_loss:.4}, validation {v:.4} nats/char (first {} windows)",
                    setup.valid_head.len()
                )
            });
        }
        // Every rank joins the save (a ZeRO rank holds a shard of the optimizer state);
        // rank 0, which evaluated, writes.
        if args.eval_every > 0 && done % args.eval_every == 0 && done < args.steps {
            if let Some(path) = &args.save {
                dist.save_checkpoint(&trainer, path, 0)?;
            }
        }
        let events = trainer.take_events();
        for e in &events {
            bar.suspend(|| say!("  {e}"));
        }
        report.add_events(&events);
    }
    bar.finish();
    device.sync()?;
    // ZeRO stage 3: the trained blocks gathered on every rank (read by the hashes, rank 0's
    // evaluation, sample and save, which then need no collective).
    trainer.gather_parameters()?;
    // Each rank's weights, hashed: the report shows whether the replicas hold the same bits.
    let rank_hashes = match dist.size() > 1 {
        true => Some(dist.weight_hashes(&trainer.model)?),
        false => None,
    };
    // Each rank's parameters, gradients and optimizer state at its step's peak, planned and
    // measured (what ZeRO spreads).
    let rank_state = dist.rank_state_bytes(device, &plan)?;
    if !root {
        // Joins rank 0's final save, written once its validation loss is finite.
        if let Some(path) = &args.save {
            dist.save_checkpoint(&trainer, path, 0)?;
        }
        return Ok(Report {
            train_loss,
            valid_loss: f32::NAN,
            bigram,
            steps: trainer.steps(),
            sample: String::new(),
            peak_bytes: device.memory_stats().peak_bytes_reserved,
            planned_run_peak: run_plan.peak_reserved,
        });
    }
    let secs = started.elapsed().as_secs_f64() - eval_secs;
    let steps_run = args.steps.saturating_sub(first_step);
    let tokens_per_s = (steps_run as f64 * (eff * args.context) as f64) / secs.max(1e-9);
    // Training's memory, before evaluation and sampling count.
    let summary = trainer.memory_summary();
    // Saved only once the validation loss is finite: a blown-up run never replaces a good
    // checkpoint.
    let valid = trainer
        .evaluate(&setup.valid, eval_batch(&trainer))?
        .finite(trainer.steps(), "validation")?;
    if let Some(path) = &args.save {
        dist.save_checkpoint(&trainer, path, 0)?;
    }
    report.log_eval(trainer.steps(), None, "validation", &valid);
    let valid_loss = valid.loss;
    let uniform = (corpus.vocab.len() as f64).ln();
    println!(
        "validation: {valid_loss:.4} nats/char on {} characters (bigram baseline {bigram:.4}, uniform {uniform:.4}); train {train_loss:.4}",
        setup.valid.len() * args.context
    );
    let skipped = trainer.scaler().map_or(0, |s| s.skipped_steps());
    println!(
        "{} steps in {secs:.1} s, {tokens_per_s:.0} tokens/s{}",
        trainer.steps() - first_step,
        if skipped > 0 {
            format!(" ({skipped} more skipped by loss scaling: their gradients overflowed)")
        } else {
            String::new()
        }
    );
    println!("\n{summary}");
    println!(
        "planned peak in use {} / measured {}",
        Bytes(plan.peak),
        Bytes(summary.stats.peak_bytes_in_use)
    );
    println!("{}", device.memory_report());

    let sample = if args.sample_len > 0 {
        // The prompt: the validation part's first character.
        let prompt = &corpus.valid[..1];
        let ids = trainer
            .model
            .generate(prompt, args.sample_len, args.temperature, args.seed)?;
        let text = corpus.vocab.decode(&ids);
        println!(
            "sample ({} characters, temperature {}, seed {}):\n{text}\n",
            args.sample_len, args.temperature, args.seed
        );
        text
    } else {
        String::new()
    };

    // The whole run's peak, evaluation and sampling included, beside its plan.
    let run = device.memory_stats();
    println!(
        "whole run: peak reserved planned {} / measured {}",
        Bytes(run_plan.peak_reserved),
        Bytes(run.peak_bytes_reserved)
    );
    report.set_step_memory(capture.finish());
    report.set_memory(summary.stats.clone());
    report
        .result("validation loss", format!("{valid_loss:.4} nats/char"))
        .result("bigram baseline", format!("{bigram:.4} nats/char"))
        .result("training loss", format!("{train_loss:.4} nats/char"))
        .result("training time", format!("{secs:.1} s"))
        .result("throughput", format!("{tokens_per_s:.0} tokens/s"))
        .result("steps", trainer.steps());
    if !sample.is_empty() {
        report.result("sample", &sample);
    }
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
            "text": corpus.name,
            "vocab_size": corpus.vocab.len(),
            "layers": cfg.layers,
            "heads": cfg.heads,
            "dim": cfg.dim,
            "context": cfg.context,
            "params": trainer.model.num_parameters(),
            "lr": args.lr,
            "optimizer": args.optimizer,
            "optimizer_state_bytes": summary.optimizer_state_bytes,
            "offload": args.offload,
            "host_bytes": summary.host_bytes,
            "optimizer_state_bytes_f32": f32_adamw_state_bytes(&trainer.model.parameters()),
            "steps": trainer.steps(),
            "skipped_steps": skipped,
            "batch_size": args.batch_size,
            "accum_steps": args.accum_steps,
            "micro_batch": trainer.micro_batch(),
            "precision": trainer.config().precision.name(),
            "checkpoint_activations": cfg.checkpoint_blocks,
            "memory_budget": setup.budget,
            "fit": fit_json,
            "planned_peak_bytes": plan.peak,
            "planned_host_bytes": plan.host_bytes,
            "planned_bytes_moved": plan.bytes_moved,
            "planned_peak_reserved": plan.peak_reserved,
            "seed": args.seed,
            "train_loss": train_loss,
            "val_loss": valid_loss,
            "bigram_val_loss": bigram,
            "planned_run_peak_reserved": run_plan.peak_reserved,
            "peak_bytes": run.peak_bytes_reserved,
            "peak_bytes_in_use": run.peak_bytes_in_use,
            "step_peak_bytes": s.peak_bytes_reserved,
            "buffers_created": run.buffers_created,
            "train_seconds": secs,
            "tokens_per_s": tokens_per_s,
        });
        dist.add_to_json(&mut j, all_reduce.as_ref());
        dist.add_traffic_to_json(&mut j, &trainer, zero)?;
        j["zero_stage"] = zero.number().into();
        j["start"] = start_memory;
        j["rank_weight_hashes"] = rank_hashes.into();
        j["per_rank_state_bytes"] = rank_state;
        println!("{j}");
    }
    Ok(Report {
        train_loss,
        valid_loss,
        bigram,
        steps: trainer.steps(),
        sample,
        peak_bytes: run.peak_bytes_reserved,
        planned_run_peak: run_plan.peak_reserved,
    })
}

/// [`prepare`], [`open_device`], [`train`].
pub fn run(args: &Args, dist: &Job) -> Result<Report> {
    let setup = prepare(args)?;
    let device = open_device(args, &setup)?;
    train(args, setup, &device, dist).map_err(|e| {
        cli::name_flags(
            "train_gpt",
            e,
            "lower --batch-size or --context, or give --memory-budget, which trains in smaller micro-batches",
        )
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    Job::main(args.distributed.as_deref(), |dist| {
        run(&args, dist).map(drop)
    })
}
