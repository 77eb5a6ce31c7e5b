//! What custom_model reports beyond the shared run: its model's description and report
//! settings, and the dropout masks a resumed run skips.

use super::model::ResMlp;
use super::{Args, Data};
use fitgrad::distributed::Job;
use fitgrad::nn::Module;
use fitgrad::report::TrainingReport;
use fitgrad::run;
use fitgrad::train::Trainer;
use fitgrad::Bytes;

/// This rank's training forwards (= dropout calls per layer) in `epochs` epochs of `n`
/// samples, with `eff` samples per step, its share of them split into micro-batches of `micro`.
pub fn forwards_in(epochs: u64, n: usize, eff: usize, micro: usize, dist: &Job) -> u64 {
    let per_epoch: usize = (0..n)
        .step_by(eff)
        .map(|start| dist.share((n - start).min(eff)).len().div_ceil(micro))
        .sum();
    epochs * per_epoch as u64
}

/// `residual MLP IN -> W x N blocks (dropout P) -> CLASSES (K parameters)`.
pub fn describe(args: &Args, data: &Data, trainer: &Trainer<ResMlp>) -> String {
    format!(
        "residual MLP {} -> {} x {} blocks (dropout {}) -> {} ({} parameters)",
        data.train.dim,
        args.width,
        args.blocks,
        args.dropout,
        data.train.classes,
        trainer.model.num_parameters()
    )
}

/// The report's settings: the dataset, the model, the optimizer and the memory flags.
pub fn settings(
    report: &mut TrainingReport,
    args: &Args,
    data: &Data,
    trainer: &Trainer<ResMlp>,
    budget: Option<u64>,
) {
    let (train, test) = (&data.train, &data.test);
    let batch = run::batch_setting(args.batch_size, args.run.accum_steps, trainer.micro_batch());
    for (key, value) in [
        ("dataset", run::dataset_setting(train, test)),
        ("model", describe(args, data, trainer)),
        ("optimizer", format!("{} lr {}", args.optimizer, args.lr)),
        ("epochs", data.epochs.to_string()),
        ("batch", batch),
        ("precision", args.run.precision.clone()),
        (
            "memory budget",
            budget.map_or("none".into(), |b| Bytes(b).to_string()),
        ),
        ("preallocation", args.checkpoint.prealloc.to_string()),
        ("seed", args.run.seed.to_string()),
    ] {
        report.setting(key, value);
    }
}

/// The `--json` fields of this model and its flags.
pub fn own_json(
    args: &Args,
    data: &Data,
    trainer: &Trainer<ResMlp>,
    budget: Option<u64>,
) -> serde_json::Value {
    serde_json::json!({
        "dataset": data.train.name,
        "width": args.width,
        "blocks": args.blocks,
        "dropout": args.dropout,
        "parameters": trainer.model.num_parameters(),
        "epochs": data.epochs,
        "batch_size": args.batch_size,
        "accum_steps": args.run.accum_steps,
        "lr": args.lr,
        "optimizer": args.optimizer,
        "precision": args.run.precision,
        "seed": args.run.seed,
        "memory_budget": budget,
    })
}
