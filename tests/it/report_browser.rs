//! The report page in a real browser: a tiny digits run writes report.html, headless Chromium
//! (Debian's `chromium`) lays it out and screenshots it, and a probe script added to a copy of
//! the page reports, through `--dump-dom`, that every chart's `<svg>` and its shapes have a
//! non-zero size. Under CI=true a missing Chromium is a failure; elsewhere the test says
//! SKIPPED.

use crate::common;
use crate::common::report_run;

use common::*;
use fitgrad::report::browser::{rendered_svgs, with_svg_probe, Chromium};
use std::io::Write;

fn note(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// (width, height) from a PNG's header.
fn png_size(bytes: &[u8]) -> Option<(u32, u32)> {
    let sig = b"\x89PNG\r\n\x1a\n";
    if bytes.len() < 24 || &bytes[..8] != sig || &bytes[12..16] != b"IHDR" {
        return None;
    }
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    Some((be(&bytes[16..20]), be(&bytes[20..24])))
}

#[test]
fn report_renders_in_headless_chromium() {
    let Some(chromium) = Chromium::find() else {
        let msg = "no Chromium found (apt-get install chromium, or set CHROMIUM)";
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{msg}: under CI=true the browser test must run");
        }
        note(&format!("\n*** SKIPPED: {msg} ***\n"));
        return;
    };
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let report = report_run::digits_report(&dev, 2, None);
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("report.html");
    report.write_html(&page).unwrap();

    // Layout, read back through the probe.
    let probe = dir.path().join("probe.html");
    let html = std::fs::read_to_string(&page).unwrap();
    std::fs::write(&probe, with_svg_probe(&html)).unwrap();
    let dom = chromium.dump_dom(&probe).unwrap();
    let svgs = rendered_svgs(&dom);
    note(&format!("chromium {}: {svgs:?}", chromium.path().display()));
    assert_eq!(
        svgs.len(),
        html.matches("<svg").count(),
        "the browser did not lay out every chart"
    );
    for id in [
        "memory-timeline",
        "loss-curve",
        "accuracy-curve",
        "throughput",
    ] {
        let s = svgs
            .iter()
            .find(|s| s.id.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("no chart {id} in the page the browser loaded"));
        assert!(
            s.width > 100.0 && s.height > 100.0,
            "{id} laid out at {s:?}"
        );
        assert!(s.shapes >= 3, "{id}: {} visible shapes", s.shapes);
    }
    assert!(
        dom.contains("fg-peak-label"),
        "the peak's label is not in the DOM"
    );

    // A screenshot of the page as a person sees it.
    let shot = dir.path().join("report.png");
    chromium.screenshot(&page, &shot, 1000, 2600).unwrap();
    let bytes = std::fs::read(&shot).unwrap();
    assert_eq!(
        png_size(&bytes),
        Some((1000, 2600)),
        "not the screenshot asked for"
    );
    note(&format!("screenshot: {} bytes", bytes.len()));
}
