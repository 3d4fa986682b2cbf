//! A decision made on another machine, kept and told on this one: a remote stop that
//! `usage execute --with-reasons` carries out here ([`crate::report::reasons`]).
//!
//! The daemon running here, if any, keeps it in its journal and tells the terminal
//! under its own limits, as for its own stops ([`super::server::WhyRequest::Record`]).
//! With no daemon (or one too old to keep records), the decision goes to its uid's file
//! ([`super::told_file`]), where `why` finds it, and the caller tells the terminal.

use std::path::{Path, PathBuf};

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
}

impl Relay {
    pub fn new(run_dir: &Path) -> Self {
        Self {
            run_dir: run_dir.to_owned(),
        }
    }

    /// Hands `decision` to the daemon, else keeps it in the uid's file.
    pub fn keep(&self, decision: &Decision, terminal: Option<Terminal>) -> RelayedTo {
        match client::record(&self.run_dir, decision, terminal) {
            Ok(()) => return RelayedTo::ByDaemon,
            Err(WhyError::NotRunning(..)) => {}
            Err(e) => tracing::debug!("The daemon did not take the decision: {e}"),
        }
        match told_file::append(&self.run_dir, decision) {
            Ok((path, readable)) => RelayedTo::InFile { path, readable },
            Err(e) => RelayedTo::Nowhere(e.to_string()),
        }
    }
}
