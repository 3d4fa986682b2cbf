//! What a run boots and runs: `vm-test`'s flags ([`Args`], read by clap) and the
//! [`Options`] they make.

use anyhow::{Result, bail};
use clap::Parser;

use crate::{KERNELS, KNOWN_TIERS, LSM_WITH_BPF, Series, VM_TIERS};

/// `cargo xtask vm-test`'s flags.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Args {
    /// The kernel to boot: 6.1 (Debian 12), 6.12 (Debian 13's series), 7 (the newest, from
    /// trixie-backports) or all.
    #[arg(long, value_name = "6.1|6.12|7|all", value_parser = kernels_named)]
    pub kernel: Option<Kernels>,
    /// The tiers to run the suites on, in order (default: lsm,fmod_ret,fentry).
    #[arg(long, value_name = "LIST", value_delimiter = ',',
          value_parser = clap::builder::PossibleValuesParser::new(KNOWN_TIERS))]
    pub tiers: Option<Vec<String>>,
    /// The kernel's `lsm=` list.
    #[arg(long, value_name = "LIST", default_value = LSM_WITH_BPF)]
    pub lsm: String,
    /// Passed to every test binary (a name filter, `--exact`, ...).
    #[arg(last = true, value_name = "TEST ARGS")]
    pub test_args: Vec<String>,
}

/// `--kernel`'s value: the kernels it names, in order.
#[derive(Clone, Debug)]
pub struct Kernels(pub Vec<Series>);

/// What a run boots and runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// Kernels to boot, in order; each runs every tier.
    pub kernels: Vec<Series>,
    /// Tiers to run the suites on, in order.
    pub tiers: Vec<String>,
    /// The kernel's `lsm=` list.
    pub lsm: String,
    /// Passed to every test binary (a name filter, `--exact`, ...).
    pub test_args: Vec<String>,
}

impl From<Args> for Options {
    fn from(args: Args) -> Self {
        Options {
            kernels: args.kernel.map_or_else(|| KERNELS.to_vec(), |k| k.0),
            tiers: (args.tiers).unwrap_or_else(|| VM_TIERS.iter().map(|&t| t.to_owned()).collect()),
            lsm: args.lsm,
            test_args: args.test_args,
        }
    }
}

impl Default for Options {
    /// Every kernel, every VM tier, the BPF LSM on, every test.
    fn default() -> Self {
        Args {
            lsm: LSM_WITH_BPF.into(),
            ..Args::default()
        }
        .into()
    }
}

/// [`Args`] on a command line of their own.
#[derive(Parser)]
#[command(name = "vm-test", no_binary_name = true)]
struct Line {
    #[command(flatten)]
    args: Args,
}

impl Options {
    /// The options `vm-test`'s flags (without the command's name) ask for.
    pub fn parse(args: &[String]) -> Result<Self> {
        Ok(Line::try_parse_from(args)?.args.into())
    }
}

/// `--kernel`'s value: one of [`KERNELS`] by its version, or `all`.
pub fn kernels_named(which: &str) -> Result<Kernels> {
    if which == "all" {
        return Ok(Kernels(KERNELS.to_vec()));
    }
    match KERNELS.iter().find(|k| k.version == which) {
        Some(&kernel) => Ok(Kernels(vec![kernel])),
        None => {
            let versions: Vec<&str> = KERNELS.iter().map(|k| k.version).collect();
            bail!("unknown kernel {which:?} ({}, all)", versions.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Options> {
        let args: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        Options::parse(&args)
    }

    #[test]
    fn no_flags_is_every_kernel_and_vm_tier() {
        let options = parse("").unwrap();
        assert_eq!(options.kernels, KERNELS.to_vec());
        assert_eq!(options.tiers, VM_TIERS);
        assert_eq!(options.lsm, LSM_WITH_BPF);
        assert!(options.test_args.is_empty());
    }

    #[test]
    fn the_flags_say_what_runs() {
        let options =
            parse("--kernel 6.12 --tiers fentry,lsm --lsm bpf -- --exact tier_x").unwrap();
        assert_eq!(options.kernels, vec![KERNELS[1]]);
        assert_eq!(options.tiers, ["fentry", "lsm"]);
        assert_eq!(options.lsm, "bpf");
        assert_eq!(options.test_args, ["--exact", "tier_x"]);
        assert_eq!(parse("--kernel all").unwrap().kernels, KERNELS.to_vec());
    }

    #[test]
    fn unknown_kernels_tiers_and_flags_are_errors_naming_them() {
        for (line, named) in [
            ("--kernel 5.10", "5.10"),
            ("--tiers lsm,kprobe", "kprobe"),
            ("--kernels 6.1", "--kernels"),
        ] {
            let error = parse(line).unwrap_err().to_string();
            assert!(error.contains(named), "{line}: {error}");
        }
    }
}
