//! CSV datasets: the `csv` crate splits the records (quoted fields, CRLF, fields that span
//! lines); this file picks the delimiter, finds the header and the label column, and turns
//! fields into features and labels with errors that name the file and the line.

use std::path::Path;

use crate::error::data_err;
use crate::Result;

/// A CSV's rows split into features and labels, before any dataset-level check.
pub(super) struct CsvTable {
    /// Row-major, `dim` per row.
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
    pub dim: usize,
    /// Each row's line in the file, for messages.
    pub lines: Vec<usize>,
    /// The label column as a message names it: `'label'` or `the last, column 5`.
    pub column: String,
}

/// The delimiters `from_csv` recognizes, in the order a tie between their counts is settled:
/// a tab or a semicolon in a file split by commas is rare, while commas often appear inside
/// fields of a semicolon file (decimal commas, text).
const DELIMITERS: [u8; 3] = [b'\t', b';', b','];

/// The delimiter of a CSV: of tab, semicolon and comma, the one that occurs most often outside
/// double quotes in the first non-blank line; ties go to tab, then semicolon; comma when the
/// line holds none of them.
pub(super) fn detect_delimiter(text: &str) -> u8 {
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let mut counts = [0usize; 3];
    let mut quoted = false;
    for b in first.bytes() {
        if b == b'"' {
            quoted = !quoted;
        } else if !quoted {
            if let Some(i) = DELIMITERS.iter().position(|&d| d == b) {
                counts[i] += 1;
            }
        }
    }
    // max_by_key keeps the last maximum; scanning in reverse makes the first one win.
    let (i, n) = counts
        .iter()
        .enumerate()
        .rev()
        .max_by_key(|&(_, n)| *n)
        .expect("three delimiters");
    if *n == 0 {
        b','
    } else {
        DELIMITERS[i]
    }
}

/// A field without the double quotes of `1, "2"`: a quote after a space is no quote to the
/// csv crate (RFC 4180), but it is clearly meant as one around a number.
fn bare(field: &str) -> &str {
    field
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .map_or(field, str::trim)
}

/// A finite number, or None. NaN and infinities are refused: one of them poisons a whole run.
fn number(field: &str) -> Option<f32> {
    bare(field).parse::<f32>().ok().filter(|x| x.is_finite())
}

/// A label: a non-negative integer, also written as "3.0" (as pandas exports integer columns
/// that once held a NaN).
fn label(field: &str) -> Option<u32> {
    let field = bare(field);
    if let Ok(l) = field.parse::<u32>() {
        return Some(l);
    }
    let x = field.parse::<f64>().ok()?;
    (x >= 0.0 && x.fract() == 0.0 && x <= f64::from(u32::MAX)).then_some(x as u32)
}

/// The line a record starts on. The csv crate's position is where it began reading the record,
/// before the empty lines it skips, so those are counted here.
fn record_line(text: &[u8], pos: &csv::Position) -> usize {
    let start = (pos.byte() as usize).min(text.len());
    let skipped = text[start..]
        .iter()
        .take_while(|&&b| b == b'\n' || b == b'\r')
        .filter(|&&b| b == b'\n')
        .count();
    pos.line() as usize + skipped
}

/// A CSV already gunzipped; see `Dataset::from_csv`. `delimiter` None detects it.
pub(super) fn parse_csv(
    path: &Path,
    bytes: &[u8],
    label_column: Option<&str>,
    delimiter: Option<u8>,
) -> Result<CsvTable> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let line = 1 + bytes[..e.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count();
        data_err(path, format!("line {line}: not UTF-8 text"))
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text); // spreadsheet byte-order mark
    let delimiter = delimiter.unwrap_or_else(|| detect_delimiter(text));
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false) // decided below from the first row's fields
        .delimiter(delimiter)
        .flexible(true) // a row of another width is our error, with its line
        .trim(csv::Trim::All)
        .from_reader(text.as_bytes());
    // (1-based line of the record's start, fields); rows of blanks are skipped (the csv
    // crate already skips empty lines), and line numbers stay those of the file.
    let line_of = |p: Option<&csv::Position>| p.map_or(0, |p| record_line(text.as_bytes(), p));
    let mut rows = reader.records().filter_map(|r| match r {
        Ok(rec) if rec.iter().all(str::is_empty) => None,
        Ok(rec) => Some(Ok((line_of(rec.position()), rec))),
        Err(e) => {
            let line = line_of(e.position());
            Some(Err(data_err(path, format!("line {line}: {e}"))))
        }
    });

    let Some(first) = rows.next() else {
        return Err(data_err(path, "empty file: no rows"));
    };
    let (first_line, first) = first?;
    let cols = first.len();
    if cols < 2 {
        let d = char::from(delimiter).escape_default();
        return Err(data_err(
            path,
            format!(
                "line {first_line}: need at least one feature column and a label column, \
                 found {cols} column (fields split at '{d}')"
            ),
        ));
    }
    let has_header = first.iter().any(|f| number(f).is_none());
    let header = |sep| first.iter().collect::<Vec<_>>().join(sep);
    let label_col = match (has_header, label_column) {
        (true, Some(want)) => first.iter().position(|h| h == want).ok_or_else(|| {
            data_err(
                path,
                format!(
                    "the header has no column named '{want}' (columns: {})",
                    header(", ")
                ),
            )
        })?,
        (true, None) => first.iter().position(|h| h == "label").unwrap_or(cols - 1),
        (false, Some(want)) => {
            return Err(data_err(
                path,
                format!(
                    "has no header row, so there is no column named '{want}' \
                     (without a header the label is the last column)"
                ),
            ))
        }
        (false, None) => cols - 1,
    };

    let dim = cols - 1;
    let mut features = Vec::new();
    let mut labels = Vec::new();
    let mut lines = Vec::new(); // each row's line, for the label check's message
    let mut push_row = |line: usize, rec: &csv::StringRecord| -> Result<()> {
        if rec.len() != cols {
            return Err(data_err(
                path,
                format!("line {line}: expected {cols} columns, found {}", rec.len()),
            ));
        }
        for (c, f) in rec.iter().enumerate() {
            if c == label_col {
                labels.push(label(f).ok_or_else(|| {
                    data_err(
                        path,
                        format!("line {line}: label {f} is not a non-negative integer"),
                    )
                })?);
            } else {
                features.push(number(f).ok_or_else(|| {
                    data_err(
                        path,
                        format!("line {line}: '{f}' is not a number (column {})", c + 1),
                    )
                })?);
            }
        }
        lines.push(line);
        Ok(())
    };
    if !has_header {
        push_row(first_line, &first)?;
    }
    for row in rows {
        let (line, rec) = row?;
        push_row(line, &rec)?;
    }
    if labels.is_empty() {
        return Err(data_err(path, "has a header but no data rows"));
    }
    let column = if has_header {
        format!("'{}'", &first[label_col])
    } else {
        format!("the last, column {}", label_col + 1)
    };
    Ok(CsvTable {
        features,
        labels,
        dim,
        lines,
        column,
    })
}
