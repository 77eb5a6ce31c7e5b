//! ZeRO checkpoints over MPI (the `mpi` feature), through train_mlp under mpirun: a sharded
//! checkpoint of 4 ranks resumes on 2 ranks and on one process, and a one-file (consolidated)
//! checkpoint moves from 2 ranks to one process and back, each to the weights and optimizer
//! state of one uninterrupted process within 1e-5 relative; a sharded checkpoint missing a
//! rank's file is refused on every rank before training, naming the file. (A rank killed or
//! stopped at every stage: tests/mpi.rs.)
//!
//! Build the example first: `cargo build --features mpi --example train_mlp && cargo test
//! --features mpi --test mpi_checkpoint` (what .ci/run does).
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// One job at a time: the machine may have two cores.
fn one_job_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// train_mlp built beside this test binary (target/<profile>/examples/train_mlp).
fn train_mlp() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let path = profile_dir.join("examples").join("train_mlp");
    assert!(
        path.exists(),
        "{} is missing: build it first with `cargo build --features mpi --example train_mlp`",
        path.display()
    );
    path
}

/// A temporary folder removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("fitgrad-mpick-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

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
    let mut cmd = Command::new("mpirun");
    let np = np.to_string();
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", &np]);
    // Containers often forbid the cross-memory attach OpenMPI's shared-memory transport tries
    // first; copying through shared memory works everywhere.
    cmd.args(["--mca", "btl_vader_single_copy_mechanism", "none"]);
    for (k, v) in env {
        cmd.env(k, v);
        cmd.args(["-x", k]);
    }
    cmd.arg(train_mlp())
        .args(args)
        .arg("--distributed")
        .arg("mpi");
    cmd
}

fn one_process(args: &[String]) -> Command {
    let mut cmd = Command::new(train_mlp());
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
    assert!(!ok, "a checkpoint missing a file must be refused:\n{text}");
    assert!(
        text.contains(&lost.display().to_string()) && text.contains("missing"),
        "the error names the missing file:\n{text}"
    );
    assert!(!text.contains("resumed from"), "nothing trains:\n{text}");
}
