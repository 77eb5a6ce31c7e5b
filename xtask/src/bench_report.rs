//! The benchmark report's data (what report.json holds) and its Markdown form.
//!
//! report.json is the one source: report.md and report.html are rendered from a [`Report`], so
//! `--html-from report.json` gives the page a run would have written.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// Bumped when a field changes meaning or goes away.
pub const SCHEMA: u32 = 2;

/// One run of `cargo xtask bench`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// [`SCHEMA`] of the writer.
    pub schema: u32,
    /// What the figures depend on besides the adapter.
    pub context: Context,
    /// Every adapter the run tried, in order, failed ones included.
    pub adapters: Vec<AdapterRecord>,
    /// Every figure, adapter after adapter.
    pub results: Vec<Figure>,
}

/// Versions, commit, OS, host and run settings.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Context {
    /// The fitgrad package's version.
    pub fitgrad_version: String,
    /// `git rev-parse HEAD` of the workspace, or "unknown".
    pub git_commit: String,
    /// Whether tracked files differed from the commit (`None`: no git).
    pub git_dirty: Option<bool>,
    /// The wgpu crate's version from Cargo.lock.
    pub wgpu_version: String,
    /// Distribution, kernel, OS and architecture.
    pub os: String,
    /// The host CPU (what CPU adapters run on).
    pub host_cpu: HostCpu,
    /// The cargo profile of the measured code.
    pub profile: String,
    /// `--quick`: fewer repetitions and shapes.
    pub quick: bool,
    /// `--train-only`.
    pub train_only: bool,
    /// `FITGRAD_AUTOTUNE_BUDGET` during the run, seconds.
    pub autotune_budget_s: String,
    /// When the run started, UTC.
    pub started_utc: String,
    /// Wall time of the whole run.
    pub seconds: f64,
}

/// The host CPU.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostCpu {
    /// Model name (/proc/cpuinfo `model name` on x86).
    pub model: String,
    /// Logical CPUs the OS lists.
    pub logical_cpus: usize,
    /// Threads this process may use (affinity, cgroup quota).
    pub available_threads: usize,
    /// SIMD extensions present, in /proc/cpuinfo's names (avx2, avx512f, asimd, sve, ...).
    pub vector_extensions: Vec<String>,
}

/// One adapter of the run and how it went.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AdapterRecord {
    /// "name / backend": unique in a run, the key figures refer to.
    pub id: String,
    /// Name as the driver reports it.
    pub name: String,
    /// Vendor name from the PCI id.
    pub vendor: String,
    /// wgpu backend.
    pub backend: String,
    /// Discrete, integrated, virtual or CPU.
    pub device_type: String,
    /// Driver name.
    pub driver: String,
    /// Driver version text.
    pub driver_info: String,
    /// Device-local memory where the backend reports it.
    pub memory_bytes: Option<u64>,
    /// What the opened device offers (`None` when it did not open).
    pub device: Option<DeviceCaps>,
    /// The host CPU, for CPU adapters (their speed is the host's).
    pub host_cpu: Option<HostCpu>,
    /// "ok" or "failed".
    pub status: String,
    /// The error (or panic) that stopped this adapter; figures before it are kept.
    pub error: Option<String>,
    /// Wall time spent on this adapter.
    pub seconds: f64,
}

/// Features and limits of an opened device.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceCaps {
    /// f16 math in f16 (SHADER_F16); otherwise packed f16 computed in f32.
    pub f16_native: bool,
    /// Subgroup size where subgroups exist with one fixed size.
    pub subgroup_size: Option<u32>,
    /// Workgroup memory, bytes.
    pub max_workgroup_storage_bytes: u32,
    /// Invocations per workgroup.
    pub max_invocations_per_workgroup: u32,
    /// Largest storage binding, bytes.
    pub max_storage_binding_bytes: u64,
}

/// Timing of repeated runs, after one warm-up run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Timing {
    /// Timed repetitions.
    pub reps: usize,
    /// Fastest, ms.
    pub min_ms: f64,
    /// Median, ms (what rates are computed from).
    pub median_ms: f64,
    /// Slowest, ms.
    pub max_ms: f64,
}

impl Timing {
    /// From the seconds of each repetition (not empty).
    pub fn from_secs(mut t: Vec<f64>) -> Timing {
        assert!(!t.is_empty(), "at least one timed run");
        t.sort_by(f64::total_cmp);
        Timing {
            reps: t.len(),
            min_ms: t[0] * 1e3,
            median_ms: t[t.len() / 2] * 1e3,
            max_ms: t[t.len() - 1] * 1e3,
        }
    }
}

/// One measured operation on one adapter.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Figure {
    /// [`AdapterRecord::id`].
    pub adapter: String,
    /// The operation (a chart and a table each).
    pub op: String,
    /// Shape (a row of the table, a group of bars).
    pub shape: String,
    /// Element type.
    pub dtype: String,
    /// The kernel variant chosen, where there is a choice.
    pub kernel: String,
    /// Anything else measured with it (peak memory).
    pub note: String,
    /// Unit of the rates.
    pub unit: String,
    /// Its time.
    pub time: Timing,
    /// Work per second at the median time.
    pub rate: f64,
    /// At the slowest run.
    pub rate_at_max_ms: f64,
    /// At the fastest run.
    pub rate_at_min_ms: f64,
    /// References measured in the same run.
    pub references: Vec<Reference>,
}

/// A reference for a figure: the same work done another way, or a copy of the same bytes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Reference {
    /// "naive kernel", "cpu sgemm 1 thread", "copy engine", ...
    pub name: String,
    /// Its time.
    pub time: Timing,
    /// Its rate in the figure's unit, at its median.
    pub rate: f64,
    /// The figure's rate over this one (above 1: the figure is faster).
    pub ratio: f64,
}

/// A number as the reports print it: about four significant digits.
pub fn num(x: f64) -> String {
    let a = x.abs();
    if !x.is_finite() {
        x.to_string()
    } else if a == 0.0 {
        "0".into()
    } else if a >= 1000.0 {
        format!("{x:.0}")
    } else if a >= 100.0 {
        format!("{x:.1}")
    } else if a >= 10.0 {
        format!("{x:.2}")
    } else if a >= 0.01 {
        format!("{x:.3}")
    } else {
        format!("{x:.2e}")
    }
}

/// "1.23 ms (min 1.20, max 1.31, 10 reps)".
pub fn timing_text(t: &Timing) -> String {
    format!(
        "{} ms (min {}, max {}, {} reps)",
        num(t.median_ms),
        num(t.min_ms),
        num(t.max_ms),
        t.reps
    )
}

/// "12.3x naive kernel (0.40 GFLOP/s, 30.1 ms (min ..., 1 reps))".
pub fn reference_text(r: &Reference, unit: &str) -> String {
    format!(
        "{}x {} ({} {unit}, {})",
        num(r.ratio),
        r.name,
        num(r.rate),
        timing_text(&r.time)
    )
}

/// "yes" / "no" / "unknown".
pub fn yes_no(b: Option<bool>) -> &'static str {
    match b {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown",
    }
}

impl Report {
    /// The adapters that failed.
    pub fn failed(&self) -> impl Iterator<Item = &AdapterRecord> {
        self.adapters.iter().filter(|a| a.status != "ok")
    }

    /// Reads report.json.
    pub fn load(path: &Path) -> Result<Report, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let r: Report = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not a benchmark report: {e}", path.display()))?;
        if r.schema != SCHEMA {
            return Err(format!(
                "{} has report schema {}, this xtask reads {SCHEMA}: run `cargo xtask bench` again",
                path.display(),
                r.schema
            ));
        }
        Ok(r)
    }

    /// The Markdown report: context, adapters, then one row per figure.
    pub fn markdown(&self) -> String {
        let c = &self.context;
        let mut md = String::from("# fitgrad benchmark report\n\n");
        md += &format!(
            "fitgrad {} at {}{}, wgpu {}, {}; profile {}{}; started {} UTC, {} s\n\n",
            c.fitgrad_version,
            c.git_commit,
            match c.git_dirty {
                Some(true) => " (with uncommitted changes)",
                _ => "",
            },
            c.wgpu_version,
            c.os,
            c.profile,
            if c.quick { ", --quick" } else { "" },
            c.started_utc,
            num(c.seconds)
        );
        md += &format!("host CPU: {}\n\n", cpu_text(&c.host_cpu));
        md += "| adapter | vendor | type | driver | memory | f16 | subgroups | status |\n|---|---|---|---|---|---|---|---|\n";
        for a in &self.adapters {
            md += &format!(
                "| {} | {} | {} | {} {} | {} | {} | {} | {} |\n",
                a.id,
                a.vendor,
                a.device_type,
                a.driver,
                a.driver_info,
                memory_text(a.memory_bytes),
                a.device.as_ref().map_or("unknown", |d| if d.f16_native {
                    "native"
                } else {
                    "packed"
                }),
                subgroup_text(a.device.as_ref()),
                match &a.error {
                    Some(e) => format!("FAILED: {}", e.replace('|', "/").replace('\n', " ")),
                    None => format!("ok, {} s", num(a.seconds)),
                }
            );
        }
        md += "\n| adapter | op | shape | dtype | kernel | time | rate | vs references | note |\n|---|---|---|---|---|---|---|---|---|\n";
        for f in &self.results {
            let vs: Vec<String> = f
                .references
                .iter()
                .map(|r| reference_text(r, &f.unit))
                .collect();
            md += &format!(
                "| {} | {} | {} | {} | {} | {} | {} {} ({}–{}) | {} | {} |\n",
                f.adapter,
                f.op,
                f.shape,
                f.dtype,
                f.kernel,
                timing_text(&f.time),
                num(f.rate),
                f.unit,
                num(f.rate_at_max_ms),
                num(f.rate_at_min_ms),
                vs.join("; "),
                f.note
            );
        }
        md
    }
}

/// "AMD EPYC 7B13, 2 logical CPUs (2 available), avx avx2 fma".
pub fn cpu_text(c: &HostCpu) -> String {
    format!(
        "{}, {} logical CPUs ({} available to this process), vector extensions: {}",
        c.model,
        c.logical_cpus,
        c.available_threads,
        if c.vector_extensions.is_empty() {
            "none found".to_string()
        } else {
            c.vector_extensions.join(" ")
        }
    )
}

/// "2.00 GiB (2147483648 bytes)" or "not reported".
pub fn memory_text(m: Option<u64>) -> String {
    match m {
        Some(b) => format!("{} ({b} bytes)", fitgrad::Bytes(b)),
        None => "not reported".into(),
    }
}

/// "8 lanes", "none of fixed size" or "unknown" (device not opened).
pub fn subgroup_text(d: Option<&DeviceCaps>) -> String {
    match d {
        None => "unknown".into(),
        Some(DeviceCaps {
            subgroup_size: Some(n),
            ..
        }) => format!("{n} lanes"),
        Some(_) => "none of fixed size".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_sorts_and_takes_the_middle() {
        let t = Timing::from_secs(vec![0.003, 0.001, 0.002]);
        assert_eq!(
            (t.reps, t.min_ms, t.median_ms, t.max_ms),
            (3, 1.0, 2.0, 3.0)
        );
        let one = Timing::from_secs(vec![0.5]);
        assert_eq!(
            (one.min_ms, one.median_ms, one.max_ms),
            (500.0, 500.0, 500.0)
        );
    }

    /// report.md names each failed adapter with its error and lists the figures it had.
    #[test]
    fn markdown_reports_failures() {
        let r: Report =
            serde_json::from_str(include_str!("../tests/fixtures/report.json")).unwrap();
        let md = r.markdown();
        let failed: Vec<_> = r.failed().collect();
        assert!(failed.len() >= 2);
        for a in failed {
            let e = a.error.as_deref().unwrap();
            assert!(
                md.contains(&format!("FAILED: {}", e.replace('|', "/"))),
                "{e}"
            );
        }
        // A row per figure after the two header lines of the figures table.
        let rows = md.split("| adapter | op |").nth(1).unwrap().lines().count() - 2;
        assert_eq!(rows, r.results.len());
    }

    #[test]
    fn numbers_keep_four_digits() {
        assert_eq!(num(1234.56), "1235");
        assert_eq!(num(123.456), "123.5");
        assert_eq!(num(12.3456), "12.35");
        assert_eq!(num(1.23456), "1.235");
        assert_eq!(num(0.0123), "0.012");
        assert_eq!(num(0.000123), "1.23e-4");
        assert_eq!(num(0.0), "0");
    }
}
