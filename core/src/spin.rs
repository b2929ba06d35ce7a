//! Waiting for a peer's answer on one host: poll, hand the core over, or sleep.
//!
//! A process that sleeps until its peer answers (an `epoll_wait`, an eventfd) is woken by the
//! kernel; when the peer runs on another core that wake-up is an interrupt to that core, which
//! on a virtual machine costs tens of microseconds, several times a small round trip. A process
//! that polls for the answer instead sees it within a microsecond, but only while the peer runs
//! on *another* core: when both share one, polling keeps the peer from running at all.
//!
//! [`SpinWait`] decides, step by step, what a waiting side does, from the time (passed in) and
//! from what it learnt in earlier waits ([`SpinPolicy`]); the transports carry the steps out
//! (the shared-memory ring's wait, the TCP connection's receive). The rules:
//!
//! 1. **Poll** ([`SpinStep::Poll`]) for the whole budget while polling paid last time, and never
//!    when the process may run on one core only (the peer needs that core), nor when the
//!    processes that wait for each other outnumber its CPUs ([`SpinPolicy::for_host`]: a group
//!    arena's ranks).
//! 2. Otherwise **yield** ([`SpinStep::Yield`]): hand the core over (`sched_yield`) and look
//!    again, until the budget is spent. A yield that comes back at once found nothing else to
//!    run on this core: the peer runs elsewhere, and polling will pay next time. One that took
//!    long ([`SOMEONE_ELSE_RAN`]) ran someone else here, most likely the peer, which polling
//!    would only have kept waiting.
//! 3. Then **sleep** ([`SpinStep::Sleep`]) until woken. A wait that ran out of budget with every
//!    yield coming back at once still counts for polling: the peer is on another core and only
//!    slow, quite possibly because it slept itself. Were both sides to learn "does not pay"
//!    from that, each would sleep because the other was slow to answer, and stay slow for good
//!    (shared memory's round trips were bimodal that way: 17 µs in some runs, 130 µs in others).
//!
//! The budget runs from the start of the wait, and again from every send the waiting side makes
//! meanwhile ([`SpinWait::sent`]): a side that just sent a request expects its answer.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use tensorwire_core::spin::{SpinPolicy, SpinStep};
//!
//! let policy = SpinPolicy::new(Duration::from_micros(20), false);
//! let t0 = Instant::now();
//! let mut wait = policy.begin(true, t0);
//! assert_eq!(wait.step(t0 + Duration::from_micros(5)), SpinStep::Poll);
//! assert_eq!(wait.step(t0 + Duration::from_micros(25)), SpinStep::Sleep);
//! // Polling paid (the answer came while polling): keep polling next time.
//! assert_eq!(wait.found(), Some(true));
//! ```

use std::time::{Duration, Instant};

use crate::env::BadVariable;

/// A spin budget from the environment variable `name`, as `env` looks it up: `Ok(None)` when it
/// is unset, else its value in whole microseconds (`0`: sleep at once, never poll). A malformed
/// value is an error that names the variable and the value. The transports' spin settings
/// (`TENSORWIRE_TCP_SPIN_US`, `TENSORWIRE_SHM_SPIN_US`) read through it.
///
/// ```
/// use std::time::Duration;
/// use tensorwire_core::spin::budget_from_env;
///
/// let env = |v: &'static str| move |_: &str| Some(v.to_string());
/// assert_eq!(budget_from_env("SPIN", env(" 50 ")), Ok(Some(Duration::from_micros(50))));
/// assert_eq!(budget_from_env("SPIN", |_: &str| None), Ok(None));
/// let bad = budget_from_env("SPIN", env("fast")).unwrap_err();
/// assert_eq!((bad.var.as_str(), bad.value.as_str()), ("SPIN", "fast"));
/// ```
pub fn budget_from_env(
    name: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Duration>, BadVariable> {
    let us = crate::env::whole_number(name, env, "a whole number of microseconds (0: never poll)")?;
    Ok(us.map(Duration::from_micros))
}

/// A `sched_yield` that takes longer than this ran another thread on our core.
pub const SOMEONE_ELSE_RAN: Duration = Duration::from_micros(3);

/// Every this many turns a waiting side gives its runtime (see [`Turn`]), one is a
/// [`Turn::Runtime`].
pub const RUNTIME_TURN_EVERY: u32 = 2;

/// How a waiting side lets the other tasks of its runtime run between looks.
///
/// [`requeue`] costs no system call, but on tokio's current-thread runtime the future given
/// to `block_on` (an application's `main`) is polled only when no task is ready, or after the
/// runtime's `event_interval` (61) turns: a waiting side that only requeues keeps it from
/// running for its whole budget, and with it whatever it would send (the other half of a
/// barrier, the next request). So every [`RUNTIME_TURN_EVERY`]-th turn is a runtime turn
/// (`tokio::task::yield_now`): the task waits for the runtime's driver poll (one `epoll_wait`
/// with a zero timeout), after which the `block_on` future runs if it was woken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// [`requeue`]: behind the tasks that are ready.
    Requeue,
    /// `tokio::task::yield_now`: after the runtime's driver poll and its `block_on` future.
    Runtime,
}

/// How a side waits for its peer: the budget of polling and yielding before it sleeps, and
/// whether it may run on one core only. Starts [`SpinWait`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpinPolicy {
    budget: Duration,
    one_core: bool,
}

/// What a waiting side does next (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpinStep {
    /// Look for the answer without giving the core away (the caller may still let its own
    /// runtime's other tasks run between looks).
    Poll,
    /// Hand the core over (`sched_yield`), report how long that took
    /// ([`SpinWait::yielded`]), then look again.
    Yield,
    /// Stop spending the core: sleep until woken. The wait is over as far as learning goes
    /// ([`SpinWait::slept`]).
    Sleep,
}

impl SpinPolicy {
    /// Waits of `budget` before sleeping; `one_core` when the process may run on one core only
    /// (then it never polls: it yields from the start). A zero budget sleeps at once, and so
    /// does one too long to add to the clock.
    pub fn new(budget: Duration, one_core: bool) -> Self {
        SpinPolicy { budget, one_core }
    }

    /// The waits of one of `on_host` processes that wait for each other on one host (the
    /// ranks of a group arena), where each process may run on `cpus` CPUs (its affinity mask,
    /// `sched_getaffinity`; 0 reads as 1), with the transports' spin `budget`.
    ///
    /// While every process can have a CPU of its own (`on_host <= cpus`), a wait polls for
    /// `budget`, as a transport's does. When they outnumber the CPUs, a polling wait burns the
    /// core that another of them needs in order to arrive: then it never polls (as on one core)
    /// but yields (`sched_yield`) between looks for the same budget, and sleeps after it, as
    /// MPICH's shared-memory waits poll and yield (`MPIR_CVAR_POLLS_BEFORE_YIELD`). The budget
    /// is not stretched by the processes per CPU: measured at 8 ranks on 2 CPUs, yielding for
    /// 2 or 4 budgets made the barrier no faster than 1 and a 1 MiB all_gather slower (the
    /// yielding ranks take turns from the ranks that copy).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tensorwire_core::spin::SpinPolicy;
    ///
    /// let us = Duration::from_micros(20);
    /// assert_eq!(SpinPolicy::for_host(2, 2, us), SpinPolicy::new(us, false));
    /// // 8 ranks on 2 CPUs: yield between looks, never poll.
    /// assert_eq!(SpinPolicy::for_host(8, 2, us), SpinPolicy::new(us, true));
    /// ```
    pub fn for_host(on_host: usize, cpus: usize, budget: Duration) -> Self {
        SpinPolicy::new(budget, on_host > cpus.max(1) || cpus <= 1)
    }

    /// The budget of a wait before it sleeps.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// Whether waits never poll: the process may run on one core only, or (from
    /// [`SpinPolicy::for_host`]) the processes waiting for each other outnumber its CPUs.
    pub fn one_core(&self) -> bool {
        self.one_core
    }

    /// A wait that starts at `now`; `paid` is what the last wait learnt (whether polling pays;
    /// `true` before anything was learnt).
    pub fn begin(&self, paid: bool, now: Instant) -> SpinWait {
        SpinWait {
            poll: !self.one_core && paid,
            one_core: self.one_core,
            budget: self.budget,
            until: now.checked_add(self.budget).unwrap_or(now),
            yields: 0,
            someone_else_ran: false,
            turns: 0,
        }
    }
}

/// One wait in progress: asked for its next [`SpinStep`] with the time, told how its yields
/// went, and asked at its end what it learnt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpinWait {
    /// Whether this wait polls (rather than yields) until `until`.
    poll: bool,
    one_core: bool,
    budget: Duration,
    /// When the budget is spent.
    until: Instant,
    /// `sched_yield`s made so far.
    yields: u32,
    /// Whether one of them ran someone else.
    someone_else_ran: bool,
    /// Turns given to the runtime so far ([`SpinWait::turn`]).
    turns: u32,
}

impl SpinWait {
    /// What to do at `now`.
    pub fn step(&self, now: Instant) -> SpinStep {
        if now >= self.until {
            SpinStep::Sleep
        } else if self.poll {
            SpinStep::Poll
        } else {
            SpinStep::Yield
        }
    }

    /// The waiting side sent something at `now` that its peer answers: the budget runs again
    /// from there (never shorter than it was).
    pub fn sent(&mut self, now: Instant) {
        if let Some(until) = now.checked_add(self.budget) {
            self.until = self.until.max(until);
        }
    }

    /// How to let the runtime's other tasks run this time between two looks (see [`Turn`]);
    /// counts the turn.
    pub fn turn(&mut self) -> Turn {
        self.turns = self.turns.wrapping_add(1);
        if self.turns % RUNTIME_TURN_EVERY == 0 {
            Turn::Runtime
        } else {
            Turn::Requeue
        }
    }

    /// Whether how long a `sched_yield` took can change what this wait learns: not when it
    /// never polls (one core, or more waiting processes than CPUs), whose waits learn the same
    /// whatever their yields took. Such a wait tells its yields with
    /// [`yielded_untimed`](Self::yielded_untimed) and reads no clock around them.
    pub fn times_yields(&self) -> bool {
        !self.one_core
    }

    /// A `sched_yield` was made and not timed ([`times_yields`](Self::times_yields) is
    /// `false`): counted, with nothing said about whether it ran someone else.
    pub fn yielded_untimed(&mut self) {
        self.yields = self.yields.saturating_add(1);
    }

    /// A `sched_yield` ([`SpinStep::Yield`]) took `took`.
    pub fn yielded(&mut self, took: Duration) {
        self.yields = self.yields.saturating_add(1);
        self.someone_else_ran |= took > SOMEONE_ELSE_RAN;
    }

    /// The `sched_yield`s made so far, and whether one of them ran someone else.
    pub fn yields(&self) -> (u32, bool) {
        (self.yields, self.someone_else_ran)
    }

    /// The answer came before the wait slept: whether polling pays from now on, or `None` when
    /// this wait tells nothing (it neither yielded nor could have; keep what was known).
    pub fn found(&self) -> Option<bool> {
        if self.one_core {
            return Some(false);
        }
        if self.poll {
            // It polled and the answer came within the budget: polling paid.
            return Some(true);
        }
        (self.yields > 0).then_some(!self.someone_else_ran)
    }

    /// The wait ran out of budget and sleeps: whether polling pays from now on. Yields that all
    /// came back at once say the peer runs on another core (only slow this time), so polling
    /// is tried again; anything else says it does not pay.
    pub fn slept(&self) -> bool {
        !self.one_core && !self.poll && self.yields > 0 && !self.someone_else_ran
    }
}

/// Lets the runtime's other ready tasks run once, then resumes this one.
///
/// Unlike `tokio::task::yield_now`, which defers the task until the runtime has polled its I/O
/// driver (one `epoll_wait` with a zero timeout per yield), this wakes the task at once: it goes
/// to the back of the run queue, behind every task that is ready. The driver is still polled
/// every `event_interval` ticks (61 by default) and whenever nothing is ready, so a wait that
/// yields in a loop costs no system call per turn. A plain future: no runtime is named, none
/// is needed to build it.
pub async fn requeue() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    fn policy(one_core: bool) -> SpinPolicy {
        SpinPolicy::new(20 * US, one_core)
    }

    #[test]
    fn polls_for_the_budget_while_polling_paid_then_sleeps() {
        let t0 = Instant::now();
        let wait = policy(false).begin(true, t0);
        assert_eq!(wait.step(t0), SpinStep::Poll);
        assert_eq!(wait.step(t0 + 19 * US), SpinStep::Poll);
        assert_eq!(wait.step(t0 + 20 * US), SpinStep::Sleep);
        assert_eq!(wait.found(), Some(true));
        // A polling wait that ran out learnt that polling did not pay.
        assert!(!wait.slept());
    }

    #[test]
    fn yields_instead_of_polling_once_polling_did_not_pay() {
        let t0 = Instant::now();
        let wait = policy(false).begin(false, t0);
        assert_eq!(wait.step(t0), SpinStep::Yield);
        assert_eq!(wait.step(t0 + 19 * US), SpinStep::Yield);
        assert_eq!(wait.step(t0 + 20 * US), SpinStep::Sleep);
    }

    #[test]
    fn on_one_core_it_never_polls_and_never_learns_that_polling_pays() {
        let t0 = Instant::now();
        let mut wait = policy(true).begin(true, t0);
        assert_eq!(wait.step(t0), SpinStep::Yield);
        wait.yielded(US);
        assert_eq!(wait.found(), Some(false));
        assert!(!wait.slept());
    }

    #[test]
    fn a_wait_that_never_polls_learns_the_same_whatever_its_yields_took() {
        let t0 = Instant::now();
        for policy in [policy(true), SpinPolicy::for_host(8, 2, 20 * US)] {
            let learnt = |yield_took: Option<Duration>| {
                let mut wait = policy.begin(true, t0);
                assert!(!wait.times_yields());
                match yield_took {
                    Some(took) => wait.yielded(took),
                    None => wait.yielded_untimed(),
                }
                assert_eq!(wait.yields().0, 1);
                let before_sleep = wait.found();
                assert_eq!(wait.step(t0 + 20 * US), SpinStep::Sleep);
                (before_sleep, wait.slept())
            };
            let untimed = learnt(None);
            assert_eq!(untimed, (Some(false), false));
            assert_eq!(learnt(Some(US)), untimed);
            assert_eq!(learnt(Some(10 * US)), untimed);
        }
        // A wait that may poll times them: what they took decides what it learns.
        let wait = policy(false).begin(false, t0);
        assert!(wait.times_yields());
    }

    #[test]
    fn quick_yields_teach_that_polling_pays_and_a_slow_one_that_it_does_not() {
        let t0 = Instant::now();
        let mut wait = policy(false).begin(false, t0);
        wait.yielded(US);
        wait.yielded(2 * US);
        assert_eq!(wait.yields(), (2, false));
        assert_eq!(wait.found(), Some(true));
        wait.yielded(10 * US);
        assert_eq!(wait.yields(), (3, true));
        assert_eq!(wait.found(), Some(false));
        // A yielding wait that made no yield tells nothing.
        assert_eq!(policy(false).begin(false, t0).found(), None);
    }

    #[test]
    fn a_wait_that_slept_after_quick_yields_tries_polling_again() {
        // The bimodal case: the peer on another core, slow only because it slept too.
        let t0 = Instant::now();
        let mut wait = policy(false).begin(false, t0);
        wait.yielded(US);
        assert_eq!(wait.step(t0 + 21 * US), SpinStep::Sleep);
        assert!(wait.slept());
        // Had a yield run someone else, it would not.
        wait.yielded(5 * US);
        assert!(!wait.slept());
        // Nor does a wait that made no yield.
        assert!(!policy(false).begin(false, t0).slept());
    }

    #[test]
    fn a_send_restarts_the_budget_but_never_shortens_it() {
        let t0 = Instant::now();
        let mut wait = policy(false).begin(true, t0);
        wait.sent(t0 + 15 * US);
        assert_eq!(wait.step(t0 + 30 * US), SpinStep::Poll);
        assert_eq!(wait.step(t0 + 35 * US), SpinStep::Sleep);
        wait.sent(t0);
        assert_eq!(wait.step(t0 + 34 * US), SpinStep::Poll);
    }

    #[test]
    fn every_second_turn_lets_the_runtime_poll_its_driver_and_block_on_future() {
        let mut wait = policy(false).begin(true, Instant::now());
        let turns: Vec<Turn> = (0..6).map(|_| wait.turn()).collect();
        assert_eq!(
            turns,
            [
                Turn::Requeue,
                Turn::Runtime,
                Turn::Requeue,
                Turn::Runtime,
                Turn::Requeue,
                Turn::Runtime
            ]
        );
        // A wait that runs for ever does not overflow its count, and keeps alternating.
        wait.turns = u32::MAX - 1;
        let turns: Vec<Turn> = (0..3).map(|_| wait.turn()).collect();
        assert_eq!(turns, [Turn::Requeue, Turn::Runtime, Turn::Requeue]);
    }

    #[test]
    fn on_a_host_with_a_cpu_for_each_process_a_wait_polls_for_the_budget() {
        for (on_host, cpus) in [(1, 1), (2, 2), (2, 16), (8, 8), (0, 4)] {
            let p = SpinPolicy::for_host(on_host, cpus, 20 * US);
            assert_eq!(p.budget(), 20 * US, "{on_host} on {cpus}");
            assert_eq!(p.one_core(), cpus == 1, "{on_host} on {cpus}");
        }
        let t0 = Instant::now();
        let wait = SpinPolicy::for_host(4, 8, 20 * US).begin(true, t0);
        assert_eq!(wait.step(t0 + 19 * US), SpinStep::Poll);
        assert_eq!(wait.step(t0 + 20 * US), SpinStep::Sleep);
    }

    #[test]
    fn outnumbered_cpus_yield_between_looks_for_the_budget_and_never_poll() {
        for (on_host, cpus) in [(3, 2), (8, 2), (9, 2), (2, 1), (8, 1), (8, 0), (64, 7)] {
            let p = SpinPolicy::for_host(on_host, cpus, 20 * US);
            assert_eq!(p.budget(), 20 * US, "{on_host} on {cpus}");
            assert!(p.one_core(), "{on_host} on {cpus}: never polls");
        }
        // It yields from the start, however polling went before, and sleeps after the budget.
        let t0 = Instant::now();
        let mut wait = SpinPolicy::for_host(8, 2, 20 * US).begin(true, t0);
        assert_eq!(wait.step(t0), SpinStep::Yield);
        assert_eq!(wait.step(t0 + 19 * US), SpinStep::Yield);
        assert_eq!(wait.step(t0 + 20 * US), SpinStep::Sleep);
        wait.yielded(US);
        assert_eq!(
            wait.found(),
            Some(false),
            "it never learns that polling pays"
        );
        // A zero budget still sleeps at once.
        let zero = SpinPolicy::for_host(8, 2, Duration::ZERO).begin(true, t0);
        assert_eq!(zero.step(t0), SpinStep::Sleep);
    }

    #[test]
    fn a_zero_budget_sleeps_at_once() {
        let t0 = Instant::now();
        let wait = SpinPolicy::new(Duration::ZERO, false).begin(true, t0);
        assert_eq!(wait.step(t0), SpinStep::Sleep);
    }

    #[test]
    fn a_budget_past_the_end_of_time_does_not_panic() {
        let t0 = Instant::now();
        let mut wait = SpinPolicy::new(Duration::MAX, false).begin(true, t0);
        wait.sent(t0 + US);
        assert_eq!(wait.step(t0 + US), SpinStep::Sleep);
    }
}
