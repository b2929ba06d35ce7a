//! The one clock the agent reads time from and waits on (quinn's `Runtime::now` and
//! `new_timer`): the endpoint's deadlines are computed from it, and the driver sleeps on it.
//!
//! The default, [`TokioClock`], is tokio's clock: the real time in production, and virtual time
//! under a paused runtime (`tokio::time::pause`, `#[tokio::test(start_paused = true)]`), where
//! agent tests then run without real sleeps. The driver never reads `std::time::Instant::now()`
//! for a protocol decision: that clock does not stop when tokio's is paused.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

/// `now + after`, or about 30 years from now when that is past the clock's range: a caller's
/// `Duration::MAX` (init timeout, shutdown timeout) means "no deadline" and must not panic.
pub(crate) fn deadline_after(now: Instant, after: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(30 * 365 * 86_400);
    now.checked_add(after.min(FAR))
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

/// [`deadline_after`] on tokio's clock.
pub(crate) fn tokio_deadline_after(after: Duration) -> tokio::time::Instant {
    tokio::time::Instant::from_std(deadline_after(
        tokio::time::Instant::now().into_std(),
        after,
    ))
}

/// Where the agent reads the time, and how it waits until a given time.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Instant;

    /// A future that completes once [`now`](Self::now) has reached `at`.
    fn sleep_until(&self, at: Instant) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// tokio's clock: real time, or virtual time when the runtime's clock is paused.
#[derive(Debug, Default, Clone, Copy)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn sleep_until(&self, at: Instant) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(at)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_past_the_clocks_range_is_far_not_a_panic() {
        let now = Instant::now();
        let far = deadline_after(now, Duration::MAX);
        assert!(far > now + Duration::from_secs(365 * 86_400));
        assert_eq!(
            deadline_after(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_tokio_clock_follows_a_paused_runtime() {
        let clock = TokioClock;
        let t0 = clock.now();
        clock.sleep_until(t0 + Duration::from_secs(3600)).await;
        // An hour of virtual time passed at once; the real clock did not move that much.
        assert!(clock.now() >= t0 + Duration::from_secs(3600));
        assert!(std::time::Instant::now() < t0 + Duration::from_secs(3600));
    }
}
