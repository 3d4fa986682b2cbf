//! A decision made on another machine, kept and told on this one: a remote stop that
//! `usage execute --with-reasons` carries out here ([`crate::report::reasons`]).
//!
//! The daemon running here, if any, keeps it in its journal and tells the terminal
//! under its own limits, as for its own stops ([`super::server::WhyRequest::Record`]).
//! With no daemon (or one too old to keep records), the decision goes to its uid's file
//! ([`super::told_file`]), where `why` finds it, and the caller tells the terminal.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::Terminal;
use super::client::{self, WhyError};
use super::decision::Decision;
use super::told_file;

/// Where a relayed decision was kept.
#[derive(Debug)]
pub enum RelayedTo {
    /// The daemon took it, and tells the terminal.
    ByDaemon,
    /// In its uid's file; `readable`: its user may read it (the file system keeps ACLs).
    InFile { path: PathBuf, readable: bool },
    /// Nowhere, and why.
    Nowhere(String),
}

#[derive(Debug)]
pub struct Relay {
    run_dir: PathBuf,
    /// The daemon did not take a decision: the rest go to the file, so that one
    /// execute (under genv's lock) waits on the daemon once at most.
    daemon_failed: AtomicBool,
}

impl Relay {
    pub fn new(run_dir: &Path) -> Self {
        Self {
            run_dir: run_dir.to_owned(),
            daemon_failed: AtomicBool::new(false),
        }
    }

    /// Hands `decision` to the daemon, else keeps it in the uid's file. A daemon that
    /// took it but whose answer did not come in time has it twice (rare, and shown twice
    /// by `why`): keeping it once more beats losing it.
    pub fn keep(&self, decision: &Decision, terminal: Option<Terminal>) -> RelayedTo {
        // Nothing is sent to a socket in a directory another user could have made.
        if let Err(e) = told_file::check_run_dir(&self.run_dir) {
            return RelayedTo::Nowhere(e.to_string());
        }
        if !self.daemon_failed.load(Ordering::Relaxed) {
            match client::record(&self.run_dir, decision, terminal) {
                Ok(()) => return RelayedTo::ByDaemon,
                Err(WhyError::NotRunning(..)) => {}
                Err(e) => tracing::debug!("The daemon did not take the decision: {e}"),
            }
            self.daemon_failed.store(true, Ordering::Relaxed);
        }
        match told_file::append(&self.run_dir, decision) {
            Ok((path, readable)) => RelayedTo::InFile { path, readable },
            Err(e) => RelayedTo::Nowhere(e.to_string()),
        }
    }
}
