//! What a peer did wrong on the mesh: [`MeshViolation`], decided by the inbox's admission
//! ([`crate::collective::inbox`]) before anything it sent is held or believed.

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
    /// disagreement of its own, with a rank it shares a group with, about a collective
    /// within the sequence window, between two different collectives
    /// ([`crate::collective::inbox::Admission::check_disagreement`]).
    #[error("it reported that rank {peer} disagreed about collective #{seq}, but {reason}")]
    ForgedDisagreement {
        /// The rank the notice blamed.
        peer: usize,
        /// The sequence number it named.
        seq: u64,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// It made this rank hold more unclaimed messages than a peer may.
    #[error("it sent more than {limit} {what} that no collective here has taken yet")]
    InboxFull {
        /// `"bytes"` or `"messages"`.
        what: &'static str,
        /// The bound.
        limit: usize,
    },
}
