//! SVG charts written by hand, as inline `<svg>` elements for self-contained pages: a
//! [`LineChart`] (lines, stacked areas, shaded bands, reference lines, labelled points over a
//! numeric x) and a [`BarChart`] (one bar per series in each group; per [`Bar`] a spread
//! whisker, references of its own, a hover title and `data-*` attributes; reference ticks per
//! group, reference lines, value labels, group labels that break or rotate). Axes get round
//! ticks; [`Axis::bytes`] puts them on powers of 1024, [`Axis::log`] on decades. The training
//! report and the benchmark page (`cargo xtask bench`) both draw with these.
//!
//! ```
//! use fitgrad::report::svg::{Axis, LineChart, PALETTE};
//! let svg = LineChart::new("loss per step")
//!     .x_axis(Axis::number("step"))
//!     .y_axis(Axis::number("loss"))
//!     .line("train", PALETTE[0], vec![(0.0, 2.3), (10.0, 1.1), (20.0, 0.6)])
//!     .to_svg();
//! assert!(svg.starts_with("<svg") && svg.contains("<path"));
//! ```
//!
//! Every chart has a `<title>` (what screen readers and tooltips show) and native hover titles
//! on its points and bars; no script is needed to read it.

mod bar;
mod line;

pub use bar::{Bar, BarChart};
pub use line::LineChart;

use std::fmt::Write;

/// Colours that stay apart for colour-blind readers (Okabe and Ito), in the order charts use.
pub const PALETTE: [&str; 8] = [
    "#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442", "#666666",
];

/// Escapes `&`, `<`, `>`, `"` and `'` for HTML and SVG text and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A number the way charts label it: at most 4 significant digits, thousands as k, M, G.
pub fn format_number(v: f64) -> String {
    let a = v.abs();
    let (scaled, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let s = if scaled == scaled.round() && scaled.abs() < 1e4 {
        format!("{scaled:.0}")
    } else if scaled.abs() >= 100.0 {
        format!("{scaled:.1}")
    } else if scaled.abs() >= 1.0 {
        format!("{scaled:.2}")
    } else {
        format!("{scaled:.3}")
    };
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    format!("{s}{suffix}")
}

/// What an axis shows and how its values are written.
#[derive(Clone, Debug)]
pub struct Axis {
    label: String,
    bytes: bool,
    percent: bool,
    log: bool,
    integer: bool,
    range: Option<(f64, f64)>,
}

impl Axis {
    /// Plain numbers ([`format_number`]).
    pub fn number(label: impl Into<String>) -> Axis {
        Axis {
            label: label.into(),
            bytes: false,
            percent: false,
            log: false,
            integer: false,
            range: None,
        }
    }

    /// Byte counts: ticks on round multiples of a power of 1024, written as "1.5 MiB".
    pub fn bytes(label: impl Into<String>) -> Axis {
        Axis {
            bytes: true,
            ..Axis::number(label)
        }
    }

    /// Fractions written as percentages (0.5 is "50%").
    pub fn percent(label: impl Into<String>) -> Axis {
        Axis {
            percent: true,
            ..Axis::number(label)
        }
    }

    /// A logarithmic scale (positive values only; others are left out).
    pub fn log(mut self) -> Axis {
        self.log = true;
        self
    }

    /// Ticks on whole numbers only (steps, op indices).
    pub fn integer(mut self) -> Axis {
        self.integer = true;
        self
    }

    /// Fixes the range instead of fitting it to the data.
    pub fn range(mut self, lo: f64, hi: f64) -> Axis {
        self.range = Some((lo, hi));
        self
    }

    fn format(&self, v: f64) -> String {
        if self.bytes {
            // "1.5 MiB", "512 KiB": as short as ticks on round multiples allow.
            const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
            let (mut x, mut u) = (v.max(0.0), 0);
            while x >= 1024.0 && u + 1 < UNITS.len() {
                x /= 1024.0;
                u += 1;
            }
            format!("{} {}", format_number(x), UNITS[u])
        } else if self.percent {
            format!("{}%", format_number(100.0 * v))
        } else {
            format_number(v)
        }
    }
}

/// A linear or logarithmic map from data to pixels.
#[derive(Clone, Copy, Debug)]
struct Scale {
    lo: f64,
    hi: f64,
    px_lo: f64,
    px_hi: f64,
    log: bool,
}

impl Scale {
    fn map(&self, v: f64) -> f64 {
        let (lo, hi, v) = if self.log {
            (self.lo.log10(), self.hi.log10(), v.max(self.lo).log10())
        } else {
            (self.lo, self.hi, v)
        };
        let t = if hi > lo { (v - lo) / (hi - lo) } else { 0.5 };
        self.px_lo + t * (self.px_hi - self.px_lo)
    }
}

/// Round tick values covering `lo..=hi`, about `n` of them.
fn ticks(axis: &Axis, lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if axis.log {
        let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
        return (a..=b).map(|e| 10f64.powi(e)).collect();
    }
    let unit = if axis.bytes {
        let mut u = 1.0;
        while hi / u >= 1024.0 {
            u *= 1024.0;
        }
        u
    } else {
        1.0
    };
    let span = ((hi - lo) / unit).max(1e-12);
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let mut step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= n as f64)
        .unwrap_or(10.0 * mag)
        * unit;
    if axis.integer {
        step = step.max(1.0).round();
    }
    let first = (lo / step).ceil() * step;
    let mut out = Vec::new();
    let mut v = first;
    while v <= hi + step * 1e-9 && out.len() < 100 {
        out.push(if v.abs() < step * 1e-9 { 0.0 } else { v });
        v += step;
    }
    out
}

/// The range of `values` to draw: from 0 (or the smallest, on a log axis) to a little above
/// the largest, unless the axis fixes it.
fn fit_range(axis: &Axis, values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    if let Some(r) = axis.range {
        return r;
    }
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite() && (!axis.log || *v > 0.0)) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return if axis.log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    if axis.log {
        return (
            10f64.powf(lo.log10().floor()),
            10f64.powf(hi.log10().ceil()),
        );
    }
    if from_zero {
        lo = lo.min(0.0);
        hi = hi.max(0.0);
    }
    if hi <= lo {
        hi = lo + 1.0;
    }
    (lo, hi + (hi - lo) * 0.06)
}

/// Approximate width of `text` in pixels at `size` (average glyph of a sans-serif face).
fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.56
}

/// The dash pattern of dashed lines and their legend entries.
const DASH: &str = "6 3";

/// A legend entry: a name and how it is drawn (a swatch for an area, else a line with this
/// stroke-dasharray, "" for solid).
struct LegendItem {
    name: String,
    color: String,
    dash: &'static str,
    area: bool,
}

/// Writes the chart's frame (title, legend, plot box) and returns the top of the plot area.
fn frame(
    svg: &mut String,
    title: &str,
    width: f64,
    legend: &[LegendItem],
    left: f64,
    right: f64,
) -> f64 {
    let _ = write!(
        svg,
        r#"<text x="{left}" y="20" class="fg-title" font-size="15" font-weight="600">{}</text>"#,
        escape(title)
    );
    // Legend: one row of swatches under the title, wrapped to the width.
    let (mut x, mut y) = (left, 40.0);
    for item in legend {
        let w = 26.0 + text_width(&item.name, 12.0) + 18.0;
        if x + w > width - right && x > left {
            x = left;
            y += 18.0;
        }
        if item.area {
            let _ = write!(
                svg,
                r#"<rect x="{x}" y="{}" width="16" height="10" fill="{}" fill-opacity="0.85"/>"#,
                y - 9.0,
                item.color
            );
        } else {
            let _ = write!(
                svg,
                r#"<line x1="{x}" y1="{y1}" x2="{x2}" y2="{y1}" stroke="{}" stroke-width="2.5"{}/>"#,
                item.color,
                if item.dash.is_empty() {
                    String::new()
                } else {
                    format!(r#" stroke-dasharray="{}""#, item.dash)
                },
                y1 = y - 4.0,
                x2 = x + 16.0
            );
        }
        let _ = write!(
            svg,
            r#"<text x="{}" y="{y}" font-size="12">{}</text>"#,
            x + 22.0,
            escape(&item.name)
        );
        x += w;
    }
    if legend.is_empty() {
        30.0
    } else {
        y + 14.0
    }
}

/// Draws the y axis (ticks, grid, label) of a plot box.
fn y_axis(svg: &mut String, axis: &Axis, scale: &Scale, left: f64, right_x: f64) {
    let (lo, hi) = (scale.lo, scale.hi);
    for t in ticks(axis, lo, hi, 5) {
        let y = scale.map(t);
        let _ = write!(
            svg,
            r##"<line x1="{left}" y1="{y:.1}" x2="{right_x}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            left - 6.0,
            y + 4.0,
            escape(&axis.format(t))
        );
    }
    let mid = (scale.px_lo + scale.px_hi) / 2.0;
    let _ = write!(
        svg,
        r#"<text x="14" y="{mid:.1}" font-size="12" text-anchor="middle" transform="rotate(-90 14 {mid:.1})">{}</text>"#,
        escape(&axis.label)
    );
}

/// Opens an `<svg>` element of this size with an accessible title and an optional id.
fn open_svg(svg: &mut String, width: f64, height: f64, title: &str, id: &Option<String>) {
    let id_attr = id
        .as_ref()
        .map(|i| format!(r#" id="{}""#, escape(i)))
        .unwrap_or_default();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg"{id_attr} class="fg-chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" font-family="system-ui, sans-serif"><title>{}</title><rect width="{width}" height="{height}" fill="white"/>"#,
        escape(title)
    );
}

/// A short stable hash, for ids unique within a page.
fn fnv(s: &str) -> u64 {
    crate::hash::fnv1a(s.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_covers_markup() {
        assert_eq!(
            escape(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn numbers_and_ticks_are_round() {
        assert_eq!(format_number(0.0), "0");
        assert_eq!(format_number(1.5), "1.5");
        assert_eq!(format_number(25_000.0), "25k");
        assert_eq!(format_number(3_200_000.0), "3.2M");
        let t = ticks(&Axis::number(""), 0.0, 9.3, 5);
        assert_eq!(t, vec![0.0, 2.0, 4.0, 6.0, 8.0]);
        // Bytes tick on multiples of a power of 1024: 0, 0.5, 1, 1.5, 2 MiB.
        let mib = 1024.0 * 1024.0;
        let t = ticks(&Axis::bytes(""), 0.0, 2.2 * mib, 5);
        assert_eq!(t, vec![0.0, 0.5 * mib, mib, 1.5 * mib, 2.0 * mib]);
        let t = ticks(&Axis::number("").integer(), 0.0, 3.0, 8);
        assert!(t.iter().all(|v| v.fract() == 0.0), "{t:?}");
        let t = ticks(&Axis::number("").log(), 3.0, 4000.0, 5);
        assert_eq!(t, vec![1.0, 10.0, 100.0, 1000.0, 10000.0]);
    }

    #[test]
    fn charts_hold_their_parts() {
        let svg = LineChart::new("a <b>")
            .id("c1")
            .stacked(
                vec![0.0, 1.0, 2.0],
                vec![("p".into(), PALETTE[0].into(), vec![1.0, 1.0, 1.0])],
                true,
            )
            .point("peak", PALETTE[5], 1.0, 1.0)
            .hline("budget", PALETTE[5], 3.0, true)
            .to_svg();
        assert!(svg.contains(r#"id="c1""#) && svg.contains("a &lt;b&gt;"));
        assert!(svg.contains("fg-area") && svg.contains("fg-peak") && svg.contains("budget"));
        let bars = BarChart::new("gflops", vec!["256".into(), "512".into()])
            .series("gpu", PALETTE[0], vec![Some(10.0), None])
            .reference("naive", PALETTE[7], vec![Some(2.0), Some(3.0)])
            .to_svg();
        assert_eq!(bars.matches("fg-bar").count(), 1);
        assert!(bars.contains("n/a"));
    }
}
