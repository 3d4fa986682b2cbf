//! `genv-enforcer.conf(5)`: `enforce --config FILE`'s keys. A key is a long flag of
//! `enforce` (`super::super::config_file` turns each into that flag), so the keys are
//! read off the same definitions the parser uses: a flag added to `enforce` is a key
//! on this page without anyone writing it.

use clap::{Arg, ArgAction};
use clap_mangen::roff::{Roff, bold, italic, roman};

use super::super::config_file::{NEGATABLE, REFUSED};
use super::{MANUAL, Page, see_also, source};

/// The installed file the unit reads.
const FILE: &str = "/etc/genv-enforcer/config.toml";

/// The keys a file may give: `enforce`'s long flags (global ones included) but those
/// [`REFUSED`], and the hidden ones, left out here as `--help` leaves them out.
pub fn keys(enforce: &clap::Command) -> Vec<&Arg> {
    (enforce.get_arguments())
        .filter(|arg| !arg.is_hide_set())
        .filter(|arg| arg.get_long().is_some_and(|long| !REFUSED.contains(&long)))
        .collect()
}

pub fn page(cli: &clap::Command) -> Page {
    let enforce = (cli.find_subcommand("enforce")).expect("`enforce` is a command");
    let mut roff = Roff::new();
    let source = source();
    roff.control("TH", ["GENV-ENFORCER.CONF", "5", "", &source, MANUAL]);
    roff.control("SH", ["NAME"]);
    roff.text([roman(
        "genv-enforcer.conf - the flags of genv-enforcer enforce, in a TOML file",
    )]);
    roff.control("SH", ["SYNOPSIS"]);
    roff.text([bold(FILE)]);
    roff.control("br", []);
    roff.text([bold("genv-enforcer enforce --config "), italic("FILE")]);
    description(&mut roff);
    roff.control("SH", ["KEYS"]);
    for arg in keys(enforce) {
        key(&mut roff, arg);
    }
    example(&mut roff);
    roff.control("SH", ["FILES"]);
    roff.control("TP", []);
    roff.text([bold(FILE)]);
    roff.text([roman(
        "What the systemd unit genv-enforcer.service runs with (a conffile: an upgrade \
         keeps the administrator's changes).",
    )]);
    let pages = [("genv-enforcer-enforce", "1"), ("genv-enforcer", "1")];
    let roff = roff.render() + &see_also(&pages).render();
    Page {
        name: "genv-enforcer.conf".into(),
        section: "5",
        roff,
    }
}

fn description(roff: &mut Roff) {
    roff.control("SH", ["DESCRIPTION"]);
    roff.text([roman(
        "genv-enforcer enforce --config FILE reads flags from a TOML file: each key is \
         one long flag of genv-enforcer-enforce(1), without its dashes. The file's \
         flags come first and the command line's after, so a flag given on both is the \
         command line's. SIGHUP makes a running enforcer read the file again; what only a \
         restart changes is named in its log.",
    )]);
    roff.control("PP", []);
    roff.text([roman(format!(
        "A flag without a value is a boolean key: true gives the flag; false gives its \
         --no- form where it has one ({}), and nothing otherwise. A flag with a value \
         takes a string or a number; a repeatable one, a list of them, each given as one \
         flag. These keys are refused: {}.",
        NEGATABLE.join(", "),
        REFUSED.join(", ")
    ))]);
}

/// One key: `name = VALUE`, then the flag's own help.
fn key(roff: &mut Roff, arg: &Arg) {
    let long = arg.get_long().expect("keys are long flags");
    let value = arg.get_value_names().and_then(|names| names.first());
    let value = value.map_or_else(|| arg.get_id().as_str().to_uppercase(), |v| v.to_string());
    roff.control("TP", []);
    let form = match arg.get_action() {
        action if !action.takes_values() && NEGATABLE.contains(&long) => {
            vec![bold("true"), roman(" | "), bold("false")]
        }
        action if !action.takes_values() => vec![bold("true")],
        ArgAction::Append => vec![roman("["), italic(value), roman(", ...]")],
        _ => vec![italic(value)],
    };
    roff.text([vec![bold(long), roman(" = ")], form].concat());
    let help = arg.get_long_help().or(arg.get_help());
    let mut help = help.map(|h| h.to_string()).unwrap_or_default();
    // A boolean's default is `false`: only a value's default says anything.
    let defaults: Vec<String> = (arg.get_default_values().iter())
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if arg.get_action().takes_values() && !defaults.is_empty() {
        help.push_str(&format!(" [default: {}]", defaults.join(", ")));
    }
    roff.text([roman(help.replace('\n', " "))]);
}

fn example(roff: &mut Roff) {
    roff.control("SH", ["EXAMPLE"]);
    roff.control("nf", []);
    for line in [
        "event-driven = true",
        "non-env-processes = true      # false: --no-non-env-processes",
        "max-devices-per-user = 2",
        "max-devices-for-user = [\"alice=4\"]",
        "interval = 10",
    ] {
        roff.text([roman(line)]);
    }
    roff.control("fi", []);
}
