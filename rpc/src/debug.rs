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
pub use tensorwire_core::protocol::gather::GatherDebugInfo;

/// "w0 (rank 0): 1 values kept; " and core's words for the protocol's view and the gathers.
impl fmt::Display for AgentDebugInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} values kept; {}; {}",
            self.worker, self.kept_values, self.protocol, self.gathers
        )
    }
}
