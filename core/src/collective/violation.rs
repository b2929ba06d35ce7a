//! What a peer did wrong on the mesh: [`MeshViolation`], decided by the inbox's admission
//! ([`crate::collective::inbox`]) before anything it sent is held or believed.

use crate::wire::FrameKind;

/// A group frame its sender had no right to send (see DESIGN "Trust: what a peer may do"):
/// the receiving mesh drops the sender and fails with [`ProcessGroupError::Misbehaved`](crate::ports::process_group::ProcessGroupError::Misbehaved).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MeshViolation {
    /// An abort naming another rank: a rank may only report its own abort.
    #[error("it sent an abort naming rank {named}, but a rank may only report its own abort")]
    ForeignAbort {
        /// The rank the abort named.
        named: usize,
    },
    /// A collective frame for a group the sender is not a member of.
    #[error("it sent a collective frame for group {group}, of which it is not a member")]
    NotInGroup {
        /// The group's id (0: the world group).
        group: u64,
    },
    /// A collective frame for a group id further beyond the newest group made on this rank
    /// than `InboxLimits::group_id_window` ([`crate::collective::inbox::InboxLimits`]).
    #[error("it sent a collective frame for group {group}, more than {window} ids beyond the newest group here ({newest})")]
    UnknownGroup {
        /// The id it named.
        group: u64,
        /// The newest group id made on this rank.
        newest: u64,
        /// The bound.
        window: u64,
    },
    /// A collective frame for a sequence number too far ahead of this rank's own collectives.
    #[error("it sent a frame for collective #{seq} of group {group}, more than {window} ahead of this rank's newest ({here})")]
    AheadOfWindow {
        /// The group's id.
        group: u64,
        /// The sequence number it sent.
        seq: u64,
        /// The newest sequence number this rank has run in the group.
        here: u64,
        /// The bound (`InboxLimits::sequence_window`, [`crate::collective::inbox::InboxLimits`]).
        window: u64,
    },
    /// A disagreement notice its sender could not have seen: a rank may report only a
    /// disagreement of its own, with another member of the group it names, about a
    /// collective of that group within the sequence window, between two different collectives
    /// ([`crate::collective::inbox::Admission::check_disagreement`]).
    #[error("it reported that rank {peer} disagreed about collective #{seq} of group {group}, but {reason}")]
    ForgedDisagreement {
        /// The group the notice named.
        group: u64,
        /// The rank the notice blamed.
        peer: usize,
        /// The sequence number it named.
        seq: u64,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// A report of a failed stage of a hierarchical collective that blames ranks its sender
    /// did not wait for: a rank may blame only ranks of its own host, or (a leader) other
    /// leaders ([`crate::collective::stage_failure::check_stage_report`]).
    #[error("it reported ranks failing in a stage of group {group}, but {reason}")]
    ForgedStageReport {
        /// The hierarchical group the report named.
        group: u64,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// It made this rank hold more unclaimed messages than a peer may.
    #[error("it sent more than {limit} {what} that no collective here has taken yet")]
    InboxFull {
        /// `"messages"` (their bytes draw from the peer's budget: [`Self::OverBudget`]).
        what: &'static str,
        /// The bound.
        limit: usize,
    },
    /// Its collective messages that no collective has taken would pass its memory budget,
    /// with what else it makes this rank hold ([`crate::budget`]).
    #[error("{0}")]
    OverBudget(crate::budget::OverBudget),
    /// A frame of a kind a process group's link does not carry once it is set up (a second
    /// hello, a message for an RPC agent the group does not serve): only group frames
    /// ([`FrameKind::Collective`]) are taken.
    #[error(
        "it sent a {kind:?} frame, which a process group's link does not carry after its hello"
    )]
    NotAGroupFrame {
        /// The kind it sent.
        kind: FrameKind,
    },
    /// A group frame whose header does not decode (core's `protocol::mesh::GroupFrame`).
    #[error("it sent a group frame that does not decode: {source}")]
    MalformedGroupFrame {
        /// What the decoder found wrong.
        #[source]
        source: crate::wire::MeshFrameError,
    },
}
