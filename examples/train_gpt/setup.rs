//! train_gpt's flags and everything they ask for, checked on the host before any device work
//! ([`prepare`]), a resumed checkpoint included, and the device they open.

use clap::Parser;
use fitgrad::checkpoint::Expect;
use fitgrad::cli::{self, MAX_BATCH, MAX_LAYERS, MAX_SAMPLE_LEN, MAX_STEPS, MAX_WIDTH};
use fitgrad::distributed::Zero;
use fitgrad::nn::{AttentionKind, GptConfig};
use fitgrad::train::text::{TextCorpus, TextDataset};
use fitgrad::train::Precision;
use fitgrad::{Bytes, Device, DeviceOptions, Error, Result};
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
    /// Batches whose gradients add up before each optimizer step.
    #[arg(long, default_value_t = 1)]
    pub accum_steps: usize,
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
    /// f32, f16, or mixed (f32 master weights and optimizer state, f16 activations and
    /// matmuls, dynamic loss scaling).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Hard limit on device memory (e.g. 64MiB). The micro-batch is chosen to fit, with
    /// gradient accumulation keeping the effective batch.
    #[arg(long)]
    pub memory_budget: Option<String>,
    /// `auto`: let --memory-budget choose the micro-batch, block checkpointing and mixed
    /// precision (cheapest first), and print each planned candidate.
    #[arg(long)]
    pub fit: Option<String>,
    /// Recompute each block's attention and MLP halves in backward instead of keeping their
    /// activations.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// fused, composed or auto (fused where the adapter runs it).
    #[arg(long, default_value = "auto")]
    pub attention: String,
    /// Print the planned peak memory of a training step, by category, and exit.
    #[arg(long)]
    pub plan: bool,
    /// Reserve the planned peak before training, so no buffer is created afterwards.
    #[arg(long)]
    pub prealloc: bool,
    /// Save a checkpoint (safetensors, written atomically) at every evaluation and at the end.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Resume from a checkpoint written by --save (same model and training flags), or from a
    /// sharded checkpoint's folder (train_mlp's --save-sharded), on any number of ranks.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Seed of the weights, the window order, dropout and the sample.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Substring of the adapter name to use.
    #[arg(long)]
    pub adapter: Option<String>,
    /// End stdout with one JSON object describing the run.
    #[arg(long)]
    pub json: bool,
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
    /// Write an HTML report (memory timeline of a step, loss curves, throughput, memory
    /// table) to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Write the report's data as JSON to this file.
    #[arg(long)]
    pub report_json: Option<PathBuf>,
    /// `mpi`: this process is one rank of data-parallel training started by mpirun (built with
    /// `--features mpi`). The batch flags give the whole job's batch, split across the ranks;
    /// rank 0 prints, evaluates, samples and saves. At --dropout 0 (the default) the weights
    /// are those of one process with the same flags.
    #[arg(long)]
    pub distributed: Option<String>,
    /// ZeRO stage under --distributed mpi: 0 replicates everything (plain data parallelism),
    /// 1 keeps each rank's shard of the optimizer state only, 2 also its shard of the summed
    /// gradients, 3 also its shard of each block's parameters (gathered around its forward and
    /// backward); the weights are those of stage 0. One process holds every shard, so the stage
    /// changes nothing there.
    #[arg(long)]
    pub zero: Option<String>,
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
    Error::InvalidArgument {
        op: "train_gpt",
        reason,
    }
}

/// Checks every flag and loads the text, before any device work.
pub fn prepare(args: &Args) -> Result<Setup> {
    let precision: Precision = args.precision.parse()?;
    let zero = Zero::from_flag(args.zero.as_deref())?;
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
    let budget = args
        .memory_budget
        .as_deref()
        .map(|b| b.parse::<Bytes>().map(|b| b.0))
        .transpose()?;
    // Every count bounded: a mistyped one is refused here, not run for days.
    let n = |v: usize| v as u64;
    cli::check_counts(
        "train_gpt",
        &[
            ("--layers", n(args.layers), 1, MAX_LAYERS),
            ("--heads", n(args.heads), 1, MAX_LAYERS),
            ("--dim", n(args.dim), 1, MAX_WIDTH),
            ("--context", n(args.context), 1, MAX_WIDTH),
            ("--batch-size", n(args.batch_size), 1, MAX_BATCH),
            ("--accum-steps", n(args.accum_steps), 1, MAX_BATCH),
            ("--steps", args.steps, 1, MAX_STEPS),
            ("--eval-every", args.eval_every, 0, MAX_STEPS),
            ("--sample-len", n(args.sample_len), 0, MAX_SAMPLE_LEN),
        ],
    )?;
    cli::check_environment()?;
    args.batch_size
        .checked_mul(args.accum_steps)
        .ok_or_else(|| invalid("--batch-size x --accum-steps overflows".into()))?;
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
        Some("auto") if args.checkpoint_activations => {
            return Err(invalid(
                "--fit auto chooses block checkpointing itself: drop --checkpoint-activations"
                    .into(),
            ))
        }
        Some("auto") => true,
        Some(other) => return Err(invalid(format!("--fit {other}: the one mode is 'auto'"))),
    };
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(invalid(format!(
            "--lr must be a number > 0, got {}",
            args.lr
        )));
    }
    if !(args.clip_grad_norm.is_finite() && args.clip_grad_norm >= 0.0) {
        return Err(invalid(format!(
            "--clip-grad-norm must be a number >= 0 (0: off), got {}",
            args.clip_grad_norm
        )));
    }
    let offload = cli::check_offload(
        "train_gpt",
        &args.offload,
        true,
        &[
            ("--optimizer adamw8bit", args.optimizer == "adamw8bit"),
            ("--precision f16", precision == Precision::F16),
            ("--distributed", args.distributed.is_some()),
        ],
    )?;
    if !(args.temperature.is_finite() && args.temperature > 0.0) {
        return Err(invalid(format!(
            "--temperature must be a number > 0, got {}",
            args.temperature
        )));
    }
    // No output may overwrite the text, the checkpoint resumed from, or another output
    // (--save may replace --resume: a run continued in place).
    let inputs: Vec<(&'static str, &std::path::Path)> =
        [("--text", &args.text), ("--resume", &args.resume)]
            .into_iter()
            .filter_map(|(f, p)| Some((f, p.as_deref()?)))
            .collect();
    let outputs: Vec<(&'static str, &std::path::Path)> = [
        ("--save", &args.save),
        ("--report", &args.report),
        ("--report-json", &args.report_json),
    ]
    .into_iter()
    .filter_map(|(f, p)| Some((f, p.as_deref()?)))
    .collect();
    cli::check_paths(&inputs, &outputs, &[("--save", "--resume")])?;
    let corpus = match &args.text {
        Some(path) => TextCorpus::from_file(path)?,
        None => TextCorpus::shakespeare(),
    };
    let (train, valid) = corpus.datasets(args.context)?;
    let head_len = (EVAL_WINDOWS * args.context + 1).min(corpus.valid.len());
    let valid_head = TextDataset::new(corpus.valid[..head_len].to_vec(), args.context)?
        .with_stride(args.context)?;
    let mut cfg = GptConfig::new(
        corpus.vocab.len(),
        args.context,
        args.layers,
        args.heads,
        args.dim,
    );
    cfg.dropout = args.dropout;
    cfg.checkpoint_blocks = args.checkpoint_activations;
    cfg.dtype = precision.param_dtype();
    cfg.seed = args.seed;
    cfg.attention = attention;
    // Heads dividing dim, dropout in range, a parameter count that fits: the model's own checks.
    cfg.validate()?;
    let identity = vec![
        ("vocab".to_string(), format!("{:016x}", corpus.vocab.hash())),
        ("text".to_string(), format!("{:016x}", corpus.hash())),
    ];
    let nothing_to_train = match &args.resume {
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

/// The checkpoint at `path` holds a model of `cfg`'s shape, trained on this text, with no
/// more than `steps` steps, and finite (read on the host, before any device work), or the
/// error says which flag to change. `Ok(true)`: it holds `steps` steps already.
fn check_resume(
    path: &std::path::Path,
    args: &Args,
    cfg: &GptConfig,
    identity: &[(String, String)],
) -> Result<bool> {
    let ckpt = fitgrad::distributed::load_checkpoint(path)?;
    let as_saved = |flag: &str| format!("set {flag} as it was saved");
    ckpt.expect_config(
        &[
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
            Expect::new("dtype", cfg.dtype, "set --precision as it was saved"),
            Expect::new("seed", cfg.seed, as_saved("--seed")),
        ],
        "train_gpt",
    )?;
    let same_text = |what: &str| {
        format!(
            "{what}: resume with the --text it was trained on, or start a new run without --resume"
        )
    };
    ckpt.check_extra(&[
        Expect::new(
            "data.vocab",
            &identity[0].1,
            same_text("another vocabulary (the same size, other characters)"),
        ),
        Expect::new("data.text", &identity[1].1, same_text("another text")),
    ])?;
    ckpt.check_finite()?;
    cli::check_resume_progress(path, ckpt.training_state()?.step, args.steps, "--steps")
}

/// Opens the device the flags ask for.
pub fn open_device(args: &Args, setup: &Setup) -> Result<Device> {
    let mut o = DeviceOptions::default();
    o.adapter = args.adapter.clone();
    o.memory_budget = setup.budget;
    Device::with_options(o)
}
