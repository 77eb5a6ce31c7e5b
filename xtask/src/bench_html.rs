//! The benchmark report as one self-contained HTML page: the context, the adapters, and per
//! operation a bar chart (one bar per adapter per shape, whiskers from the fastest to the
//! slowest run, the references as lines across each bar) and a table (rows: shapes; columns:
//! adapters) holding every figure of report.json. No script, no network.

use crate::bench_report::{
    cpu_text, memory_text, num, reference_text, subgroup_text, timing_text, yes_no, Figure, Report,
};
use fitgrad::report::svg::{escape, Axis, Bar, BarChart, PALETTE};
use std::fmt::Write;

/// Colours of the reference ticks, in order of first appearance (the chart gives each a dash
/// pattern too).
const REF_COLOR: &[&str] = &["#222", "#c0392b", "#6c3483", "#117a65"];

/// One operation's figures: rows are (shape, dtype) in first-seen order.
struct Section<'a> {
    op: &'a str,
    unit: &'a str,
    rows: Vec<(&'a str, &'a str)>,
    figures: Vec<&'a Figure>,
    /// Reference names in first-seen order (their colours).
    refs: Vec<&'a str>,
}

fn sections(r: &Report) -> Vec<Section<'_>> {
    let mut out: Vec<Section> = Vec::new();
    for f in &r.results {
        let i = match out.iter().position(|s| s.op == f.op && s.unit == f.unit) {
            Some(i) => i,
            None => {
                out.push(Section {
                    op: &f.op,
                    unit: &f.unit,
                    rows: Vec::new(),
                    figures: Vec::new(),
                    refs: Vec::new(),
                });
                out.len() - 1
            }
        };
        let s = &mut out[i];
        let row = (f.shape.as_str(), f.dtype.as_str());
        if !s.rows.contains(&row) {
            s.rows.push(row);
        }
        for rf in &f.references {
            if !s.refs.contains(&rf.name.as_str()) {
                s.refs.push(&rf.name);
            }
        }
        s.figures.push(f);
    }
    out
}

impl Section<'_> {
    fn get(&self, row: (&str, &str), adapter: &str) -> Option<&Figure> {
        self.figures
            .iter()
            .copied()
            .find(|f| f.adapter == adapter && (f.shape.as_str(), f.dtype.as_str()) == row)
    }

    /// A reference's colour, by its first appearance in the section.
    fn ref_color(&self, name: &str) -> &'static str {
        let i = self.refs.iter().position(|r| *r == name).unwrap_or(0);
        REF_COLOR[i % REF_COLOR.len()]
    }
}

/// The whole page.
pub fn page(r: &Report) -> String {
    let mut h = String::new();
    h += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">";
    h += "<title>fitgrad benchmark report</title><style>";
    h += CSS;
    h += "</style></head><body>\n<h1>fitgrad benchmark report</h1>\n";
    h += &context_html(r);
    h += &adapters_html(r);
    h += "<p class=\"how\">Each bar is an adapter's rate at its median time (higher is \
          better); the whisker spans the rates of its slowest and fastest runs. Lines across a \
          bar are references measured in the same run on that adapter (or on the host CPU); \
          a ratio is the figure's rate over the reference's; n/a marks a figure the adapter did \
          not measure. Below each chart, every figure: rate, time, repetitions, kernel chosen \
          and references.</p>\n";
    let secs = sections(r);
    h += "<nav><b>Operations:</b> ";
    for (i, s) in secs.iter().enumerate() {
        let _ = write!(h, "<a href=\"#op{i}\">{}</a> ", escape(s.op));
    }
    h += "</nav>\n";
    for (i, s) in secs.iter().enumerate() {
        let _ = writeln!(
            h,
            "<section id=\"op{i}\"><h2>{} <small>({})</small></h2>",
            escape(s.op),
            escape(s.unit)
        );
        h += &chart(r, s);
        h += &table(r, s);
        h += "</section>\n";
    }
    if secs.is_empty() {
        h += "<p class=\"failed\">No figures: every adapter failed.</p>\n";
    }
    let _ = write!(
        h,
        "<footer>report schema {}; written by <code>cargo xtask bench</code></footer>\n</body></html>\n",
        r.schema
    );
    h
}

const CSS: &str = "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}\
table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 6px;\
vertical-align:top;text-align:left;font-size:13px}th{background:#f3f3f3}.num{font-weight:600}\
.sub{color:#555;font-size:11px}.failed{color:#b00020;font-weight:600}.swatch{display:inline-block;\
width:10px;height:10px;margin-right:4px}svg.fg-chart{max-width:100%;height:auto;display:block}\
.how{max-width:60em;color:#444}nav a{margin-right:0.6em}footer{color:#777;margin-top:2em}";

fn context_html(r: &Report) -> String {
    let c = &r.context;
    let rows = [
        ("fitgrad", c.fitgrad_version.clone()),
        (
            "commit",
            format!(
                "{}{}",
                c.git_commit,
                match c.git_dirty {
                    Some(true) => " (tracked files changed since the commit)",
                    Some(false) => " (clean)",
                    None => " (no git)",
                }
            ),
        ),
        ("wgpu", c.wgpu_version.clone()),
        ("OS", c.os.clone()),
        ("host CPU", cpu_text(&c.host_cpu)),
        ("profile", c.profile.clone()),
        ("--quick", yes_no(Some(c.quick)).into()),
        ("--train-only", yes_no(Some(c.train_only)).into()),
        (
            "FITGRAD_AUTOTUNE_BUDGET",
            format!("{} s", c.autotune_budget_s),
        ),
        ("started", format!("{} UTC", c.started_utc)),
        ("run time", format!("{} s", num(c.seconds))),
    ];
    let mut h = String::from("<h2>Context</h2><table class=\"context\">");
    for (k, v) in rows {
        let _ = write!(h, "<tr><th>{}</th><td>{}</td></tr>", escape(k), escape(&v));
    }
    h + "</table>\n"
}

fn adapters_html(r: &Report) -> String {
    let mut h = String::from(
        "<h2>Adapters</h2><table class=\"adapters\"><tr><th>adapter</th><th>vendor</th>\
         <th>backend</th><th>type</th><th>driver</th><th>memory</th><th>f16</th>\
         <th>subgroups</th><th>limits</th><th>host CPU</th><th>status</th></tr>",
    );
    for (i, a) in r.adapters.iter().enumerate() {
        let f16 = match &a.device {
            None => "unknown (not opened)",
            Some(d) if d.f16_native => "native (SHADER_F16)",
            Some(_) => "packed in u32, computed in f32",
        };
        let limits = a.device.as_ref().map_or("unknown".to_string(), |d| {
            format!(
                "workgroup memory {} bytes, {} invocations per workgroup, storage binding {} bytes",
                d.max_workgroup_storage_bytes,
                d.max_invocations_per_workgroup,
                d.max_storage_binding_bytes
            )
        });
        let status = match &a.error {
            Some(e) => format!(
                "<span class=\"failed\">failed</span> after {} s: {}",
                num(a.seconds),
                escape(e)
            ),
            None => format!("{} in {} s", escape(&a.status), num(a.seconds)),
        };
        let _ = write!(
            h,
            "<tr><td><span class=\"swatch\" style=\"background:{}\"></span>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}<div class=\"sub\">{}</div></td><td>{}</td>\
             <td>{}</td><td>{}</td><td class=\"sub\">{}</td><td>{}</td><td>{}</td></tr>",
            adapter_color(i),
            escape(&a.id),
            escape(&a.vendor),
            escape(&a.backend),
            escape(&a.device_type),
            escape(&a.driver),
            escape(&a.driver_info),
            escape(&memory_text(a.memory_bytes)),
            f16,
            escape(&subgroup_text(a.device.as_ref())),
            escape(&limits),
            a.host_cpu
                .as_ref()
                .map_or("—".into(), |c| escape(&cpu_text(c))),
            status
        );
    }
    h + "</table>\n"
}

/// The chart's size before rotated shape labels add their room, pixels.
const CHART_W: f64 = 960.0;
const CHART_H: f64 = 340.0;

/// Rates spanning more than this ratio are drawn on a log axis, where the small ones (a CPU
/// adapter beside a discrete GPU) still show as bars.
const LOG_ABOVE_RATIO: f64 = 30.0;

/// Adapter `i`'s colour, in charts, legends and tables alike.
fn adapter_color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// Whether the positive values among `values` span more than `ratio` (then a log axis keeps
/// the small ones visible).
fn wants_log(values: &[f64], ratio: f64) -> bool {
    let pos = values.iter().copied().filter(|v| v.is_finite() && *v > 0.0);
    let (lo, hi) = pos.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    hi > 0.0 && hi / lo > ratio
}

/// One section's bar chart: a group per (shape, dtype), a bar per adapter in each (a failed
/// adapter's missing figures are "n/a"), the spread of its runs as a whisker, and each
/// reference measured on that adapter as a tick across its own bar.
fn chart(r: &Report, s: &Section) -> String {
    let groups = s
        .rows
        .iter()
        .map(|(shape, dtype)| format!("{shape}\n{dtype}"));
    let mut values = Vec::new();
    for f in &s.figures {
        values.extend([f.rate, f.rate_at_min_ms, f.rate_at_max_ms]);
        values.extend(f.references.iter().map(|x| x.rate));
    }
    let axis = if wants_log(&values, LOG_ABOVE_RATIO) {
        Axis::number(format!("{} (log scale)", s.unit)).log()
    } else {
        Axis::number(s.unit)
    };
    let mut c = BarChart::new(
        format!("{}: {} per adapter and shape", s.op, s.unit),
        groups.collect(),
    )
    .size(CHART_W, CHART_H)
    .y_axis(axis)
    .value_labels();
    for name in &s.refs {
        c = c.bar_reference(ref_label(name), s.ref_color(name));
    }
    for (i, a) in r.adapters.iter().enumerate() {
        let bars =
            s.rows
                .iter()
                .map(|row| {
                    let bar = match s.get(*row, &a.id) {
                        Some(f) => figure_bar(s, &a.id, f),
                        None if a.error.is_some() => Bar::missing()
                            .title(format!("{}: not measured: the adapter failed", a.id)),
                        None => Bar::missing().title(format!("{}: not measured", a.id)),
                    };
                    bar.data("adapter", &a.id).data("shape", row.0)
                })
                .collect();
        let failed = if a.error.is_some() { " (failed)" } else { "" };
        c = c.bars(format!("{}{failed}", a.id), adapter_color(i), bars);
    }
    c.to_svg() + "\n"
}

/// A figure's bar: its rate at the median time, the rates of its slowest and fastest runs,
/// its references.
fn figure_bar(s: &Section, adapter: &str, f: &Figure) -> Bar {
    let tip = format!(
        "{adapter}: {} {} {}: {} {}, {}",
        f.shape,
        f.dtype,
        s.op,
        num(f.rate),
        s.unit,
        timing_text(&f.time)
    );
    let mut bar = Bar::new(f.rate).title(tip);
    if f.time.reps > 1 {
        bar = bar.spread(f.rate_at_max_ms, f.rate_at_min_ms);
    }
    for rf in &f.references {
        let tip = format!("{} on {adapter}", reference_text(rf, s.unit));
        bar = bar.titled_reference(ref_label(&rf.name), rf.rate, tip);
    }
    bar
}

/// A reference's legend entry.
fn ref_label(name: &str) -> String {
    format!("reference: {name}")
}

/// One section's table: a row per (shape, dtype), a column per adapter.
fn table(r: &Report, s: &Section) -> String {
    let mut h = String::from("<table class=\"figures\"><tr><th>shape</th><th>dtype</th>");
    for (i, a) in r.adapters.iter().enumerate() {
        let _ = write!(
            h,
            "<th><span class=\"swatch\" style=\"background:{}\"></span>{}{}</th>",
            adapter_color(i),
            escape(&a.id),
            if a.error.is_some() {
                " <span class=\"failed\">(failed)</span>"
            } else {
                ""
            }
        );
    }
    h += "</tr>";
    for row in &s.rows {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td>",
            escape(row.0),
            escape(row.1)
        );
        for a in &r.adapters {
            let Some(f) = s.get(*row, &a.id) else {
                h += if a.error.is_some() {
                    "<td class=\"failed\">not measured: the adapter failed</td>"
                } else {
                    "<td>—</td>"
                };
                continue;
            };
            let _ = write!(
                h,
                "<td><span class=\"num\">{} {}</span> <span class=\"sub\">({}–{})</span><br>{}",
                num(f.rate),
                escape(&f.unit),
                num(f.rate_at_max_ms),
                num(f.rate_at_min_ms),
                escape(&timing_text(&f.time))
            );
            if !f.kernel.is_empty() {
                let _ = write!(h, "<div class=\"sub\">kernel {}</div>", escape(&f.kernel));
            }
            if !f.note.is_empty() {
                let _ = write!(h, "<div class=\"sub\">{}</div>", escape(&f.note));
            }
            for rf in &f.references {
                let _ = write!(
                    h,
                    "<div class=\"sub\">{}</div>",
                    escape(&reference_text(rf, &f.unit))
                );
            }
            h += "</td>";
        }
        h += "</tr>";
    }
    h + "</table>\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const FIXTURE: &str = include_str!("../tests/fixtures/report.json");

    fn fixture() -> Report {
        serde_json::from_str(FIXTURE).expect("the fixture is a report")
    }

    /// Every string and number of report.json is on the page, as the page prints it (booleans
    /// print as yes / no, checked where they are used).
    #[test]
    fn page_shows_every_figure_of_the_json() {
        let report = fixture();
        let html = page(&report);
        let json: Value = serde_json::to_value(&report).unwrap();
        let mut missing = Vec::new();
        walk(&json, "", &mut |path, v| {
            let shown = match v {
                Value::String(s) => s.is_empty() || html.contains(&escape(s)),
                Value::Number(n) if n.is_u64() => html.contains(&n.to_string()),
                Value::Number(n) => html.contains(&num(n.as_f64().unwrap())),
                _ => true,
            };
            if !shown {
                missing.push(format!("{path} = {v}"));
            }
        });
        assert!(missing.is_empty(), "not on the page: {missing:#?}");
    }

    fn walk(v: &Value, path: &str, f: &mut impl FnMut(&str, &Value)) {
        match v {
            Value::Object(m) => m
                .iter()
                .for_each(|(k, x)| walk(x, &format!("{path}.{k}"), f)),
            Value::Array(a) => a
                .iter()
                .enumerate()
                .for_each(|(i, x)| walk(x, &format!("{path}[{i}]"), f)),
            _ => f(path, v),
        }
    }

    #[test]
    fn a_log_axis_when_rates_span_more_than_30x() {
        assert!(wants_log(&[0.3, 470.0], LOG_ABOVE_RATIO));
        assert!(!wants_log(&[3.0, 47.0], LOG_ABOVE_RATIO));
        // Zero and non-finite rates are not drawn on a log axis, so they do not count.
        assert!(!wants_log(&[0.0, 5.0, 100.0, f64::NAN], LOG_ABOVE_RATIO));
        assert!(!wants_log(&[], LOG_ABOVE_RATIO));
        // The same through the page: one shape measured on two adapters, 20x and 40x apart.
        let mut report = fixture();
        let mut one = report.results[0].clone();
        one.references.clear();
        let figure = |adapter: &str, rate: f64| Figure {
            adapter: adapter.into(),
            rate,
            rate_at_min_ms: rate,
            rate_at_max_ms: rate,
            ..one.clone()
        };
        let (a, b) = (report.adapters[0].id.clone(), report.adapters[1].id.clone());
        report.results = vec![figure(&a, 1.0), figure(&b, 20.0)];
        assert!(!page(&report).contains("(log scale)"));
        report.results = vec![figure(&a, 1.0), figure(&b, 40.0)];
        assert_eq!(page(&report).matches("(log scale)").count(), 1);
    }

    /// One bar per figure, each adapter's bars in its colour, found by the chart's `data-*`
    /// hook; a failed adapter is named with its error, and its missing figures say why.
    #[test]
    fn one_bar_per_adapter_per_shape() {
        let report = fixture();
        let html = page(&report);
        assert_eq!(
            html.matches("class=\"fg-bar\"").count(),
            report.results.len()
        );
        for (i, a) in report.adapters.iter().enumerate() {
            let n = report.results.iter().filter(|f| f.adapter == a.id).count();
            let bars = html
                .matches(&format!(
                    "fill=\"{}\" class=\"fg-bar\" data-adapter=\"{}\"",
                    adapter_color(i),
                    escape(&a.id)
                ))
                .count();
            assert_eq!(bars, n, "{}", a.id);
            // Every shape of every section has a bar or an "n/a" for each adapter.
            let missing = html
                .matches(&format!(
                    "class=\"fg-missing\" data-adapter=\"{}\"",
                    escape(&a.id)
                ))
                .count();
            let shapes: usize = sections(&report).iter().map(|s| s.rows.len()).sum();
            assert_eq!(bars + missing, shapes, "{}", a.id);
        }
        let failed: Vec<_> = report.failed().collect();
        assert!(!failed.is_empty(), "the fixture has a failed adapter");
        for a in failed {
            assert!(html.contains(&escape(a.error.as_deref().unwrap())));
        }
        assert!(html.contains("not measured: the adapter failed"));
        assert_eq!(html.matches("<svg").count(), sections(&report).len());
        assert!(!html.contains("<script"), "the page runs no script");
        assert!(
            !html.contains("http://")
                || html.matches("http://").count()
                    == html.matches("xmlns=\"http://www.w3.org/2000/svg\"").count()
        );
        assert!(!html.contains("https://"));
    }
}
