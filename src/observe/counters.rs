//! Kernel counters read again and again, turned into increases that never go backwards.
//! Shared by the exported counters (`metrics`) and the fallback detector (`fallback`), so
//! neither of those modules needs the other.

/// A kernel counter seen through successive reads, turned into increments that never go
/// backwards: a decrease means the counter restarted from zero (reset, driver reload, or a
/// wrap), so everything read since then is new.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Monotonic {
    last: u64,
}

impl Monotonic {
    pub fn starting_at(raw: u64) -> Self {
        Self { last: raw }
    }

    /// The increase since the previous read.
    pub fn observe(&mut self, raw: u64) -> u64 {
        let delta = if raw >= self.last {
            raw - self.last
        } else {
            raw
        };
        self.last = raw;
        delta
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_treats_a_decrease_as_a_restart_from_zero() {
        let mut m = Monotonic::starting_at(100);
        assert_eq!(m.observe(150), 50);
        assert_eq!(m.observe(150), 0);
        assert_eq!(m.observe(20), 20, "reset: the 20 since the restart are new");
        assert_eq!(m.observe(25), 5);
        let mut m = Monotonic::starting_at(u64::MAX - 1);
        assert_eq!(m.observe(3), 3, "64-bit wrap counts as a restart");
    }
}
