//! ZeRO checkpoints over MPI (the `mpi` feature), through train_mlp and custom_model under
//! mpirun: a sharded checkpoint of 4 ranks resumes on 2 ranks and on one process, and a
//! one-file (consolidated) checkpoint moves from 2 ranks to one process and back, each to the
//! weights and optimizer state of one uninterrupted process within 1e-5 relative, at stages 1
//! and 2 (train_mlp) and at stage 3 (custom_model, its blocks units sharded over the ranks);
//! a sharded checkpoint missing a rank's file, or resumed by another model, is refused on
//! every rank before training, naming the file. (A rank killed or stopped at every stage:
//! tests/mpi.rs.)
//!
//! Build the examples first: `cargo build --features mpi --example train_mlp --example
//! custom_model && cargo test --features mpi --test mpi_checkpoint` (what .ci/run does).
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::Command;
use std::time::Instant;

mod mpirun;
use mpirun::*;

/// A small, quick run of train_mlp for `epochs`, then `more` flags.
fn flags(epochs: u32, more: &[&str]) -> Vec<String> {
    let epochs = epochs.to_string();
    let base = [
        "--hidden",
        "32",
        "--epochs",
        &epochs,
        "--batch-size",
        "64",
        "--seed",
        "5",
    ];
    base.iter().chain(more).map(|s| s.to_string()).collect()
}

/// mpirun with `np` ranks of train_mlp; `env` reaches every rank.
fn mpirun(np: usize, args: &[String], env: &[(&str, &str)]) -> Command {
    mpirun_np(np, "train_mlp", args, env)
}

fn one_process(args: &[String]) -> Command {
    one_process_of("train_mlp", args)
}

fn one_process_of(name: &str, args: &[String]) -> Command {
    let mut cmd = Command::new(example(name));
    cmd.args(args);
    cmd
}

/// Runs `cmd`; its stdout and stderr and whether it succeeded.
fn run(mut cmd: Command, what: &str) -> (bool, String) {
    let started = Instant::now();
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    eprintln!("{what}: {:.1} s", started.elapsed().as_secs_f64());
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn run_ok(cmd: Command, what: &str) -> String {
    let (ok, text) = run(cmd, what);
    assert!(ok, "{what} failed:\n{text}");
    text
}

/// max |a - b| / max |b| over one tensor.
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let scale = b
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs() / scale)
        .fold(0.0, f64::max)
}

/// The checkpoint file `got` holds every tensor (model and optimizer state) of `want` within
/// 1e-5 relative, and the same step and epoch.
fn same_run(got: &str, want: &str, what: &str) {
    let a = fitgrad::checkpoint::load(Path::new(got)).unwrap();
    let b = fitgrad::checkpoint::load(Path::new(want)).unwrap();
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>(),
        "{what}"
    );
    let mut worst = 0.0f64;
    for (name, t) in &b.tensors {
        let d = rel_diff(&a.tensors[name].to_f32(), &t.to_f32());
        assert!(d <= 1e-5, "{what}: {name} differs by {d:e}");
        worst = worst.max(d);
    }
    for key in ["step", "epoch", "optim.step_count", "optim.param_steps"] {
        assert_eq!(a.metadata.get(key), b.metadata.get(key), "{what}: {key}");
    }
    eprintln!(
        "{what}: worst relative difference over {} tensors: {worst:e}",
        b.tensors.len()
    );
}

/// A timeout generous enough for a loaded machine compiling kernels on every rank.
const ENV: [(&str, &str); 1] = [("FITGRAD_DIST_TIMEOUT", "300")];

/// The uninterrupted run (one process, two epochs) against checkpoints that cross rank
/// counts after the first epoch: a sharded save of 4 ZeRO-2 ranks resumed on 2 ZeRO-1 ranks
/// and on one process; a one-file save of 2 ZeRO-2 ranks resumed on one process; one
/// process's resumed on 2 ZeRO-1 ranks.
#[test]
fn checkpoints_resume_on_other_rank_counts_to_the_uninterrupted_run() {
    let _one = one_job_at_a_time();
    let tmp = TempDir::new("resume");
    let single = tmp.path("single.safetensors");
    run_ok(
        one_process(&flags(2, &["--save", &single])),
        "one process, 2 epochs",
    );

    let ckpt = tmp.path("ckpt");
    run_ok(
        mpirun(
            4,
            &flags(1, &["--zero", "2", "--save-sharded", &ckpt]),
            &ENV,
        ),
        "4 ranks at --zero 2, 1 epoch, sharded save",
    );
    let index = fitgrad::distributed::zero::checkpoint::read_index(Path::new(&ckpt)).unwrap();
    assert_eq!(index.ranks, 4);
    for f in &index.files {
        assert!(tmp.0.join("ckpt").join(&f.file).is_file(), "{}", f.file);
    }
    let two = tmp.path("two.safetensors");
    run_ok(
        mpirun(
            2,
            &flags(2, &["--zero", "1", "--resume", &ckpt, "--save", &two]),
            &ENV,
        ),
        "2 ranks at --zero 1 resumed from 4 ranks' shards",
    );
    same_run(&two, &single, "4 ranks' shards resumed on 2 ranks");
    let one = tmp.path("one.safetensors");
    run_ok(
        one_process(&flags(2, &["--resume", &ckpt, "--save", &one])),
        "one process resumed from 4 ranks' shards",
    );
    same_run(&one, &single, "4 ranks' shards resumed on one process");

    let c2 = tmp.path("c2.safetensors");
    run_ok(
        mpirun(2, &flags(1, &["--zero", "2", "--save", &c2]), &ENV),
        "2 ranks at --zero 2, 1 epoch, one-file save",
    );
    let from2 = tmp.path("from2.safetensors");
    run_ok(
        one_process(&flags(2, &["--resume", &c2, "--save", &from2])),
        "one process resumed from 2 ranks' file",
    );
    same_run(&from2, &single, "2 ranks' file resumed on one process");
    let c1 = tmp.path("c1.safetensors");
    run_ok(
        one_process(&flags(1, &["--save", &c1])),
        "one process, 1 epoch",
    );
    let from1 = tmp.path("from1.safetensors");
    run_ok(
        mpirun(
            2,
            &flags(2, &["--zero", "1", "--resume", &c1, "--save", &from1]),
            &ENV,
        ),
        "2 ranks at --zero 1 resumed from one process's file",
    );
    same_run(&from1, &single, "one process's file resumed on 2 ranks");
}

/// A sharded checkpoint without rank 1's file: every rank refuses it before training,
/// naming the file.
#[test]
fn a_sharded_checkpoint_missing_a_rank_file_is_refused_before_training() {
    let _one = one_job_at_a_time();
    let tmp = TempDir::new("missing");
    let ckpt = tmp.path("ckpt");
    run_ok(
        mpirun(
            2,
            &flags(1, &["--zero", "1", "--save-sharded", &ckpt]),
            &ENV,
        ),
        "2 ranks, sharded save",
    );
    let index = fitgrad::distributed::zero::checkpoint::read_index(Path::new(&ckpt)).unwrap();
    let lost = tmp.0.join("ckpt").join(&index.files[1].file);
    std::fs::remove_file(&lost).unwrap();
    let (ok, text) = run(
        mpirun(2, &flags(2, &["--zero", "1", "--resume", &ckpt]), &ENV),
        "2 ranks resumed without rank 1's file",
    );
    refused_for_missing(ok, &text, &lost);
}

/// A small, quick run of custom_model (two blocks, each an `nn::Unit`) for `epochs`, then
/// `more` flags; dropout 0, since each rank draws its own masks.
fn blocks_flags(epochs: u32, more: &[&str]) -> Vec<String> {
    let epochs = epochs.to_string();
    let base = [
        "--dataset",
        "digits",
        "--width",
        "16",
        "--blocks",
        "2",
        "--dropout",
        "0",
        "--epochs",
        &epochs,
        "--batch-size",
        "64",
        "--seed",
        "3",
    ];
    base.iter().chain(more).map(|s| s.to_string()).collect()
}

/// ZeRO stage 3 (custom_model: each rank keeps its shard of every block's parameters): one
/// epoch on 4 ranks saved both sharded (each rank its shard of every unit, of the other
/// parameters and of the optimizer state; an index of groups) and as one file, then the second
/// epoch resumed from the shards on 2 ranks at stage 3, on one process and on 2 ranks at
/// stage 2, and from the one file on 2 ranks at stage 3, each ends with the model and
/// optimizer state of one uninterrupted process. The shards missing a rank's file, or resumed
/// by a model of another width, are refused before training.
#[test]
fn stage_3_checkpoints_resume_on_other_rank_counts_to_the_uninterrupted_run() {
    let _one = one_job_at_a_time();
    let tmp = TempDir::new("stage3");
    let cm = "custom_model";
    let single = tmp.path("single.safetensors");
    run_ok(
        one_process_of(cm, &blocks_flags(2, &["--save", &single])),
        "custom_model, one process, 2 epochs",
    );
    let (ckpt, c4) = (tmp.path("ckpt"), tmp.path("c4.safetensors"));
    let save = ["--zero", "3", "--save-sharded", &ckpt, "--save", &c4];
    run_ok(
        mpirun_np(4, cm, &blocks_flags(1, &save), &ENV),
        "4 ranks at --zero 3, 1 epoch, sharded and one-file saves",
    );
    let index = fitgrad::distributed::zero::checkpoint::read_index(Path::new(&ckpt)).unwrap();
    assert_eq!((index.ranks, index.version), (4, 2));
    // The parameters in no unit, then each block's.
    assert_eq!(index.groups.len(), 3, "{:?}", index.groups);
    assert!(index
        .params
        .iter()
        .all(|p| (p.group > 0) == p.name.starts_with("blocks.")));
    for (k, (np, stage, from, what)) in [
        (
            2,
            "3",
            &ckpt,
            "4 ranks' stage 3 shards resumed on 2 ranks at stage 3",
        ),
        (
            1,
            "3",
            &ckpt,
            "4 ranks' stage 3 shards resumed on one process",
        ),
        (
            2,
            "2",
            &ckpt,
            "4 ranks' stage 3 shards resumed on 2 ranks at stage 2",
        ),
        (
            2,
            "3",
            &c4,
            "4 ranks' stage 3 file resumed on 2 ranks at stage 3",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let out = tmp.path(&format!("resumed-{k}.safetensors"));
        let args = blocks_flags(2, &["--zero", stage, "--resume", from, "--save", &out]);
        let cmd = match np {
            1 => one_process_of(cm, &args),
            _ => mpirun_np(np, cm, &args, &ENV),
        };
        let text = run_ok(cmd, what);
        assert!(text.contains("resumed from"), "{what}:\n{text}");
        same_run(&out, &single, what);
    }

    let mut wider = blocks_flags(2, &["--zero", "3", "--resume", &ckpt]);
    let at = wider.iter().position(|f| f == "--width").unwrap() + 1;
    wider[at] = "32".into();
    let (ok, text) = run(
        mpirun_np(2, cm, &wider, &ENV),
        "2 ranks of a wider model resumed from the shards",
    );
    assert!(
        !ok && !text.contains("resumed from"),
        "another model resumed:\n{text}"
    );
    assert!(
        text.contains("width") && !text.contains("panicked"),
        "{text}"
    );

    let lost = tmp.0.join("ckpt").join(&index.files[1].file);
    std::fs::remove_file(&lost).unwrap();
    let (ok, text) = run(
        mpirun_np(
            2,
            cm,
            &blocks_flags(2, &["--zero", "3", "--resume", &ckpt]),
            &ENV,
        ),
        "2 ranks at --zero 3 resumed without rank 1's file",
    );
    refused_for_missing(ok, &text, &lost);
}

/// A resume from shards missing `lost` failed, naming the file, before any training.
fn refused_for_missing(ok: bool, text: &str, lost: &Path) {
    assert!(!ok, "a checkpoint missing a file must be refused:\n{text}");
    assert!(
        text.contains(&lost.display().to_string()) && text.contains("missing"),
        "the error names the missing file:\n{text}"
    );
    assert!(!text.contains("resumed from"), "nothing trains:\n{text}");
}
