//! The flags every training command shares, checked once: the memory budget and `--fit auto`,
//! the batch and its accumulation, a learning rate, and the files a run reads and writes.

use super::checks::{check_counts, check_paths, MAX_BATCH};
use crate::{Bytes, Error, Result};
use std::path::{Path, PathBuf};

/// An [`Error::InvalidArgument`] of command `op`.
pub fn invalid(op: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        op,
        reason: reason.into(),
    }
}

/// `--memory-budget` (e.g. `48MiB`) in bytes; 0 is refused (nothing fits in it).
pub fn parse_budget(op: &'static str, flag: Option<&str>) -> Result<Option<u64>> {
    let budget = flag.map(|b| b.parse::<Bytes>().map(|b| b.0)).transpose()?;
    if budget == Some(0) {
        return Err(invalid(op, "--memory-budget must be more than 0 bytes"));
    }
    Ok(budget)
}

/// Whether `--fit` asks for fit auto: only `auto`, only with a budget, and not together with
/// `--checkpoint-activations` when fit auto chooses `checkpointing` itself (`checkpointing`:
/// what the command calls it, "activation checkpointing" or "block checkpointing").
pub fn parse_fit(
    op: &'static str,
    fit: Option<&str>,
    budget: Option<u64>,
    checkpoint_activations: bool,
    checkpointing: &str,
) -> Result<bool> {
    match fit {
        None => Ok(false),
        Some("auto") if budget.is_none() => {
            Err(invalid(op, "--fit auto fits a budget: add --memory-budget"))
        }
        Some("auto") if checkpoint_activations => Err(invalid(
            op,
            format!("--fit auto chooses {checkpointing} itself: drop --checkpoint-activations"),
        )),
        Some("auto") => Ok(true),
        Some(other) => Err(invalid(
            op,
            format!("--fit {other}: the one mode is 'auto'"),
        )),
    }
}

/// `--batch-size` and `--accum-steps` within [`MAX_BATCH`], and the samples of one optimizer
/// step (their product), which must not overflow.
pub fn effective_batch(op: &'static str, batch: usize, accum: usize) -> Result<usize> {
    check_counts(
        op,
        &[
            ("--batch-size", batch as u64, 1, MAX_BATCH),
            ("--accum-steps", accum as u64, 1, MAX_BATCH),
        ],
    )?;
    batch
        .checked_mul(accum)
        .ok_or_else(|| invalid(op, "--batch-size x --accum-steps overflows"))
}

/// A number `flag` (a learning rate, a temperature) that is finite and above 0 (or at least 0
/// with `zero_ok`).
pub fn check_number<T>(op: &'static str, flag: &str, lr: T, zero_ok: bool) -> Result<()>
where
    T: Into<f64> + Copy + std::fmt::Display,
{
    let v: f64 = lr.into();
    let ok = v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0));
    match (ok, zero_ok) {
        (true, _) => Ok(()),
        (false, true) => Err(invalid(
            op,
            format!("{flag} must be a finite number >= 0, got {lr}"),
        )),
        (false, false) => Err(invalid(
            op,
            format!("{flag} must be a number > 0, got {lr}"),
        )),
    }
}

/// The files a run reads and writes, each with its flag, checked together before any device
/// work ([`check_paths`]): no output overwrites an input, a file inside an input folder, or
/// another output. `--save` may replace `--resume` (a run continued in place).
#[derive(Default)]
pub struct Files<'a> {
    inputs: Vec<(&'static str, PathBuf)>,
    outputs: Vec<(&'static str, &'a Path)>,
    /// Output folders: (flag, folder, the files written into it).
    folders: Vec<(&'static str, &'a Path, &'a [&'a str])>,
}

impl<'a> Files<'a> {
    /// No files yet.
    pub fn new() -> Files<'a> {
        Files::default()
    }

    /// An input file of `flag`, when given.
    pub fn input(mut self, flag: &'static str, path: Option<&Path>) -> Self {
        self.inputs.extend(path.map(|p| (flag, p.to_path_buf())));
        self
    }

    /// Every input file of `flag`.
    pub fn inputs(mut self, flag: &'static str, paths: impl IntoIterator<Item = PathBuf>) -> Self {
        self.inputs.extend(paths.into_iter().map(|p| (flag, p)));
        self
    }

    /// An input folder of `flag`: every file in it is an input (what writing into it would
    /// destroy), and a folder that cannot be listed adds nothing (reading it reports that).
    pub fn input_folder(self, flag: &'static str, dir: Option<&Path>) -> Self {
        let files = dir
            .and_then(|d| std::fs::read_dir(d).ok())
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file());
        self.inputs(flag, files.collect::<Vec<_>>())
    }

    /// An output file of `flag`, when given.
    pub fn output(mut self, flag: &'static str, path: Option<&'a Path>) -> Self {
        self.outputs.extend(path.map(|p| (flag, p)));
        self
    }

    /// An output folder of `flag`, when given, into which the run writes `files`: each of
    /// them is checked as an output once the folder exists.
    pub fn output_folder(
        mut self,
        flag: &'static str,
        dir: Option<&'a Path>,
        files: &'a [&'a str],
    ) -> Self {
        self.folders.extend(dir.map(|d| (flag, d, files)));
        self
    }

    /// Checks them all ([`check_paths`]); an output folder that is an input folder's file, or
    /// holds an input among the files written into it, is refused naming both flags.
    pub fn check(&self) -> Result<()> {
        let inputs: Vec<(&'static str, &Path)> =
            self.inputs.iter().map(|(f, p)| (*f, p.as_path())).collect();
        check_paths(&inputs, &self.outputs, &[("--save", "--resume")])?;
        let mut written: Vec<(&'static str, PathBuf)> = Vec::new();
        for &(flag, dir, files) in &self.folders {
            if dir.is_file() {
                return Err(invalid(
                    flag,
                    format!("'{}' is a file: give {flag} a folder", dir.display()),
                ));
            }
            written.extend(files.iter().map(|f| (flag, dir.join(f))));
        }
        // The folder's files are checked only where the folder exists (a new one destroys
        // nothing); its parent must exist and take new folders when the run writes it.
        let written: Vec<(&'static str, &Path)> = written
            .iter()
            .filter(|(_, p)| p.parent().is_some_and(Path::is_dir))
            .map(|(f, p)| (*f, p.as_path()))
            .collect();
        let mut all = self.outputs.clone();
        all.extend(written);
        check_paths(&inputs, &all, &[("--save", "--resume")])
    }
}

/// The optimizer steps of `epochs` epochs of `samples` samples, `eff` a step: the one rule for
/// a product of counts (epochs x steps per epoch), at most [`MAX_STEPS`](super::MAX_STEPS),
/// so a schedule over the run neither wraps nor runs for years.
pub fn total_steps(op: &'static str, samples: usize, eff: usize, epochs: u64) -> Result<u64> {
    let per_epoch = samples.div_ceil(eff.max(1)) as u64;
    let total = per_epoch.saturating_mul(epochs);
    let most = super::checks::MAX_STEPS;
    check_counts(op, &[("--epochs x steps per epoch", total, 0, most)])?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_auto_needs_a_budget_and_no_checkpointing_flag() {
        let ck = "activation checkpointing";
        assert!(!parse_fit("t", None, None, false, ck).unwrap());
        assert!(parse_fit("t", Some("auto"), Some(8), false, ck).unwrap());
        for (fit, budget, flag, says) in [
            (Some("auto"), None, false, "--memory-budget"),
            (Some("auto"), Some(8), true, "--checkpoint-activations"),
            (Some("manual"), Some(8), false, "'auto'"),
        ] {
            let err = parse_fit("t", fit, budget, flag, ck)
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{err}");
        }
        assert!(parse_budget("t", Some("0")).is_err());
        assert_eq!(parse_budget("t", Some("1KiB")).unwrap(), Some(1024));
    }

    /// One rule for products of counts: a batch times its accumulation that overflows, and
    /// epochs times steps past the most steps, are refused naming the flags.
    #[test]
    fn products_of_counts_are_bounded() {
        assert_eq!(effective_batch("t", 8, 4).unwrap(), 32);
        let err = effective_batch("t", 8, 1 << 58).unwrap_err().to_string();
        assert!(err.contains("--accum-steps"), "{err}");
        assert_eq!(total_steps("t", 100, 10, 3).unwrap(), 30);
        let err = total_steps("t", 100, 1, 1 << 62).unwrap_err().to_string();
        assert!(err.contains("--epochs"), "{err}");
    }

    /// An output folder over an input folder's files, and an output onto an input, are
    /// refused before anything is written; distinct paths pass.
    #[test]
    fn outputs_never_overwrite_inputs_or_an_input_folder() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(model.join("model.safetensors"), b"w").unwrap();
        let data = dir.path().join("d.csv");
        std::fs::write(&data, b"a,label\n1,0\n").unwrap();
        let files: &[&str] = &["model.safetensors", "config.json"];
        let err = Files::new()
            .input_folder("--model", Some(&model))
            .output_folder("--save", Some(&model), files)
            .check()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--model"), "{err}");
        let err = Files::new()
            .input("--dataset", Some(&data))
            .output("--report", Some(&data))
            .check()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--dataset"), "{err}");
        let out = dir.path().join("out");
        Files::new()
            .input_folder("--model", Some(&model))
            .input("--dataset", Some(&data))
            .output_folder("--save", Some(&out), files)
            .output("--report", Some(&dir.path().join("r.html")))
            .check()
            .unwrap();
        assert_eq!(
            std::fs::read(model.join("model.safetensors")).unwrap(),
            b"w"
        );
    }
}
