//! What the example commands share in checking their flags before any device work: counts
//! within bounds ([`check_counts`]), output files that overwrite no input and no other output
//! ([`check_paths`]), a resume that leaves something to train ([`check_resume_progress`]), the
//! environment ([`check_environment`]), and errors that name the flag to change
//! ([`name_flags`]). Each is one rule, so every command refuses the same input the same way.

use crate::report::check_output_path;
// The plan's printing lives with the plan (src/train/run_plan.rs), where `distributed` uses it.
pub use crate::train::{plan_json, print_plan};
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The most optimizer steps a command runs (`--steps`, `--eval-every`): far past any run on
/// one device, and far enough below `u64::MAX` that step x batch positions cannot overflow.
pub const MAX_STEPS: u64 = 1_000_000_000;
/// The most epochs a command runs (`--epochs`).
pub const MAX_EPOCHS: u64 = 1_000_000;
/// The most characters a command generates (`--sample-len`): each is one forward of the model.
pub const MAX_SAMPLE_LEN: u64 = 100_000;
/// The most samples in a batch, a micro-batch's accumulation count, or a shard.
pub const MAX_BATCH: u64 = 1 << 20;
/// The most features of a layer (`--dim`, `--width`, `--hidden`), positions (`--context`).
pub const MAX_WIDTH: u64 = 1 << 16;
/// The most layers, blocks or heads.
pub const MAX_LAYERS: u64 = 1 << 10;

/// Checks that every `(flag, value, min, max)` has `min <= value <= max`; the first that does
/// not is an [`Error::InvalidArgument`] of `op` naming the flag and the bound.
pub fn check_counts(op: &'static str, counts: &[(&str, u64, u64, u64)]) -> Result<()> {
    for &(flag, value, min, max) in counts {
        let reason = if value < min {
            format!("{flag} must be at least {min}, got {value}")
        } else if value > max {
            format!("{flag} {value} is more than {max}, the most this command takes; ask for fewer")
        } else {
            continue;
        };
        return Err(Error::InvalidArgument { op, reason });
    }
    Ok(())
}

/// What identifies a file on disk: its device and inode where the system has them (so hard
/// links and symlinks to one file are one file), else its canonical path. A path that does not
/// exist yet is its folder's canonical path joined with its name.
#[derive(Clone, Debug, PartialEq, Eq)]
enum FileId {
    #[cfg(unix)]
    Inode(u64, u64),
    Path(PathBuf),
}

fn file_id(path: &Path) -> Option<FileId> {
    if let Ok(meta) = std::fs::metadata(path) {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            return Some(FileId::Inode(meta.dev(), meta.ino()));
        }
        #[cfg(not(unix))]
        {
            let _ = meta;
            return std::fs::canonicalize(path).ok().map(FileId::Path);
        }
    }
    // A dangling symlink: where it points is what would be written.
    if let Ok(target) = std::fs::read_link(path) {
        let base = path.parent().unwrap_or(Path::new("."));
        return file_id(&base.join(target));
    }
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path.file_name()?;
    Some(FileId::Path(std::fs::canonicalize(dir).ok()?.join(name)))
}

/// Checks, before any device work, that writing the `outputs` (flag, path) destroys nothing:
/// each names a file in a folder that exists and takes new files ([`check_output_path`]), and,
/// after resolving links, none is one of the `inputs` (flag, path) or another output. The
/// pairs in `may_replace` (output flag, input flag) are allowed to be one file: `("--save",
/// "--resume")` continues a run in place. [`Error::InvalidArgument`] names both flags.
pub fn check_paths(
    inputs: &[(&'static str, &Path)],
    outputs: &[(&'static str, &Path)],
    may_replace: &[(&str, &str)],
) -> Result<()> {
    for &(flag, path) in outputs {
        check_output_path(flag, path)?;
    }
    let ids: Vec<_> = outputs.iter().map(|&(_, p)| file_id(p)).collect();
    for (i, &(flag, path)) in outputs.iter().enumerate() {
        let Some(id) = &ids[i] else { continue };
        let clash = |other: &str, what: &str| Error::InvalidArgument {
            op: flag,
            reason: format!(
                "'{}' is the file of {other} too{}: writing it would destroy {what}; give \
                 {flag} another path",
                path.display(),
                if path_differs(path, outputs, inputs, other) {
                    " (after resolving links)"
                } else {
                    ""
                }
            ),
        };
        for &(input, ipath) in inputs {
            if may_replace.contains(&(flag, input)) {
                continue;
            }
            if file_id(ipath).as_ref() == Some(id) {
                return Err(clash(input, &format!("the {input} file")));
            }
        }
        for (j, &(other, _)) in outputs.iter().enumerate().take(i) {
            if ids[j].as_ref() == Some(id) {
                return Err(clash(other, &format!("what {other} writes")));
            }
        }
    }
    Ok(())
}

/// Whether `path` is spelled differently from the path of flag `other` (so the message says
/// that links were resolved).
fn path_differs(
    path: &Path,
    outputs: &[(&str, &Path)],
    inputs: &[(&str, &Path)],
    other: &str,
) -> bool {
    inputs
        .iter()
        .chain(outputs)
        .find(|(f, _)| *f == other)
        .is_some_and(|(_, p)| *p != path)
}

/// A resume from a checkpoint at `done` (steps or epochs) of a run asked to go to `asked`
/// (`flag`): more done than asked is an [`Error::InvalidArgument`] (nothing would train, and
/// the count was likely mistyped); `Ok(true)` when exactly as many are done, so the command
/// says plainly that it trains nothing.
pub fn check_resume_progress(
    path: &Path,
    done: u64,
    asked: u64,
    flag: &'static str,
) -> Result<bool> {
    if done > asked {
        return Err(Error::InvalidArgument {
            op: flag,
            reason: format!(
                "the checkpoint '{}' holds {done} already, more than {flag} {asked}: nothing \
                 would be trained; ask for more than {done}, or start a new run without --resume",
                path.display()
            ),
        });
    }
    Ok(done == asked)
}

/// The environment variables fitgrad reads, checked as flags are: a value
/// `FITGRAD_AUTOTUNE` or `FITGRAD_AUTOTUNE_BUDGET` cannot take is an [`Error::InvalidArgument`]
/// naming the variable (the library alone only warns through `log`).
pub fn check_environment() -> Result<()> {
    crate::kernels::matmul::env_settings().map(drop)
}

/// `error` with a divergence's remedy in this command's own flags: the library's names
/// flags that not every command has (`--clip-grad-norm`, a resume), so a command gives
/// `remedy` from its own; mixed precision is still suggested where the library suggests it
/// (the run was not in it). Any other error is returned as it is.
pub fn own_remedy(error: Error, remedy: &str) -> Error {
    match error {
        Error::NonFinite {
            step,
            what,
            remedy: library,
        } => {
            let remedy = match library.contains("--precision mixed") {
                true => format!(
                    "{remedy}, or use mixed precision (--precision mixed), whose loss scaling \
                     skips such steps"
                ),
                false => remedy.to_string(),
            };
            Error::NonFinite { step, what, remedy }
        }
        e => e,
    }
}

/// `error` with the flags that change it, where the error cannot know them: an adapter limit
/// passed by a buffer (the batch, the model's size) becomes an [`Error::InvalidArgument`] of
/// `op` that says `change`; any other error is returned as it is.
pub fn name_flags(op: &'static str, error: Error, change: &str) -> Error {
    match error {
        e @ Error::Limit { .. } => Error::InvalidArgument {
            op,
            reason: format!("{e}; {change}"),
        },
        e => e,
    }
}

/// Where `--offload` puts things: (optimizer offloaded, parameters streamed). `parameters`
/// implies the optimizer; `units` says whether the command's model names units (a model
/// without any is refused with how to mark them); `conflicts` are (flag, whether given) of the
/// features streamed parameters cannot serve yet, each refused by name, never dropped.
pub fn check_offload(
    op: &'static str,
    offload: &str,
    units: bool,
    conflicts: &[(&str, bool)],
) -> Result<(bool, bool)> {
    match offload {
        "none" => Ok((false, false)),
        "optimizer" => Ok((true, false)),
        "parameters" => {
            if !units {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!(
                        "--offload parameters: {}",
                        crate::residency::HOW_TO_MARK_UNITS
                    ),
                });
            }
            if let Some((flag, _)) = conflicts.iter().find(|(_, on)| *on) {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!(
                        "--offload parameters does not combine with {flag} yet (streamed units' \
                         gradients are summed in host memory); drop one of them"
                    ),
                });
            }
            Ok((true, true))
        }
        other => Err(Error::InvalidArgument {
            op,
            reason: format!("--offload {other}: use none, optimizer or parameters"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_name_the_flag_and_the_bound() {
        assert!(check_counts("t", &[("--a", 1, 1, 3), ("--b", 3, 1, 3)]).is_ok());
        let low = check_counts("t", &[("--a", 0, 1, 3)])
            .unwrap_err()
            .to_string();
        assert!(low.contains("--a must be at least 1"), "{low}");
        let high = check_counts("t", &[("--a", 2, 1, 3), ("--b", 9, 1, 3)])
            .unwrap_err()
            .to_string();
        assert!(high.contains("--b 9 is more than 3"), "{high}");
    }

    #[test]
    fn resume_progress() {
        let p = Path::new("c.st");
        assert!(!check_resume_progress(p, 3, 6, "--steps").unwrap());
        assert!(check_resume_progress(p, 6, 6, "--steps").unwrap());
        let err = check_resume_progress(p, 7, 6, "--steps")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--steps 6") && err.contains("nothing"),
            "{err}"
        );
    }

    /// The only test that sets these variables; the tuner, reading them meanwhile in other
    /// tests, only warns and keeps its defaults.
    #[test]
    fn environment_values_are_checked() {
        assert!(check_environment().is_ok());
        for (var, bad, good) in [
            ("FITGRAD_AUTOTUNE", "maybe", "OFF"),
            ("FITGRAD_AUTOTUNE_BUDGET", "abc", "2.5"),
        ] {
            std::env::set_var(var, bad);
            let err = check_environment().unwrap_err().to_string();
            std::env::set_var(var, good);
            let ok = check_environment();
            std::env::remove_var(var);
            assert!(err.contains(var) && err.contains(bad), "{err}");
            assert!(ok.is_ok(), "{var}={good}: {ok:?}");
        }
    }

    #[test]
    fn limit_errors_get_the_flags() {
        let e = Error::Limit {
            op: "alloc",
            what: "binding size",
            value: 10,
            limit: 5,
        };
        let named = name_flags("x", e, "lower --batch-size").to_string();
        assert!(
            named.contains("limit of 5") && named.contains("--batch-size"),
            "{named}"
        );
        let other = name_flags("x", Error::Gpu("g".into()), "lower --batch-size").to_string();
        assert!(!other.contains("--batch-size"));
    }
}
