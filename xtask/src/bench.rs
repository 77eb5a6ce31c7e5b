//! `cargo xtask bench [--quick] [--all-backends] [--train-only] [--adapter NAME]`: the
//! cross-vendor benchmark;
//! `cargo xtask bench --html-from report.json [--out page.html]`: its page again, no benchmark.
//!
//! Runs one set of kernels on every adapter wgpu finds (or those whose name contains NAME) and
//! writes report.json, report.md and report.html under `<target dir>/bench/`. Each figure keeps
//! its repetitions and spread, and the references measured in the same run, so it reads as a
//! ratio: matmul against a naive one-invocation-per-output kernel on the same adapter and a
//! single-threaded CPU sgemm (the `matrixmultiply` crate); softmax and add against a buffer
//! copy of the same tensor (the copy engine) and a copy kernel; fused attention against the
//! same math composed from matmul and softmax; a training step against its matmuls alone. An
//! adapter that fails (it does not open, a kernel errs, the device is lost, something panics)
//! is recorded as failed with its error and the figures it had, and the next adapter runs.
//! The measurements themselves are in bench_ops.rs; this file is the command around them.

use crate::bench_context::{self, target_dir};
use crate::bench_ops::Bench;
use crate::bench_report::{AdapterRecord, DeviceCaps, Figure, HostCpu, Report, SCHEMA};
use fitgrad::{AdapterSummary, Device, DeviceOptions};
use std::path::PathBuf;
use std::time::Instant;

struct Opts {
    quick: bool,
    /// Only the training-step entry.
    train_only: bool,
    adapter: Option<String>,
    /// With `quick`, every backend of an adapter (not only the first).
    all_backends: bool,
    /// Render this report.json as a page and stop.
    html_from: Option<PathBuf>,
    /// Where `--html-from` writes the page.
    out: Option<PathBuf>,
}

const USAGE: &str =
    "use [--quick] [--all-backends] [--train-only] [--adapter NAME], or --html-from REPORT.json [--out PAGE.html]";

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        quick: false,
        train_only: false,
        adapter: None,
        all_backends: false,
        html_from: None,
        out: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |flag: &str| it.next().cloned().ok_or(format!("{flag} needs a value"));
        match a.as_str() {
            "--quick" => o.quick = true,
            "--train-only" => o.train_only = true,
            "--all-backends" => o.all_backends = true,
            "--adapter" => o.adapter = Some(value("--adapter")?),
            "--html-from" => o.html_from = Some(value("--html-from")?.into()),
            "--out" => o.out = Some(value("--out")?.into()),
            other => return Err(format!("unknown argument {other}; {USAGE}")),
        }
    }
    if o.out.is_some() && o.html_from.is_none() {
        return Err(format!("--out goes with --html-from; {USAGE}"));
    }
    Ok(o)
}

/// Whether these arguments only render a page (no benchmark, so no release build needed).
pub fn renders_only(args: &[String]) -> bool {
    args.iter().any(|a| a == "--html-from")
}

/// The cargo profile this binary (and the fitgrad code it measures) was built with.
const PROFILE: &str = if cfg!(debug_assertions) {
    "dev (unoptimized)"
} else {
    "release"
};

/// Runs `f`, turning a panic into an error, so one adapter's panic leaves the others running.
pub fn guarded(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "(no message)".into());
            Err(format!("panicked: {msg}"))
        }
    }
}

/// Benchmarks one adapter: its record and the figures it produced, failed or not.
fn bench_adapter(a: &AdapterSummary, o: &Opts, host: &HostCpu) -> (AdapterRecord, Vec<Figure>) {
    let started = Instant::now();
    let id = format!("{} / {}", a.name, a.backend);
    let mut rec = AdapterRecord {
        id: id.clone(),
        name: a.name.clone(),
        vendor: a.vendor_name.into(),
        backend: a.backend.clone(),
        device_type: a.device_type.clone(),
        driver: a.driver.clone(),
        driver_info: a.driver_info.clone(),
        memory_bytes: a.memory,
        device: None,
        host_cpu: a.is_cpu().then(|| host.clone()),
        status: "ok".into(),
        error: None,
        seconds: 0.0,
    };
    let mut figures = Vec::new();
    let mut doing = String::from("opening the device");
    let result = guarded(|| {
        let dev = Device::with_options(
            DeviceOptions::default()
                .backend(a.backend.clone())
                .adapter(a.name.clone()),
        )
        .map_err(|e| e.to_string())?;
        let info = dev.info();
        rec.device = Some(DeviceCaps {
            f16_native: info.f16_native,
            subgroup_size: info.subgroup_size,
            max_workgroup_storage_bytes: info.limits.max_compute_workgroup_storage_size,
            max_invocations_per_workgroup: info.limits.max_compute_invocations_per_workgroup,
            max_storage_binding_bytes: info.limits.max_storage_buffer_binding_size,
        });
        let mut b = Bench {
            dev: &dev,
            adapter: &id,
            reps: if o.quick { 3 } else { 10 },
            out: &mut figures,
            doing: &mut doing,
        };
        b.all(o.quick, o.train_only).map_err(|e| e.to_string())
    });
    if let Err(e) = result {
        eprintln!("  FAILED while {doing}: {e}");
        rec.status = "failed".into();
        rec.error = Some(format!("while {doing}: {e}"));
    }
    rec.seconds = started.elapsed().as_secs_f64();
    (rec, figures)
}

/// Writes report.html for `report` at `path`.
fn write_page(report: &Report, path: &std::path::Path) -> Result<(), String> {
    let html = crate::bench_html::page(report);
    fitgrad::write_atomic(path, html.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

pub fn run(args: &[String]) -> Result<(), String> {
    let o = parse(args)?;
    if let Some(json) = &o.html_from {
        let report = Report::load(json)?;
        let out = o.out.clone().unwrap_or_else(|| {
            json.parent()
                .unwrap_or(std::path::Path::new("."))
                .join("report.html")
        });
        write_page(&report, &out)?;
        println!("wrote {}", out.display());
        return Ok(());
    }
    // A benchmark measures tuned kernels on every adapter, CPU ones included (where a normal
    // run tunes only on request, as their candidates compile for seconds each).
    if std::env::var_os("FITGRAD_AUTOTUNE_BUDGET").is_none() {
        std::env::set_var("FITGRAD_AUTOTUNE_BUDGET", "1e9");
    }
    let mut adapters = Device::adapters();
    if let Some(want) = &o.adapter {
        adapters.retain(|a| a.name.to_lowercase().contains(&want.to_lowercase()));
    }
    if o.quick && !o.all_backends {
        // One backend per physical adapter (the list is best first).
        let mut seen = std::collections::HashSet::new();
        adapters.retain(|a| seen.insert(a.name.clone()));
    }
    if adapters.is_empty() {
        return Err("no adapter to benchmark".into());
    }
    let started = Instant::now();
    let mut context = bench_context::gather(PROFILE, o.quick, o.train_only);
    let mut report = Report {
        schema: SCHEMA,
        context: context.clone(),
        adapters: Vec::new(),
        results: Vec::new(),
    };
    for a in &adapters {
        eprintln!("benchmarking {a}");
        let (rec, figures) = bench_adapter(a, &o, &context.host_cpu);
        report.adapters.push(rec);
        report.results.extend(figures);
    }
    context.seconds = started.elapsed().as_secs_f64();
    report.context = context;

    let dir = target_dir().join("bench");
    let md = report.markdown();
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    fitgrad::write_atomic(&dir.join("report.json"), text.as_bytes()).map_err(|e| e.to_string())?;
    fitgrad::write_atomic(&dir.join("report.md"), md.as_bytes()).map_err(|e| e.to_string())?;
    write_page(&report, &dir.join("report.html"))?;
    println!("{md}");
    println!(
        "wrote {} (and report.md, report.html) in {:.0} s",
        dir.join("report.json").display(),
        report.context.seconds
    );
    let failed: Vec<&str> = report.failed().map(|a| a.id.as_str()).collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} of {} adapters failed ({}); the reports say why",
            failed.len(),
            report.adapters.len(),
            failed.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Figures made before an error or a panic are kept; the error says what failed.
    #[test]
    fn a_failing_adapter_keeps_its_figures_and_its_error() {
        let mut figures = vec![];
        let r = guarded(|| {
            figures.push(1);
            Err("device lost".into())
        });
        assert_eq!((r, figures.len()), (Err("device lost".into()), 1));
        let r = guarded(|| {
            figures.push(2);
            panic!("kernel {} broke", 7)
        });
        assert_eq!(r, Err("panicked: kernel 7 broke".into()));
        assert_eq!(figures, [1, 2]);
        let r = guarded(|| std::panic::panic_any(3u8));
        assert_eq!(r, Err("panicked: (no message)".into()));
        assert_eq!(guarded(|| Ok(())), Ok(()));
    }

    #[test]
    fn arguments() {
        let a = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert!(parse(&a(&["--out", "x.html"])).is_err());
        assert!(parse(&a(&["--adapter"])).is_err());
        assert!(parse(&a(&["--bogus"])).is_err());
        let o = parse(&a(&["--html-from", "r.json", "--out", "p.html"])).unwrap();
        assert_eq!(o.html_from, Some("r.json".into()));
        assert!(renders_only(&a(&["--html-from", "r.json"])));
        assert!(!renders_only(&a(&["--quick"])));
    }
}
