//! Why a peer is gone: the cause a worker records once per lost peer, which every call to it
//! then fails with.

use super::violation::ProtocolViolation;

/// Why a peer is gone ([`Endpoint::handle_peer_lost`](super::Endpoint::handle_peer_lost)),
/// recorded once per peer: the first cause the driver reports stays (a link's reader and
/// writer may both see its end).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LostCause {
    /// Its connection broke or closed: the transport's error, as the link saw it. (Boxed:
    /// errors that carry a cause stay small.)
    #[error("{0}")]
    Transport(Box<crate::ports::transport::TransportError>),
    /// A message was due to it and this worker has no connection to it (it never connected,
    /// or its link is gone and no loss was recorded yet).
    #[error("no connection to it")]
    NoConnection,
    /// It aborted the group whose connections the agent shares, saying why (its own words,
    /// in its own name: a rank may report only its own abort), and its connection ended.
    #[error("it aborted its group: {reason}")]
    Aborted {
        /// What it said.
        reason: String,
    },
    /// It broke the protocol of the group whose connections the agent shares: that group
    /// dropped it.
    #[error("it broke its group's protocol: {0}")]
    GroupViolation(Box<crate::ports::process_group::MeshViolation>),
    /// It sent what it had no right to send (or bytes that are no message): the driver
    /// dropped it. Every survivor's calls to it fail with this. (Boxed: errors that carry a
    /// cause stay small.)
    #[error("it broke the RPC protocol: {0}")]
    Misbehaved(Box<ProtocolViolation>),
    /// It left the group (dynamic groups).
    #[error("it left the group")]
    Left,
    /// It shut down (its graceful shutdown completed, or it stopped at once).
    #[error("it shut down")]
    Shutdown,
    /// It made this worker hold more than its memory budget per peer (`peer_budget`, see
    /// [`crate::budget`]): frames queued for it that it did not read, collective messages no
    /// collective took, a frame it is sending, records kept for it, all counted together. The
    /// driver dropped it and freed what was queued for it. (Boxed: errors that carry a cause
    /// stay small.)
    #[error("it passed its memory budget: {0}")]
    OverBudget(Box<crate::budget::OverBudget>),
}
