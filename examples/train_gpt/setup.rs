//! train_gpt's flags and everything they ask for, checked on the host before any device work
//! ([`prepare`]), a resumed checkpoint included, and the device they open.

use clap::Parser;
use fitgrad::checkpoint::Expect;
use fitgrad::distributed::Zero;
use fitgrad::nn::{AttentionKind, GptConfig};
use fitgrad::run::resume::as_saved;
use fitgrad::run::{self, MAX_LAYERS, MAX_SAMPLE_LEN, MAX_STEPS, MAX_WIDTH};
use fitgrad::train::text::{TextCorpus, TextDataset};
use fitgrad::train::Precision;
use fitgrad::{Device, Error, Result};
use std::path::PathBuf;

/// Validation windows of the evaluations during training (the whole validation part at the
/// end): 64 windows of the default context are 2,048 characters.
const EVAL_WINDOWS: usize = 64;
/// The flags.
#[derive(Parser, Debug, Clone)]
#[command(about = "Train a character-level GPT with fitgrad")]
pub struct Args {
    /// A UTF-8 text file (optionally gzipped) to train on instead of the embedded plays; the
    /// vocabulary is its characters.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Attention heads per block (must divide --dim).
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    pub dim: usize,
    /// Characters a prediction sees (the position table's length).
    #[arg(long, default_value_t = 32)]
    pub context: usize,
    /// Windows per batch.
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,
    /// Optimizer steps in all (a resumed run goes on to this many).
    #[arg(long, default_value_t = 400)]
    pub steps: u64,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    /// adamw, or adamw8bit (both moments in 8 bits for tensors of 4096 elements or more).
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "adamw8bit"])]
    pub optimizer: String,
    /// none; optimizer: f32 master weights and AdamW's state in host memory (the device
    /// keeps parameters and gradients; each step reads the gradients back and uploads the
    /// parameters); parameters: that, and each block's parameters in host memory too, on the
    /// device only around the block's forward and backward (at most about two blocks at
    /// once).
    #[arg(long, default_value = "none", value_parser = ["none", "optimizer", "parameters"])]
    pub offload: String,
    /// Cosine decay to 10% with 5% linear warm-up instead of a constant learning rate.
    #[arg(long)]
    pub cosine: bool,
    /// Dropout after the embeddings and on each residual branch, in [0, 1).
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f32,
    /// Clip the gradients' total L2 norm to this before each update (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad_norm: f32,
    /// fused, composed or auto (fused where the adapter runs it).
    #[arg(long, default_value = "auto")]
    pub attention: String,
    /// Evaluate on the first 64 validation windows every this many steps (0: only at the end,
    /// on the whole validation part).
    #[arg(long, default_value_t = 100)]
    pub eval_every: u64,
    /// Characters to generate at the end (0: no sample).
    #[arg(long, default_value_t = 300)]
    pub sample_len: usize,
    /// Sampling temperature (> 0; lower is more conservative).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// --fit auto and --checkpoint-activations.
    #[command(flatten)]
    pub fit: fitgrad::run::FitArgs,
    /// The flags every training command shares.
    #[command(flatten)]
    pub common: fitgrad::run::TrainArgs,
}

/// What a run ends with.
#[derive(Clone, Debug)]
pub struct Report {
    /// Mean training loss of the last steps (nats per character).
    pub train_loss: f32,
    /// Loss on the whole validation part (nats per character).
    pub valid_loss: f32,
    /// The add-one bigram model's validation loss on the same split.
    pub bigram: f64,
    /// Optimizer steps done.
    pub steps: u64,
    /// The generated sample (empty with --sample-len 0).
    pub sample: String,
    /// The device's peak bytes reserved over the whole run, evaluation and sampling
    /// included (`peak_bytes` of the JSON; 0 for `--plan`).
    pub peak_bytes: u64,
    /// The whole run's planned peak reserved.
    pub planned_run_peak: u64,
}

/// Everything the flags ask for, checked on the host.
pub struct Setup {
    pub corpus: TextCorpus,
    pub train: TextDataset,
    pub valid: TextDataset,
    /// The first validation windows, for evaluations during training.
    pub valid_head: TextDataset,
    pub cfg: GptConfig,
    pub precision: Precision,
    /// The ZeRO stage under --distributed mpi.
    pub zero: Zero,
    pub budget: Option<u64>,
    pub fit_auto: bool,
    /// `--offload`: (optimizer offloaded, parameters streamed).
    pub offload: (bool, bool),
    /// What the run trains on, stored in its checkpoints (the vocabulary's and the text's
    /// hashes).
    pub identity: Vec<(String, String)>,
    /// A resume whose checkpoint already holds --steps steps: nothing is trained.
    pub nothing_to_train: bool,
}

/// An [`Error::InvalidArgument`] of this command.
fn invalid(reason: String) -> Error {
    run::invalid(OP, reason)
}

/// This command's name in its errors.
const OP: &str = "train_gpt";

/// Checks every flag and loads the text, before any device work.
pub fn prepare(args: &Args) -> Result<Setup> {
    let precision: Precision = args.run.precision.parse()?;
    let zero = Zero::from_flag(args.job.zero.as_deref())?;
    let budget = run::parse_budget(OP, args.run.memory_budget.as_deref())?;
    // Every count bounded: a mistyped one is refused here, not run for days.
    let n = |v: usize| v as u64;
    run::check_counts(
        OP,
        &[
            ("--layers", n(args.layers), 1, MAX_LAYERS),
            ("--heads", n(args.heads), 1, MAX_LAYERS),
            ("--dim", n(args.dim), 1, MAX_WIDTH),
            ("--context", n(args.context), 1, MAX_WIDTH),
        ],
    )?;
    run::effective_batch(OP, args.batch_size, args.run.accum_steps)?;
    run::check_counts(
        OP,
        &[
            ("--steps", args.steps, 1, MAX_STEPS),
            ("--eval-every", args.eval_every, 0, MAX_STEPS),
            ("--sample-len", n(args.sample_len), 0, MAX_SAMPLE_LEN),
        ],
    )?;
    run::check_environment()?;
    let fit_auto = args.fit.auto(OP, budget, "block checkpointing")?;
    run::check_number(OP, "--lr", args.lr, false)?;
    if !(args.clip_grad_norm.is_finite() && args.clip_grad_norm >= 0.0) {
        return Err(invalid(format!(
            "--clip-grad-norm must be a number >= 0 (0: off), got {}",
            args.clip_grad_norm
        )));
    }
    let offload = run::check_offload(
        OP,
        &args.offload,
        true,
        &[
            ("--optimizer adamw8bit", args.optimizer == "adamw8bit"),
            ("--precision f16", precision == Precision::F16),
            ("--distributed", args.job.distributed.is_some()),
        ],
    )?;
    run::check_number(OP, "--temperature", args.temperature, false)?;
    // No output may overwrite the text, the checkpoint resumed from, or another output
    // (--save may replace --resume: a run continued in place).
    args.common
        .files(run::Files::new())
        .input("--text", args.text.as_deref())
        .check()?;
    let corpus = match &args.text {
        Some(path) => TextCorpus::from_file(path)?,
        None => TextCorpus::shakespeare(),
    };
    let (train, valid) = corpus.datasets(args.context)?;
    let head_len = (EVAL_WINDOWS * args.context + 1).min(corpus.valid.len());
    let valid_head = TextDataset::new(corpus.valid[..head_len].to_vec(), args.context)?
        .with_stride(args.context)?;
    let cfg = model_config(args, &corpus, precision)?;
    let identity = vec![
        ("vocab".to_string(), format!("{:016x}", corpus.vocab.hash())),
        ("text".to_string(), format!("{:016x}", corpus.hash())),
    ];
    let nothing_to_train = match &args.checkpoint.resume {
        Some(path) => check_resume(path, args, &cfg, &identity)?,
        None => false,
    };
    Ok(Setup {
        corpus,
        train,
        valid,
        valid_head,
        cfg,
        precision,
        zero,
        budget,
        fit_auto,
        offload,
        identity,
        nothing_to_train,
    })
}

/// The GPT the flags describe, on `corpus`'s vocabulary, checked by the model's own rules
/// (heads dividing dim, dropout in range, a parameter count that fits).
fn model_config(args: &Args, corpus: &TextCorpus, precision: Precision) -> Result<GptConfig> {
    let attention = match args.attention.as_str() {
        "auto" => AttentionKind::Auto,
        "fused" => AttentionKind::Fused,
        "composed" => AttentionKind::Composed,
        other => {
            return Err(invalid(format!(
                "--attention {other}: use fused, composed or auto"
            )))
        }
    };
    let mut cfg = GptConfig::new(
        corpus.vocab.len(),
        args.context,
        args.layers,
        args.heads,
        args.dim,
    );
    cfg.dropout = args.dropout;
    cfg.checkpoint_blocks = args.fit.checkpoint_activations;
    cfg.dtype = precision.param_dtype();
    cfg.seed = args.run.seed;
    cfg.attention = attention;
    cfg.validate()?;
    Ok(cfg)
}

/// The checkpoint at `path` holds a model of `cfg`'s shape, trained on this text, with no
/// more than `steps` steps, and finite (read on the host, before any device work), or the
/// error says which flag to change. `Ok(true)`: it holds `steps` steps already.
fn check_resume(
    path: &std::path::Path,
    args: &Args,
    cfg: &GptConfig,
    identity: &[(String, String)],
) -> Result<bool> {
    let config = [
        Expect::new(
            "kind",
            "gpt",
            "resume a GPT checkpoint written by train_gpt",
        ),
        Expect::new(
            "vocab_size",
            cfg.vocab_size,
            "resume with the --text it was trained on",
        ),
        Expect::new("context", cfg.context, as_saved("--context")),
        Expect::new("layers", cfg.layers, as_saved("--layers")),
        Expect::new("heads", cfg.heads, as_saved("--heads")),
        Expect::new("dim", cfg.dim, as_saved("--dim")),
        Expect::new("dropout", cfg.dropout, as_saved("--dropout")),
        Expect::new(
            "checkpoint_blocks",
            cfg.checkpoint_blocks,
            as_saved("--checkpoint-activations (or --fit auto's budget)"),
        ),
        Expect::new("attention", &args.attention, as_saved("--attention")),
        Expect::new("dtype", cfg.dtype, as_saved("--precision")),
        Expect::new("seed", cfg.seed, as_saved("--seed")),
    ];
    let same_text = |what: &str| {
        format!(
            "{what}: resume with the --text it was trained on, or start a new run without --resume"
        )
    };
    let data = [
        Expect::new(
            "data.vocab",
            &identity[0].1,
            same_text("another vocabulary (the same size, other characters)"),
        ),
        Expect::new("data.text", &identity[1].1, same_text("another text")),
    ];
    run::check_checkpoint(OP, path, &config, &data, run::Until::Steps(args.steps))
}

/// Opens the device the flags ask for.
pub fn open_device(args: &Args, setup: &Setup) -> Result<Device> {
    run::open_device(args.run.adapter.as_deref(), setup.budget)
}

/// The shared flags read as the command's own (`args.run.plan`, `args.checkpoint.save`).
impl std::ops::Deref for Args {
    type Target = fitgrad::run::TrainArgs;

    fn deref(&self) -> &fitgrad::run::TrainArgs {
        &self.common
    }
}
