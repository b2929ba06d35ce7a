//! A failed stage of a hierarchical collective ([`super::hierarchy`]), told to the other hosts:
//! who is blamed, what is forwarded, and how long each stage may wait, decided sans-IO.
//!
//! A stage sees only its own group: the ranks of one host (through the arena) or the leaders
//! (over the links). When a rank on host B stops (or dies) in the first stage, B's other ranks
//! see it, but the other hosts' ranks only wait for B's leader (the leaders' stage), or for
//! their own leader (the last stage), and would time out naming it. So:
//!
//! - **Who reports, and whom it blames** ([`stage_report`]): a rank whose own wait in a stage
//!   failed, on a rank it waited for in that stage (its timeout names every rank still
//!   awaited; a death names the dead rank), tells every other rank of the hierarchical group,
//!   naming those ranks (world ranks) and what happened to them. A failure this rank was told
//!   of (a report, an abort, a death another rank saw) is not reported again, and neither are
//!   argument errors, disagreements (their own notices travel) or a shutdown.
//! - **When each stage gives up** ([`stage_bounds`], [`forward_allowance`]): the stages of one
//!   collective share its timeout `T`, measured from the call. The first host stage gives up
//!   at `T − 2a`, the leaders' stage at `T − a`, the last host stage at `T` (`a`: the
//!   allowance for a report to arrive). A rank that waits on another stage's rank waits
//!   longer than the ranks that watch that rank directly, so the report reaches it before its
//!   own bound names the wrong rank, and every rank still fails within `T`.
//! - **What a report may say** ([`check_stage_report`]): a rank may blame only ranks of a
//!   stage group it is in: ranks of its own host, or (a leader) the other leaders. Anything
//!   else is a [`MeshViolation::ForgedStageReport`] of its sender. A report that passes is
//!   believed as its sender's account: the error names the sender too
//!   ([`StageReport::error`]).
//!
//! The simulation below runs every collective on every assignment of up to 7 ranks to hosts
//! with each rank stalled in turn, ranks starting at different times and reports taking time
//! to arrive (within the allowance), and checks that every other rank fails by `T` naming the
//! stalled rank, and that every report it sends passes the check.
//!
//! ```
//! use std::time::Duration;
//! use tensorwire_core::collective::hierarchy::{HierOp, HostPlan, Stage, Step};
//! use tensorwire_core::collective::stage_failure::{forward_allowance, stage_bounds};
//!
//! // Ranks 0 and 1 on one host, 2 and 3 on another.
//! let plan = HostPlan::new(&["a", "a", "b", "b"]);
//! let t = Duration::from_secs(8);
//! let a = forward_allowance(t);
//! assert_eq!(a, Duration::from_secs(1));
//! // A leader's barrier: in its host, among the leaders, then the release in its host.
//! assert_eq!(
//!     stage_bounds(&plan, 0, HierOp::Barrier, t),
//!     vec![
//!         (Stage::Host(Step::Barrier), t - 2 * a),
//!         (Stage::Leaders(Step::Barrier), t - a),
//!         (Stage::Host(Step::Barrier), t),
//!     ]
//! );
//! ```

use std::time::Duration;

use super::hierarchy::{HierOp, HostPlan, Stage};
use super::MeshViolation;
use crate::ports::process_group::ProcessGroupError;

/// The most a report is allowed to take from its sender's bound to its receivers.
pub const MAX_FORWARD_ALLOWANCE: Duration = Duration::from_secs(1);

/// How much earlier than the next level each stage level gives up, for a collective of
/// timeout `timeout`: an eighth of it, at most [`MAX_FORWARD_ALLOWANCE`]. Ranks that start a
/// collective further apart than this (or a report that takes longer) may still name the rank
/// they waited for rather than the one that failed.
pub fn forward_allowance(timeout: Duration) -> Duration {
    (timeout / 8).min(MAX_FORWARD_ALLOWANCE)
}

/// Each of rank `rank`'s stages for `op` ([`HostPlan::stages`]), with the time from the call
/// by which it gives up: a host stage before the leaders' at `timeout − 2a`, the leaders' at
/// `timeout − a`, a host stage after the leaders' at `timeout` (`a`:
/// [`forward_allowance`]). A broadcast's host stage is before the leaders' on the root's host
/// and after it elsewhere.
pub fn stage_bounds(
    plan: &HostPlan,
    rank: usize,
    op: HierOp,
    timeout: Duration,
) -> Vec<(Stage, Duration)> {
    let a = forward_allowance(timeout);
    let level = |n: u32| timeout.saturating_sub(a * (2 - n));
    let host = plan.host_of(rank);
    let mut host_stages = 0;
    plan.stages(rank, op)
        .into_iter()
        .map(|stage| {
            let bound = match stage {
                Stage::Leaders(_) => level(1),
                Stage::Host(_) => {
                    host_stages += 1;
                    let before = match op {
                        HierOp::Broadcast { root } => plan.host_of(root) == host,
                        _ => host_stages == 1,
                    };
                    level(if before { 0 } else { 2 })
                }
            };
            (stage, bound)
        })
        .collect()
}

/// What happened to the ranks a report names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageCause {
    /// The reporter saw their process end (or their connection break).
    Died,
    /// They did not come within the reporter's stage bound, which was `waited` long.
    TimedOut {
        /// How long the reporter's stage waited.
        waited: Duration,
    },
}

/// What a rank tells the other ranks of its hierarchical group when a stage of its own failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageReport {
    /// The ranks it blames, as world ranks, ascending.
    pub ranks: Vec<usize>,
    /// What happened to them.
    pub cause: StageCause,
}

/// The report a rank sends when a stage of its hierarchical collective failed with `error`
/// (the stage's own group's error: a timeout names that group's ranks, `members` gives their
/// world ranks; a dead rank is named by its world rank already, and reported only when it is
/// one of `members`), or `None` when the failure is not one this rank saw itself on a rank it
/// waited for.
pub fn stage_report(error: &ProcessGroupError, members: &[usize]) -> Option<StageReport> {
    match error {
        ProcessGroupError::Timeout {
            waiting_on,
            timeout,
            ..
        } => {
            let mut ranks: Vec<usize> = waiting_on
                .iter()
                .map(|r| members.get(*r).copied())
                .collect::<Option<_>>()?;
            ranks.sort_unstable();
            ranks.dedup();
            (!ranks.is_empty()).then_some(StageReport {
                ranks,
                cause: StageCause::TimedOut { waited: *timeout },
            })
        }
        // A death seen on the links may be any rank's: reported only for one of the stage's
        // (a rank blames only those it shares a stage with).
        ProcessGroupError::PeerDied {
            rank,
            reported_by: None,
            ..
        } if members.contains(rank) => Some(StageReport {
            ranks: vec![*rank],
            cause: StageCause::Died,
        }),
        _ => None,
    }
}

impl StageReport {
    /// The error a rank fails with when world rank `reporter` sent this report.
    pub fn error(&self, reporter: usize) -> ProcessGroupError {
        match self.cause {
            StageCause::Died => ProcessGroupError::PeerDied {
                rank: self.ranks[0],
                reported_by: Some(reporter),
                reason: "its process ended (or its connection broke) during a stage of a \
                         collective across hosts"
                    .to_owned(),
            },
            StageCause::TimedOut { waited } => ProcessGroupError::StageTimedOut {
                waiting_on: self.ranks.clone(),
                reported_by: reporter,
                waited,
            },
        }
    }
}

/// Whether world rank `sender` may send a report blaming `ranks` in the hierarchical group
/// whose hosts are `hosts` (world ranks, each host's ascending and its first the leader):
///
/// - it blames at least one rank, and never itself;
/// - it is a member of the group, and so is every rank it blames;
/// - each rank it blames is on its host, or it and that rank are both leaders (a rank waits
///   only on those in its stages).
///
/// Anything else is [`MeshViolation::ForgedStageReport`] of the sender.
pub fn check_stage_report(
    hosts: &[Vec<usize>],
    group: u64,
    sender: usize,
    ranks: &[usize],
) -> Result<(), MeshViolation> {
    let forged = |reason| Err(MeshViolation::ForgedStageReport { group, reason });
    if ranks.is_empty() {
        return forged("it blamed no rank");
    }
    if ranks.contains(&sender) {
        return forged("it blamed itself");
    }
    let host_of = |r: usize| hosts.iter().position(|h| h.contains(&r));
    let is_leader = |r: usize| hosts.iter().any(|h| h.first() == Some(&r));
    let Some(own) = host_of(sender) else {
        return forged("it is not a member of that group");
    };
    for r in ranks {
        let Some(theirs) = host_of(*r) else {
            return forged("a rank it blamed is not a member of that group");
        };
        if theirs != own && !(is_leader(sender) && is_leader(*r)) {
            return forged("a rank it blamed shares none of its stages");
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "stage_failure_sim.rs"]
mod sim;
