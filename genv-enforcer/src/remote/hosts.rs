//! The hosts a remote run enforces: `-H h1,user@h2` or `--hostfile FILE` (one per line,
//! `#` comments), as genv reads them. Each name reaches `ssh` as an argument, so one
//! that could be read as an option (`-oProxyCommand=…`), or that carries spaces or
//! control characters, is refused here rather than passed on.

use std::path::Path;

/// One host, as the admin named it: `name` prefixes its lines (`[name] …`), as genv's
/// do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    /// Its place in the fleet: what its multiplexed connection is keyed by (never its
    /// name, which several entries may resolve alike through different routes).
    pub id: usize,
    pub name: String,
    /// The SSH login name: `user@` in the entry, else `-l`, else ssh's own default.
    pub user: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HostError {
    #[error("{at}: {entry:?} is not a host: {why}")]
    Invalid {
        at: String,
        entry: String,
        why: &'static str,
    },
    #[error("{at}: {entry:?} is named twice; each host is enforced once per cycle")]
    Duplicate { at: String, entry: String },
    #[error("{0}: no hosts")]
    Empty(String),
    #[error("--hostfile {path}: {message}")]
    File { path: String, message: String },
}

/// A host file larger than this is refused (a fleet of 16k hosts fits in a fraction).
const HOSTFILE_LIMIT: u64 = 1 << 20;

/// `-H h1,h2`.
pub fn parse_list(list: &str, default_user: Option<&str>) -> Result<Vec<Host>, HostError> {
    let entries = list
        .split(',')
        .enumerate()
        .map(|(i, e)| (format!("--host entry {}", i + 1), e.trim()));
    collect(entries, default_user, "--host")
}

/// `--hostfile FILE`: one host per line; blank lines and `#` comments skipped.
pub fn read_hostfile(path: &Path, default_user: Option<&str>) -> Result<Vec<Host>, HostError> {
    let file_error = |message: String| HostError::File {
        path: path.display().to_string(),
        message,
    };
    let text = crate::state::admin_file::read(path, HOSTFILE_LIMIT).map_err(file_error)?;
    let entries = text
        .lines()
        .enumerate()
        .map(|(i, line)| (format!("{}:{}", path.display(), i + 1), line.trim()))
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'));
    collect(
        entries,
        default_user,
        &format!("--hostfile {}", path.display()),
    )
}

fn collect<'a>(
    entries: impl Iterator<Item = (String, &'a str)>,
    default_user: Option<&str>,
    what: &str,
) -> Result<Vec<Host>, HostError> {
    if let Some(user) = default_user {
        check_user(user).map_err(|why| HostError::Invalid {
            at: "--username".into(),
            entry: user.into(),
            why,
        })?;
    }
    let mut hosts: Vec<Host> = Vec::new();
    for (at, entry) in entries {
        let host =
            parse_one(hosts.len(), entry, default_user).map_err(|why| HostError::Invalid {
                at: at.clone(),
                entry: entry.into(),
                why,
            })?;
        if hosts.iter().any(|h| h.name == host.name) {
            return Err(HostError::Duplicate {
                at,
                entry: entry.into(),
            });
        }
        hosts.push(host);
    }
    if hosts.is_empty() {
        return Err(HostError::Empty(what.to_owned()));
    }
    Ok(hosts)
}

fn parse_one(id: usize, entry: &str, default_user: Option<&str>) -> Result<Host, &'static str> {
    let (user, name) = match entry.rsplit_once('@') {
        Some((user, name)) => (Some(user), name),
        None => (default_user, entry),
    };
    if let Some(user) = user {
        check_user(user)?;
    }
    check_name(name)?;
    Ok(Host {
        id,
        name: name.to_owned(),
        user: user.map(str::to_owned),
    })
}

fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("the name is empty");
    }
    if name.starts_with('-') {
        return Err("it starts with '-', which ssh would read as an option");
    }
    if name.len() > 253 {
        return Err("it is longer than a DNS name can be");
    }
    // DNS names, IPv4 and IPv6 literals (with a %zone), and ssh_config aliases.
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._-:[]%".contains(c);
    if !name.chars().all(allowed) {
        return Err("only letters, digits and . _ - : [ ] % are allowed in a host name");
    }
    Ok(())
}

fn check_user(user: &str) -> Result<(), &'static str> {
    if user.is_empty() {
        return Err("the login name is empty");
    }
    if user.starts_with('-') {
        return Err("the login name starts with '-', which ssh would read as an option");
    }
    if !user
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "._-$@".contains(c))
        || user.len() > 64
    {
        return Err("the login name is not a user name");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_genvs_host_lists() {
        let hosts = parse_list("gpu1, alice@gpu2,10.0.0.3", Some("admin")).unwrap();
        let named: Vec<(&str, Option<&str>)> = hosts
            .iter()
            .map(|h| (h.name.as_str(), h.user.as_deref()))
            .collect();
        assert_eq!(
            named,
            [
                ("gpu1", Some("admin")),
                ("gpu2", Some("alice")),
                ("10.0.0.3", Some("admin"))
            ]
        );
    }

    #[test]
    fn refuses_what_ssh_would_read_as_an_option() {
        for entry in [
            "-oProxyCommand=touch /tmp/x",
            "gpu1 -v",
            "",
            "gpu\n1",
            "-l@gpu1",
        ] {
            let err = parse_list(entry, None).unwrap_err();
            assert!(
                matches!(err, HostError::Invalid { .. } | HostError::Empty(_)),
                "{entry:?}: {err}"
            );
        }
        let err = parse_list("gpu1", Some("-oX")).unwrap_err().to_string();
        assert!(err.starts_with("--username"), "{err}");
    }

    #[test]
    fn a_host_named_twice_is_refused() {
        let err = parse_list("gpu1,gpu2,gpu1", None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--host entry 3: \"gpu1\" is named twice; each host is enforced once per cycle"
        );
    }

    #[test]
    fn host_files_skip_comments_and_name_the_bad_line() {
        let dir = std::env::temp_dir().join(format!("genv-hosts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("hosts");
        std::fs::write(&file, "# fleet\ngpu1\n\n  gpu2  \n").unwrap();
        let hosts = read_hostfile(&file, None).unwrap();
        assert_eq!(hosts.len(), 2);
        std::fs::write(&file, "gpu1\nbad host\n").unwrap();
        let err = read_hostfile(&file, None).unwrap_err().to_string();
        assert!(err.contains("hosts:2") && err.contains("bad host"), "{err}");
        std::fs::write(&file, "# nothing\n").unwrap();
        assert!(matches!(
            read_hostfile(&file, None),
            Err(HostError::Empty(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
