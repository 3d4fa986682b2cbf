//! `genv(8)`: the `genv` front (`deploy/genv`) the packages install as `/usr/sbin/genv`
//! and first on users' `PATH`. It is a shell script, with no clap definitions to read:
//! this page says what its header says.

use clap_mangen::roff::{Roff, bold, italic, roman};

use super::{MANUAL, Page, see_also, source};

pub fn page() -> Page {
    let mut roff = Roff::new();
    let source = source();
    roff.control("TH", ["GENV", "8", "", &source, MANUAL]);
    roff.control("SH", ["NAME"]);
    roff.text([roman(
        "genv - genv-enforcer's genv-compatible front: genv enforce run by genv-enforcer",
    )]);
    roff.control("SH", ["SYNOPSIS"]);
    for (command, rest) in [
        ("genv enforce ", "[OPTIONS]"),
        ("genv usage ", "COMMAND [OPTIONS]"),
        ("genv why ", "[PID] [OPTIONS]"),
        ("genv ", "COMMAND [ARGS]"),
    ] {
        roff.text([bold(command), italic(rest)]);
        roff.control("br", []);
    }
    roff.control("SH", ["DESCRIPTION"]);
    roff.text([roman(
        "This genv is genv-enforcer's front, in place of genv's own command. The packages \
         install it as /usr/lib/genv-enforcer/front/genv, whose directory \
         /etc/profile.d/genv-enforcer.sh puts first on users' PATH, and link it as \
         /usr/sbin/genv for root and sudo (under /usr/local when built from source). It \
         chooses, by the command:",
    )]);
    for (command, what) in COMMANDS {
        roff.control("TP", []);
        roff.text([bold(command)]);
        roff.text([roman(what)]);
    }
    environment(&mut roff);
    roff.control("SH", ["SECURITY"]);
    roff.text([roman(
        "genv-enforcer is run only if it and every directory above it are root's (or, for \
         an ordinary user, theirs) and writable by no one else.",
    )]);
    let pages = [
        ("genv-enforcer", "1"),
        ("genv-enforcer-enforce", "1"),
        ("genv-enforcer-why", "1"),
    ];
    Page {
        name: "genv".into(),
        section: "8",
        roff: roff.render() + &see_also(&pages).render(),
    }
}

/// What each command runs.
const COMMANDS: [(&str, &str); 4] = [
    (
        "genv enforce",
        "runs genv-enforcer enforce with the same arguments: genv's flags, rules, output \
         and state files, and the enforcer's own (--event-driven and all); see \
         genv-enforcer-enforce(1).",
    ),
    (
        "genv usage",
        "runs genv-enforcer usage when GENV_FRONT_USAGE=1, the real genv's otherwise.",
    ),
    (
        "genv why",
        "runs genv-enforcer why: what the enforcer did to your processes, and why (genv \
         has no why).",
    ),
    (
        "anything else",
        "runs the real, Python genv, untouched: the next genv on PATH that is not a front \
         like this one.",
    ),
];

fn environment(roff: &mut Roff) {
    roff.control("SH", ["ENVIRONMENT"]);
    for (name, what) in [
        (
            "GENV_FRONT_REAL",
            "The real genv to run, instead of the next one on PATH.",
        ),
        (
            "GENV_ENFORCER",
            "The genv-enforcer to run, instead of the one installed with this front.",
        ),
        (
            "GENV_FRONT_USAGE",
            "1: genv usage runs genv-enforcer usage.",
        ),
    ] {
        roff.control("TP", []);
        roff.text([bold(name)]);
        roff.text([roman(what)]);
    }
    roff.control("PP", []);
    roff.text([roman(
        "Root ignores GENV_FRONT_REAL and GENV_ENFORCER: under su or a lax sudo they could \
         be a user's.",
    )]);
}
