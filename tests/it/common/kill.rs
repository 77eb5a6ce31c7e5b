//! Processes killed while they save: the harness of the kill tests (tests/checkpoint.rs,
//! tests/stream_params.rs). The child, an ignored test of the same binary, saves to one path
//! over and over and counts its saves in a progress file; the parent kills it (SIGKILL) at a
//! random point of a save, every other time within the file write, and checks what is left.

use super::HostRng;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A child's side: where to save, where to count, and the number of its first save.
pub struct Child {
    pub path: PathBuf,
    progress: PathBuf,
    pub first: u64,
}

impl Child {
    /// The child's spec from `env` ("<checkpoint>;<progress file>;<first save>"), or `None`
    /// when this process is not a child.
    pub fn from_env(env: &str) -> Option<Child> {
        let spec = std::env::var(env).ok()?;
        let mut parts = spec.split(';');
        Some(Child {
            path: PathBuf::from(parts.next().unwrap()),
            progress: PathBuf::from(parts.next().unwrap()),
            first: parts.next().unwrap().parse().unwrap(),
        })
    }

    /// Calls `save(n)` for n = first, first + 1, … until killed (or a minute passes),
    /// counting each finished save.
    pub fn save_until_killed(&self, mut save: impl FnMut(u64)) {
        let start = Instant::now();
        for n in self.first.. {
            save(n);
            std::fs::write(&self.progress, format!("{}", n - self.first + 1)).unwrap();
            if start.elapsed() > Duration::from_secs(60) {
                break;
            }
        }
    }
}

fn saves_done(progress: &Path) -> u64 {
    std::fs::read_to_string(progress)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// The files in `dir` whose names start with `prefix`.
fn files_starting(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect()
}

/// Runs `kills` rounds. Each spawns `child_test` of this test binary with `env` naming `path`
/// (its saves numbered from round × 1,000,000), waits for one of its saves (two in the first,
/// to time one), kills it during a later one, removes the temporary file it left (at most
/// one) and calls `check(round, first save number)` on what is at `path`. Returns how many
/// kills landed within a file write; asserts there was at least one.
pub fn kill_during_saves(
    child_test: &str,
    env: &str,
    path: &Path,
    kills: u64,
    mut check: impl FnMut(u64, u64),
) -> u64 {
    let dir = path.parent().unwrap();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let mut rng = HostRng::new(seed);
    eprintln!("kill test: random seed {seed}");
    let exe = std::env::current_exe().unwrap();
    let mut save_time = Duration::from_millis(500);
    let mut mid_write = 0;
    for round in 0..kills {
        let progress = dir.join(format!("progress-{round}"));
        let log = dir.join(format!("child-{round}.log"));
        let first = round * 1_000_000;
        let mut child = std::process::Command::new(&exe)
            .args([
                "--exact",
                child_test,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                env,
                format!("{};{};{first}", path.display(), progress.display()),
            )
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let want = if round == 0 { 2 } else { 1 };
        let t0 = Instant::now();
        let mut t1 = None;
        while saves_done(&progress) < want {
            if saves_done(&progress) == 1 && t1.is_none() {
                t1 = Some(Instant::now());
            }
            if let Some(status) = child.try_wait().unwrap() {
                let log = std::fs::read_to_string(&log);
                panic!("the child exited ({status}) before saving: {log:?}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(180),
                "the child never saved"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        if let Some(t1) = t1 {
            save_time = t1.elapsed();
            eprintln!("kill test: one save takes {save_time:?}");
        }
        // write_atomic's temporary file (`.NAME.tmp-PID-RANDOM`) exists from the start of the
        // file write to the rename.
        let tmp_prefix = format!(".{name}.tmp-{}-", child.id());
        if round % 2 == 0 {
            // Anywhere in a save: reading back, serializing, writing, syncing, renaming.
            std::thread::sleep(save_time.mul_f64((rng.next_u64() % 1000) as f64 / 1000.0));
        } else {
            // Within the file write: once the temporary file is there, up to 5 ms later.
            let t0 = Instant::now();
            while files_starting(dir, &tmp_prefix).is_empty()
                && t0.elapsed() < Duration::from_secs(30)
            {
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(Duration::from_micros(rng.next_u64() % 5000));
        }
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        let left = files_starting(dir, &tmp_prefix);
        assert!(
            left.len() <= 1,
            "round {round}: {left:?}: one save at a time"
        );
        if let Some(tmp_file) = left.first() {
            mid_write += 1;
            std::fs::remove_file(tmp_file).unwrap();
        }
        check(round, first);
    }
    eprintln!(
        "kill test: {kills} kills, {mid_write} of them while the temporary file was being \
         written (left behind as .{name}.tmp-PID-RANDOM, removed here); the checkpoint loaded \
         every time"
    );
    assert!(
        mid_write > 0,
        "no kill landed while a file was being written"
    );
    mid_write
}
