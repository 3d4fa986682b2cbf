//! A token bucket: up to `burst` tokens, one more every `every`. Full when made (and
//! made without a clock, so that a bucket can be a constant).

use std::time::{Duration, Instant};

/// A bucket's size and how fast it refills.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    pub burst: u32,
    pub every: Duration,
}

impl Rate {
    fn per_second(self) -> f64 {
        1.0 / self.every.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct TokenBucket {
    rate: Rate,
    tokens: f64,
    /// When `tokens` was counted (`None`: full since it was made).
    at: Option<Instant>,
}

impl TokenBucket {
    pub const fn full(rate: Rate) -> Self {
        Self {
            rate,
            tokens: rate.burst as f64,
            at: None,
        }
    }

    pub fn rate(&self) -> Rate {
        self.rate
    }

    /// Its tokens at `now`.
    fn tokens(&self, now: Instant) -> f64 {
        let burst = f64::from(self.rate.burst);
        let Some(at) = self.at else {
            return burst;
        };
        let elapsed = now.saturating_duration_since(at).as_secs_f64();
        (self.tokens + elapsed * self.rate.per_second()).min(burst)
    }

    /// Whether a token is there now (none is taken).
    pub fn has(&self, now: Instant) -> bool {
        self.tokens(now) >= 1.0
    }

    /// Takes a token if one is there; whether it was.
    pub fn take(&mut self, now: Instant) -> bool {
        let tokens = self.tokens(now);
        if tokens < 1.0 {
            return false;
        }
        self.tokens = tokens - 1.0;
        // Never back: an earlier `now` would credit the time since it a second time.
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
        true
    }

    /// When a token will be there, if none is at `now`.
    pub fn next_at(&self, now: Instant) -> Instant {
        let missing = (1.0 - self.tokens(now)).max(0.0);
        now + Duration::from_secs_f64(missing / self.rate.per_second())
    }

    /// A token taken that was not used after all.
    pub fn give_back(&mut self) {
        self.tokens = (self.tokens + 1.0).min(f64::from(self.rate.burst));
    }

    /// Whether it is as good as new (nothing to remember of it).
    pub fn is_full(&self, now: Instant) -> bool {
        self.tokens(now) >= f64::from(self.rate.burst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_refills_one_token_per_period_up_to_its_burst() {
        let t0 = Instant::now();
        let second = Duration::from_secs(1);
        let mut bucket = TokenBucket::full(Rate {
            burst: 2,
            every: second,
        });
        assert!(bucket.take(t0) && bucket.take(t0));
        assert!(!bucket.take(t0 + second / 2), "empty");
        assert_eq!(bucket.next_at(t0 + second / 2), t0 + second);
        assert!(bucket.take(t0 + second), "one back after a period");
        assert!(!bucket.take(t0 + second));
        assert!(
            bucket.is_full(t0 + 10 * second),
            "never more than its burst"
        );
        assert!(bucket.take(t0 + 10 * second) && bucket.take(t0 + 10 * second));
        assert!(!bucket.has(t0 + 10 * second));
        bucket.give_back();
        assert!(bucket.take(t0 + 10 * second), "a token given back");
    }

    /// A `now` earlier than the last take's (two callers' clocks read in another
    /// order) credits no time twice.
    #[test]
    fn an_earlier_now_credits_nothing_again() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut bucket = TokenBucket::full(Rate {
            burst: 2,
            every: Duration::from_secs(1),
        });
        assert!(bucket.take(t1));
        assert!(
            bucket.take(t0),
            "the second token, taken with an earlier clock"
        );
        assert!(!bucket.has(t1), "both were taken by t1; none came back");
    }
}
