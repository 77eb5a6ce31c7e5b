//! What train_mlp reports beyond the shared run: its report's settings, and the int8 model's
//! weight bytes and accuracy (`--quantize`).

use super::{Args, Setup};
use fitgrad::compress::QuantizedMlp;
use fitgrad::nn::{Mlp, Module};
use fitgrad::report::TrainingReport;
use fitgrad::run;
use fitgrad::train::{Evaluation, Trainer};
use fitgrad::Bytes;

/// The report's settings: the dataset, the model, the optimizer and the memory flags.
pub fn settings(
    report: &mut TrainingReport,
    args: &Args,
    setup: &Setup,
    trainer: &Trainer<Mlp>,
    lr: f32,
) {
    let (train, test) = (&setup.train, &setup.test);
    let cosine = if args.cosine { ", cosine" } else { "" };
    for (key, value) in [
        ("dataset", run::dataset_setting(train, test)),
        (
            "model",
            format!(
                "MLP {:?}, {} ({} parameters)",
                setup.widths,
                args.activation,
                trainer.model.num_parameters()
            ),
        ),
        ("optimizer", format!("{} lr {lr}{cosine}", args.optimizer)),
        ("epochs", args.epochs.to_string()),
        (
            "batch",
            run::batch_setting(args.batch_size, args.run.accum_steps, trainer.micro_batch()),
        ),
        ("precision", trainer.config().precision.name().to_string()),
        (
            "activation checkpointing",
            trainer.model.checkpoint_activations.to_string(),
        ),
        (
            "memory budget",
            setup.budget.map_or("none".into(), |b| Bytes(b).to_string()),
        ),
        ("preallocation", args.checkpoint.prealloc.to_string()),
        (
            "shard size",
            args.shard_size
                .map_or("in memory".into(), |s| s.to_string()),
        ),
        (
            "clip grad norm",
            args.clip_grad_norm.map_or("off".into(), |c| c.to_string()),
        ),
        ("seed", args.run.seed.to_string()),
    ] {
        report.setting(key, value);
    }
}

/// `--quantize`: every layer to int8, the test set again; (dense weight bytes, int8 weight
/// bytes, int8 accuracy), printed beside the trained model's.
pub fn quantized(
    trainer: &Trainer<Mlp>,
    setup: &Setup,
    eval: &Evaluation,
    batch: usize,
) -> fitgrad::Result<(u64, u64, Option<f32>)> {
    let q = QuantizedMlp::from_mlp(&trainer.model)?;
    let e = q.evaluate(&setup.test, batch)?;
    let layers = &trainer.model.layers;
    let dense: u64 = layers.iter().map(|l| l.weight.allocated_bytes()).sum();
    let quantized = q.model().weight_bytes();
    let accuracy = eval.accuracy.unwrap_or(f32::NAN);
    println!(
        "int8: weights {} ({:.3}x the {} {} weights), test loss {:.4}, accuracy {:.2}% ({:+.2} points)",
        Bytes(quantized),
        quantized as f64 / dense as f64,
        Bytes(dense),
        setup.param_dtype,
        e.loss,
        100.0 * e.accuracy.unwrap_or(f32::NAN),
        100.0 * (e.accuracy.unwrap_or(f32::NAN) - accuracy)
    );
    Ok((dense, quantized, e.accuracy))
}
