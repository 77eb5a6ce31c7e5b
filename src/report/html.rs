//! A self-contained HTML page: headings, paragraphs, tables and inline SVG, with its CSS in a
//! `<style>` element and no script, font or image from anywhere else, written atomically.
//!
//! ```
//! use fitgrad::report::html::Page;
//! let mut page = Page::new("bench");
//! page.heading(2, "matmul").table(&["shape", "GFLOP/s"], &[vec!["256".into(), "9.5".into()]]);
//! let html = page.finish();
//! assert!(html.starts_with("<!DOCTYPE html>") && !html.contains("<script"));
//! ```

use super::svg::escape;
use crate::Result;
use std::fmt::Write;
use std::path::Path;

/// The page's style: readable widths, tables with lines between rows, numbers right-aligned.
const CSS: &str = "body{font-family:system-ui,sans-serif;max-width:960px;margin:24px auto;\
padding:0 16px;color:#222;line-height:1.45}h1{font-size:1.6em;margin-bottom:4px}\
h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:4px}\
h3{font-size:1.05em;margin-top:1.4em}.sub{color:#666;margin-top:0}\
table{border-collapse:collapse;margin:8px 0 16px;font-size:.92em}\
th,td{border-bottom:1px solid #e3e3e3;padding:4px 12px 4px 0;text-align:left;vertical-align:top}\
th{font-weight:600;border-bottom:2px solid #ccc}td.num{text-align:right;font-variant-numeric:tabular-nums}\
code{background:#f3f3f3;padding:0 3px;border-radius:3px}.chart{margin:8px 0 20px;overflow-x:auto}\
.chart svg{max-width:100%;height:auto}.note{color:#555;font-size:.92em}";

/// An HTML page being built (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Page {
    title: String,
    body: String,
}

impl Page {
    /// An empty page with this `<title>` (and no heading: add one).
    pub fn new(title: impl Into<String>) -> Page {
        Page {
            title: title.into(),
            body: String::new(),
        }
    }

    /// A heading of `level` 1 to 6 (clamped).
    pub fn heading(&mut self, level: u8, text: &str) -> &mut Self {
        let l = level.clamp(1, 6);
        let _ = write!(self.body, "<h{l}>{}</h{l}>", escape(text));
        self
    }

    /// A paragraph of plain text (escaped).
    pub fn paragraph(&mut self, text: &str) -> &mut Self {
        let _ = write!(self.body, "<p>{}</p>", escape(text));
        self
    }

    /// A paragraph in a smaller, grey type (what a chart shows, how it was measured).
    pub fn note(&mut self, text: &str) -> &mut Self {
        let _ = write!(self.body, r#"<p class="note">{}</p>"#, escape(text));
        self
    }

    /// A grey line under the title.
    pub fn subtitle(&mut self, text: &str) -> &mut Self {
        let _ = write!(self.body, r#"<p class="sub">{}</p>"#, escape(text));
        self
    }

    /// Markup written as it is: the caller vouches for it (an SVG from `svg`, text already
    /// escaped).
    pub fn raw(&mut self, html: &str) -> &mut Self {
        self.body.push_str(html);
        self
    }

    /// An `<svg>` chart in a block of its own.
    pub fn chart(&mut self, svg: &str) -> &mut Self {
        let _ = write!(self.body, r#"<div class="chart">{svg}</div>"#);
        self
    }

    /// A table: `headers`, then one row per entry (cells escaped; cells that read as numbers
    /// or sizes are right-aligned).
    pub fn table(&mut self, headers: &[&str], rows: &[Vec<String>]) -> &mut Self {
        self.body.push_str("<table><thead><tr>");
        for h in headers {
            let _ = write!(self.body, "<th>{}</th>", escape(h));
        }
        self.body.push_str("</tr></thead><tbody>");
        for row in rows {
            self.body.push_str("<tr>");
            for cell in row {
                let class = if looks_numeric(cell) {
                    r#" class="num""#
                } else {
                    ""
                };
                let _ = write!(self.body, "<td{class}>{}</td>", escape(cell));
            }
            self.body.push_str("</tr>");
        }
        self.body.push_str("</tbody></table>");
        self
    }

    /// A two-column table of names and values.
    pub fn key_values(&mut self, pairs: &[(String, String)]) -> &mut Self {
        self.body.push_str("<table><tbody>");
        for (k, v) in pairs {
            let _ = write!(
                self.body,
                "<tr><th>{}</th><td>{}</td></tr>",
                escape(k),
                escape(v)
            );
        }
        self.body.push_str("</tbody></table>");
        self
    }

    /// A bulleted list of plain-text items.
    pub fn list(&mut self, items: &[String]) -> &mut Self {
        self.body.push_str("<ul>");
        for i in items {
            let _ = write!(self.body, "<li>{}</li>", escape(i));
        }
        self.body.push_str("</ul>");
        self
    }

    /// The whole document.
    pub fn finish(&self) -> String {
        format!(
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
             <title>{}</title><style>{CSS}</style></head><body>{}</body></html>\n",
            escape(&self.title),
            self.body
        )
    }

    /// Writes the document to `path` atomically ([`crate::write_atomic`]).
    pub fn write(&self, path: &Path) -> Result<()> {
        crate::write_atomic(path, self.finish().as_bytes())
    }
}

/// "12", "-3.5", "1.50 MiB", "97.2%", "+0.4%", "3.1k": right-aligned in tables.
fn looks_numeric(s: &str) -> bool {
    let t = s.trim().trim_start_matches(['+', '-']);
    t.starts_with(|c: char| c.is_ascii_digit())
        && t.chars().all(|c| {
            c.is_ascii_digit() || " .,%x".contains(c) || c.is_ascii_alphabetic() && t.len() < 12
        })
}
