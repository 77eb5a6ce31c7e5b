//! Drawing a [`BarChart`]: layout of the group labels, then bars with their whiskers, own
//! references and value labels, group references, lines across, and the plot's frame.

use super::super::DASH;
use super::super::{escape, fit_range, frame, open_svg, text_width, y_axis};
use super::super::{Axis, LegendItem, Scale};
use super::{Bar, BarChart};
use std::fmt::Write;

/// Dash patterns of per-bar references by declaration order: colour alone does not survive
/// grey print or colour-blind eyes.
const OWN_DASH: [&str; 4] = ["", "6 3", "2 2", "8 3 2 3"];
/// Colour of per-bar references no [`BarChart::bar_reference`] declared.
const OWN_DEFAULT_COLOR: &str = "#222";
/// Widest bar: a few series in a wide group stay bars, not blocks.
const MAX_BAR_W: f64 = 56.0;
/// Narrowest bar whose value is written above it: a label wider than its bar would run into
/// the next one's.
const VALUE_MIN_W: f64 = 30.0;
/// Group labels: font size, line height, and the angle of rotated ones (degrees).
const LABEL_SIZE: f64 = 11.0;
const LINE_H: f64 = 14.0;
const LABEL_ANGLE: f64 = 35.0;
/// Margins around the plot: left (y tick labels), right, bottom (one or two label lines).
const LEFT: f64 = 74.0;
const RIGHT: f64 = 24.0;
const BOTTOM: f64 = 58.0;

/// Where group labels go: under their groups as written, or rotated on one line each.
struct Labels {
    rotate: bool,
    left: f64,
    bottom: f64,
}

/// The plot's vertical geometry, shared by everything drawn against the y axis.
struct Plot {
    sy: Scale,
    top: f64,
    bottom: f64,
    /// Pixel of the bars' base: 0, or the axis' low end on a log axis.
    base: f64,
    bar_w: f64,
}

impl Plot {
    /// The pixel of `v`, kept inside the plot (an axis range may cut a whisker).
    fn y(&self, v: f64) -> f64 {
        self.sy.map(v).clamp(self.top, self.bottom)
    }
}

/// Whether `v` can be drawn on `axis` (a log axis has no place for 0 and below).
fn shown(axis: &Axis, v: f64) -> bool {
    v.is_finite() && (!axis.log || v > 0.0)
}

/// A group's label on one line: its lines joined by spaces.
fn one_line(label: &str) -> String {
    label.lines().collect::<Vec<_>>().join(" ")
}

/// A legend entry drawn as a swatch (`area`) or a line with this dash pattern.
fn item(name: &str, color: &str, dash: &'static str, area: bool) -> LegendItem {
    LegendItem {
        name: name.into(),
        color: color.into(),
        dash,
        area,
    }
}

/// ` data-key="value"` for each attribute, values escaped.
fn data_attrs(data: &[(String, String)]) -> String {
    data.iter()
        .map(|(k, v)| format!(r#" data-{k}="{}""#, escape(v)))
        .collect()
}

impl BarChart {
    /// The `<svg>` element.
    pub fn to_svg(&self) -> String {
        let styles = self.own_styles();
        let legend = self.legend(&styles);
        let bar_values = self.series.iter().flat_map(|s| &s.bars).flat_map(|b| {
            let spread = b
                .spread
                .map_or([None, None], |(lo, hi)| [Some(lo), Some(hi)]);
            b.value
                .into_iter()
                .chain(spread.into_iter().flatten())
                .chain(b.references.iter().map(|r| r.value))
        });
        let values = bar_values
            .chain(
                self.references
                    .iter()
                    .flat_map(|r| r.values.iter().flatten().copied()),
            )
            .chain(self.hlines.iter().map(|h| h.2));
        let (y_lo, y_hi) = fit_range(&self.y, values, !self.y.log);

        let labels = self.label_layout();
        let (left, right) = (labels.left, RIGHT);
        let height = self.height + (labels.bottom - BOTTOM);
        let mut svg = String::new();
        open_svg(&mut svg, self.width, height, &self.title, &self.id);
        let top = frame(&mut svg, &self.title, self.width, &legend, left, right);
        let (plot_top, plot_bottom) = (top + 8.0, height - labels.bottom);
        let sy = Scale {
            lo: y_lo,
            hi: y_hi,
            px_lo: plot_bottom,
            px_hi: plot_top,
            log: self.y.log,
        };
        y_axis(&mut svg, &self.y, &sy, left, self.width - right);
        let plot_w = self.width - left - right;
        let group_w = plot_w / self.groups.len().max(1) as f64;
        let n_series = self.series.len().max(1) as f64;
        let bar_w = (group_w * 0.8 / n_series).clamp(1.0, MAX_BAR_W);
        let plot = Plot {
            base: sy
                .map(if self.y.log { y_lo } else { 0.0f64.max(y_lo) })
                .clamp(plot_top, plot_bottom),
            sy,
            top: plot_top,
            bottom: plot_bottom,
            bar_w,
        };
        let inset = (group_w - bar_w * n_series) / 2.0;
        for (g, name) in self.groups.iter().enumerate() {
            let gx = left + g as f64 * group_w;
            let group = one_line(name);
            for (k, s) in self.series.iter().enumerate() {
                let x = gx + inset + k as f64 * bar_w;
                match s.bars.get(g) {
                    Some(bar) => self.draw_bar(&mut svg, &plot, x, bar, &s.name, &s.color, &group),
                    None => self.draw_bar(&mut svg, &plot, x, &Bar::missing(), &s.name, "", &group),
                }
                let own = s.bars.get(g).map_or(&[][..], |b| &b.references[..]);
                for r in own.iter().filter(|r| shown(&self.y, r.value)) {
                    let i = styles.iter().position(|(n, _)| *n == r.name).unwrap_or(0);
                    let (color, dash) = (styles[i].1, OWN_DASH[i % OWN_DASH.len()]);
                    let title = r.title.clone().unwrap_or_else(|| {
                        format!(
                            "{}, {}, {group}: {}",
                            r.name,
                            s.name,
                            self.y.format(r.value)
                        )
                    });
                    let y = plot.y(r.value);
                    let _ = write!(
                        svg,
                        r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="2"{} class="fg-ref"><title>{}</title></line>"#,
                        x - 2.0,
                        x + bar_w + 1.0,
                        if dash.is_empty() {
                            String::new()
                        } else {
                            format!(r#" stroke-dasharray="{dash}""#)
                        },
                        escape(&title)
                    );
                }
            }
            for r in &self.references {
                if let Some(v) = r.values.get(g).copied().flatten() {
                    let y = plot.y(v);
                    let _ = write!(
                        svg,
                        r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{}" stroke-width="2" stroke-dasharray="5 3"><title>{}, {group}: {}</title></line>"#,
                        gx + group_w * 0.05,
                        gx + group_w * 0.95,
                        r.color,
                        escape(&r.name),
                        escape(&self.y.format(v))
                    );
                }
            }
            group_label(
                &mut svg,
                name,
                gx + group_w / 2.0,
                plot_bottom,
                labels.rotate,
            );
        }
        for (label, color, v) in &self.hlines {
            let y = plot.y(*v);
            let _ = write!(
                svg,
                r#"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="1.5" stroke-dasharray="8 4"><title>{}</title></line>"#,
                self.width - right,
                escape(label)
            );
        }
        let _ = write!(
            svg,
            r##"<rect x="{left}" y="{plot_top:.1}" width="{plot_w:.1}" height="{:.1}" fill="none" stroke="#888" class="fg-plot"/></svg>"##,
            plot_bottom - plot_top
        );
        svg
    }

    /// (name, colour) of every per-bar reference style: the declared ones, then those bars
    /// name without a declaration, in the order they appear.
    fn own_styles(&self) -> Vec<(&str, &str)> {
        let mut out: Vec<(&str, &str)> = self
            .bar_references
            .iter()
            .map(|(n, c)| (n.as_str(), c.as_str()))
            .collect();
        for r in self
            .series
            .iter()
            .flat_map(|s| &s.bars)
            .flat_map(|b| &b.references)
        {
            if !out.iter().any(|(n, _)| *n == r.name) {
                out.push((r.name.as_str(), OWN_DEFAULT_COLOR));
            }
        }
        out
    }

    /// Series (swatches), per-bar references, per-group references and lines across.
    fn legend(&self, own: &[(&str, &str)]) -> Vec<LegendItem> {
        let series = self
            .series
            .iter()
            .map(|s| item(&s.name, &s.color, "", true));
        let own = own
            .iter()
            .enumerate()
            .map(|(i, (n, c))| item(n, c, OWN_DASH[i % OWN_DASH.len()], false));
        let groups = self
            .references
            .iter()
            .map(|r| item(&r.name, &r.color, DASH, false));
        let lines = self.hlines.iter().map(|(l, c, _)| item(l, c, DASH, false));
        series.chain(own).chain(groups).chain(lines).collect()
    }

    /// Whether group labels fit under their groups as written; if not, the margins rotated
    /// one-line labels need: below, their drop; at the left, the first labels' reach past
    /// the plot's edge.
    fn label_layout(&self) -> Labels {
        let n = self.groups.len().max(1) as f64;
        let group_w = |left: f64| (self.width - left - RIGHT) / n;
        let widest_line = self
            .groups
            .iter()
            .flat_map(|g| g.lines())
            .map(|l| text_width(l, LABEL_SIZE))
            .fold(0.0, f64::max);
        if widest_line <= group_w(LEFT) * 0.95 {
            let lines = self.groups.iter().map(|g| g.lines().count()).max();
            let lines = lines.unwrap_or(1).max(1) as f64;
            return Labels {
                rotate: false,
                left: LEFT,
                bottom: BOTTOM.max(16.0 + LINE_H * (lines - 1.0) + 12.0),
            };
        }
        let (sin, cos) = LABEL_ANGLE.to_radians().sin_cos();
        let widths: Vec<f64> = self
            .groups
            .iter()
            .map(|g| text_width(&one_line(g), LABEL_SIZE))
            .collect();
        // Label i ends at its group's centre and reaches w cos(angle) to the left of it; a
        // wider margin narrows the groups, so settle it in a few rounds. Half the chart at most.
        let mut left = LEFT;
        for _ in 0..4 {
            let g = group_w(left);
            let need = widths
                .iter()
                .enumerate()
                .map(|(i, w)| w * cos + 6.0 - (i as f64 + 0.5) * g)
                .fold(LEFT, f64::max);
            left = need.min(self.width / 2.0);
        }
        let widest = widths.iter().copied().fold(0.0, f64::max);
        Labels {
            rotate: true,
            left,
            bottom: BOTTOM.max(14.0 + widest * sin + LABEL_SIZE * cos + 8.0),
        }
    }

    /// One bar with its whisker and value label, or "n/a" where it has no value (or none a
    /// log axis can show).
    #[allow(clippy::too_many_arguments)]
    fn draw_bar(
        &self,
        svg: &mut String,
        plot: &Plot,
        x: f64,
        bar: &Bar,
        series: &str,
        color: &str,
        group: &str,
    ) {
        let data = data_attrs(&bar.data);
        let shown = |v: f64| shown(&self.y, v);
        let Some(v) = bar.value.filter(|v| shown(*v)) else {
            let title = bar
                .title
                .clone()
                .unwrap_or_else(|| format!("{series}, {group}: no value"));
            let _ = write!(
                svg,
                r##"<text x="{:.1}" y="{:.1}" font-size="10" fill="#a00" text-anchor="middle" class="fg-missing"{data}><title>{}</title>n/a</text>"##,
                x + plot.bar_w / 2.0,
                plot.base - 4.0,
                escape(&title)
            );
            return;
        };
        let title = bar
            .title
            .clone()
            .unwrap_or_else(|| format!("{series}, {group}: {}", self.y.format(v)));
        let y = plot.y(v);
        // At least a pixel high, so a tiny value still shows as a bar.
        let (top, h) = if y < plot.base {
            (y, (plot.base - y).max(1.0))
        } else {
            (plot.base, (y - plot.base).max(1.0))
        };
        let _ = write!(
            svg,
            r#"<rect x="{x:.1}" y="{top:.1}" width="{:.1}" height="{h:.1}" fill="{color}" class="fg-bar"{data}><title>{}</title></rect>"#,
            (plot.bar_w - 1.0).max(0.5),
            escape(&title)
        );
        let mut label_y = y.min(plot.base);
        if let Some((lo, hi)) = bar.spread.filter(|(lo, hi)| shown(*lo) && shown(*hi)) {
            let (cx, y_lo, y_hi) = (x + (plot.bar_w - 1.0) / 2.0, plot.y(lo), plot.y(hi));
            let cap = (plot.bar_w / 4.0).min(4.0);
            let _ = write!(
                svg,
                r##"<path d="M{:.1} {y_hi:.1}H{:.1}M{cx:.1} {y_hi:.1}V{y_lo:.1}M{:.1} {y_lo:.1}H{:.1}" stroke="#333" stroke-width="1" fill="none" class="fg-whisker"><title>{}</title></path>"##,
                cx - cap,
                cx + cap,
                cx - cap,
                cx + cap,
                escape(&format!(
                    "{series}, {group}: {} to {}",
                    self.y.format(lo),
                    self.y.format(hi)
                ))
            );
            label_y = label_y.min(y_hi);
        }
        if self.value_labels && plot.bar_w >= VALUE_MIN_W {
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" font-size="10" text-anchor="middle" class="fg-value">{}</text>"#,
                x + (plot.bar_w - 1.0) / 2.0,
                (label_y - 4.0).max(plot.top + 10.0),
                escape(&self.y.format(v))
            );
        }
    }
}

/// A group's label under the plot at `cx`: its lines stacked, or on one line rotated so that
/// it ends under the group's centre.
fn group_label(svg: &mut String, label: &str, cx: f64, plot_bottom: f64, rotate: bool) {
    if rotate {
        let y = plot_bottom + 14.0;
        let _ = write!(
            svg,
            r#"<text x="{cx:.1}" y="{y:.1}" font-size="{LABEL_SIZE}" text-anchor="end" transform="rotate(-{LABEL_ANGLE} {cx:.1} {y:.1})" class="fg-group">{}</text>"#,
            escape(&one_line(label))
        );
        return;
    }
    let mut lines = label.lines();
    let _ = write!(
        svg,
        r#"<text x="{cx:.1}" y="{:.1}" font-size="{LABEL_SIZE}" text-anchor="middle" class="fg-group">{}"#,
        plot_bottom + 16.0,
        escape(lines.next().unwrap_or(""))
    );
    for l in lines {
        let _ = write!(
            svg,
            r#"<tspan x="{cx:.1}" dy="{LINE_H}">{}</tspan>"#,
            escape(l)
        );
    }
    svg.push_str("</text>");
}
