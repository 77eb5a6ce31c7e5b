//! [`TempShardFile`]: a shard file in the temp folder that belongs to this process, and is
//! removed whatever way the process ends: when dropped (a return or an error), on SIGINT or
//! SIGTERM (Ctrl-C, `kill`), and, after a kill that runs no code (`kill -9`, a crash), by the
//! next process that makes one.
//!
//! A file is `fitgrad-PID-UNIQUE-NAME.fgshard` in [`std::env::temp_dir`]: the owner's process
//! id comes first, so the next process can tell a dead owner's file (and the `.tmp-` file of a
//! write it interrupted) from a running one's, and removes only those.

use crate::fsutil::{process_alive, unique_suffix};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};

/// The start of every shard file's name, before the owner's pid.
const PREFIX: &str = "fitgrad-";
/// The end of every shard file's name.
const SUFFIX: &str = ".fgshard";

/// The shard files this process owns, removed by the signal handler.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// A path in the temp folder for a shard file of this process (the file itself is written by
/// `ShardedDataset::create`), removed when this is dropped. Making one first removes the shard
/// files of processes that no longer run, and installs (once per process) a SIGINT / SIGTERM
/// handler that removes this process's shard files and exits with status 130, as an
/// interrupted command does. An application that installs its own handler first keeps it (the
/// files are then removed on drop and by the next run).
pub struct TempShardFile {
    path: PathBuf,
}

impl TempShardFile {
    /// A new unique path for a shard of the dataset `name` (any text; path separators are
    /// replaced).
    pub fn new(name: &str) -> TempShardFile {
        static HANDLER: Once = Once::new();
        HANDLER.call_once(|| {
            if let Err(e) = ctrlc::set_handler(|| {
                remove_live();
                std::process::exit(130);
            }) {
                log::warn!(
                    "shard files: no SIGINT/SIGTERM handler ({e}); they are removed when the \
                     run ends or by the next run"
                );
            }
        });
        let dir = std::env::temp_dir();
        remove_stale(&dir);
        let name: String = name
            .chars()
            .map(|c| if c.is_alphanumeric() { c } else { '-' })
            .collect();
        let path = dir.join(format!(
            "{PREFIX}{}-{}-{name}{SUFFIX}",
            std::process::id(),
            unique_suffix()
        ));
        crate::device::lock(&LIVE).push(path.clone());
        TempShardFile { path }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempShardFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        crate::device::lock(&LIVE).retain(|p| *p != self.path);
    }
}

/// Removes every shard file this process owns (the signal handler's work; the handler runs
/// on a thread of its own, so plain file removal is safe there).
fn remove_live() {
    for p in crate::device::lock(&LIVE).drain(..) {
        let _ = std::fs::remove_file(p);
    }
}

/// The owner's pid of a shard file's name (`fitgrad-PID-...fgshard`), or of the temporary file
/// of its atomic write (`.fitgrad-PID-...fgshard.tmp-...`).
fn owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.').unwrap_or(name);
    let rest = rest.strip_prefix(PREFIX)?;
    if !(name.ends_with(SUFFIX) || name.contains(&format!("{SUFFIX}.tmp-"))) {
        return None;
    }
    rest.split('-').next()?.parse().ok()
}

/// Removes the shard files in `dir` whose owner no longer runs; returns how many.
pub(crate) fn remove_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let me = std::process::id();
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            owner(&name.to_string_lossy()).is_some_and(|pid| pid != me && !process_alive(pid))
        })
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_owners() {
        assert_eq!(owner("fitgrad-123-abc-digits.fgshard"), Some(123));
        assert_eq!(owner(".fitgrad-77-x-y.fgshard.tmp-77-Qr"), Some(77));
        assert_eq!(owner("fitgrad-digits-seed0-1-2.fgshard"), None);
        assert_eq!(owner("fitgrad-123-abc.txt"), None);
        assert_eq!(owner("other-123.fgshard"), None);
    }
}
