//! `cargo run --release --example finetune -- --model DIR --eval-text FILE` — evaluate and
//! fine-tune a GPT-2 or a Llama saved as a Hugging Face folder (config.json, model.safetensors
//! or a sharded index, tokenizer.json).
//!
//! `--eval-text` tokenizes the whole file with no special tokens, cuts it into consecutive
//! windows of `--context`+1 tokens, one starting every `--context` tokens (the last may be
//! shorter), and reports `eval_loss`, the token-weighted mean next-token cross-entropy in nats
//! over all windows. With `--steps 0` (the default) that is the loaded model's loss; with
//! `--text FILE --steps N` the whole model is fine-tuned first (AdamW, the trainer of
//! train_gpt: `--batch-size`, `--accum-steps`, `--precision`, `--memory-budget`, `--fit auto`,
//! `--checkpoint-activations`, `--plan`) and evaluated before and after. `--generate "prompt"`
//! samples `--max-new-tokens` tokens at `--temperature`, `--top-k`, `--top-p` with `--seed`; `--save DIR` writes the
//! model back as a folder transformers loads; `--json` ends stdout with one JSON object. Every
//! flag and file is checked before any device work.
//!
//! tests/hf.rs includes this file as a module and calls [`prepare`] and [`run`].

use clap::Parser;
use fitgrad::hf::TOKENIZER_FILE;
use fitgrad::hf::{save_gpt2, save_llama, PretrainedGpt, PretrainedLlama, Tokenizer};
use fitgrad::nn::{LanguageModel, Sampling};
use fitgrad::optim::{decay_groups, AdamW};
use fitgrad::train::text::{TextDataset, TokenBatch};
use fitgrad::train::WindowLoss;
use fitgrad::train::{window_loss, BatchSource, Precision, TrainModel, Trainer, TrainerConfig};
use fitgrad::{Bytes, Device, DeviceOptions, Error, Result};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Windows per forward when evaluating.
const EVAL_BATCH: usize = 8;

/// The flags.
#[derive(Parser, Debug, Clone)]
#[command(
    about = "Evaluate, fine-tune and sample a Hugging Face GPT-2 or Llama folder with fitgrad"
)]
pub struct Args {
    /// A Hugging Face GPT-2 or Llama folder: config.json, model.safetensors (or
    /// model.safetensors.index.json and its shards), tokenizer.json.
    #[arg(long)]
    pub model: PathBuf,
    /// A UTF-8 text whose loss is reported as eval_loss (nats per token).
    #[arg(long)]
    pub eval_text: Option<PathBuf>,
    /// Tokens a prediction sees, at most the model's positions (GPT-2's n_positions, Llama's
    /// max_position_embeddings; the default).
    #[arg(long)]
    pub context: Option<usize>,
    /// A UTF-8 text to fine-tune on (windows of --context + 1 tokens, every token a start).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Optimizer steps of fine-tuning (0: evaluate the model as loaded).
    #[arg(long, default_value_t = 0)]
    pub steps: u64,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-4)]
    pub lr: f32,
    /// Windows per batch.
    #[arg(long, default_value_t = 4)]
    pub batch_size: usize,
    /// Batches whose gradients add up before each optimizer step.
    #[arg(long, default_value_t = 1)]
    pub accum_steps: usize,
    /// f32, f16 (weights converted on load; a value past f16's range is an error) or mixed.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Hard limit on device memory (e.g. 512MiB); the micro-batch is fitted to it.
    #[arg(long)]
    pub memory_budget: Option<String>,
    /// `auto`: let --memory-budget choose micro-batch, checkpointing and precision.
    #[arg(long)]
    pub fit: Option<String>,
    /// Recompute each block's halves in backward instead of keeping their activations.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Print the planned peak memory of a fine-tuning step, by category, and exit.
    #[arg(long)]
    pub plan: bool,
    /// A prompt to continue after evaluation and fine-tuning.
    #[arg(long)]
    pub generate: Option<String>,
    /// Tokens to sample after --generate's prompt.
    #[arg(long, default_value_t = 40)]
    pub max_new_tokens: usize,
    /// Sampling temperature (> 0).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Sample only among the k most probable tokens (1: greedy).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample only among the most probable tokens whose probabilities add up to p, in (0, 1].
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Seed of the window order and of sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the model (after fine-tuning) to this folder as transformers reads it.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Substring of the adapter name to use.
    #[arg(long)]
    pub adapter: Option<String>,
    /// End stdout with one JSON object describing the run.
    #[arg(long)]
    pub json: bool,
}

/// What a run ends with.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The eval text's loss after fine-tuning (the loaded model's with --steps 0).
    pub eval: Option<WindowLoss>,
    /// The eval text's loss before fine-tuning (only when --steps > 0).
    pub eval_before: Option<WindowLoss>,
    /// Mean training loss of the last steps.
    pub train_loss: Option<f32>,
    /// The prompt and its continuation.
    pub generated: Option<String>,
}

/// A model folder read and checked on the host.
pub enum Folder {
    /// `GPT2LMHeadModel`.
    Gpt2(PretrainedGpt),
    /// `LlamaForCausalLM`.
    Llama(PretrainedLlama),
}

impl Folder {
    /// Reads `dir` with the loader its `config.json`'s model_type names.
    fn open(dir: &Path, dtype: fitgrad::DType) -> Result<Folder> {
        match fitgrad::hf::model_type(dir)?.as_str() {
            "llama" => Ok(Folder::Llama(PretrainedLlama::open(dir, dtype)?)),
            // GPT-2's loader names any other model_type in its refusal.
            _ => Ok(Folder::Gpt2(PretrainedGpt::open(dir, dtype)?)),
        }
    }

    fn dir(&self) -> &Path {
        match self {
            Folder::Gpt2(f) => &f.dir,
            Folder::Llama(f) => &f.dir,
        }
    }

    fn tokenizer(&self) -> Result<Tokenizer> {
        match self {
            Folder::Gpt2(f) => f.tokenizer(),
            Folder::Llama(f) => f.tokenizer(),
        }
    }

    /// The most positions, and the config field that says so.
    fn positions(&self) -> (usize, &'static str) {
        match self {
            Folder::Gpt2(f) => (f.config.context, "n_positions"),
            Folder::Llama(f) => (f.config.context, "max_position_embeddings"),
        }
    }

    fn vocab_size(&self) -> usize {
        match self {
            Folder::Gpt2(f) => f.config.vocab_size,
            Folder::Llama(f) => f.config.vocab_size,
        }
    }

    /// One line on the architecture.
    fn describe(&self) -> String {
        match self {
            Folder::Gpt2(f) => {
                let c = &f.config;
                format!(
                    "GPT-2, {} layers, dim {}, {} heads, {} positions, vocabulary {}",
                    c.layers, c.dim, c.heads, c.context, c.vocab_size
                )
            }
            Folder::Llama(f) => {
                let c = &f.config;
                format!(
                    "Llama, {} layers, dim {}, {} heads over {} kv heads, {} positions, \
                     vocabulary {}{}",
                    c.layers,
                    c.dim,
                    c.heads,
                    c.kv_heads,
                    c.context,
                    c.vocab_size,
                    if c.tie_embeddings { ", tied head" } else { "" }
                )
            }
        }
    }
}

/// Everything the flags ask for, read and checked on the host.
pub struct Setup {
    folder: Folder,
    tokenizer: Tokenizer,
    context: usize,
    eval: Option<Vec<u32>>,
    train: Option<TextDataset>,
    prompt: Option<Vec<u32>>,
    precision: Precision,
    budget: Option<u64>,
    fit_auto: bool,
}

fn invalid(reason: String) -> Error {
    Error::InvalidArgument {
        op: "finetune",
        reason,
    }
}

fn read_text(path: &std::path::Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| Error::Data {
        path: path.display().to_string(),
        reason: format!("not UTF-8 text: {e}"),
    })
}

/// Checks every flag, reads the folder, the tokenizer and the texts, before any device work.
pub fn prepare(args: &Args) -> Result<Setup> {
    let precision: Precision = args.precision.parse()?;
    let budget = args
        .memory_budget
        .as_deref()
        .map(|b| b.parse::<Bytes>().map(|b| b.0))
        .transpose()?;
    if budget == Some(0) {
        return Err(invalid("--memory-budget must be more than 0 bytes".into()));
    }
    let fit_auto = match args.fit.as_deref() {
        None => false,
        Some("auto") if budget.is_none() => {
            return Err(invalid(
                "--fit auto fits a budget: add --memory-budget".into(),
            ))
        }
        Some("auto") => true,
        Some(other) => return Err(invalid(format!("--fit {other}: the one mode is 'auto'"))),
    };
    if args.batch_size == 0 || args.accum_steps == 0 {
        return Err(invalid(
            "--batch-size and --accum-steps must be at least 1".into(),
        ));
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(invalid(format!(
            "--lr must be a number > 0, got {}",
            args.lr
        )));
    }
    if !(args.temperature.is_finite() && args.temperature > 0.0) {
        return Err(invalid(format!(
            "--temperature must be a number > 0, got {}",
            args.temperature
        )));
    }
    if args.top_k == Some(0) || args.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return Err(invalid(format!(
            "--top-k must be at least 1 and --top-p in (0, 1], got {:?} and {:?}",
            args.top_k, args.top_p
        )));
    }
    if (args.steps > 0 || args.plan) && args.text.is_none() {
        return Err(invalid(
            "--steps and --plan fine-tune on a text: add --text FILE".into(),
        ));
    }
    let folder = Folder::open(&args.model, precision.param_dtype())?;
    if args.checkpoint_activations && matches!(folder, Folder::Llama(_)) {
        return Err(invalid(
            "--checkpoint-activations: a Llama's blocks are not checkpointed (yet)".into(),
        ));
    }
    let tokenizer = folder.tokenizer()?;
    let (n_positions, field) = folder.positions();
    let context = args.context.unwrap_or(n_positions);
    if context == 0 || context > n_positions {
        return Err(invalid(format!(
            "--context {context}: between 1 and the model's {field} = {n_positions}"
        )));
    }
    if tokenizer.vocab_size() > folder.vocab_size() {
        return Err(Error::Data {
            path: args.model.join(TOKENIZER_FILE).display().to_string(),
            reason: format!(
                "the tokenizer's {} tokens pass the model's vocab_size of {}",
                tokenizer.vocab_size(),
                folder.vocab_size()
            ),
        });
    }
    let eval = match &args.eval_text {
        Some(path) => {
            let ids = tokenizer.encode(&read_text(path)?)?;
            if ids.len() < 2 {
                return Err(Error::Data {
                    path: path.display().to_string(),
                    reason: format!("{} tokens: the loss needs at least 2", ids.len()),
                });
            }
            Some(ids)
        }
        None => None,
    };
    let train = match &args.text {
        Some(path) => {
            let ids = tokenizer.encode(&read_text(path)?)?;
            Some(TextDataset::new(ids, context).map_err(|e| Error::Data {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?)
        }
        None => None,
    };
    let prompt = match &args.generate {
        Some(p) => {
            let ids = tokenizer.encode(p)?;
            if ids.is_empty() {
                return Err(invalid(
                    "--generate needs a prompt of at least one token".into(),
                ));
            }
            Some(ids)
        }
        None => None,
    };
    Ok(Setup {
        folder,
        tokenizer,
        context,
        eval,
        train,
        prompt,
        precision,
        budget,
        fit_auto,
    })
}

/// Opens the device the flags ask for.
pub fn open_device(args: &Args, setup: &Setup) -> Result<Device> {
    let mut o = DeviceOptions::default();
    o.adapter = args.adapter.clone();
    o.memory_budget = setup.budget;
    Device::with_options(o)
}

fn evaluate<M: LanguageModel>(model: &M, setup: &Setup) -> Result<Option<WindowLoss>> {
    let Some(ids) = &setup.eval else {
        return Ok(None);
    };
    model.set_training(false);
    let loss = window_loss(model, ids, setup.context, EVAL_BATCH, model.dtype())?;
    model.set_training(true);
    Ok(Some(loss))
}

/// Evaluates, fine-tunes, evaluates again, samples and saves, on `device`.
pub fn run(args: &Args, setup: Setup, device: &Device) -> Result<Report> {
    println!("adapter: {}", device.info().adapter);
    println!(
        "model: {} ({}), context {}",
        args.model.display(),
        setup.folder.describe(),
        setup.context
    );
    match &setup.folder {
        Folder::Gpt2(f) => run_model(args, &setup, device, &|| f.build(device), &save_gpt2),
        Folder::Llama(f) => run_model(args, &setup, device, &|| f.build(device), &save_llama),
    }
}

/// Writes a model back as a folder, with a copy of the tokenizer.
type SaveFn<M> = dyn Fn(&M, &Path, Option<&Path>) -> Result<()>;

/// [`run`] for the model `build` makes (again when budget fitting rebuilds it); `save` writes
/// it back as a folder.
fn run_model<M>(
    args: &Args,
    setup: &Setup,
    device: &Device,
    build_model: &dyn Fn() -> Result<M>,
    save: &SaveFn<M>,
) -> Result<Report>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let mut report = Report::default();
    let mut gpt = build_model()?;
    let mut plan_json = None;
    if let Some(train) = &setup.train {
        let mut config = TrainerConfig::new(args.batch_size, args.accum_steps, args.lr);
        config.precision = setup.precision;
        config.clip_grad_norm = Some(1.0);
        gpt.set_checkpointing(args.checkpoint_activations);
        // The first build hands over the model already loaded; a rebuild (budget fitting)
        // loads the weights again.
        let first = std::cell::RefCell::new(Some(gpt));
        let build = || {
            let model = match first.borrow_mut().take() {
                Some(m) => m,
                None => {
                    let mut m = build_model()?;
                    m.set_checkpointing(args.checkpoint_activations);
                    m
                }
            };
            let groups = decay_groups(model.named_parameters(), 0.0);
            let optimizer = AdamW::with_groups(groups, args.lr)?;
            Trainer::new(model, Box::new(optimizer), config.clone())
        };
        let mut trainer = if setup.fit_auto {
            let (trainer, choice) = Trainer::build_fit_auto(device, train, build)?;
            print!("{choice}");
            trainer
        } else {
            Trainer::build_within_budget(device, train, build)?
        };
        let plan = trainer.plan(train)?;
        if args.plan {
            print!("{plan}");
            if args.json {
                println!("{}", serde_json::json!({"planned_peak_bytes": plan.peak}));
            }
            return Ok(report);
        }
        plan_json = Some(plan.peak);
        report.eval_before = evaluate(&trainer.model, setup)?;
        if let Some(e) = &report.eval_before {
            println!("eval loss before fine-tuning: {:.6} nats/token", e.loss);
        }
        let eff = args.batch_size * args.accum_steps;
        let n = train.len() as u64;
        let mut losses = Vec::new();
        let mut order = (u64::MAX, Vec::new());
        for step in 0..args.steps {
            // Positions step * eff .. of the concatenated seeded epoch orders.
            let idx: Vec<usize> = (0..eff as u64)
                .map(|i| {
                    let pos = step * eff as u64 + i;
                    if order.0 != pos / n {
                        order = (pos / n, train.epoch_order(args.seed, pos / n));
                    }
                    order.1[(pos % n) as usize]
                })
                .collect();
            trainer.step(train, &idx)?;
            if (step + 1) % 10 == 0 || step + 1 == args.steps {
                let loss = trainer.take_loss()?;
                println!("step {}: train loss {loss:.4}", step + 1);
                losses.push(loss);
            }
        }
        report.train_loss = losses.last().copied();
        gpt = trainer.model;
    }
    report.eval = evaluate(&gpt, setup)?;
    if let Some(e) = &report.eval {
        println!(
            "eval loss: {:.6} nats/token over {} tokens in {} windows",
            e.loss, e.tokens, e.windows
        );
    }
    if let Some(prompt) = &setup.prompt {
        let mut sampling = Sampling::new(args.temperature, args.seed);
        sampling.top_k = args.top_k;
        sampling.top_p = args.top_p;
        let ids = gpt.generate_with(prompt, args.max_new_tokens, &sampling)?;
        let text = setup.tokenizer.decode(&ids)?;
        println!("generated:\n{text}");
        report.generated = Some(text);
    }
    if let Some(dir) = &args.save {
        save(&gpt, dir, Some(&setup.folder.dir().join(TOKENIZER_FILE)))?;
        println!("saved {}", dir.display());
    }
    if args.json {
        let j = serde_json::json!({
            "model": args.model.display().to_string(),
            "adapter": device.info().adapter.name,
            "params": gpt.num_parameters(),
            "context": setup.context,
            "steps": args.steps,
            "eval_loss": report.eval.map(|e| e.loss),
            "eval_tokens": report.eval.map(|e| e.tokens),
            "eval_windows": report.eval.map(|e| e.windows),
            "eval_loss_before": report.eval_before.map(|e| e.loss),
            "train_loss": report.train_loss,
            "planned_peak_bytes": plan_json,
            "generated": report.generated,
        });
        println!("{j}");
    }
    Ok(report)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = prepare(&args).and_then(|setup| {
        let device = open_device(&args, &setup)?;
        run(&args, setup, &device)
    });
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
