//! Why a collective, or setting up a group, failed ([`ProcessGroupError`]), and what a peer did
//! wrong on the mesh ([`MeshViolation`]).

use std::time::Duration;

use crate::collective::{CollectiveError, Signature};
use crate::device::Device;
use crate::ports::transport::TransportError;

/// What a rank saw of a peer that died ([`ProcessGroupError::PeerDied`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeathCause {
    /// Its connection failed or closed: the transport's error. (Boxed: errors that carry a
    /// cause stay small.)
    #[error("{0}")]
    Transport(Box<TransportError>),
    /// Its connection closed while a collective still expected a message from it.
    #[error("its connection closed")]
    ConnectionClosed,
    /// The group told the arena its connection broke while this rank waited for it there.
    #[error("its connection broke during {collective} through the group arena")]
    ConnectionBroke {
        /// The collective.
        collective: &'static str,
    },
    /// Its process ended while this rank waited for it in the group arena.
    #[error("its process{} ended during {collective} through the group arena", pid.map(|p| format!(" {p}")).unwrap_or_default())]
    ProcessEnded {
        /// Its process id, where the arena knows it.
        pid: Option<u32>,
        /// The collective.
        collective: &'static str,
    },
    /// It ended (its process, or its connection) during a stage of a collective across hosts,
    /// as the rank that reported it saw.
    #[error(
        "its process ended (or its connection broke) during a stage of a collective across hosts"
    )]
    InStage,
}

/// Why a collective (or setting up a group) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessGroupError {
    /// The collective did not complete within the group's timeout.
    #[error(
        "{collective} #{seq} on rank {rank} timed out after {timeout:?} waiting for rank(s) {}",
        RankList(.waiting_on)
    )]
    Timeout {
        /// The collective (`"barrier"`, `"all_gather"`, ...).
        collective: &'static str,
        /// Its sequence number in the group.
        seq: u64,
        /// This rank.
        rank: usize,
        /// The ranks whose messages had not arrived (or that had not taken ours).
        waiting_on: Vec<usize>,
        /// The timeout.
        timeout: Duration,
    },
    /// A peer's connection broke without a clean shutdown: the process died or the network
    /// failed. The group cannot be used any more.
    #[error("rank {rank} died{}: {cause}", reported_by.map(|r| format!(" (reported by rank {r})")).unwrap_or_default())]
    PeerDied {
        /// The rank that died.
        rank: usize,
        /// Another rank that saw it die and told us, if we did not see it ourselves.
        reported_by: Option<usize>,
        /// What was seen.
        cause: DeathCause,
    },
    /// Another rank of a group spanning hosts told this rank that `waiting_on` (world ranks)
    /// did not come within its stage of a collective that this rank's own stage waited on in
    /// turn (see [`crate::collective::stage_failure`]); the collective failed here on its
    /// word, within this rank's timeout. The group cannot be used any more.
    #[error(
        "rank(s) {} did not come within {waited:?} in a stage of a collective across hosts (reported by rank {reported_by})",
        RankList(.waiting_on)
    )]
    StageTimedOut {
        /// The ranks that did not come (world ranks).
        waiting_on: Vec<usize>,
        /// The rank that waited for them and told this one.
        reported_by: usize,
        /// How long its stage waited.
        waited: Duration,
    },
    /// A peer aborted its group (it saw a failure of its own and told the others); `reason`
    /// is its account, attributed to it: a rank may only report its own abort, so no other
    /// rank is blamed on its word.
    #[error("rank {rank} aborted its group: {reason}")]
    PeerAborted {
        /// The rank that aborted (the sender of the abort).
        rank: usize,
        /// What it said it saw.
        reason: String,
    },
    /// A peer sent a frame it had no right to send; its connection was dropped, which breaks
    /// the group as a dead rank would, naming it and what it did.
    #[error("rank {rank} broke the group's protocol: {violation}")]
    Misbehaved {
        /// The rank that sent the frame.
        rank: usize,
        /// What it did.
        violation: MeshViolation,
    },
    /// A peer sent, on a connection the group shares with the RPC agent, a frame the agent
    /// refused (it broke the RPC protocol; the agent's own errors name how): its connection
    /// was dropped, which breaks the group as a dead rank would.
    #[error("rank {rank} broke the RPC protocol on the group's connection (the agent refused a {kind:?} frame it sent)")]
    RefusedFrame {
        /// The rank that sent the frame.
        rank: usize,
        /// The frame's kind.
        kind: crate::wire::FrameKind,
    },
    /// A peer shut its group down cleanly while this rank still expected messages from it.
    #[error("rank {rank} left the group (shut down) while {collective} #{seq} still expected a message from it")]
    PeerLeft {
        /// The rank that left.
        rank: usize,
        /// The collective that needed it.
        collective: &'static str,
        /// Its sequence number.
        seq: u64,
    },
    /// Ranks disagree about the collective: a message's kind or length does not match.
    #[error("rank {peer} disagrees about {collective} #{seq}: {reason}")]
    Mismatch {
        /// The peer whose message did not fit.
        peer: usize,
        /// The collective this rank is running.
        collective: &'static str,
        /// Its sequence number.
        seq: u64,
        /// What did not match.
        reason: String,
    },
    /// Ranks ran different collectives, or one collective with different arguments (op,
    /// element type, element count, root), under the same sequence number. The rank that saw
    /// it tells every other rank, and on every rank that collective and every later one fail
    /// with this error (the collectives issued before it still complete; see
    /// [`crate::collective::disagreement`]): a rank fails at once if it still waits in that
    /// collective, else at the latest in its next collective that needs a message from the
    /// rank that saw it (every barrier, all_gather and all_reduce does; a broadcast needs only
    /// its root's).
    #[error("rank {peer} ran {theirs} as collective #{seq}, {}", Side::new(*.rank, .ours, *.here))]
    Disagreement {
        /// The collective's sequence number.
        seq: u64,
        /// The rank whose message disagreed.
        peer: usize,
        /// What it ran.
        theirs: Signature,
        /// The rank that received the message and saw the disagreement.
        rank: usize,
        /// What that rank ran.
        ours: Signature,
        /// Whether this error arose on this rank (else `rank` reported it).
        here: bool,
    },
    /// The arguments are invalid (rank out of range, buffer not whole elements, ...).
    #[error("invalid {collective} arguments: {source}")]
    Arguments {
        /// The collective.
        collective: &'static str,
        /// What was wrong.
        #[source]
        source: CollectiveError,
    },
    /// Sending to a peer failed: the transport's error. (Boxed: errors that carry a cause
    /// stay small.)
    #[error("sending to rank {rank} failed: {source}")]
    Send {
        /// The peer.
        rank: usize,
        /// The transport's error.
        #[source]
        source: Box<TransportError>,
    },
    /// This rank has no connection to a peer it must send to (its link is gone, or it never
    /// had one in this group).
    #[error("sending to rank {rank} failed: no connection to that rank")]
    NoConnection {
        /// The peer.
        rank: usize,
    },
    /// The task that ran a collective on this rank's runtime panicked or was cancelled (the
    /// runtime shut down under it), so the collective has no result.
    #[error("the {collective} task for rank {rank} {}", if *.panicked { "panicked" } else { "was cancelled" })]
    TaskFailed {
        /// The collective.
        collective: &'static str,
        /// The rank the task sent to or waited for.
        rank: usize,
        /// Whether it panicked (else it was cancelled).
        panicked: bool,
    },
    /// A tensor is not on the device the group works on.
    #[error("{collective}: the tensor is on {tensor}, but this {backend} group works on {group} tensors{}", if *.group == Device::Cpu { " (use an nccl group for CUDA tensors)" } else { "" })]
    WrongDevice {
        /// The collective.
        collective: &'static str,
        /// The group's backend.
        backend: &'static str,
        /// Where the tensor is.
        tensor: Device,
        /// Where the group works.
        group: Device,
    },
    /// The backend cannot run the collective on tensors of this dtype.
    #[error("{collective}: the {backend} backend does not support {dtype} tensors")]
    UnsupportedType {
        /// The collective.
        collective: &'static str,
        /// The group's backend.
        backend: &'static str,
        /// The tensor's dtype.
        dtype: String,
    },
    /// The backend's library reported an error (NCCL); the group cannot be used any more.
    #[error("{backend} {collective} #{seq} on rank {rank} failed: {reason}")]
    Backend {
        /// The group's backend.
        backend: &'static str,
        /// The collective.
        collective: &'static str,
        /// Its sequence number in the group.
        seq: u64,
        /// This rank.
        rank: usize,
        /// The library's message.
        reason: String,
    },
    /// Setting up the group did not finish in time: these ranks did not connect.
    #[error(
        "process group setup on rank {rank} timed out after {timeout:?} waiting for rank(s) {} to connect",
        RankList(.waiting_on)
    )]
    SetupTimeout {
        /// This rank.
        rank: usize,
        /// The ranks that did not connect (or publish their address), ascending.
        waiting_on: Vec<usize>,
        /// The setup's timeout.
        timeout: Duration,
    },
    /// Two connections claimed the same rank while this rank set its group up: one of them
    /// is not that rank (a worker holding the cluster secret but impersonating another; the
    /// secret names no rank, so this rank cannot tell which). The setup fails on this rank,
    /// which aborts its links saying so, rather than run with either.
    #[error("process group setup on rank {rank}: two connections claimed rank {claimed} (from {first} and from {second}); one of them is not rank {claimed}")]
    ClaimedTwice {
        /// This rank.
        rank: usize,
        /// The rank both claimed.
        claimed: usize,
        /// Where the first came from.
        first: std::net::SocketAddr,
        /// Where the second came from.
        second: std::net::SocketAddr,
    },
    /// A peer's certificate does not let it be the rank it claimed in its hello (this rank
    /// refused the connection, told it why and went on waiting for the real rank), or the
    /// peer this rank dialled as rank `claimed` is certified for another rank (the setup
    /// fails). Decided by [`check_rank_claim`](crate::identity::check_rank_claim).
    #[error("process group setup on rank {rank}: refused the connection with {peer}: {source}")]
    RankNotCertified {
        /// This rank.
        rank: usize,
        /// The peer's address.
        peer: std::net::SocketAddr,
        /// The rank it claimed (or was dialled as) and what its certificate names.
        #[source]
        source: crate::identity::RankClaimError,
    },
    /// Setting up the group failed (rendezvous, store, connections), said in the group's
    /// words with its data (a rank out of range, a malformed record, ...).
    #[error("process group setup on rank {rank}: {reason}")]
    Setup {
        /// This rank.
        rank: usize,
        /// What failed.
        reason: String,
    },
    /// Setting up the group failed where the store did.
    #[error("process group setup on rank {rank}: {doing} failed: {source}")]
    SetupStore {
        /// This rank.
        rank: usize,
        /// What the setup was doing through the store (`"publishing the arena"`, ...).
        doing: &'static str,
        /// The store's error.
        #[source]
        source: crate::ports::store::StoreError,
    },
    /// Setting up the group failed where the transport did.
    #[error("process group setup on rank {rank}: {doing} failed: {source}")]
    SetupTransport {
        /// This rank.
        rank: usize,
        /// What the setup was doing (`"listening"`, ...).
        doing: &'static str,
        /// The transport's error (boxed: it is large, and rare).
        #[source]
        source: Box<TransportError>,
    },
    /// The backend does not offer this operation.
    #[error("the {backend} backend does not support {collective}")]
    Unsupported {
        /// The operation.
        collective: &'static str,
        /// The group's backend.
        backend: &'static str,
    },
    /// Ranks did not arrive at a monitored barrier in time (reported by rank 0, which waits
    /// for everyone).
    #[error(
        "[Rank {rank}]: {} {} failed to pass monitoredBarrier in {timeout:?}",
        if .missing.len() == 1 { "Rank" } else { "Ranks" },
        RankList(.missing)
    )]
    MonitoredBarrier {
        /// This rank (0).
        rank: usize,
        /// The ranks that did not arrive: all of them with `wait_all_ranks`, else the first.
        missing: Vec<usize>,
        /// How long rank 0 waited.
        timeout: Duration,
    },
    /// The group was shut down on this rank.
    #[error("the process group was shut down")]
    ShutDown,
    /// Encoding or decoding an object (`all_gather_object`) failed.
    #[error("object from rank {rank} could not be {op}: {source}")]
    Object {
        /// The rank whose object it is.
        rank: usize,
        /// `"encoded"` or `"decoded"`.
        op: &'static str,
        /// The codec's error.
        #[source]
        source: postcard::Error,
    },
    /// A backend option the group was created with is unknown or has a bad value.
    #[error("process group setup on rank {rank}: option {key}={value:?}: {expected}")]
    BadOption {
        /// This rank.
        rank: usize,
        /// The option's name.
        key: String,
        /// Its value.
        value: String,
        /// What the backend takes for it (for an unknown option, the options it knows).
        expected: &'static str,
    },
    /// An environment variable the group's options were read from (`TENSORWIRE_COLLECTIVES`,
    /// `TENSORWIRE_ARENA_BYTES`, `TENSORWIRE_DEBUG`, the shared-memory spin) holds a value its
    /// setting does not take.
    #[error("process group setup on rank {rank}: {source}")]
    BadVariable {
        /// This rank.
        rank: usize,
        /// The variable, its value and what it takes.
        #[source]
        source: crate::env::BadVariable,
    },
    /// The root of an object collective (`broadcast_object`, `scatter_object`) passed no
    /// value to send.
    #[error("{collective}: the root (rank {root}) passed no value to send")]
    NoRootValue {
        /// The collective.
        collective: &'static str,
        /// The root, this rank.
        root: usize,
    },
}

// Decided by the inbox that checks group frames; re-exported here, where it always was.
pub use crate::collective::MeshViolation;

/// The receiving side of a [`ProcessGroupError::Disagreement`].
struct Side<'a> {
    rank: usize,
    ours: &'a Signature,
    here: bool,
}

impl<'a> Side<'a> {
    fn new(rank: usize, ours: &'a Signature, here: bool) -> Self {
        Side { rank, ours, here }
    }
}

impl std::fmt::Display for Side<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Side { rank, ours, here } = self;
        if *here {
            write!(f, "this rank ({rank}) {ours}")
        } else {
            write!(f, "rank {rank} {ours} (reported by rank {rank})")
        }
    }
}

/// Displays ranks as `1, 3`, or says that they are unknown.
struct RankList<'a>(&'a [usize]);

impl std::fmt::Display for RankList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(unknown: the backend does not say which)");
        }
        for (i, rank) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{rank}")?;
        }
        Ok(())
    }
}
