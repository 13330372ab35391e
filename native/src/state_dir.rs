//! Where `cairn serve` keeps what must outlive a restart and stay private:
//! the signaling secret, revoked token ids, the list of join tokens and the
//! generated API key. `--state-dir`, else `$CAIRN_STATE_DIR`, else
//! `$XDG_STATE_HOME/cairn`, else `~/.local/state/cairn`.

use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Where the state directory for `flag` is, without making it (for
/// commands that only read it, such as `cairn audit verify`).
pub fn locate(flag: Option<PathBuf>) -> PathBuf {
    flag.or_else(|| std::env::var_os("CAIRN_STATE_DIR").map(PathBuf::from))
        .or_else(|| std::env::var_os("XDG_STATE_HOME").map(|d| PathBuf::from(d).join("cairn")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state/cairn")))
        .unwrap_or_else(|| PathBuf::from(".cairn-state"))
}

/// The state directory for `flag` (created owner-only on Unix when missing).
pub fn resolve(flag: Option<PathBuf>) -> std::io::Result<PathBuf> {
    let dir = locate(flag);
    let existed = dir.exists();
    std::fs::create_dir_all(&dir)?;
    // Only a directory made here is narrowed: `--state-dir` may name one the
    // user shares on purpose (the files in it are 0600 either way).
    #[cfg(unix)]
    if !existed {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    }
    #[cfg(not(unix))]
    let _ = existed;
    Ok(dir)
}

/// Replaces `path` with `bytes`, readable by its owner only: written to a
/// sibling first and renamed, so a crash leaves the old file or the new one.
pub fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    // A leftover from a crash may have other permissions; `mode` applies only on creation.
    let _ = std::fs::remove_file(&tmp);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut f = options.open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}
