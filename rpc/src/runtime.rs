//! The one runtime the agent reads time from, waits on and spawns with (quinn's `Runtime`:
//! `now`, timers, `spawn`), injected once through [`RpcOptions::runtime`](crate::RpcOptions).
//!
//! Every deadline of the agent is computed from [`Runtime::now`], every wait ends on
//! [`Runtime::sleep_until`], and no other module of this crate reads `Instant::now()` or
//! calls `tokio::time`. The default, [`TokioRuntime`], is tokio's clock: real time in
//! production, and virtual time under a paused runtime (`tokio::time::pause`,
//! `#[tokio::test(start_paused = true)]`), where agent tests then run without real sleeps.
//! `std::time::Instant::now()` would not do: that clock does not stop when tokio's is paused.
//!
//! The agent's own tasks (readers, writers, handlers) are tracked in tokio `JoinSet`s, so
//! that shutdown can end and await them; [`Runtime::spawn`] is for the tasks that must outlive
//! the caller's (the last stage of a shutdown).

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

/// A boxed future of the runtime's (sleeps, spawned tasks).
pub type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// `now + after`, or about 30 years from now when that is past the clock's range: a caller's
/// `Duration::MAX` (init timeout, shutdown timeout) means "no deadline" and must not panic.
pub(crate) fn deadline_after(now: Instant, after: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(30 * 365 * 86_400);
    now.checked_add(after.min(FAR))
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

/// `at` as a tokio instant, for the deadlines of the mesh's dial and hello (`dynamic.rs`), which
/// wait on tokio's clock.
pub(crate) fn tokio_instant(at: Instant) -> tokio::time::Instant {
    tokio::time::Instant::from_std(at)
}

/// Where the agent reads the time, how it waits until a given time, and how it starts a task.
pub trait Runtime: Send + Sync + std::fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Instant;

    /// A future that completes once [`now`](Self::now) has reached `at`.
    fn sleep_until(&self, at: Instant) -> BoxFuture;

    /// Runs `task` on its own; the returned future completes when it has ended (dropping it
    /// does not stop the task).
    fn spawn(&self, task: BoxFuture) -> BoxFuture;
}

/// A deadline passed before the future it bounded completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Elapsed;

impl dyn Runtime {
    /// `after` from now on this runtime's clock (far in the future for `Duration::MAX`).
    pub(crate) fn deadline_after(&self, after: Duration) -> Instant {
        deadline_after(self.now(), after)
    }

    /// Waits `after` on this runtime's clock.
    pub(crate) fn sleep(&self, after: Duration) -> BoxFuture {
        self.sleep_until(self.deadline_after(after))
    }

    /// `fut`'s output, unless `at` comes first.
    pub(crate) async fn timeout_at<F: Future>(
        &self,
        at: Instant,
        fut: F,
    ) -> Result<F::Output, Elapsed> {
        tokio::select! {
            biased;
            out = fut => Ok(out),
            () = self.sleep_until(at) => Err(Elapsed),
        }
    }
}

/// tokio's clock and executor: real time, or virtual time when the runtime's clock is paused.
#[derive(Debug, Default, Clone, Copy)]
pub struct TokioRuntime;

impl Runtime for TokioRuntime {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn sleep_until(&self, at: Instant) -> BoxFuture {
        Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(at)))
    }

    fn spawn(&self, task: BoxFuture) -> BoxFuture {
        let handle = tokio::spawn(task);
        Box::pin(async move {
            let _ = handle.await;
        })
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
    async fn the_tokio_runtime_follows_a_paused_clock() {
        let rt: &dyn Runtime = &TokioRuntime;
        let t0 = rt.now();
        rt.sleep_until(t0 + Duration::from_secs(3600)).await;
        // An hour of virtual time passed at once; the real clock did not move that much.
        assert!(rt.now() >= t0 + Duration::from_secs(3600));
        assert!(Instant::now() < t0 + Duration::from_secs(3600));
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_ends_a_wait_at_its_deadline_and_not_before() {
        let rt: &dyn Runtime = &TokioRuntime;
        let t0 = rt.now();
        let never = std::future::pending::<()>();
        assert_eq!(
            rt.timeout_at(t0 + Duration::from_secs(5), never).await,
            Err(Elapsed)
        );
        assert_eq!(rt.now(), t0 + Duration::from_secs(5));
        let later = rt.deadline_after(Duration::from_secs(5));
        assert_eq!(rt.timeout_at(later, async { 7 }).await, Ok(7));
    }

    #[tokio::test(start_paused = true)]
    async fn a_spawned_task_runs_to_its_end_and_is_awaited() {
        let rt: &dyn Runtime = &TokioRuntime;
        let (tx, rx) = tokio::sync::oneshot::channel();
        rt.spawn(Box::pin(async move {
            let _ = tx.send(42);
        }))
        .await;
        assert_eq!(rx.await, Ok(42));
    }
}
