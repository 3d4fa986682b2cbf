//! What a `vm-test` run showed: one [`Run`] per kernel booted, each tier's result, and
//! the failures named by kernel and tier.

use std::time::Duration;

use super::Series;

/// What the boots showed, one run per kernel, in order.
pub struct Outcome {
    pub runs: Vec<Run>,
}

/// One kernel's boot.
pub struct Run {
    pub kernel: Series,
    /// The package booted, e.g. `linux-image-6.12.117+deb12-amd64`.
    pub package: String,
    /// The guest script's exit status (0: every tier passed).
    pub status: i32,
    /// Each tier that reported its end, in order: (tier, passed, how long it took).
    pub tiers: Vec<(String, bool, Duration)>,
    /// Each suite that ended: (tier, suite, how long it took).
    pub suites: Vec<(String, String, Duration)>,
    /// The tiers the run was asked for.
    pub asked: Vec<String>,
    /// Every line the guest printed.
    pub console: Vec<String>,
    pub booted: Duration,
    pub total: Duration,
    /// Why the kernel was booted a second time, if it was (`patch_race`).
    pub rebooted: Option<String>,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.runs.iter().all(|run| run.status == 0)
    }

    /// Every line every guest printed.
    pub fn console(&self) -> impl Iterator<Item = &String> {
        self.runs.iter().flat_map(|run| &run.console)
    }

    /// What failed, each naming its kernel and tier.
    pub fn failures(&self) -> Vec<String> {
        let mut failures = Vec::new();
        for run in &self.runs {
            let version = run.kernel.version;
            let before = failures.len();
            for tier in &run.asked {
                match run.tiers.iter().find(|(t, ..)| t == tier) {
                    Some((_, true, _)) => {}
                    Some((_, false, _)) => failures.push(format!("kernel {version}, tier {tier}")),
                    None => failures.push(format!(
                        "kernel {version}, tier {tier} (never finished; the guest exited {})",
                        run.status
                    )),
                }
            }
            if run.status != 0 && failures.len() == before {
                failures.push(format!(
                    "kernel {version} (the guest exited {})",
                    run.status
                ));
            }
        }
        failures
    }
}

impl Run {
    /// One line: the kernel, its boot, and each tier's result and time.
    pub fn summary(&self) -> String {
        let tiers: Vec<String> = self
            .tiers
            .iter()
            .map(|(tier, passed, took)| {
                let result = if *passed { "passed" } else { "FAILED" };
                format!("{tier}: {result} in {took:.0?}")
            })
            .collect();
        format!(
            "kernel {} ({}): boot {:.1?}, suites {:.0?} ({}), total {:.0?}{}",
            self.kernel.version,
            self.package,
            self.booted,
            self.total.saturating_sub(self.booted),
            tiers.join("; "),
            self.total,
            (self.rebooted.as_ref()).map_or(String::new(), |why| format!("; {why}"))
        )
    }
}
