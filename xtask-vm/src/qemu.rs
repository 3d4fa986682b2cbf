//! The VM itself: QEMU under TCG booting one kernel with the initramfs, and the guest's
//! console read as it streams (printed, kept, and its markers read: booted, each tier's
//! start and end, the exit status).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::guest::tier_marker;
use crate::{Guest, Kernel, Run, Series, initramfs, patch_race};

/// What one boot is: the kernel, its `lsm=`, how its console lines are labelled when
/// printed, and how long it may take.
pub(crate) struct Boot<'a> {
    pub series: Series,
    pub kernel: &'a Kernel,
    pub lsm: &'a str,
    pub label: String,
    pub deadline: Duration,
}

/// Boots `boot`'s kernel, prints and keeps its console until QEMU exits; kills it past
/// its deadline.
pub fn boot(guest: &Guest, boot: &Boot, initramfs: &Path) -> Result<Console> {
    let started = Instant::now();
    let mut child = qemu_command(guest, boot.kernel, initramfs, boot.lsm)
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
    let mut console = Console::new(boot, started);
    console.follow(&receive, &mut child, boot.deadline)?;
    let exit = child.wait()?;
    console.total = started.elapsed();
    if console.booted.is_none() {
        eprintln!(
            "vm-test: kernel {}: the guest never reached its script (qemu: {exit})",
            boot.series.version
        );
    }
    Ok(console)
}

/// The guest's console as it streams: printed, kept, and read for the init's markers
/// (booted, each tier's start and end, the exit status).
pub struct Console {
    series: Series,
    marker: String,
    /// What each printed line starts with (`[vm 6.1] `): the guest's lines stay apart
    /// from the host's when both print at once.
    label: String,
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
    fn new(boot: &Boot, started: Instant) -> Self {
        Self {
            series: boot.series,
            marker: tier_marker(boot.series),
            label: format!("[{}] ", boot.label),
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

    /// Reads the console's lines as they come until QEMU closes it, or kills QEMU at the
    /// guest's wedge (at once) or past `deadline` (an error naming the tier it was in).
    fn follow(
        &mut self,
        lines: &mpsc::Receiver<String>,
        qemu: &mut Child,
        deadline: Duration,
    ) -> Result<()> {
        loop {
            let left = deadline.saturating_sub(self.started.elapsed());
            match lines.recv_timeout(left) {
                Ok(line) => {
                    self.take(line.trim_end_matches('\r'));
                    // Wedged for good (patch_race): stopped now, not at the deadline.
                    if patch_race::wedged(&self.lines[self.lines.len() - 1..]).is_some() {
                        eprintln!(
                            "vm-test: kernel {}: the guest is wedged (its watchdog says a \
                             daemon's CPU is stuck); stopping it",
                            self.series.version
                        );
                        let _ = qemu.kill();
                        return Ok(());
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = qemu.kill();
                    let _ = qemu.wait();
                    bail!(
                        "the VM ran past its deadline, {deadline:.0?}{}; killed",
                        match &self.tier {
                            Some((tier, _)) => format!(", in tier {tier}"),
                            None => String::new(),
                        }
                    );
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            }
        }
    }

    fn take(&mut self, line: &str) {
        println!("{}{line}", self.label);
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

impl Console {
    /// This boot's console followed by `again`'s, a second boot of the same kernel for
    /// the tiers this one had not ended: the run failed if either did.
    pub fn follow_with(&mut self, again: Console) {
        let earlier_failed = self.tiers.iter().any(|(_, passed, _)| !passed);
        self.lines.extend(again.lines);
        self.suites.extend(again.suites);
        self.tiers.extend(again.tiers);
        self.total += again.total;
        self.status = (again.status).map(|s| if earlier_failed { s.max(1) } else { s });
    }

    /// The run this console shows, asked for `asked`; an error where the guest never
    /// reported a result.
    pub fn into_run(self, series: Series, kernel: &Kernel, asked: Vec<String>) -> Result<Run> {
        let (Some(status), Some(booted)) = (self.status, self.booted) else {
            bail!(
                "the VM stopped after {:.0?} without reporting a result; its console is above",
                self.total
            );
        };
        Ok(Run {
            kernel: series,
            package: kernel.package.clone(),
            status,
            tiers: self.tiers,
            suites: self.suites,
            asked,
            console: self.lines,
            booted,
            total: self.total,
            rebooted: None,
        })
    }
}

/// QEMU under TCG, booting `kernel` with the initramfs, the host's root, the work tree
/// and the target directory shared over virtio-9p ([`shares`]), the console on stdio.
fn qemu_command(guest: &Guest, kernel: &Kernel, initramfs: &Path, lsm: &str) -> Command {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
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
    .args(["-nodefaults", "-no-user-config", "-no-reboot"])
    .args(["-display", "none"])
    .args(["-chardev", "stdio,id=console,signal=off"])
    .args(["-serial", "chardev:console"])
    .arg("-kernel")
    .arg(&kernel.vmlinux)
    .arg("-initrd")
    .arg(initramfs)
    .args([
        "-append",
        &format!("console=ttyS0 lsm={lsm} panic=-1 quiet mitigations=off"),
    ])
    .args(shares(guest))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    die_with_this_process(&mut qemu);
    qemu
}

/// QEMU's options sharing the host's root (read-only), the work tree and the target
/// directory: `initramfs` mounts them by these tags.
fn shares(guest: &Guest) -> Vec<String> {
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
    // multidevs=remap: the host's root spans several filesystems.
    let mut shares = share("hostroot", Path::new("/"), ",readonly=on,multidevs=remap").to_vec();
    shares.extend(share("work", &guest.root, ""));
    shares.extend(share(
        initramfs::TARGET_TAG,
        &guest.target_dir,
        ",readonly=on",
    ));
    shares
}

/// QEMU goes when this process goes (killed, or ^C), instead of running its guest on
/// for up to the deadline with no one reading it.
fn die_with_this_process(qemu: &mut Command) {
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
}
