//! SVG charts written by hand, as inline `<svg>` elements for self-contained pages: a
//! [`LineChart`] (lines, stacked areas, shaded bands, reference lines, labelled points over a
//! numeric x) and a [`BarChart`] (one bar per series in each group, reference ticks per group,
//! reference lines). Axes get round ticks; [`Axis::bytes`] puts them on powers of 1024.
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

/// A legend entry: a name and how it is drawn.
struct LegendItem {
    name: String,
    color: String,
    dashed: bool,
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
                if item.dashed {
                    r#" stroke-dasharray="6 3""#
                } else {
                    ""
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

enum Layer {
    Line {
        name: String,
        color: String,
        points: Vec<(f64, f64)>,
        dashed: bool,
        step: bool,
        dots: bool,
    },
    Stack {
        xs: Vec<f64>,
        layers: Vec<(String, String, Vec<f64>)>,
        step: bool,
    },
    HLine {
        label: String,
        color: String,
        y: f64,
        dashed: bool,
    },
    VLine {
        label: String,
        color: String,
        x: f64,
    },
    Band {
        label: String,
        from: f64,
        to: f64,
        shade: bool,
    },
    Point {
        label: String,
        color: String,
        x: f64,
        y: f64,
    },
}

/// A chart over a numeric x: lines, stacked areas, bands, reference lines and labelled
/// points, drawn in the order added (bands and areas first is what reads best).
pub struct LineChart {
    title: String,
    id: Option<String>,
    width: f64,
    height: f64,
    x: Axis,
    y: Axis,
    layers: Vec<Layer>,
}

impl LineChart {
    /// An empty chart, 900 x 340 pixels.
    pub fn new(title: impl Into<String>) -> LineChart {
        LineChart {
            title: title.into(),
            id: None,
            width: 900.0,
            height: 340.0,
            x: Axis::number(""),
            y: Axis::number(""),
            layers: Vec::new(),
        }
    }

    /// Sets the `id` attribute of the `<svg>` element.
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Sets the size in pixels.
    pub fn size(mut self, width: f64, height: f64) -> Self {
        self.width = width.max(200.0);
        self.height = height.max(120.0);
        self
    }

    /// Sets the x axis.
    pub fn x_axis(mut self, axis: Axis) -> Self {
        self.x = axis;
        self
    }

    /// Sets the y axis.
    pub fn y_axis(mut self, axis: Axis) -> Self {
        self.y = axis;
        self
    }

    /// A solid line through `points` (x, y), in x order.
    pub fn line(self, name: impl Into<String>, color: &str, points: Vec<(f64, f64)>) -> Self {
        self.add_line(name.into(), color, points, false, false, false)
    }

    /// A line with a dot at every point (few points: per-epoch values).
    pub fn dotted_line(self, name: impl Into<String>, color: &str, pts: Vec<(f64, f64)>) -> Self {
        self.add_line(name.into(), color, pts, false, false, true)
    }

    /// A dashed step line: each value holds until the next x, the last for one unit.
    pub fn dashed_steps(self, name: impl Into<String>, color: &str, pts: Vec<(f64, f64)>) -> Self {
        self.add_line(name.into(), color, pts, true, true, false)
    }

    fn add_line(
        mut self,
        name: String,
        color: &str,
        points: Vec<(f64, f64)>,
        dashed: bool,
        step: bool,
        dots: bool,
    ) -> Self {
        let points = points
            .into_iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        self.layers.push(Layer::Line {
            name,
            color: color.into(),
            points,
            dashed,
            step,
            dots,
        });
        self
    }

    /// Areas stacked bottom to top in the order given, over `xs`: each layer is (name, colour,
    /// one value per x). With `step`, each value holds until the next x (the last for one
    /// unit), which is exact for per-op samples.
    pub fn stacked(
        mut self,
        xs: Vec<f64>,
        layers: Vec<(String, String, Vec<f64>)>,
        step: bool,
    ) -> Self {
        self.layers.push(Layer::Stack { xs, layers, step });
        self
    }

    /// A horizontal reference line at `y`, labelled at its right end.
    pub fn hline(mut self, label: impl Into<String>, color: &str, y: f64, dashed: bool) -> Self {
        self.layers.push(Layer::HLine {
            label: label.into(),
            color: color.into(),
            y,
            dashed,
        });
        self
    }

    /// A vertical marker at `x`, labelled at its top.
    pub fn vline(mut self, label: impl Into<String>, color: &str, x: f64) -> Self {
        self.layers.push(Layer::VLine {
            label: label.into(),
            color: color.into(),
            x,
        });
        self
    }

    /// A band over `from..to` labelled at the top where it is wide enough; `shade` fills it
    /// lightly (alternate bands to tell neighbours apart).
    pub fn band(mut self, label: impl Into<String>, from: f64, to: f64, shade: bool) -> Self {
        self.layers.push(Layer::Band {
            label: label.into(),
            from,
            to,
            shade,
        });
        self
    }

    /// A marked point with a label beside it (the peak).
    pub fn point(mut self, label: impl Into<String>, color: &str, x: f64, y: f64) -> Self {
        self.layers.push(Layer::Point {
            label: label.into(),
            color: color.into(),
            x,
            y,
        });
        self
    }

    /// The `<svg>` element.
    pub fn to_svg(&self) -> String {
        let (left, right, bottom) = (74.0, 24.0, 46.0);
        let mut legend = Vec::new();
        let (mut xs, mut ys) = (Vec::new(), vec![0.0]);
        for l in &self.layers {
            match l {
                Layer::Line {
                    name,
                    color,
                    points,
                    dashed,
                    step,
                    ..
                } => {
                    legend.push(LegendItem {
                        name: name.clone(),
                        color: color.clone(),
                        dashed: *dashed,
                        area: false,
                    });
                    xs.extend(points.iter().map(|p| p.0));
                    if *step {
                        xs.extend(points.last().map(|p| p.0 + 1.0));
                    }
                    ys.extend(points.iter().map(|p| p.1));
                }
                Layer::Stack {
                    xs: sx,
                    layers,
                    step,
                } => {
                    for (name, color, _) in layers.iter().rev() {
                        legend.push(LegendItem {
                            name: name.clone(),
                            color: color.clone(),
                            dashed: false,
                            area: true,
                        });
                    }
                    xs.extend(sx.iter().copied());
                    if *step {
                        xs.extend(sx.last().map(|x| x + 1.0));
                    }
                    ys.extend((0..sx.len()).map(|i| {
                        layers
                            .iter()
                            .map(|(_, _, v)| v.get(i).copied().unwrap_or(0.0))
                            .sum::<f64>()
                    }));
                }
                Layer::HLine {
                    label,
                    color,
                    y,
                    dashed,
                } => {
                    legend.push(LegendItem {
                        name: label.clone(),
                        color: color.clone(),
                        dashed: *dashed,
                        area: false,
                    });
                    ys.push(*y);
                }
                Layer::VLine { x, .. } => xs.push(*x),
                Layer::Band { from, to, .. } => xs.extend([*from, *to]),
                Layer::Point { x, y, .. } => {
                    xs.push(*x);
                    // Headroom for the label above the point.
                    ys.push(*y * 1.12);
                }
            }
        }
        let mut svg = String::new();
        open_svg(&mut svg, self.width, self.height, &self.title, &self.id);
        let top = frame(&mut svg, &self.title, self.width, &legend, left, right);
        let (x_lo, x_hi) = match self.x.range {
            Some(r) => r,
            None => {
                let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if lo.is_finite() && hi > lo {
                    (lo, hi)
                } else if lo.is_finite() {
                    (lo - 0.5, lo + 0.5)
                } else {
                    (0.0, 1.0)
                }
            }
        };
        let (y_lo, y_hi) = fit_range(&self.y, ys.into_iter(), !self.y.log);
        let plot_top = top + 8.0;
        let plot_bottom = self.height - bottom;
        let sx = Scale {
            lo: x_lo,
            hi: x_hi,
            px_lo: left,
            px_hi: self.width - right,
            log: self.x.log,
        };
        let sy = Scale {
            lo: y_lo,
            hi: y_hi,
            px_lo: plot_bottom,
            px_hi: plot_top,
            log: self.y.log,
        };
        y_axis(&mut svg, &self.y, &sy, left, self.width - right);
        for t in ticks(&self.x, x_lo, x_hi, 8) {
            let x = sx.map(t);
            let _ = write!(
                svg,
                r#"<text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
                plot_bottom + 16.0,
                escape(&self.x.format(t))
            );
        }
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
            (left + self.width - right) / 2.0,
            self.height - 8.0,
            escape(&self.x.label)
        );
        let clip = format!(
            "fgclip{:x}",
            fnv(&self.title) ^ fnv(self.id.as_deref().unwrap_or(""))
        );
        let _ = write!(
            svg,
            r#"<clipPath id="{clip}"><rect x="{left}" y="{plot_top:.1}" width="{:.1}" height="{:.1}"/></clipPath><g clip-path="url(#{clip})">"#,
            self.width - right - left,
            plot_bottom - plot_top
        );
        let mut labels = String::new();
        for l in &self.layers {
            self.draw(&mut svg, &mut labels, l, &sx, &sy);
        }
        svg.push_str("</g>");
        let _ = write!(
            svg,
            r##"<rect x="{left}" y="{plot_top:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="#888"/>"##,
            self.width - right - left,
            plot_bottom - plot_top
        );
        svg.push_str(&labels);
        svg.push_str("</svg>");
        svg
    }

    fn draw(&self, svg: &mut String, labels: &mut String, l: &Layer, sx: &Scale, sy: &Scale) {
        match l {
            Layer::Band {
                label,
                from,
                to,
                shade,
            } => {
                let (a, b) = (sx.map(*from), sx.map(*to));
                let _ = write!(
                    svg,
                    r##"<rect x="{a:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}" fill-opacity="0.6"><title>{}</title></rect>"##,
                    sy.px_hi,
                    (b - a).max(0.0),
                    sy.px_lo - sy.px_hi,
                    if *shade { "#eef0f4" } else { "#f9fafb" },
                    escape(label)
                );
                // The label at 11 px, smaller where that does not fit; none in a sliver.
                if let Some(size) = [11.0, 9.0, 8.0]
                    .into_iter()
                    .find(|&f| text_width(label, f) + 2.0 < b - a)
                {
                    let _ = write!(
                        labels,
                        r##"<text x="{:.1}" y="{:.1}" font-size="{size}" fill="#555" text-anchor="middle">{}</text>"##,
                        (a + b) / 2.0,
                        sy.px_hi + 13.0,
                        escape(label)
                    );
                }
            }
            Layer::Stack { xs, layers, step } => {
                let n = xs.len();
                let mut below = vec![0.0f64; n];
                for (name, color, values) in layers {
                    let above: Vec<f64> = (0..n)
                        .map(|i| below[i] + values.get(i).copied().unwrap_or(0.0))
                        .collect();
                    let edge = |vals: &[f64]| -> Vec<(f64, f64)> {
                        let mut pts = Vec::with_capacity(2 * n);
                        for i in 0..n {
                            pts.push((xs[i], vals[i]));
                            if *step {
                                let next = xs.get(i + 1).copied().unwrap_or(xs[i] + 1.0);
                                pts.push((next, vals[i]));
                            }
                        }
                        pts
                    };
                    let top = edge(&above);
                    let mut bottom = edge(&below);
                    bottom.reverse();
                    let mut d = String::new();
                    for (k, (x, y)) in top.iter().chain(&bottom).enumerate() {
                        let _ = write!(
                            d,
                            "{}{:.1},{:.1}",
                            if k == 0 { "M" } else { "L" },
                            sx.map(*x),
                            sy.map(*y)
                        );
                    }
                    d.push('Z');
                    let _ = write!(
                        svg,
                        r#"<path d="{d}" fill="{color}" fill-opacity="0.85" stroke="none" class="fg-area"><title>{}</title></path>"#,
                        escape(name)
                    );
                    below = above;
                }
            }
            Layer::Line {
                name,
                color,
                points,
                dashed,
                step,
                dots,
            } => {
                let mut d = String::new();
                for (k, &(x, y)) in points.iter().enumerate() {
                    let _ = write!(
                        d,
                        "{}{:.1},{:.1}",
                        if k == 0 { "M" } else { "L" },
                        sx.map(x),
                        sy.map(y)
                    );
                    if *step {
                        let next = points.get(k + 1).map_or(x + 1.0, |p| p.0);
                        let _ = write!(d, "L{:.1},{:.1}", sx.map(next), sy.map(y));
                    }
                }
                if points.len() == 1 && !*step {
                    // One point draws no segment: a dot shows it.
                    let (x, y) = points[0];
                    let _ = write!(d, "M{:.1},{:.1}h0.1", sx.map(x), sy.map(y));
                }
                let _ = write!(
                    svg,
                    r#"<path d="{d}" fill="none" stroke="{color}" stroke-width="2" stroke-linejoin="round" stroke-linecap="round"{} class="fg-line"><title>{}</title></path>"#,
                    if *dashed {
                        r#" stroke-dasharray="6 3""#
                    } else {
                        ""
                    },
                    escape(name)
                );
                if *dots {
                    for &(x, y) in points {
                        let _ = write!(
                            svg,
                            r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}"><title>{}: {} at {}</title></circle>"#,
                            sx.map(x),
                            sy.map(y),
                            escape(name),
                            escape(&self.y.format(y)),
                            escape(&self.x.format(x))
                        );
                    }
                }
            }
            Layer::HLine {
                label,
                color,
                y,
                dashed,
            } => {
                let py = sy.map(*y);
                let _ = write!(
                    svg,
                    r#"<line x1="{:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="{color}" stroke-width="1.8"{}><title>{}</title></line>"#,
                    sx.px_lo,
                    sx.px_hi,
                    if *dashed {
                        r#" stroke-dasharray="8 4""#
                    } else {
                        ""
                    },
                    escape(label)
                );
                let _ = write!(
                    labels,
                    r#"<text x="{:.1}" y="{:.1}" font-size="11" fill="{color}" text-anchor="end">{}</text>"#,
                    sx.px_hi - 4.0,
                    py - 4.0,
                    escape(label)
                );
            }
            Layer::VLine { label, color, x } => {
                let px = sx.map(*x);
                let _ = write!(
                    svg,
                    r#"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="{color}" stroke-width="1.5" stroke-dasharray="3 3"><title>{}</title></line>"#,
                    sy.px_hi,
                    sy.px_lo,
                    escape(label)
                );
            }
            Layer::Point { label, color, x, y } => {
                let (px, py) = (sx.map(*x), sy.map(*y));
                let _ = write!(
                    labels,
                    r#"<circle cx="{px:.1}" cy="{py:.1}" r="5" fill="{color}" stroke="white" stroke-width="1.5" class="fg-peak"><title>{}</title></circle>"#,
                    escape(label)
                );
                // The label on the side with room, a little above the point (below it when
                // the point is near the top).
                let w = text_width(label, 12.0);
                let right_side = px + 10.0 + w < sx.px_hi;
                let (tx, anchor) = if right_side {
                    (px + 10.0, "start")
                } else {
                    ((px - 10.0).max(sx.px_lo + w), "end")
                };
                let ty = if py - 10.0 < sy.px_hi + 14.0 {
                    py + 18.0
                } else {
                    py - 10.0
                };
                // A white box behind the label keeps it readable over areas and lines.
                let bx = if right_side { tx - 3.0 } else { tx - w - 3.0 };
                let _ = write!(
                    labels,
                    r#"<rect x="{bx:.1}" y="{:.1}" width="{:.1}" height="17" fill="white" fill-opacity="0.85" rx="3"/><text x="{tx:.1}" y="{ty:.1}" font-size="12" font-weight="600" fill="{color}" text-anchor="{anchor}" class="fg-peak-label">{}</text>"#,
                    ty - 13.0,
                    w + 6.0,
                    escape(label)
                );
            }
        }
    }
}

/// A short stable hash, for ids unique within a page.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// One series of a [`BarChart`]: a bar in each group (`None`: no value there, e.g. an adapter
/// that failed, drawn as "n/a").
struct BarSeries {
    name: String,
    color: String,
    values: Vec<Option<f64>>,
}

/// Bars in groups: each group (a shape) holds one bar per series (an adapter), with reference
/// ticks per group (a naive kernel, a CPU baseline) and reference lines across the chart.
pub struct BarChart {
    title: String,
    id: Option<String>,
    width: f64,
    height: f64,
    y: Axis,
    groups: Vec<String>,
    series: Vec<BarSeries>,
    references: Vec<BarSeries>,
    hlines: Vec<(String, String, f64)>,
}

impl BarChart {
    /// A chart with these groups along x, 900 x 340 pixels.
    pub fn new(title: impl Into<String>, groups: Vec<String>) -> BarChart {
        BarChart {
            title: title.into(),
            id: None,
            width: 900.0,
            height: 340.0,
            y: Axis::number(""),
            groups,
            series: Vec::new(),
            references: Vec::new(),
            hlines: Vec::new(),
        }
    }

    /// Sets the `id` attribute of the `<svg>` element.
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Sets the size in pixels.
    pub fn size(mut self, width: f64, height: f64) -> Self {
        self.width = width.max(200.0);
        self.height = height.max(120.0);
        self
    }

    /// Sets the y axis ([`Axis::log`] for values spanning magnitudes).
    pub fn y_axis(mut self, axis: Axis) -> Self {
        self.y = axis;
        self
    }

    /// A series: one bar per group, in group order.
    pub fn series(
        mut self,
        name: impl Into<String>,
        color: &str,
        values: Vec<Option<f64>>,
    ) -> Self {
        self.series.push(BarSeries {
            name: name.into(),
            color: color.into(),
            values,
        });
        self
    }

    /// A reference drawn as a dashed tick across each group at its value there.
    pub fn reference(
        mut self,
        name: impl Into<String>,
        color: &str,
        values: Vec<Option<f64>>,
    ) -> Self {
        self.references.push(BarSeries {
            name: name.into(),
            color: color.into(),
            values,
        });
        self
    }

    /// A horizontal reference line across the whole chart.
    pub fn hline(mut self, label: impl Into<String>, color: &str, y: f64) -> Self {
        self.hlines.push((label.into(), color.into(), y));
        self
    }

    /// The `<svg>` element.
    pub fn to_svg(&self) -> String {
        let (left, right, bottom) = (74.0, 24.0, 58.0);
        let legend: Vec<LegendItem> = self
            .series
            .iter()
            .map(|s| LegendItem {
                name: s.name.clone(),
                color: s.color.clone(),
                dashed: false,
                area: true,
            })
            .chain(self.references.iter().map(|s| LegendItem {
                name: s.name.clone(),
                color: s.color.clone(),
                dashed: true,
                area: false,
            }))
            .chain(self.hlines.iter().map(|(l, c, _)| LegendItem {
                name: l.clone(),
                color: c.clone(),
                dashed: true,
                area: false,
            }))
            .collect();
        let values = self
            .series
            .iter()
            .chain(&self.references)
            .flat_map(|s| s.values.iter().flatten().copied())
            .chain(self.hlines.iter().map(|h| h.2));
        let (y_lo, y_hi) = fit_range(&self.y, values, !self.y.log);
        let mut svg = String::new();
        open_svg(&mut svg, self.width, self.height, &self.title, &self.id);
        let top = frame(&mut svg, &self.title, self.width, &legend, left, right);
        let (plot_top, plot_bottom) = (top + 8.0, self.height - bottom);
        let sy = Scale {
            lo: y_lo,
            hi: y_hi,
            px_lo: plot_bottom,
            px_hi: plot_top,
            log: self.y.log,
        };
        y_axis(&mut svg, &self.y, &sy, left, self.width - right);
        let plot_w = self.width - left - right;
        let groups = self.groups.len().max(1) as f64;
        let group_w = plot_w / groups;
        let bars = self.series.len().max(1) as f64;
        let bar_w = (group_w * 0.8 / bars).max(1.0);
        let base = sy.map(if self.y.log { y_lo } else { 0.0f64.max(y_lo) });
        for (g, name) in self.groups.iter().enumerate() {
            let gx = left + g as f64 * group_w;
            let x0 = gx + group_w * 0.1;
            for (k, s) in self.series.iter().enumerate() {
                let x = x0 + k as f64 * bar_w;
                match s.values.get(g).copied().flatten() {
                    Some(v) if !self.y.log || v > 0.0 => {
                        let y = sy.map(v);
                        let _ = write!(
                            svg,
                            r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}" class="fg-bar"><title>{}, {}: {}</title></rect>"#,
                            y.min(base),
                            (bar_w - 1.0).max(0.5),
                            (base - y).abs().max(0.5),
                            s.color,
                            escape(&s.name),
                            escape(name),
                            escape(&self.y.format(v))
                        );
                    }
                    _ => {
                        let _ = write!(
                            svg,
                            r##"<text x="{:.1}" y="{:.1}" font-size="10" fill="#a00" text-anchor="middle">n/a</text>"##,
                            x + bar_w / 2.0,
                            base - 4.0
                        );
                    }
                }
            }
            for r in &self.references {
                if let Some(v) = r.values.get(g).copied().flatten() {
                    let y = sy.map(v);
                    let _ = write!(
                        svg,
                        r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{}" stroke-width="2" stroke-dasharray="5 3"><title>{}, {}: {}</title></line>"#,
                        gx + group_w * 0.05,
                        gx + group_w * 0.95,
                        r.color,
                        escape(&r.name),
                        escape(name),
                        escape(&self.y.format(v))
                    );
                }
            }
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
                gx + group_w / 2.0,
                plot_bottom + 16.0,
                escape(name)
            );
        }
        for (label, color, v) in &self.hlines {
            let y = sy.map(*v);
            let _ = write!(
                svg,
                r#"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="1.5" stroke-dasharray="8 4"><title>{}</title></line>"#,
                self.width - right,
                escape(label)
            );
        }
        let _ = write!(
            svg,
            r##"<rect x="{left}" y="{plot_top:.1}" width="{plot_w:.1}" height="{:.1}" fill="none" stroke="#888"/></svg>"##,
            plot_bottom - plot_top
        );
        svg
    }
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
