//! examples/train_gpt/main.rs, included as a module: every bad configuration is a typed error from
//! `prepare` (no device), and a tiny configuration trains on each backend, saves, resumes to
//! the uninterrupted run's step count, samples text of the asked length from the vocabulary,
//! and fits a budget with `--fit auto`.

use crate::common;

use crate::common::budget_figure;

use crate::examples::train_gpt;

use clap::Parser;
use common::*;
use fitgrad::distributed::Job;
use fitgrad::{Bytes, Device, DeviceOptions, Error};
use std::io::Write;
use train_gpt::{prepare, train, Args};

/// A small repetitive text: a tiny model learns it in a few steps.
const TEXT: &str = "to be, or not to be, that is the question. ";

fn text_file(text: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text).unwrap();
    f
}

/// The flags of a tiny run on `path`, with `extra` added or replacing the tiny run's.
fn args(path: &std::path::Path, extra: &[&str]) -> Args {
    let mut all = vec![
        "train_gpt".to_string(),
        "--text".into(),
        path.display().to_string(),
    ];
    for (flag, value) in [
        ("--layers", "1"),
        ("--heads", "2"),
        ("--dim", "16"),
        ("--context", "8"),
        ("--batch-size", "4"),
        ("--steps", "6"),
        ("--eval-every", "3"),
        ("--sample-len", "12"),
        ("--lr", "0.01"),
    ] {
        let replaced = extra.iter().any(|e| e.split('=').next() == Some(flag));
        if !replaced {
            all.extend([flag.to_string(), value.to_string()]);
        }
    }
    all.extend(extra.iter().map(|s| s.to_string()));
    Args::try_parse_from(&all).unwrap_or_else(|e| panic!("{all:?}: {e}"))
}

/// `prepare`'s error for `extra` on `text`, with a substring its message must hold.
fn refused(text: &[u8], extra: &[&str], says: &str) -> Error {
    let f = text_file(text);
    let err = match prepare(&args(f.path(), extra)) {
        Ok(_) => panic!("{extra:?} on {} bytes was accepted", text.len()),
        Err(e) => e,
    };
    let msg = err.to_string();
    assert!(
        msg.contains(says),
        "{extra:?}: the message should say '{says}': {msg}"
    );
    err
}

#[test]
fn bad_configurations_are_refused_before_any_device_work() {
    let long = TEXT.repeat(20);
    let t = long.as_bytes();
    let is_arg = |e: &Error| matches!(e, Error::InvalidArgument { .. });
    let is_data = |e: &Error| matches!(e, Error::Data { .. });
    assert!(is_arg(&refused(t, &["--heads", "3"], "divide")));
    for flag in [
        "--layers",
        "--heads",
        "--dim",
        "--context",
        "--batch-size",
        "--accum-steps",
    ] {
        assert!(is_arg(&refused(t, &[flag, "0"], flag)));
    }
    assert!(is_arg(&refused(t, &["--steps", "0"], "--steps")));
    assert!(is_arg(&refused(t, &["--dropout", "1"], "dropout")));
    assert!(is_arg(&refused(
        t,
        &["--temperature", "0"],
        "--temperature"
    )));
    assert!(is_arg(&refused(t, &["--lr=-1"], "--lr")));
    assert!(is_arg(&refused(t, &["--precision", "f64"], "f64")));
    assert!(is_arg(&refused(t, &["--attention", "sparse"], "sparse")));
    assert!(is_arg(&refused(t, &["--fit", "manual"], "auto")));
    let streamed = ["--offload", "parameters"];
    let with = |more: &[&'static str]| [&streamed[..], more].concat();
    assert!(is_arg(&refused(
        t,
        &with(&["--optimizer", "adamw8bit"]),
        "--optimizer adamw8bit"
    )));
    assert!(is_arg(&refused(
        t,
        &with(&["--precision", "f16"]),
        "--precision f16"
    )));
    assert!(is_arg(&refused(t, &["--fit", "auto"], "--memory-budget")));
    assert!(is_arg(&refused(
        t,
        &[
            "--fit",
            "auto",
            "--memory-budget",
            "8MiB",
            "--checkpoint-activations"
        ],
        "--checkpoint-activations"
    )));
    assert!(is_arg(&refused(t, &["--memory-budget", "lots"], "lots")));
    // The text: empty, not UTF-8, shorter than one window of validation.
    assert!(is_data(&refused(b"", &[], "empty")));
    assert!(is_data(&refused(b"caf\xe9 au lait", &[], "UTF-8")));
    let err = refused(TEXT.as_bytes(), &["--context", "8"], "validation");
    assert!(is_data(&err), "{err:?}");
    // A missing file and a missing checkpoint.
    let missing = std::path::Path::new("/nonexistent/fitgrad/plays.txt");
    let err = prepare(&args(missing, &[])).err().expect("a missing file");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    let err = refused(t, &["--resume", "/nonexistent/fitgrad/gpt.safetensors"], "");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    // Report files that could not be written: a missing folder, a folder.
    let report = ["--report", "/nonexistent/fitgrad/report.html"];
    assert!(is_arg(&refused(t, &report, "does not exist")));
    let folder = std::env::temp_dir().display().to_string();
    assert!(is_arg(&refused(t, &["--report-json", &folder], "folder")));
    // Every count bounded: a mistyped one is refused, not run until killed.
    assert!(is_arg(&refused(
        t,
        &["--sample-len", "100000000000"],
        "--sample-len"
    )));
    assert!(is_arg(&refused(
        t,
        &["--steps", "1000000000000"],
        "--steps"
    )));
    assert!(is_arg(&refused(t, &["--context", "10000000"], "--context")));
    // A text of more distinct characters than a vocabulary holds (it aborted in the bigram
    // baseline's (vocab, vocab) table before).
    let wide: String = (0..=fitgrad::train::text::MAX_VOCAB as u32)
        .filter_map(|i| char::from_u32(0x4E00 + i % 0x5000 + (i / 0x5000) * 0x10000))
        .collect();
    assert!(wide.chars().count() > fitgrad::train::text::MAX_VOCAB);
    assert!(is_data(&refused(wide.as_bytes(), &[], "65536")));
    // A text too short for any context says how long it must be, not "at most 0".
    let err = refused(b"abc", &[], "at least 90 characters");
    assert!(!err.to_string().contains("at most 0"), "{err}");
    // The defaults on the embedded plays are valid.
    prepare(&Args::try_parse_from(["train_gpt"]).unwrap()).expect("the default configuration");
}

/// No output destroys an input or another output: the text, a link to it, the report and
/// the checkpoint, a folder or a missing folder as --save; --save may replace --resume.
#[test]
fn outputs_never_overwrite_inputs_or_each_other() {
    let f = text_file(TEXT.repeat(20).as_bytes());
    let text = f.path().display().to_string();
    let before = std::fs::read(f.path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name).display().to_string();
    let clash = |extra: &[&str], says: &str| {
        let err = prepare(&args(f.path(), extra)).err().expect("a collision");
        let msg = err.to_string();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        assert!(msg.contains(says), "{extra:?}: {msg}");
    };
    clash(&["--save", &text], "--text");
    clash(&["--report", &text], "--text");
    #[cfg(unix)]
    {
        let link = at("link.txt");
        std::os::unix::fs::symlink(f.path(), &link).unwrap();
        clash(&["--save", &link], "after resolving links");
        let hard = at("hard.txt");
        std::fs::hard_link(f.path(), &hard).unwrap();
        clash(&["--report-json", &hard], "--text");
    }
    let out = at("out.bin");
    clash(&["--report", &out, "--save", &out], "--report");
    clash(&["--report", &out, "--report-json", &out], "--report-json");
    clash(&["--save", &dir.path().display().to_string()], "folder");
    clash(
        &["--save", "/nonexistent/fitgrad/gpt.safetensors"],
        "does not exist",
    );
    assert_eq!(std::fs::read(f.path()).unwrap(), before, "the text changed");
    // Distinct paths pass (nothing is written by prepare).
    prepare(&args(
        f.path(),
        &["--save", &out, "--report", &at("r.html")],
    ))
    .unwrap();
    assert!(!std::path::Path::new(&out).exists());
}

/// A fresh device of `dev`'s backend, f16 stored as `dev` stores it (budgets and memory
/// statistics are the test's own).
fn device_like(dev: &Device) -> Device {
    let info = dev.info();
    let mut o = DeviceOptions::default();
    o.backend = Some(info.adapter.backend.clone());
    o.force_packed_f16 = !info.f16_native
        && dev
            .wgpu_device()
            .features()
            .contains(wgpu::Features::SHADER_F16);
    Device::with_options(o).expect("a second device on this adapter")
}

/// Train 3 steps and save, resume to 6; the loss falls below a uniform guess, the sample holds
/// the asked characters of the vocabulary; a resume with another width is refused.
fn tiny_run_saves_resumes_and_samples(dev: &Device) {
    let f = text_file(TEXT.repeat(20).as_bytes());
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("gpt.safetensors");
    let ckpt_s = ckpt.display().to_string();
    let first = args(f.path(), &["--steps", "3", "--save", &ckpt_s]);
    let report = train(
        &first,
        prepare(&first).unwrap(),
        &device_like(dev),
        &Job::Single,
    )
    .unwrap();
    assert_eq!(report.steps, 3);
    let more = args(f.path(), &["--resume", &ckpt_s]);
    let report = train(
        &more,
        prepare(&more).unwrap(),
        &device_like(dev),
        &Job::Single,
    )
    .unwrap();
    assert_eq!(report.steps, 6, "resumed to the asked step count");
    let t20 = TEXT.repeat(20);
    let t20 = t20.as_bytes();
    let vocab = fitgrad::train::text::CharVocab::from_text(TEXT).unwrap();
    let uniform = (vocab.len() as f32).ln();
    assert!(
        report.valid_loss.is_finite() && report.valid_loss < uniform,
        "validation loss {} vs uniform {uniform}",
        report.valid_loss
    );
    assert!(report.bigram > 0.0 && report.bigram < uniform as f64);
    assert!(report.sample.chars().count() >= 12, "{:?}", report.sample);
    assert!(
        report.sample.chars().all(|c| vocab.id(c).is_some()),
        "{:?}",
        report.sample
    );
    let other = refused(
        TEXT.repeat(20).as_bytes(),
        &["--resume", &ckpt_s, "--dim", "32"],
        "--dim",
    );
    assert!(matches!(other, Error::Data { .. }), "{other:?}");
    // Another text of the same vocabulary size (the characters shifted by one), and another
    // text of the same vocabulary: refused, naming --text.
    let shifted: String = TEXT
        .repeat(20)
        .chars()
        .map(|c| char::from_u32(c as u32 + 1).unwrap())
        .collect();
    let err = refused(shifted.as_bytes(), &["--resume", &ckpt_s], "--text");
    assert!(err.to_string().contains("vocabulary"), "{err}");
    let reordered = TEXT.repeat(20).chars().rev().collect::<String>();
    let err = refused(reordered.as_bytes(), &["--resume", &ckpt_s], "--text");
    assert!(err.to_string().contains("another text"), "{err}");
    // Another dropout, and fewer steps than the checkpoint holds.
    refused(t20, &["--resume", &ckpt_s, "--dropout", "0.1"], "--dropout");
    let err = refused(t20, &["--resume", &ckpt_s, "--steps", "2"], "--steps");
    assert!(err.to_string().contains("nothing"), "{err}");
    // A checkpoint that holds NaN says so, not "lower the learning rate".
    let mut ck = fitgrad::checkpoint::load(&ckpt).unwrap();
    let (name, t) = ck.tensors.iter_mut().next().unwrap();
    let name = name.clone();
    t.bytes[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    let nan = dir.path().join("nan.safetensors");
    ck.save(&nan).unwrap();
    let err = refused(t20, &["--resume", &nan.display().to_string()], "diverged");
    assert!(err.to_string().contains(&name), "{err}");
}

/// `--fit auto` under a budget between the plain step's need and a one-window step's: it
/// chooses, trains within the budget, and reports a finite loss.
fn tiny_run_fits_a_budget(dev: &Device) {
    let f = text_file(TEXT.repeat(20).as_bytes());
    let a = args(
        f.path(),
        &["--steps", "2", "--sample-len", "0", "--eval-every", "0"],
    );
    let fresh = device_like(dev);
    let report = train(&a, prepare(&a).unwrap(), &fresh, &Job::Single).unwrap();
    let plain = fresh.memory_stats().peak_bytes_reserved;
    let budget = format!("{plain}");
    let a = args(
        f.path(),
        &[
            "--steps",
            "2",
            "--sample-len",
            "0",
            "--fit",
            "auto",
            "--memory-budget",
            &budget,
        ],
    );
    let budgeted = device_like(dev);
    budgeted.set_memory_budget(Some(plain)).unwrap();
    let fitted = train(&a, prepare(&a).unwrap(), &budgeted, &Job::Single).unwrap();
    assert!(fitted.valid_loss.is_finite() && report.valid_loss.is_finite());
    assert!(budgeted.memory_stats().peak_bytes_reserved <= plain);
}

/// The tiny run of 2 steps with `flags`, under `budget` (None: no budget) on a fresh device
/// like `dev`: the report and the device.
fn tiny_budgeted_run(
    dev: &Device,
    text: &std::path::Path,
    flags: &[&str],
    budget: Option<&str>,
) -> (Result<train_gpt::Report, Error>, Device) {
    let mut extra = [&["--steps", "2"], flags].concat();
    if let Some(b) = budget {
        extra.extend(["--memory-budget", b]);
    }
    let a = args(text, &extra);
    let fresh = device_like(dev);
    let report = prepare(&a).and_then(|setup| {
        if let Some(b) = budget {
            fresh.set_memory_budget(Some(b.parse::<Bytes>()?.0))?;
        }
        train(&a, setup, &fresh, &Job::Single)
    });
    (report, fresh)
}

/// A budget too small is refused with the figure; the figure as printed runs (training,
/// evaluations, the sample), one byte less is refused.
fn tiny_run_minimum_budget_works_as_printed(dev: &Device) {
    let f = text_file(TEXT.repeat(20).as_bytes());
    let flags = ["--eval-every", "0", "--sample-len", "4"];
    let run = |b: &str| {
        tiny_budgeted_run(dev, f.path(), &flags, Some(b))
            .0
            .map(drop)
    };
    budget_figure::figure_passed_back_works(run, "1KiB");
}

/// `peak_bytes` (the JSON's) is the device's peak reserved over the whole run, evaluation
/// and the sample's KV cache included, and the whole run's plan equals it; under a budget
/// of half that peak the run still completes within the budget.
fn whole_run_peak_is_planned_and_bounded_by_a_budget(dev: &Device) {
    let f = text_file(TEXT.repeat(20).as_bytes());
    let flags = ["--eval-every", "1", "--sample-len", "40"];
    let (report, fresh) = tiny_budgeted_run(dev, f.path(), &flags, None);
    let report = report.unwrap();
    let measured = fresh.memory_stats().peak_bytes_reserved;
    assert_eq!(report.peak_bytes, measured);
    assert_eq!(report.planned_run_peak, measured, "planned = measured");
    let half = (measured / 2).to_string();
    let (report, fresh) = tiny_budgeted_run(dev, f.path(), &flags, Some(&half));
    let report = report.unwrap_or_else(|e| panic!("--memory-budget {half}: {e}"));
    let stats = fresh.memory_stats();
    assert_eq!(report.peak_bytes, stats.peak_bytes_reserved);
    assert!(report.peak_bytes <= measured / 2, "{stats:?}");
    assert!(report.valid_loss.is_finite() && report.sample.chars().count() > 40);
}

device_tests!(tiny_run_saves_resumes_and_samples, tiny_run_fits_a_budget);

// Budgets and plans are the arena's and the planner's, the same on every adapter (the
// kernels are tested per backend above): one backend keeps these runs short.
#[test]
fn minimum_budget_works_as_printed() {
    run_on("vulkan", tiny_run_minimum_budget_works_as_printed);
}

#[test]
fn whole_run_peak_is_planned_and_bounded() {
    run_on("vulkan", whole_run_peak_is_planned_and_bounded_by_a_budget);
}

/// `--zero N` on one process says what its plan is (a plain run's: the one process holds
/// every shard), in the text and the JSON (issue 43 item 4); stage 0 and a job of ranks say
/// nothing.
#[test]
fn zero_on_one_process_is_said() {
    use fitgrad::distributed::Zero;
    let note = Job::Single.zero_note(Zero::stage(3).unwrap()).unwrap();
    assert!(note.contains("ZeRO stage 3"), "{note}");
    assert!(
        note.contains("--distributed mpi") && !note.contains("  "),
        "{note}"
    );
    assert!(Job::Single.zero_note(Zero::OFF).is_none());
}
