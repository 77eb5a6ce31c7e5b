//! ZeRO stage 3 over MPI with the model made in host memory (`born_on_host`): under
//! `mpirun -np 2 --zero 3` each rank of custom_model, train_mlp and train_gpt makes its model
//! one unit at a time in host memory and keeps only its shard of each unit, so no rank's device
//! peak in use before the first step (the `start` figures of the run's JSON) reaches the
//! model's parameter bytes; one process, which makes the model whole, holds all of them.
//! (That the weights are those of one process: tests/mpi.rs.)
//!
//! Build the examples first: `cargo build --features mpi --example train_mlp --example
//! custom_model --example train_gpt && cargo test --features mpi --test mpi_zero3_born`.
#![cfg(feature = "mpi")]

use std::process::Command;

mod mpirun;
use mpirun::*;

/// The `start` object of the JSON line in `text`: each rank's device peak in use before the
/// first step and the model's parameter bytes.
fn start_memory(text: &str) -> (Vec<u64>, u64) {
    let line = text
        .lines()
        .find(|l| l.starts_with('{') && l.contains("\"start\""))
        .unwrap_or_else(|| panic!("no JSON line with the start figures:\n{text}"));
    let j: serde_json::Value = serde_json::from_str(line).unwrap();
    let s = &j["start"];
    let peaks = s["rank_peak_bytes_in_use"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    (peaks, s["model_parameter_bytes"].as_u64().unwrap())
}

/// `name` with `args` at `--zero 3` on 2 ranks: every rank's device peak before the first
/// step stays below 3/4 of the model's parameter bytes (the rest of the model was never on
/// its device). With `whole_too`, one process with the same flags, which makes the model
/// whole, reaches them.
fn never_whole_on_a_device(name: &str, args: &[&str], whole_too: bool) {
    let _one = one_job_at_a_time();
    let mut job = strings(args);
    job.extend(strings(&["--zero", "3", "--json"]));
    let text = run_ok(
        mpirun_np(2, name, &job, &[]),
        &format!("{name} -np 2 --zero 3"),
    );
    let (peaks, model) = start_memory(&text);
    eprintln!(
        "{name} -np 2 --zero 3: model {model} B, device peak before the first step {peaks:?}"
    );
    assert_eq!(peaks.len(), 2, "{name}: one figure per rank:\n{text}");
    for (rank, &peak) in peaks.iter().enumerate() {
        assert!(
            peak < model * 3 / 4,
            "{name}: rank {rank}'s device held {peak} B before the first step, of a {model} B \
             model"
        );
    }
    if whole_too {
        let mut one = Command::new(example(name));
        one.args(&job);
        let text = run_ok(one, &format!("{name} --zero 3, one process"));
        let (peaks, whole) = start_memory(&text);
        eprintln!(
            "{name} one process: model {whole} B, device peak before the first step {peaks:?}"
        );
        assert_eq!(whole, model);
        assert!(
            peaks[0] >= model,
            "{name}: one process holds the whole model"
        );
    }
}

/// custom_model's residual MLP of six blocks (each an `nn::Unit`).
#[test]
fn custom_model_at_zero_3_never_holds_the_whole_model() {
    let args = [
        "--dataset",
        "digits",
        "--width",
        "64",
        "--blocks",
        "6",
        "--dropout",
        "0",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--seed",
        "3",
    ];
    never_whole_on_a_device("custom_model", &args, true);
}

/// train_mlp's MLP of five layers (each a unit at stage 3), with AdamW and with SGD (whose
/// momentum stays on the device: the model is made in host memory all the same).
#[test]
fn train_mlp_at_zero_3_never_holds_the_whole_model() {
    let args = [
        "--hidden",
        "64,64,64,64",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--seed",
        "5",
    ];
    never_whole_on_a_device("train_mlp", &args, false);
    let sgd: Vec<&str> = args.iter().copied().chain(["--optimizer", "sgd"]).collect();
    never_whole_on_a_device("train_mlp", &sgd, false);
}

/// train_gpt's GPT of six blocks, one step.
#[test]
fn train_gpt_at_zero_3_never_holds_the_whole_model() {
    let tmp = TempDir::new("born-gpt");
    let text = tmp.0.join("text.txt");
    std::fs::write(
        &text,
        "to be, or not to be, that is the question. ".repeat(20),
    )
    .unwrap();
    let text = text.display().to_string();
    let args = [
        "--text",
        &text,
        "--steps",
        "1",
        "--layers",
        "6",
        "--dim",
        "32",
        "--heads",
        "2",
        "--context",
        "16",
        "--batch-size",
        "4",
        "--sample-len",
        "0",
    ];
    never_whole_on_a_device("train_gpt", &args, false);
}
