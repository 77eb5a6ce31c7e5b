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
//! LoRA (GPT-2 and Llama folders): `--lora-rank R` (with `--lora-alpha`, `--lora-dropout`,
//! `--lora-targets c_attn,...`; PEFT's default targets when none are given) freezes the model and trains adapters in PEFT's layout only;
//! `--quantize int8|nf4` keeps the frozen base quantized on the device (QLoRA);
//! `--resume-adapter DIR` starts from a PEFT adapter folder, `--save-adapter DIR` writes one,
//! `--merge-into DIR` writes the model with the adapter merged. With `--fit auto` the budget
//! also chooses among the dense, int8 and NF4 bases.
//!
//! tests/it/hf.rs and tests/it/lora_finetune.rs include this file as a module and call [`prepare`],
//! [`run`] and [`run_config`]. The flags are in this file; [`setup`] reads and checks them on the
//! host, [`run`] evaluates and fine-tunes a folder, [`config`] plans or trains a model built
//! from a config alone.

mod config;
mod run;
mod setup;

// What tests/it/hf.rs and tests/it/lora_finetune.rs call (each uses some).
#[allow(unused_imports)]
pub use config::{run_config, ConfigReport};
#[allow(unused_imports)]
pub use run::{open_device, run, Report};
pub use setup::prepare;

use clap::Parser;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The flags.
#[derive(Parser, Debug, Clone)]
#[command(
    about = "Evaluate, fine-tune and sample a Hugging Face GPT-2 or Llama folder with fitgrad",
    // A flag given twice takes its last value (so [`Args::default_run`] takes overrides).
    args_override_self = true
)]
pub struct Args {
    /// The adapter, the budget, the plan, the JSON line, the accumulation.
    #[command(flatten)]
    pub run: fitgrad::run::RunArgs,
    /// --fit auto and --checkpoint-activations.
    #[command(flatten)]
    pub fit: fitgrad::run::FitArgs,
    /// A Hugging Face GPT-2 or Llama folder: config.json, model.safetensors (or
    /// model.safetensors.index.json and its shards), tokenizer.json. Without it: the small
    /// model shipped in the crate (models/shakespeare-gpt2), and with no --text and no
    /// --eval-text the eighth play's parts.
    #[arg(long)]
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
    /// Evaluate --eval-text every this many steps while fine-tuning (0: before and after only).
    #[arg(long, default_value_t = 0)]
    pub eval_every: u64,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-4)]
    pub lr: f32,
    /// Windows per batch.
    #[arg(long, default_value_t = 4)]
    pub batch_size: usize,
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
    /// Write the model (after fine-tuning) to this folder as transformers reads it.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Build the model from a config alone, with random weights and no tokenizer (the steps
    /// train on seeded random token ids): a config.json, a folder holding one, or a shipped
    /// name (gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-3-8b, tinyllama-1.1b). With --plan
    /// nothing is allocated: any size is planned on any adapter, under any --memory-budget.
    #[arg(long, conflicts_with_all = ["model", "eval_text", "text", "generate", "save"])]
    pub config: Option<String>,
    /// adamw, or sgd (plain SGD: no optimizer state).
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "sgd"])]
    pub optimizer: String,
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

/// The small GPT-2 folder shipped in the crate (made by examples/make_shipped_model.rs).
pub const SHIPPED_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/shakespeare-gpt2");

/// The flags a run with none stands for: LoRA on the shipped model, on the eighth play,
/// evaluated on its held-out end before, during and after.
pub const DEFAULT_RUN: &[&str] = &[
    "--lora-rank",
    "8",
    "--lora-targets",
    "c_attn,c_fc",
    "--steps",
    "60",
    "--lr",
    "3e-3",
    "--context",
    "64",
    "--batch-size",
    "8",
    "--eval-every",
    "20",
];

impl Args {
    /// The `--model` folder, or the shipped one.
    pub fn model_dir(&self) -> &Path {
        Path::new(self.model.as_deref().unwrap_or(Path::new(SHIPPED_MODEL)))
    }

    /// The flags of [`DEFAULT_RUN`] and then `extra`.
    pub fn default_run(extra: &[&str]) -> Args {
        let all = std::iter::once("finetune")
            .chain(DEFAULT_RUN.iter().copied())
            .chain(extra.iter().copied());
        Args::parse_from(all)
    }

    /// Whether no flag was given.
    fn is_bare(&self) -> bool {
        format!("{self:?}") == format!("{:?}", Args::parse_from(["finetune"]))
    }
}

fn main() -> ExitCode {
    // Flag errors exit with 1 and clap's message (a negative number names its flag).
    let mut args = match fitgrad::run::parse::<Args>() {
        Ok(a) => a,
        Err(code) => return code,
    };
    if args.is_bare() {
        println!("no flags: finetune {}", DEFAULT_RUN.join(" "));
        args = Args::default_run(&[]);
    }
    let result = match &args.config {
        Some(_) => run_config(&args).map(|_| ()),
        None => prepare(&args).and_then(|setup| {
            let device = open_device(&args, &setup)?;
            run(&args, setup, &device).map(|_| ())
        }),
    };
    // A divergence's remedy in this command's flags (it clips gradients at norm 1 already).
    let result = result.map_err(|e| fitgrad::run::own_remedy(e, "lower the learning rate (--lr)"));
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
