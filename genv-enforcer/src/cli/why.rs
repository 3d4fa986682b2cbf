//! `genv-enforcer why [PID] [--me]`, run by any user: what the running daemon did to
//! their processes, and why.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Result;

use crate::backends::users;
use crate::exit_code::NOT_RUNNING;
use crate::notify::client::{self, WhyError};
use crate::notify::decision::Decision;
use crate::notify::journal::{CAPACITY, PER_UID, Query};
use crate::notify::told_file;

pub(super) fn why(
    pid: Option<u32>,
    me: bool,
    limit: usize,
    json: bool,
    run_dir: &Path,
) -> Result<ExitCode> {
    let query = Query { pid, me, limit };
    let remote = remote_stops(run_dir, &query);
    let decisions = match client::ask(run_dir, &query) {
        Ok(decisions) => merged(decisions, remote, limit),
        Err(WhyError::NotRunning(..)) if !remote.is_empty() => {
            eprintln!(
                "genv-enforcer why: no daemon runs here; these are the stops remote enforcement made here"
            );
            merged(Vec::new(), remote, limit)
        }
        Err(e @ WhyError::NotRunning(..)) => {
            eprintln!("genv-enforcer why: {e}");
            return Ok(ExitCode::from(NOT_RUNNING));
        }
        Err(e) => return Err(e.into()),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&decisions)?);
        return Ok(ExitCode::SUCCESS);
    }
    let root_sees_all = rustix::process::getuid().is_root() && !me;
    if decisions.is_empty() {
        let whose = match (pid, root_sees_all) {
            (Some(pid), _) => format!("process {pid}"),
            (None, true) => "any process".to_owned(),
            (None, false) => "your processes".to_owned(),
        };
        println!(
            "The enforcer has done nothing to {whose} lately (it keeps its last {CAPACITY} decisions, {PER_UID} per user, since it started)."
        );
        return Ok(ExitCode::SUCCESS);
    }
    let name = |uid: u32| users::display_name(uid);
    let with_user: Option<&dyn Fn(u32) -> String> = root_sees_all.then_some(&name);
    print!("{}", client::render(&decisions, with_user));
    Ok(ExitCode::SUCCESS)
}

/// What remote enforcement did here while no daemon ran to keep it
/// ([`told_file`]), as `query` asks: the caller's own (root: everyone's, unless `--me`).
fn remote_stops(run_dir: &Path, query: &Query) -> Vec<Decision> {
    let caller = rustix::process::getuid().as_raw();
    let kept = match told_file::read(run_dir, caller) {
        Ok(kept) => kept,
        Err(e) => {
            eprintln!(
                "genv-enforcer why: remote enforcement kept decisions about your processes that only root may read ({e})"
            );
            Vec::new()
        }
    };
    (kept.into_iter())
        .filter(|d| !query.me || d.uid == caller)
        .filter(|d| query.pid.is_none_or(|pid| d.pid == pid))
        .collect()
}

/// The daemon's and the file's, oldest first, the newest `limit`.
fn merged(mut decisions: Vec<Decision>, remote: Vec<Decision>, limit: usize) -> Vec<Decision> {
    if remote.is_empty() {
        return decisions;
    }
    decisions.extend(remote);
    decisions.sort_by_key(|d| d.time);
    let excess = decisions.len().saturating_sub(limit);
    decisions.drain(..excess);
    decisions
}
