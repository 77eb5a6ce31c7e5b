//! ZeRO checkpoints over MPI (the `mpi` feature), through train_mlp under mpirun: a sharded
//! checkpoint of 4 ranks resumes on 2 ranks and on one process, and a one-file (consolidated)
//! checkpoint moves from 2 ranks to one process and back, each to the weights and optimizer
//! state of one uninterrupted process within 1e-5 relative; a sharded checkpoint missing a
//! rank's file is refused on every rank before training, naming the file. At ZeRO stages 1
//! and 2, a rank that is killed or stopped ends the job within 30 s.
//!
//! Build the example first: `cargo build --features mpi --example train_mlp && cargo test
//! --features mpi --test mpi_checkpoint` (what .ci/run does).
#![cfg(feature = "mpi")]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a job may take to end after one of its ranks is killed or stopped.
const STOP_WITHIN: Duration = Duration::from_secs(30);

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

/// Sends `sig` to `pid` through the shell's own `kill`; whether it was sent.
fn kill(sig: &str, pid: u32) -> bool {
    Command::new("sh")
        .args(["-c", &format!("kill {sig} {pid} 2>/dev/null")])
        .status()
        .is_ok_and(|s| s.success())
}

/// A running 2-rank job at a ZeRO stage: mpirun, the ranks' pids (from their start-up line)
/// and everything the job wrote to stderr so far.
struct Job {
    child: Child,
    pids: Vec<u32>,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
}

impl Job {
    fn start(stage: u8, env: &[(&str, &str)]) -> Job {
        let stage = stage.to_string();
        let mut child = mpirun(2, &flags(100_000, &["--zero", &stage]), env)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mpirun starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut job = Job {
            child,
            pids: vec![0; 2],
            lines,
            log: Vec::new(),
        };
        // "rank R of 2: pid P, ..." once a rank has joined training.
        let deadline = Instant::now() + Duration::from_secs(300);
        while job.pids.contains(&0) {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = job
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("the ranks did not start:\n{}", job.log.join("\n")));
            if let Some(rest) = line.strip_prefix("rank ") {
                let parsed = (|| {
                    let rank: usize = rest.split(' ').next()?.parse().ok()?;
                    let pid = rest.split("pid ").nth(1)?.split(',').next()?.parse().ok()?;
                    Some((rank, pid))
                })();
                if let Some((rank, pid)) = parsed {
                    job.pids[rank] = pid;
                }
            }
            job.log.push(line);
        }
        job
    }

    fn signal(&self, sig: &str, rank: usize) {
        assert!(kill(sig, self.pids[rank]), "kill {sig} {}", self.pids[rank]);
    }

    /// Waits up to `limit` for mpirun to end; its status and the whole stderr.
    fn wait(&mut self, limit: Duration) -> (Option<std::process::ExitStatus>, String) {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break Some(s);
            }
            if Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let drain = Instant::now() + Duration::from_secs(5);
        while let Ok(l) = self
            .lines
            .recv_timeout(drain.saturating_duration_since(Instant::now()))
        {
            self.log.push(l);
        }
        (status, self.log.join("\n"))
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Nothing outlives the test, whatever it found.
        for pid in &self.pids {
            if *pid != 0 {
                kill("-KILL", *pid);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// SIGKILL of rank 1 mid-run at ZeRO stages 1 and 2: the job ends with an error within 30 s,
/// and the log names the rank.
#[test]
fn a_killed_rank_stops_the_other_within_30_s_at_zero_1_and_2() {
    let _one = one_job_at_a_time();
    for stage in [1, 2] {
        let mut job = Job::start(stage, &[]);
        std::thread::sleep(Duration::from_secs(2));
        let killed = Instant::now();
        job.signal("-KILL", 1);
        let before = job.log.len();
        let (status, log) = job.wait(STOP_WITHIN);
        let after = job.log[before..].join("\n");
        let status = status.unwrap_or_else(|| {
            panic!(
                "--zero {stage}: the job still ran {STOP_WITHIN:?} after rank 1 was killed:\n{log}"
            )
        });
        assert!(
            !status.success(),
            "--zero {stage}: the job must fail:\n{log}"
        );
        // Said after the kill (the start-up lines name every rank too).
        assert!(
            after.contains("rank 1"),
            "--zero {stage}: the log names the killed rank after the kill:\n{log}"
        );
        eprintln!(
            "--zero {stage}: the job ended {:?} after the kill ({status})",
            killed.elapsed()
        );
    }
}

/// SIGSTOP of rank 1 mid-run (alive, never answering) at ZeRO stages 1 and 2: rank 0's
/// collective times out, it says so and aborts every rank, within 30 s.
#[test]
fn a_stopped_rank_times_out_and_stops_every_rank_at_zero_1_and_2() {
    let _one = one_job_at_a_time();
    for stage in [1, 2] {
        let mut job = Job::start(stage, &[("FITGRAD_DIST_TIMEOUT", "5")]);
        std::thread::sleep(Duration::from_secs(2));
        let stopped = Instant::now();
        job.signal("-STOP", 1);
        let (status, log) = job.wait(STOP_WITHIN);
        let status = status.unwrap_or_else(|| {
            panic!("--zero {stage}: the job still ran {STOP_WITHIN:?} after rank 1 was stopped:\n{log}")
        });
        assert!(
            !status.success(),
            "--zero {stage}: the job must fail:\n{log}"
        );
        assert!(
            log.contains("rank 0 of 2") && log.contains("did not complete within 5 s"),
            "--zero {stage}: rank 0 must say which collective timed out:\n{log}"
        );
        eprintln!(
            "--zero {stage}: the job ended {:?} after the stop ({status})",
            stopped.elapsed()
        );
    }
}
