//! genv-enforcer: enforces genv's GPU-usage policy on a shared GPU node.
//!
//! Data flows one way: backends (NVML, `/proc`) and genv's state files make a
//! [`snapshot`]; pure [`rules`] turn it into findings; findings become a [`report`];
//! [`actions`] carry the report out. The [`cli`] wires this into `genv enforce`'s
//! command line; the [`daemon`] runs it, polling as genv does or driven by the kernel
//! events of the [`bpf`] programs, which reach it through the [`intake`].

pub mod actions;
pub mod backends;
pub mod bpf;
pub mod cli;
pub mod cycle;
pub mod daemon;
pub mod intake;
pub mod report;
pub mod rules;
pub mod snapshot;
pub mod state;
