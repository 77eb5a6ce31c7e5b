//! The benchmark page in a real browser: `xtask bench --html-from` renders a fixture
//! report.json, headless Chromium loads the page, takes a screenshot, and the DOM it dumps says
//! every chart and every bar exists with a non-zero size. Under CI=true a missing Chromium is a
//! failure, never a skip.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/report.json");

/// Debian's package installs `chromium`; other systems name it differently.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|n| std::env::split_paths(&path).map(move |d| d.join(n)))
        .find(|p| p.is_file())
}

/// Runs `cmd`, killing it after `limit` (a hung browser must not hang the test). Both pipes
/// are drained on threads, so a full one cannot stall the browser.
fn run_with_limit(cmd: &mut Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the command starts");
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

fn browser(chromium: &Path, profile: &Path) -> Command {
    let mut c = Command::new(chromium);
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1280,2400",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    c
}

fn url(p: &Path) -> String {
    format!("file://{}", p.display())
}

/// Reports every chart's and every bar's laid-out size into the DOM before it is dumped.
const PROBE: &str = r#"<script>
(function () {
  var out = [];
  document.querySelectorAll('svg.fg-chart').forEach(function (s, i) {
    var r = s.getBoundingClientRect();
    out.push('svg ' + r.width + ' ' + r.height);
  });
  document.querySelectorAll('svg.fg-chart rect.fg-bar').forEach(function (b) {
    var r = b.getBoundingClientRect();
    out.push('bar ' + r.width + ' ' + r.height + ' ' + b.getAttribute('data-adapter'));
  });
  var pre = document.createElement('pre');
  pre.id = 'layout';
  pre.textContent = out.join('\n');
  document.body.appendChild(pre);
})();
</script>"#;

#[test]
fn the_page_renders_its_charts_in_chromium() {
    let Some(chromium) = chromium() else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("CI=true and no Chromium: apt-get install chromium");
        }
        eprintln!("skipped: no chromium on PATH (apt-get install chromium)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    std::fs::copy(FIXTURE, &json).unwrap();
    let render = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["bench", "--html-from"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        render.status.success(),
        "{}",
        String::from_utf8_lossy(&render.stderr)
    );
    let page = dir.path().join("report.html");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        !html.contains("<script"),
        "the report itself runs no script"
    );

    // What the fixture should show: a chart per operation, a bar per figure.
    let report: Value = serde_json::from_str(&std::fs::read_to_string(FIXTURE).unwrap()).unwrap();
    let results = report["results"].as_array().unwrap();
    let mut ops: Vec<(&str, &str)> = results
        .iter()
        .map(|f| (f["op"].as_str().unwrap(), f["unit"].as_str().unwrap()))
        .collect();
    ops.sort();
    ops.dedup();
    let mut per_adapter: BTreeMap<String, usize> = BTreeMap::new();
    for f in results {
        *per_adapter
            .entry(f["adapter"].as_str().unwrap().into())
            .or_default() += 1;
    }
    let failed: Vec<&str> = report["adapters"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a["error"].as_str())
        .collect();
    assert!(
        !failed.is_empty() && per_adapter.len() >= 2,
        "the fixture has two adapters with figures and a failed one"
    );

    // Layout in the browser.
    let probe = dir.path().join("probe.html");
    std::fs::write(&probe, html.replace("</body>", &format!("{PROBE}</body>"))).unwrap();
    let dump = run_with_limit(
        browser(&chromium, &dir.path().join("profile-dom"))
            .arg("--dump-dom")
            .arg(url(&probe)),
        Duration::from_secs(120),
    );
    let dom = String::from_utf8_lossy(&dump.stdout);
    assert!(
        dump.status.success() && dom.contains("id=\"layout\""),
        "chromium --dump-dom failed: {}\n{}",
        dump.status,
        String::from_utf8_lossy(&dump.stderr)
    );
    let layout = dom
        .split("<pre id=\"layout\">")
        .nth(1)
        .and_then(|s| s.split("</pre>").next())
        .unwrap();
    let (mut charts, mut bars) = (0, BTreeMap::<String, usize>::new());
    for line in layout.lines() {
        let mut f = line.splitn(4, ' ');
        let (kind, w, h) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
        let (w, h): (f64, f64) = (w.parse().unwrap(), h.parse().unwrap());
        assert!(w > 0.0 && h > 0.0, "{line}: an element without size");
        match kind {
            "svg" => charts += 1,
            "bar" => *bars.entry(f.next().unwrap().into()).or_default() += 1,
            _ => panic!("{line}"),
        }
    }
    assert_eq!(charts, ops.len(), "one chart per operation");
    assert_eq!(bars, per_adapter, "one bar per adapter per shape");
    for e in failed {
        let shown = e
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;");
        assert!(dom.contains(&shown), "the error {e:?} is on the page");
    }

    // The screenshot: a PNG of the window's size, kept for a person to look at.
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench_report.png");
    let _ = std::fs::remove_file(&shot);
    let out = run_with_limit(
        browser(&chromium, &dir.path().join("profile-shot"))
            .arg(format!("--screenshot={}", shot.display()))
            .arg(url(&page)),
        Duration::from_secs(120),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(&shot).expect("chromium wrote the screenshot");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let be = |i: usize| u32::from_be_bytes(png[i..i + 4].try_into().unwrap());
    assert_eq!((be(16), be(20)), (1280, 2400), "IHDR width and height");
    // A blank page of this size compresses to a few KiB; charts and tables do not.
    assert!(
        png.len() > 40_000,
        "a {} byte screenshot looks blank",
        png.len()
    );
    eprintln!("screenshot: {}", shot.display());
}

#[test]
fn html_from_refuses_what_is_not_a_report() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("report.json");
    std::fs::write(&bad, r#"{"results": []}"#).unwrap();
    for path in [bad.clone(), dir.path().join("missing.json")] {
        let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
            .args(["bench", "--html-from"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&path.display().to_string()), "{err}");
    }
    assert!(!dir.path().join("report.html").exists());
}
