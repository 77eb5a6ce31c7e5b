//! train_mlp's flags and everything they ask for, checked on the host before any device work
//! ([`prepare`]): the counts, the paths, the dataset and a resumed checkpoint.

use clap::Parser;
use fitgrad::checkpoint::Expect;
use fitgrad::cli::{self, MAX_BATCH, MAX_EPOCHS};
use fitgrad::compress::PruneConfig;
use fitgrad::distributed::{Job, Zero};
use fitgrad::nn::Activation;
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::Precision;
use fitgrad::{Bytes, DType, Result};

#[derive(Parser, Debug)]
#[command(about = "Train an MLP classifier with fitgrad")]
pub struct Args {
    /// digits (embedded), fashion-mnist, mnist, or a path (a CSV file with a label column, or a
    /// folder of IDX files).
    #[arg(long, default_value = "digits")]
    pub dataset: String,
    /// The label column of a CSV --dataset, by its header name (default: the column named
    /// "label", else the last one).
    #[arg(long)]
    pub label_column: Option<String>,
    /// Hidden layer widths, comma separated.
    #[arg(long, default_value = "256,256", value_delimiter = ',')]
    pub hidden: Vec<usize>,
    #[arg(long, default_value_t = 20)]
    pub epochs: u64,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Batches whose gradients add up before each optimizer step.
    #[arg(long, default_value_t = 1)]
    pub accum_steps: usize,
    /// Learning rate (default: 1e-3 for adamw, 0.05 for sgd).
    #[arg(long)]
    pub lr: Option<f32>,
    /// adamw, adamw8bit (both moments in 8 bits) or sgd (sgd uses momentum 0.9).
    #[arg(long, default_value = "adamw")]
    pub optimizer: String,
    /// none, or optimizer: f32 master weights and AdamW's state in host memory (the device
    /// keeps parameters and gradients; each step reads the gradients back and uploads the
    /// parameters). `parameters` is refused: the MLP names no units (custom_model and
    /// train_gpt stream theirs).
    #[arg(long, default_value = "none", value_parser = ["none", "optimizer", "parameters"])]
    pub offload: String,
    /// relu, gelu, tanh or sigmoid.
    #[arg(long, default_value = "relu")]
    pub activation: String,
    /// Cosine decay with 5% linear warm-up instead of a constant learning rate.
    #[arg(long)]
    pub cosine: bool,
    /// Clip the gradients' total L2 norm to this before each update.
    #[arg(long)]
    pub clip_grad_norm: Option<f32>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Substring of the adapter name to use (see --list-adapters).
    #[arg(long)]
    pub adapter: Option<String>,
    /// Print the adapters wgpu finds and exit.
    #[arg(long)]
    pub list_adapters: bool,
    /// End stdout with one JSON object describing the run.
    #[arg(long)]
    pub json: bool,
    /// f32, f16, or mixed (f32 master weights and optimizer state, f16 activations and
    /// matmuls, dynamic loss scaling).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Hard limit on device memory (e.g. 48MiB). The micro-batch is chosen to fit, with
    /// gradient accumulation keeping the effective batch.
    #[arg(long)]
    pub memory_budget: Option<String>,
    /// `auto`: let --memory-budget choose the micro-batch, activation checkpointing and mixed
    /// precision (cheapest first), and print each planned candidate.
    #[arg(long)]
    pub fit: Option<String>,
    /// Print the planned peak memory of a training step, by category, and exit.
    #[arg(long)]
    pub plan: bool,
    /// Reserve the planned peak before training, so no buffer is created afterwards.
    #[arg(long)]
    pub prealloc: bool,
    /// Recompute gelu layers in backward instead of keeping their pre-activations.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Stream the training set through the device in shards of this many samples, read from a
    /// file on disk (written once to the temp folder), so a dataset larger than the memory
    /// budget trains.
    #[arg(long)]
    pub shard_size: Option<usize>,
    /// Save a checkpoint (safetensors, written atomically) after every epoch.
    #[arg(long)]
    pub save: Option<std::path::PathBuf>,
    /// Save a sharded checkpoint into this folder after every epoch: each rank writes its
    /// shard of the parameters and optimizer state, rank 0 an index (index.json), so any
    /// number of ranks, or one process, resumes from it (--resume DIR).
    #[arg(long)]
    pub save_sharded: Option<std::path::PathBuf>,
    /// Resume from a checkpoint written by --save (same model flags), or from the folder of
    /// --save-sharded, on any number of ranks.
    #[arg(long)]
    pub resume: Option<std::path::PathBuf>,
    /// Write an HTML report (memory timeline of a step, loss / accuracy / throughput, memory
    /// table) to this file; the test set is then evaluated after every epoch.
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
    /// Write the report's data as JSON to this file.
    #[arg(long)]
    pub report_json: Option<std::path::PathBuf>,
    /// `mpi`: this process is one rank of data-parallel training started by mpirun (built with
    /// `--features mpi`). The batch flags give the whole job's batch, split across the ranks,
    /// so the weights are those of one process with the same flags; rank 0 prints, evaluates
    /// and saves.
    #[arg(long)]
    pub distributed: Option<String>,
    /// ZeRO stage under --distributed mpi: 0 replicates everything (plain data parallelism),
    /// 1 keeps each rank's shard of the optimizer state only, 2 also its shard of the summed
    /// gradients; the weights are those of stage 0. 3 also keeps its shard of each layer's
    /// parameters (each layer an nn::Unit at this stage), gathered around the layer's forward
    /// and backward. One process holds every shard, so the stage changes nothing there.
    #[arg(long)]
    pub zero: Option<String>,
    /// Prune the weights by magnitude to this sparsity in [0, 1) during training (cubic
    /// schedule from 5% to 60% of the steps), and report the sparsity of each layer.
    #[arg(long)]
    pub prune: Option<f32>,
    /// After training, quantize every layer to int8 (per-output-channel scales) and evaluate
    /// that model too: its weight bytes and accuracy next to the trained model's.
    #[arg(long)]
    pub quantize: bool,
}

/// Everything the flags ask for, checked on the host.
pub struct Setup {
    pub precision: Precision,
    /// The ZeRO stage under --distributed mpi.
    pub zero: Zero,
    pub act: Activation,
    pub budget: Option<u64>,
    /// `--offload optimizer`.
    pub offload_optimizer: bool,
    /// Samples per optimizer step (--batch-size x --accum-steps).
    pub eff: usize,
    pub fit_auto: bool,
    /// --report or --report-json.
    pub reporting: bool,
    pub prune: Option<PruneConfig>,
    pub train: Dataset,
    pub test: Dataset,
    /// The layer widths, input and classes included.
    pub widths: Vec<usize>,
    pub param_dtype: DType,
    /// What the run trains on, stored in its checkpoints (the dataset's hash).
    pub identity: Vec<(String, String)>,
    /// A resume whose checkpoint already holds --epochs epochs: nothing is trained.
    pub nothing_to_train: bool,
}

/// Checks every flag (the ZeRO stage against `dist`), loads the dataset and checks a resumed
/// checkpoint, before any device work.
pub fn prepare(args: &Args, dist: &Job) -> Result<Setup> {
    let precision: Precision = args.precision.parse()?;
    let zero = Zero::from_flag(args.zero.as_deref())?;
    dist.check_zero(
        zero,
        &[
            ("--prune", args.prune.is_some()),
            ("--quantize", args.quantize),
        ],
    )?;
    let act: Activation = args.activation.parse()?;
    let budget = args
        .memory_budget
        .as_deref()
        .map(|b| b.parse::<Bytes>().map(|b| b.0))
        .transpose()?;
    let invalid = |reason: String| fitgrad::Error::InvalidArgument {
        op: "train_mlp",
        reason,
    };
    // The Mlp's layers are no units: streaming is refused with how to mark them.
    let (offload_optimizer, _) = cli::check_offload("train_mlp", &args.offload, false, &[])?;
    let n = |v: usize| v as u64;
    let mut counts = vec![
        ("--epochs", args.epochs, 1, MAX_EPOCHS),
        ("--batch-size", n(args.batch_size), 1, MAX_BATCH),
        ("--accum-steps", n(args.accum_steps), 1, MAX_BATCH),
        (
            "--shard-size",
            n(args.shard_size.unwrap_or(1)),
            1,
            MAX_BATCH,
        ),
    ];
    // A hidden width of 0 is refused with its place in the list.
    counts.extend(
        args.hidden
            .iter()
            .map(|&w| ("--hidden", n(w), 1, cli::MAX_WIDTH)),
    );
    cli::check_counts("train_mlp", &counts)?;
    cli::check_environment()?;
    let eff = args
        .batch_size
        .checked_mul(args.accum_steps)
        .ok_or_else(|| invalid("--batch-size x --accum-steps overflows".into()))?;
    let fit_auto =
        match args.fit.as_deref() {
            None => false,
            Some("auto") if budget.is_none() => {
                return Err(invalid(
                    "--fit auto fits a budget: add --memory-budget".into(),
                ))
            }
            Some("auto") if args.checkpoint_activations => return Err(invalid(
                "--fit auto chooses activation checkpointing itself: drop --checkpoint-activations"
                    .into(),
            )),
            Some("auto") => true,
            Some(other) => return Err(invalid(format!("--fit {other}: the one mode is 'auto'"))),
        };
    if budget == Some(0) {
        return Err(invalid("--memory-budget must be more than 0 bytes".into()));
    }
    if args.checkpoint_activations && act != Activation::Gelu {
        return Err(invalid(format!(
            "--checkpoint-activations recomputes gelu layers in backward; {} layers keep \
             nothing it could drop: use --activation gelu, or drop --checkpoint-activations",
            args.activation
        )));
    }
    // No output may overwrite the dataset's files, the checkpoint resumed from, or another
    // output (--save may replace --resume: a run continued in place).
    let data_files = data::input_files(&args.dataset);
    let mut inputs: Vec<(&'static str, &std::path::Path)> = data_files
        .iter()
        .map(|p| ("--dataset", p.as_path()))
        .collect();
    inputs.extend(args.resume.as_deref().map(|p| ("--resume", p)));
    let outputs: Vec<(&'static str, &std::path::Path)> = [
        ("--save", &args.save),
        ("--report", &args.report),
        ("--report-json", &args.report_json),
    ]
    .into_iter()
    .filter_map(|(f, p)| Some((f, p.as_deref()?)))
    .collect();
    cli::check_paths(&inputs, &outputs, &[("--save", "--resume")])?;
    if let Some(dir) = &args.save_sharded {
        fitgrad::distributed::zero::checkpoint::check_folder("--save-sharded", dir)?;
    }
    let reporting = args.report.is_some() || args.report_json.is_some();
    if !matches!(args.optimizer.as_str(), "adamw" | "adamw8bit" | "sgd") {
        return Err(invalid(format!(
            "unknown optimizer '{}' (adamw, adamw8bit or sgd)",
            args.optimizer
        )));
    }
    if let Some(lr) = args.lr {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(invalid(format!(
                "--lr must be a finite number >= 0, got {lr}"
            )));
        }
    }
    let prune = args.prune.map(PruneConfig::new);
    if let Some(cfg) = &prune {
        cfg.validate()?;
    }
    let (train, test) =
        data::load_with_label(&args.dataset, args.seed, args.label_column.as_deref())?;
    if train.dim != test.dim {
        return Err(invalid(format!(
            "the training set has {} features per sample and the test set {}",
            train.dim, test.dim
        )));
    }
    let mut widths = vec![train.dim];
    widths.extend(args.hidden.iter().copied());
    widths.push(train.classes);
    let param_dtype = match precision {
        Precision::F16 => DType::F16,
        _ => DType::F32,
    };
    let identity = vec![("dataset".to_string(), format!("{:016x}", train.hash()))];
    // The checkpoint is checked on the host, before any device work, naming the flags.
    let nothing_to_train = match &args.resume {
        Some(path) => {
            let ckpt = fitgrad::distributed::load_checkpoint(path)?;
            let widths: Vec<String> = widths.iter().map(usize::to_string).collect();
            ckpt.expect_config(
                &[
                    Expect::new(
                        "kind",
                        "mlp",
                        "resume an MLP checkpoint written by train_mlp",
                    ),
                    Expect::new(
                        "widths",
                        widths.join(","),
                        "set --hidden as it was saved, on the --dataset it was trained on",
                    ),
                    Expect::new("activation", act.name(), "set --activation as it was saved"),
                    Expect::new("dtype", param_dtype, "set --precision as it was saved"),
                ],
                "train_mlp",
            )?;
            ckpt.check_extra(&[Expect::new(
                "data.dataset",
                &identity[0].1,
                "another dataset: resume with the --dataset (and --seed) it was trained on, or \
                 start a new run without --resume",
            )])?;
            ckpt.check_finite()?;
            cli::check_resume_progress(path, ckpt.training_state()?.epoch, args.epochs, "--epochs")?
        }
        None => false,
    };
    Ok(Setup {
        precision,
        zero,
        act,
        budget,
        offload_optimizer,
        eff,
        fit_auto,
        reporting,
        prune,
        train,
        test,
        widths,
        param_dtype,
        identity,
        nothing_to_train,
    })
}
