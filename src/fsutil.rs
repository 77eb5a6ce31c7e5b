//! Files written so that a crash never leaves a torn file behind.

use crate::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` through a temporary file in the same folder, flushed to disk and
/// renamed over `path`: readers see the old file or the new one, never half of one.
///
/// The temporary file is `.NAME.tmp-PID-RANDOM` (a unique name per call, so threads and
/// processes saving to the same path never share one); it is removed on any error, and only a
/// kill between its creation and the rename leaves it behind. After the rename the folder is
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
