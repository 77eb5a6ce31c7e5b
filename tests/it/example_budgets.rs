//! The smallest-budget figure train_mlp and custom_model print (both examples included as
//! modules, run as a user runs them, on a tiny CSV): a budget too small is a
//! `BudgetTooSmall` whose message gives the figure rounded up and in exact bytes, not a raw
//! out-of-memory; either printed form passed back as `--memory-budget` trains, and one byte
//! less is refused again.

use crate::common;

use crate::common::budget_figure;

use crate::examples::train_mlp;

use crate::examples::custom_model;

use budget_figure::figure_passed_back_works;
use clap::Parser;
use fitgrad::distributed::Job;
use std::io::Write;

/// 48 rows of 4 features in 3 classes, with a header: a dataset an epoch trains in a moment.
fn tiny_csv() -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".csv").tempfile().unwrap();
    writeln!(f, "a,b,c,d,label").unwrap();
    for i in 0..48u32 {
        let v = |k: u32| ((i * 7 + k * 13) % 11) as f32 / 11.0;
        writeln!(f, "{},{},{},{},{}", v(0), v(1), v(2), v(3), i % 3).unwrap();
    }
    f.flush().unwrap();
    f
}

#[test]
fn train_mlp_minimum_budget_works_as_printed() {
    // No adapter: skipped loudly, or a failure under CI=true.
    if common::fresh_with_budget(None).is_none() {
        return;
    }
    let csv = tiny_csv();
    let path = csv.path().display().to_string();
    let run = |budget: &str| {
        let args = train_mlp::Args::try_parse_from([
            "train_mlp",
            "--dataset",
            &path,
            "--hidden",
            "8",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--memory-budget",
            budget,
        ])
        .unwrap();
        train_mlp::run(args, &Job::Single)
    };
    figure_passed_back_works(run, "1KiB");
}

#[test]
fn custom_model_minimum_budget_works_as_printed() {
    // No adapter: skipped loudly, or a failure under CI=true.
    if common::fresh_with_budget(None).is_none() {
        return;
    }
    let csv = tiny_csv();
    let path = csv.path().display().to_string();
    let run = |budget: &str| {
        let args = custom_model::Args::try_parse_from([
            "custom_model",
            "--dataset",
            &path,
            "--width",
            "8",
            "--blocks",
            "1",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--memory-budget",
            budget,
        ])
        .unwrap();
        custom_model::run(args, &Job::Single)
    };
    // 1 KiB cannot hold the model: the typed error with the figure, not the driver's.
    figure_passed_back_works(run, "1KiB");
}
