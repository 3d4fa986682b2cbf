//! The manual pages, made from the command line's own definitions (clap's, rendered by
//! clap_mangen), so that a flag or a command added anywhere is in its page:
//! `genv-enforcer(1)`, then one page per visible command at every depth, named by its
//! path (`genv-enforcer-enforce(1)`, `genv-enforcer-remote-enforce(1)`: man-db's
//! `man genv-enforcer enforce` finds a subcommand's page by that name); the
//! configuration file's keys (`genv-enforcer.conf(5)`, [`conf`]); and the `genv` front
//! (`genv(8)`, [`front`]). The packages install them gzip'd under `/usr/share/man`,
//! written by the hidden `manual-pages DIR` command (`xtask/src/layout.rs`).

mod conf;
mod front;

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::CommandFactory;
use clap_mangen::roff::{Roff, bold, roman};

use super::args::Cli;

/// One manual page: `name(section)` and its roff source.
pub struct Page {
    pub name: String,
    pub section: &'static str,
    pub roff: String,
}

impl Page {
    /// The file it is installed as, before compression: `genv-enforcer-enforce.1`.
    pub fn file_name(&self) -> String {
        format!("{}.{}", self.name, self.section)
    }
}

/// The manual every page's title line names.
const MANUAL: &str = "genv-enforcer manual";

/// The title line's source: the package and its version.
fn source() -> String {
    format!("genv-enforcer {}", env!("CARGO_PKG_VERSION"))
}

/// The command line as parsed, built (global flags propagated to every command, each
/// command's display name its path), without clap's `help` command, which is no page.
pub fn command() -> clap::Command {
    let mut cli = Cli::command().disable_help_subcommand(true);
    cli.build();
    cli
}

/// Every page, the commands' first (`genv-enforcer(1)` at their head).
pub fn pages() -> Vec<Page> {
    let cli = command();
    let mut pages = Vec::new();
    command_pages(&cli, None, &mut pages);
    pages.push(conf::page(&cli));
    pages.push(front::page());
    pages
}

/// `cmd`'s page, then its visible commands', depth first; `parent` is the page above.
fn command_pages(cmd: &clap::Command, parent: Option<&str>, pages: &mut Vec<Page>) {
    let name = cmd.get_display_name().unwrap_or(cmd.get_name()).to_owned();
    let man = clap_mangen::Man::new(cmd.clone())
        .title(name.clone())
        .source(source())
        .manual(MANUAL);
    let mut roff = Vec::new();
    man.render(&mut roff).expect("rendering into memory");
    let mut roff = String::from_utf8(roff).expect("roff made of UTF-8 text");
    let mut related: Vec<(&str, &str)> = parent.map(|p| (p, "1")).into_iter().collect();
    if parent.is_none() || name == "genv-enforcer-enforce" {
        related.push(("genv-enforcer.conf", "5"));
    }
    if parent.is_none() {
        related.push(("genv", "8"));
    }
    roff.push_str(&see_also(&related).render());
    pages.push(Page {
        name: name.clone(),
        section: "1",
        roff,
    });
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        command_pages(sub, Some(&name), pages);
    }
}

/// A SEE ALSO section naming `pages` (name, section), and the documentation the
/// packages install beside the README.
fn see_also(pages: &[(&str, &str)]) -> Roff {
    let mut roff = Roff::new();
    roff.control("SH", ["SEE ALSO"]);
    let mut line = Vec::new();
    for (i, (name, section)) in pages.iter().enumerate() {
        let comma = if i + 1 < pages.len() { ", " } else { "" };
        line.push(bold(*name));
        line.push(roman(format!("({section}){comma}")));
    }
    roff.text(line);
    roff.control("PP", []);
    roff.text([roman(
        "The README and the guides under /usr/share/doc/genv-enforcer \
         (/usr/local/share/doc/genv-enforcer when built from source).",
    )]);
    roff
}

/// `manual-pages DIR`: every page into `dir`, one file each (`genv-enforcer.1`).
pub fn write(dir: &Path) -> Result<ExitCode> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for page in pages() {
        let path = dir.join(page.file_name());
        std::fs::write(&path, &page.roff).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests;
