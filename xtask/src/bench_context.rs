//! What a benchmark figure depends on besides the kernel: versions, commit, OS, host CPU, and
//! where the reports go.
//!
//! A CPU adapter (lavapipe, llvmpipe, WARP) runs on the host's cores, so its figures are only
//! comparable with the CPU model, core count and vector extensions beside them.

use crate::bench_report::{Context, HostCpu};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace's lock file, read at compile time: the versions the measured binary was built
/// with (`cargo` rebuilds xtask when it changes).
const CARGO_LOCK: &str = include_str!("../../Cargo.lock");

/// The workspace root (the fitgrad package).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Cargo's target folder: `CARGO_TARGET_DIR` (relative to the current folder, as cargo reads
/// it), else the ancestor of this binary that holds cargo's `CACHEDIR.TAG` (a `target-dir`
/// from a config file), else `target/` in the workspace.
pub fn target_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        let d = PathBuf::from(d);
        return if d.is_relative() {
            std::env::current_dir().map(|c| c.join(&d)).unwrap_or(d)
        } else {
            d
        };
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.ancestors().find(|a| a.join("CACHEDIR.TAG").is_file()) {
            return dir.to_path_buf();
        }
    }
    workspace_root().join("target")
}

/// `version = "..."` of the first package named `name` in a Cargo.lock text.
pub fn lock_version<'a>(lock: &'a str, name: &str) -> Option<&'a str> {
    let needle = format!("name = \"{name}\"\n");
    let at = lock.find(&needle)? + needle.len();
    let rest = lock[at..].strip_prefix("version = \"")?;
    rest.split('"').next()
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(workspace_root())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The context of a run that starts now; `seconds` is filled in at the end.
pub fn gather(profile: &str, quick: bool, train_only: bool) -> Context {
    let commit = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    // Tracked files changed since the commit: the measured code is not the commit's.
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).map(|s| !s.is_empty());
    Context {
        fitgrad_version: lock_version(CARGO_LOCK, "fitgrad")
            .unwrap_or("unknown")
            .into(),
        git_commit: commit,
        git_dirty: dirty,
        wgpu_version: lock_version(CARGO_LOCK, "wgpu").unwrap_or("unknown").into(),
        os: os_description(),
        host_cpu: host_cpu(),
        profile: profile.into(),
        quick,
        train_only,
        autotune_budget_s: std::env::var("FITGRAD_AUTOTUNE_BUDGET").unwrap_or_default(),
        started_utc: utc_now(),
        seconds: 0.0,
    }
}

/// "Debian GNU/Linux 12 (bookworm), kernel 6.1.0-18-amd64, linux x86_64".
fn os_description() -> String {
    let mut parts = Vec::new();
    if let Ok(text) = std::fs::read_to_string("/etc/os-release") {
        if let Some(name) = text
            .lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME="))
            .map(|v| v.trim_matches('"').to_string())
        {
            parts.push(name);
        }
    }
    if let Ok(k) = std::fs::read_to_string("/proc/sys/kernel/osrelease") {
        parts.push(format!("kernel {}", k.trim()));
    }
    parts.push(format!(
        "{} {}",
        std::env::consts::OS,
        std::env::consts::ARCH
    ));
    parts.join(", ")
}

/// The vector extensions that decide a CPU adapter's speed, as /proc/cpuinfo names them (x86
/// `flags`, Arm `Features`).
const VECTOR_FLAGS: &[&str] = &[
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "asimd",
    "asimdhp",
    "asimddp",
    "sve",
    "sve2",
    "i8mm",
    "bf16",
];

fn host_cpu() -> HostCpu {
    let available = std::thread::available_parallelism().map_or(0, |n| n.get());
    match std::fs::read_to_string("/proc/cpuinfo") {
        Ok(text) => parse_cpuinfo(&text, available),
        Err(_) => HostCpu {
            model: other_os_cpu_model().unwrap_or_else(|| "unknown".into()),
            logical_cpus: available,
            available_threads: available,
            vector_extensions: detected_extensions(),
        },
    }
}

/// The host CPU from /proc/cpuinfo's text (x86: `model name`, `flags`; Arm: `Features`, and a
/// model name only on some kernels).
pub fn parse_cpuinfo(text: &str, available_threads: usize) -> HostCpu {
    let field = |key: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    let model = field("model name")
        .or_else(|| field("Model"))
        .or_else(|| field("Hardware"))
        .or_else(|| {
            let (imp, part) = (field("CPU implementer")?, field("CPU part")?);
            Some(format!("Arm implementer {imp} part {part}"))
        })
        .unwrap_or_else(|| "unknown".into());
    let logical = text
        .lines()
        .filter(|l| l.split(':').next().map(str::trim) == Some("processor"))
        .count();
    let flags = field("flags")
        .or_else(|| field("Features"))
        .unwrap_or_default();
    let have: Vec<&str> = flags.split_whitespace().collect();
    let vector_extensions = VECTOR_FLAGS
        .iter()
        .filter(|f| have.contains(f))
        .map(|f| f.to_string())
        .collect();
    HostCpu {
        model,
        logical_cpus: logical,
        available_threads,
        vector_extensions,
    }
}

fn other_os_cpu_model() -> Option<String> {
    if cfg!(target_os = "macos") {
        let out = Command::new("sysctl")
            .args(["-n", "machdep.cpu.brand_string"])
            .output()
            .ok()?;
        return Some(String::from_utf8_lossy(&out.stdout).trim().to_string());
    }
    std::env::var("PROCESSOR_IDENTIFIER").ok()
}

/// Where there is no /proc/cpuinfo: what the standard library detects, in cpuinfo's names.
fn detected_extensions() -> Vec<String> {
    #[allow(unused_mut)]
    let mut v: Vec<&str> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        let found = [
            ("sse4_2", is_x86_feature_detected!("sse4.2")),
            ("avx", is_x86_feature_detected!("avx")),
            ("avx2", is_x86_feature_detected!("avx2")),
            ("fma", is_x86_feature_detected!("fma")),
            ("f16c", is_x86_feature_detected!("f16c")),
            ("avx512f", is_x86_feature_detected!("avx512f")),
            ("avx512bw", is_x86_feature_detected!("avx512bw")),
            ("avx512vl", is_x86_feature_detected!("avx512vl")),
        ];
        v.extend(found.iter().filter(|f| f.1).map(|f| f.0));
    }
    #[cfg(target_arch = "aarch64")]
    {
        let found = [
            ("asimd", std::arch::is_aarch64_feature_detected!("neon")),
            ("asimdhp", std::arch::is_aarch64_feature_detected!("fp16")),
            (
                "asimddp",
                std::arch::is_aarch64_feature_detected!("dotprod"),
            ),
            ("sve", std::arch::is_aarch64_feature_detected!("sve")),
            ("sve2", std::arch::is_aarch64_feature_detected!("sve2")),
        ];
        v.extend(found.iter().filter(|f| f.1).map(|f| f.0));
    }
    v.into_iter().map(String::from).collect()
}

/// The current time as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc_from_unix(secs)
}

/// Civil date of a Unix time (the days-from-civil algorithm run backwards).
pub fn utc_from_unix(secs: u64) -> String {
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_come_from_the_lock_file() {
        let lock = "[[package]]\nname = \"wgpu-core\"\nversion = \"9\"\n\n[[package]]\nname = \"wgpu\"\nversion = \"30.0.2\"\n";
        assert_eq!(lock_version(lock, "wgpu"), Some("30.0.2"));
        assert_eq!(lock_version(lock, "naga"), None);
        assert!(lock_version(CARGO_LOCK, "wgpu").is_some_and(|v| v.starts_with("30.")));
    }

    #[test]
    fn cpuinfo_x86_and_arm() {
        let x86 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_2 avx avx2 fma\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_2 avx avx2 fma\n";
        let c = parse_cpuinfo(x86, 2);
        assert_eq!(c.model, "AMD EPYC 7B13");
        assert_eq!(c.logical_cpus, 2);
        assert_eq!(c.vector_extensions, ["sse4_2", "avx", "avx2", "fma"]);
        let arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm asimddp sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n";
        let c = parse_cpuinfo(arm, 1);
        assert_eq!(c.model, "Arm implementer 0x41 part 0xd40");
        assert_eq!(c.vector_extensions, ["asimd", "asimddp", "sve"]);
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc_from_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_from_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_from_unix(1_735_689_599), "2024-12-31T23:59:59Z");
    }
}
