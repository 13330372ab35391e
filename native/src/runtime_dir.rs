//! A private runtime directory when the session has none (a service, `ssh host cmd`, a
//! container): Mesa's window-system probing, which wgpu and Vulkan loaders trigger even
//! for compute, prints `error: XDG_RUNTIME_DIR is invalid or not set in the environment.`
//! twice otherwise, and a newcomer reads those lines as failures.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Sets `XDG_RUNTIME_DIR` to `$TMPDIR/cairn-runtime-UID` (mode 0700, ours) when it is unset
/// or not an absolute path to a directory. Must run before any thread starts.
pub fn ensure() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|v| usable(Path::new(&v))) {
        return;
    }
    let Some(dir) = private_dir() else {
        return;
    };
    // SAFETY: called first thing in `main`, before the tokio runtime, wgpu or any other
    // thread exists, so nothing reads the environment concurrently.
    unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
}

fn usable(path: &Path) -> bool {
    path.is_absolute() && path.is_dir()
}

/// The directory, created if missing; `None` when it exists but is not a directory of ours
/// that only we can read (someone else's, or a link planted in /tmp).
fn private_dir() -> Option<PathBuf> {
    let uid = std::fs::metadata("/proc/self").ok()?.uid();
    let dir = std::env::temp_dir().join(format!("cairn-runtime-{uid}"));
    let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    let meta = std::fs::symlink_metadata(&dir).ok()?;
    let ours = meta.is_dir() && meta.uid() == uid && meta.permissions().mode() & 0o077 == 0;
    ours.then_some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_or_missing_paths_are_not_usable() {
        assert!(!usable(Path::new("relative/dir")));
        assert!(!usable(Path::new("/no/such/cairn/dir")));
        assert!(usable(&std::env::temp_dir()));
    }

    #[test]
    fn the_private_directory_is_ours_and_closed_to_others() {
        let dir = private_dir().expect("a private directory in the temp dir");
        let meta = std::fs::metadata(&dir).expect("it exists");
        assert!(meta.is_dir());
        assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    }
}
