//! The one runtime the drivers read time from, wait on and spawn with (quinn's `Runtime`: `now`,
//! timers, `spawn`). The agent, the mesh and the process groups take it once (in their
//! options) and no other module of theirs reads `Instant::now()` or calls `tokio::time`: every
//! deadline is computed from [`Runtime::now`] and every wait ends on [`Runtime::sleep_until`].
//! The adapter over tokio's clock, `TokioRuntime`, lives in `tensorwire-mesh` (the lowest crate
//! that runs on tokio); under a paused tokio clock the drivers' tests then run in virtual time,
//! without real sleeps.

use std::future::Future;
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::{Duration, Instant};

/// A boxed future of the runtime's (sleeps, spawned tasks).
pub type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Where a driver reads the time, how it waits until a given time, and how it starts a task.
pub trait Runtime: Send + Sync + std::fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Instant;

    /// A future that completes once [`now`](Self::now) has reached `at`.
    fn sleep_until(&self, at: Instant) -> BoxFuture;

    /// Runs `task` on its own; the returned future completes when it has ended (dropping it
    /// does not stop the task).
    fn spawn(&self, task: BoxFuture) -> BoxFuture;
}

/// `now + after`, or about 30 years from now when that is past the clock's range: a caller's
/// `Duration::MAX` (an init or shutdown timeout) means "no deadline" and must not panic.
pub fn deadline_after(now: Instant, after: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(30 * 365 * 86_400);
    now.checked_add(after.min(FAR))
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

/// A deadline passed before the future it bounded completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the deadline passed")]
pub struct Elapsed;

impl dyn Runtime {
    /// `after` from now on this runtime's clock (far in the future for `Duration::MAX`).
    pub fn deadline_after(&self, after: Duration) -> Instant {
        deadline_after(self.now(), after)
    }

    /// Waits `after` on this runtime's clock.
    pub fn sleep(&self, after: Duration) -> BoxFuture {
        self.sleep_until(self.deadline_after(after))
    }

    /// `fut`'s output, unless `at` comes first. `fut` is polled first, so a future that is
    /// ready when the deadline is too still gives its output.
    pub async fn timeout_at<F: Future>(&self, at: Instant, fut: F) -> Result<F::Output, Elapsed> {
        let mut fut = pin!(fut);
        let mut sleep = self.sleep_until(at);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = fut.as_mut().poll(cx) {
                return Poll::Ready(Ok(out));
            }
            sleep.as_mut().poll(cx).map(|()| Err(Elapsed))
        })
        .await
    }

    /// `fut`'s output, unless `after` passes first.
    pub async fn timeout<F: Future>(&self, after: Duration, fut: F) -> Result<F::Output, Elapsed> {
        let at = self.deadline_after(after);
        self.timeout_at(at, fut).await
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
}
