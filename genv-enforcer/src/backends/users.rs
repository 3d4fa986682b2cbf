//! User names from uids (`getpwuid_r`), cached: the passwd database may be NSS-backed
//! (LDAP, sssd), and a refusal storm must not turn into a lookup storm.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Answers kept at most; a node has far fewer users.
const MAX_CACHED: usize = 4096;

/// The user's name, or `None` where the uid has no passwd entry (a container's uid,
/// a deleted user). Answers, found or not, are kept for the daemon's life.
pub fn name_of(uid: u32) -> Option<String> {
    static CACHE: OnceLock<Mutex<HashMap<u32, Option<String>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(known) = cache.lock().ok().and_then(|c| c.get(&uid).cloned()) {
        return known;
    }
    let found = lookup(uid);
    if let Ok(mut cache) = cache.lock() {
        // Bounded: uids come from files anyone can write.
        if cache.len() >= MAX_CACHED {
            cache.clear();
        }
        cache.insert(uid, found.clone());
    }
    found
}

/// The user's name, or the uid as text.
pub fn display_name(uid: u32) -> String {
    name_of(uid).unwrap_or_else(|| uid.to_string())
}

fn lookup(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwuid_r writes into our buffers only.
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return None;
    }
    // SAFETY: on success pw_name points into `buf`, NUL-terminated.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    Some(name.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_has_a_name_and_an_unknown_uid_shows_as_a_number() {
        assert_eq!(name_of(0).as_deref(), Some("root"));
        assert_eq!(name_of(4_000_000), None);
        assert_eq!(display_name(4_000_000), "4000000");
        assert_eq!(display_name(0), "root");
    }
}
