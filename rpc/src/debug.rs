//! The agent's debug view ([`Agent::debug_info`](crate::Agent::debug_info)): what it holds and
//! waits for.

use std::fmt;

use tensorwire_core::protocol::DebugInfo;

use tensorwire_core::protocol::membership::WorkerInfo;

/// What an agent holds and waits for: [`Agent::debug_info`](crate::Agent::debug_info).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AgentDebugInfo {
    /// This worker.
    pub worker: WorkerInfo,
    /// Values kept for references this worker owns.
    pub kept_values: usize,
    /// The protocol's view: owned references and their forks, forks held here (pending users
    /// are the unconfirmed ones), calls in flight and requests being served per peer.
    pub protocol: DebugInfo,
    /// The gathers of a dynamic group this worker leads.
    pub gathers: GatherDebugInfo,
}

/// What the leader of a dynamic group's gathers holds ([`AgentDebugInfo::gathers`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GatherDebugInfo {
    /// Rounds under way (candidates the leader has not joined included).
    pub rounds: usize,
    /// Bytes of members' values held.
    pub held_bytes: usize,
    /// Calls waiting for their answer.
    pub waiting: usize,
}

impl fmt::Display for AgentDebugInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.protocol;
        write!(
            f,
            "{}: {} values kept; owned references {}; forks held {}; calls in flight {:?}; requests being served {:?}; gathers led {} ({} bytes, {} waiting)",
            self.worker,
            self.kept_values,
            p.owned
                .iter()
                .map(|o| format!("{} ({} forks elsewhere, {} handles here{}{})", o.rref, o.forks, o.local_handles, if o.request_holds > 0 { format!(", held by {} requests being served", o.request_holds) } else { String::new() }, if o.being_created { ", being created" } else { "" }))
                .collect::<Vec<_>>()
                .join(", "),
            p.forks
                .iter()
                .map(|u| format!("{} of {} on rank {} ({} handles{})", u.fork, u.rref, u.owner, u.handles, if u.confirmed { "" } else { ", pending user" }))
                .collect::<Vec<_>>()
                .join(", "),
            p.calls_in_flight,
            p.requests_being_served,
            self.gathers.rounds,
            self.gathers.held_bytes,
            self.gathers.waiting,
        )
    }
}
