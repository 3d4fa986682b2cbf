//! What another user can put in `$GENV_TMPDIR` in place of `envs.json` and
//! `devices.json` (see `hostile_tests`, whose scratch directories these use): links,
//! FIFOs, hard links, endless or huge files. None is read through, written through,
//! or waited on.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

use serde_json::json;

use super::StateDir;
use super::hostile_tests::{Scratch, assert_names, devices_text, mkfifo, promptly, snapshot};

#[test]
fn a_symlinked_envs_json_is_not_read() {
    let scratch = Scratch::new();
    let target = scratch.target("envs.json", &json!({"envs": []}).to_string(), 0o600);
    symlink(&target, scratch.in_state("envs.json")).unwrap();

    let error = scratch.dir().load_envs().unwrap_err().to_string();

    assert_names(&error, "envs.json", "symbolic link");
}

#[test]
fn a_symlinked_devices_json_is_not_read() {
    let scratch = Scratch::new();
    let target = scratch.target("devices.json", &devices_text("x"), 0o600);
    symlink(&target, scratch.in_state("devices.json")).unwrap();

    let error = scratch.dir().load_devices(&[]).unwrap_err().to_string();

    assert_names(&error, "devices.json", "symbolic link");
}

#[test]
fn detach_never_writes_through_a_symlinked_devices_json() {
    let scratch = Scratch::new();
    let eid = scratch.live_env();
    let target = scratch.target("devices.json", &devices_text(&eid), 0o644);
    let before = snapshot(&target);
    symlink(&target, scratch.in_state("devices.json")).unwrap();

    let error = scratch.dir().detach(&eid, 0).unwrap_err().to_string();

    assert_names(&error, "devices.json", "symbolic link");
    assert_eq!(snapshot(&target), before, "the link's target was rewritten");
}

#[test]
fn detach_refuses_a_hard_linked_devices_json() {
    let scratch = Scratch::new();
    let eid = scratch.live_env();
    let other = scratch.target("other.json", &devices_text(&eid), 0o644);
    let before = snapshot(&other);
    fs::hard_link(&other, scratch.in_state("devices.json")).unwrap();

    let error = scratch.dir().detach(&eid, 0).unwrap_err().to_string();

    assert_names(&error, "devices.json", "hard link");
    assert_eq!(
        snapshot(&other),
        before,
        "the other name's file was rewritten"
    );
}

#[test]
fn detach_rewrites_devices_json_in_place() {
    let scratch = Scratch::new();
    let eid = scratch.live_env();
    let path = scratch.in_state("devices.json");
    fs::write(&path, devices_text(&eid)).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
    let inode = fs::metadata(&path).unwrap().ino();

    scratch.dir().detach(&eid, 0).unwrap();

    let meta = fs::metadata(&path).unwrap();
    assert_eq!((meta.ino(), meta.mode() & 0o7777), (inode, 0o666));
    let text = fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"attachments\": []"), "{text}");
    assert!(
        text.starts_with("{\n  \"devices\": ["),
        "not genv's format: {text}"
    );
}

#[test]
fn a_fifo_envs_json_fails_promptly() {
    let scratch = Scratch::new();
    mkfifo(&scratch.in_state("envs.json"));
    let dir = scratch.dir();

    let result = promptly("reading a FIFO envs.json", move || {
        dir.load_envs().map_err(|e| e.to_string())
    });

    assert_names(&result.unwrap_err(), "envs.json", "FIFO");
}

#[test]
fn a_fifo_devices_json_fails_promptly() {
    let scratch = Scratch::new();
    mkfifo(&scratch.in_state("devices.json"));
    let dir = scratch.dir();

    let result = promptly("reading a FIFO devices.json", move || {
        dir.load_devices(&[]).map_err(|e| e.to_string())
    });

    assert_names(&result.unwrap_err(), "devices.json", "FIFO");
}

#[test]
fn envs_json_linked_to_dev_zero_is_refused_promptly() {
    let scratch = Scratch::new();
    symlink("/dev/zero", scratch.in_state("envs.json")).unwrap();
    let dir = scratch.dir();

    let result = promptly("reading /dev/zero as envs.json", move || {
        dir.load_envs().map_err(|e| e.to_string())
    });

    assert_names(&result.unwrap_err(), "envs.json", "symbolic link");
}

#[test]
fn an_oversized_envs_json_is_an_error_not_a_partial_parse() {
    let scratch = Scratch::new();
    // Valid JSON, but padded past the cap: a size check, not a parse error, stops it.
    let mut text = json!({"envs": []}).to_string().into_bytes();
    text.resize(17 * 1024 * 1024, b' ');
    fs::write(scratch.in_state("envs.json"), text).unwrap();

    let error = scratch.dir().load_envs().unwrap_err().to_string();

    assert_names(&error, "envs.json", "larger than 16777216 bytes");
}

#[test]
fn missing_files_are_still_no_state() {
    let scratch = Scratch::new();
    assert!(scratch.dir().load_envs().unwrap().is_empty());
    assert!(scratch.dir().load_devices(&[]).unwrap().is_none());
    let gone = StateDir::new(scratch.base.join("never-made"));
    assert!(gone.load_envs().unwrap().is_empty());
    assert!(gone.load_devices(&[]).unwrap().is_none());
}

/// The refusals are typed, for callers that treat them apart from I/O failures.
#[test]
fn refusals_are_typed() {
    use super::safe_open::{FileKind, Refusal};
    use super::{LockErrorKind, MAX_STATE_FILE, StateErrorKind};
    use rustix::fs::FileType;

    let scratch = Scratch::new();
    symlink("/etc/passwd", scratch.in_state("genv.lock")).unwrap();
    let error = scratch.dir().lock().unwrap_err();
    assert!(matches!(
        error.kind,
        LockErrorKind::Refused(Refusal::Symlink)
    ));
    assert_eq!(error.path, scratch.in_state("genv.lock"));

    mkfifo(&scratch.in_state("envs.json"));
    let error = scratch.dir().load_envs().unwrap_err();
    let fifo = Refusal::NotRegular(FileKind(FileType::Fifo));
    assert!(matches!(error.kind, StateErrorKind::ReadRefused(ref r) if *r == fifo));
    assert_eq!(error.path, scratch.in_state("envs.json"));

    fs::remove_file(scratch.in_state("envs.json")).unwrap();
    let eid = scratch.live_env();
    let other = scratch.target("other.json", &devices_text(&eid), 0o644);
    fs::hard_link(&other, scratch.in_state("devices.json")).unwrap();
    let error = scratch.dir().detach(&eid, 0).unwrap_err();
    assert!(matches!(
        error.kind,
        StateErrorKind::WriteRefused(Refusal::HardLinked(2))
    ));

    fs::remove_file(scratch.in_state("devices.json")).unwrap();
    let big = fs::File::create(scratch.in_state("devices.json")).unwrap();
    big.set_len(MAX_STATE_FILE + 1).unwrap();
    let error = scratch.dir().load_devices(&[]).unwrap_err();
    assert!(matches!(
        error.kind,
        StateErrorKind::ReadRefused(Refusal::TooLarge {
            cap: MAX_STATE_FILE
        })
    ));
}
