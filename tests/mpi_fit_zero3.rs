//! `--fit auto` over MPI with ZeRO stage 3 as a rung (train_mlp, 2 ranks, each of its MLP's
//! layers a unit at stage 3): a budget stage 2 cannot meet but stage 3 can is met at stage 3
//! on every rank, and the weights are one process's; `--fit auto --zero 3` fits at that stage
//! with each rank's planned peak its measured one; a budget nothing meets ends every rank with
//! the typed error, without a hang.
//!
//! Build the examples first: `cargo build --features mpi --example train_mlp --example
//! custom_model --example train_gpt && cargo test --features mpi --test mpi_fit_zero3`.
#![cfg(feature = "mpi")]

use std::process::Command;
use std::time::{Duration, Instant};

mod mpirun;
use mpirun::*;

/// A model whose parameters, gradients and AdamW state outweigh its activations, in many small
/// units: stage 3's shards save more than two gathered units cost.
fn model(batch: usize) -> Vec<String> {
    let batch = batch.to_string();
    strings(&[
        "--hidden",
        "256,256,256,256,256,256,256,256",
        "--batch-size",
        &batch,
        "--seed",
        "5",
        "--epochs",
        "1",
    ])
}

/// The JSON line of `text` holding `key`.
fn json_with(text: &str, key: &str) -> serde_json::Value {
    let line = text
        .lines()
        .find(|l| l.starts_with('{') && l.contains(key))
        .unwrap_or_else(|| panic!("no JSON line with {key}:\n{text}"));
    serde_json::from_str(line).unwrap()
}

/// The largest rank's planned step peak reserved of a `--plan --json` job at `stage` with a
/// batch of 2 (one sample per rank: the smallest step a rank can take).
fn planned_peak(stage: u8) -> u64 {
    let mut a = model(2);
    a.extend(strings(&["--zero", &stage.to_string(), "--plan", "--json"]));
    let text = run_ok(mpirun_np(2, "train_mlp", &a, &[]), "a stage's plan");
    let p = json_with(&text, "\"per_rank\"")["per_rank"].clone();
    p["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["peak_reserved"].as_u64().unwrap())
        .max()
        .unwrap()
}

/// Both ranks' start-up lines name `stage`.
fn both_ranks_at(text: &str, stage: u8) {
    for rank in 0..2 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("rank {rank} of 2: pid")))
            .unwrap_or_else(|| panic!("rank {rank} did not join:\n{text}"));
        assert!(
            line.contains(&format!("ZeRO stage {stage},")),
            "rank {rank}: {line}"
        );
    }
}

/// Every rank's whole-run peak reserved within 2% of its plan (`rank_peaks` of the JSON).
fn plans_hold_on_every_rank(j: &serde_json::Value) {
    let peaks = j["rank_peaks"].as_array().expect("rank_peaks");
    assert_eq!(peaks.len(), 2, "{j}");
    for r in peaks {
        let (p, m) = (
            r["planned"].as_u64().unwrap(),
            r["measured"].as_u64().unwrap(),
        );
        let off = (p as f64 - m as f64).abs() / m.max(1) as f64;
        eprintln!("rank {}: planned peak {p} B, measured {m} B", r["rank"]);
        assert!(off <= 0.02, "rank {}: planned {p}, measured {m}", r["rank"]);
    }
}

/// A budget between stage 3's smallest step and stage 2's: `--fit auto` plans stages 0 to 2
/// (none fits), takes stage 3 on both ranks, trains, and its sharded checkpoint holds the
/// weights and optimizer state of one process (batch 64, no budget) within 1e-5 relative.
#[test]
fn fit_auto_takes_stage_3_where_stage_2_cannot_fit() {
    let _one = one_job_at_a_time();
    let (s2, s3) = (planned_peak(2), planned_peak(3));
    eprintln!("smallest step peak reserved: stage 2 {s2} B, stage 3 {s3} B");
    assert!(s3 < s2 * 49 / 50, "stage 3 ({s3}) saves on stage 2 ({s2})");
    let budget = (s2 + s3) / 2;
    let tmp = TempDir::new("fit-z3");
    // Each rank writes its own shards (a consolidated --save gathers the units on rank 0,
    // which this budget does not leave room for).
    let (single, dist) = (tmp.0.join("one.safetensors"), tmp.0.join("two"));
    // AdamW turns the rounding of gradients that are nearly zero, which another order of
    // additions changes, into steps of about its learning rate: a small one keeps those
    // below the tolerance over the deep model's 23 steps (1.7e-5 relative at 1e-3).
    let lr = strings(&["--lr", "1e-4"]);
    let mut one = Command::new(example("train_mlp"));
    one.args(model(64)).args(&lr).arg("--save").arg(&single);
    run_ok(one, "one process");
    let mut a = model(64);
    a.extend(lr);
    let budget = budget.to_string();
    a.extend(strings(&[
        "--fit",
        "auto",
        "--memory-budget",
        &budget,
        "--json",
    ]));
    a.extend(["--save-sharded".into(), dist.display().to_string()]);
    let text = run_ok(mpirun_np(2, "train_mlp", &a, &[]), "fit auto at stage 3");
    eprintln!("{text}");
    for stage in 0..3 {
        let line = text
            .lines()
            .find(|l| l.contains(&format!("ZeRO stage {stage},")))
            .unwrap_or_else(|| panic!("stage {stage} is a candidate:\n{text}"));
        assert!(line.ends_with("does not fit"), "{line}");
    }
    assert!(
        text.lines()
            .any(|l| l.contains("ZeRO stage 3,") && l.ends_with(" fits")),
        "stage 3 fits:\n{text}"
    );
    let j = json_with(&text, "\"rank_weight_hashes\"");
    assert_eq!(j["zero_stage"], 3, "{j}");
    both_ranks_at(&text, 3);
    let hashes = j["rank_weight_hashes"].as_array().unwrap();
    assert_eq!(hashes[0], hashes[1], "the ranks hold the same bits");
    let (a, b) = (
        fitgrad::distributed::load_checkpoint(&dist).unwrap(),
        fitgrad::checkpoint::load(&single).unwrap(),
    );
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>()
    );
    for (name, t) in &b.tensors {
        let (x, y) = (a.tensors[name].to_f32(), t.to_f32());
        let scale = y.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30) as f64;
        let d = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (*p as f64 - *q as f64).abs() / scale)
            .fold(0.0, f64::max);
        eprintln!("{name}: {d:e}");
        assert!(d <= 1e-5, "{name} differs by {d:e} relative");
    }
}

/// `--fit auto --zero 3` with a budget: the stage's ladder fits, both ranks train at stage 3,
/// and each rank's measured peak is its plan's within 2%.
#[test]
fn fit_auto_at_zero_3_fits_and_its_plan_holds_on_every_rank() {
    let _one = one_job_at_a_time();
    let budget = (planned_peak(3) * 21 / 20).to_string();
    let mut a = model(64);
    a.extend(strings(&[
        "--zero",
        "3",
        "--fit",
        "auto",
        "--memory-budget",
        &budget,
        "--json",
    ]));
    let text = run_ok(mpirun_np(2, "train_mlp", &a, &[]), "--fit auto --zero 3");
    eprintln!("{text}");
    let j = json_with(&text, "\"rank_peaks\"");
    assert_eq!(j["zero_stage"], 3, "{j}");
    both_ranks_at(&text, 3);
    plans_hold_on_every_rank(&j);
}

/// A budget nothing meets, with and without `--zero 3`: every rank prints the typed error
/// (the smallest budget that works) and the job exits non-zero, within two and a half minutes
/// (planning every rung on a loaded machine takes under one).
#[test]
fn a_budget_nothing_meets_ends_every_rank_with_the_error() {
    let _one = one_job_at_a_time();
    for zero in [&[][..], &["--zero", "3"][..]] {
        let mut a = model(64);
        a.extend(strings(&["--fit", "auto", "--memory-budget", "64KiB"]));
        a.extend(strings(zero));
        let started = Instant::now();
        let out = mpirun_np(2, "train_mlp", &a, &[]).output().unwrap();
        let took = started.elapsed();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        eprintln!("{zero:?}: {:.1} s\n{err}", took.as_secs_f64());
        assert!(!out.status.success(), "{zero:?}: ran:\n{err}");
        assert!(took < Duration::from_secs(150), "{zero:?}: took {took:?}");
        for rank in 0..2 {
            let line = err
                .lines()
                .find(|l| l.starts_with(&format!("fitgrad rank {rank} of 2: error:")))
                .unwrap_or_else(|| panic!("{zero:?}: rank {rank} printed no error:\n{err}"));
            assert!(line.contains("needs at least"), "{zero:?}: {line}");
            assert!(line.contains("every rank stops on it"), "{zero:?}: {line}");
        }
    }
}
