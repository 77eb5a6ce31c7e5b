//! [`BarChart`]: groups along x, one bar per series in each. A [`Bar`] can carry a spread
//! whisker, references measured beside it alone, a hover title and `data-*` attributes;
//! references per group and lines across the chart go beside them. The drawing is in
//! `bar/draw.rs`.

mod draw;

use super::Axis;

/// One bar of a [`BarChart`] series: its value, or none ("n/a" is written in its place), and
/// what is drawn with it.
///
/// ```
/// use fitgrad::report::svg::{Bar, BarChart, PALETTE};
/// let svg = BarChart::new("GFLOP/s", vec!["256".into(), "512".into()])
///     .bar_reference("naive kernel", "#222")
///     .bars(
///         "gpu",
///         PALETTE[0],
///         vec![
///             Bar::new(40.0).spread(36.0, 42.0).reference("naive kernel", 8.0),
///             Bar::missing().title("gpu failed before 512").data("adapter", "gpu"),
///         ],
///     )
///     .to_svg();
/// assert!(svg.contains("fg-whisker") && svg.contains(r#"data-adapter="gpu""#));
/// ```
#[derive(Clone, Debug, Default)]
pub struct Bar {
    value: Option<f64>,
    spread: Option<(f64, f64)>,
    references: Vec<OwnReference>,
    title: Option<String>,
    data: Vec<(String, String)>,
}

/// A reference of one bar: its style's name, value and hover title.
#[derive(Clone, Debug)]
struct OwnReference {
    name: String,
    value: f64,
    title: Option<String>,
}

impl Bar {
    /// A bar of height `value`.
    pub fn new(value: f64) -> Bar {
        Bar {
            value: Some(value),
            ..Bar::default()
        }
    }

    /// No value here (a figure that was not measured): "n/a" stands in the bar's place, with
    /// the bar's title and `data-*` attributes.
    pub fn missing() -> Bar {
        Bar::default()
    }

    /// A whisker from `lo` to `hi` over the bar: the spread of what the value summarises (the
    /// rates of the slowest and fastest of repeated runs about their median). Kept inside the
    /// plot where the axis range cuts it.
    pub fn spread(mut self, lo: f64, hi: f64) -> Bar {
        self.spread = Some((lo.min(hi), lo.max(hi)));
        self
    }

    /// A reference measured beside this bar alone (a naive kernel run on the same adapter),
    /// drawn as a tick across this bar only; bars of other series have their own. `name` is
    /// its legend entry and style (see [`BarChart::bar_reference`]).
    pub fn reference(self, name: impl Into<String>, value: f64) -> Bar {
        self.push_reference(name.into(), value, None)
    }

    /// [`Bar::reference`] with its own hover title instead of "name, series, group: value".
    pub fn titled_reference(
        self,
        name: impl Into<String>,
        value: f64,
        title: impl Into<String>,
    ) -> Bar {
        self.push_reference(name.into(), value, Some(title.into()))
    }

    fn push_reference(mut self, name: String, value: f64, title: Option<String>) -> Bar {
        self.references.push(OwnReference { name, value, title });
        self
    }

    /// The hover title, instead of "series, group: value".
    pub fn title(mut self, title: impl Into<String>) -> Bar {
        self.title = Some(title.into());
        self
    }

    /// A `data-KEY="value"` attribute on the bar's element (and on the "n/a" of a missing
    /// one), for a page's tests or stylesheet to find bars by what they stand for. The value
    /// is escaped; `key` is lowercased, and anything but ASCII letters, digits and '-' in it
    /// becomes '-'.
    pub fn data(mut self, key: &str, value: impl Into<String>) -> Bar {
        let key = key
            .chars()
            .map(|c| match c.to_ascii_lowercase() {
                c @ ('a'..='z' | '0'..='9' | '-') => c,
                _ => '-',
            })
            .collect();
        self.data.push((key, value.into()));
        self
    }
}

impl From<Option<f64>> for Bar {
    fn from(v: Option<f64>) -> Bar {
        v.map_or_else(Bar::missing, Bar::new)
    }
}

/// One series of a [`BarChart`]: a bar in each group.
struct BarSeries {
    name: String,
    color: String,
    bars: Vec<Bar>,
}

/// A reference per group: one value for a whole group, ticked across all its bars.
struct GroupReference {
    name: String,
    color: String,
    values: Vec<Option<f64>>,
}

/// Bars in groups: each group (a shape) holds one bar per series (an adapter). Bars may carry
/// spread whiskers and references of their own ([`Bar`]); a reference per group (a CPU
/// baseline shared by every adapter) ticks across a whole group; horizontal lines cross the
/// chart.
///
/// Group labels break into lines at `'\n'` ("shape\ndtype"); when a line is wider than its
/// group, each label is written on one line, rotated, and the chart grows taller (and its left
/// margin wider) by the room they take. Bars are at most 56 pixels wide, centred in their
/// group.
pub struct BarChart {
    title: String,
    id: Option<String>,
    width: f64,
    height: f64,
    y: Axis,
    groups: Vec<String>,
    series: Vec<BarSeries>,
    references: Vec<GroupReference>,
    /// Styles of per-bar references, by name: (name, colour), in declaration order.
    bar_references: Vec<(String, String)>,
    hlines: Vec<(String, String, f64)>,
    value_labels: bool,
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
            bar_references: Vec::new(),
            hlines: Vec::new(),
            value_labels: false,
        }
    }

    /// Sets the `id` attribute of the `<svg>` element.
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Sets the size in pixels (the height before rotated group labels add theirs).
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

    /// A series of plain bars: one value per group, in group order (`None`: "n/a").
    pub fn series(self, name: impl Into<String>, color: &str, values: Vec<Option<f64>>) -> Self {
        let bars = values.into_iter().map(Bar::from).collect();
        self.bars(name, color, bars)
    }

    /// A series of [`Bar`]s: one per group, in group order.
    pub fn bars(mut self, name: impl Into<String>, color: &str, bars: Vec<Bar>) -> Self {
        self.series.push(BarSeries {
            name: name.into(),
            color: color.into(),
            bars,
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
        self.references.push(GroupReference {
            name: name.into(),
            color: color.into(),
            values,
        });
        self
    }

    /// Declares the style of the per-bar references named `name` ([`Bar::reference`]): their
    /// colour, with a dash pattern of their own by declaration order (solid, dashed, dotted,
    /// dash-dot), and one legend entry. Names bars use without a declaration are styled in
    /// dark grey, after the declared ones, in the order bars name them.
    pub fn bar_reference(mut self, name: impl Into<String>, color: &str) -> Self {
        let name = name.into();
        if !self.bar_references.iter().any(|(n, _)| *n == name) {
            self.bar_references.push((name, color.into()));
        }
        self
    }

    /// A horizontal reference line across the whole chart.
    pub fn hline(mut self, label: impl Into<String>, color: &str, y: f64) -> Self {
        self.hlines.push((label.into(), color.into(), y));
        self
    }

    /// Writes each bar's value above it (above its whisker), where the bar is at least 30
    /// pixels wide; narrower bars keep it in their hover title.
    pub fn value_labels(mut self) -> Self {
        self.value_labels = true;
        self
    }
}

#[cfg(test)]
mod tests;
