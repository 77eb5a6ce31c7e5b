//! The benchmark report as one self-contained HTML page: the context, the adapters, and per
//! operation a bar chart (one bar per adapter per shape, whiskers from the fastest to the
//! slowest run, the references as lines across each bar) and a table (rows: shapes; columns:
//! adapters) holding every figure of report.json. No script, no network.

use crate::bench_report::{
    cpu_text, memory_text, num, reference_text, subgroup_text, timing_text, yes_no, Figure, Report,
};
use crate::svg::{color, esc, Scale, Svg};
use std::fmt::Write;

/// Dash patterns of the reference lines, in order of first appearance.
const REF_DASH: &[&str] = &["", "6 3", "2 2", "8 3 2 3"];
const REF_COLOR: &[&str] = &["#222", "#c0392b", "#6c3483", "#117a65"];

/// One operation's figures: rows are (shape, dtype) in first-seen order.
struct Section<'a> {
    op: &'a str,
    unit: &'a str,
    rows: Vec<(&'a str, &'a str)>,
    figures: Vec<&'a Figure>,
    /// Reference names in first-seen order (their line styles).
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

    fn ref_style(&self, name: &str) -> (&'static str, &'static str) {
        let i = self.refs.iter().position(|r| *r == name).unwrap_or(0);
        (REF_COLOR[i % REF_COLOR.len()], REF_DASH[i % REF_DASH.len()])
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
          a ratio is the figure's rate over the reference's. Below each chart, every figure: \
          rate, time, repetitions, kernel chosen and references.</p>\n";
    let secs = sections(r);
    h += "<nav><b>Operations:</b> ";
    for (i, s) in secs.iter().enumerate() {
        let _ = write!(h, "<a href=\"#op{i}\">{}</a> ", esc(s.op));
    }
    h += "</nav>\n";
    for (i, s) in secs.iter().enumerate() {
        let _ = writeln!(
            h,
            "<section id=\"op{i}\"><h2>{} <small>({})</small></h2>",
            esc(s.op),
            esc(s.unit)
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
width:10px;height:10px;margin-right:4px}svg.chart{max-width:100%;height:auto;display:block}\
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
        let _ = write!(h, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(&v));
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
                esc(e)
            ),
            None => format!("{} in {} s", esc(&a.status), num(a.seconds)),
        };
        let _ = write!(
            h,
            "<tr><td><span class=\"swatch\" style=\"background:{}\"></span>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}<div class=\"sub\">{}</div></td><td>{}</td>\
             <td>{}</td><td>{}</td><td class=\"sub\">{}</td><td>{}</td><td>{}</td></tr>",
            color(i),
            esc(&a.id),
            esc(&a.vendor),
            esc(&a.backend),
            esc(&a.device_type),
            esc(&a.driver),
            esc(&a.driver_info),
            esc(&memory_text(a.memory_bytes)),
            f16,
            esc(&subgroup_text(a.device.as_ref())),
            esc(&limits),
            a.host_cpu
                .as_ref()
                .map_or("—".into(), |c| esc(&cpu_text(c))),
            status
        );
    }
    h + "</table>\n"
}

/// Chart geometry, pixels.
const W: f64 = 960.0;
const PLOT_H: f64 = 240.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 16.0;

/// One section's bar chart.
fn chart(r: &Report, s: &Section) -> String {
    let plot_w = W - LEFT - RIGHT;
    let n_groups = s.rows.len().max(1);
    let n_ad = r.adapters.len().max(1);
    let group_w = plot_w / n_groups as f64;
    let bar_w = (group_w * 0.8 / n_ad as f64).min(48.0);
    // Legend rows: adapters, then references, laid out left to right by estimated width.
    let mut legend: Vec<(String, LegendMark)> = r
        .adapters
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let failed = if a.error.is_some() { " (failed)" } else { "" };
            (format!("{}{failed}", a.id), LegendMark::Box(color(i)))
        })
        .collect();
    for name in &s.refs {
        let (c, d) = s.ref_style(name);
        legend.push((format!("reference: {name}"), LegendMark::Line(c, d)));
    }
    let mut lx = LEFT;
    let mut ly = 16.0;
    let mut placed = Vec::new();
    for (text, mark) in legend {
        let w = 22.0 + 6.4 * text.chars().count() as f64 + 16.0;
        if lx + w > W - RIGHT && lx > LEFT {
            lx = LEFT;
            ly += 18.0;
        }
        placed.push((lx, ly, text, mark));
        lx += w;
    }
    let top = ly + 18.0;
    // Group labels: shape over dtype, rotated when they do not fit their group.
    let longest = s
        .rows
        .iter()
        .map(|r| r.0.chars().count())
        .max()
        .unwrap_or(0) as f64;
    let rotate = longest * 6.2 > group_w * 0.95;
    let bottom = if rotate { 30.0 + longest * 5.0 } else { 44.0 };
    let height = top + PLOT_H + bottom;
    let base = top + PLOT_H;

    let mut values = Vec::new();
    for f in &s.figures {
        values.extend([f.rate, f.rate_at_min_ms, f.rate_at_max_ms]);
        values.extend(f.references.iter().map(|x| x.rate));
    }
    let log = Scale::wants_log(&values, 30.0);
    let scale = Scale::covering(&values, log, (base, top));
    let mut g = Svg::new(W, height, "chart", &format!("{} in {}", s.op, s.unit));

    for (x, y, text, mark) in &placed {
        match mark {
            LegendMark::Box(c) => g.rect(*x, y - 10.0, 12.0, 12.0, c, "", ""),
            LegendMark::Line(c, d) => g.line((*x, y - 4.0), (x + 18.0, y - 4.0), c, 2.0, d, "", ""),
        }
        g.text(x + 22.0, *y, text, 12.0, "start", 0.0);
    }
    // Grid and y axis.
    for t in scale.ticks() {
        let y = scale.y(t);
        g.line((LEFT, y), (W - RIGHT, y), "#e4e4e4", 1.0, "", "", "");
        g.text(LEFT - 6.0, y + 4.0, &tick_label(t), 11.0, "end", 0.0);
    }
    g.line((LEFT, top), (LEFT, base), "#555", 1.0, "", "", "");
    g.line((LEFT, base), (W - RIGHT, base), "#555", 1.0, "", "", "");
    let axis = if scale.is_log() {
        format!("{} (log scale)", s.unit)
    } else {
        s.unit.to_string()
    };
    g.text(16.0, top + PLOT_H / 2.0, &axis, 12.0, "middle", -90.0);

    for (gi, row) in s.rows.iter().enumerate() {
        let gx = LEFT + gi as f64 * group_w;
        let x0 = gx + (group_w - bar_w * n_ad as f64) / 2.0;
        for (ai, a) in r.adapters.iter().enumerate() {
            let Some(f) = s.get(*row, &a.id) else {
                continue;
            };
            let x = x0 + ai as f64 * bar_w;
            let y = scale.y(f.rate);
            let tip = format!(
                "{}: {} {} {}: {} {}, {}",
                a.id,
                row.0,
                row.1,
                s.op,
                num(f.rate),
                s.unit,
                timing_text(&f.time)
            );
            let attrs = format!(
                r#"class="bar" data-adapter="{}" data-shape="{}""#,
                esc(&a.id),
                esc(row.0)
            );
            // At least one pixel, so a tiny rate still shows as a bar.
            let hgt = (base - y).max(1.0);
            g.rect(
                x + 1.0,
                base - hgt,
                bar_w - 2.0,
                hgt,
                color(ai),
                &attrs,
                &tip,
            );
            if f.time.reps > 1 {
                let (cx, lo, hi) = (
                    x + bar_w / 2.0,
                    scale.y(f.rate_at_max_ms),
                    scale.y(f.rate_at_min_ms),
                );
                g.line((cx, lo), (cx, hi), "#333", 1.0, "", "", "");
                g.line((cx - 3.0, hi), (cx + 3.0, hi), "#333", 1.0, "", "", "");
                g.line((cx - 3.0, lo), (cx + 3.0, lo), "#333", 1.0, "", "", "");
            }
            for rf in &f.references {
                let (c, d) = s.ref_style(&rf.name);
                let ry = scale.y(rf.rate);
                let tip = format!("{} on {}", reference_text(rf, s.unit), a.id);
                g.line(
                    (x - 2.0, ry),
                    (x + bar_w + 2.0, ry),
                    c,
                    2.0,
                    d,
                    r#"class="ref""#,
                    &tip,
                );
            }
            if bar_w >= 30.0 {
                // Above the whisker's top, which the label would otherwise cross.
                let top = y.min(scale.y(f.rate_at_min_ms));
                g.text(
                    x + bar_w / 2.0,
                    top - 4.0,
                    &num(f.rate),
                    10.0,
                    "middle",
                    0.0,
                );
            }
        }
        let cx = gx + group_w / 2.0;
        if rotate {
            g.text(
                cx,
                base + 14.0,
                &format!("{} {}", row.0, row.1),
                11.0,
                "end",
                -35.0,
            );
        } else {
            g.text(cx, base + 16.0, row.0, 11.0, "middle", 0.0);
            g.text(cx, base + 30.0, row.1, 11.0, "middle", 0.0);
        }
    }
    g.finish() + "\n"
}

/// A tick's value without trailing zeros ("0.1", "2.5", "100").
fn tick_label(v: f64) -> String {
    let s = num(v);
    if s.contains('.') && !s.contains('e') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

enum LegendMark {
    Box(&'static str),
    Line(&'static str, &'static str),
}

/// One section's table: a row per (shape, dtype), a column per adapter.
fn table(r: &Report, s: &Section) -> String {
    let mut h = String::from("<table class=\"figures\"><tr><th>shape</th><th>dtype</th>");
    for (i, a) in r.adapters.iter().enumerate() {
        let _ = write!(
            h,
            "<th><span class=\"swatch\" style=\"background:{}\"></span>{}{}</th>",
            color(i),
            esc(&a.id),
            if a.error.is_some() {
                " <span class=\"failed\">(failed)</span>"
            } else {
                ""
            }
        );
    }
    h += "</tr>";
    for row in &s.rows {
        let _ = write!(h, "<tr><td>{}</td><td>{}</td>", esc(row.0), esc(row.1));
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
                esc(&f.unit),
                num(f.rate_at_max_ms),
                num(f.rate_at_min_ms),
                esc(&timing_text(&f.time))
            );
            if !f.kernel.is_empty() {
                let _ = write!(h, "<div class=\"sub\">kernel {}</div>", esc(&f.kernel));
            }
            if !f.note.is_empty() {
                let _ = write!(h, "<div class=\"sub\">{}</div>", esc(&f.note));
            }
            for rf in &f.references {
                let _ = write!(
                    h,
                    "<div class=\"sub\">{}</div>",
                    esc(&reference_text(rf, &f.unit))
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
                Value::String(s) => s.is_empty() || html.contains(&esc(s)),
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

    /// One bar per figure, each adapter's bars in its colour; a failed adapter is named with
    /// its error, and its missing figures say why.
    #[test]
    fn tick_labels_drop_trailing_zeros() {
        let t: Vec<String> = [0.01, 0.1, 1.0, 2.5, 10.0, 100.0, 1000.0]
            .map(tick_label)
            .into();
        assert_eq!(t, ["0.01", "0.1", "1", "2.5", "10", "100", "1000"]);
    }

    #[test]
    fn one_bar_per_adapter_per_shape() {
        let report = fixture();
        let html = page(&report);
        assert_eq!(html.matches("class=\"bar\"").count(), report.results.len());
        for (i, a) in report.adapters.iter().enumerate() {
            let n = report.results.iter().filter(|f| f.adapter == a.id).count();
            let bars = html
                .matches(&format!(
                    "fill=\"{}\" class=\"bar\" data-adapter=\"{}\"",
                    color(i),
                    esc(&a.id)
                ))
                .count();
            assert_eq!(bars, n, "{}", a.id);
        }
        let failed: Vec<_> = report.failed().collect();
        assert!(!failed.is_empty(), "the fixture has a failed adapter");
        for a in failed {
            assert!(html.contains(&esc(a.error.as_deref().unwrap())));
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
