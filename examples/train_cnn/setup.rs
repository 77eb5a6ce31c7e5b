//! train_cnn's flags and everything they ask for, checked on the host before any device work
//! ([`prepare`]): the counts, the paths, the dataset and the defaults its image size chooses.

use super::augment::{Augment, Augmented};
use clap::Parser;
use fitgrad::run::{self, MAX_EPOCHS, MAX_LAYERS, MAX_WIDTH};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::Precision;
use fitgrad::Result;
use std::path::{Path, PathBuf};

/// This command's name in its errors.
const OP: &str = "train_cnn";
/// Where `apt-get install dataset-fashion-mnist` puts the IDX files.
const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

#[derive(Parser, Debug)]
#[command(about = "Train a small ResNet defined in this example with fitgrad's Trainer")]
pub struct Args {
    /// The adapter, the budget, the plan, the JSON line, the accumulation.
    #[command(flatten)]
    pub run: fitgrad::run::RunArgs,
    /// --fit auto and --checkpoint-activations.
    #[command(flatten)]
    pub fit: fitgrad::run::FitArgs,
    /// --prealloc, --save, --resume.
    #[command(flatten)]
    pub checkpoint: fitgrad::run::CheckpointArgs,
    /// auto (Fashion-MNIST when installed, else digits), digits, fashion-mnist, mnist, or a
    /// folder of IDX files.
    #[arg(long, default_value = "auto")]
    pub dataset: String,
    /// batch (BatchNorm2d) or group (GroupNorm, groups of 4 channels).
    #[arg(long, default_value = "batch")]
    pub norm: String,
    /// With group norm: add each micro-batch's weight gradients as separate sums (faster) instead
    /// of the batch-invariant sums that make a budgeted run end on the unbudgeted run's weights.
    #[arg(long)]
    pub fast_sums: bool,
    /// Channels of the first stage (the second and third have 2x and 4x); default 24 for
    /// images of 16 pixels a side or more (Fashion-MNIST), 16 for smaller ones (the digits).
    #[arg(long)]
    pub width: Option<usize>,
    /// The stem conv's stride: default 2 for images of 16 pixels a side or more (28x28 ->
    /// 14x14 before the first stage), 1 for smaller ones.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4))]
    pub stem_stride: Option<u64>,
    /// Residual blocks per stage after its first.
    #[arg(long, default_value_t = 0)]
    pub blocks: usize,
    /// Epochs (default: 3 on Fashion-MNIST, 10 on the digits).
    #[arg(long)]
    pub epochs: Option<u64>,
    /// Samples per batch; default 128 for images of 16 pixels a side or more, 64 for smaller
    /// ones.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// adamw, or sgd (momentum 0.9).
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "sgd"])]
    pub optimizer: String,
    /// The learning rate; default 4e-3 for images of 16 pixels a side or more, 2e-3 for
    /// smaller ones.
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// constant, or cosine (decay to 0 over the run after a warm-up of 5% of the steps);
    /// default cosine for images of 16 pixels a side or more, constant for smaller ones.
    #[arg(long, value_parser = ["constant", "cosine"])]
    pub schedule: Option<String>,
    /// The same as --schedule cosine.
    #[arg(long)]
    pub cosine: bool,
    /// Random crops: pad every side with this many zeros, then crop back to the image size at a
    /// seeded offset (per sample and epoch).
    #[arg(long, default_value_t = 0)]
    pub crop_pad: usize,
    /// Random horizontal flips (seeded, per sample and epoch).
    #[arg(long)]
    pub flip: bool,
    /// Both: --crop-pad 2 --flip.
    #[arg(long)]
    pub augment: bool,
    /// Train on the first N samples of the training set only (a quick run).
    #[arg(long)]
    pub train_samples: Option<usize>,
    /// Write an HTML report of the run.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// `mpi`: one rank of data-parallel training started by mpirun (`--features mpi`).
    #[arg(long)]
    pub distributed: Option<String>,
}

/// Everything the flags ask for, checked on the host, with the defaults of the image size.
pub struct Setup {
    pub precision: Precision,
    /// `--norm group`.
    pub group: bool,
    pub budget: Option<u64>,
    pub fit_auto: bool,
    pub train: Dataset,
    pub test: Dataset,
    /// The images' side in pixels.
    pub side: usize,
    pub epochs: u64,
    pub width: usize,
    pub lr: f64,
    pub batch_size: usize,
    pub stem_stride: usize,
    pub cosine: bool,
    pub aug: Augment,
}

/// Checks every flag and loads the dataset, before any device work.
pub fn prepare(args: &Args) -> Result<Setup> {
    let invalid = |reason: &str| run::invalid(OP, reason);
    let precision: Precision = args.run.precision.parse()?;
    if precision == Precision::F16 {
        return Err(invalid("--precision f32 or mixed"));
    }
    let group = match args.norm.as_str() {
        "batch" => false,
        "group" => true,
        n => return Err(invalid(&format!("--norm batch or group, got '{n}'"))),
    };
    if args.fast_sums && !group {
        return Err(invalid("--fast-sums applies to --norm group"));
    }
    // Every count bounded by the rule every command shares.
    let n = |v: Option<usize>| v.map_or(1, |v| v as u64);
    run::check_counts(
        OP,
        &[
            ("--width", n(args.width), 1, MAX_WIDTH),
            ("--blocks", args.blocks as u64, 0, MAX_LAYERS),
            ("--epochs", args.epochs.unwrap_or(1), 1, MAX_EPOCHS),
            ("--train-samples", n(args.train_samples), 1, u64::MAX),
            ("--crop-pad", args.crop_pad as u64, 0, MAX_WIDTH),
        ],
    )?;
    run::effective_batch(OP, args.batch_size.unwrap_or(1), args.run.accum_steps)?;
    run::check_environment()?;
    if args.cosine && args.schedule.as_deref() == Some("constant") {
        return Err(invalid("--cosine and --schedule constant disagree"));
    }
    if let Some(lr) = args.lr {
        run::check_number(OP, "--lr", lr, false)?;
    }
    let budget = run::parse_budget(OP, args.run.memory_budget.as_deref())?;
    let fit_auto = args.fit.auto(OP, budget, "activation checkpointing")?;
    let spec = match args.dataset.as_str() {
        "auto" if Path::new(FASHION_MNIST_DIR).is_dir() => "fashion-mnist",
        "auto" => "digits",
        s => s,
    };
    // No output may overwrite the dataset's files, the checkpoint resumed from, or another
    // output (--save may replace --resume: a run continued in place).
    run::Files::new()
        .inputs("--dataset", data::input_files(spec))
        .input("--resume", args.checkpoint.resume.as_deref())
        .output("--save", args.checkpoint.save.as_deref())
        .output("--report", args.report.as_deref())
        .check()?;
    let (mut train, test): (Dataset, Dataset) = data::load(spec, args.run.seed)?;
    if let Some(n) = args.train_samples.filter(|&n| n < train.len()) {
        train.features.truncate(n * train.dim);
        train.labels.truncate(n);
    }
    let side = train.dim.isqrt();
    if side * side != train.dim {
        return Err(invalid(&format!(
            "images must be square: {} features per sample",
            train.dim
        )));
    }
    // Defaults by image size: 28x28 (Fashion-MNIST) gets a strided stem, a wider network, a
    // higher rate and cosine decay; the 8x8 digits keep every pixel, width 16 and a constant
    // rate.
    let large = side >= 16;
    let aug = Augment {
        pad: if args.augment { 2 } else { args.crop_pad },
        flip: args.flip || args.augment,
    };
    Ok(Setup {
        precision,
        group,
        budget,
        fit_auto,
        epochs: args
            .epochs
            .unwrap_or(if train.len() <= 10_000 { 10 } else { 3 }),
        width: args.width.unwrap_or(if large { 24 } else { 16 }),
        lr: args.lr.unwrap_or(if large { 4e-3 } else { 2e-3 }),
        batch_size: args.batch_size.unwrap_or(if large { 128 } else { 64 }),
        stem_stride: args
            .stem_stride
            .map_or(1 + usize::from(large), |s| s as usize),
        cosine: match args.schedule.as_deref() {
            Some(s) => s == "cosine",
            None => args.cosine || large,
        },
        aug,
        train,
        test,
        side,
    })
}

impl Setup {
    /// The training images, augmented as the flags ask.
    pub fn images(&self, seed: u64) -> Result<Augmented<'_>> {
        Augmented::new(&self.train, self.side, self.aug, seed)
    }
}

/// The steps of the whole run, at most [`run::MAX_STEPS`] (epochs x steps per epoch).
pub fn total_steps(setup: &Setup, accum: usize) -> Result<u64> {
    let eff = setup.batch_size * accum;
    run::total_steps(OP, setup.train.len(), eff, setup.epochs)
}
