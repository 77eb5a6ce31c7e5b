//! What the MPI tests share: the examples built beside the test binary, run under mpirun one
//! job at a time, and their output.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// One job at a time: each runs two ranks, and the machine may have two cores.
pub fn one_job_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The example `name` built beside this test binary (target/<profile>/examples/<name>).
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: build it first with `cargo build --features mpi --example {name}` \
         (add --release when testing with --release)",
        path.display()
    );
    path
}

/// A temporary folder removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("fitgrad-mpi-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    /// The path of `name` inside the folder, as a string (for a flag).
    pub fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Owned strings of `flags`.
pub fn strings(flags: &[&str]) -> Vec<String> {
    flags.iter().map(|s| s.to_string()).collect()
}

/// mpirun with `np` ranks of the example `name`; `env` reaches every rank.
pub fn mpirun_np(np: usize, name: &str, args: &[String], env: &[(&str, &str)]) -> Command {
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
    cmd.arg(example(name))
        .args(args)
        .arg("--distributed")
        .arg("mpi");
    cmd
}

/// Runs `cmd` and returns its stdout and stderr; panics naming `what` when it fails.
pub fn run_ok(mut cmd: Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}
