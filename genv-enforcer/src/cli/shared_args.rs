//! What `enforce` and `remote enforce` share: genv's rule flags, and the parsers of
//! the periods they take.

use clap::Args;

/// genv's rule flags, each with its `--no-` form; shared by `enforce` and `remote
/// enforce`.
#[derive(Debug, Args)]
pub struct RuleArgs {
    /// Terminate processes that are not running in a GPU environment [default: off].
    #[arg(long, overrides_with = "no_non_env_processes")]
    pub non_env_processes: bool,
    /// Do not terminate processes outside environments.
    #[arg(long, overrides_with = "non_env_processes")]
    pub no_non_env_processes: bool,

    /// Enforce environment attached devices [default: on].
    #[arg(long, overrides_with = "no_env_devices")]
    pub env_devices: bool,
    /// Do not enforce environment attached devices.
    #[arg(long, overrides_with = "env_devices")]
    pub no_env_devices: bool,

    /// Enforce environment memory capacity if set [default: on].
    #[arg(long, overrides_with = "no_env_memory")]
    pub env_memory: bool,
    /// Do not enforce environment memory capacity.
    #[arg(long, overrides_with = "env_memory")]
    pub no_env_memory: bool,

    /// Maximum allowed attached devices for each user.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub max_devices_per_user: Option<u32>,

    /// Per-user maximum of attached devices (with --max-devices-per-user).
    #[arg(long, value_name = "USERNAME=MAXIMUM", num_args = 1.., value_parser = user_limit, action = clap::ArgAction::Append)]
    pub max_devices_for_user: Vec<(String, u32)>,
}

/// The longest period a flag takes (a year): past it, time arithmetic overflows.
pub(super) const MAX_SECONDS: f64 = 365.0 * 86400.0;

pub(super) fn non_negative_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && (0.0..=MAX_SECONDS).contains(&s) => Ok(s),
        _ => Err(format!(
            "{text:?} is not a number of seconds from 0 to {MAX_SECONDS}"
        )),
    }
}

pub(super) fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s <= MAX_SECONDS => Ok(s),
        _ => Err(format!(
            "{text:?} is not a number of seconds above 0, up to {MAX_SECONDS}"
        )),
    }
}

fn user_limit(text: &str) -> Result<(String, u32), String> {
    let invalid = || format!("not a valid spec: {text} (expected USERNAME=MAXIMUM)");
    let (user, maximum) = text.split_once('=').ok_or_else(invalid)?;
    if user.is_empty() || maximum.contains('=') {
        return Err(invalid());
    }
    Ok((user.to_owned(), maximum.parse().map_err(|_| invalid())?))
}
