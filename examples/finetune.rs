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
//! LoRA (GPT-2 folders): `--lora-rank R` (with `--lora-alpha`, `--lora-dropout`,
//! `--lora-targets c_attn,...`) freezes the model and trains adapters in PEFT's layout only;
//! `--quantize int8|nf4` keeps the frozen base quantized on the device (QLoRA);
//! `--resume-adapter DIR` starts from a PEFT adapter folder, `--save-adapter DIR` writes one,
//! `--merge-into DIR` writes the model with the adapter merged. With `--fit auto` the budget
//! also chooses among the dense, int8 and NF4 bases.
//!
//! tests/hf.rs includes this file as a module and calls [`prepare`] and [`run`].

use clap::Parser;
use fitgrad::compress::{quantize_gpt_base, BaseQuant};
use fitgrad::hf::{save_gpt2, save_llama, PretrainedGpt, PretrainedLlama, Tokenizer};
use fitgrad::hf::{Adapter, LoraSpec, ModelConfig, TOKENIZER_FILE};
use fitgrad::nn::{trainable_parameters, Gpt, LanguageModel, Llama, LoraConfig, Module, Sampling};
use fitgrad::optim::{decay_groups, AdamW, Optimizer, Sgd};
use fitgrad::train::text::{TextDataset, TokenBatch};
use fitgrad::train::WindowLoss;
use fitgrad::train::{
    window_loss, BatchSource, Plan, Precision, TrainModel, Trainer, TrainerConfig,
};
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
    /// model.safetensors.index.json and its shards), tokenizer.json. Needed unless --config.
    #[arg(long, required_unless_present = "config")]
    pub model: Option<PathBuf>,
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
    /// Build the model from a config alone, with random weights and no tokenizer (the steps
    /// train on seeded random token ids): a config.json, a folder holding one, or a shipped
    /// name (gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-3-8b, tinyllama-1.1b). With --plan
    /// nothing is allocated: any size is planned on any adapter, under any --memory-budget.
    #[arg(long, conflicts_with_all = ["model", "eval_text", "text", "generate", "save"])]
    pub config: Option<String>,
    /// adamw, or sgd (plain SGD: no optimizer state).
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "sgd"])]
    pub optimizer: String,
    /// End stdout with one JSON object describing the run.
    #[arg(long)]
    pub json: bool,
    /// Train LoRA adapters of this rank instead of the whole model (the base is frozen).
    #[arg(long)]
    pub lora_rank: Option<usize>,
    /// LoRA's alpha: the update is scaled by alpha / rank (PEFT's default 8).
    #[arg(long)]
    pub lora_alpha: Option<f32>,
    /// Dropout on the adapters' input, in [0, 1).
    #[arg(long)]
    pub lora_dropout: Option<f32>,
    /// Comma-separated module names to adapt (c_attn, c_proj, c_fc; attn.c_proj, ...).
    #[arg(long)]
    pub lora_targets: Option<String>,
    /// How the frozen base is held under LoRA: none, int8, nf4 (double-quantized) or
    /// nf4-single.
    #[arg(long, default_value = "none")]
    pub quantize: String,
    /// Write the adapters (after fine-tuning) to this folder in PEFT's format.
    #[arg(long)]
    pub save_adapter: Option<PathBuf>,
    /// Start from the PEFT adapter in this folder (its rank, alpha and targets).
    #[arg(long)]
    pub resume_adapter: Option<PathBuf>,
    /// Write the model with the adapters merged into its weights to this folder.
    #[arg(long)]
    pub merge_into: Option<PathBuf>,
}

impl Args {
    /// The `--model` folder (empty under `--config`, which builds no folder).
    pub fn model_dir(&self) -> &Path {
        self.model.as_deref().unwrap_or(Path::new(""))
    }
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
    /// A quantized frozen base's device bytes and parameters.
    pub base: Option<(u64, usize)>,
    /// What `--fit auto` chose, as printed: every candidate with its planned peak.
    pub fit_choice: Option<String>,
    /// The planned step of the fine-tuning run.
    pub plan: Option<fitgrad::train::Plan>,
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
            Folder::Gpt2(f) => ModelConfig::Gpt2(f.config.clone()).describe(),
            Folder::Llama(f) => ModelConfig::Llama(f.config.clone()).describe(),
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
    lora: Option<LoraSetup>,
}

/// The LoRA flags, checked.
pub struct LoraSetup {
    spec: LoraSpec,
    resume: Option<Adapter>,
    quant: BaseQuant,
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

/// The training flags every mode shares, checked.
struct Flags {
    precision: Precision,
    budget: Option<u64>,
    fit_auto: bool,
}

/// Checks the flags that need no file.
fn check_flags(args: &Args) -> Result<Flags> {
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
    Ok(Flags {
        precision,
        budget,
        fit_auto,
    })
}

/// Checks every flag, reads the folder, the tokenizer and the texts, before any device work.
pub fn prepare(args: &Args) -> Result<Setup> {
    let Flags {
        precision,
        budget,
        fit_auto,
    } = check_flags(args)?;
    if (args.steps > 0 || args.plan) && args.text.is_none() {
        return Err(invalid(
            "--steps and --plan fine-tune on a text: add --text FILE".into(),
        ));
    }
    let folder = Folder::open(args.model_dir(), precision.param_dtype())?;
    if args.checkpoint_activations && matches!(folder, Folder::Llama(_)) {
        return Err(invalid(
            "--checkpoint-activations: a Llama's blocks are not checkpointed (yet)".into(),
        ));
    }
    let lora = prepare_lora(args, &folder, precision)?;
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
            path: args.model_dir().join(TOKENIZER_FILE).display().to_string(),
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
        lora,
    })
}

/// Checks the LoRA flags against the folder's model, on the host.
fn prepare_lora(args: &Args, folder: &Folder, precision: Precision) -> Result<Option<LoraSetup>> {
    let quant: BaseQuant = args.quantize.parse()?;
    let on = args.lora_rank.is_some() || args.resume_adapter.is_some();
    if !on {
        let given = [
            ("--lora-alpha", args.lora_alpha.is_some()),
            ("--lora-dropout", args.lora_dropout.is_some()),
            ("--lora-targets", args.lora_targets.is_some()),
            ("--quantize", quant != BaseQuant::None),
            ("--save-adapter", args.save_adapter.is_some()),
            ("--merge-into", args.merge_into.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
            return Err(invalid(format!(
                "{flag} is a LoRA setting: add --lora-rank R or --resume-adapter DIR"
            )));
        }
        return Ok(None);
    }
    let Folder::Gpt2(folder) = folder else {
        return Err(invalid(
            "--lora-rank / --resume-adapter: LoRA adapts GPT-2 folders (a Llama's is not wired yet)"
                .into(),
        ));
    };
    if quant != BaseQuant::None && precision == Precision::F16 {
        return Err(invalid(format!(
            "--quantize {quant} quantizes f32 weights: use --precision f32 or mixed"
        )));
    }
    if args.save.is_some() {
        return Err(invalid(
            "--save writes the base without its adapters: use --merge-into DIR (merged) or \
             --save-adapter DIR (the adapters alone)"
                .into(),
        ));
    }
    for (flag, dir) in [
        ("--save-adapter", &args.save_adapter),
        ("--merge-into", &args.merge_into),
    ] {
        let Some(dir) = dir else { continue };
        let same = |a: &std::path::Path, b: &std::path::Path| {
            a.canonicalize()
                .ok()
                .is_some_and(|x| Some(x) == b.canonicalize().ok())
        };
        if same(dir, args.model_dir())
            || args.resume_adapter.as_deref().is_some_and(|r| same(dir, r))
        {
            return Err(invalid(format!(
                "{flag} {} would overwrite an input folder",
                dir.display()
            )));
        }
    }
    let (spec, resume) = match &args.resume_adapter {
        Some(dir) => {
            let a = fitgrad::hf::read_adapter(dir, &folder.config)?;
            let differs = [
                (
                    "--lora-rank",
                    args.lora_rank.is_some_and(|r| r != a.spec.config.r),
                ),
                (
                    "--lora-alpha",
                    args.lora_alpha.is_some_and(|v| v != a.spec.config.alpha),
                ),
                ("--lora-targets", args.lora_targets.is_some()),
            ];
            if let Some((flag, _)) = differs.iter().find(|(_, d)| *d) {
                return Err(invalid(format!(
                    "{flag} differs from the adapter in {} (r = {}, alpha = {}, targets {:?});                      drop the flag",
                    dir.display(),
                    a.spec.config.r,
                    a.spec.config.alpha,
                    a.spec.targets
                )));
            }
            let mut spec = a.spec.clone();
            if let Some(p) = args.lora_dropout {
                spec.config.dropout = p;
            }
            (spec, Some(a))
        }
        None => {
            let targets = args
                .lora_targets
                .as_deref()
                .unwrap_or("c_attn")
                .split(',')
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
                .collect();
            let spec = LoraSpec {
                config: LoraConfig {
                    r: args.lora_rank.expect("LoRA is on"),
                    alpha: args.lora_alpha.unwrap_or(8.0),
                    dropout: args.lora_dropout.unwrap_or(0.0),
                },
                targets,
            };
            (spec, None)
        }
    };
    // Every target and the rank, against the model's widths.
    fitgrad::hf::resolve_targets(&folder.config, &spec)?;
    Ok(Some(LoraSetup {
        spec,
        resume,
        quant,
    }))
}

/// The folder's model on `device`, with the adapters and the base `quant` the flags ask for;
/// the base's device bytes and parameters when quantized.
fn build_gpt(
    args: &Args,
    setup: &Setup,
    folder: &PretrainedGpt,
    device: &Device,
    quant: BaseQuant,
) -> Result<(Gpt, Option<(u64, usize)>)> {
    let mut gpt = folder.build(device)?;
    let Some(lora) = &setup.lora else {
        return Ok((gpt, None));
    };
    match &lora.resume {
        Some(a) => a.apply(&mut gpt, args.seed)?,
        None => {
            fitgrad::hf::add_lora(&mut gpt, &lora.spec, args.seed)?;
        }
    }
    let base = quantize_gpt_base(&mut gpt, quant)?;
    Ok((gpt, (quant != BaseQuant::None).then_some(base)))
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
        args.model_dir().display(),
        setup.folder.describe(),
        setup.context
    );
    let setup = &setup;
    match &setup.folder {
        Folder::Gpt2(f) => run_model(
            args,
            setup,
            device,
            &|q| build_gpt(args, setup, f, device, q),
            &save_gpt2,
            &|gpt| save_lora(args, setup, f, gpt),
        ),
        Folder::Llama(f) => run_model(
            args,
            setup,
            device,
            &|_| Ok((f.build(device)?, None)),
            &save_llama,
            &|_| Ok(()),
        ),
    }
}

/// Writes the adapters of a LoRA run as the flags ask: `--save-adapter`, `--merge-into`.
fn save_lora(args: &Args, setup: &Setup, folder: &PretrainedGpt, gpt: &Gpt) -> Result<()> {
    let Some(lora) = &setup.lora else {
        return Ok(());
    };
    if let Some(dir) = &args.save_adapter {
        fitgrad::hf::save_adapter(
            gpt,
            &lora.spec,
            dir,
            &args.model_dir().display().to_string(),
        )?;
        println!("saved adapter {}", dir.display());
    }
    if let Some(dir) = &args.merge_into {
        let adapter = fitgrad::hf::adapter_of(gpt, &lora.spec)?;
        fitgrad::hf::merge_adapter(folder, &adapter, dir)?;
        println!("merged into {}", dir.display());
    }
    Ok(())
}

/// A model built for a run and, when its frozen base is quantized, the base's device bytes
/// and parameters.
type Built<M> = (M, Option<(u64, usize)>);

/// Builds the model with its frozen base held as asked.
type BuildFn<'a, M> = dyn Fn(BaseQuant) -> Result<Built<M>> + 'a;

/// Writes a model back as a folder, with a copy of the tokenizer.
type SaveFn<M> = dyn Fn(&M, &Path, Option<&Path>) -> Result<()>;

/// [`run`] for the model `build_model` makes (again when budget fitting rebuilds it); `save`
/// writes it back as a folder, `after` writes what else the trained model gives (adapters).
fn run_model<M>(
    args: &Args,
    setup: &Setup,
    device: &Device,
    build_model: &BuildFn<'_, M>,
    save: &SaveFn<M>,
    after: &dyn Fn(&M) -> Result<()>,
) -> Result<Report>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let mut report = Report::default();
    let quant = setup.lora.as_ref().map_or(BaseQuant::None, |l| l.quant);
    // Under --fit auto the budget is the ladder's to apply: the model loads without it, so a
    // budget it alone passes ends in fit auto's smallest workable budget, not a failed load.
    let budget = device.memory_stats().budget;
    if setup.fit_auto && setup.train.is_some() {
        device.set_memory_budget(None)?;
    }
    let built = build_model(quant);
    device.set_memory_budget(budget)?;
    let (mut gpt, mut base) = built?;
    let mut plan_json = None;
    if let Some(train) = &setup.train {
        let mut config = TrainerConfig::new(args.batch_size, args.accum_steps, args.lr);
        config.precision = setup.precision;
        config.clip_grad_norm = Some(1.0);
        gpt.set_checkpointing(args.checkpoint_activations);
        // The first build hands over the model already loaded; a rebuild (budget fitting)
        // loads the weights again.
        let first = std::cell::RefCell::new(Some((gpt, quant)));
        let built_base = std::cell::Cell::new(base);
        let build_with = |q: &BaseQuant| {
            let model = match first.borrow_mut().take() {
                Some((m, mq)) if mq == *q => m,
                _ => {
                    let (mut m, b) = build_model(*q)?;
                    built_base.set(b);
                    m.set_checkpointing(args.checkpoint_activations);
                    m
                }
            };
            let optimizer = optimizer_for(args, &model)?;
            Trainer::new(model, optimizer, config.clone())
        };
        let build = || build_with(&quant);
        let mut fit_choice = None;
        let mut trainer = if setup.fit_auto && setup.lora.is_some() && quant == BaseQuant::None {
            // The budget also chooses the base: dense, then int8, then NF4.
            let bases = [
                BaseQuant::None,
                BaseQuant::Int8,
                BaseQuant::Nf4 { double_quant: true },
            ];
            let (trainer, choice) =
                Trainer::build_fit_auto_variants(device, train, &bases, build_with)?;
            print!("{choice}");
            fit_choice = Some(choice.to_string());
            trainer
        } else if setup.fit_auto {
            let (trainer, choice) = Trainer::build_fit_auto(device, train, build)?;
            print!("{choice}");
            fit_choice = Some(choice.to_string());
            trainer
        } else {
            let mut trainer = Trainer::build_within_budget(device, train, build)?;
            trainer.check_device_memory(train)?;
            trainer
        };
        report.fit_choice = fit_choice;
        let plan = trainer.plan(train)?;
        report.plan = Some(plan.clone());
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
        report.train_loss = train_steps(args, &mut trainer, train)?;
        gpt = trainer.model;
        base = built_base.get();
    }
    if let Some((bytes, params)) = base {
        println!(
            "frozen base: {quant} in {bytes} bytes, {:.4} bytes per parameter ({:.4}x of f32)",
            bytes as f64 / params as f64,
            bytes as f64 / (4.0 * params as f64)
        );
    }
    report.base = base;
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
    after(&gpt)?;
    if let Some(dir) = &args.save {
        save(&gpt, dir, Some(&setup.folder.dir().join(TOKENIZER_FILE)))?;
        println!("saved {}", dir.display());
    }
    if args.json {
        let j = serde_json::json!({
            "model": args.model_dir().display().to_string(),
            "adapter": device.info().adapter.name,
            "params": gpt.num_parameters(),
            "trainable_params": trainable_parameters(&gpt).iter().map(|(_, t)| t.numel()).sum::<usize>(),
            "quantize": quant.to_string(),
            "base_bytes": base.map(|b| b.0),
            "base_bytes_per_param": base.map(|(b, p)| b as f64 / p as f64),
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

/// `--optimizer` over the parameters that train (under LoRA the adapters only: the base has
/// no gradients and no state): AdamW without weight decay, or SGD.
fn optimizer_for<M: Module>(args: &Args, model: &M) -> Result<Box<dyn Optimizer>> {
    let groups = decay_groups(trainable_parameters(model), 0.0);
    Ok(if args.optimizer == "sgd" {
        let params = groups.into_iter().flat_map(|g| g.params).collect();
        Box::new(Sgd::new(params, args.lr)?)
    } else {
        Box::new(AdamW::with_groups(groups, args.lr)?)
    })
}

/// The trainer of a fine-tuning run: `first` is the model already built, `build_model`
/// builds it again where budget fitting tries several. AdamW without weight decay (or SGD),
/// gradients clipped to norm 1; `--fit auto` prints its choice.
fn make_trainer<M>(
    args: &Args,
    precision: Precision,
    fit_auto: bool,
    device: &Device,
    train: &TextDataset,
    mut first: M,
    build_model: &dyn Fn() -> Result<M>,
) -> Result<Trainer<M>>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let mut config = TrainerConfig::new(args.batch_size, args.accum_steps, args.lr);
    config.precision = precision;
    config.clip_grad_norm = Some(1.0);
    first.set_checkpointing(args.checkpoint_activations);
    let first = std::cell::RefCell::new(Some(first));
    let build = || {
        let model = match first.borrow_mut().take() {
            Some(m) => m,
            None => {
                let mut m = build_model()?;
                m.set_checkpointing(args.checkpoint_activations);
                m
            }
        };
        let optimizer = optimizer_for(args, &model)?;
        Trainer::new(model, optimizer, config.clone())
    };
    if fit_auto {
        let (trainer, choice) = Trainer::build_fit_auto(device, train, build)?;
        print!("{choice}");
        return Ok(trainer);
    }
    let mut trainer = Trainer::build_within_budget(device, train, build)?;
    trainer.check_device_memory(train)?;
    Ok(trainer)
}

/// Runs `--steps` optimizer steps over the seeded epoch orders of `train`, printing the loss
/// every 10; returns the last printed loss.
fn train_steps<M>(args: &Args, trainer: &mut Trainer<M>, train: &TextDataset) -> Result<Option<f32>>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let eff = args.batch_size * args.accum_steps;
    let n = train.len() as u64;
    let mut last = None;
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
            last = Some(loss);
        }
    }
    Ok(last)
}

/// What a `--config` run reports.
#[derive(Clone, Debug, Default)]
pub struct ConfigReport {
    /// The step's plan.
    pub plan: Plan,
    /// The measured peak in use over the steps (none with --plan).
    pub measured_peak: Option<u64>,
    /// The last training loss (none with --plan).
    pub train_loss: Option<f32>,
}

/// `--config`: the architecture built with random weights; with `--plan` on a device that only
/// plans (nothing allocated), else trained `--steps` steps on seeded random token ids.
pub fn run_config(args: &Args) -> Result<ConfigReport> {
    let name = args
        .config
        .as_deref()
        .ok_or_else(|| invalid("run_config needs --config".into()))?;
    let flags = check_flags(args)?;
    let model = ModelConfig::open(name)?.with(flags.precision.param_dtype(), args.seed);
    let (positions, field) = model.positions();
    let context = args.context.unwrap_or(positions);
    if context == 0 || context > positions {
        return Err(invalid(format!(
            "--context {context}: between 1 and the model's {field} = {positions}"
        )));
    }
    if !args.plan && args.steps == 0 {
        return Err(invalid(
            "--config builds a model with random weights: add --plan, or --steps N".into(),
        ));
    }
    if args.checkpoint_activations && matches!(model, ModelConfig::Llama(_)) {
        return Err(invalid(
            "--checkpoint-activations: a Llama's blocks are not checkpointed (yet)".into(),
        ));
    }
    // Windows enough for one effective batch, of seeded random ids.
    let windows = args.batch_size * args.accum_steps;
    let mut rng = fitgrad::tensor::Rng::new(args.seed);
    let vocab = model.vocab_size() as u64;
    let ids = (0..windows + context)
        .map(|_| (rng.next_u64() % vocab) as u32)
        .collect();
    let train = TextDataset::new(ids, context)?;
    let mut options = DeviceOptions::default().plan_only(args.plan);
    options.adapter = args.adapter.clone();
    options.memory_budget = flags.budget;
    let device = Device::with_options(options)?;
    println!(
        "adapter: {}{}",
        device.info().adapter,
        if args.plan { " (planning only)" } else { "" }
    );
    println!(
        "model: {name} ({}), {} parameters, context {context}, random weights",
        model.describe(),
        model.num_parameters()
    );
    match &model {
        ModelConfig::Gpt2(c) => {
            let build = || Gpt::new(&device, c.clone());
            config_steps(args, &flags, &device, &train, build()?, &build)
        }
        ModelConfig::Llama(c) => {
            let build = || Llama::new(&device, c.clone());
            config_steps(args, &flags, &device, &train, build()?, &build)
        }
    }
}

/// [`run_config`] once the model is built.
fn config_steps<M>(
    args: &Args,
    flags: &Flags,
    device: &Device,
    train: &TextDataset,
    first: M,
    build_model: &dyn Fn() -> Result<M>,
) -> Result<ConfigReport>
where
    M: LanguageModel + TrainModel<TokenBatch>,
{
    let mut trainer = make_trainer(
        args,
        flags.precision,
        flags.fit_auto,
        device,
        train,
        first,
        build_model,
    )?;
    let mut report = ConfigReport {
        plan: trainer.plan(train)?,
        ..Default::default()
    };
    print!("{}", report.plan);
    if !args.plan {
        report.train_loss = train_steps(args, &mut trainer, train)?;
        let measured = device.memory_stats().peak_bytes_in_use;
        println!(
            "planned peak in use {} / measured {} ({:+.2}%)",
            Bytes(report.plan.peak),
            Bytes(measured),
            (measured as f64 / report.plan.peak as f64 - 1.0) * 100.0
        );
        report.measured_peak = Some(measured);
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "params": trainer.model.num_parameters(),
                "planned_peak_bytes": report.plan.peak,
                "plan": report.plan,
                "measured_peak_bytes": report.measured_peak,
                "train_loss": report.train_loss,
            })
        );
    }
    Ok(report)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match &args.config {
        Some(_) => run_config(&args).map(|_| ()),
        None => prepare(&args).and_then(|setup| {
            let device = open_device(&args, &setup)?;
            run(&args, setup, &device).map(|_| ())
        }),
    };
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
