//! Small hand-written SVG pieces for the benchmark page: escaping, an element builder, value
//! scales with ticks, a palette. Inline SVG needs no library, script or network.

use std::fmt::Write;

/// Escapes text for HTML and SVG, in content and in quoted attributes.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// Distinct colours for series (adapters), readable on white and in grey print.
const PALETTE: &[&str] = &[
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2", "#edc948", "#9c755f",
];

/// Series `i`'s colour.
pub fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// An `<svg>` element under construction, with explicit pixel size (so it has a size before
/// any stylesheet applies) and a matching viewBox (so CSS may scale it down).
pub struct Svg {
    body: String,
    width: f64,
    height: f64,
    class: String,
    label: String,
}

impl Svg {
    /// An empty picture of `width` x `height` pixels; `label` is its accessible name.
    pub fn new(width: f64, height: f64, class: &str, label: &str) -> Svg {
        Svg {
            body: String::new(),
            width,
            height,
            class: class.into(),
            label: label.into(),
        }
    }

    /// A filled rectangle; `attrs` is extra attribute text (already escaped), `title` a tooltip.
    #[allow(clippy::too_many_arguments)]
    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, fill: &str, attrs: &str, title: &str) {
        let _ = write!(
            self.body,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{fill}" {attrs}>"#
        );
        if !title.is_empty() {
            let _ = write!(self.body, "<title>{}</title>", esc(title));
        }
        self.body.push_str("</rect>");
    }

    /// A line; `dash` is a stroke-dasharray ("" for solid), `title` a tooltip.
    #[allow(clippy::too_many_arguments)]
    pub fn line(
        &mut self,
        (x1, y1): (f64, f64),
        (x2, y2): (f64, f64),
        stroke: &str,
        width: f64,
        dash: &str,
        attrs: &str,
        title: &str,
    ) {
        let _ = write!(
            self.body,
            r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{stroke}" stroke-width="{width}" {}{attrs}>"#,
            if dash.is_empty() {
                String::new()
            } else {
                format!(r#"stroke-dasharray="{dash}" "#)
            }
        );
        if !title.is_empty() {
            let _ = write!(self.body, "<title>{}</title>", esc(title));
        }
        self.body.push_str("</line>");
    }

    /// Text at (x, y); `anchor` is start, middle or end; `rotate` degrees about (x, y).
    pub fn text(&mut self, x: f64, y: f64, s: &str, size: f64, anchor: &str, rotate: f64) {
        let transform = if rotate == 0.0 {
            String::new()
        } else {
            format!(r#" transform="rotate({rotate} {x:.1} {y:.1})""#)
        };
        let _ = write!(
            self.body,
            r#"<text x="{x:.1}" y="{y:.1}" font-size="{size}" text-anchor="{anchor}"{transform}>{}</text>"#,
            esc(s)
        );
    }

    /// The finished element.
    pub fn finish(self) -> String {
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" class="{}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" aria-label="{}" font-family="sans-serif">{}</svg>"#,
            esc(&self.class),
            esc(&self.label),
            self.body,
            w = self.width,
            h = self.height,
        )
    }
}

/// Maps values onto pixels, linearly from 0 or by decades.
pub struct Scale {
    lo: f64,
    hi: f64,
    log: bool,
    /// Pixel of `lo` and of `hi` (top of the plot: a smaller y).
    px: (f64, f64),
}

impl Scale {
    /// A scale covering `values` (positive where `log`): from 0 to a round number above the
    /// largest, or whole decades around them. The pixel range is `px` (bottom, top).
    pub fn covering(values: &[f64], log: bool, px: (f64, f64)) -> Scale {
        let finite = values.iter().copied().filter(|v| v.is_finite() && *v > 0.0);
        let max = finite.clone().fold(f64::MIN, f64::max);
        let min = finite.fold(f64::MAX, f64::min);
        if max < min {
            // Nothing to show: an empty axis from 0 to 1.
            return Scale {
                lo: 0.0,
                hi: 1.0,
                log: false,
                px,
            };
        }
        if log {
            let lo = 10f64.powf(min.log10().floor());
            let mut hi = 10f64.powf(max.log10().ceil());
            if hi <= lo {
                hi = lo * 10.0;
            }
            Scale { lo, hi, log, px }
        } else {
            Scale {
                lo: 0.0,
                hi: nice_above(max * 1.05),
                log,
                px,
            }
        }
    }

    /// Whether values spread over more than `decades` orders of magnitude (then a log scale
    /// keeps the small ones visible).
    pub fn wants_log(values: &[f64], ratio: f64) -> bool {
        let pos: Vec<f64> = values
            .iter()
            .copied()
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        let max = pos.iter().copied().fold(f64::MIN, f64::max);
        let min = pos.iter().copied().fold(f64::MAX, f64::min);
        !pos.is_empty() && max / min > ratio
    }

    /// Whether this is a log scale.
    pub fn is_log(&self) -> bool {
        self.log
    }

    /// The pixel of `v` (clamped to the axis).
    pub fn y(&self, v: f64) -> f64 {
        let t = if self.log {
            if v <= 0.0 || !v.is_finite() {
                0.0
            } else {
                (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
            }
        } else {
            (v - self.lo) / (self.hi - self.lo)
        };
        let t = t.clamp(0.0, 1.0);
        self.px.0 + (self.px.1 - self.px.0) * t
    }

    /// Tick values: decades (with 2 and 5 when there are few), or about five round steps.
    pub fn ticks(&self) -> Vec<f64> {
        if self.log {
            let (a, b) = (
                self.lo.log10().round() as i32,
                self.hi.log10().round() as i32,
            );
            let mut t = Vec::new();
            for e in a..=b {
                let d = 10f64.powi(e);
                t.push(d);
                if b - a <= 2 && e < b {
                    t.extend([2.0 * d, 5.0 * d]);
                }
            }
            t
        } else {
            let step = nice_above(self.hi / 5.0);
            (0..)
                .map(|i| i as f64 * step)
                .take_while(|v| *v <= self.hi * (1.0 + 1e-9))
                .collect()
        }
    }
}

/// The smallest of 1, 2, 2.5, 5 times a power of ten that is at least `x` (> 0).
fn nice_above(x: f64) -> f64 {
    if x.is_nan() || x <= 0.0 || !x.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(x.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|v| *v >= x * (1.0 - 1e-12))
        .unwrap_or(10.0 * p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup() {
        assert_eq!(
            esc(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn scales_map_and_tick() {
        let s = Scale::covering(&[3.0, 47.0], false, (200.0, 0.0));
        assert_eq!(s.ticks(), vec![0.0, 10.0, 20.0, 30.0, 40.0, 50.0]);
        assert_eq!(s.y(0.0), 200.0);
        assert_eq!(s.y(50.0), 0.0);
        assert_eq!(s.y(25.0), 100.0);
        let l = Scale::covering(&[0.3, 470.0], true, (200.0, 0.0));
        assert_eq!(l.ticks(), vec![0.1, 1.0, 10.0, 100.0, 1000.0]);
        assert!((l.y(1.0) - 150.0).abs() < 1e-9);
        assert!(Scale::wants_log(&[0.3, 470.0], 30.0));
        assert!(!Scale::wants_log(&[3.0, 47.0], 30.0));
        let empty = Scale::covering(&[], true, (200.0, 0.0));
        assert_eq!(empty.y(0.5), 100.0);
    }

    #[test]
    fn nice_numbers() {
        assert_eq!(nice_above(0.7), 1.0);
        assert_eq!(nice_above(1.3), 2.0);
        assert_eq!(nice_above(2.2), 2.5);
        assert_eq!(nice_above(37.0), 50.0);
        assert_eq!(nice_above(80.0), 100.0);
    }
}
