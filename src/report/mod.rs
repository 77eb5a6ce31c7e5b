//! Reports people can look at: a training run as one self-contained HTML page (inline SVG, no
//! script, nothing fetched) and the same data as JSON.
//!
//! - [`TrainingReport`]: the data of a run (settings, adapter, loss and throughput, the memory
//!   timeline of one step beside the planner's, the memory table, what the trainer changed on
//!   its own, the budget and the strategy chosen for it), its JSON and its page. The examples'
//!   `--report` / `--report-json` write it; [`StepCapture`] records the step's memory.
//! - [`svg`] and [`html`]: the building blocks of the pages (charts, tables, escaping, atomic
//!   writing), usable for other reports (`cargo xtask bench`).
//! - [`browser`]: rendering a page in headless Chromium, for tests of the pages.

pub mod browser;
pub mod html;
pub mod svg;
mod training;
mod training_page;

pub use training::{
    BudgetFit, EpochPoint, EvalPoint, StepCapture, StepMemory, StepPoint, TrainingReport,
};

use crate::{Error, Result};
use std::path::Path;

/// Checks, before any training, that a report can be written to `path`: it names a file (not a
/// folder) in a folder that exists and takes new files (a file is created there and removed).
/// [`Error::InvalidArgument`] names `flag` for a path that cannot work, [`Error::Io`] carries
/// the system's refusal.
pub fn check_output_path(flag: &'static str, path: &Path) -> Result<()> {
    let invalid = |reason: String| Error::InvalidArgument { op: flag, reason };
    if path.as_os_str().is_empty() || path.file_name().is_none() {
        return Err(invalid(format!(
            "'{}' names no file; give a file name such as report.html",
            path.display()
        )));
    }
    if path.is_dir() {
        return Err(invalid(format!(
            "'{}' is a folder; give a file name inside it",
            path.display()
        )));
    }
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Err(invalid(format!(
            "the folder '{}' of '{}' does not exist; create it first",
            dir.display(),
            path.display()
        )));
    }
    tempfile::Builder::new()
        .prefix(".fitgrad-report-check-")
        .tempfile_in(dir)
        .map(drop)
        .map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })
}
