//! The end of a train_gpt run: the whole validation part, the save, the sample, the memory
//! beside its plan, the report (and its settings) and the JSON line.

use super::steps::Trained;
use super::{eval_batch, Args, Report, Setup};
use fitgrad::distributed::Job;
use fitgrad::nn::{Gpt, Module};
use fitgrad::report::TrainingReport;
use fitgrad::run::{self, finish, Joined};
use fitgrad::train::{BatchSource, MemorySummary, RunPlan, Trainer};
use fitgrad::{Bytes, Result};

/// What [`finish_run`] reports beside the trainer.
pub struct End {
    pub bigram: f64,
    pub run_plan: RunPlan,
    pub job: Joined,
    pub trained: Trained,
}

/// The end of the run: every rank's hashes and state; rank 0 evaluates the whole validation
/// part, saves, samples, prints the memory and writes the report and the JSON.
pub fn finish_run(
    args: &Args,
    setup: &Setup,
    trainer: Trainer<Gpt>,
    mut report: TrainingReport,
    dist: &Job,
    end: End,
) -> Result<Report> {
    let End {
        bigram,
        run_plan,
        job,
        trained,
    } = end;
    let device = trainer.device().clone();
    let plan = &run_plan.step;
    // ZeRO stage 3: the trained blocks gathered on every rank (read by the hashes, rank 0's
    // evaluation, sample and save, which then need no collective).
    trainer.gather_parameters()?;
    let hashes = finish::rank_hashes(dist, &trainer.model)?;
    // Each rank's parameters, gradients and optimizer state at its step's peak, planned and
    // measured (what ZeRO spreads).
    let rank_state = dist.rank_state_bytes(&device, plan)?;
    let mut out = Report {
        train_loss: trained.train_loss,
        valid_loss: f32::NAN,
        bigram,
        steps: trainer.steps(),
        sample: String::new(),
        peak_bytes: device.memory_stats().peak_bytes_reserved,
        planned_run_peak: run_plan.peak_reserved,
    };
    if !dist.is_root() {
        // Joins rank 0's final save, written once its validation loss is finite.
        if let Some(path) = &args.checkpoint.save {
            dist.save_checkpoint(&trainer, path, 0)?;
        }
        return Ok(out);
    }
    let (secs, train_loss) = (trained.secs, trained.train_loss);
    let steps_run = args.steps.saturating_sub(trained.first_step);
    let eff = args.batch_size * args.run.accum_steps;
    let tokens_per_s = (steps_run as f64 * (eff * args.context) as f64) / secs.max(1e-9);
    // Training's memory, before evaluation and sampling count.
    let summary = trainer.memory_summary();
    // Saved only once the validation loss is finite: a blown-up run never replaces a good
    // checkpoint.
    let valid = trainer
        .evaluate(&setup.valid, eval_batch(setup, &trainer))?
        .finite(trainer.steps(), "validation")?;
    if let Some(path) = &args.checkpoint.save {
        dist.save_checkpoint(&trainer, path, 0)?;
    }
    report.log_eval(trainer.steps(), None, "validation", &valid);
    let f = Figures {
        train_loss,
        valid_loss: valid.loss,
        bigram,
        secs,
        tokens_per_s,
    };
    say_figures(args, setup, &trainer, &f, trained.first_step);
    println!("\n{summary}");
    finish::print_step_peak(plan, &summary);
    println!("{}", device.memory_report());
    let sample = sample(args, setup, &trainer)?;
    // The whole run's peak, evaluation and sampling included, beside its plan.
    finish::print_whole_run(&run_plan, &device);
    report.set_step_memory(trained.capture.finish());
    report.set_memory(summary.stats.clone());
    f.results(&mut report, trainer.steps(), &sample);
    let files = (
        args.report.report.as_deref(),
        args.report.report_json.as_deref(),
    );
    finish::write_reports(&report, files.0, files.1)?;
    if args.run.json {
        let ranks = (dist, hashes, rank_state);
        let plans = (&run_plan, &job, &summary);
        print_json(args, setup, &trainer, plans, &f, ranks)?;
    }
    out.valid_loss = f.valid_loss;
    out.sample = sample;
    out.peak_bytes = device.memory_stats().peak_bytes_reserved;
    Ok(out)
}

/// The sample of `--sample-len` characters after the validation part's first, printed.
fn sample(args: &Args, setup: &Setup, trainer: &Trainer<Gpt>) -> Result<String> {
    let n = args.sample_len;
    if n == 0 {
        return Ok(String::new());
    }
    let (corpus, seed) = (&setup.corpus, args.run.seed);
    let ids = trainer
        .model
        .generate(&corpus.valid[..1], n, args.temperature, seed)?;
    let text = corpus.vocab.decode(&ids);
    println!(
        "sample ({n} characters, temperature {}, seed {seed}):\n{text}\n",
        args.temperature
    );
    Ok(text)
}

/// The run's figures in the JSON line.
struct Figures {
    train_loss: f32,
    valid_loss: f32,
    bigram: f64,
    secs: f64,
    tokens_per_s: f64,
}

impl Figures {
    /// The report's results: the losses beside the bigram baseline, time, throughput, steps
    /// and the sample.
    fn results(&self, report: &mut TrainingReport, steps: u64, sample: &str) {
        report
            .result(
                "validation loss",
                format!("{:.4} nats/char", self.valid_loss),
            )
            .result("bigram baseline", format!("{:.4} nats/char", self.bigram))
            .result("training loss", format!("{:.4} nats/char", self.train_loss))
            .result("training time", format!("{:.1} s", self.secs))
            .result("throughput", format!("{:.0} tokens/s", self.tokens_per_s))
            .result("steps", steps);
        if !sample.is_empty() {
            report.result("sample", sample);
        }
    }
}

/// The validation loss beside the baselines, and the steps' time and throughput.
fn say_figures(args: &Args, setup: &Setup, trainer: &Trainer<Gpt>, f: &Figures, first_step: u64) {
    let (valid_loss, bigram, train_loss) = (f.valid_loss, f.bigram, f.train_loss);
    let uniform = (setup.corpus.vocab.len() as f64).ln();
    println!(
        "validation: {valid_loss:.4} nats/char on {} characters (bigram baseline {bigram:.4}, uniform {uniform:.4}); train {train_loss:.4}",
        setup.valid.len() * args.context
    );
    let skipped = trainer.scaler().map_or(0, |s| s.skipped_steps());
    println!(
        "{} steps in {:.1} s, {:.0} tokens/s{}",
        trainer.steps() - first_step,
        f.secs,
        f.tokens_per_s,
        if skipped > 0 {
            format!(" ({skipped} more skipped by loss scaling: their gradients overflowed)")
        } else {
            String::new()
        }
    );
}

/// The `--json` line: the shared memory fields, the model's, the figures and the job's.
fn print_json(
    args: &Args,
    setup: &Setup,
    trainer: &Trainer<Gpt>,
    (run_plan, job, summary): (&RunPlan, &Joined, &MemorySummary),
    f: &Figures,
    (dist, hashes, rank_state): (&Job, Option<Vec<u64>>, serde_json::Value),
) -> Result<()> {
    let (cfg, corpus) = (trainer.model.gpt_config(), &setup.corpus);
    let own = serde_json::json!({
        "text": corpus.name,
        "vocab_size": corpus.vocab.len(),
        "layers": cfg.layers,
        "heads": cfg.heads,
        "dim": cfg.dim,
        "context": cfg.context,
        "params": trainer.model.num_parameters(),
        "lr": args.lr,
        "optimizer": args.optimizer,
        "batch_size": args.batch_size,
        "accum_steps": args.run.accum_steps,
        "precision": trainer.config().precision.name(),
        "checkpoint_activations": cfg.checkpoint_blocks,
        "memory_budget": setup.budget,
        "fit": finish::fit_json(job.choice.as_ref()),
        "seed": args.run.seed,
        "train_loss": f.train_loss,
        "val_loss": f.valid_loss,
        "bigram_val_loss": f.bigram,
        "train_seconds": f.secs,
        "tokens_per_s": f.tokens_per_s,
    });
    let memory = finish::memory_json(trainer, run_plan, summary, &args.offload);
    let mut j = finish::extend(memory, own);
    finish::add_job_json(&mut j, dist, job, trainer, hashes)?;
    j["per_rank_state_bytes"] = rank_state;
    println!("{j}");
    Ok(())
}

/// `GPT L layers, dim D, H heads, context C (N parameters)`.
pub fn describe(trainer: &Trainer<Gpt>) -> String {
    let cfg = trainer.model.gpt_config();
    format!(
        "GPT {} layers, dim {}, {} heads, context {} ({} parameters)",
        cfg.layers,
        cfg.dim,
        cfg.heads,
        cfg.context,
        trainer.model.num_parameters()
    )
}

/// The report's settings: the text, the model, the optimizer and the memory flags.
pub fn settings(report: &mut TrainingReport, args: &Args, setup: &Setup, trainer: &Trainer<Gpt>) {
    let corpus = &setup.corpus;
    let cfg = trainer.model.gpt_config();
    let cosine = if args.cosine { ", cosine" } else { "" };
    let batch = run::batch_setting(args.batch_size, args.run.accum_steps, trainer.micro_batch());
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
            format!("{}, attention {}", describe(trainer), args.attention),
        ),
        (
            "optimizer",
            format!("{} lr {}{cosine}", args.optimizer, args.lr),
        ),
        ("steps", args.steps.to_string()),
        ("batch", batch),
        ("precision", trainer.config().precision.name().to_string()),
        ("block checkpointing", cfg.checkpoint_blocks.to_string()),
        ("dropout", args.dropout.to_string()),
        ("clip grad norm", args.clip_grad_norm.to_string()),
        (
            "memory budget",
            setup.budget.map_or("none".into(), |b| Bytes(b).to_string()),
        ),
        ("seed", args.run.seed.to_string()),
    ] {
        report.setting(key, value);
    }
}
