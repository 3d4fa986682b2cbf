//! genv-enforcer: enforces genv's GPU-usage policy on a shared GPU node.
//!
//! Data flows one way: backends (NVML, `/proc`) and genv's state files make a
//! [`snapshot`]; pure [`rules`] turn it into findings; findings become a [`report`];
//! [`actions`] carry the report out; a [`cycle`] is all of that once.
//!
//! The event side adds the kernel's view, stage by stage: the [`kernel`] programs
//! (loaded, attached, their maps' handles split by owner) report opens and process
//! lifecycle through the [`intake`]; [`alloc`] is `--memory-at-alloc`'s userspace half,
//! owning its maps and probes; [`sync`] is the mirror, owning the maps the programs
//! decide from (`--deny` at the open) and keeping them in step with genv's state;
//! [`react`] turns each kernel event into what it wants done; the [`daemon`] runs the
//! loop that does it and ties it to the cycle, and [`service`] is what it publishes and
//! answers as a service. [`remote`] runs the same
//! rules over a fleet of hosts through OpenSSH. The [`cli`] turns `genv enforce`'s
//! command line into one validated configuration and runs it.
//!
//! Each module uses only modules below it in the layering that `tests/architecture.rs`
//! checks (warn_once, clock, exit_code, limits, backends, state, snapshot, notify,
//! rules, report, actions, cycle, kernel, intake, service, alloc, sync, react, daemon,
//! remote, doctor, cli), and no file uses a sibling
//! that uses it back. What the enforcer did is told to the users it did it to through
//! [`notify`].

pub mod actions;
pub mod alloc;
pub mod backends;
pub mod cli;
pub mod clock;
pub mod cycle;
pub mod daemon;
pub mod doctor;
pub mod exit_code;
pub mod genv_lines;
pub mod intake;
pub mod kernel;
pub mod limits;
pub mod notify;
pub mod react;
pub mod remote;
pub mod report;
pub mod rules;
pub mod service;
pub mod snapshot;
pub mod state;
pub mod sync;
pub mod warn_once;
