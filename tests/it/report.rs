//! The training report's writers: a tiny digits run's report reads back from its JSON
//! unchanged; its page is one self-contained HTML file (no script, nothing fetched) holding
//! the memory timeline, loss, accuracy and throughput charts and the peak's label with its
//! op; both files are written atomically; a budget draws its line and names the strategy;
//! paths that cannot be written are typed errors before anything runs.

use crate::common;
use crate::common::report_run;

use common::*;
use fitgrad::report::{check_output_path, TrainingReport};
use fitgrad::{Bytes, Device, Error};

device_tests!(report_round_trips_and_holds_its_charts);

fn report_round_trips_and_holds_its_charts(dev: &Device) {
    let Some(dev) = fresh_device(
        fitgrad::DeviceOptions::default()
            .backend(dev.info().adapter.backend.clone())
            .force_packed_f16(!dev.info().f16_native),
    ) else {
        return;
    };
    let report = report_run::digits_report(&dev, 2, None);
    let m = report.step_memory.as_ref().expect("a step was recorded");
    assert_eq!(m.step, 1, "the second step is the one recorded");
    assert!(
        (m.ratio() - 1.0).abs() <= 0.02,
        "planned / measured {}",
        m.ratio()
    );
    assert_eq!(report.evals.len(), 2);
    assert!(report.evals.iter().all(|e| e.accuracy.is_some()));
    assert!(report.steps.len() >= 4);

    // JSON: the same report back, field for field.
    let json = report.to_json();
    let back = TrainingReport::from_json(&json).unwrap();
    assert_eq!(back, report);
    assert!(json.contains("\"kind\": \"alloc\"") && json.contains("\"role\": \"activation\""));
    assert!(matches!(
        TrainingReport::from_json("{\"title\": 3}"),
        Err(Error::Data { .. })
    ));

    // HTML: self-contained, with its charts and the peak's label.
    let html = report.to_html();
    assert!(html.starts_with("<!DOCTYPE html>"));
    for id in [
        "memory-timeline",
        "loss-curve",
        "accuracy-curve",
        "throughput",
    ] {
        assert!(html.contains(&format!("id=\"{id}\"")), "no {id} chart");
    }
    assert!(no_fetch(&html), "the page loads something");
    // The label names the op's kernel family (its name up to the specialization) and phase.
    let peak_op = m.measured.peak_op().unwrap();
    let family = peak_op
        .split("_[")
        .next()
        .unwrap()
        .split(" (")
        .next()
        .unwrap();
    let label = format!("peak {} at {family}", Bytes(m.measured.peak()));
    assert!(
        html.contains(&fitgrad::report::svg::escape(&label)),
        "no peak label '{label}'"
    );
    assert!(html.contains("planned by the dry-run planner"));
    assert!(html.contains("fg-area") && html.contains("fg-peak"));
    assert!(html.contains("No memory budget was given"));

    // Files, atomically, in a folder of their own; nothing else is left there.
    let dir = tempfile::tempdir().unwrap();
    let (h, j) = (dir.path().join("r.html"), dir.path().join("r.json"));
    report.write_html(&h).unwrap();
    report.write_json(&j).unwrap();
    assert_eq!(std::fs::read_to_string(&h).unwrap(), html);
    assert_eq!(
        TrainingReport::from_json(&std::fs::read_to_string(&j).unwrap()).unwrap(),
        report
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);

    // Under a budget: the budget line, the strategy, and the reserved bytes it limits.
    // (Small tensors share 2 MiB segments, so a budget on reserved bytes starts there.)
    let budget = 8 << 20;
    let dev2 = fresh_device(
        fitgrad::DeviceOptions::default()
            .backend(dev.info().adapter.backend.clone())
            .force_packed_f16(!dev.info().f16_native)
            .memory_budget(budget),
    )
    .unwrap();
    let budgeted = report_run::digits_report(&dev2, 1, Some(budget));
    let html = budgeted.to_html();
    let b = budgeted.budget.as_ref().unwrap();
    assert!(html.contains(&format!("budget {}", Bytes(b.budget))));
    assert!(html.contains(&fitgrad::report::svg::escape(&b.strategy)));
    assert!(html.contains("reserved from the driver"));
}

/// Every URL in the page is a namespace name, not something fetched.
fn no_fetch(html: &str) -> bool {
    !html.contains("<script")
        && !html.contains("<link")
        && !html.contains("src=")
        && html
            .match_indices("http")
            .all(|(i, _)| html[i..].starts_with("http://www.w3.org/2000/svg"))
}

#[test]
fn page_fetches_nothing_without_a_device() {
    // A report read from JSON renders without a device.
    let json = r#"{"title":"t","fitgrad_version":"0","adapter":[],"settings":[],"results":[],
        "throughput_unit":"samples/s","steps":[{"step":1,"loss":2.0,"throughput":10.0}],
        "evals":[],"epochs":[],"step_memory":null,"plan":null,"memory":null,"events":[],
        "budget":null}"#;
    let r = TrainingReport::from_json(json).unwrap();
    let html = r.to_html();
    assert!(no_fetch(&html), "the page loads something");
    assert!(html.contains("No step was recorded"));
}

#[test]
fn bad_report_paths_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let arg = |p: &std::path::Path| match check_output_path("--report", p) {
        Err(Error::InvalidArgument { op, reason }) => {
            assert_eq!(op, "--report");
            reason
        }
        other => panic!("{}: {other:?}", p.display()),
    };
    assert!(arg(dir.path()).contains("folder"));
    assert!(arg(std::path::Path::new("")).contains("no file"));
    assert!(arg(&dir.path().join("missing/report.html")).contains("does not exist"));
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    assert!(arg(&file.join("report.html")).contains("does not exist"));
    check_output_path("--report", &dir.path().join("report.html")).unwrap();
    // The check leaves nothing behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}
