//! The watch follows the state directory into existence and out of it, on a real
//! inotify descriptor and a real directory tree.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{StateWatch, Target};
use crate::state::StateDir;

/// Longer than any inotify event takes to arrive; shorter than a hung suite.
const PROMPTLY: Duration = Duration::from_secs(5);

fn scratch() -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let base = std::env::temp_dir().join(format!(
        "genv-state-watch-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&base).unwrap();
    base
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The next batch of events: whether the state must be read.
fn next(runtime: &tokio::runtime::Runtime, watch: &mut StateWatch) -> bool {
    runtime
        .block_on(async { tokio::time::timeout(PROMPTLY, watch.changed()).await })
        .expect("no inotify event arrived")
        .unwrap()
}

fn ancestor(dir: &Path, next: &str) -> Target {
    Target::Ancestor {
        dir: dir.to_owned(),
        next: next.into(),
    }
}

#[test]
fn the_watch_follows_the_state_directory_into_existence_and_out_of_it() {
    let runtime = runtime();
    let base = scratch();
    let state = base.join("var/tmp/genv");
    let mut watch = runtime.block_on(async { StateWatch::new(&StateDir::new(&state)).unwrap() });
    assert_eq!(watch.target(), Some(&ancestor(&base, "var")));

    // An unrelated directory beside it moves nothing.
    fs::create_dir(base.join("other")).unwrap();
    assert!(!next(&runtime, &mut watch));
    assert_eq!(watch.target(), Some(&ancestor(&base, "var")));
    fs::create_dir(base.join("var")).unwrap();
    assert!(next(&runtime, &mut watch));
    assert_eq!(watch.target(), Some(&ancestor(&base.join("var"), "tmp")));

    // `mkdir -p` faster than the watch moves: it lands on the deepest one there is.
    fs::create_dir_all(&state).unwrap();
    assert!(next(&runtime, &mut watch));
    assert_eq!(watch.target(), Some(&Target::State));

    fs::write(state.join("envs.json"), "{}").unwrap();
    assert!(next(&runtime, &mut watch));
    fs::write(state.join("unrelated"), "").unwrap();
    assert!(
        !next(&runtime, &mut watch),
        "a file genv does not read is not a change"
    );

    // Removed (genv's directory is in /var/tmp, which tmp cleaners sweep), then back.
    fs::remove_dir_all(&state).unwrap();
    assert!(next(&runtime, &mut watch));
    assert_eq!(
        watch.target(),
        Some(&ancestor(&base.join("var/tmp"), "genv"))
    );
    fs::create_dir(&state).unwrap();
    assert!(next(&runtime, &mut watch));
    assert_eq!(watch.target(), Some(&Target::State));
    assert!(!watch.is_lost());
    fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_state_directory_that_exists_is_watched_at_once() {
    let runtime = runtime();
    let base = scratch();
    let mut watch = runtime.block_on(async { StateWatch::new(&StateDir::new(&base)).unwrap() });
    assert_eq!(watch.target(), Some(&Target::State));
    fs::write(base.join("devices.json"), "{}").unwrap();
    assert!(next(&runtime, &mut watch));
    fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_link_where_the_state_directory_goes_is_refused_not_followed() {
    let runtime = runtime();
    let base = scratch();
    fs::create_dir(base.join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(base.join("elsewhere"), base.join("genv")).unwrap();
    let made = runtime.block_on(async { StateWatch::new(&StateDir::new(base.join("genv"))) });
    let error = made.err().expect("a link was watched");
    assert!(error.to_string().contains("link"), "{error}");
    fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_renamed_state_directory_is_let_go_and_its_replacement_watched() {
    let runtime = runtime();
    let base = scratch();
    let state = base.join("genv");
    fs::create_dir(&state).unwrap();
    let mut watch = runtime.block_on(async { StateWatch::new(&StateDir::new(&state)).unwrap() });
    assert_eq!(watch.target(), Some(&Target::State));
    // `mv genv x; mkdir genv`: the watch must not stay on `x`.
    fs::rename(&state, base.join("x")).unwrap();
    assert!(next(&runtime, &mut watch));
    assert_eq!(watch.target(), Some(&ancestor(&base, "genv")));
    fs::create_dir(&state).unwrap();
    assert!(next(&runtime, &mut watch));
    assert_eq!(watch.target(), Some(&Target::State));
    fs::write(base.join("x/envs.json"), "{}").unwrap();
    assert!(
        !next(&runtime, &mut watch),
        "the old directory is still watched"
    );
    fs::write(state.join("envs.json"), "{}").unwrap();
    assert!(next(&runtime, &mut watch));
    fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_link_on_the_way_to_the_state_directory_is_not_followed() {
    let runtime = runtime();
    let base = scratch();
    fs::create_dir(base.join("elsewhere")).unwrap();
    let link = base.join("a");
    std::os::unix::fs::symlink(base.join("elsewhere"), &link).unwrap();
    // Root's link (an administrator's `/var/tmp` → `/tmp`) is followed.
    let state = base.join("a/genv");
    let watch = runtime.block_on(async { StateWatch::new(&StateDir::new(&state)).unwrap() });
    assert_eq!(watch.target(), Some(&ancestor(&link, "genv")));
    drop(watch);
    // A user's is not: the watch stays above it, on `base`, waiting for `a`.
    std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
    let watch = runtime.block_on(async { StateWatch::new(&StateDir::new(&state)).unwrap() });
    assert_eq!(watch.target(), Some(&ancestor(&base, "a")));
    fs::remove_dir_all(&base).unwrap();
}
