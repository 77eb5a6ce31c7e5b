//! train_mlp's flags and everything they ask for, checked on the host before any device work
//! ([`prepare`]): the counts, the paths, the dataset and a resumed checkpoint.

use clap::Parser;
use fitgrad::checkpoint::Expect;
use fitgrad::compress::PruneConfig;
use fitgrad::distributed::{Job, Zero};
use fitgrad::nn::Activation;
use fitgrad::run::resume::as_saved;
use fitgrad::run::{self, MAX_BATCH, MAX_EPOCHS, MAX_WIDTH};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::Precision;
use fitgrad::{DType, Result};

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
    /// Print the adapters wgpu finds and exit.
    #[arg(long)]
    pub list_adapters: bool,
    /// Stream the training set through the device in shards of this many samples, read from a
    /// file on disk (written once to the temp folder), so a dataset larger than the memory
    /// budget trains.
    #[arg(long)]
    pub shard_size: Option<usize>,
    /// Save a sharded checkpoint into this folder after every epoch: each rank writes its
    /// shard of the parameters and optimizer state, rank 0 an index (index.json), so any
    /// number of ranks, or one process, resumes from it (--resume DIR).
    #[arg(long)]
    pub save_sharded: Option<std::path::PathBuf>,
    /// Prune the weights by magnitude to this sparsity in [0, 1) during training (cubic
    /// schedule from 5% to 60% of the steps), and report the sparsity of each layer.
    #[arg(long)]
    pub prune: Option<f32>,
    /// After training, quantize every layer to int8 (per-output-channel scales) and evaluate
    /// that model too: its weight bytes and accuracy next to the trained model's.
    #[arg(long)]
    pub quantize: bool,
    /// --fit auto and --checkpoint-activations.
    #[command(flatten)]
    pub fit: fitgrad::run::FitArgs,
    /// The flags every training command shares.
    #[command(flatten)]
    pub common: fitgrad::run::TrainArgs,
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
    const OP: &str = "train_mlp";
    let precision: Precision = args.run.precision.parse()?;
    let zero = Zero::from_flag(args.job.zero.as_deref())?;
    let quantize = ("--quantize", args.quantize);
    dist.check_zero(zero, &[("--prune", args.prune.is_some()), quantize])?;
    let act: Activation = args.activation.parse()?;
    let budget = run::parse_budget(OP, args.run.memory_budget.as_deref())?;
    // The Mlp's layers are no units: streaming is refused with how to mark them.
    let (offload_optimizer, _) = run::check_offload(OP, &args.offload, false, &[])?;
    let eff = run::effective_batch(OP, args.batch_size, args.run.accum_steps)?;
    let shard = args.shard_size.unwrap_or(1) as u64;
    let mut counts = vec![
        ("--epochs", args.epochs, 1, MAX_EPOCHS),
        ("--shard-size", shard, 1, MAX_BATCH),
    ];
    // A hidden width of 0 is refused with its place in the list.
    counts.extend(
        args.hidden
            .iter()
            .map(|&w| ("--hidden", w as u64, 1, MAX_WIDTH)),
    );
    run::check_counts(OP, &counts)?;
    run::check_environment()?;
    let fit_auto = args.fit.auto(OP, budget, "activation checkpointing")?;
    check_model_flags(args, act)?;
    // No output may overwrite the dataset's files, the checkpoint resumed from, or another
    // output (--save may replace --resume: a run continued in place).
    args.common
        .files(run::Files::new())
        .inputs("--dataset", data::input_files(&args.dataset))
        .check()?;
    if let Some(dir) = &args.save_sharded {
        fitgrad::distributed::zero::checkpoint::check_folder("--save-sharded", dir)?;
    }
    let reporting = args.report.report.is_some() || args.report.report_json.is_some();
    let prune = args.prune.map(PruneConfig::new);
    let label = args.label_column.as_deref();
    let (train, test) = data::load_with_label(&args.dataset, args.run.seed, label)?;
    if train.dim != test.dim {
        return Err(run::invalid(
            OP,
            format!(
                "the training set has {} features per sample and the test set {}",
                train.dim, test.dim
            ),
        ));
    }
    let mut widths = vec![train.dim];
    widths.extend(args.hidden.iter().copied());
    widths.push(train.classes);
    let param_dtype = match precision {
        Precision::F16 => DType::F16,
        _ => DType::F32,
    };
    let identity = run::resume::dataset_identity(train.hash());
    // The checkpoint is checked on the host, before any device work, naming the flags.
    let nothing_to_train = match &args.checkpoint.resume {
        Some(path) => check_resume(path, args, &widths, act, param_dtype, &identity)?,
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

/// The model's and the optimizer's flags: checkpointing that has something to drop, a known
/// optimizer, a learning rate, a sparsity.
fn check_model_flags(args: &Args, act: Activation) -> Result<()> {
    const OP: &str = "train_mlp";
    if args.fit.checkpoint_activations && act != Activation::Gelu {
        return Err(run::invalid(
            OP,
            format!(
                "--checkpoint-activations recomputes gelu layers in backward; {} layers keep \
                 nothing it could drop: use --activation gelu, or drop --checkpoint-activations",
                args.activation
            ),
        ));
    }
    if !matches!(args.optimizer.as_str(), "adamw" | "adamw8bit" | "sgd") {
        return Err(run::invalid(
            OP,
            format!(
                "unknown optimizer '{}' (adamw, adamw8bit or sgd)",
                args.optimizer
            ),
        ));
    }
    if let Some(lr) = args.lr {
        run::check_number(OP, "--lr", lr, true)?;
    }
    if let Some(p) = args.prune {
        PruneConfig::new(p).validate()?;
    }
    Ok(())
}

/// The checkpoint at `path` holds an MLP of these `widths`, `act` and `dtype`, trained on
/// this dataset, with no more epochs than asked; `Ok(true)`: it holds them all.
fn check_resume(
    path: &std::path::Path,
    args: &Args,
    widths: &[usize],
    act: Activation,
    dtype: DType,
    identity: &[(String, String)],
) -> Result<bool> {
    let widths: Vec<String> = widths.iter().map(usize::to_string).collect();
    let config = [
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
        Expect::new("activation", act.name(), as_saved("--activation")),
        Expect::new("dtype", dtype, as_saved("--precision")),
    ];
    let data = [run::resume::same_dataset(identity)];
    let until = run::Until::Epochs(args.epochs);
    run::check_checkpoint("train_mlp", path, &config, &data, until)
}

/// The shared flags read as the command's own (`args.run.plan`, `args.checkpoint.save`).
impl std::ops::Deref for Args {
    type Target = fitgrad::run::TrainArgs;

    fn deref(&self) -> &fitgrad::run::TrainArgs {
        &self.common
    }
}
