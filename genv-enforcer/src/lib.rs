//! genv-enforcer: enforces genv's GPU-usage policy on a shared GPU node.
//!
//! Data flows one way: backends (NVML, `/proc`) and genv's state files make a
//! [`snapshot`]; pure [`rules`] turn it into findings; findings become a [`report`];
//! [`actions`] carry the report out; a [`cycle`] is all of that once. The event-driven
//! [`daemon`] adds the kernel's view: the [`bpf`] programs report opens and process
//! lifecycle through the [`intake`], and decide `--deny` at the open from the maps that
//! [`prevention`] keeps in step with genv's state. [`remote`] runs the same rules over a
//! fleet of hosts through OpenSSH. The [`cli`] turns `genv enforce`'s command line into
//! one validated configuration and runs it.
//!
//! Each module uses only modules below it in the layering that `tests/architecture.rs`
//! checks (backends, state, snapshot, rules, report, actions, cycle, bpf, intake,
//! prevention, daemon, remote, cli).

pub mod actions;
pub mod backends;
pub mod bpf;
pub mod cli;
pub mod cycle;
pub mod daemon;
pub mod intake;
pub mod prevention;
pub mod remote;
pub mod report;
pub mod rules;
pub mod snapshot;
pub mod state;
