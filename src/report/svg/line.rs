//! [`LineChart`]: lines, stacked areas, shaded bands, reference lines and labelled points over a
//! numeric x.

use super::{escape, fit_range, fnv, frame, open_svg, text_width, ticks, y_axis, DASH};
use super::{Axis, LegendItem, Scale};
use std::fmt::Write;

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
                        dash: if *dashed { DASH } else { "" },
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
                            dash: "",
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
                        dash: if *dashed { DASH } else { "" },
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
                // Above the line, or below it where the band labels at the top would collide.
                let ty = if py - 4.0 < sy.px_hi + 18.0 {
                    py + 13.0
                } else {
                    py - 4.0
                };
                let _ = write!(
                    labels,
                    r#"<text x="{:.1}" y="{ty:.1}" font-size="11" fill="{color}" text-anchor="end" paint-order="stroke" stroke="white" stroke-width="3">{}</text>"#,
                    sx.px_hi - 4.0,
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
