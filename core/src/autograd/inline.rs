//! Where the driver runs a local backward task: inline on the thread that drives the worker's
//! RPCs, or handed to a blocking thread.
//!
//! A hand-off to a blocking thread costs two thread wake-ups (there and back), tens of µs on a
//! loaded host: more than a small backward, whose gradient request then waits for the hand-off
//! on every hop. A long backward must not hold the thread that answers RPCs, though. The
//! decision follows the engine's recent run times (measured by the driver and passed in):
//! inline only once [`RECENT`] runs are known, their median took at most the bound and none
//! took more than [`STALL_FACTOR`] times it. A rare slow run (the process preempted, an
//! allocator trim) does not send the next ones away; one that would stall the thread does.
//! Every [`PROBE_EVERY`]th run goes to a blocking thread anyway, so a model that grows is
//! noticed by its next runs without stalling the thread for long.

use std::collections::VecDeque;
use std::time::Duration;

/// The default bound on a run's time for backward tasks to run inline.
pub const DEFAULT_INLINE_BOUND: Duration = Duration::from_micros(50);

/// How many of the latest runs the decision looks at.
pub const RECENT: usize = 8;

/// A run longer than this many times the bound sends the next [`RECENT`] runs to a blocking
/// thread, whatever the median.
pub const STALL_FACTOR: u32 = 20;

/// While running inline, every `PROBE_EVERY`th run is handed to a blocking thread all the same
/// (its time counts like any other).
pub const PROBE_EVERY: u64 = 64;

/// Where a backward task runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunOn {
    /// On the driver's own thread, now: the recent runs were all short.
    Inline,
    /// On a blocking thread: a recent run was long, too few are known, or this one probes.
    Blocking,
}

/// Decides [`RunOn`] from the engine's recent run times.
///
/// ```
/// use std::time::Duration;
/// use tensorwire_core::autograd::inline::{InlineRuns, RunOn, RECENT};
/// let mut runs = InlineRuns::new(Duration::from_micros(50));
/// assert_eq!(runs.next_run(), RunOn::Blocking); // nothing known yet
/// for _ in 0..RECENT {
///     runs.record(Duration::from_micros(10));
/// }
/// assert_eq!(runs.next_run(), RunOn::Inline);
/// runs.record(Duration::from_millis(3)); // one long run: back to a blocking thread
/// assert_eq!(runs.next_run(), RunOn::Blocking);
/// ```
#[derive(Debug, Clone)]
pub struct InlineRuns {
    bound: Duration,
    recent: VecDeque<Duration>,
    decided: u64,
    inline: u64,
}

impl InlineRuns {
    /// Runs inline while each of the [`RECENT`] latest took at most `bound` (zero: never
    /// inline).
    pub fn new(bound: Duration) -> Self {
        Self {
            bound,
            recent: VecDeque::with_capacity(RECENT),
            decided: 0,
            inline: 0,
        }
    }

    /// Changes the bound; the runs recorded so far are kept.
    pub fn set_bound(&mut self, bound: Duration) {
        self.bound = bound;
    }

    /// How many runs were sent inline and how many to a blocking thread, in that order.
    pub fn counts(&self) -> (u64, u64) {
        (self.inline, self.decided - self.inline)
    }

    /// Where the next run goes.
    pub fn next_run(&mut self) -> RunOn {
        self.decided += 1;
        let short = self.recent.len() == RECENT && {
            let mut sorted = [Duration::ZERO; RECENT];
            for (s, t) in sorted.iter_mut().zip(&self.recent) {
                *s = *t;
            }
            sorted.sort_unstable();
            sorted[RECENT / 2] <= self.bound && sorted[RECENT - 1] <= self.bound * STALL_FACTOR
        };
        if short && !self.bound.is_zero() && self.decided % PROBE_EVERY != 0 {
            self.inline += 1;
            RunOn::Inline
        } else {
            RunOn::Blocking
        }
    }

    /// A run took `took`.
    pub fn record(&mut self, took: Duration) {
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(took);
    }
}

impl Default for InlineRuns {
    fn default() -> Self {
        Self::new(DEFAULT_INLINE_BOUND)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    fn warmed(took: Duration) -> InlineRuns {
        let mut r = InlineRuns::default();
        for _ in 0..RECENT {
            r.record(took);
        }
        r
    }

    #[test]
    fn short_runs_go_inline_once_enough_are_known() {
        let mut r = InlineRuns::default();
        for _ in 0..RECENT - 1 {
            assert_eq!(r.next_run(), RunOn::Blocking);
            r.record(10 * US);
        }
        assert_eq!(r.next_run(), RunOn::Blocking, "one run short of RECENT");
        r.record(10 * US);
        assert_eq!(r.next_run(), RunOn::Inline);
        // The bound itself is short enough.
        assert_eq!(warmed(DEFAULT_INLINE_BOUND).next_run(), RunOn::Inline);
        assert_eq!(
            warmed(DEFAULT_INLINE_BOUND + US).next_run(),
            RunOn::Blocking
        );
    }

    #[test]
    fn a_rare_slow_run_keeps_runs_inline_but_mostly_slow_ones_do_not() {
        let mut r = warmed(5 * US);
        // Preempted once: 10 times the bound, under the stall limit.
        r.record(10 * DEFAULT_INLINE_BOUND);
        assert_eq!(r.next_run(), RunOn::Inline);
        // Half of the recent runs over the bound (the median is): a blocking thread.
        let mut r = warmed(5 * US);
        for _ in 0..RECENT / 2 {
            r.record(2 * DEFAULT_INLINE_BOUND);
        }
        assert_eq!(r.next_run(), RunOn::Blocking);
        // One run past the stall limit is enough.
        let mut r = warmed(5 * US);
        r.record(DEFAULT_INLINE_BOUND * STALL_FACTOR + US);
        assert_eq!(r.next_run(), RunOn::Blocking);
    }

    #[test]
    fn one_long_run_sends_the_next_ones_to_a_blocking_thread_until_it_ages_out() {
        let mut r = warmed(5 * US);
        r.record(2_000 * US);
        for _ in 0..RECENT - 1 {
            assert_eq!(r.next_run(), RunOn::Blocking);
            r.record(5 * US);
        }
        assert_eq!(
            r.next_run(),
            RunOn::Blocking,
            "the long run is still recent"
        );
        r.record(5 * US);
        assert_eq!(r.next_run(), RunOn::Inline, "it aged out");
        assert_eq!(r.counts(), (1, RECENT as u64));
        // A lower bound applies to the runs already recorded.
        r.set_bound(4 * US);
        assert_eq!(r.next_run(), RunOn::Blocking);
        assert_eq!(r.counts(), (1, RECENT as u64 + 1));
    }

    #[test]
    fn inline_runs_are_probed_on_a_blocking_thread_now_and_then() {
        let mut r = warmed(5 * US);
        let blocking: Vec<u64> = (1..=3 * PROBE_EVERY)
            .filter(|_| {
                let on = r.next_run();
                r.record(5 * US);
                on == RunOn::Blocking
            })
            .collect();
        assert_eq!(blocking.len(), 3, "one probe per PROBE_EVERY runs");
    }

    #[test]
    fn a_zero_bound_never_runs_inline() {
        let mut r = InlineRuns::new(Duration::ZERO);
        for _ in 0..2 * RECENT {
            r.record(Duration::ZERO);
            assert_eq!(r.next_run(), RunOn::Blocking);
        }
    }
}
