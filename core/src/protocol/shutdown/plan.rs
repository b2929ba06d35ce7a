//! What an agent's shutdown does, given how it was asked to stop and what the agent is: which
//! stage runs before the release (the group's termination detection, a dynamic member's
//! leave, or none), the bound on all of it, and who removes the group's last key from the
//! store. The agent runs the stages it is given within that bound (`tensorwire_rpc`'s
//! `Agent::shutdown`).
//!
//! ```
//! use std::time::Duration;
//! use tensorwire_core::protocol::shutdown::plan::{Shutdown, Stage};
//!
//! let plan = Shutdown::graceful(Duration::from_secs(30)).plan(false, 0);
//! assert_eq!(plan.stage, Stage::Graceful);
//! assert_eq!(plan.timeout, Duration::from_secs(30));
//! assert!(plan.clears_group_kind, "rank 0 of a static group removes the group's kind");
//! ```

use std::time::Duration;

use crate::name::WorkerId;

/// How long an immediate shutdown lets queued messages leave before it closes the connections.
pub const IMMEDIATE_CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How an agent stops (`Agent::shutdown` of `tensorwire_rpc`, which re-exports it).
///
/// ```
/// use std::time::Duration;
/// use tensorwire_core::protocol::shutdown::plan::Shutdown;
///
/// assert_eq!(
///     Shutdown::graceful(Duration::from_secs(30)),
///     Shutdown::Graceful { timeout: Duration::from_secs(30) }
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Shutdown {
    /// Wait until no worker has work left and no call is in flight anywhere — including the
    /// calls that functions started without awaiting them (fire-and-forget chains) — then
    /// stop; all within `timeout` (PyTorch's `shutdown(graceful=True)`, whose
    /// `_wait_all_workers` repeats a global count of calls in flight until a round sees none;
    /// see [`crate::protocol::shutdown`] for ours).
    Graceful {
        /// The bound on the whole shutdown.
        timeout: Duration,
    },
    /// Fail pending calls at once and stop; queued messages get
    /// [`IMMEDIATE_CLOSE_TIMEOUT`] to leave before the connections close.
    Immediate,
}

/// What runs before an agent releases what it holds ([`ShutdownPlan::stage`]). Exhaustive: a
/// new stage breaks the driver's build instead of being skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// A static group's graceful shutdown: the termination detection over the members'
    /// connections ([`Endpoint::begin_graceful_shutdown`](crate::protocol::Endpoint::begin_graceful_shutdown)).
    Graceful,
    /// A dynamic group's member leaves it gracefully
    /// ([`Endpoint::begin_leave`](crate::protocol::Endpoint::begin_leave) and the membership's
    /// leave).
    Leave,
    /// Nothing: an immediate shutdown fails pending calls and stops.
    Nothing,
}

/// What one agent's shutdown does ([`Shutdown::plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownPlan {
    /// What runs before the release.
    pub stage: Stage,
    /// The bound on the whole shutdown, the release's flush of queued messages included.
    pub timeout: Duration,
    /// Whether this agent removes the group's kind from the store once the stage is over
    /// (rank 0 of a static group, which put it there and hosts the store; a dynamic group's
    /// last member removes its keys when it leaves).
    pub clears_group_kind: bool,
}

impl Shutdown {
    /// [`Shutdown::Graceful`] within `timeout`.
    pub const fn graceful(timeout: Duration) -> Self {
        Shutdown::Graceful { timeout }
    }

    /// What the shutdown of the agent of rank `me` does, in a dynamic group or a static one.
    pub fn plan(self, dynamic: bool, me: WorkerId) -> ShutdownPlan {
        let (stage, timeout) = match self {
            Shutdown::Graceful { timeout } if dynamic => (Stage::Leave, timeout),
            Shutdown::Graceful { timeout } => (Stage::Graceful, timeout),
            Shutdown::Immediate => (Stage::Nothing, IMMEDIATE_CLOSE_TIMEOUT),
        };
        ShutdownPlan {
            stage,
            timeout,
            clears_group_kind: me == 0 && !dynamic,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_graceful_shutdown_detects_termination_in_a_static_group_and_leaves_a_dynamic_one() {
        let t = Duration::from_secs(7);
        let stat = Shutdown::graceful(t).plan(false, 3);
        assert_eq!(
            (stat.stage, stat.timeout, stat.clears_group_kind),
            (Stage::Graceful, t, false)
        );
        let dynamic = Shutdown::graceful(t).plan(true, 3);
        assert_eq!((dynamic.stage, dynamic.timeout), (Stage::Leave, t));
    }

    #[test]
    fn an_immediate_shutdown_runs_no_stage_and_flushes_within_its_own_bound() {
        for dynamic in [false, true] {
            let plan = Shutdown::Immediate.plan(dynamic, 1);
            assert_eq!(plan.stage, Stage::Nothing);
            assert_eq!(plan.timeout, IMMEDIATE_CLOSE_TIMEOUT);
        }
    }

    #[test]
    fn only_rank_0_of_a_static_group_removes_the_groups_kind() {
        for how in [Shutdown::Immediate, Shutdown::graceful(Duration::ZERO)] {
            assert!(how.plan(false, 0).clears_group_kind);
            assert!(!how.plan(false, 1).clears_group_kind);
            assert!(
                !how.plan(true, 0).clears_group_kind,
                "a dynamic group's rank 0"
            );
        }
    }
}
