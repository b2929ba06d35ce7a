//! Waiting for something that another task makes true.

use std::time::Duration;

use tokio::sync::watch;

/// Waits until `cond` holds, checking it each millisecond of the runtime's clock; panics
/// naming `what` when `limit` passes first.
///
/// Meant for conditions no event announces (an agent's counters): under tokio's paused clock
/// (`#[tokio::test(start_paused = true)]`) the checks cost no real time, the clock moving on
/// only while every task is idle. Where a value is announced, wait on it with [`wait_for`].
pub async fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not reached within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Waits, without polling, until the value `rx` watches satisfies `pred`, and returns a copy of
/// it; panics naming `what` when `limit` passes first or the sender is gone.
pub async fn wait_for<T: Clone>(
    what: &str,
    limit: Duration,
    rx: &mut watch::Receiver<T>,
    pred: impl FnMut(&T) -> bool,
) -> T {
    match tokio::time::timeout(limit, rx.wait_for(pred)).await {
        Ok(Ok(v)) => v.clone(),
        Ok(Err(_)) => panic!("{what}: the sender is gone before it was reached"),
        Err(_) => panic!("{what}: not reached within {limit:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn wait_until_returns_once_another_task_makes_it_true() {
        let flag = Arc::new(AtomicBool::new(false));
        let set = Arc::clone(&flag);
        let start = tokio::time::Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            set.store(true, Ordering::SeqCst);
        });
        wait_until("flag", Duration::from_secs(10), || {
            flag.load(Ordering::SeqCst)
        })
        .await;
        let took = start.elapsed();
        assert!(
            took >= Duration::from_secs(3) && took < Duration::from_millis(3_010),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "never: not reached within 2s")]
    async fn wait_until_fails_at_its_limit_naming_what() {
        wait_until("never", Duration::from_secs(2), || false).await;
    }

    #[tokio::test(start_paused = true)]
    async fn wait_for_wakes_on_the_change_that_satisfies_it() {
        let (tx, mut rx) = watch::channel(0u32);
        tokio::spawn(async move {
            for i in 1..=5 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                tx.send_replace(i);
            }
            // Keep the sender until the waiter had its chance.
            tokio::time::sleep(Duration::from_secs(60)).await;
        });
        assert_eq!(
            wait_for("four", Duration::from_secs(10), &mut rx, |v| *v >= 4).await,
            4
        );
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "gone: the sender is gone")]
    async fn wait_for_fails_when_the_sender_goes() {
        let (tx, mut rx) = watch::channel(0u32);
        drop(tx);
        wait_for("gone", Duration::from_secs(1), &mut rx, |v| *v > 0).await;
    }
}
