//! Pinned programs made by tests: a test-private pin directory, removed however the
//! test ends (left behind, its programs would go on deciding for the whole machine), and
//! the generations a daemon pins under it.

use std::path::{Path, PathBuf};

/// A test's pin directory, removed when dropped.
pub struct Pins(pub PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The pinned generations (one directory each) under `root`.
pub fn generations(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .map(|entries| entries.filter_map(|e| Some(e.ok()?.path())).collect())
        .unwrap_or_default()
}
