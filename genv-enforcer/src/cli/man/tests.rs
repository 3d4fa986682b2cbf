use super::*;

/// A page's text with roff's escaped hyphens (`\-`) and font changes taken out.
fn plain(page: &Page) -> String {
    (page.roff.replace("\\-", "-"))
        .replace("\\fB", "")
        .replace("\\fI", "")
        .replace("\\fR", "")
}

/// Whether `text` holds `flag` as a whole word (`--deny`, not `--deny-root`).
fn names(text: &str, flag: &str) -> bool {
    text.match_indices(flag).any(|(at, _)| {
        let next = text[at + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

/// Every visible command at every depth, with its page's name.
fn commands(cmd: &clap::Command, name: String, found: &mut Vec<(String, clap::Command)>) {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        commands(sub, format!("{name}-{}", sub.get_name()), found);
    }
    found.push((name, cmd.clone()));
}

#[test]
fn every_flag_of_every_command_is_in_its_page() {
    let pages = pages();
    let mut all = Vec::new();
    commands(&command(), "genv-enforcer".into(), &mut all);
    assert!(all.len() >= 9, "{} commands", all.len());
    for (name, cmd) in all {
        let page = (pages.iter().find(|p| p.name == name && p.section == "1"))
            .unwrap_or_else(|| panic!("no page {name}(1)"));
        let text = plain(page);
        for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
            let long = arg.get_long().map(|l| format!("--{l}"));
            let short = arg.get_short().map(|s| format!("-{s}"));
            for flag in [long, short].into_iter().flatten() {
                assert!(names(&text, &flag), "{name}(1) does not name {flag}");
            }
        }
    }
}

/// man-db finds `man genv-enforcer remote enforce`'s page by the command's path.
#[test]
fn a_commands_page_is_named_by_its_path_and_the_hidden_one_has_none() {
    let names: Vec<String> = pages().iter().map(Page::file_name).collect();
    for expected in [
        "genv-enforcer.1",
        "genv-enforcer-enforce.1",
        "genv-enforcer-remote-enforce.1",
        "genv-enforcer-usage-snapshot.1",
        "genv-enforcer.conf.5",
        "genv.8",
    ] {
        assert!(names.iter().any(|n| n == expected), "{expected}: {names:?}");
    }
    assert!(
        !names
            .iter()
            .any(|n| n.contains("manual-pages") || n.contains("help"))
    );
    let unique: std::collections::BTreeSet<&String> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
}

/// Every key `enforce --config` accepts: the long flags of `enforce` as clap builds
/// them (global ones included) that the file's reader does not refuse.
#[test]
fn the_configuration_page_names_every_key_the_file_accepts() {
    let cli = command();
    let enforce = cli.find_subcommand("enforce").unwrap();
    let page = pages().into_iter().find(|p| p.name == "genv-enforcer.conf");
    let text = plain(&page.unwrap());
    let mut checked = 0;
    for arg in enforce.get_arguments().filter(|a| !a.is_hide_set()) {
        let Some(key) = arg.get_long() else { continue };
        let listed = text.contains(&format!("\n{key} = "));
        let refused = super::super::config_file::REFUSED.contains(&key);
        assert_eq!(
            listed, !refused,
            "{key}: listed {listed}, refused {refused}"
        );
        checked += 1;
    }
    assert!(checked > 30, "{checked} keys");
    assert!(
        text.contains("\nnon-env-processes = true | false\n"),
        "{text}"
    );
    assert!(text.contains("\nmax-devices-for-user = [USERNAME=MAXIMUM, ...]\n"));
}
