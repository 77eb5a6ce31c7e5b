//! The lines a run prints to describe itself, the same in every command: its data, its
//! batch, its budget.

use crate::error::Bytes;
use crate::train::data::Dataset;

/// `dataset: NAME (N train, M test, F features, C classes)`.
pub fn dataset_line(train: &Dataset, test: &Dataset) -> String {
    format!(
        "dataset: {} ({} train, {} test, {} features, {} classes)",
        train.name,
        train.len(),
        test.len(),
        train.dim,
        train.classes
    )
}

/// The report's `batch` setting: `B x A accumulation steps, micro-batch M`.
pub fn batch_setting(batch: usize, accum: usize, micro: usize) -> String {
    format!("{batch} x {accum} accumulation steps, micro-batch {micro}")
}

/// The budget's line: `memory budget B: micro-batch m of b (n accumulated micro-batches per
/// step)`; `accumulated` says "accumulated" before "micro-batches" (as train_mlp and
/// train_gpt print it).
pub fn budget_line(
    budget: u64,
    batch: usize,
    micro: usize,
    accum: usize,
    accumulated: bool,
) -> String {
    format!(
        "memory budget {}: micro-batch {micro} of {batch} ({} {}micro-batches per step)",
        Bytes(budget),
        batch.div_ceil(micro) * accum,
        if accumulated { "accumulated " } else { "" }
    )
}

/// The report's `dataset` setting: `NAME (N train, M test)`.
pub fn dataset_setting(train: &Dataset, test: &Dataset) -> String {
    format!(
        "{} ({} train, {} test)",
        train.name,
        train.len(),
        test.len()
    )
}
