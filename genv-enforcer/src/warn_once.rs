//! A warning said once, not at every turn of a loop while what it warns of lasts: said
//! again only once that is over ([`WarnOnce::clear`]), or (keyed by a reason) when the
//! reason changes.

/// What was warned of last, if it still holds: `WarnOnce<()>` for a condition that
/// holds or not, `WarnOnce<String>` for one whose reason may change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarnOnce<K = ()> {
    said: Option<K>,
}

impl<K> Default for WarnOnce<K> {
    fn default() -> Self {
        Self { said: None }
    }
}

impl<K: PartialEq> WarnOnce<K> {
    /// Whether to say it now: it was not said, or said for another reason. Said from
    /// then on.
    pub fn first(&mut self, about: K) -> bool {
        if self.said.as_ref() == Some(&about) {
            return false;
        }
        self.said = Some(about);
        true
    }

    /// What was warned of is over: the next warning is said again. Whether one had
    /// been said (to say that it is over).
    pub fn clear(&mut self) -> bool {
        self.said.take().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::WarnOnce;

    #[test]
    fn said_once_until_over_or_another_reason() {
        let mut once = WarnOnce::default();
        assert!(once.first(()));
        assert!(!once.first(()));
        assert!(once.clear());
        assert!(!once.clear());
        assert!(once.first(()));
        let mut why = WarnOnce::default();
        assert!(why.first("gone".to_owned()));
        assert!(!why.first("gone".to_owned()));
        assert!(why.first("denied".to_owned()));
    }
}
