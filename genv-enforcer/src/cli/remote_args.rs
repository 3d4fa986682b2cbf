//! `genv-enforcer remote …`: genv's `genv remote` flags (`-H`, `--hostfile`, `-l`, `-t`,
//! `-e`, `-q`), then `enforce` with genv's rule flags, plus the enforcer's own.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::shared_args::{RuleArgs, non_negative_seconds, positive_seconds};

#[derive(Debug, Args)]
pub struct RemoteArgs {
    /// Comma-separated hostnames or IP addresses (`user@host` allowed).
    #[arg(
        short = 'H',
        long = "host",
        value_name = "HOSTS",
        required_unless_present = "hostfile",
        conflicts_with = "hostfile"
    )]
    pub hosts: Option<String>,

    /// A file with one hostname or IP address per line (`#` comments).
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,

    /// SSH login name.
    #[arg(short = 'l', long = "username", value_name = "USER")]
    pub username: Option<String>,

    /// SSH connection timeout in seconds (ssh's ConnectTimeout).
    #[arg(short = 't', long = "timeout", value_name = "SECONDS")]
    pub timeout: Option<u32>,

    /// Exit on an SSH error to one or more hosts.
    #[arg(short = 'e', long = "exit-on-error")]
    pub exit_on_error: bool,

    /// Ignore SSH errors.
    #[arg(short = 'q', long)]
    pub quiet: bool,

    /// What runs on each host before `usage snapshot`, `usage execute` or `usage
    /// watch`: `sudo genv` drives hosts that run Python genv.
    #[arg(long, value_name = "COMMAND", default_value = "sudo genv-enforcer")]
    pub remote_command: String,

    /// An ssh_config file for every connection (ssh -F): keys, known hosts, ports,
    /// jump hosts.
    #[arg(long, value_name = "FILE")]
    pub ssh_config: Option<PathBuf>,

    /// Seconds one host may take to answer one command; past it, the host is reported
    /// and left out of the cycle.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, value_parser = positive_seconds)]
    pub host_timeout: f64,

    /// How many hosts are talked to at once.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_parallel: u32,

    /// One SSH connection per command, as genv makes them, instead of one multiplexed
    /// connection per host (ControlMaster).
    #[arg(long)]
    pub no_multiplex: bool,

    /// Say on stderr how long each cycle took, and what each host's stream does.
    #[arg(long, short)]
    pub verbose: bool,

    /// A flag given to `usage snapshot` and `usage watch` on every host (repeatable,
    /// one word each): `--genv-tmpdir=/var/tmp/genv`, `--nvml-lib=/opt/nvidia/lib/libnvidia-ml.so.1`.
    /// Not for hosts running Python genv, whose `usage snapshot` takes none.
    #[arg(long, value_name = "FLAG", allow_hyphen_values = true, value_parser = host_word)]
    pub host_option: Vec<String>,

    /// A flag given to `usage watch` alone on every host (repeatable, one word each):
    /// `--gpu-node=195:0=0`, `--bpf-tier=none`, `--poll-interval=5`.
    #[arg(long, value_name = "FLAG", allow_hyphen_values = true, value_parser = host_word)]
    pub watch_option: Vec<String>,

    /// Serve Prometheus metrics here (ADDR:PORT): each host up or down, how long since
    /// it was heard from, its failures, the actions sent to it.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_addr: Option<std::net::SocketAddr>,

    #[command(subcommand)]
    pub command: RemoteCommand,
}

#[derive(Debug, Subcommand)]
pub enum RemoteCommand {
    /// Enforce GPU usage on every host, the rules counting across hosts (genv remote
    /// enforce).
    Enforce(RemoteEnforceArgs),
}

#[derive(Debug, Args)]
pub struct RemoteEnforceArgs {
    /// Seconds between cycles; 0 runs one cycle and exits. With --event-driven, how
    /// often hosts that cannot stream are polled.
    #[arg(long, default_value_t = 10.0, value_parser = non_negative_seconds, allow_hyphen_values = true)]
    pub interval: f64,

    #[command(flatten)]
    pub rules: RuleArgs,

    /// Keep a `usage watch` stream open to each host and run the rules whenever a host
    /// changes, instead of every --interval (hosts that cannot stream are polled).
    #[arg(long)]
    pub event_driven: bool,
}

/// A word for the host's command line, which its shell splits again: plain characters
/// only, so that it stays one word and nothing else.
fn host_word(text: &str) -> Result<String, String> {
    let plain = !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_=:,./+@%".contains(&b));
    match plain {
        true => Ok(text.to_owned()),
        false => Err(format!(
            "{text:?}: one word of letters, digits and -_=:,./+@% (the host's shell reads it)"
        )),
    }
}

/// genv's argparse also takes `-host` and `-hostfile` (single dash) before the remote
/// subcommand; clap does not, so they are spelled `--host` and `--hostfile` first.
pub fn genv_spellings(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut args: Vec<OsString> = args.into_iter().collect();
    if args.get(1).is_some_and(|a| a == "remote") {
        for arg in args.iter_mut().skip(2) {
            if arg == "enforce" {
                break;
            }
            let text = arg.to_string_lossy();
            let genv_spelling = ["-host", "-hostfile"]
                .iter()
                .any(|s| text == *s || text.starts_with(&format!("{s}=")));
            if genv_spelling {
                let mut long = OsString::from("-");
                long.push(&*arg);
                *arg = long;
            }
        }
    }
    args
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::super::args::{Cli, Command};
    use super::*;

    fn remote(args: &[&str]) -> Result<RemoteArgs, clap::Error> {
        let cli = Cli::try_parse_from(["genv-enforcer", "remote"].iter().chain(args))?;
        match cli.command {
            Command::Remote(args) => Ok(args),
            _ => unreachable!(),
        }
    }

    #[test]
    fn accepts_genvs_remote_command_line() {
        let args = remote(&[
            "-H",
            "h1,h2",
            "-l",
            "admin",
            "-t",
            "5",
            "-e",
            "-q",
            "enforce",
            "--interval",
            "0",
            "--non-env-processes",
            "--max-devices-per-user",
            "1",
        ])
        .unwrap();
        assert_eq!(args.hosts.as_deref(), Some("h1,h2"));
        assert_eq!(
            (args.timeout, args.exit_on_error, args.quiet),
            (Some(5), true, true)
        );
        let RemoteCommand::Enforce(enforce) = args.command;
        assert_eq!(enforce.interval, 0.0);
        assert_eq!(enforce.rules.max_devices_per_user, Some(1));
    }

    #[test]
    fn genvs_single_dash_spellings_are_taken() {
        let argv = ["genv-enforcer", "remote", "-host", "h1", "enforce", "-host"];
        let args = genv_spellings(argv.iter().map(OsString::from));
        assert_eq!(args[2], "--host");
        assert_eq!(args[5], "-host", "the rule flags are left alone");
        let args =
            genv_spellings(["genv-enforcer", "remote", "-hostfile", "f"].map(OsString::from));
        assert_eq!(args[2], "--hostfile");
        let args = genv_spellings(["genv-enforcer", "remote", "-host=h1"].map(OsString::from));
        assert_eq!(args[2], "--host=h1");
    }

    #[test]
    fn host_options_stay_one_word_on_the_host() {
        let args = remote(&[
            "-H",
            "h",
            "--host-option=--genv-tmpdir=/var/tmp/genv",
            "--watch-option",
            "--bpf-tier=none",
            "enforce",
        ])
        .unwrap();
        assert_eq!(args.host_option, ["--genv-tmpdir=/var/tmp/genv"]);
        assert_eq!(args.watch_option, ["--bpf-tier=none"]);
        for bad in ["--genv-tmpdir=/tmp/a b", "--x=$(id)", "a;b", ""] {
            let flag = format!("--host-option={bad}");
            assert!(remote(&["-H", "h", &flag, "enforce"]).is_err(), "{bad}");
        }
    }

    #[test]
    fn hosts_are_named_one_way() {
        let err = remote(&["enforce"]).unwrap_err().to_string();
        assert!(err.contains("--host"), "{err}");
        let err = remote(&["-H", "a", "--hostfile", "f", "enforce"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--hostfile"), "{err}");
    }
}
