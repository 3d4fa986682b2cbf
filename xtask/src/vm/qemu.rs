//! The VM itself: QEMU under TCG booting one kernel with the initramfs, and the guest's
//! console read as it streams (printed, kept, and its markers read: booted, each tier's
//! start and end, the exit status).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::{Series, initramfs, kernel, tier_marker};

/// Boots `kernel`, prints and keeps its console until QEMU exits; kills it past
/// `deadline`.
pub fn boot(
    root: &Path,
    target_dir: Option<&Path>,
    kernel: &kernel::Kernel,
    initramfs: &Path,
    lsm: &str,
    series: Series,
    deadline: Duration,
) -> Result<Console> {
    let started = Instant::now();
    let mut child = qemu_command(root, target_dir, kernel, initramfs, lsm)
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let stdout = child.stdout.take().unwrap();
    let (lines, receive) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut console = Console::new(series, started);
    loop {
        let left = deadline.saturating_sub(started.elapsed());
        match receive.recv_timeout(left) {
            Ok(line) => {
                console.take(line.trim_end_matches('\r'));
                // Wedged for good (patch_race): stopped now, not at the deadline.
                if super::patch_race::wedged(&console.lines[console.lines.len() - 1..]).is_some() {
                    eprintln!(
                        "vm-test: kernel {}: the guest is wedged (its watchdog says a daemon's \
                         CPU is stuck); stopping it",
                        series.version
                    );
                    let _ = child.kill();
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "the VM ran past its deadline, {deadline:.0?}{}; killed",
                    match &console.tier {
                        Some((tier, _)) => format!(", in tier {tier}"),
                        None => String::new(),
                    }
                );
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let exit = child.wait()?;
    console.total = started.elapsed();
    if console.booted.is_none() {
        eprintln!(
            "vm-test: kernel {}: the guest never reached its script (qemu: {exit})",
            series.version
        );
    }
    Ok(console)
}

/// The guest's console as it streams: printed, kept, and read for the init's markers
/// (booted, each tier's start and end, the exit status).
pub struct Console {
    marker: String,
    started: Instant,
    /// Every line the guest printed.
    pub lines: Vec<String>,
    /// The guest script's exit status, once printed.
    pub status: Option<i32>,
    /// When the guest script started.
    pub booted: Option<Duration>,
    /// The tier running, and since when.
    tier: Option<(String, Instant)>,
    /// Each tier that ended: (tier, passed, how long it took).
    pub tiers: Vec<(String, bool, Duration)>,
    /// The suite running, and since when.
    suite: Option<(String, Instant)>,
    /// Each suite that ended: (tier, suite, how long it took), timed here as the
    /// guest's marker lines arrive.
    pub suites: Vec<(String, String, Duration)>,
    /// From QEMU's start to its exit.
    pub total: Duration,
}

impl Console {
    fn new(series: Series, started: Instant) -> Self {
        Self {
            marker: tier_marker(series),
            started,
            lines: Vec::new(),
            status: None,
            booted: None,
            tier: None,
            tiers: Vec::new(),
            suite: None,
            suites: Vec::new(),
            total: Duration::ZERO,
        }
    }

    fn take(&mut self, line: &str) {
        println!("{line}");
        if line.starts_with("genv-vm: booted") {
            self.booted = Some(self.started.elapsed());
        }
        if let Some((tier, what)) = line
            .strip_prefix(self.marker.as_str())
            .and_then(|rest| rest.split_once(": "))
        {
            match what {
                "start" => self.tier = Some((tier.to_owned(), Instant::now())),
                suite if suite.starts_with("suite ") && suite.ends_with(" start") => {
                    let name = &suite["suite ".len()..suite.len() - " start".len()];
                    self.suite = Some((name.to_owned(), Instant::now()));
                }
                suite if suite.starts_with("suite ") && suite.ends_with(" end") => {
                    if let Some((name, at)) = self.suite.take() {
                        self.suites.push((tier.to_owned(), name, at.elapsed()));
                    }
                }
                "passed" | "FAILED" => {
                    let took = self
                        .tier
                        .take()
                        .map_or(Duration::ZERO, |(_, at)| at.elapsed());
                    self.tiers.push((tier.to_owned(), what == "passed", took));
                }
                _ => {}
            }
        }
        if let Some(code) = line.strip_prefix(initramfs::EXIT_MARKER) {
            self.status = code.trim().parse::<i32>().ok();
        }
        self.lines.push(line.to_owned());
    }
}

/// QEMU under TCG, booting `kernel` with the initramfs, the host's root shared
/// read-only and the work tree read-write over virtio-9p, the console on stdio.
fn qemu_command(
    root: &Path,
    target_dir: Option<&Path>,
    kernel: &kernel::Kernel,
    initramfs: &Path,
    lsm: &str,
) -> Command {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let share = |id: &str, path: &Path, extra: &str| {
        [
            "-fsdev".to_owned(),
            format!(
                "local,id={id},path={},security_model=none{extra}",
                path.display()
            ),
            "-device".to_owned(),
            format!("virtio-9p-pci,fsdev={id},mount_tag={id}"),
        ]
    };
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args([
        "-machine",
        "pc",
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        "max",
    ])
    .args(["-smp", &cpus.to_string(), "-m", "4G"])
    .args([
        "-nodefaults",
        "-no-user-config",
        "-no-reboot",
        "-display",
        "none",
    ])
    .args([
        "-chardev",
        "stdio,id=console,signal=off",
        "-serial",
        "chardev:console",
    ])
    .arg("-kernel")
    .arg(&kernel.vmlinux)
    .arg("-initrd")
    .arg(initramfs)
    .args([
        "-append",
        &format!("console=ttyS0 lsm={lsm} panic=-1 quiet mitigations=off"),
    ])
    // multidevs=remap: the host's root spans several filesystems.
    .args(share(
        "hostroot",
        Path::new("/"),
        ",readonly=on,multidevs=remap",
    ))
    .args(share("work", root, ""))
    .args(target_dir.map_or(Vec::new(), |dir| {
        share(initramfs::TARGET_TAG, dir, "").to_vec()
    }))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    // QEMU goes when this process goes (killed, or ^C), instead of running its guest on
    // for up to the deadline with no one reading it.
    let parent = std::process::id();
    // SAFETY: prctl and getppid are async-signal-safe; nothing else runs in the child.
    unsafe {
        qemu.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("vm-test exited while starting QEMU"));
            }
            Ok(())
        });
    }
    qemu
}
