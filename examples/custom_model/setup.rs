//! custom_model's flags and everything they ask for, checked on the host before any device
//! work ([`prepare`]); the dataset and a resumed checkpoint once the adapter is known
//! ([`load_data`]: `--dataset auto` depends on it).

use clap::Parser;
use fitgrad::checkpoint::Expect;
use fitgrad::compress::PruneConfig;
use fitgrad::distributed::{Job, Zero};
use fitgrad::run::resume::{as_saved, dataset_identity, same_dataset};
use fitgrad::run::{self, MAX_EPOCHS, MAX_LAYERS, MAX_WIDTH};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::Precision;
use fitgrad::{DeviceInfo, Result};
use std::path::{Path, PathBuf};

/// This command's name in its errors.
const OP: &str = "custom_model";
/// Where `apt-get install dataset-fashion-mnist` puts the IDX files.
const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

#[derive(Parser, Debug)]
#[command(about = "Train a residual MLP defined in this example with fitgrad's Trainer")]
pub struct Args {
    /// auto (Fashion-MNIST when installed and the adapter is a GPU, else digits), digits
    /// (embedded), fashion-mnist, mnist, or a path (a CSV file with a label column, or a folder
    /// of IDX files).
    #[arg(long, default_value = "auto")]
    pub dataset: String,
    /// The label column of a CSV --dataset, by its header name (default: the column named
    /// "label", else the last one).
    #[arg(long)]
    pub label_column: Option<String>,
    /// Features of the residual stream.
    #[arg(long, default_value_t = 128)]
    pub width: usize,
    /// Residual blocks.
    #[arg(long, default_value_t = 2)]
    pub blocks: usize,
    /// Dropout probability inside each block, in [0, 1).
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    pub dropout: f64,
    /// Prune the Linear weights by magnitude to this sparsity in [0, 1) during training
    /// (cubic schedule from 5% to 60% of the steps), and report the sparsity of each layer.
    #[arg(long)]
    pub prune: Option<f32>,
    /// Epochs (default: 8 on digits, 2 on larger datasets).
    #[arg(long)]
    pub epochs: Option<u64>,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true)]
    pub lr: f64,
    /// adamw, or adamw8bit (both moments in 8 bits for tensors of 4096 elements or more).
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "adamw8bit"])]
    pub optimizer: String,
    /// none; optimizer: f32 master weights and AdamW's state in host memory (the device
    /// keeps parameters and gradients; each step reads the gradients back and uploads the
    /// parameters); parameters: that, and each block's parameters in host memory too (each
    /// block is an nn::Unit), on the device only around the block's forward and backward.
    #[arg(long, default_value = "none", value_parser = ["none", "optimizer", "parameters"])]
    pub offload: String,
    /// Save a sharded checkpoint into this folder after every epoch: each rank writes its
    /// shard of the parameters and optimizer state, rank 0 an index (index.json).
    #[arg(long)]
    pub save_sharded: Option<PathBuf>,
    /// The flags every training command shares.
    #[command(flatten)]
    pub common: fitgrad::run::TrainArgs,
}

/// Everything the flags ask for, checked on the host.
pub struct Setup {
    pub precision: Precision,
    /// The ZeRO stage under --distributed mpi.
    pub zero: Zero,
    /// `--offload`: (optimizer offloaded, parameters streamed).
    pub offload: (bool, bool),
    pub budget: Option<u64>,
    /// --report or --report-json.
    pub reporting: bool,
    pub prune: Option<PruneConfig>,
}

/// Checks every flag (the ZeRO stage against `dist`) before any device work.
pub fn prepare(args: &Args, dist: &Job) -> Result<Setup> {
    let precision: Precision = args.run.precision.parse()?;
    let zero = Zero::from_flag(args.job.zero.as_deref())?;
    if zero.number() == 3 && args.blocks == 0 {
        return Err(run::invalid(
            OP,
            format!(
                "--zero 3 shards the blocks (each an nn::Unit), and --blocks 0 has none: {}",
                fitgrad::residency::HOW_TO_MARK_UNITS
            ),
        ));
    }
    // custom_model has no --fit auto.
    dist.check_zero(zero, &[("--prune", args.prune.is_some())])?;
    if precision == Precision::F16 {
        return Err(run::invalid(
            OP,
            "this example keeps f32 master weights: --precision f32 or mixed",
        ));
    }
    run::check_counts(
        OP,
        &[
            ("--width", args.width as u64, 1, MAX_WIDTH),
            ("--blocks", args.blocks as u64, 0, MAX_LAYERS),
            ("--epochs", args.epochs.unwrap_or(1), 1, MAX_EPOCHS),
        ],
    )?;
    run::effective_batch(OP, args.batch_size, args.run.accum_steps)?;
    run::check_environment()?;
    let offload = run::check_offload(
        OP,
        &args.offload,
        args.blocks > 0,
        &[
            ("--optimizer adamw8bit", args.optimizer == "adamw8bit"),
            ("--prune", args.prune.is_some()),
            ("--distributed", args.job.distributed.is_some()),
        ],
    )?;
    if !(0.0..1.0).contains(&args.dropout) {
        return Err(run::invalid(
            OP,
            format!("--dropout must be in [0, 1), got {}", args.dropout),
        ));
    }
    run::check_number(OP, "--lr", args.lr, false)?;
    let budget = run::parse_budget(OP, args.run.memory_budget.as_deref())?;
    // No output may overwrite the dataset's files, the checkpoint resumed from, or another
    // output (--save may replace --resume: a run continued in place). "auto" reads one of two
    // datasets: both are inputs.
    let data_files: Vec<PathBuf> = match args.dataset.as_str() {
        "auto" => ["digits", "fashion-mnist"]
            .iter()
            .flat_map(|d| data::input_files(d))
            .collect(),
        spec => data::input_files(spec),
    };
    args.common
        .files(run::Files::new())
        .inputs("--dataset", data_files)
        .check()?;
    if let Some(dir) = &args.save_sharded {
        fitgrad::distributed::zero::checkpoint::check_folder("--save-sharded", dir)?;
    }
    let prune = args.prune.map(PruneConfig::new);
    if let Some(cfg) = &prune {
        cfg.validate()?;
    }
    Ok(Setup {
        precision,
        zero,
        offload,
        budget,
        reporting: args.report.report.is_some() || args.report.report_json.is_some(),
        prune,
    })
}

/// The data of a run on the adapter `info` describes.
pub struct Data {
    pub train: Dataset,
    pub test: Dataset,
    /// `--epochs`, or the default for the dataset's size.
    pub epochs: u64,
    /// What the run trains on, stored in its checkpoints (the dataset's hash).
    pub identity: Vec<(String, String)>,
    /// A resume whose checkpoint already holds --epochs epochs: nothing is trained.
    pub nothing_to_train: bool,
}

/// Loads the dataset (`auto`: Fashion-MNIST when installed and the adapter is a GPU, else the
/// digits; `say` tells why) and checks a resumed checkpoint against it, naming the flags.
pub fn load_data(args: &Args, info: &DeviceInfo, say: impl Fn(&str)) -> Result<Data> {
    let spec = match args.dataset.as_str() {
        "auto" if !Path::new(FASHION_MNIST_DIR).is_dir() => "digits",
        "auto" if info.adapter.is_cpu() => {
            say("(a CPU adapter: training on the digits; --dataset fashion-mnist for more)");
            "digits"
        }
        "auto" => "fashion-mnist",
        s => s,
    };
    let label = args.label_column.as_deref();
    let (train, test) = data::load_with_label(spec, args.run.seed, label)?;
    say(&run::dataset_line(&train, &test));
    let epochs = args
        .epochs
        .unwrap_or(if train.len() <= 10_000 { 8 } else { 2 });
    let identity = dataset_identity(train.hash());
    let nothing_to_train = match &args.checkpoint.resume {
        Some(path) => {
            let data = "resume on the --dataset it was trained on";
            let config = [
                Expect::new(
                    "kind",
                    "res-mlp",
                    "resume a checkpoint written by custom_model",
                ),
                Expect::new("inputs", train.dim, data),
                Expect::new("classes", train.classes, data),
                Expect::new("width", args.width, as_saved("--width")),
                Expect::new("blocks", args.blocks, as_saved("--blocks")),
                Expect::new("dropout", args.dropout as f32, as_saved("--dropout")),
            ];
            let same = [same_dataset(&identity)];
            run::check_checkpoint(OP, path, &config, &same, run::Until::Epochs(epochs))?
        }
        None => false,
    };
    Ok(Data {
        train,
        test,
        epochs,
        identity,
        nothing_to_train,
    })
}

/// The shared flags read as the command's own (`args.run.plan`, `args.checkpoint.save`).
impl std::ops::Deref for Args {
    type Target = fitgrad::run::TrainArgs;

    fn deref(&self) -> &fitgrad::run::TrainArgs {
        &self.common
    }
}
