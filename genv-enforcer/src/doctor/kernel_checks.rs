//! The kernel's side of the checkup: BTF, the active LSMs, each open tier and
//! `--memory-at-alloc`'s probes, as the kernel answers a real load
//! ([`crate::kernel::tier_probe`]), and the tier the configuration would get.

use super::checked_item::{CheckedItem, ItemStatus};
use crate::alloc::MemoryAtAlloc;
use crate::kernel::cuda::{AllocProbes, RefusalAtAlloc};
use crate::kernel::tier_probe::{self, KernelAnswers};
use crate::kernel::{LoadOptions, Tier, TierChoice, btf, tier};
use crate::sync::KernelSettings;

/// The tier the configuration would run on, and why each other tier was refused.
#[derive(Debug, Default)]
pub struct TierOutcome {
    pub chosen: Option<Tier>,
    pub refused: Vec<(Tier, String)>,
}

/// The kernel's answers for `settings` (`None`: the configuration loads no programs;
/// the kernel is asked all the same, sized as the daemon's defaults); `probe`: whether
/// programs may be loaded at all (see `private_mounts`), else why not.
pub fn check(
    settings: Option<&KernelSettings>,
    probe: Result<(), String>,
) -> (Vec<CheckedItem>, TierOutcome) {
    let mut findings = vec![btf_finding(settings.is_some())];
    let answers = probe.and_then(|()| {
        tier_probe::ask(&load_options(settings)).map_err(|e| format!("before any tier: {e}"))
    });
    let answers = match answers {
        Ok(answers) => answers,
        Err(why) => KernelAnswers {
            tiers: Tier::BEST_FIRST.map(|t| (t, Err(why.clone()))).into(),
            lsms: None,
            memory_at_alloc: Some(Err(why)),
            uprobe_events: false,
        },
    };
    findings.push(lsm_finding(answers.lsms.as_deref()));
    let mut outcome = TierOutcome::default();
    let candidates = settings.map_or(TierChoice::Auto, |s| s.tier).candidates();
    for (tier, answer) in &answers.tiers {
        findings.push(tier_finding(*tier, answer, answers.lsms.as_deref()));
        match answer {
            Ok(_) if outcome.chosen.is_none() && candidates.contains(tier) => {
                outcome.chosen = Some(*tier)
            }
            Ok(_) => {}
            Err(why) => outcome.refused.push((*tier, why.clone())),
        }
    }
    findings.push(match &answers.memory_at_alloc {
        Some(loaded) => memory_at_alloc_finding(settings, loaded),
        None => memory_at_alloc_not_asked(answers.uprobe_events),
    });
    findings.push(configured_tier_finding(settings, &outcome));
    (findings, outcome)
}

/// What the daemon would load with these settings (nothing pinned whatever they say).
fn load_options(settings: Option<&KernelSettings>) -> LoadOptions {
    let memory_at_alloc = match settings.map(|s| s.memory_at_alloc) {
        None | Some(MemoryAtAlloc::Off) => AllocProbes::Off,
        Some(MemoryAtAlloc::Report | MemoryAtAlloc::Kill) => AllocProbes::Plain,
        Some(MemoryAtAlloc::Refuse) => AllocProbes::Refusing,
    };
    LoadOptions {
        choice: settings.map_or(TierChoice::Auto, |s| s.tier),
        ring_bytes: settings.and_then(|s| s.ring_bytes),
        pin_dir: None,
        compat_opens: settings.is_some_and(|s| s.deny.deny),
        log_decisions: settings.is_some_and(|s| s.bpf_log),
        memory_at_alloc,
    }
}

fn btf_finding(needed: bool) -> CheckedItem {
    match std::fs::metadata(btf::VMLINUX) {
        Ok(meta) => CheckedItem::ok("btf", format!("{} ({} bytes)", btf::VMLINUX, meta.len())),
        Err(e) => CheckedItem::new(
            "btf",
            if needed {
                ItemStatus::Fail
            } else {
                ItemStatus::Warn
            },
            format!("{}: {e}: no BPF tier can load", btf::VMLINUX),
        )
        .with_fix("a kernel built with CONFIG_DEBUG_INFO_BTF=y (Linux 5.8 or later)"),
    }
}

fn lsm_finding(lsms: Option<&str>) -> CheckedItem {
    let Some(list) = lsms.map(str::trim) else {
        return CheckedItem::new(
            "lsm list",
            ItemStatus::Warn,
            "/sys/kernel/security/lsm cannot be read (securityfs)",
        )
        .with_fix("a kernel with securityfs (CONFIG_SECURITYFS)");
    };
    match crate::kernel::bpf_lsm_active(list) {
        true => CheckedItem::ok("lsm list", format!("{list}: bpf is in it")),
        false => CheckedItem::new(
            "lsm list",
            ItemStatus::Warn,
            format!("{list}: no bpf in it"),
        )
        .with_fix(format!(
            "boot with lsm={list},bpf on the kernel's command line"
        )),
    }
}

fn tier_finding(tier: Tier, answer: &Result<String, String>, lsms: Option<&str>) -> CheckedItem {
    let item = format!("tier {tier}");
    let Err(why) = answer else {
        let done = answer.as_deref().unwrap_or_default();
        return CheckedItem::ok(item, format!("accepted: {done}"));
    };
    let fix = match tier {
        Tier::Lsm => match lsms.map(str::trim) {
            Some(list) if crate::kernel::bpf_lsm_active(list) => {
                "a kernel that lets root load BPF LSM programs (no sandbox forbidding them)"
                    .to_owned()
            }
            list => format!(
                "a kernel with CONFIG_BPF_LSM booted with lsm={},bpf",
                list.unwrap_or("...")
            ),
        },
        Tier::FmodRet | Tier::Fentry => "a kernel that lets root load BPF tracing programs \
             (CONFIG_DYNAMIC_FTRACE_WITH_DIRECT_CALLS; no lockdown=confidentiality or \
             sandbox forbidding them)"
            .to_owned(),
        Tier::Tracepoint => "tracefs and CONFIG_FTRACE_SYSCALLS".to_owned(),
    };
    CheckedItem::new(item, ItemStatus::Warn, format!("refused: {why}")).with_fix(fix)
}

fn memory_at_alloc_finding(
    settings: Option<&KernelSettings>,
    answer: &Result<RefusalAtAlloc, String>,
) -> CheckedItem {
    let asked = settings.map_or(MemoryAtAlloc::Off, |s| s.memory_at_alloc);
    let item = "memory-at-alloc";
    let loads = "the libcuda uprobes load and verify, their kill (bpf_send_signal) included";
    match answer {
        Ok(RefusalAtAlloc::Refused(why)) => CheckedItem::new(
            item,
            match asked {
                MemoryAtAlloc::Refuse => ItemStatus::Warn,
                _ => ItemStatus::Ok,
            },
            format!("{loads}; refuse is refused ({why}): it kills instead"),
        )
        .with_fix("a kernel that lets uprobe programs set registers (7 and later)"),
        Ok(_) => CheckedItem::ok(item, format!("{loads}; refuse returns out-of-memory")),
        Err(why) => CheckedItem::new(
            item,
            match asked {
                MemoryAtAlloc::Off => ItemStatus::Warn,
                _ => ItemStatus::Fail,
            },
            format!("the libcuda probes cannot load: {why}"),
        )
        .with_fix("a kernel with uprobes (CONFIG_UPROBE_EVENTS) and bpf_send_signal (5.3+)"),
    }
}

/// `--memory-at-alloc off`: its probes are not loaded (a dozen programs to verify);
/// what the kernel offers them is said all the same.
fn memory_at_alloc_not_asked(uprobe_events: bool) -> CheckedItem {
    let uprobes = match uprobe_events {
        true => "tracefs has uprobe_events",
        false => "tracefs has no uprobe_events (CONFIG_UPROBE_EVENTS)",
    };
    CheckedItem::new(
        "memory-at-alloc",
        ItemStatus::Absent,
        format!(
            "not asked, its probes not loaded ({uprobes}); with --memory-at-alloc kill or \
             refuse, doctor loads them here"
        ),
    )
}

/// What the configuration's `--bpf-tier` gets here.
fn configured_tier_finding(
    settings: Option<&KernelSettings>,
    outcome: &TierOutcome,
) -> CheckedItem {
    let Some(settings) = settings else {
        let best = outcome.chosen.map_or("none".to_owned(), |t| t.to_string());
        return CheckedItem::new(
            "event-driven",
            ItemStatus::Absent,
            format!(
                "not asked: the full cycle alone (with --event-driven this kernel gives {best})"
            ),
        );
    };
    let asked = format!("--bpf-tier {}", settings.tier.name());
    match (settings.tier, outcome.chosen) {
        (TierChoice::None, _) => CheckedItem::ok(
            "event-driven",
            format!("{asked}: no kernel programs, the full cycle alone"),
        ),
        (_, Some(chosen)) => CheckedItem::ok(
            "event-driven",
            format!(
                "{asked}: the {chosen} tier; GPU opens from outside any environment are {}",
                tier::guarantee(Some(chosen), settings.deny)
            ),
        ),
        (_, None) => CheckedItem::new(
            "event-driven",
            ItemStatus::Fail,
            format!("{asked}: the kernel refuses every tier asked for"),
        )
        .with_fix("see the tiers above, or --bpf-tier none (the full cycle alone)"),
    }
}
