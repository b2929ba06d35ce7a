//! [`TokioRuntime`]: core's [`Runtime`] port over tokio's clock and executor, the default of the
//! mesh, the process groups and the agent. This is the one module of the crate that touches
//! `tokio::time`.

use std::time::Instant;

pub use tensorwire_core::ports::runtime::{BoxFuture, Elapsed, Runtime};

/// tokio's clock and executor: real time, or virtual time when the runtime's clock is paused
/// (`tokio::time::pause`, `#[tokio::test(start_paused = true)]`). `std::time::Instant::now()`
/// would not do: that clock does not stop when tokio's is paused.
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
    use std::time::Duration;

    use super::*;

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
        // Ready at the deadline itself: the output, not a timeout.
        let now = rt.now();
        assert_eq!(rt.timeout_at(now, async { 8 }).await, Ok(8));
    }
}
