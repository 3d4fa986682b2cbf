//! Project tasks: `cargo xtask <task>` (`cargo xtask --help` lists them).
//!
//! - `test`: the whole suite, what CI runs ([`test`]): formatting, lints, every
//!   artefact built, then the host's suites beside the VM's ([`vm`], the `xtask-vm`
//!   crate): the tier-dependent suites on every VM tier (LSM, fmod_ret, fentry) on each
//!   of three Debian kernels (6.1, 6.12 and the newest, 7), the harness's refusal check and the
//!   unit under systemd. The real genv 1.4.3 is installed from PyPI into
//!   `target/debug/genv-venv` on first use; openssh-server and sudo from apt, for the
//!   remote tests' hosts ([`setup`]).
//! - `vm-test`: the tier-dependent suites in Debian's kernels under QEMU ([`vm`]).
//! - `demo`: the event-driven enforcer on a simulated GPU node with no GPU: the fake
//!   NVML, a genv environment, intruders opening a GPU node, and how fast they end.
//! - `build-ebpf`: the kernel programs' object alone (the enforcer's build script builds
//!   and embeds it too). `test`, `demo` and `build-ebpf` first install what building it
//!   needs ([`toolchain`]).
//! - `install` / `uninstall`: genv-enforcer on a node, with its `genv` front and its
//!   systemd unit ([`install`]).
//! - `dist`: the `.deb`, the RPM, the Python wheel and the tarball, built against glibc
//!   2.28, into `target/dist/` ([`dist`]); they and `install` lay down one list of files
//!   ([`layout`]).
//! - `bench`: one full enforcement cycle with 0, 100 and 1,000 GPU processes, the
//!   event-driven reaction to a GPU open, the kernel programs' cost per run, and remote
//!   enforcement over SSH ([`bench_remote`]); writes the tables to `docs/bench.md`.
//! - `gpu-check`: the real-GPU check of `--memory-at-alloc` ([`gpu_check`]).

mod bench_alloc;
mod bench_bpf_log;
mod bench_compare;
mod bench_events;
mod bench_footprint;
mod bench_remote;
mod demo;
mod dist;
mod gpu_check;
mod install;
mod layout;
mod setup;
mod sim;
mod test;
mod timings;
mod toolchain;
mod vm;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};

pub use setup::{ensure_apt, ensure_openssh, ensure_promtool, ensure_python_venv, genv_venv};

/// genv-enforcer's project tasks.
#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// The whole suite, as CI runs it (`.ci/run`); with test arguments, the host's tests
    /// only, given them.
    Test {
        /// Passed to `cargo test --workspace` (after `--`).
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "CARGO TEST ARGS"
        )]
        cargo_args: Vec<String>,
    },
    /// The tier-dependent suites in Debian's kernels under QEMU.
    VmTest(VmTest),
    /// The event-driven enforcer on a simulated GPU node.
    Demo,
    /// The benchmarks, written to docs/bench.md; one section alone, printed.
    Bench {
        section: Option<BenchSection>,
        /// Measure REV's build and this tree's side by side (the events and remote
        /// sections, or the one named), interleaved, and print each figure before →
        /// after with its spread.
        #[arg(long, value_name = "REV")]
        compare: Option<String>,
        /// Runs of each section on each side, with --compare.
        #[arg(long, default_value_t = 3, requires = "compare")]
        runs: usize,
    },
    /// The kernel programs' object alone.
    BuildEbpf,
    /// genv-enforcer on a node (or under --root).
    Install(install::Options),
    /// What `install` laid down, removed.
    Uninstall(install::Options),
    /// The .deb, the RPM, the wheel and the tarball, into target/dist/.
    Dist,
    /// The real-GPU check of --memory-at-alloc (on a GPU node).
    GpuCheck {
        /// Passed to the check's script (after `--`).
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "ARGS"
        )]
        args: Vec<String>,
    },
}

#[derive(clap::Args)]
struct VmTest {
    /// The systemd unit under systemd as PID 1 instead (no other flag with it).
    #[arg(long, exclusive = true)]
    systemd: bool,
    #[command(flatten)]
    args: xtask_vm::Args,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum BenchSection {
    /// One full cycle at 0 to 10,000 GPU processes.
    Cycle,
    /// The event-driven reaction, the kernel programs, the --deny attempt loops.
    Events,
    Footprint,
    BpfLog,
    MemoryAtAlloc,
    Remote,
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Test { cargo_args } => test::test(&cargo_args),
        Task::VmTest(vm_test) => vm::command(vm_test.systemd, vm_test.args.into()),
        Task::Demo => demo::run(),
        Task::Bench {
            section,
            compare: Some(rev),
            runs,
        } => {
            let sections = section.map_or(vec![BenchSection::Events, BenchSection::Remote], |s| {
                vec![s]
            });
            bench_compare::compare(&rev, &sections, runs.max(1))
        }
        Task::Bench { section: None, .. } => bench(),
        Task::Bench {
            section: Some(section),
            ..
        } => match section {
            BenchSection::Cycle => bench_cycle().map(|table| print!("{table}")),
            BenchSection::Events => bench_section(bench_events::run),
            BenchSection::Footprint => bench_footprint_only(),
            BenchSection::BpfLog => bench_section(bench_bpf_log::run),
            BenchSection::MemoryAtAlloc => bench_section(bench_alloc::run),
            BenchSection::Remote => bench_section(bench_remote::run),
        },
        Task::BuildEbpf => toolchain::build_ebpf(&root()),
        Task::Install(options) => install::install(&options),
        Task::Uninstall(options) => install::uninstall(&options),
        Task::Dist => dist::run(),
        Task::GpuCheck { args } => gpu_check::run_check(&args),
    }
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Cargo's target directory: `target/` in the work tree unless `CARGO_TARGET_DIR` or
/// cargo's configuration put it elsewhere (shared target directories are common), as
/// `cargo metadata` reports it.
pub fn target_dir() -> Result<PathBuf> {
    let output = cargo(&["metadata", "--no-deps", "--format-version", "1"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running cargo metadata")?;
    if !output.status.success() {
        bail!("cargo metadata failed: {}", output.status);
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("cargo metadata's output")?;
    match metadata["target_directory"].as_str() {
        Some(dir) => Ok(PathBuf::from(dir)),
        None => bail!("cargo metadata names no target_directory"),
    }
}

pub fn cargo(args: &[&str]) -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command.args(args).current_dir(root());
    command
}

pub fn run(command: &mut Command) -> Result<()> {
    xtask_vm::run_as("xtask", command)
}

/// What a simulated node runs: the enforcer, the fake NVML, the gpu-process helper.
pub fn build_node_artefacts(extra: &[&str]) -> Result<()> {
    let mut build = cargo(&["build", "-p", "genv-enforcer", "-p", "fake-nvml"]);
    build.args([
        "-p",
        "fake-cuda",
        "-p",
        "genv-enforcer-tests",
        "--bin",
        "genv-enforcer",
    ]);
    build
        .args(["--bin", "gpu-process", "--bin", "cuda-user", "--lib"])
        .args(extra);
    run(&mut build)
}

/// `cargo xtask bench bpf-log`: one section alone, printed.
fn bench_section(section: fn(&Path) -> Result<String>) -> Result<()> {
    // Another build's release directory (the code before a change, built in a worktree
    // of its own): measured by this bench as it is, for a side-by-side table.
    if let Some(other) = std::env::var_os("GENV_BENCH_RELEASE_DIR") {
        print!("{}", section(Path::new(&other))?);
        return Ok(());
    }
    toolchain::ensure_ebpf_toolchain()?;
    build_node_artefacts(&["--release"])?;
    print!("{}", section(&target_dir()?.join("release"))?);
    Ok(())
}

/// `cargo xtask bench footprint`: that table alone, printed (docs/bench.md is left as
/// the whole bench wrote it). `GENV_BENCH_RELEASE_DIR` measures another build, as for
/// the other sections.
fn bench_footprint_only() -> Result<()> {
    if let Some(other) = std::env::var_os("GENV_BENCH_RELEASE_DIR") {
        let venv = genv_venv(&target_dir()?)?;
        print!("{}", bench_footprint::run(Path::new(&other), &venv)?);
        return Ok(());
    }
    toolchain::ensure_ebpf_toolchain()?;
    build_node_artefacts(&["--release"])?;
    let venv = genv_venv(&target_dir()?)?;
    print!(
        "{}",
        bench_footprint::run(&target_dir()?.join("release"), &venv)?
    );
    Ok(())
}

fn bench() -> Result<()> {
    let cycle = bench_cycle()?;
    let release = target_dir()?.join("release");
    let venv = genv_venv(&target_dir()?)?;
    let table = format!(
        "{cycle}{}{}{}{}{}",
        bench_events::run(&release)?,
        bench_bpf_log::run(&release)?,
        bench_alloc::run(&release)?,
        bench_footprint::run(&release, &venv)?,
        bench_remote::run(&release)?
    );
    print!("{table}");
    let docs = root().join("docs");
    std::fs::create_dir_all(&docs)?;
    let path = docs.join("bench.md");
    let prose = std::fs::read_to_string(&path).unwrap_or_default();
    std::fs::write(&path, with_tables(&prose, &table))?;
    eprintln!("xtask: wrote the tables of docs/bench.md (below its marker)");
    Ok(())
}

/// The line in docs/bench.md below which the bench writes: what is above it (each
/// round's comparison, and why the figures moved) is people's, and kept.
const BENCH_MARKER: &str =
    "<!-- Below this line, `cargo xtask bench` writes its tables; what is above is kept. -->";

/// `bench.md`'s `prose` (up to its marker; none, where it has none) with `tables` below
/// the marker.
fn with_tables(prose: &str, tables: &str) -> String {
    let kept = match prose.find(BENCH_MARKER) {
        Some(at) => &prose[..at],
        None => "",
    };
    format!("{kept}{BENCH_MARKER}\n\n{}", tables.trim_start())
}

/// The release build of everything the bench runs, then the cycle benchmark's table.
fn bench_cycle() -> Result<String> {
    toolchain::ensure_ebpf_toolchain()?;
    build_node_artefacts(&["--release"])?;
    let lib = target_dir()?.join("release/libnvidia_ml_fake.so");
    let output = cargo(&[
        "bench",
        "-p",
        "genv-enforcer",
        "--bench",
        "cycle",
        "--quiet",
    ])
    .env("GENV_ENFORCER_NVML_LIB", &lib)
    .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "the benchmark failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(stdout.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::Options;

    #[test]
    fn the_bench_keeps_what_is_above_its_marker() {
        let before = format!("# This round\n\nprose\n\n{BENCH_MARKER}\n\n# old tables\n");
        let after = with_tables(&before, "\n# new tables\n");
        assert_eq!(
            after,
            format!("# This round\n\nprose\n\n{BENCH_MARKER}\n\n# new tables\n")
        );
        assert_eq!(
            with_tables("", "# tables\n"),
            format!("{BENCH_MARKER}\n\n# tables\n")
        );
    }

    fn parse(line: &str) -> Result<Task, clap::Error> {
        let words = std::iter::once("xtask").chain(line.split_whitespace());
        Cli::try_parse_from(words).map(|cli| cli.task)
    }

    #[test]
    fn every_task_keeps_its_name_and_flags() {
        let Ok(Task::Test { cargo_args }) = parse("test -- --test event_driven -- --exact x")
        else {
            panic!("test")
        };
        assert_eq!(cargo_args, ["--test", "event_driven", "--", "--exact", "x"]);
        assert!(matches!(parse("test"), Ok(Task::Test { cargo_args }) if cargo_args.is_empty()));
        let Ok(Task::VmTest(vm_test)) = parse("vm-test --kernel 6.12 --tiers lsm -- opens") else {
            panic!("vm-test")
        };
        let options: Options = vm_test.args.into();
        assert_eq!(
            (options.kernels[0].version, &options.tiers[..]),
            ("6.12", &["lsm".to_owned()][..])
        );
        assert_eq!(options.test_args, ["opens"]);
        assert!(matches!(parse("vm-test --systemd"), Ok(Task::VmTest(v)) if v.systemd));
        assert!(parse("vm-test --systemd --kernel 6.1").is_err());
        for section in ["footprint", "bpf-log", "memory-at-alloc", "remote"] {
            assert!(matches!(
                parse(&format!("bench {section}")),
                Ok(Task::Bench {
                    section: Some(_),
                    ..
                })
            ));
        }
        assert!(parse("bench nope").is_err());
        for task in ["demo", "bench", "build-ebpf", "dist", "uninstall --root /r"] {
            assert!(parse(task).is_ok(), "{task}");
        }
        let Ok(Task::Install(install)) =
            parse("install --root /r --binary /b --enforcer-path /usr/bin/genv-enforcer")
        else {
            panic!("install")
        };
        assert!(format!("{install:?}").contains("\"/usr/bin/genv-enforcer\""));
        let Ok(Task::GpuCheck { args }) = parse("gpu-check -- --report r.md") else {
            panic!("gpu-check")
        };
        assert_eq!(args, ["--report", "r.md"]);
    }
}
