//! [`BarChart`]: groups along x, one bar per series in each, reference ticks per group and
//! reference lines across.

use super::{escape, fit_range, frame, open_svg, y_axis};
use super::{Axis, LegendItem, Scale};
use std::fmt::Write;

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
