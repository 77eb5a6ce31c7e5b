//! `cargo xtask <task>`: project chores that are not tests.
//!
//! - `shaders`: parses and validates every shader variant with naga (no GPU needed).
//! - `modules [--graph]`: the graph of src/'s files; fails on a circle of files or an import
//!   that runs up ARCHITECTURE.md's layer order (see modules/).
//! - `adapters`: lists the adapters wgpu finds.
//! - `bench [--quick] [--train-only] [--adapter NAME]`: the cross-vendor benchmark report
//!   (report.json, report.md, report.html; see bench.rs); `bench --html-from REPORT.json`
//!   renders the page of an earlier run.
//! - `ci`: runs `.ci/run`.

mod bench;
mod bench_context;
mod bench_html;
mod bench_ops;
mod bench_report;
mod modules;

use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let task = std::env::args().nth(1).unwrap_or_default();
    match task.as_str() {
        "shaders" => shaders(),
        "modules" => modules::run(&std::env::args().skip(2).collect::<Vec<_>>()),
        "bench" => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            if cfg!(debug_assertions) && !bench::renders_only(&args) {
                // `cargo xtask` builds in the dev profile, where fitgrad itself is unoptimized:
                // measure a release build, as `cargo bench` does.
                return release_bench(&args);
            }
            match bench::run(&args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("bench: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        "adapters" => {
            for a in fitgrad::Device::adapters() {
                println!("{a}");
            }
            ExitCode::SUCCESS
        }
        "ci" => {
            let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
            match Command::new("bash")
                .arg(".ci/run")
                .current_dir(root)
                .status()
            {
                Ok(s) if s.success() => ExitCode::SUCCESS,
                Ok(_) => ExitCode::FAILURE,
                Err(e) => {
                    eprintln!("could not run .ci/run: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        _ => {
            eprintln!(
                "usage: cargo xtask <shaders|bench [--quick] [--train-only] [--adapter NAME]\
                 |bench --html-from REPORT.json [--out PAGE.html]|modules [--graph]|adapters|ci>"
            );
            ExitCode::from(2)
        }
    }
}

/// Runs `bench` again from a release build of xtask.
fn release_bench(args: &[String]) -> ExitCode {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["run", "--release", "--package", "xtask", "--", "bench"])
        .args(args)
        .current_dir(root);
    if std::env::var_os("CARGO_TARGET_DIR").is_some() {
        // Resolved against the caller's folder, as cargo did for this build, not the root's.
        cmd.env("CARGO_TARGET_DIR", bench_context::target_dir());
    }
    match cmd.status() {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("could not run the release build of xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn shaders() -> ExitCode {
    let mut failed = 0;
    for (name, result) in fitgrad::validate_shaders() {
        match result {
            Ok(()) => println!("ok    {name}"),
            Err(e) => {
                failed += 1;
                println!("FAIL  {name}\n{e}");
            }
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        eprintln!("{failed} shader variant(s) failed validation");
        ExitCode::FAILURE
    }
}
