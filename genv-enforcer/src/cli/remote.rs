//! `remote enforce`: its flags become a [`Fleet`] and a [`RemoteMode`], checked here.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail};

use super::remote_args::{RemoteArgs, RemoteCommand};
use crate::remote::hosts::{self, Host};
use crate::remote::metrics::FleetMetrics;
use crate::remote::ssh::{Ssh, SshOptions};
use crate::remote::{ErrorPolicy, Fleet, RemoteMode};

pub fn run(args: RemoteArgs) -> Result<ExitCode> {
    let RemoteCommand::Enforce(enforce) = &args.command;
    let mode = match (enforce.event_driven, enforce.interval) {
        (true, 0.0) => bail!(
            "--event-driven keeps streams open: give --interval a value above 0 (how often hosts that cannot stream are polled)"
        ),
        (true, every) => RemoteMode::EventDriven(Duration::from_secs_f64(every)),
        (false, 0.0) => RemoteMode::Once,
        (false, every) => RemoteMode::Polling(Duration::from_secs_f64(every)),
    };
    if let Some(warning) = enforce.rules.warning() {
        tracing::warn!("{warning}");
    }
    let fleet = fleet(&args)?;
    let metrics = args.metrics_addr.map(|addr| {
        let names = fleet.hosts.iter().map(|h| h.name.clone()).collect();
        (addr, Arc::new(FleetMetrics::new(names)))
    });
    let fleet = Fleet {
        metrics: metrics.as_ref().map(|(_, m)| Arc::clone(m)),
        ..fleet
    };
    if let (true, Some(dir)) = (fleet.verbose, fleet.ssh.control_dir()) {
        tracing::info!("SSH control sockets in {}", dir.display());
    }
    super::runtime()?.block_on(async {
        if let Some((addr, metrics)) = metrics {
            crate::service::metrics::listen(addr, metrics)?;
        }
        crate::remote::run(fleet, mode).await
    })
}

/// The hosts, how to reach them and what to run there, as the flags say (no metrics
/// yet).
fn fleet(args: &RemoteArgs) -> Result<Fleet> {
    let RemoteCommand::Enforce(enforce) = &args.command;
    let remote: Vec<String> = args
        .remote_command
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    if remote.is_empty() {
        bail!(
            "--remote-command is empty: give the command that runs genv-enforcer (or genv) on each host"
        );
    }
    let ssh = Ssh::new(SshOptions {
        program: "ssh".into(),
        config: args.ssh_config.clone(),
        connect_timeout: args.timeout,
        multiplex: !args.no_multiplex,
    });
    let hosts = hosts_of(args)?;
    Ok(Fleet {
        plain: crate::remote::plain_hosts::PlainHosts::new(hosts.len()),
        hosts,
        ssh,
        rules: enforce.rules.rules(),
        remote,
        errors: match (args.exit_on_error, args.quiet) {
            (true, _) => ErrorPolicy::Exit,
            (false, true) => ErrorPolicy::Quiet,
            (false, false) => ErrorPolicy::Report,
        },
        host_timeout: Duration::from_secs_f64(args.host_timeout),
        parallel: Arc::new(tokio::sync::Semaphore::new(args.max_parallel as usize)),
        executing: Arc::new(tokio::sync::Semaphore::new(args.max_parallel as usize)),
        verbose: args.verbose,
        host_options: args.host_option.clone(),
        watch_options: args.watch_option.clone(),
        metrics: None,
    })
}

fn hosts_of(args: &RemoteArgs) -> Result<Vec<Host>> {
    let user = args.username.as_deref();
    Ok(match (&args.hosts, &args.hostfile) {
        (Some(list), _) => hosts::parse_list(list, user)?,
        (None, Some(file)) => hosts::read_hostfile(file, user)?,
        (None, None) => bail!("give the hosts with -H or --hostfile"),
    })
}
