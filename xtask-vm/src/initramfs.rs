//! The guest's initramfs: busybox (static), the modules init needs, and `/init`.
//!
//! `/init` makes the guest look like the host: the host's root filesystem read-only over
//! virtio-9p with a tmpfs overlay on top for writes, the project's work tree read-write
//! at the same path, fresh `/proc`, `/sys`, `/dev`, `/tmp`, `/run` and bpffs. It then runs
//! the guest script there (chrooted), prints its exit status and powers off. The host's
//! binaries, test executables, Python and genv venv run unchanged.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

/// What `/init` needs to know.
pub struct Init<'a> {
    /// Module file names under `/modules`, in load order.
    pub modules: Vec<String>,
    /// The work tree's path on the host, and so in the guest.
    pub work_tree: &'a Path,
    /// What runs once the new root is ready.
    pub then: Then<'a>,
    /// Cargo's target directory, shared read-only and cached at its own path, under a
    /// tmpfs that takes the guest's writes (see [`P9_CACHED`]): the test binaries and
    /// what they run are there. Mounted after the work tree (it is inside it by default)
    /// and the guest's `/tmp` and `/run` (it may be under them: `CARGO_TARGET_DIR`).
    pub target_dir: &'a Path,
}

/// What `/init` hands the guest to once its root is ready.
pub enum Then<'a> {
    /// The script (inside the work tree) that runs the tests, chrooted; `/init` prints
    /// its exit status ([`EXIT_MARKER`]) and powers off.
    Script(&'a Path),
    /// systemd as PID 1 (`switch_root`), starting `unit` instead of the default target,
    /// with `units` (file name, text) in `/etc/systemd/system` of the guest's overlay. The
    /// unit prints the status and powers off. The guest gets an empty `/etc/fstab` (the
    /// host's names its disks, which the guest has not) and a machine id (without one,
    /// systemd's first-boot units would prompt on the console).
    Systemd {
        unit: &'a str,
        units: &'a [(String, String)],
    },
}

/// The 9p tag of [`Init::target_dir`]'s share.
pub const TARGET_TAG: &str = "target";

/// 9p's mount options. msize: 9p's default 8 KiB makes every read of a test binary a
/// dozen round trips.
const P9: &str = "trans=virtio,version=9p2000.L,msize=262144";

/// How the read-only shares (the host's root, the target directory) are mounted: with
/// the guest's page and dentry caches (`cache=loose`), so that each exec of the daemon
/// (100 MB, debug) and of genv's Python, and each of Python's imports, is read over 9p
/// once per boot instead of every time, under emulation. Loose caching trusts the files
/// not to change under the guest: `cargo xtask test` builds everything before it boots,
/// and nothing the guest reads from them is written on the host while it runs. The work
/// tree, which the guest writes and the host reads, stays uncached (`cache=mmap`).
const P9_CACHED: &str = "trans=virtio,version=9p2000.L,msize=262144,ro,cache=loose";

/// The line the guest prints last; the host reads the status from it.
pub const EXIT_MARKER: &str = "genv-vm: exit status ";

impl Init<'_> {
    fn script(&self) -> String {
        let work = self.work_tree.display();
        let modules = self.modules.join(" ");
        let then = self.then();
        let target = format!(
            "mkdir -p /target /rw/target/upper /rw/target/work \"/newroot{dir}\"\n\
             mount -t 9p -o {P9_CACHED} {TARGET_TAG} /target \
             || fail \"mount the target directory\"\n\
             mount -t overlay overlay \
             -o lowerdir=/target,upperdir=/rw/target/upper,workdir=/rw/target/work \
             \"/newroot{dir}\" || fail \"mount the target directory's overlay\"\n",
            dir = self.target_dir.display()
        );
        let (p9, p9_cached) = (P9, P9_CACHED);
        format!(
            r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() {{ echo "genv-vm: init failed: $*"; echo "{EXIT_MARKER}125"; poweroff -f; }}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in {modules}; do insmod /modules/$m || fail "insmod $m"; done
mkdir -p /lower /rw /newroot
mount -t 9p -o {p9_cached} hostroot /lower || fail "mount the host's root"
mount -t tmpfs tmpfs /rw && mkdir /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \
    || fail "mount the overlay"
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
mount -t tmpfs tmpfs /newroot/tmp
mount -t tmpfs tmpfs /newroot/run
mount -t bpf bpf /newroot/sys/fs/bpf
mount -t securityfs securityfs /newroot/sys/kernel/security
# Last, so that no fresh /tmp or /run hides it; cache=mmap: tests map files shared.
mkdir -p "/newroot{work}"
mount -t 9p -o {p9},cache=mmap work "/newroot{work}" || fail "mount the work tree"
{target}hostname genv-vm
{then}"#
        )
    }

    fn then(&self) -> String {
        match &self.then {
            Then::Script(script) => format!(
                "chroot /newroot /bin/sh \"{}\"\necho \"{EXIT_MARKER}$?\"\nsync\npoweroff -f\n",
                script.display()
            ),
            Then::Systemd { unit, units } => {
                let mut then = String::from(
                    ": > /newroot/etc/fstab\n\
                     echo 6e766d2d67656e762d766d2d74657374 > /newroot/etc/machine-id\n\
                     mkdir -p /newroot/etc/systemd/system\n",
                );
                for (name, text) in *units {
                    // The text goes through a quoted here-document, as it is.
                    assert!(
                        text.ends_with('\n') && !text.lines().any(|l| l == "GENV_VM_UNIT"),
                        "{name}: a unit's text must end its last line and never hold the \
                         here-document's end"
                    );
                    then.push_str(&format!(
                        "cat > /newroot/etc/systemd/system/{name} <<'GENV_VM_UNIT'\n{text}GENV_VM_UNIT\n"
                    ));
                }
                then.push_str(&format!(
                    "# exec: switch_root must be PID 1. Should it fail, init has exited: \
                     the kernel panics, on the console.\n\
                     exec switch_root /newroot /lib/systemd/systemd --unit={unit} \
                     --show-status=false --log-level=warning\n"
                ));
                then
            }
        }
    }
}

/// Writes the initramfs (an uncompressed `newc` cpio archive) to `out`.
pub fn write(
    out: &Path,
    busybox: &Path,
    modules: &[std::path::PathBuf],
    init: &Init,
) -> Result<()> {
    let mut archive = Cpio::default();
    for dir in ["bin", "dev", "proc", "sys", "modules"] {
        archive.entry(dir, 0o040755, 0, &[]);
    }
    // The kernel gives init its stdio on /dev/console before anything is mounted.
    archive.entry("dev/console", 0o020600, libc::makedev(5, 1), &[]);
    let busybox = std::fs::read(busybox)
        .with_context(|| format!("{} (apt-get install busybox-static)", busybox.display()))?;
    archive.entry("bin/busybox", 0o100755, 0, &busybox);
    for module in modules {
        let name = module.file_name().unwrap().to_string_lossy();
        archive.entry(
            &format!("modules/{name}"),
            0o100644,
            0,
            &std::fs::read(module)?,
        );
    }
    archive.entry("init", 0o100755, 0, init.script().as_bytes());
    std::fs::write(out, archive.finish()).with_context(|| format!("{}", out.display()))
}

/// A `newc` cpio archive (the format the kernel unpacks), built in memory.
#[derive(Default)]
struct Cpio {
    bytes: Vec<u8>,
    inode: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: libc::dev_t, data: &[u8]) {
        self.inode += 1;
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        let fields = [
            self.inode,
            mode,
            0, // uid
            0, // gid
            1, // nlink
            0, // mtime
            data.len() as u32,
            0, // device major
            0, // device minor
            major,
            minor,
            name.len() as u32 + 1,
            0, // check
        ];
        write!(self.bytes, "070701").unwrap();
        for field in fields {
            write!(self.bytes, "{field:08x}").unwrap();
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 0, &[]);
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_the_archive_ends_with_the_trailer() {
        let mut archive = Cpio::default();
        archive.entry("init", 0o100755, 0, b"#!/bin/sh\n");
        let bytes = archive.finish();
        assert!(bytes.starts_with(b"070701"));
        assert_eq!(bytes.len() % 4, 0);
        // Header (110) + "init\0" padded to 116, then 10 bytes of data padded to 128.
        assert_eq!(&bytes[128..134], b"070701");
        assert!(bytes.windows(10).any(|w| w == b"TRAILER!!!"));
    }

    fn init(target_dir: &Path) -> Init<'_> {
        Init {
            modules: vec!["9p.ko".into()],
            work_tree: Path::new("/work/tree"),
            then: Then::Script(Path::new("/work/tree/target/vm/guest.sh")),
            target_dir,
        }
    }

    #[test]
    fn under_systemd_the_units_are_written_and_systemd_becomes_pid_1() {
        let units = [(
            "t.target".to_owned(),
            "[Unit]\nRequires=s.service\n".to_owned(),
        )];
        let mut with_systemd = init(Path::new("/work/tree/target"));
        with_systemd.then = Then::Systemd {
            unit: "t.target",
            units: &units,
        };
        let script = with_systemd.script();
        let unit = "cat > /newroot/etc/systemd/system/t.target <<'GENV_VM_UNIT'\n\
                    [Unit]\nRequires=s.service\nGENV_VM_UNIT\n";
        let written = script.find(unit).expect(&script);
        let switch = script
            .find("exec switch_root /newroot /lib/systemd/systemd --unit=t.target")
            .expect(&script);
        assert!(written < switch && script.find(": > /newroot/etc/fstab").unwrap() < switch);
        assert!(!script.contains("chroot /newroot"), "{script}");
    }

    #[test]
    fn the_target_directory_is_mounted_cached_and_read_only_under_a_tmpfs_at_its_own_path() {
        for dir in ["/tmp/shared-target", "/work/tree/target"] {
            let script = init(Path::new(dir)).script();
            let share = format!("mount -t 9p -o {P9},ro,cache=loose target /target ");
            let overlay = format!(
                "mount -t overlay overlay -o lowerdir=/target,upperdir=/rw/target/upper,\
                 workdir=/rw/target/work \"/newroot{dir}\""
            );
            let (shared, at) = (script.find(&share), script.find(&overlay));
            let (Some(shared), Some(at)) = (shared, at) else {
                panic!("{dir}: {script}")
            };
            // After the guest's own /tmp (which would hide it) and the work tree.
            assert!(shared < at);
            assert!(at > script.find("mount -t tmpfs tmpfs /newroot/tmp").unwrap());
            assert!(at > script.find("work \"/newroot/work/tree\"").unwrap());
            assert!(at < script.find("chroot /newroot").unwrap());
            assert!(script.contains(&format!("\"/newroot{dir}\"\n")), "{script}");
        }
    }

    #[test]
    fn the_host_root_is_cached_and_the_work_tree_is_not() {
        let script = init(Path::new("/work/tree/target")).script();
        assert!(
            script.contains(&format!(
                "mount -t 9p -o {P9},ro,cache=loose hostroot /lower"
            )),
            "{script}"
        );
        assert!(
            script.contains(&format!(
                "mount -t 9p -o {P9},cache=mmap work \"/newroot/work/tree\""
            )),
            "{script}"
        );
        assert_eq!(script.matches("mount -t 9p").count(), 3, "{script}");
    }
}
