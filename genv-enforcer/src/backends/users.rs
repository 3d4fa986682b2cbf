//! User names from uids (`getpwuid_r`), cached: the passwd database may be NSS-backed
//! (LDAP, sssd), and a refusal storm must not turn into a lookup storm. A lookup that
//! does not answer within [`LOOKUP_WAIT`] goes on in its own thread: the name is shown as
//! the uid meanwhile, and the daemon's event loop never waits on a slow directory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::Duration;

/// Answers kept at most; a node has far fewer users.
const MAX_CACHED: usize = 4096;
/// How long a caller waits for a lookup not cached yet.
pub const LOOKUP_WAIT: Duration = Duration::from_millis(100);
/// How long a usage snapshot (`usage snapshot`, `usage watch`: processes of their own, off
/// any event loop) waits: a name missing there is an environment other hosts do not
/// count against anyone, so a busy machine's slow thread must not pass for a uid with
/// no name (seen in CI: 100 ms was not enough beside two TCG guests).
pub const SNAPSHOT_LOOKUP_WAIT: Duration = Duration::from_secs(2);

/// The user's name, or `None` where the uid has no passwd entry (a container's uid,
/// a deleted user) or the lookup has not answered yet. Answers, found or not, are kept
/// for the daemon's life.
pub fn name_of(uid: u32) -> Option<String> {
    name_within(uid, LOOKUP_WAIT)
}

/// [`name_of`], waiting up to `wait` for a lookup not cached yet: for a thread of its
/// own, off the event loop, which can wait for a slow directory (or a slow machine).
pub fn name_within(uid: u32, wait: Duration) -> Option<String> {
    static NAMES: OnceLock<Names> = OnceLock::new();
    NAMES.get_or_init(|| Names::new(lookup)).name_of(uid, wait)
}

/// [`name_of`] for a usage snapshot, waiting up to [`SNAPSHOT_LOOKUP_WAIT`].
pub fn name_for_snapshot(uid: u32) -> Option<String> {
    name_within(uid, SNAPSHOT_LOOKUP_WAIT)
}

/// The user's name, or the uid as text.
pub fn display_name(uid: u32) -> String {
    name_of(uid).unwrap_or_else(|| uid.to_string())
}

#[derive(Clone)]
enum Entry {
    Known(Option<String>),
    /// A lookup runs in its own thread; it fills the entry when it answers.
    Pending,
}

type Lookup = fn(u32) -> Option<String>;

struct Names {
    cache: Arc<Mutex<HashMap<u32, Entry>>>,
    lookup: Lookup,
}

impl Names {
    fn new(lookup: Lookup) -> Self {
        Self {
            cache: Default::default(),
            lookup,
        }
    }

    fn name_of(&self, uid: u32, wait: Duration) -> Option<String> {
        {
            let mut cache = self.cache.lock().ok()?;
            match cache.get(&uid) {
                Some(Entry::Known(known)) => return known.clone(),
                Some(Entry::Pending) => return None,
                None => {}
            }
            // Bounded: uids come from files anyone can write.
            if cache.len() >= MAX_CACHED {
                cache.retain(|_, entry| matches!(entry, Entry::Pending));
            }
            cache.insert(uid, Entry::Pending);
        }
        let (tx, rx) = mpsc::channel();
        let (cache, lookup) = (Arc::clone(&self.cache), self.lookup);
        let spawned = std::thread::Builder::new()
            .name("getpwuid".into())
            .spawn(move || {
                let found = lookup(uid);
                if let Ok(mut cache) = cache.lock() {
                    cache.insert(uid, Entry::Known(found.clone()));
                }
                let _ = tx.send(found);
            });
        if spawned.is_err() {
            let _ = self.cache.lock().map(|mut c| c.remove(&uid));
            return None;
        }
        rx.recv_timeout(wait).ok().flatten()
    }
}

fn lookup(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `passwd` is plain data (integers and pointers): all-zero is a valid
    // value, which getpwuid_r overwrites.
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
    use std::time::Instant;

    #[test]
    fn root_has_a_name_and_an_unknown_uid_shows_as_a_number() {
        assert_eq!(name_of(0).as_deref(), Some("root"));
        assert_eq!(name_of(4_000_000), None);
        assert_eq!(display_name(4_000_000), "4000000");
        assert_eq!(display_name(0), "root");
    }

    #[test]
    fn a_snapshot_waits_out_a_lookup_a_busy_machine_makes_slow() {
        /// A lookup that answers after 300 ms, as a starved thread may.
        fn slow(uid: u32) -> Option<String> {
            std::thread::sleep(Duration::from_millis(300));
            Some(format!("user{uid}"))
        }
        // The event loop's wait gives up on it; a snapshot's does not.
        assert_eq!(Names::new(slow).name_of(7, LOOKUP_WAIT), None);
        let name = Names::new(slow).name_of(7, SNAPSHOT_LOOKUP_WAIT);
        assert_eq!(name.as_deref(), Some("user7"));
    }

    #[test]
    fn a_directory_that_does_not_answer_never_holds_the_caller() {
        use std::sync::atomic::{AtomicBool, Ordering};
        static RELEASED: AtomicBool = AtomicBool::new(false);
        /// A directory that answers only once the test lets it.
        fn stuck(uid: u32) -> Option<String> {
            while !RELEASED.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
            Some(format!("user{uid}"))
        }
        let names = Names::new(stuck);
        // The lookup cannot answer yet: both calls come back without it.
        assert_eq!(names.name_of(7, Duration::from_millis(20)), None, "not yet");
        assert_eq!(
            names.name_of(7, Duration::from_millis(20)),
            None,
            "still pending"
        );
        RELEASED.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(30);
        while names.name_of(7, Duration::ZERO).is_none() {
            assert!(Instant::now() < deadline, "the answer never arrived");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(names.name_of(7, Duration::ZERO).as_deref(), Some("user7"));
    }
}
