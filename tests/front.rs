//! The `genv` front (`deploy/genv`) as root runs it: `sudo genv enforce` must run the
//! genv-enforcer the admin installed, and nothing an ordinary user could have put in
//! its place (the second audit's local-root hole).
//!
//! Each test plants a program that leaves a mark when it runs, where a user could have
//! put it, and runs the installed front as root: the mark must never appear.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use genv_enforcer_tests::{artefact, unique};

const NOBODY: u32 = 65534;

/// A scratch directory of root's, mode 0755, under the system's temporary directory.
fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "genv-front-test-{}-{}",
        std::process::id(),
        unique()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `cargo xtask install` of the test build into `root`, the front naming `enforcer_path`
/// (or the default, the node's own path).
fn install(root: &Path, enforcer_path: Option<&Path>) {
    let mut xtask = genv_enforcer_tests::xtask();
    xtask
        .arg("install")
        .arg("--root")
        .arg(root)
        .arg("--binary")
        .arg(artefact("genv-enforcer"));
    if let Some(path) = enforcer_path {
        xtask.arg("--enforcer-path").arg(path);
    }
    assert!(xtask.status().unwrap().success(), "{xtask:?} failed");
}

fn front(root: &Path) -> PathBuf {
    root.join("usr/local/lib/genv-enforcer/front/genv")
}

/// A program that leaves `mark` when it runs.
fn plant(path: &Path, mark: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(
        path,
        format!("#!/bin/sh\ntouch '{}'\necho planted\n", mark.display()),
    )
    .unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn chown(path: &Path, uid: u32) {
    rustix::fs::chown(
        path,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(uid)),
    )
    .unwrap();
}

/// `genv enforce --help` through the front, as root, with `path` as PATH and the given
/// environment.
fn run_as_root(front: &Path, path: &str, env: &[(&str, &Path)]) -> Output {
    let mut command = Command::new(front);
    command.args(["enforce", "--help"]).env("PATH", path);
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().unwrap()
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A package staged under a directory any user could create, then copied to a node
/// (here: the staging directory removed, and made again by uid 65534 with its own
/// `genv-enforcer` in it). Root's front must run the node's path, not the stage's.
#[test]
fn a_staged_install_names_the_nodes_path_and_never_the_staging_root() {
    let dir = scratch();
    let world = dir.join("world");
    std::fs::create_dir(&world).unwrap();
    std::fs::set_permissions(&world, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let stage = world.join("stage");
    install(&stage, None);
    let node = dir.join("node");
    std::fs::create_dir(&node).unwrap();
    let front_copy = node.join("genv");
    std::fs::copy(front(&stage), &front_copy).unwrap();
    let text_of_front = std::fs::read_to_string(&front_copy).unwrap();
    assert!(
        text_of_front.contains("installed_enforcer='/usr/local/bin/genv-enforcer'\n"),
        "the front names the node's path"
    );
    assert!(
        !text_of_front.contains(stage.to_str().unwrap()),
        "the front names the staging root"
    );

    // The stage goes; a user makes it again with a program of theirs.
    std::fs::remove_dir_all(&stage).unwrap();
    let mark = dir.join("ran-as-root");
    let status = Command::new("setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "sh",
        ])
        .arg("-c")
        .arg(format!(
            "mkdir -p '{0}/usr/local/bin' && printf '#!/bin/sh\\ntouch {1}\\n' > \
             '{0}/usr/local/bin/genv-enforcer' && chmod 755 '{0}/usr/local/bin/genv-enforcer'",
            stage.display(),
            mark.display()
        ))
        .status()
        .unwrap();
    assert!(status.success());
    let output = run_as_root(&front_copy, "/usr/bin:/bin", &[]);
    assert!(
        !mark.exists(),
        "root's front ran the user's program: {}",
        text(&output)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The front's target, with every way another user could have replaced it: owned by
/// them, in a directory others can write, under a directory of theirs. Each is refused
/// with the path and the reason; the admin's own, under a sticky /tmp-like directory,
/// runs.
#[test]
fn the_front_runs_no_enforcer_another_user_could_replace() {
    let dir = scratch();
    let mark = dir.join("ran-as-root");
    let sticky = dir.join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();

    let owned_by_nobody = dir.join("a/genv-enforcer");
    plant(&owned_by_nobody, &mark);
    chown(&owned_by_nobody, NOBODY);
    let in_a_writable_dir = dir.join("b/genv-enforcer");
    plant(&in_a_writable_dir, &mark);
    std::fs::set_permissions(
        in_a_writable_dir.parent().unwrap(),
        std::fs::Permissions::from_mode(0o777),
    )
    .unwrap();
    let under_nobodys_dir = dir.join("c/bin/genv-enforcer");
    plant(&under_nobodys_dir, &mark);
    chown(&dir.join("c"), NOBODY);
    let directly_in_sticky = sticky.join("genv-enforcer");
    plant(&directly_in_sticky, &mark);
    let writable_file = dir.join("d/genv-enforcer");
    plant(&writable_file, &mark);
    std::fs::set_permissions(&writable_file, std::fs::Permissions::from_mode(0o757)).unwrap();

    let cases = [
        (
            &owned_by_nobody,
            owned_by_nobody.clone(),
            "owned by uid 65534",
        ),
        (
            &in_a_writable_dir,
            in_a_writable_dir.parent().unwrap().to_owned(),
            "others can write there",
        ),
        (&under_nobodys_dir, dir.join("c"), "owned by uid 65534"),
        (
            &directly_in_sticky,
            sticky.clone(),
            "others can write there",
        ),
        (
            &writable_file,
            writable_file.clone(),
            "others can write there",
        ),
    ];
    for (target, culprit, why) in cases {
        let root = dir.join(format!("root-{}", unique()));
        install(&root, Some(target));
        let output = run_as_root(&front(&root), "/usr/bin:/bin", &[]);
        assert!(
            !mark.exists(),
            "root's front ran {}: {}",
            target.display(),
            text(&output)
        );
        let said = text(&output);
        assert!(
            !output.status.success()
                && said.contains(&format!("{} ", culprit.display()))
                && said.contains(why),
            "{}: expected a refusal naming {} ({why}): {said}",
            target.display(),
            culprit.display()
        );
    }

    // The admin's own binary, in root's directories under the sticky one, runs.
    let root = sticky.join("root");
    install(
        &root,
        Some(&sticky.join("root/usr/local/bin/genv-enforcer")),
    );
    let output = run_as_root(&front(&root), "/usr/bin:/bin", &[]);
    assert!(
        output.status.success() && text(&output).contains("--event-driven"),
        "the installed enforcer's help: {}",
        text(&output)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A scratch directory with uid 1000's own `genv-enforcer` in `home/bin` (theirs, and
/// trusted for them, never for root), which leaves the mark when it runs: (scratch,
/// mark, bin).
fn a_users_own_enforcer() -> (PathBuf, PathBuf, PathBuf) {
    let dir = scratch();
    let mark = dir.join("ran-as-root");
    let user_bin = dir.join("home/bin");
    plant(&user_bin.join("genv-enforcer"), &mark);
    for path in [
        dir.join("home"),
        user_bin.clone(),
        user_bin.join("genv-enforcer"),
    ] {
        chown(&path, 1000);
    }
    (dir, mark, user_bin)
}

/// Root ignores `GENV_ENFORCER`. The front asks `id` who runs it: an `id` first on a
/// user's PATH (kept by su or a lax sudo) that says "1000" must not make root run that
/// user's program.
#[test]
fn root_is_told_apart_by_the_systems_id_not_one_on_path() {
    let (dir, mark, user_bin) = a_users_own_enforcer();
    std::fs::write(user_bin.join("id"), "#!/bin/sh\necho 1000\n").unwrap();
    std::fs::set_permissions(user_bin.join("id"), std::fs::Permissions::from_mode(0o755)).unwrap();
    chown(&user_bin.join("id"), 1000);
    let root = dir.join("root");
    install(&root, Some(&root.join("usr/local/bin/genv-enforcer")));
    let output = run_as_root(
        &front(&root),
        &format!("{}:/usr/bin:/bin", user_bin.display()),
        &[("GENV_ENFORCER", &user_bin.join("genv-enforcer"))],
    );
    assert!(
        !mark.exists(),
        "root's front ran the user's GENV_ENFORCER: {}",
        text(&output)
    );
    assert!(
        output.status.success() && text(&output).contains("--event-driven"),
        "the installed enforcer answers: {}",
        text(&output)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Where `/bin/sh` is bash, a user's environment kept by su or a lax sudo could define
/// `[` as a function (`BASH_FUNC_[%%`) that says root is not root. The front's `-p`
/// (its first line) makes bash import no functions: run here by bash itself, with the
/// front's own first-line flags.
#[test]
fn a_bash_as_sh_imports_no_function_from_a_users_environment() {
    let (dir, mark, user_bin) = a_users_own_enforcer();
    let root = dir.join("root");
    install(&root, Some(&root.join("usr/local/bin/genv-enforcer")));
    let source = std::fs::read_to_string(front(&root)).unwrap();
    let (shebang, body) = source.split_once('\n').unwrap();
    let flags = shebang
        .strip_prefix("#!/bin/sh")
        .expect("the front runs under /bin/sh");
    let as_bash = dir.join("front-under-bash");
    std::fs::write(&as_bash, format!("#!/bin/bash{flags}\n{body}")).unwrap();
    std::fs::set_permissions(&as_bash, std::fs::Permissions::from_mode(0o755)).unwrap();
    let output = Command::new(&as_bash)
        .args(["enforce", "--help"])
        .env("PATH", "/usr/bin:/bin")
        .env(
            "BASH_FUNC_[%%",
            "() { case \"$*\" in *\"= 0 ]\"*) return 1;; esac; builtin [ \"$@\"; }",
        )
        .env("GENV_ENFORCER", user_bin.join("genv-enforcer"))
        .output()
        .unwrap();
    assert!(
        !mark.exists(),
        "root's front ran the user's GENV_ENFORCER: {}",
        text(&output)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `genv why` is the enforcer's, for anyone: run by an ordinary user through the front,
/// it reaches the installed enforcer's `why`, which says that no daemon answers (none
/// runs here), naming the socket it asked.
#[test]
fn genv_why_reaches_the_enforcers_why_for_an_ordinary_user() {
    let dir = scratch();
    let root = dir.join("root");
    install(&root, Some(&root.join("usr/local/bin/genv-enforcer")));
    let run_dir = dir.join("run");
    let output = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(front(&root))
        .args(["why", "--me"])
        .env("PATH", "/usr/bin:/bin")
        .env("GENV_ENFORCER_RUN_DIR", &run_dir)
        .output()
        .unwrap();
    let said = text(&output);
    assert_eq!(output.status.code(), Some(3), "{said}");
    assert!(
        said.contains(&format!(
            "no genv-enforcer is answering at {}/why.sock",
            run_dir.display()
        )),
        "{said}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
