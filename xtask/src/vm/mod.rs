//! `cargo xtask vm-test`: the tier-dependent tests on the kernel tiers this machine's
//! kernel refuses (LSM, fentry), in a Debian kernel under QEMU, against the binaries
//! built here.
//!
//! One boot runs every requested tier's suites in turn (`GENV_TEST_BPF_TIER=<tier>`,
//! `GENV_REQUIRE_BPF=1`: a tier the kernel refuses fails its tests). QEMU runs under TCG:
//! `/dev/kvm` here is nested and a stock kernel hangs at boot under it; TCG makes the
//! guest slow (an open costs ~50 µs instead of ~1 µs) but behaves like the real thing,
//! which is what these tests check. Overheads are measured on the host, never here.

mod initramfs;
mod kernel;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{cargo, run};

/// The test binaries whose scenarios depend on the tier.
const TIER_SUITES: [&str; 2] = ["event_driven", "prevention"];

/// Debian's own kernel would pick AppArmor first and no BPF LSM; this is the list the
/// LSM tier needs, with what a hardened distribution would also have.
pub const LSM_WITH_BPF: &str = "lockdown,capability,landlock,yama,bpf";

/// How long a whole VM run may take before it is killed (CI has 90 minutes in all).
const DEADLINE: Duration = Duration::from_secs(40 * 60);

pub struct Options {
    /// Tiers to run the suites on, in order.
    pub tiers: Vec<String>,
    /// The kernel's `lsm=` list.
    pub lsm: String,
    /// Passed to every test binary (a name filter, `--exact`, ...).
    pub test_args: Vec<String>,
}

impl Options {
    pub fn parse(args: &[String]) -> Result<Self> {
        let mut options = Options {
            tiers: vec!["lsm".into(), "fentry".into()],
            lsm: LSM_WITH_BPF.into(),
            test_args: Vec::new(),
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--tiers" => {
                    let list = args
                        .next()
                        .context("--tiers needs a list, e.g. lsm,fentry")?;
                    options.tiers = list.split(',').map(str::to_owned).collect();
                    if let Some(bad) = options
                        .tiers
                        .iter()
                        .find(|t| !["lsm", "fentry", "tracepoint"].contains(&t.as_str()))
                    {
                        bail!("--tiers: unknown tier {bad:?} (lsm, fentry, tracepoint)");
                    }
                }
                "--lsm" => {
                    options.lsm = args
                        .next()
                        .context("--lsm needs the kernel's lsm= list")?
                        .clone();
                }
                "--" => options.test_args.extend(args.by_ref().cloned()),
                other => bail!(
                    "vm-test: unknown argument {other:?} \
                     (usage: cargo xtask vm-test [--tiers lsm,fentry] [--lsm LIST] [-- TEST ARGS])"
                ),
            }
        }
        Ok(options)
    }
}

/// The harness's own check, run by `cargo xtask test` after the suites: boot without
/// the BPF LSM, ask for the LSM tier, and require that the run fail, saying why. A
/// harness that quietly fell back to another tier would pass here and fail this check.
pub fn refusal_check(root: &Path) -> Result<()> {
    let without_bpf = LSM_WITH_BPF.trim_end_matches(",bpf");
    eprintln!(
        "vm-test: refusal check: booting with lsm={without_bpf}; the lsm tier must fail \
         loudly (the failure below is expected)"
    );
    let outcome = test(
        root,
        &Options {
            tiers: vec!["lsm".into()],
            lsm: without_bpf.into(),
            test_args: vec![
                "--exact".into(),
                "one_instance_and_nothing_left_behind".into(),
            ],
        },
    )?;
    let said_why = outcome
        .console
        .iter()
        .any(|line| line.contains("BPF LSM is not active"));
    if outcome.passed || !said_why {
        bail!(
            "refusal check: a kernel without the BPF LSM {} (expected a failed run naming \
             the inactive BPF LSM)",
            if outcome.passed {
                "passed the lsm tier's tests"
            } else {
                "failed without saying why"
            }
        );
    }
    eprintln!("vm-test: refusal check passed: the refused lsm tier failed the run, saying why");
    Ok(())
}

/// What one boot showed.
pub struct Outcome {
    pub passed: bool,
    /// Every line the guest printed.
    pub console: Vec<String>,
}

/// Boots the VM, runs the suites, and says whether every tier passed.
pub fn test(root: &Path, options: &Options) -> Result<Outcome> {
    if unsafe { libc::geteuid() } != 0 {
        bail!("vm-test needs root (apt-get, and the tests inside make nodes and signal)");
    }
    let cache = root.join("target/vm");
    std::fs::create_dir_all(&cache)?;
    ensure_packages()?;
    let kernel = kernel::prepare(&cache, kernel::KERNELS[0])?;
    let suites = build_suites()?;

    let script = cache.join("guest.sh");
    std::fs::write(&script, guest_script(root, &suites, options))?;
    let initramfs = cache.join("initramfs.cpio");
    let init = initramfs::Init {
        modules: kernel
            .modules
            .iter()
            .map(|m| m.file_name().unwrap().to_string_lossy().into_owned())
            .collect(),
        work_tree: root,
        script: &script,
    };
    initramfs::write(&initramfs, Path::new(BUSYBOX), &kernel.modules, &init)?;

    eprintln!(
        "vm-test: booting {} (lsm={}) under QEMU/TCG; tiers: {}",
        kernel.package,
        options.lsm,
        options.tiers.join(", ")
    );
    boot(root, &kernel, &initramfs, &options.lsm)
}

const BUSYBOX: &str = "/bin/busybox";

/// QEMU and a static busybox from the distribution; xz and zstd to unpack the kernels
/// (6.1's image and 6.12's modules are xz, 6.12's image zstd).
fn ensure_packages() -> Result<()> {
    let have = |path: &str| Path::new(path).exists();
    let static_busybox = have(BUSYBOX)
        && Command::new("file")
            .arg(BUSYBOX)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains("statically linked"))
            .unwrap_or(true);
    if have("/usr/bin/qemu-system-x86_64")
        && static_busybox
        && have("/usr/bin/xz")
        && have("/usr/bin/zstd")
    {
        return Ok(());
    }
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(["qemu-system-x86", "busybox-static", "xz-utils", "zstd"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
    };
    if !install()?.success() {
        run(Command::new("apt-get").arg("update"))?;
        if !install()?.success() {
            bail!("apt-get install qemu-system-x86 busybox-static xz-utils zstd failed");
        }
    }
    Ok(())
}

/// Builds the binaries the tests run and the test executables; their paths.
fn build_suites() -> Result<Vec<PathBuf>> {
    crate::build_node_artefacts(&[])?;
    let mut build = cargo(&[
        "test",
        "--no-run",
        "--message-format=json",
        "-p",
        "genv-enforcer-tests",
    ]);
    for suite in TIER_SUITES {
        build.args(["--test", suite]);
    }
    let output = build.stderr(Stdio::inherit()).output()?;
    if !output.status.success() {
        bail!("building the tier test suites failed");
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let name = message["target"]["name"].as_str().unwrap_or_default();
        if let Some(exe) = message["executable"].as_str() {
            if TIER_SUITES.contains(&name) {
                found.push(PathBuf::from(exe));
            }
        }
    }
    if found.len() != TIER_SUITES.len() {
        bail!("cargo built {found:?}, expected the suites {TIER_SUITES:?}");
    }
    Ok(found)
}

/// The guest's script: every suite on every tier, with a marker line around each so the
/// host can time them and tell which tier failed.
fn guest_script(root: &Path, suites: &[PathBuf], options: &Options) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let test_args: Vec<String> = options.test_args.iter().map(|a| quote(a)).collect();
    let mut script = format!(
        "# Written by `cargo xtask vm-test`; runs inside the guest.\n\
         export PATH={path} HOME=/root GENV_REQUIRE_BPF=1\n\
         cd {tests}\n\
         echo \"genv-vm: booted $(uname -r), active LSMs: $(cat /sys/kernel/security/lsm 2>/dev/null || echo unknown)\"\n\
         failed=0\n",
        path = quote(&std::env::var("PATH").unwrap_or_default()),
        tests = quote(&root.join("tests").display().to_string()),
    );
    for tier in &options.tiers {
        script.push_str(&format!(
            "echo 'genv-vm: tier {tier}: start'\nstatus=passed\n"
        ));
        for suite in suites {
            script.push_str(&format!(
                "GENV_TEST_BPF_TIER={tier} {} --color=never {} || status=FAILED\n",
                quote(&suite.display().to_string()),
                test_args.join(" ")
            ));
        }
        script.push_str(&format!(
            "echo \"genv-vm: tier {tier}: $status\"\n[ $status = passed ] || failed=1\n"
        ));
    }
    script.push_str("exit $failed\n");
    script
}

fn boot(root: &Path, kernel: &kernel::Kernel, initramfs: &Path, lsm: &str) -> Result<Outcome> {
    let started = Instant::now();
    let mut child = qemu_command(root, kernel, initramfs, lsm)
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
    let mut console = Console::default();
    loop {
        let left = DEADLINE.saturating_sub(started.elapsed());
        match receive.recv_timeout(left) {
            Ok(line) => console.take(line.trim_end_matches('\r'), started),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                bail!("the VM ran past {DEADLINE:?}; killed");
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let exit = child.wait()?;
    let total = started.elapsed();
    match console.booted {
        Some(boot) => eprintln!(
            "vm-test: boot {boot:.1?}, suites {:.1?} ({}), total {total:.1?}",
            total - boot,
            console.timings.join("; ")
        ),
        None => eprintln!("vm-test: the guest never reached its script ({total:.1?})"),
    }
    let Some(status) = console.status else {
        bail!("the VM stopped (qemu: {exit}) without reporting a result; its console is above");
    };
    Ok(Outcome {
        passed: status == 0,
        console: console.lines,
    })
}

/// The guest's console as it streams: printed, kept, and read for the init's markers
/// (booted, each tier's start and end, the exit status).
struct Console {
    lines: Vec<String>,
    status: Option<i32>,
    booted: Option<Duration>,
    tier_started: Instant,
    timings: Vec<String>,
}

impl Default for Console {
    fn default() -> Self {
        Self {
            lines: Vec::new(),
            status: None,
            booted: None,
            tier_started: Instant::now(),
            timings: Vec::new(),
        }
    }
}

impl Console {
    fn take(&mut self, line: &str, started: Instant) {
        println!("{line}");
        if line.starts_with("genv-vm: booted") {
            self.booted = Some(started.elapsed());
        }
        if let Some(rest) = line.strip_prefix("genv-vm: tier ") {
            if rest.ends_with(": start") {
                self.tier_started = Instant::now();
            } else {
                let took = self.tier_started.elapsed();
                self.timings.push(format!("{rest} in {took:.0?}"));
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
fn qemu_command(root: &Path, kernel: &kernel::Kernel, initramfs: &Path, lsm: &str) -> Command {
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
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    qemu
}
