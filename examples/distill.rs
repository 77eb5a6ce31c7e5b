//! `cargo run --release --example distill` — knowledge distillation: a large teacher MLP is
//! trained on the digits, then a small student learns from it (`compress::Distill`, the loss
//! `alpha T^2 KL(teacher || student) + (1 - alpha) CE`), and the same student, from the same
//! initial weights and on the same batches, is trained on the labels alone for comparison.
//!
//! The teacher learns from the whole training set; the students, by default, from a quarter of
//! it (`--student-fraction`): a large model trained on much data, distilled where the small
//! model has few labels of its own, which is where the teacher's soft targets teach most. The
//! teacher trains with a strong weight decay (`--teacher-weight-decay`), which keeps its logits
//! moderate: at high T the soft term asks the student to reproduce the teacher's logits, and a
//! saturated teacher's take many steps to reach. docs/design-notes.md has the measurements, with
//! the full training set too.
//!
//! It prints the teacher's accuracy, both students' test accuracy after every epoch, the best
//! of each and the epoch it was first reached, and the parameter memory of each model.
//! `--json` ends stdout with one JSON object.

use clap::Parser;
use fitgrad::compress::{Distill, DistillConfig};
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::optim::AdamW;
use fitgrad::run::{self, MAX_BATCH, MAX_EPOCHS, MAX_WIDTH};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::{TrainModel, Trainer, TrainerConfig};
use fitgrad::{Bytes, Device, Error, Result};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(about = "Distil a large MLP into a small one with fitgrad")]
struct Args {
    /// digits (embedded), fashion-mnist, mnist, or a path (CSV or a folder of IDX files).
    #[arg(long, default_value = "digits")]
    dataset: String,
    /// The label column of a CSV --dataset, by its header name (default: the column named
    /// "label", else the last one).
    #[arg(long)]
    label_column: Option<String>,
    /// The teacher's hidden widths, comma separated.
    #[arg(long, default_value = "512,512", value_delimiter = ',')]
    teacher_hidden: Vec<usize>,
    /// The student's hidden widths, comma separated.
    #[arg(long, default_value = "32", value_delimiter = ',')]
    student_hidden: Vec<usize>,
    /// Epochs of the teacher.
    #[arg(long, default_value_t = 20)]
    teacher_epochs: u64,
    /// The teacher's AdamW weight decay (the students use AdamW's default, 0.01).
    #[arg(long, default_value_t = 1.0)]
    teacher_weight_decay: f32,
    /// Epochs of each student (distillation needs long runs: on a quarter of the digits it
    /// overtakes the labels alone only after about 100 epochs).
    #[arg(long, default_value_t = 150)]
    epochs: u64,
    /// The share of the training set the students learn from, in (0, 1] (a seeded subset; the
    /// teacher learns from all of it).
    #[arg(long, default_value_t = 0.25)]
    student_fraction: f64,
    /// The soft term's weight in [0, 1].
    #[arg(long, default_value_t = 0.5)]
    alpha: f32,
    /// The softmax temperature, positive.
    #[arg(long, default_value_t = 4.0)]
    temperature: f32,
    /// AdamW learning rate of all three models.
    #[arg(long, default_value_t = 3e-3)]
    lr: f32,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Seeds the weights, the data split and order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Substring of the adapter name to use.
    #[arg(long)]
    adapter: Option<String>,
    /// End stdout with one JSON object describing the run.
    #[arg(long)]
    json: bool,
}

/// A trainer for `model` with AdamW over its parameters (`weight_decay`: AdamW's default).
fn trainer<M: Module>(model: M, args: &Args, weight_decay: Option<f32>) -> Result<Trainer<M>> {
    let opt = AdamW::new(model.parameters(), args.lr)?;
    let opt = match weight_decay {
        Some(wd) => opt.weight_decay(wd)?,
        None => opt,
    };
    Trainer::new(
        model,
        Box::new(opt),
        TrainerConfig::new(args.batch_size, 1, args.lr),
    )
}

/// Trains for `epochs`, returning the test accuracy after each.
fn train<M: TrainModel<fitgrad::train::ClassBatch>>(
    t: &mut Trainer<M>,
    train: &Dataset,
    test: &Dataset,
    epochs: u64,
    seed: u64,
) -> Result<Vec<f32>> {
    (0..epochs)
        .map(|epoch| {
            t.train_epoch(train, seed, epoch, |_, _, _| Ok(()))?;
            Ok(t.evaluate(test, 1024)?.accuracy.unwrap_or(f32::NAN))
        })
        .collect()
}

/// The best accuracy and the first epoch (from 1) that reached it.
fn best(acc: &[f32]) -> (f32, usize) {
    let b = acc.iter().copied().fold(f32::NAN, f32::max);
    (b, acc.iter().position(|&a| a == b).map_or(0, |i| i + 1))
}

/// Every flag checked before any device work; the distillation's settings.
fn check(args: &Args) -> Result<DistillConfig> {
    let invalid = |reason: String| Error::InvalidArgument {
        op: "distill",
        reason,
    };
    let n = |v: usize| v as u64;
    let mut counts = vec![
        ("--batch-size", n(args.batch_size), 1, MAX_BATCH),
        ("--epochs", args.epochs, 1, MAX_EPOCHS),
        ("--teacher-epochs", args.teacher_epochs, 1, MAX_EPOCHS),
    ];
    // A width of 0 is refused with its flag.
    counts.extend(
        args.teacher_hidden
            .iter()
            .map(|&w| ("--teacher-hidden", n(w), 1, MAX_WIDTH)),
    );
    counts.extend(
        args.student_hidden
            .iter()
            .map(|&w| ("--student-hidden", n(w), 1, MAX_WIDTH)),
    );
    run::check_counts("distill", &counts)?;
    run::check_environment()?;
    run::check_number("distill", "--lr", args.lr, false)?;
    // Checked before the teacher trains, not after.
    let distill = DistillConfig::new(args.alpha, args.temperature);
    distill.validate()?;
    if !(args.student_fraction > 0.0 && args.student_fraction <= 1.0) {
        return Err(invalid(format!(
            "--student-fraction must be in (0, 1], got {}",
            args.student_fraction
        )));
    }
    if !(args.teacher_weight_decay.is_finite() && args.teacher_weight_decay >= 0.0) {
        return Err(invalid(format!(
            "--teacher-weight-decay must be a finite number >= 0, got {}",
            args.teacher_weight_decay
        )));
    }
    Ok(distill)
}

/// What the three models reached: accuracy per epoch and parameter bytes.
struct Figures {
    teacher_acc: Vec<f32>,
    alone_acc: Vec<f32>,
    distilled_acc: Vec<f32>,
    teacher_bytes: u64,
    student_bytes: u64,
}

impl Figures {
    /// Both students' accuracy by epoch, the best of each, the memory, and the `--json` line.
    fn print(
        &self,
        args: &Args,
        dev: &Device,
        dataset: &str,
        (tw, sw): (&[usize], &[usize]),
        (teacher_samples, student_samples): (usize, usize),
    ) {
        let (alone_acc, distilled_acc) = (&self.alone_acc, &self.distilled_acc);
        let (teacher_bytes, student_bytes) = (self.teacher_bytes, self.student_bytes);
        println!("epoch  alone  distilled");
        for (e, (a, d)) in alone_acc.iter().zip(distilled_acc).enumerate() {
            println!("{:>5}  {:>5.2}%  {:>8.2}%", e + 1, 100.0 * a, 100.0 * d);
        }
        let (ab, ae) = best(alone_acc);
        let (db, de) = best(distilled_acc);
        let (af, df) = (
            alone_acc.last().copied().unwrap_or(f32::NAN),
            distilled_acc.last().copied().unwrap_or(f32::NAN),
        );
        println!(
            "student trained alone:        accuracy {:.2}% (best {:.2}% at epoch {ae})",
            100.0 * af,
            100.0 * ab
        );
        println!(
            "student trained with teacher: accuracy {:.2}% (best {:.2}% at epoch {de})",
            100.0 * df,
            100.0 * db
        );
        println!(
            "parameter memory: teacher {}, student {} ({:.1}x smaller)",
            Bytes(teacher_bytes),
            Bytes(student_bytes),
            teacher_bytes as f64 / student_bytes.max(1) as f64
        );
        if args.json {
            let j = serde_json::json!({
                "adapter": dev.info().adapter.name,
                "dataset": dataset,
                "teacher_widths": tw,
                "student_widths": sw,
                "alpha": args.alpha,
                "temperature": args.temperature,
                "teacher_weight_decay": args.teacher_weight_decay,
                "teacher_samples": teacher_samples,
                "student_samples": student_samples,
                "teacher_accuracy": self.teacher_acc.last(),
                "student_alone_accuracy": af,
                "student_distilled_accuracy": df,
                "student_alone_per_epoch": alone_acc,
                "student_distilled_per_epoch": distilled_acc,
                "teacher_parameter_bytes": teacher_bytes,
                "student_parameter_bytes": student_bytes,
            });
            println!("{j}");
        }
    }
}

fn run(args: Args) -> Result<()> {
    let invalid = |reason: String| Error::InvalidArgument {
        op: "distill",
        reason,
    };
    let distill = check(&args)?;
    let (train_set, test_set) =
        data::load_with_label(&args.dataset, args.seed, args.label_column.as_deref())?;
    // The students' samples: a seeded subset of the teacher's.
    let student_set = if args.student_fraction < 1.0 {
        train_set.split(1.0 - args.student_fraction, args.seed).0
    } else {
        train_set.clone()
    };
    if student_set.is_empty() {
        return Err(invalid(format!(
            "--student-fraction {} of {} samples leaves the students none",
            args.student_fraction,
            train_set.len()
        )));
    }
    let dev = run::open_device(args.adapter.as_deref(), None)?;
    println!("adapter: {}", dev.info().adapter);
    println!("{}", run::dataset_line(&train_set, &test_set));
    let widths = |hidden: &[usize]| {
        let mut w = vec![train_set.dim];
        w.extend_from_slice(hidden);
        w.push(train_set.classes);
        w
    };
    let (tw, sw) = (widths(&args.teacher_hidden), widths(&args.student_hidden));

    let teacher = Mlp::new(&dev, &tw, Activation::Relu, args.seed)?;
    let mut t = trainer(teacher, &args, Some(args.teacher_weight_decay))?;
    let teacher_acc = train(
        &mut t,
        &train_set,
        &test_set,
        args.teacher_epochs,
        args.seed,
    )?;
    let teacher = t.model;
    let teacher_bytes = teacher.parameter_bytes();
    println!(
        "teacher MLP {tw:?}: {} parameters ({}), test accuracy {:.2}% after {} epochs",
        teacher.num_parameters(),
        Bytes(teacher_bytes),
        100.0 * teacher_acc.last().copied().unwrap_or(f32::NAN),
        args.teacher_epochs
    );

    println!(
        "students learn from {} of the {} training samples (--student-fraction {})",
        student_set.len(),
        train_set.len(),
        args.student_fraction
    );

    // Both students start from the same weights and see the same batches.
    let student_seed = args.seed.wrapping_add(1);
    let student = Mlp::new(&dev, &sw, Activation::Relu, student_seed)?;
    let mut alone = trainer(student, &args, None)?;
    let student_bytes = alone.model.parameter_bytes();
    let alone_acc = train(&mut alone, &student_set, &test_set, args.epochs, args.seed)?;
    let student = Mlp::new(&dev, &sw, Activation::Relu, student_seed)?;
    let mut distilled = trainer(Distill::new(teacher, student, distill)?, &args, None)?;
    let distilled_acc = train(
        &mut distilled,
        &student_set,
        &test_set,
        args.epochs,
        args.seed,
    )?;

    println!(
        "student MLP {sw:?}: {} parameters ({}), alpha {}, temperature {}",
        distilled.model.student.num_parameters(),
        Bytes(student_bytes),
        args.alpha,
        args.temperature
    );
    let figures = Figures {
        teacher_acc,
        alone_acc,
        distilled_acc,
        teacher_bytes,
        student_bytes,
    };
    let samples = (train_set.len(), student_set.len());
    figures.print(&args, &dev, &train_set.name, (&tw, &sw), samples);
    Ok(())
}

fn main() -> ExitCode {
    let args = match fitgrad::run::parse::<Args>() {
        Ok(a) => a,
        Err(code) => return code,
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
