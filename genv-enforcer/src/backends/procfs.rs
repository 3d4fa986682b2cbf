//! What `/proc` tells about a process: whether it exists, who it is (start time, so a
//! reused pid is never mistaken for it), whether it is a kernel thread, its real uid, its
//! genv environment, and which NVIDIA GPU device nodes it holds open.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use rustix::process::{Pid, test_kill_process};

use super::address_space::{self, NoAnswer, SpaceFile};

/// The variable genv sets in every process of an environment.
pub const ENV_VAR: &str = "GENV_ENVIRONMENT_ID";

/// The kernel's `PF_KTHREAD` flag in `/proc/<pid>/stat`.
const PF_KTHREAD: u32 = 0x0020_0000;

/// As genv's `poll_pid`: `kill(pid, 0)` succeeds or fails with EPERM. Non-positive pids
/// never count (they would name process groups).
pub fn pid_exists(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    match Pid::from_raw(pid) {
        Some(pid) => match test_kill_process(pid) {
            Ok(()) => true,
            Err(e) => e == rustix::io::Errno::PERM,
        },
        None => false,
    }
}

/// The fields of `/proc/<pid>/stat` the enforcer relies on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub state: char,
    pub ppid: i32,
    pub flags: u32,
    /// Clock ticks since boot (10 ms): with the pid, it names one process, unless the
    /// pid is reused within the tick its first process started in (a wrap of the whole
    /// pid space in 10 ms, or root choosing the pid through `ns_last_pid`).
    pub start_time: u64,
    /// `startcode`, `endcode` and `startstack`: set anew by every `execve` (and, with
    /// ASLR, different on each), so a changed value means a new program image with a
    /// new environment block. Zero when the reader may not see them.
    pub exec_fingerprint: [u64; 3],
    /// The controlling terminal's device number as the kernel encodes it here
    /// (`new_encode_dev`); 0 for none.
    pub tty_nr: u32,
}

impl ProcStat {
    pub fn is_kernel_thread(&self) -> bool {
        self.flags & PF_KTHREAD != 0
    }

    pub fn is_zombie(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }

    /// The image of process `pid` this was read of, for a read of its address space.
    pub fn image_of(&self, pid: u32) -> address_space::Process {
        address_space::Process {
            pid,
            started: self.start_time,
            image: self.exec_fingerprint,
        }
    }
}

/// Whether process `pid` has a thread besides its leader: listed under
/// `/proc/<pid>/task` until it is released, at the very end of its exit (after its
/// descriptors are closed). A leader that called `pthread_exit` is a zombie while the
/// others run on. Stops at the first one found.
pub fn has_other_threads(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks
        .filter_map(Result::ok)
        .any(|task| task.file_name().to_str().and_then(|t| t.parse().ok()) != Some(pid))
}

/// Every pid in `/proc` now.
pub fn pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .collect()
}

/// `/proc/<pid>/stat`, read once.
pub fn stat(pid: u32) -> io::Result<ProcStat> {
    StatFile::open(pid)?.read()
}

/// An open `/proc/<pid>/stat`, re-read in place each cycle. The descriptor is bound to
/// the process it was opened for, not to the number: once that process is gone it
/// reads ESRCH even if the pid has been reused, and across `execve` it keeps reading the
/// same process (whose exec fingerprint then changes).
#[derive(Debug)]
pub struct StatFile {
    file: std::fs::File,
    pid: u32,
}

impl StatFile {
    pub fn open(pid: u32) -> io::Result<Self> {
        Ok(Self {
            file: std::fs::File::open(format!("/proc/{pid}/stat"))?,
            pid,
        })
    }

    /// One `pread` at offset 0: no size-hint `statx`, no reopening.
    pub fn read(&self) -> io::Result<ProcStat> {
        use std::os::unix::fs::FileExt;
        let mut buffer = [0u8; 1024];
        let n = self.file.read_at(&mut buffer, 0)?;
        std::str::from_utf8(&buffer[..n])
            .ok()
            .filter(|_| n > 0 && n < buffer.len())
            .and_then(parse_stat)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("/proc/{}/stat: unexpected format", self.pid),
                )
            })
    }
}

/// Reads a whole `/proc` file without the size-hint `statx` that `std::fs::read` makes
/// (procfs files report size 0 anyway).
fn read_all(path: &str) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut bytes = vec![0u8; 4096];
    let mut len = 0;
    loop {
        if len == bytes.len() {
            bytes.resize(bytes.len() * 2, 0);
        }
        let n = file.read(&mut bytes[len..])?;
        if n == 0 {
            bytes.truncate(len);
            return Ok(bytes);
        }
        len += n;
    }
}

/// `comm` may hold spaces and parentheses, so fields are counted after the last `)`.
fn parse_stat(text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    // After comm: state(3) ppid(4) ... tty_nr(7) ... flags(9) ... starttime(22) ... startcode(26)
    // endcode(27) startstack(28), numbered as in proc(5).
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        flags: field(9)? as u32,
        start_time: field(22)?,
        exec_fingerprint: [
            field(26).unwrap_or(0),
            field(27).unwrap_or(0),
            field(28).unwrap_or(0),
        ],
        // Printed as a signed int: kept as the same 32 bits.
        tty_nr: fields
            .get(4)
            .and_then(|n| n.parse::<i32>().ok())
            .map_or(0, |n| n as u32),
    })
}

/// The real uid, from the `Uid:` line of `/proc/<pid>/status`.
pub fn real_uid(pid: u32) -> io::Result<u32> {
    let status = read_all(&format!("/proc/{pid}/status"))?;
    String::from_utf8_lossy(&status)
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().next())
        .and_then(|uid| uid.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("/proc/{pid}/status: no Uid line"),
            )
        })
}

/// Why a process's environment could not be read.
#[derive(Debug, thiserror::Error)]
pub enum EnvironError {
    #[error("process {0} is gone")]
    Gone(u32),
    #[error("not enough permissions to read /proc/{0}/environ")]
    Unreadable(u32),
    #[error("cannot read /proc/{0}/environ: {1}")]
    Other(u32, #[source] io::Error),
    /// Its reader waited past its deadline (see [`address_space`]).
    #[error("cannot read /proc/{0}/environ: {1}")]
    NoAnswer(u32, NoAnswer),
}

impl EnvironError {
    /// Whether the process's own owner keeps its block from being read (its address
    /// space is held), as opposed to the daemon having no reader free.
    pub fn held_by_owner(&self) -> bool {
        matches!(self, Self::NoAnswer(_, NoAnswer::Held))
    }
}

/// The value of `GENV_ENVIRONMENT_ID` in the process's initial environment, read as genv
/// reads it (the last assignment wins).
/// The inode of the initial pid namespace (`PROC_PID_INIT_INO`, a constant of the
/// kernel's ABI since namespaces got inodes).
const INITIAL_PID_NAMESPACE: &str = "pid:[4026531836]";

/// This process's pid namespace (`/proc/self/ns/pid`) when it is not the initial one,
/// whatever `/proc` is mounted (a remounted `/proc` shows only the inner pids);
/// `None` in the initial one, or where it cannot be told.
pub fn nested_pid_namespace() -> Option<String> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let link = link.to_string_lossy();
    (link != INITIAL_PID_NAMESPACE).then(|| link.into_owned())
}

pub fn environment_id(pid: u32) -> Result<Option<String>, EnvironError> {
    environment_var(pid, ENV_VAR)
}

/// A variable of the process's initial environment as `getenv` reads it (the first
/// assignment wins), where Python's `os.environ` (genv's reading) takes the last.
pub fn first_environment_var(pid: u32, name: &str) -> Result<Option<String>, EnvironError> {
    first_environment_vars(pid, [name]).map(|[value]| value)
}

/// Several variables of the process's initial environment, read at once, each as
/// [`first_environment_var`] reads it.
pub fn first_environment_vars<const N: usize>(
    pid: u32,
    names: [&str; N],
) -> Result<[Option<String>; N], EnvironError> {
    let bytes = environ(pid)?;
    Ok(names.map(|name| {
        bytes
            .split(|b| *b == 0)
            .filter_map(|entry| entry.strip_prefix(name.as_bytes())?.strip_prefix(b"="))
            .next()
            .map(|value| String::from_utf8_lossy(value).into_owned())
    }))
}

/// The process's environment block, read on a worker with a deadline: the read takes the
/// process's `mmap_lock`, which its owner can hold for ever (see [`address_space`]).
fn environ(pid: u32) -> Result<Vec<u8>, EnvironError> {
    let stat = stat(pid).map_err(|_| EnvironError::Gone(pid))?;
    let path = format!("/proc/{pid}/environ");
    let process = stat.image_of(pid);
    let read = address_space::read(process, SpaceFile::Environ, move || read_all(&path))
        .map_err(|e| EnvironError::NoAnswer(pid, e))?;
    read.map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => EnvironError::Gone(pid),
        io::ErrorKind::PermissionDenied => EnvironError::Unreadable(pid),
        _ if e.raw_os_error() == Some(libc::ESRCH) => EnvironError::Gone(pid),
        _ => EnvironError::Other(pid, e),
    })
}

/// A variable of the process's initial environment (the last assignment wins).
pub fn environment_var(pid: u32, name: &str) -> Result<Option<String>, EnvironError> {
    Ok(find_var(&environ(pid)?, name))
}

fn find_var(environ: &[u8], name: &str) -> Option<String> {
    environ
        .split(|b| *b == 0)
        .filter_map(|entry| entry.strip_prefix(name.as_bytes())?.strip_prefix(b"="))
        .next_back()
        .map(|value| String::from_utf8_lossy(value).into_owned())
}

/// Every process holding a GPU node open, with the GPU indices it holds, in pid order.
/// Nodes are recognised by `st_rdev` through `index_of` (the device map), never by
/// path, so renamed nodes, links and private `mknod` copies count too.
pub fn gpu_node_holders(
    proc_root: &Path,
    index_of: &dyn Fn(u32, u32) -> Option<u32>,
) -> io::Result<Vec<(u32, Vec<u32>)>> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir(proc_root)? {
        if let Some(pid) = entry?.file_name().to_str().and_then(|n| n.parse().ok()) {
            pids.push(pid);
        }
    }
    Ok(gpu_node_holders_among(proc_root, &pids, index_of))
}

/// [`gpu_node_holders`] among `pids` only: a check of the processes that just opened a
/// GPU node reads their descriptors, not every process's (the whole sweep was most of
/// the reaction's time on a node without NVML).
pub fn gpu_node_holders_among(
    proc_root: &Path,
    pids: &[u32],
    index_of: &dyn Fn(u32, u32) -> Option<u32>,
) -> Vec<(u32, Vec<u32>)> {
    let mut holders = Vec::new();
    for &pid in pids {
        let Ok(fds) = std::fs::read_dir(proc_root.join(pid.to_string()).join("fd")) else {
            continue; // gone, or not ours to read
        };
        let mut indices: Vec<u32> = fds
            .filter_map(|fd| std::fs::metadata(fd.ok()?.path()).ok())
            .filter(|meta| meta.file_type().is_char_device())
            .filter_map(|meta| {
                let rdev = std::os::unix::fs::MetadataExt::rdev(&meta);
                index_of(libc::major(rdev), libc::minor(rdev))
            })
            .collect();
        if !indices.is_empty() {
            indices.sort_unstable();
            indices.dedup();
            holders.push((pid, indices));
        }
    }
    holders.sort_unstable_by_key(|(pid, _)| *pid);
    holders
}

/// GPU minors in NVML index order (PCI bus order), from the driver's
/// `/proc/driver/nvidia/gpus/<bus id>/information`. `None` without the driver.
pub fn driver_minors_in_pci_order() -> Option<Vec<u32>> {
    let mut gpus: Vec<(String, u32)> = std::fs::read_dir("/proc/driver/nvidia/gpus")
        .ok()?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let info = std::fs::read_to_string(entry.path().join("information")).ok()?;
            let minor = info
                .lines()
                .find_map(|l| l.strip_prefix("Device Minor:"))?
                .trim()
                .parse()
                .ok()?;
            Some((entry.file_name().to_string_lossy().to_lowercase(), minor))
        })
        .collect();
    gpus.sort();
    Some(gpus.into_iter().map(|(_, minor)| minor).collect())
}

/// `pid` and its ancestors up to PID 1: processes the enforcer must never signal.
pub fn self_and_ancestors(pid: u32) -> Vec<u32> {
    let mut chain = vec![pid];
    let mut current = pid;
    while let Ok(stat) = stat(current) {
        if stat.ppid <= 0 || chain.contains(&(stat.ppid as u32)) {
            break;
        }
        current = stat.ppid as u32;
        chain.push(current);
    }
    chain
}

/// A process (python3) whose leader called `pthread_exit` while another thread sleeps
/// on, once its leader reads as a zombie.
#[cfg(test)]
pub(crate) fn leader_exited_first() -> std::process::Child {
    let script = "import ctypes, threading, time\n\
                  threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n\
                  print('ready', flush=True)\n\
                  ctypes.CDLL(None).pthread_exit(None)\n";
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert_eq!(ready.trim(), "ready");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !stat(child.id()).unwrap().is_zombie() {
        assert!(
            std::time::Instant::now() < deadline,
            "the leader never exited"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_a_hostile_comm() {
        let line = "4242 (a) b (c) S 17 4242 4242 34817 -1 4194560 99 0 0 0 0 0 0 0 20 0 1 0 123456 1000 100";
        let stat = parse_stat(line).unwrap();
        assert_eq!(
            (stat.state, stat.ppid, stat.flags, stat.start_time),
            ('S', 17, 4194560, 123456)
        );
        assert_eq!(stat.tty_nr, 34817, "/dev/pts/1");
        assert!(!stat.is_kernel_thread());
    }

    #[test]
    fn finds_the_last_assignment_like_genv() {
        let environ =
            b"A=1\0GENV_ENVIRONMENT_ID=x\0GENV_ENVIRONMENT_IDX=no\0GENV_ENVIRONMENT_ID=y=z\0";
        assert_eq!(find_var(environ, ENV_VAR).as_deref(), Some("y=z"));
        assert_eq!(find_var(b"A=1\0", ENV_VAR), None);
    }

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        let stat = stat(me).unwrap();
        assert!(!stat.is_kernel_thread() && !stat.is_zombie());
        assert!(pid_exists(me as i32));
        assert!(!pid_exists(0) && !pid_exists(-1));
        assert_eq!(real_uid(me).unwrap(), rustix::process::getuid().as_raw());
        assert!(self_and_ancestors(me).len() >= 2);
    }

    /// A process whose leader called `pthread_exit` while another thread runs on: the
    /// leader reads as a zombie, the process is not gone.
    #[test]
    fn a_leader_that_exited_first_leaves_its_process_with_other_threads() {
        let mut child = leader_exited_first();
        assert!(
            has_other_threads(child.id()),
            "its sleeping thread is not seen"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!has_other_threads(child.id()) && !has_other_threads(me_never()));
    }

    /// A pid no process has (beyond the kernel's `pid_max` limit).
    fn me_never() -> u32 {
        (1 << 22) + 1
    }
}
