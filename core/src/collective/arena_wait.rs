//! A rank's waits in the group arena, decided sans-IO: whom it still waits for, when to look
//! again, and, when the wait cannot end well, the failure, naming the ranks.
//!
//! The arena's executor (the shared-memory transport's) carries a wait out: it polls the
//! counters for its spin budget, then sleeps, and after every wake-up it asks
//! [`ArenaWait::step`] with the counters it sees, the time on the group's clock and what it
//! knows of the awaited ranks' processes ([`Lost`]). The answer is to stop waiting
//! ([`WaitStep::Done`]), to sleep until a given time at the latest ([`WaitStep::Sleep`]: the
//! next liveness check, or the deadline), or a failure ([`WaitStep::Failed`]):
//!
//! - a rank still awaited whose process ended, or that the group knows is gone, is named first
//!   (the lowest such rank);
//! - else, at the deadline, [`ArenaFailure::Timeout`] names **every** rank still awaited (whose
//!   counter has not reached what this rank waits for), in rank order;
//! - a caller that gives up on the collective earlier (a `Work::wait` with a shorter timeout)
//!   asks [`ArenaWait::expire`]: the same timeout, with the caller's duration.
//!
//! A failed collective leaves the ranks out of step (some published phases the others never
//! will), so a rank's [`ArenaState`](super::arena::ArenaState) keeps its first failure
//! ([`ArenaState::fail`](super::arena::ArenaState::fail)) and every later collective through
//! the arena fails with it.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use tensorwire_core::collective::arena_wait::{ArenaFailure, ArenaWait, WaitStep, LIVENESS_PERIOD};
//!
//! let t0 = Instant::now();
//! let timeout = Duration::from_secs(1);
//! // Rank 0 of 4 waits for everyone's first phase (a barrier); rank 2 has published it.
//! let wait = ArenaWait::new(vec![(1, 1), (2, 1), (3, 1)], t0 + timeout, timeout);
//! let counters = [1, 0, 1, 0];
//! let alive = |_| None;
//! assert_eq!(
//!     wait.step(|q| counters[q], t0, alive),
//!     WaitStep::Sleep { until: t0 + LIVENESS_PERIOD }
//! );
//! assert_eq!(
//!     wait.step(|q| counters[q], t0 + timeout, alive),
//!     WaitStep::Failed(ArenaFailure::Timeout { waiting_on: vec![1, 3], timeout })
//! );
//! ```

use std::time::{Duration, Instant};

/// The value a counter holds after `phases` phases (counters wrap; compare with
/// [`reached`]).
pub fn counter(phases: u64) -> u32 {
    phases as u32
}

/// Whether a counter holding `value` has reached `target` (wrapping: within 2³¹ phases).
pub fn reached(value: u32, target: u32) -> bool {
    (value.wrapping_sub(target) as i32) >= 0
}

/// Whether every rank of `ranks` has published `target` (each rank's counter as `counter`
/// gives it): what [`ArenaWait::done`] says of a wait for `ranks` at `target`, without making
/// one (the executor's first looks, before it may have to sleep).
pub fn all_reached(ranks: &[usize], target: u32, counter: impl Fn(usize) -> u32) -> bool {
    ranks.iter().all(|q| reached(counter(*q), target))
}

/// How long a waiting rank sleeps at most before it looks again at the processes of the ranks it
/// waits for (a rank whose process ended is named within about this long).
pub const LIVENESS_PERIOD: Duration = Duration::from_millis(20);

/// Why the group says a rank is gone ([`Lost::Gone`], [`ArenaFailure::Gone`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Gone {
    /// It shut its group down (it said goodbye).
    #[error("it left the group")]
    Left,
    /// Its connection broke, or the group dropped it.
    #[error("its connection broke")]
    ConnectionBroke,
    /// The group is broken (the group's own error names why; the driver reports that).
    #[error("the group is broken")]
    GroupBroken,
}

/// What the executor knows of an awaited rank that will not publish again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lost {
    /// Its process ended.
    Died,
    /// The group says it is gone (it left, or its connection broke): why.
    Gone(Gone),
    /// It saw ranks run different collectives (or one with other arguments) and said so in
    /// the arena: it fails that collective and every later one, so it will not publish again.
    Disagreed,
    /// Its process ended (or the group says it is gone) after a collective of its own had
    /// failed, as it said in the arena: a consequence, not a cause. It is named only when no
    /// other awaited rank is lost (a rank that failed because another died, and then exited,
    /// would otherwise be blamed for that death).
    EndedAfterFailing,
}

/// Why a collective through the arena failed. Every later collective through the same arena
/// fails with the same one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ArenaFailure {
    /// The deadline passed (or the caller gave up after `timeout`) while this rank waited for
    /// `waiting_on`: every rank whose counter had not moved on, in rank order.
    #[error("timed out after {timeout:?} waiting for rank(s) {waiting_on:?} in the arena")]
    Timeout {
        /// The ranks still awaited.
        waiting_on: Vec<usize>,
        /// The collective's timeout, or the caller's.
        timeout: Duration,
    },
    /// The process of `rank` ended while this rank waited for it.
    #[error("rank {rank} died during a collective through the arena")]
    Died {
        /// The group rank.
        rank: usize,
    },
    /// The group said `rank` is gone while this rank waited for it.
    #[error("rank {rank} is gone: {why}")]
    Gone {
        /// The group rank.
        rank: usize,
        /// What the group knows.
        why: Gone,
    },
    /// `rank` saw ranks run different collectives (or one with other arguments) and said so in
    /// the arena: the ranks are out of step. (A broadcast's root, which waits for nobody, learns
    /// of a disagreement this way, at its next collective, as over the links it learns from
    /// the notice.)
    #[error("rank {rank} saw ranks run different collectives (or one with other arguments) through the arena")]
    DisagreementReported {
        /// The rank that saw it.
        rank: usize,
    },
    /// `rank` ran another collective (or the same with other arguments) in the same phase.
    #[error("rank {rank} ran a different collective (or other arguments) through the arena")]
    Disagreement {
        /// The group rank.
        rank: usize,
    },
}

/// What a waiting rank does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitStep {
    /// Every awaited rank has published: go on.
    Done,
    /// Sleep until woken (a publication), or `until` at the latest, then ask again.
    Sleep {
        /// The next liveness check, or the deadline if that comes first.
        until: Instant,
    },
    /// The wait failed.
    Failed(ArenaFailure),
}

/// One wait of one rank: for each awaited rank, the counter value it must reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaWait {
    targets: Vec<(usize, u32)>,
    deadline: Instant,
    timeout: Duration,
}

impl ArenaWait {
    /// A wait for `targets` (rank, counter value), failing at `deadline` on the group's clock;
    /// `timeout` is what a timeout reports.
    pub fn new(targets: Vec<(usize, u32)>, deadline: Instant, timeout: Duration) -> Self {
        ArenaWait {
            targets,
            deadline,
            timeout,
        }
    }

    /// The ranks (and values) this wait is for.
    pub fn targets(&self) -> &[(usize, u32)] {
        &self.targets
    }

    /// The collective's deadline.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether every awaited rank has published, given each rank's counter.
    pub fn done(&self, counter: impl Fn(usize) -> u32) -> bool {
        self.targets
            .iter()
            .all(|(q, target)| reached(counter(*q), *target))
    }

    /// Whether rank `q` has reached every target this wait has for it.
    fn reached_by(&self, q: usize, counter: impl Fn(usize) -> u32) -> bool {
        self.targets
            .iter()
            .filter(|(r, _)| *r == q)
            .all(|(_, target)| reached(counter(q), *target))
    }

    /// The ranks still awaited, in rank order, without repeats.
    pub fn missing(&self, counter: impl Fn(usize) -> u32) -> Vec<usize> {
        let mut out: Vec<usize> = self
            .targets
            .iter()
            .filter(|(q, target)| !reached(counter(*q), *target))
            .map(|(q, _)| *q)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// What to do now, given the counters, the time on the group's clock, and what is known
    /// of the ranks still awaited (`lost` is asked only about those).
    pub fn step(
        &self,
        counter: impl Fn(usize) -> u32,
        now: Instant,
        lost: impl Fn(usize) -> Option<Lost>,
    ) -> WaitStep {
        let missing = self.missing(&counter);
        if missing.is_empty() {
            return WaitStep::Done;
        }
        let mut after_failing = None;
        for q in &missing {
            let Some(end) = lost(*q) else { continue };
            // A rank may publish and then leave (or exit) between the read of its counter above
            // and this look at its end: what it published before it went counts, so its counter
            // is read again, now that its end is known.
            if self.reached_by(*q, &counter) {
                continue;
            }
            return WaitStep::Failed(match end {
                Lost::Died => ArenaFailure::Died { rank: *q },
                Lost::Gone(why) => ArenaFailure::Gone { rank: *q, why },
                Lost::Disagreed => ArenaFailure::DisagreementReported { rank: *q },
                Lost::EndedAfterFailing => {
                    after_failing.get_or_insert(*q);
                    continue;
                }
            });
        }
        if let Some(rank) = after_failing {
            return WaitStep::Failed(ArenaFailure::Died { rank });
        }
        let missing = self.missing(&counter);
        if missing.is_empty() {
            return WaitStep::Done;
        }
        if now >= self.deadline {
            return WaitStep::Failed(ArenaFailure::Timeout {
                waiting_on: missing,
                timeout: self.timeout,
            });
        }
        let until = now
            .checked_add(LIVENESS_PERIOD)
            .map_or(self.deadline, |t| t.min(self.deadline));
        WaitStep::Sleep { until }
    }

    /// The caller gave up after `after` (before the deadline): the timeout naming the ranks
    /// still awaited, or `None` when none is (the wait is done after all).
    pub fn expire(&self, counter: impl Fn(usize) -> u32, after: Duration) -> Option<ArenaFailure> {
        let missing = self.missing(counter);
        (!missing.is_empty()).then_some(ArenaFailure::Timeout {
            waiting_on: missing,
            timeout: after,
        })
    }
}

/// Before a collective through the arena: the lowest rank of `world` other than `me` that
/// said it saw a disagreement (`disagreed`), whose report fails this collective at once (the
/// ranks are out of step; waiting for that rank would only time out).
pub fn reported_disagreement(
    world: usize,
    me: usize,
    disagreed: impl Fn(usize) -> bool,
) -> Option<ArenaFailure> {
    (0..world)
        .find(|q| *q != me && disagreed(*q))
        .map(|rank| ArenaFailure::DisagreementReported { rank })
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(2);

    fn alive(_: usize) -> Option<Lost> {
        None
    }

    #[test]
    fn a_wait_is_done_once_every_counter_reached_its_target() {
        let t0 = Instant::now();
        let wait = ArenaWait::new(vec![(1, 3), (2, 3)], t0 + T, T);
        assert_eq!(wait.step(|_| 3, t0, alive), WaitStep::Done);
        // Further on counts too (a rank that moved on to the next phase).
        assert_eq!(wait.step(|q| 3 + q as u32, t0 + T, alive), WaitStep::Done);
        // Done even past the deadline: the counters are what matters.
        assert!(wait.done(|_| 4));
        // An empty wait is done at once.
        assert_eq!(
            ArenaWait::new(Vec::new(), t0, T).step(|_| 0, t0 + T, |_| Some(Lost::Died)),
            WaitStep::Done
        );
    }

    #[test]
    fn all_reached_says_what_a_wait_for_the_same_targets_says() {
        let t0 = Instant::now();
        let counters = [5u32, 4, 6, u32::MAX];
        for (ranks, target) in [
            (vec![0, 2], 5),
            (vec![0, 1], 5),
            (vec![3], u32::MAX),
            (vec![3], 0),
            (vec![], 9),
        ] {
            let wait = ArenaWait::new(ranks.iter().map(|q| (*q, target)).collect(), t0, T);
            assert_eq!(
                all_reached(&ranks, target, |q| counters[q]),
                wait.done(|q| counters[q]),
                "{ranks:?} at {target}"
            );
        }
        assert!(!all_reached(&[0, 1], 5, |q| counters[q]));
        assert!(all_reached(&[0, 2], 5, |q| counters[q]));
    }

    #[test]
    fn a_waiting_rank_sleeps_until_the_next_liveness_check_or_the_deadline() {
        let t0 = Instant::now();
        let wait = ArenaWait::new(vec![(1, 1)], t0 + T, T);
        assert_eq!(
            wait.step(|_| 0, t0, alive),
            WaitStep::Sleep {
                until: t0 + LIVENESS_PERIOD
            }
        );
        let late = t0 + T - Duration::from_millis(5);
        assert_eq!(
            wait.step(|_| 0, late, alive),
            WaitStep::Sleep { until: t0 + T }
        );
    }

    #[test]
    fn at_the_deadline_the_timeout_names_every_rank_still_awaited() {
        let t0 = Instant::now();
        // Rank 0 of 6 waits for everyone; 2 and 4 have published, 1, 3 and 5 have not.
        let wait = ArenaWait::new((1..6).map(|q| (q, 7)).collect(), t0 + T, T);
        let counters = [7, 6, 7, 0, 8, 6];
        assert_eq!(
            wait.step(|q| counters[q], t0 + T, alive),
            WaitStep::Failed(ArenaFailure::Timeout {
                waiting_on: vec![1, 3, 5],
                timeout: T
            })
        );
        // Not a moment before.
        assert!(matches!(
            wait.step(|q| counters[q], t0 + T - Duration::from_nanos(1), alive),
            WaitStep::Sleep { .. }
        ));
    }

    #[test]
    fn a_caller_that_gives_up_early_gets_the_timeout_with_its_own_duration() {
        let t0 = Instant::now();
        let wait = ArenaWait::new(vec![(3, 1), (1, 1), (2, 1)], t0 + T, T);
        let counters = [1, 1, 1, 0];
        let short = Duration::from_millis(300);
        assert_eq!(
            wait.expire(|q| counters[q], short),
            Some(ArenaFailure::Timeout {
                waiting_on: vec![3],
                timeout: short
            })
        );
        assert_eq!(wait.expire(|_| 1, short), None);
    }

    #[test]
    fn a_dead_or_gone_rank_still_awaited_is_named_before_the_deadline() {
        let t0 = Instant::now();
        let wait = ArenaWait::new(vec![(1, 1), (2, 1), (3, 1)], t0 + T, T);
        let counters = [1, 1, 0, 0];
        // Rank 1 died after it published: not this wait's business.
        let lost = |q: usize| match q {
            1 => Some(Lost::Died),
            3 => Some(Lost::Gone(Gone::Left)),
            _ => None,
        };
        assert_eq!(
            wait.step(|q| counters[q], t0, lost),
            WaitStep::Failed(ArenaFailure::Gone {
                rank: 3,
                why: Gone::Left
            })
        );
        let lost = |q: usize| (q == 2).then_some(Lost::Died);
        // Also past the deadline: the death is the better answer.
        assert_eq!(
            wait.step(|q| counters[q], t0 + T, lost),
            WaitStep::Failed(ArenaFailure::Died { rank: 2 })
        );
    }

    #[test]
    fn a_rank_that_published_and_then_left_between_two_looks_is_not_missing() {
        // Rank 2 publishes and shuts down between the first read of its counter and the look
        // at its end (the race of "init then immediate shutdown": rank 0 once failed a barrier
        // naming rank 2 as gone although rank 2 had arrived).
        use std::cell::Cell;
        let t0 = Instant::now();
        let wait = ArenaWait::new(vec![(1, 4), (2, 4)], t0 + T, T);
        let reads = Cell::new(0u32);
        let counter = |q: usize| {
            if q == 1 {
                return 4;
            }
            reads.set(reads.get() + 1);
            if reads.get() == 1 {
                3
            } else {
                4
            }
        };
        let gone = |q: usize| (q == 2).then_some(Lost::Gone(Gone::Left));
        assert_eq!(wait.step(counter, t0, gone), WaitStep::Done);
        // Had it not published before it went, its end is the answer.
        assert_eq!(
            wait.step(|q| if q == 2 { 3 } else { 4 }, t0, gone),
            WaitStep::Failed(ArenaFailure::Gone {
                rank: 2,
                why: Gone::Left
            })
        );
        // The same for a process that exited.
        reads.set(0);
        let died = |q: usize| (q == 2).then_some(Lost::Died);
        assert_eq!(wait.step(counter, t0, died), WaitStep::Done);
    }

    #[test]
    fn a_rank_that_reported_a_disagreement_fails_the_waits_for_it_and_the_next_collective() {
        let t0 = Instant::now();
        let wait = ArenaWait::new(vec![(1, 2), (2, 2)], t0 + T, T);
        let disagreed = |q: usize| (q == 2).then_some(Lost::Disagreed);
        assert_eq!(
            wait.step(|_| 1, t0, disagreed),
            WaitStep::Failed(ArenaFailure::DisagreementReported { rank: 2 })
        );
        // Not a rank this wait no longer waits for.
        assert_eq!(
            wait.step(|q| if q == 2 { 2 } else { 1 }, t0, disagreed),
            WaitStep::Sleep {
                until: t0 + LIVENESS_PERIOD
            }
        );
        // Before a collective: the lowest reporting rank but this one.
        assert_eq!(
            reported_disagreement(4, 1, |q| q == 1 || q == 3),
            Some(ArenaFailure::DisagreementReported { rank: 3 })
        );
        assert_eq!(reported_disagreement(4, 1, |q| q == 1), None);
    }

    #[test]
    fn a_rank_that_ended_after_its_own_failure_is_named_only_when_no_other_is_lost() {
        // Rank 0 failed because rank 2 died, and exited; rank 1 still waits for both.
        let t0 = Instant::now();
        let wait = ArenaWait::new(vec![(0, 3), (2, 3)], t0 + T, T);
        let lost = |q: usize| match q {
            0 => Some(Lost::EndedAfterFailing),
            2 => Some(Lost::Died),
            _ => None,
        };
        assert_eq!(
            wait.step(|_| 2, t0, lost),
            WaitStep::Failed(ArenaFailure::Died { rank: 2 })
        );
        // Alone, it is named (its process did end).
        let lost = |q: usize| (q == 0).then_some(Lost::EndedAfterFailing);
        assert_eq!(
            wait.step(|_| 2, t0, lost),
            WaitStep::Failed(ArenaFailure::Died { rank: 0 })
        );
    }

    #[test]
    fn an_endless_timeout_sleeps_in_liveness_periods() {
        // A caller's `Duration::MAX` is a deadline some 30 years on (the runtime port's
        // `deadline_after`).
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(30 * 365 * 86_400);
        let wait = ArenaWait::new(vec![(1, 1)], far, Duration::MAX);
        assert_eq!(
            wait.step(|_| 0, t0, alive),
            WaitStep::Sleep {
                until: t0 + LIVENESS_PERIOD
            }
        );
    }
}
