//! `genv-enforcer why [PID] [--me]`, run by any user: what the running daemon did to
//! their processes, and why.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Result;

use crate::backends::users;
use crate::exit_code::NOT_RUNNING;
use crate::notify::client::{self, WhyError};
use crate::notify::journal::{CAPACITY, PER_UID, Query};

pub(super) fn why(
    pid: Option<u32>,
    me: bool,
    limit: usize,
    json: bool,
    run_dir: &Path,
) -> Result<ExitCode> {
    let query = Query { pid, me, limit };
    let decisions = match client::ask(run_dir, &query) {
        Ok(decisions) => decisions,
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
