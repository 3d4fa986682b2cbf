//! Helpers for the event-driven suites.
//!
//! Which device number stands for GPU 0 depends on the tier under test
//! ([`test_nodes`]):
//! - the tracepoint tier sees only opens that succeed, and no NVIDIA node opens without
//!   the driver, so the daemon is told (`--gpu-node 1:7=0`) that `/dev/full`'s number is
//!   GPU 0;
//! - the LSM, fmod_ret and fentry tiers see the attempt before the driver is asked, so
//!   there the node is NVIDIA's own `195:0`, whose opens fail with ENXIO where no driver is loaded
//!   (as in the VM harness, where no driver owns major 195 either).
//!
//! Tests open private nodes with that number (made with `mknod`).
//!
//! `GENV_REQUIRE_BPF=1` (set by CI) turns "the kernel programs could not be loaded" from a
//! skip into a failure. `GENV_TEST_BPF_TIER` picks the tier (default `auto`: the best
//! the kernel accepts).

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::{Daemon, Node, PATIENCE, wait_for_or};

/// The device numbers tests use as GPUs 0 and 1 on the requested tier: NVIDIA's own
/// where the hook runs before the driver (LSM, fmod_ret, fentry); where only a
/// successful open is seen (tracepoint, and `auto`, which may end up there), two real
/// devices nothing else on a test machine opens: `/dev/full` and `/dev/btrfs-control`.
pub fn test_nodes() -> [(u32, u32); 2] {
    match requested_tier().as_str() {
        "lsm" | "fmod_ret" | "fentry" => [(195, 0), (195, 1)],
        _ => [(1, 7), (10, 234)],
    }
}

/// `--gpu-node` values mapping [`test_nodes`] to GPUs 0 and 1.
pub fn test_node_flags() -> [String; 2] {
    let [(a, b), (c, d)] = test_nodes();
    [format!("{a}:{b}=0"), format!("{c}:{d}=1")]
}

/// Whether the requested tier sees open attempts that fail (LSM, fmod_ret and fentry
/// run before the driver's open; the tracepoint tier reads the descriptor the syscall
/// returned).
pub fn tier_sees_failed_opens() -> bool {
    matches!(requested_tier().as_str(), "lsm" | "fmod_ret" | "fentry")
}

/// Whether `tier` (as the daemon names it) refuses an open under `--deny` (EPERM, the
/// process lives on); the other tiers kill the opener inside the syscall.
pub fn tier_refuses(tier: &str) -> bool {
    matches!(tier, "lsm" | "fmod_ret")
}

/// Makes a character node with GPU 0's test number at `path`.
pub fn make_gpu_node(path: &Path) -> PathBuf {
    make_gpu_node_for(path, 0)
}

/// Makes a character node with GPU `gpu`'s test number (0 or 1) at `path`.
pub fn make_gpu_node_for(path: &Path, gpu: usize) -> PathBuf {
    crate::harness::mknod_char(path, test_nodes()[gpu])
        .unwrap_or_else(|e| panic!("mknod {}: {e}", path.display()));
    path.to_owned()
}

/// Nine ways in to GPU node `gpu` (in `dir`), as gpu-process arguments: a symlink, a
/// hard link, a private `mknod` in a 0700 directory, a `/proc/self/fd` re-open,
/// `openat(dirfd)`, `open(2)`, `openat2(2)`, a second thread and a 32-bit `int 0x80`
/// open. Makes what they need;
/// the private directory belongs to `owner` (the uid that will open), else to root.
pub fn ways_in(dir: &Path, gpu: &Path, owner: Option<u32>) -> Vec<(&'static str, Vec<String>)> {
    let symlink = dir.join("symlink");
    std::os::unix::fs::symlink(gpu, &symlink).unwrap();
    let hard_link = dir.join("hard-link");
    std::fs::hard_link(gpu, &hard_link).unwrap();
    let private = dir.join("private");
    std::fs::create_dir(&private).unwrap();
    let private_node = make_gpu_node(&private.join("my-gpu"));
    std::fs::set_permissions(
        &private,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    if let Some(uid) = owner {
        std::os::unix::fs::chown(&private, Some(uid), None).unwrap();
    }
    let name = gpu.file_name().unwrap().to_str().unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let args = |list: &[&str]| list.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>();
    vec![
        ("symlink", args(&["--open", &s(&symlink)])),
        ("hard link", args(&["--open", &s(&hard_link)])),
        ("private mknod", args(&["--open", &s(&private_node)])),
        ("/proc/self/fd re-open", args(&["--reopen", &s(gpu)])),
        ("openat(dirfd)", args(&["--open-at", &s(dir), name])),
        ("open(2)", args(&["--open-syscall", &s(gpu)])),
        ("openat2(2)", args(&["--open2", &s(gpu)])),
        ("a second thread", args(&["--open-in-thread", &s(gpu)])),
        // The tracepoint tier reads the two kinds of descriptor table differently.
        (
            "a table never grown",
            args(&["--fresh-table", "--open", &s(gpu)]),
        ),
        ("a grown table", args(&["--grown-table", "--open", &s(gpu)])),
        ("a 32-bit open (int 0x80)", args(&["--open-int80", &s(gpu)])),
    ]
}

/// Every process holding a descriptor of a character device with `gpu`'s number, through
/// any path to it (a link, a private `mknod`), found in `/proc`; with the
/// `GENV_ENVIRONMENT_ID` and real uid each runs with. `O_PATH` descriptors, which cannot
/// reach the driver, do not count; processes that exit while being read are left out.
pub fn holders_of(gpu: &Path) -> Vec<Holder> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    const O_PATH: u32 = 0o10000000;
    let rdev = std::fs::metadata(gpu).unwrap().rdev();
    let usable = |pid: u32, fd: &std::ffi::OsStr| {
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.display()));
        let flags = info.ok().and_then(|info| {
            let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?;
            u32::from_str_radix(flags.trim(), 8).ok()
        });
        flags.is_some_and(|flags| flags & O_PATH == 0)
    };
    let holds = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
            fds.filter_map(Result::ok).any(|fd| {
                std::fs::metadata(fd.path())
                    .is_ok_and(|m| m.rdev() == rdev && m.file_type().is_char_device())
                    && usable(pid, &fd.file_name())
            })
        })
    };
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| holds(pid))
        .filter_map(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let uid = status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            let eid = environ
                .split(|&b| b == 0)
                .filter_map(|entry| entry.strip_prefix(b"GENV_ENVIRONMENT_ID="))
                .next_back()
                .map(|value| String::from_utf8_lossy(value).into_owned());
            Some(Holder { pid, eid, uid })
        })
        .collect()
}

/// A process holding a GPU node open ([`holders_of`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    /// Its `GENV_ENVIRONMENT_ID` (the last assignment), if any.
    pub eid: Option<String>,
    pub uid: u32,
}

pub fn bpf_required() -> bool {
    std::env::var("GENV_REQUIRE_BPF").is_ok_and(|v| v == "1")
}

pub fn requested_tier() -> String {
    std::env::var("GENV_TEST_BPF_TIER").unwrap_or_else(|_| "auto".into())
}

/// Says which tier the running test is on, straight to stderr: libtest captures
/// `eprintln!` of passing tests, and a run must show every test's tier.
fn announce_tier(tier: &str) {
    use std::io::Write;
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let _ = writeln!(std::io::stderr(), "[{tier} tier] {test}");
}

/// An event-driven daemon, started and past its first full cycle.
pub struct EventDaemon {
    pub daemon: Daemon,
    /// The tier it runs on.
    pub tier: String,
    pub run_dir: PathBuf,
    /// Every line the daemon printed so far.
    seen: RefCell<Vec<String>>,
}

impl EventDaemon {
    /// Starts `genv-enforcer enforce --event-driven` on `node` with the test GPU node
    /// mapped, a full cycle only every hour (so that whatever happens within a test was
    /// caused by an event), and `args`. `None` (after saying why) when the kernel
    /// programs cannot be loaded here and BPF is not required.
    pub fn start(node: &Node, args: &[&str]) -> Option<Self> {
        let run_dir = node.dir.join("run");
        let tier = requested_tier();
        let [gpu0, gpu1] = test_node_flags();
        let mut all = vec![
            "--event-driven",
            "--verbose",
            "--bpf-tier",
            &tier,
            "--gpu-node",
            &gpu0,
            "--gpu-node",
            &gpu1,
            "--interval",
            "3600",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        let daemon = Daemon::start(node, &all);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        let mut running_on = None;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let Ok(line) = daemon.output.recv_timeout(left) else {
                break;
            };
            if let Some(rest) = line.split("Event-driven on the ").nth(1) {
                running_on = rest.split(' ').next().map(str::to_owned);
            }
            let failed = line.contains("No BPF tier could be loaded");
            let ready = line.contains("Watching GPU nodes");
            seen.push(line);
            if failed {
                break;
            }
            if ready {
                let tier = running_on.expect("the tier line comes first");
                let asked = requested_tier();
                assert!(
                    asked == "auto" || asked == tier,
                    "asked for the {asked} tier, the daemon runs on {tier}"
                );
                announce_tier(&tier);
                return Some(Self {
                    daemon,
                    tier,
                    run_dir,
                    seen: RefCell::new(seen),
                });
            }
        }
        let why = format!("the event-driven daemon did not start its kernel programs: {seen:#?}");
        if bpf_required() {
            panic!("GENV_REQUIRE_BPF=1 and {why}");
        }
        eprintln!("skipped (GENV_REQUIRE_BPF is not set): {why}");
        None
    }

    /// The first line containing `needle`, among those printed so far or within 30 s.
    /// genv's lines go to stdout and the daemon's own to stderr, two pipes whose
    /// relative order is lost, so lines are matched in any order.
    /// Each line is looked at once: a daemon that printed 30,000 decision lines (the
    /// attempt loop) is searched in one pass, where a scan of every line at each new one
    /// ran past the patience under TCG.
    pub fn expect(&self, needle: &str) -> String {
        if let Some(line) = self.seen.borrow().iter().find(|l| l.contains(needle)) {
            return line.clone();
        }
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.checked_duration_since(Instant::now());
            let Some(line) = left.and_then(|left| self.daemon.output.recv_timeout(left).ok())
            else {
                let seen = self.seen.borrow();
                let last = &seen[seen.len().saturating_sub(40)..];
                panic!(
                    "waited {PATIENCE:?} for a line containing {needle:?}; saw {} lines, the \
                     last {}: {last:#?}",
                    seen.len(),
                    last.len()
                );
            };
            let found = line.contains(needle);
            self.seen.borrow_mut().push(line.clone());
            if found {
                return line;
            }
        }
    }

    /// Waits until `count` lines containing `needle` were printed (within 30 s).
    pub fn expect_count(&self, needle: &str, count: usize) {
        let seen = || self.lines().iter().filter(|l| l.contains(needle)).count();
        wait_for_or(
            format_args!("{count} lines containing {needle:?}"),
            PATIENCE,
            || (seen() >= count).then_some(()),
            || format!("{} lines", seen()),
        );
    }

    /// Every line the daemon printed so far.
    pub fn lines(&self) -> Vec<String> {
        let mut seen = self.seen.borrow_mut();
        seen.extend(self.daemon.output.try_iter());
        seen.clone()
    }

    /// Waits (generously) until the status file's counter `name` is above 0; the daemon
    /// rewrites the file about once a second.
    pub fn wait_count(&self, name: &str) -> u64 {
        self.wait_count_above(name, 0)
    }

    /// Waits (generously) until the status file's counter `name` is above `floor`: a
    /// marker that the daemon did that much more work since the caller read `floor`.
    pub fn wait_count_above(&self, name: &str, floor: u64) -> u64 {
        self.wait_status(&format!("counter {name} above {floor}"), |status| {
            let count = status["counts"][name].as_u64().unwrap();
            (count > floor).then_some(count)
        })
    }

    /// Waits (generously) until the status file's counter `name` is `count` or more
    /// (the daemon handled that many events of a kind, ran that many checks or
    /// cycles); returns that status, whose other counts include what that work did.
    pub fn wait_count_at_least(&self, name: &str, count: u64) -> Value {
        self.wait_status(&format!("counter {name} at {count}"), |status| {
            (status["counts"][name].as_u64().unwrap() >= count).then(|| status.clone())
        })
    }

    /// The status file's counter `name` now.
    pub fn count(&self, name: &str) -> u64 {
        self.status()["counts"][name].as_u64().unwrap()
    }

    /// The barrier on the daemon's work: waits until the daemon publishes its status
    /// after `after` (its `updated`, whole seconds, past `after`), and returns that
    /// status. Its loop is one thread, and it publishes after handling what it read and
    /// running the checks then due: every event whose line was printed before `after`,
    /// and every check, cycle or kill it called for, is in the counts returned (and a
    /// count above them is work begun after `after`). An idle daemon publishes only
    /// every heartbeat (10 s); one that counted anything, within a second.
    pub fn published_after(&self, after: SystemTime) -> Value {
        let after = after.duration_since(UNIX_EPOCH).unwrap().as_secs();
        self.wait_status(&format!("a status published after {after}"), |status| {
            (status["updated"].as_u64().unwrap() > after).then(|| status.clone())
        })
    }

    /// [`Self::published_after`] now: the daemon's counts once it handled everything it
    /// printed so far.
    pub fn barrier(&self) -> Value {
        self.published_after(SystemTime::now())
    }

    /// Waits (generously) until `check` finds what it wants in the status file.
    pub fn wait_status<T>(&self, what: &str, check: impl Fn(&Value) -> Option<T>) -> T {
        self.wait_status_for(what, PATIENCE, check)
    }

    /// [`Self::wait_status`] within `timeout`.
    pub fn wait_status_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&Value) -> Option<T>,
    ) -> T {
        wait_for_or(
            what,
            timeout,
            || check(&self.status()),
            || self.status()["counts"].to_string(),
        )
    }

    /// The daemon's status file.
    pub fn status(&self) -> Value {
        let text = std::fs::read_to_string(self.run_dir.join("status.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }
}

/// Whether a BPF program with this id is loaded (`BPF_PROG_GET_FD_BY_ID`), the check
/// `bpftool prog show id N` makes.
pub fn program_loaded(id: u32) -> bool {
    const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
    // union bpf_attr for this command: { u32 prog_id; u32 next_id; u32 open_flags; }
    let attr: [u32; 3] = [id, 0, 0];
    // SAFETY: `attr` is a live, initialised `bpf_attr` prefix of the size passed; the
    // kernel only reads it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_GET_FD_BY_ID,
            attr.as_ptr(),
            size_of_val(&attr),
        )
    };
    if fd >= 0 {
        // SAFETY: closes the descriptor the syscall just returned, which nothing else
        // owns.
        unsafe { libc::close(fd as i32) };
        return true;
    }
    let errno = std::io::Error::last_os_error();
    assert_eq!(
        errno.raw_os_error(),
        Some(libc::ENOENT),
        "BPF_PROG_GET_FD_BY_ID {id}: {errno}"
    );
    false
}

/// A pinned map (`BPF_OBJ_GET`), as `bpftool map ... pinned` opens one.
fn open_pinned(pin: &Path) -> std::os::fd::OwnedFd {
    const BPF_OBJ_GET: libc::c_long = 7;
    let path = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes()).unwrap();
    // union bpf_attr for BPF_OBJ_GET: { u64 pathname; u32 bpf_fd; u32 file_flags; }
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let attr = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    // SAFETY: `attr` is a live, initialised `bpf_attr` prefix of the size passed; the
    // kernel only reads it.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, &attr, size_of_val(&attr)) };
    assert!(
        fd >= 0,
        "BPF_OBJ_GET {}: {}",
        pin.display(),
        std::io::Error::last_os_error()
    );
    // SAFETY: a descriptor the kernel just returned.
    unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) }
}

/// The id of the program the link pinned at `pin` runs (`BPF_OBJ_GET_INFO_BY_FD`).
pub fn pinned_link_program(pin: &Path) -> u32 {
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    let link = open_pinned(pin);
    // struct bpf_link_info begins { u32 type; u32 id; u32 prog_id; ... }; the kernel
    // fills no more than the length given.
    let mut info = [0u32; 3];
    // union bpf_attr for this command: { u32 bpf_fd; u32 info_len; u64 info; }
    #[repr(C)]
    struct InfoByFd {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let attr = InfoByFd {
        bpf_fd: std::os::fd::AsRawFd::as_raw_fd(&link) as u32,
        info_len: size_of_val(&info) as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: `attr` is a live, initialised `bpf_attr` prefix of the size passed; the
    // kernel writes at most `info_len` bytes into `info`, which lives across the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &attr,
            size_of_val(&attr),
        )
    };
    assert_eq!(
        ret,
        0,
        "BPF_OBJ_GET_INFO_BY_FD {}: {}",
        pin.display(),
        std::io::Error::last_os_error()
    );
    info[2]
}

/// `union bpf_attr` for the map element commands.
#[repr(C)]
struct MapElem {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// The `u64` value of `key` (a `u32`) in the pinned hash map at `pin`, if it is there.
pub fn pinned_map_get(pin: &Path, key: u32) -> Option<u64> {
    const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
    let map = open_pinned(pin);
    let mut value = 0u64;
    let attr = MapElem {
        map_fd: std::os::fd::AsRawFd::as_raw_fd(&map) as u32,
        _pad: 0,
        key: &key as *const u32 as u64,
        value: &mut value as *mut u64 as u64,
        flags: 0,
    };
    // SAFETY: `attr` is a live, initialised `bpf_attr` prefix of the size passed; the
    // kernel writes only the value it points at, which lives across the call.
    let found = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_LOOKUP_ELEM,
            &attr,
            size_of_val(&attr),
        )
    } == 0;
    let errno = std::io::Error::last_os_error();
    assert!(
        found || errno.raw_os_error() == Some(libc::ENOENT),
        "lookup: {errno}"
    );
    found.then_some(value)
}

/// Sets `key` to `value` in the pinned hash map at `pin` (`u32` keys, `u64` values).
pub fn pinned_map_put(pin: &Path, key: u32, value: u64) {
    const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
    let map = open_pinned(pin);
    let attr = MapElem {
        map_fd: std::os::fd::AsRawFd::as_raw_fd(&map) as u32,
        _pad: 0,
        key: &key as *const u32 as u64,
        value: &value as *const u64 as u64,
        flags: 0,
    };
    // SAFETY: `attr` is a live, initialised `bpf_attr` prefix of the size passed; the
    // kernel only reads it.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_UPDATE_ELEM,
            &attr,
            size_of_val(&attr),
        )
    };
    assert_eq!(rc, 0, "update: {}", std::io::Error::last_os_error());
}
