//! Files written so that a crash never leaves a torn file behind, and the leftovers of
//! processes that were killed (their temporary files) found by their owner's process id.

use crate::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` through a temporary file in the same folder, flushed to disk and
/// renamed over `path`: readers see the old file or the new one, never half of one.
///
/// The temporary file is `.NAME.tmp-PID-RANDOM` (a unique name per call, so threads and
/// processes saving to the same path never share one); it is removed on any error, and only a
/// kill between its creation and the rename leaves it behind, until the next save to `path`
/// removes those whose process no longer runs. After the rename the folder is
/// synced too (on unix), so the new name itself survives a power cut.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // A save killed between creating its temporary file and the rename (kill -9) leaves it
    // behind; the next save to this path removes those of processes that no longer run.
    remove_dead_owners(dir, &format!(".{name}.tmp-"));
    let prefix = format!(".{name}.tmp-{}-", std::process::id());
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix);
    // tempfile creates 0600 files; a checkpoint gets the mode `File::create` would give it
    // (0666 less the umask), so other readers of the folder keep reading it.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    // Dropping the NamedTempFile on any error below removes it.
    let mut tmp = builder.tempfile_in(dir).map_err(io)?;
    tmp.write_all(bytes).map_err(io)?;
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    sync_dir(dir).map_err(io)
}

/// Removes the files in `dir` named `{prefix}PID-...` whose process `PID` no longer runs (never
/// this process's own: another thread may be writing one).
fn remove_dead_owners(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let me = std::process::id();
    for e in entries.flatten() {
        let name = e.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        if pid.is_some_and(|pid| pid != me && !process_alive(pid)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Whether a process with this id runs (on unix: `kill(pid, 0)` succeeds or is refused for
/// permission, i.e. the process exists). Elsewhere every process counts as running, so
/// nothing of another process is ever removed there.
pub(crate) fn process_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return true;
        };
        if pid <= 0 {
            return true;
        }
        // SAFETY: signal 0 sends nothing; kill only checks that the process exists.
        let r = unsafe { libc::kill(pid, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// The process id, the time and a random number: no two calls share it, even in two
/// processes started at once or under a reused pid.
pub(crate) fn unique_suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // std's hasher keys are random per process and per RandomState.
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("{nanos:x}-{:08x}", random as u32)
}

/// Flushes a folder's entries (the rename) to disk. Filesystems that cannot sync a folder say
/// so with InvalidInput or Unsupported; the file's own data is synced already, so those pass.
#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::File::open(dir).and_then(|d| d.sync_all()) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::InvalidInput | std::io::ErrorKind::Unsupported
            ) =>
        {
            Ok(())
        }
        r => r,
    }
}

/// Elsewhere std cannot open a folder for syncing (Windows needs FILE_FLAG_BACKUP_SEMANTICS);
/// the file's data is synced, only the rename may be lost to a power cut.
#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}
