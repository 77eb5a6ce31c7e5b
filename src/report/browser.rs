//! Checking a page in headless Chromium: a screenshot, and the size each `<svg>` and its
//! shapes were laid out at (read back with `--dump-dom` from a probe script added to a copy of
//! the page; the page itself has no script). Used by the browser test of the reports; needs the
//! `chromium` package (Debian) or another Chromium-based browser.
//!
//! ```no_run
//! use fitgrad::report::browser::{rendered_svgs, with_svg_probe, Chromium};
//! # fn main() -> fitgrad::Result<()> {
//! let chromium = Chromium::find().expect("chromium installed");
//! let html = std::fs::read_to_string("report.html").unwrap();
//! std::fs::write("probe.html", with_svg_probe(&html)).unwrap();
//! let dom = chromium.dump_dom("probe.html".as_ref())?;
//! assert!(rendered_svgs(&dom).iter().all(|s| s.width > 0.0 && s.shapes > 0));
//! chromium.screenshot("report.html".as_ref(), "shot.png".as_ref(), 1000, 2400)?;
//! # Ok(()) }
//! ```

use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The flags every run gets: headless, no sandbox (CI containers run as root), no GPU, no
/// network traffic of the browser's own.
pub const FLAGS: [&str; 4] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
];

/// How long one browser run may take before it is killed.
const TIMEOUT: Duration = Duration::from_secs(120);

/// A Chromium executable.
#[derive(Clone, Debug)]
pub struct Chromium {
    path: PathBuf,
}

impl Chromium {
    /// The browser named by `$CHROMIUM`, else the first of `chromium`, `chromium-browser`,
    /// `google-chrome`, `google-chrome-stable` on `PATH`; `None` when there is none.
    pub fn find() -> Option<Chromium> {
        if let Some(p) = std::env::var_os("CHROMIUM").filter(|p| !p.is_empty()) {
            return Some(Chromium { path: p.into() });
        }
        let names = [
            "chromium",
            "chromium-browser",
            "google-chrome",
            "google-chrome-stable",
        ];
        let dirs: Vec<PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        names.iter().find_map(|n| {
            dirs.iter()
                .map(|d| d.join(n))
                .find(|p| p.is_file())
                .map(|path| Chromium { path })
        })
    }

    /// The executable.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renders `page` at `width` x `height` CSS pixels into the PNG file `png`.
    pub fn screenshot(&self, page: &Path, png: &Path, width: u32, height: u32) -> Result<()> {
        let png = std::path::absolute(png).map_err(|e| io(png, e))?;
        self.run(
            page,
            &[
                format!("--screenshot={}", png.display()),
                format!("--window-size={width},{height}"),
                "--hide-scrollbars".into(),
            ],
        )?;
        if !png.is_file() {
            return Err(io(
                &png,
                std::io::Error::other("chromium exited without writing the screenshot"),
            ));
        }
        Ok(())
    }

    /// The DOM of `page` after it loaded (scripts run), as HTML.
    pub fn dump_dom(&self, page: &Path) -> Result<String> {
        self.run(page, &["--dump-dom".into()])
    }

    /// Runs the browser on `page` with `extra` flags and a profile folder of its own; its
    /// stdout, or an error with the end of its stderr.
    fn run(&self, page: &Path, extra: &[String]) -> Result<String> {
        let page = std::path::absolute(page).map_err(|e| io(page, e))?;
        let profile = tempfile::tempdir().map_err(|e| io(&page, e))?;
        let mut child = Command::new(&self.path)
            .args(FLAGS)
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(["--no-first-run", "--mute-audio"])
            .args(extra)
            .arg(format!("file://{}", page.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| io(&self.path, e))?;
        // Read both pipes on threads so a chatty browser never blocks on a full pipe.
        let out = child.stdout.take().map(read_all);
        let err = child.stderr.take().map(read_all);
        let started = Instant::now();
        let status = loop {
            match child.try_wait().map_err(|e| io(&self.path, e))? {
                Some(s) => break s,
                None if started.elapsed() > TIMEOUT => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(io(
                        &page,
                        std::io::Error::other(format!(
                            "{} did not finish in {} s",
                            self.path.display(),
                            TIMEOUT.as_secs()
                        )),
                    ));
                }
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let stdout = out.and_then(|h| h.join().ok()).unwrap_or_default();
        let stderr = err.and_then(|h| h.join().ok()).unwrap_or_default();
        if !status.success() {
            let tail: String = stderr
                .lines()
                .rev()
                .take(8)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            return Err(io(
                &page,
                std::io::Error::other(format!("{} failed ({status}): {tail}", self.path.display())),
            ));
        }
        Ok(stdout)
    }
}

fn io(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source,
    }
}

fn read_all(mut r: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = r.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    })
}

/// The probe: after layout, each `<svg>` gets its laid-out width and height and the number of
/// its shapes (paths, rects, lines, circles) whose box is not empty, as `data-*` attributes
/// that `--dump-dom` shows.
const PROBE: &str = "<script>for(const s of document.querySelectorAll('svg')){\
const r=s.getBoundingClientRect();let n=0;\
for(const e of s.querySelectorAll('path,rect,line,circle,polyline')){let b;\
try{b=e.getBBox()}catch(_){continue}\
if(b.width>0||b.height>0)n++;}\
s.setAttribute('data-rendered-width',r.width.toFixed(1));\
s.setAttribute('data-rendered-height',r.height.toFixed(1));\
s.setAttribute('data-rendered-shapes',n);}</script>";

/// `html` with the probe script added at the end of its body (for a copy of the page only).
pub fn with_svg_probe(html: &str) -> String {
    match html.rfind("</body>") {
        Some(i) => format!("{}{PROBE}{}", &html[..i], &html[i..]),
        None => format!("{html}{PROBE}"),
    }
}

/// What the probe found about one `<svg>`.
#[derive(Clone, Debug, PartialEq)]
pub struct SvgBox {
    /// Its `id` attribute, if it has one.
    pub id: Option<String>,
    /// Laid-out width in CSS pixels.
    pub width: f64,
    /// Laid-out height in CSS pixels.
    pub height: f64,
    /// Shapes inside it with a non-empty box.
    pub shapes: usize,
}

/// Every probed `<svg>` of a DOM dumped from a page made by [`with_svg_probe`].
pub fn rendered_svgs(dom: &str) -> Vec<SvgBox> {
    let attr = |tag: &str, name: &str| -> Option<String> {
        let key = format!(" {name}=\"");
        let at = tag.find(&key)? + key.len();
        Some(tag[at..].split('"').next()?.to_string())
    };
    dom.match_indices("<svg")
        .filter_map(|(i, _)| {
            let tag = &dom[i..i + dom[i..].find('>')?];
            Some(SvgBox {
                id: attr(tag, "id"),
                width: attr(tag, "data-rendered-width")?.parse().ok()?,
                height: attr(tag, "data-rendered-height")?.parse().ok()?,
                shapes: attr(tag, "data-rendered-shapes")?.parse().ok()?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_goes_in_the_body_and_its_attributes_parse_back() {
        let page = with_svg_probe("<html><body><svg id=\"a\"></svg></body></html>");
        assert!(page.contains("<script>") && page.ends_with("</script></body></html>"));
        let dom = r#"<svg id="a" data-rendered-width="900.0" data-rendered-height="340.0" data-rendered-shapes="12"><rect/></svg><svg class="x"></svg>"#;
        assert_eq!(
            rendered_svgs(dom),
            vec![SvgBox {
                id: Some("a".into()),
                width: 900.0,
                height: 340.0,
                shapes: 12
            }]
        );
    }
}
