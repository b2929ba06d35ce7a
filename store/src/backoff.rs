//! Exponential backoff with jitter, for connection retries.

use std::time::Duration;

use rand::Rng;

/// Delays that double from `initial` up to `max`, each drawn uniformly from the upper half of
/// the current step so that many ranks retrying at once spread out.
#[derive(Debug, Clone)]
pub struct Backoff {
    step: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at `initial` (at least 1 ms) and never exceeds `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        let step = initial.max(Duration::from_millis(1));
        Backoff {
            step: step.min(max.max(step)),
            max: max.max(step),
        }
    }

    /// The next delay to sleep.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.step;
        self.step = (self.step * 2).min(self.max);
        let low = step / 2;
        let jitter = rand::thread_rng().gen_range(0..=(step - low).as_micros() as u64);
        low + Duration::from_micros(jitter)
    }
}

impl Default for Backoff {
    /// 10 ms doubling to 1 s.
    fn default() -> Self {
        Backoff::new(Duration::from_millis(10), Duration::from_secs(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_stay_in_their_window_and_are_capped() {
        let mut b = Backoff::new(Duration::from_millis(8), Duration::from_millis(100));
        let mut step = Duration::from_millis(8);
        for _ in 0..10 {
            let d = b.next_delay();
            assert!(
                d >= step / 2 && d <= step,
                "{d:?} outside [{:?}, {step:?}]",
                step / 2
            );
            step = (step * 2).min(Duration::from_millis(100));
        }
    }

    #[test]
    fn delays_are_jittered() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..20 {
            let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
            seen.insert(b.next_delay());
        }
        assert!(seen.len() > 1);
    }
}
