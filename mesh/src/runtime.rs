//! [`TokioRuntime`]: core's [`Runtime`] port over tokio's clock and executor, the default of the
//! mesh, the process groups and the agent. This is the one module of the crate that touches
//! `tokio::time`.
//!
//! A sleep further off than [`FAR`] on a real clock waits on one process-wide timer thread
//! (a `FarTimer`), not in tokio's timer wheel: while any timer is pending in the wheel, every
//! wait of tokio's reactor in `epoll_wait` carries a timeout, an hrtimer the kernel arms and
//! cancels per wait (about 0.6 µs a round trip pinned, issue 45), and the agent's driver
//! always sleeps on one (the earliest call's deadline, 60 s by default). Nearer sleeps keep
//! tokio's timer, and so does every sleep under a paused (virtual) tokio clock.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

pub use tensorwire_core::ports::runtime::{BoxFuture, Elapsed, Runtime};

/// A sleep whose deadline is further than this from now (on a real clock) waits on the timer
/// thread; a nearer one in tokio's wheel (its precise timer, for the short waits of a dial's
/// backoff or a test). Far deadlines are the long bounds (calls, shutdown, setup) that are
/// rarely reached.
pub const FAR: Duration = Duration::from_millis(50);

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
        if at.saturating_duration_since(self.now()) <= FAR {
            return tokio_sleep(at);
        }
        // Where a far one waits is decided at its first poll: the bound of an operation that
        // ends at its first poll (most of a process group's) is never polled, and then costs
        // no registration on the thread and no more clock readings.
        Box::pin(LazySleep::Unpolled(at))
    }

    fn spawn(&self, task: BoxFuture) -> BoxFuture {
        let handle = tokio::spawn(task);
        Box::pin(async move {
            let _ = handle.await;
        })
    }
}

/// tokio's own sleep until `at`.
fn tokio_sleep(at: Instant) -> BoxFuture {
    Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(at)))
}

/// A far sleep of [`TokioRuntime`]'s, which takes its place (the [`FarTimer`] or tokio's
/// timer, by [`far_sleep`]) at its first poll.
enum LazySleep {
    /// Not polled yet: the deadline.
    Unpolled(Instant),
    /// On the timer thread.
    Far(FarSleep),
    /// In tokio's wheel (a paused clock, or a deadline that came near before the first poll).
    Tokio(BoxFuture),
}

impl Future for LazySleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        loop {
            match this {
                LazySleep::Far(far) => return Pin::new(far).poll(cx),
                LazySleep::Tokio(sleep) => return sleep.as_mut().poll(cx),
                LazySleep::Unpolled(at) => {
                    let at = *at;
                    *this = match far_sleep(at) {
                        Some(far) => LazySleep::Far(far),
                        None => LazySleep::Tokio(tokio_sleep(at)),
                    };
                }
            }
        }
    }
}

/// A sleep until `at` on the process's [`FarTimer`], when `at` is further than [`FAR`] from
/// now and tokio's clock is real; else `None` (tokio's timer then).
fn far_sleep(at: Instant) -> Option<FarSleep> {
    let before = tokio::time::Instant::now();
    if at.saturating_duration_since(before.into_std()) <= FAR {
        return None;
    }
    // A paused (frozen) tokio clock cannot advance within this one synchronous call: if its two
    // readings around a reading of the real clock differ, it is real (equal: paused, or a
    // coarse real clock, which then keeps tokio's timer).
    let _real = std::time::Instant::now();
    if tokio::time::Instant::now() == before {
        return None;
    }
    Some(FarTimer::global()?.sleep_until(at))
}

/// One thread that wakes the tasks sleeping until far deadlines: a map of the pending
/// deadlines in order, each with the waker of its sleep's last poll, and a condition variable
/// the thread waits on until the earliest. Registering a deadline later than the one the thread
/// waits for only takes the lock (no system call); an earlier one wakes the thread to wait
/// anew. A sleep dropped before its deadline removes its entry.
#[derive(Debug, Default)]
struct FarTimer {
    timers: Mutex<Timers>,
    changed: Condvar,
}

/// What the [`FarTimer`]'s lock guards.
#[derive(Debug, Default)]
struct Timers {
    /// The pending sleeps by deadline (a sequence number tells equal deadlines apart), with
    /// the waker of each one's last poll (`None` before its first).
    pending: BTreeMap<(Instant, u64), Option<Waker>>,
    /// The next sequence number.
    next: u64,
    /// The deadline the thread waits for (`None`: it waits for a registration).
    waits_for: Option<Instant>,
    /// How many times a registration woke the thread (for the tests).
    notified: u64,
}

impl FarTimer {
    /// The process's timer, its thread started on first use; `None` if that thread could not
    /// be started (tokio's timer then).
    fn global() -> Option<&'static Arc<FarTimer>> {
        static GLOBAL: OnceLock<Option<Arc<FarTimer>>> = OnceLock::new();
        GLOBAL.get_or_init(|| FarTimer::start().ok()).as_ref()
    }

    /// A timer with its own thread.
    fn start() -> std::io::Result<Arc<FarTimer>> {
        let timer = Arc::new(FarTimer::default());
        let run = Arc::clone(&timer);
        std::thread::Builder::new()
            .name("tensorwire-timer".into())
            .spawn(move || run.run())?;
        Ok(timer)
    }

    fn lock(&self) -> MutexGuard<'_, Timers> {
        self.timers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a sleep until `at`.
    fn sleep_until(self: &Arc<Self>, at: Instant) -> FarSleep {
        let mut timers = self.lock();
        let key = (at, timers.next);
        timers.next += 1;
        timers.pending.insert(key, None);
        if timers.waits_for.is_none_or(|waits_for| at < waits_for) {
            timers.waits_for = Some(at);
            timers.notified += 1;
            self.changed.notify_one();
        }
        FarSleep {
            timer: Arc::clone(self),
            key,
            done: false,
        }
    }

    /// The thread: wakes every sleep whose deadline has come (outside the lock), then waits
    /// until the earliest deadline left or a registration of an earlier one.
    fn run(&self) {
        let mut due = Vec::new();
        let mut timers = self.lock();
        loop {
            let now = Instant::now();
            while let Some(entry) = timers.pending.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.extend(entry.remove());
            }
            if !due.is_empty() {
                drop(timers);
                due.drain(..).for_each(Waker::wake);
                timers = self.lock();
                continue;
            }
            timers.waits_for = timers.pending.first_key_value().map(|(&(at, _), _)| at);
            timers = match timers.waits_for {
                Some(at) => {
                    (self.changed.wait_timeout(timers, at - now))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                None => (self.changed.wait(timers)).unwrap_or_else(PoisonError::into_inner),
            };
        }
    }
}

/// A sleep on the [`FarTimer`]: ready once the thread found its deadline come (its entry gone).
#[derive(Debug)]
struct FarSleep {
    timer: Arc<FarTimer>,
    key: (Instant, u64),
    done: bool,
}

impl Future for FarSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.done {
            return Poll::Ready(());
        }
        let mut timers = self.timer.lock();
        let Some(waker) = timers.pending.get_mut(&self.key) else {
            drop(timers);
            self.done = true;
            return Poll::Ready(());
        };
        // The waker replaced is dropped after the lock (its drop may run other code).
        let old = match waker {
            Some(w) if w.will_wake(cx.waker()) => None,
            _ => waker.replace(cx.waker().clone()),
        };
        drop(timers);
        drop(old);
        Poll::Pending
    }
}

impl Drop for FarSleep {
    fn drop(&mut self) {
        if !self.done {
            // Dropped after the lock, as in `poll`.
            let _waker = self.timer.lock().pending.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_tokio_runtime_follows_a_paused_clock() {
        let rt: &dyn Runtime = &TokioRuntime;
        let t0 = rt.now();
        // Far, but the clock is paused: tokio's timer, which auto-advance fires.
        assert!(far_sleep(t0 + Duration::from_secs(3600)).is_none());
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

    /// A generous bound on how late a sleep of a few tens of milliseconds may wake on this
    /// loaded machine (what is under test is that it wakes, and not before its deadline).
    const LATE: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn a_far_sleep_on_a_real_clock_waits_on_the_thread_and_wakes_its_task_at_its_deadline() {
        let rt: &dyn Runtime = &TokioRuntime;
        let at = rt.now() + FAR + Duration::from_millis(30);
        let far = far_sleep(at).expect("a far deadline on a real clock goes to the thread");
        let pending = || (far.timer.lock().pending.keys().map(|k| k.0)).collect::<Vec<_>>();
        assert_eq!(pending(), [at]);
        far.await;
        let woke = Instant::now();
        assert!(woke >= at, "woke {:?} early", at - woke);
        assert!(woke < at + LATE, "woke {:?} late", woke - at);
        // Through the port as well (the timer thread, as above).
        let at = rt.now() + FAR + Duration::from_millis(30);
        rt.sleep_until(at).await;
        assert!(Instant::now() >= at);
    }

    #[tokio::test]
    async fn a_far_sleep_is_registered_at_its_first_poll_and_not_before() {
        // A deadline no other test uses (the process's timer may be shared with them).
        let at = Instant::now() + FAR + Duration::from_millis(30) + Duration::from_nanos(4_177);
        let registered = || {
            let timer = FarTimer::global().expect("the timer thread starts");
            let found = timer.lock().pending.keys().any(|k| k.0 == at);
            found
        };
        // Made through the port and dropped unpolled (an operation that ended at once).
        drop(TokioRuntime.sleep_until(at));
        assert!(!registered());
        let mut sleep = LazySleep::Unpolled(at);
        assert!(!registered());
        let mut cx = Context::from_waker(Waker::noop());
        assert!(Pin::new(&mut sleep).poll(&mut cx).is_pending());
        assert!(matches!(sleep, LazySleep::Far(_)));
        assert!(registered());
        drop(sleep);
        assert!(!registered());
    }

    #[tokio::test]
    async fn a_near_sleep_keeps_tokios_timer() {
        let at = Instant::now() + FAR / 2;
        assert!(far_sleep(at).is_none());
        assert!(far_sleep(Instant::now()).is_none());
        TokioRuntime.sleep_until(at).await;
        assert!(Instant::now() >= at);
    }

    #[test]
    fn dropped_sleeps_leave_no_entry() {
        let timer = FarTimer::start().unwrap();
        let far = Instant::now() + Duration::from_secs(60);
        let mut cx = Context::from_waker(Waker::noop());
        // Created and dropped one after another, polled or not: the registry stays bounded.
        for i in 0..10_000u32 {
            let mut sleep = timer.sleep_until(far + Duration::from_millis(u64::from(i % 7)));
            if i % 2 == 0 {
                assert!(Pin::new(&mut sleep).poll(&mut cx).is_pending());
            }
            assert_eq!(timer.lock().pending.len(), 1);
        }
        assert!(timer.lock().pending.is_empty());
        // Many at once, then all dropped.
        let sleeps: Vec<_> = (0..1_000).map(|_| timer.sleep_until(far)).collect();
        assert_eq!(timer.lock().pending.len(), 1_000);
        drop(sleeps);
        assert!(timer.lock().pending.is_empty());
    }

    #[test]
    fn only_a_deadline_earlier_than_the_threads_wakes_it() {
        let timer = FarTimer::start().unwrap();
        let t0 = Instant::now() + Duration::from_secs(60);
        let first = timer.sleep_until(t0);
        assert_eq!(timer.lock().notified, 1);
        let later: Vec<_> = (1..100)
            .map(|s| timer.sleep_until(t0 + Duration::from_secs(s)))
            .collect();
        assert_eq!(timer.lock().notified, 1, "a later deadline woke the thread");
        let earlier = timer.sleep_until(t0 - Duration::from_secs(1));
        assert_eq!(timer.lock().notified, 2);
        drop((first, later, earlier));
    }

    #[tokio::test]
    async fn an_earlier_deadline_registered_later_is_not_held_up_by_the_one_before() {
        let timer = FarTimer::start().unwrap();
        let t0 = Instant::now();
        let late = timer.sleep_until(t0 + Duration::from_secs(3600));
        let soon = t0 + Duration::from_millis(30);
        let woke = {
            let soon_sleep = timer.sleep_until(soon);
            soon_sleep.await;
            Instant::now()
        };
        assert!(woke >= soon);
        assert!(woke < soon + LATE, "woke {:?} late", woke - soon);
        // Deadlines fire in order; the one left is the hour's.
        let pending: Vec<_> = timer.lock().pending.keys().map(|k| k.0).collect();
        assert_eq!(pending, [t0 + Duration::from_secs(3600)]);
        drop(late);
        assert!(timer.lock().pending.is_empty());
    }

    #[tokio::test]
    async fn sleeps_wake_in_deadline_order_each_its_own_task() {
        let timer = FarTimer::start().unwrap();
        let t0 = Instant::now();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for ms in [60u64, 20, 40] {
            let sleep = timer.sleep_until(t0 + Duration::from_millis(ms));
            let tx = tx.clone();
            tokio::spawn(async move {
                sleep.await;
                let _ = tx.send((ms, Instant::now()));
            });
        }
        drop(tx);
        let mut woke = Vec::new();
        while let Some((ms, at)) = rx.recv().await {
            assert!(at >= t0 + Duration::from_millis(ms));
            woke.push(ms);
        }
        assert_eq!(woke, [20, 40, 60]);
        assert!(timer.lock().pending.is_empty());
    }
}
