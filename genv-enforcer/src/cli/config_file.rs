//! `enforce --config FILE`: the flags in a TOML file (`/etc/genv-enforcer/config.toml`
//! under the systemd unit), one key per long flag:
//!
//! ```toml
//! event-driven = true
//! non-env-processes = true      # false: --no-non-env-processes
//! max-devices-per-user = 2
//! max-devices-for-user = ["alice=4"]
//! interval = 10
//! ```
//!
//! The file's flags come first and the command line's after, so a flag given on both
//! is the command line's. SIGHUP reads the file again ([`reloader`], put in force by
//! `service::reload`).

use std::ffi::OsString;
use std::path::Path;

use clap::Parser;

use super::args::{Cli, Command, EnforceArgs};
use super::config::{EnforceConfig, Mode};
use crate::service::reload::{Reloadable, Reloader};

/// The flags that have a `--no-` form: `false` in the file means it.
pub const NEGATABLE: [&str; 3] = ["non-env-processes", "env-devices", "env-memory"];
/// Long flags a file cannot give: `config` (a file naming another), what only prints
/// (`help`, `version`), and `log-format`, which is read before the file is.
pub const REFUSED: [&str; 4] = ["config", "help", "version", "log-format"];
/// A configuration file is a few hundred bytes; past this it is refused.
const LIMIT: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("{path}: {message}")]
    Read { path: String, message: String },
    #[error("{path}: {key}: {message}")]
    Key {
        path: String,
        key: String,
        message: &'static str,
    },
}

/// The file's flags as command-line words.
pub fn words(path: &Path) -> Result<Vec<OsString>, ConfigFileError> {
    let shown = path.display().to_string();
    let read_error = |message: String| ConfigFileError::Read {
        path: shown.clone(),
        message,
    };
    let text = crate::state::admin_file::read(path, LIMIT).map_err(read_error)?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| read_error(e.message().to_owned()))?;
    let mut words = Vec::new();
    for (key, value) in &table {
        let bad = |message| ConfigFileError::Key {
            path: shown.clone(),
            key: key.clone(),
            message,
        };
        if REFUSED.contains(&key.as_str()) || key.starts_with('-') || key.is_empty() {
            return Err(bad("not a flag a file can give"));
        }
        let flag = format!("--{key}");
        match value {
            toml::Value::Boolean(true) => words.push(flag.into()),
            toml::Value::Boolean(false) if NEGATABLE.contains(&key.as_str()) => {
                words.push(format!("--no-{key}").into());
            }
            toml::Value::Boolean(false) => {}
            toml::Value::Array(items) => {
                for item in items {
                    words.push(flag.clone().into());
                    words.push(scalar(item).ok_or_else(|| bad("a list of plain values"))?);
                }
            }
            other => {
                words.push(flag.into());
                words.push(scalar(other).ok_or_else(|| bad("not a plain value"))?);
            }
        }
    }
    Ok(words)
}

fn scalar(value: &toml::Value) -> Option<OsString> {
    match value {
        toml::Value::String(s) => Some(s.into()),
        toml::Value::Integer(i) => Some(i.to_string().into()),
        toml::Value::Float(f) => Some(f.to_string().into()),
        _ => None,
    }
}

/// `argv` with `enforce --config FILE`'s flags put right after `enforce` (the command
/// line's own, after them, win); `doctor`'s alike. Other commands are left as they are.
pub fn expand(argv: &[OsString]) -> Result<Vec<OsString>, ConfigFileError> {
    // Global flags (`--log-format X`) may come before the command.
    let mut at = 1;
    while let Some(arg) = argv.get(at).and_then(|a| a.to_str()) {
        match arg {
            "--log-format" => at += 2,
            _ if arg.starts_with("--log-format=") => at += 1,
            _ => break,
        }
    }
    // `doctor` reads the configuration as `enforce` does.
    if argv.get(at).is_none_or(|a| a != "enforce" && a != "doctor") {
        return Ok(argv.to_vec());
    }
    let mut path = None;
    for (i, arg) in argv.iter().enumerate().skip(at + 1) {
        if arg == "--config" {
            path = argv.get(i + 1).cloned();
        } else if let Some(p) = arg.to_str().and_then(|a| a.strip_prefix("--config=")) {
            path = Some(p.into());
        }
    }
    let Some(path) = path else {
        return Ok(argv.to_vec());
    };
    let mut expanded = argv[..=at].to_vec();
    expanded.extend(words(Path::new(&path))?);
    expanded.extend(argv[at + 1..].iter().cloned());
    Ok(expanded)
}

/// SIGHUP's reading of `--config`: the command line as first given, with the file's
/// flags read again, parsed and validated exactly as at start; what changed that needs
/// a restart is named.
/// What only a restart changes (the kernel side, the sources, the identity policy),
/// each under its flag, its value as text: enough to say which ones a file changed.
fn restart_only(args: &EnforceArgs) -> Vec<(&'static str, String)> {
    use std::fmt::Debug;
    fn text(value: &dyn Debug) -> String {
        format!("{value:?}")
    }
    /// An optional flag's value, or that it was not given.
    fn given<T: Debug>(value: &Option<T>) -> String {
        value
            .as_ref()
            .map_or_else(|| "not given".to_owned(), |v| text(v))
    }
    let (e, s) = (&args.events, &args.sources);
    vec![
        ("--event-driven", text(&e.event_driven)),
        ("--bpf-tier", given(&e.bpf_tier)),
        ("--gpu-node", text(&e.gpu_node)),
        ("--run-dir", text(&e.run_dir)),
        ("--deny", text(&e.deny)),
        ("--deny-root", text(&e.deny_root)),
        ("--allow-exe", text(&e.allow_exe)),
        ("--keep-pinned", text(&e.keep_pinned)),
        ("--pin-dir", text(&e.pin_dir)),
        ("--bpf-log", text(&e.bpf_log)),
        ("--memory-at-alloc", text(&e.memory_at_alloc)),
        ("--cuda-lib", text(&e.cuda_lib)),
        ("--ring-buffer-bytes", given(&e.ring_buffer_bytes)),
        ("--metrics-addr", given(&e.metrics_addr)),
        ("--verbose", text(&e.verbose)),
        ("--nvml-lib", text(&s.nvml_lib)),
        ("--genv-tmpdir", text(&s.genv_tmpdir)),
        ("--allow-unknown-env", text(&args.allow_unknown_env)),
        ("--allow-foreign-env", text(&args.allow_foreign_env)),
        ("--orphans", text(&args.orphans)),
    ]
}

/// The flags whose values differ between `before` and `after`, with both values.
fn changed(before: &[(&'static str, String)], after: &[(&'static str, String)]) -> Vec<String> {
    before
        .iter()
        .zip(after)
        .filter(|((_, old), (_, new))| old != new)
        .map(|((flag, old), (_, new))| format!("{flag}: {old} -> {new}"))
        .collect()
}

pub fn reloader(argv: Vec<OsString>, started: &EnforceArgs) -> Reloader {
    let started = restart_only(started);
    Reloader(Box::new(move || {
        let expanded = expand(&argv)?;
        let Command::Enforce(args) = Cli::try_parse_from(expanded)?.command else {
            anyhow::bail!("not an enforce command line");
        };
        // Half a change could undo what the other half relied on (`deny` dropped with
        // `non-env-processes` off, the kernel still denying): all or nothing.
        let changed = changed(&started, &restart_only(&args));
        if !changed.is_empty() {
            anyhow::bail!(
                "the file changes settings only a restart changes ({}): restart the daemon to apply it",
                changed.join("; ")
            );
        }
        let config = EnforceConfig::from_args(args)?;
        let (interval, memory_interval) = match config.mode {
            Mode::EventDriven(settings) => (settings.interval, Some(settings.memory_interval)),
            Mode::Polling(interval) => (interval, None),
            Mode::Once => anyhow::bail!("interval = 0 would end the daemon; give it a period"),
        };
        let reloadable = Reloadable {
            rules: config.rules,
            interval,
            memory_interval,
            execution: config.execution,
            notify: config.notify,
        };
        // What the rules say of themselves, as at start (said as SIGHUP's).
        Ok((reloadable, config.warnings))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!(
            "genv-config-{}-{}.toml",
            std::process::id(),
            text.len()
        ));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn keys_become_flags() {
        let path = file(
            "event-driven = true\nenv-memory = false\nkeep-pinned = false\ninterval = 5\n\
             max-devices-for-user = [\"alice=2\", \"bob=0\"]\nmemory-interval = 0.5\n",
        );
        let words: Vec<String> = words(&path)
            .unwrap()
            .into_iter()
            .map(|w| w.into_string().unwrap())
            .collect();
        let _ = std::fs::remove_file(&path);
        assert!(words.contains(&"--event-driven".to_owned()));
        assert!(words.contains(&"--no-env-memory".to_owned()));
        assert!(!words.iter().any(|w| w.contains("keep-pinned")));
        assert!(words.windows(2).any(|w| w == ["--interval", "5"]));
        assert!(words.windows(2).any(|w| w == ["--memory-interval", "0.5"]));
        assert_eq!(
            words
                .iter()
                .filter(|w| *w == "--max-devices-for-user")
                .count(),
            2
        );
    }

    /// `notify = "none"` in the file switches the terminal lines off.
    #[test]
    fn the_file_can_switch_notifying_off() {
        use clap::Parser;
        let path = file("# quiet terminals\nnotify = \"none\"\n");
        let argv: Vec<OsString> = ["genv-enforcer", "enforce", "--config"]
            .into_iter()
            .map(OsString::from)
            .chain([path.clone().into_os_string()])
            .collect();
        let expanded = expand(&argv).unwrap();
        let _ = std::fs::remove_file(&path);
        let cli = super::super::args::Cli::try_parse_from(expanded).unwrap();
        let super::super::args::Command::Enforce(args) = cli.command else {
            unreachable!()
        };
        assert_eq!(args.notify, crate::notify::NotifyMode::None);
    }

    #[test]
    fn errors_name_the_file_and_the_key() {
        let path = file("interval = { every = 5 }\n");
        let err = words(&path).unwrap_err().to_string();
        assert!(
            err.contains(&path.display().to_string()) && err.contains("interval"),
            "{err}"
        );
        std::fs::write(&path, "interval = \n").unwrap();
        let err = words(&path).unwrap_err().to_string();
        assert!(err.starts_with(&path.display().to_string()), "{err}");
        let _ = std::fs::remove_file(&path);
    }

    /// The ConfigMap's `config.toml` in the DaemonSet manifest, as a file.
    fn configmap_file() -> std::path::PathBuf {
        let manifest =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/daemonset.yaml");
        let text = std::fs::read_to_string(manifest).unwrap();
        let block = text
            .split("config.toml: |\n")
            .nth(1)
            .unwrap()
            .split("\n---")
            .next()
            .unwrap();
        let toml: String = block
            .lines()
            .map(|l| l.strip_prefix("    ").unwrap_or(l).to_owned() + "\n")
            .collect();
        file(&toml)
    }

    #[test]
    fn the_configmaps_configuration_is_a_valid_event_driven_daemon() {
        let path = configmap_file();
        starts_an_event_driven_daemon(&path);
        let _ = std::fs::remove_file(path);
    }

    /// The file `cargo xtask install` lays down is one the daemon starts from.
    #[test]
    fn the_shipped_configuration_is_a_valid_event_driven_daemon() {
        starts_an_event_driven_daemon(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config.toml"),
        );
    }

    fn starts_an_event_driven_daemon(shipped: &Path) {
        use clap::Parser;
        let shipped = shipped.to_owned();
        let argv: Vec<OsString> = ["genv-enforcer", "enforce", "--config"]
            .into_iter()
            .map(OsString::from)
            .chain([shipped.into_os_string()])
            .collect();
        let cli = super::super::args::Cli::try_parse_from(expand(&argv).unwrap()).unwrap();
        let super::super::args::Command::Enforce(args) = cli.command else {
            unreachable!()
        };
        let config = super::super::config::EnforceConfig::from_args(args).unwrap();
        assert!(config.rules.non_env_processes);
        match config.mode {
            super::super::config::Mode::EventDriven(settings) => {
                assert!(settings.kernel.keep_pinned)
            }
            other => panic!("{other:?}"),
        }
    }

    /// `doctor` checks the configuration `enforce` would run: the same file, read alike.
    #[test]
    fn doctor_reads_the_file_as_enforce_does() {
        let path = file("event-driven = true\nbpf-tier = \"tracepoint\"\n");
        let argv: Vec<OsString> = ["genv-enforcer", "doctor", "--json", "--config"]
            .into_iter()
            .map(OsString::from)
            .chain([path.clone().into_os_string()])
            .collect();
        let cli = super::super::args::Cli::try_parse_from(expand(&argv).unwrap()).unwrap();
        let _ = std::fs::remove_file(&path);
        let super::super::args::Command::Doctor { json, enforce } = cli.command else {
            panic!("not doctor: {:?}", cli.command);
        };
        assert!(json && enforce.events.event_driven);
        assert_eq!(
            enforce.events.bpf_tier,
            Some(crate::kernel::TierChoice::Tracepoint)
        );
    }

    #[test]
    fn the_command_lines_flags_come_after_the_files() {
        let path = file("interval = 5\n");
        let argv: Vec<OsString> = ["genv-enforcer", "enforce", "--config"]
            .into_iter()
            .map(OsString::from)
            .chain([
                path.clone().into_os_string(),
                "--interval".into(),
                "7".into(),
            ])
            .collect();
        let expanded = expand(&argv).unwrap();
        let at = |w: &str| expanded.iter().rposition(|a| a == w).unwrap();
        assert!(at("5") < at("7"));
        assert_eq!(expanded[1], "enforce");
        // After a global flag too.
        let mut global: Vec<OsString> =
            vec!["genv-enforcer".into(), "--log-format".into(), "json".into()];
        global.extend(argv[1..].iter().cloned());
        let expanded = expand(&global).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(expanded[3], "enforce");
        assert!(expanded.iter().any(|a| a == "5"), "{expanded:?}");
    }
}
