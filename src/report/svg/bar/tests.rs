//! What a [`BarChart`] draws, read back from its markup: whiskers, per-bar references, value
//! labels, group labels, titles and `data-*` attributes.

use super::{Bar, BarChart};
use crate::report::svg::{text_width, Axis, PALETTE};

/// The opening tags (up to the next `<`) of the elements of this class.
fn elements<'a>(svg: &'a str, class: &str) -> Vec<&'a str> {
    let needle = format!(r#"class="{class}""#);
    svg.split('<').filter(|e| e.contains(&needle)).collect()
}

fn attr<'a>(el: &'a str, name: &str) -> &'a str {
    let key = format!(r#" {name}=""#);
    let i = el.find(&key).unwrap_or_else(|| panic!("no {name} in {el}")) + key.len();
    el[i..].split('"').next().unwrap()
}

fn num(el: &str, name: &str) -> f64 {
    attr(el, name).parse().unwrap()
}

/// The plot box: (left, top, right, bottom).
fn plot(svg: &str) -> (f64, f64, f64, f64) {
    let p = elements(svg, "fg-plot")[0];
    let (x, y) = (num(p, "x"), num(p, "y"));
    (x, y, x + num(p, "width"), y + num(p, "height"))
}

/// A whisker's (top, bottom) pixels, from its path "M x y H x M cx y_hi V y_lo M x y H x".
fn whisker(el: &str) -> (f64, f64) {
    let n: Vec<f64> = attr(el, "d")
        .split(|c: char| c.is_ascii_alphabetic() || c == ' ')
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().unwrap())
        .collect();
    (n[1], n[5])
}

#[test]
fn whiskers_span_the_spread_inside_the_plot() {
    let svg = BarChart::new("t", vec!["a".into(), "b".into(), "c".into()])
        .bars(
            "s",
            PALETTE[0],
            vec![
                Bar::new(10.0).spread(12.0, 8.0),
                Bar::new(5.0).spread(4.0, 20.0),
                Bar::new(7.0),
            ],
        )
        .to_svg();
    let (_, top, _, bottom) = plot(&svg);
    let bars = elements(&svg, "fg-bar");
    let whiskers = elements(&svg, "fg-whisker");
    assert_eq!(whiskers.len(), 2, "no whisker without a spread");
    for (w, b) in whiskers.iter().zip(&bars) {
        let (hi, lo) = whisker(w);
        let bar_top = num(b, "y");
        assert!(top <= hi && lo <= bottom, "{w} outside {top}..{bottom}");
        // The spread straddles the value: its top above the bar's, its bottom inside the bar.
        assert!(
            hi < bar_top && bar_top < lo,
            "{w} against the bar at {bar_top}"
        );
    }
    // The taller spread (4..20) reaches higher than the shorter (8..12).
    assert!(whisker(whiskers[1]).0 < whisker(whiskers[0]).0);

    // An axis range that cuts the spread: the whisker stops at the plot's top edge.
    let cut = BarChart::new("t", vec!["a".into()])
        .y_axis(Axis::number("").range(0.0, 10.0))
        .bars("s", PALETTE[0], vec![Bar::new(5.0).spread(3.0, 30.0)])
        .to_svg();
    let (_, top, _, bottom) = plot(&cut);
    let (hi, lo) = whisker(elements(&cut, "fg-whisker")[0]);
    assert_eq!(hi, top);
    assert!(lo > top && lo < bottom);

    // On a log axis a spread reaching 0 cannot be drawn.
    let log = BarChart::new("t", vec!["a".into()])
        .y_axis(Axis::number("").log())
        .bars("s", PALETTE[0], vec![Bar::new(5.0).spread(0.0, 30.0)])
        .to_svg();
    assert_eq!(elements(&log, "fg-bar").len(), 1);
    assert!(elements(&log, "fg-whisker").is_empty());
}

#[test]
fn each_series_bar_has_its_own_reference() {
    let svg = BarChart::new("t", vec!["a".into(), "b".into()])
        .bar_reference("naive", "#c0392b")
        .bars(
            "gpu1",
            PALETTE[0],
            vec![
                Bar::new(10.0).reference("naive", 2.0),
                Bar::new(12.0).reference("naive", 3.0).reference("cpu", 1.0),
            ],
        )
        .bars(
            "gpu2",
            PALETTE[1],
            vec![
                Bar::new(8.0).titled_reference("naive", 6.0, "6x on gpu2"),
                Bar::missing(),
            ],
        )
        .to_svg();
    let bars = elements(&svg, "fg-bar");
    let refs = elements(&svg, "fg-ref");
    assert_eq!((bars.len(), refs.len()), (3, 4));
    for r in &refs {
        let (x1, x2) = (num(r, "x1"), num(r, "x2"));
        let over: Vec<_> = bars
            .iter()
            .filter(|b| x1 <= num(b, "x") && num(b, "x") + num(b, "width") <= x2)
            .collect();
        assert_eq!(over.len(), 1, "{r} crosses one bar");
    }
    // Group a: gpu1's reference at 2 lies below gpu2's at 6; each names its own series.
    let (y2, y6) = (num(refs[0], "y1"), num(refs[1], "y1"));
    assert!(y2 > y6, "{y2} {y6}");
    assert!(svg.contains("<title>naive, gpu1, a: 2</title>"));
    assert!(svg.contains("<title>6x on gpu2</title>"));
    // The declared style first (solid, its colour), the undeclared one after it (dashed, grey);
    // one legend entry each, however many bars carry them.
    assert!(refs[0].contains(r##"stroke="#c0392b""##) && !refs[0].contains("dasharray"));
    assert!(refs[3].contains(r##"stroke="#222""##) && refs[3].contains(r#"dasharray="6 3""#));
    assert_eq!(svg.matches(">naive</text>").count(), 1);
    assert_eq!(svg.matches(">cpu</text>").count(), 1);
}

#[test]
fn group_labels_break_or_rotate() {
    let short = BarChart::new("t", vec!["256\nf32".into(), "512\nf16".into()])
        .series("s", PALETTE[0], vec![Some(1.0), Some(2.0)])
        .to_svg();
    assert!(elements(&short, "fg-group")
        .iter()
        .all(|g| !g.contains("rotate(")));
    assert_eq!(elements(&short, "fg-group").len(), 2);
    assert!(short.contains(">256<tspan") && short.contains(">f16</tspan>"));
    assert_eq!(attr(&short, "height"), "340");

    let label = "attention fwd+bwd causal 4x4x256x64\nf32";
    let long = BarChart::new("t", vec![label.to_string(); 8])
        .series("s", PALETTE[0], vec![Some(1.0); 8])
        .to_svg();
    let groups = elements(&long, "fg-group");
    assert_eq!(groups.len(), 8);
    let first = groups[0];
    assert!(first.contains("rotate(-35 "), "{first}");
    assert!(first.ends_with(">attention fwd+bwd causal 4x4x256x64 f32"));
    // The chart grows to hold the labels, and the first one does not run off its left edge.
    assert!(num(&long, "height") > 340.0);
    let reach = text_width(&label.replace('\n', " "), 11.0) * 35f64.to_radians().cos();
    assert!(num(first, "x") - reach >= 0.0, "{first}");
    let (left, ..) = plot(&long);
    assert!(left > 74.0);
}

#[test]
fn titles_and_data_attributes_are_escaped() {
    let svg = BarChart::new("t", vec!["a".into(), "b".into()])
        .bars(
            "s",
            PALETTE[0],
            vec![
                Bar::new(1.0)
                    .title("a <b> & c")
                    .data("Adapter Name", r#"gpu "0" <vk> & 'x'"#),
                Bar::missing()
                    .title("failed: <oom>")
                    .data("adapter", "gpu&1"),
            ],
        )
        .to_svg();
    let bar = elements(&svg, "fg-bar")[0];
    assert_eq!(
        attr(bar, "data-adapter-name"),
        "gpu &quot;0&quot; &lt;vk&gt; &amp; &#39;x&#39;"
    );
    assert!(svg.contains("<title>a &lt;b&gt; &amp; c</title>"));
    let missing = elements(&svg, "fg-missing");
    assert_eq!(missing.len(), 1);
    assert_eq!(attr(missing[0], "data-adapter"), "gpu&amp;1");
    assert!(svg.contains("<title>failed: &lt;oom&gt;</title>n/a</text>"));
}

#[test]
fn values_are_written_over_wide_bars_only() {
    let chart = |series: usize, labels: bool| {
        let mut c = BarChart::new("t", vec!["a".into()]).y_axis(Axis::number("").range(0.0, 20.0));
        for _ in 0..series {
            c = c.bars("s", PALETTE[0], vec![Bar::new(12.5).spread(10.0, 14.0)]);
        }
        if labels {
            c = c.value_labels();
        }
        c.to_svg()
    };
    let wide = chart(2, true);
    let values = elements(&wide, "fg-value");
    assert_eq!(values.len(), 2);
    assert!(wide.contains(r#"class="fg-value">12.5</text>"#));
    // Above the whisker's top, which it would otherwise cross.
    let (whisker_top, _) = whisker(elements(&wide, "fg-whisker")[0]);
    assert!(num(values[0], "y") < whisker_top);
    assert!(elements(&chart(2, false), "fg-value").is_empty());
    // Forty bars in one group are narrower than their labels.
    assert!(elements(&chart(40, true), "fg-value").is_empty());
}
