//! The mesh: one authenticated connection between every pair of ranks, with a reader task per
//! connection that sorts incoming messages by (peer, collective sequence number).
//!
//! # Setting up
//! Through [`crate::link`], as core's `StaticJoin` decides: the lower rank of each pair dials
//! the higher one and sends a [`Hello`](crate::link::Hello) (group name, its rank, the world
//! size) first. Every rank but 0 listens on an ephemeral port and publishes `ip:port` in the
//! store under `tensorwire/pg/<group>/addr/<rank>`, accepts exactly the ranks below it,
//! refusing connections with a wrong or duplicate hello (logged, without stopping the setup),
//! and then removes its key. Setup is bounded by the group's timeout; its timeout error names
//! the ranks that did not connect.
//!
//! # Groups over one mesh
//! The world group and its subgroups (process groups' `Group::new_group`) share
//! the connections: each group has an id (0 for the world) and files its collectives under a
//! key holding that id and its own sequence number (see `GroupMesh`), so messages of groups
//! used at once never mix, and a failure that breaks the mesh breaks every group. A
//! disagreement (below) fails every group's collectives but the earlier ones of its own.
//!
//! # Frames
//! The group's own frames are [`FrameKind::Collective`](tensorwire_core::wire::FrameKind)
//! frames whose header is a [`GroupFrame`], encoded and decoded in core
//! ([`tensorwire_core::protocol::mesh`]): a collective message (its sequence number and the
//! round's [`Signature`](tensorwire_core::collective::Signature), with at most one payload), a
//! clean goodbye, an abort in the sender's own name (what it saw, in its words: a rank may only
//! report its own abort, and an abort naming another rank is a violation of its sender), and a
//! disagreement notice that tells them which ranks ran what under one sequence number.
//!
//! Before a collective message is filed it is checked against core's
//! [`Admission`]: the sender must be a member
//! of the group, the sequence number within the window, and what the sender leaves unclaimed
//! within the bounds; anything else is a [`MeshViolation`] of the sender, which is dropped.
//!
//! Every other frame belongs to the layer that shares the connections (the RPC agent) and goes
//! to the [`FrameSink`] it set, on the reader task, without another hop; a group without one
//! takes such a frame as a broken peer.
//!
//! # Failures
//! A connection that ends without a goodbye means the peer died: the mesh is then *broken*,
//! every waiting and later collective fails with [`ProcessGroupError::PeerDied`] naming that
//! rank (or [`ProcessGroupError::Misbehaved`] for a peer dropped for a violation), and the
//! other peers are told (an abort in this rank's name) in case they cannot see it themselves. A
//! connection that ends after a goodbye only fails the collectives that still expect that
//! peer's messages.
//!
//! A disagreement about collective N of a group (found here, or a peer's notice) does not
//! break the mesh: it fails collective N and the group's later ones with
//! [`ProcessGroupError::Disagreement`], waiting or not yet started, and every other group's
//! collectives and the point-to-point messages at once, while the group's collectives before
//! N still take their messages and complete (a rank may still be finishing N − 1 when the
//! notice about N comes, and the last message of N − 1 after it, on another connection).
//! [`Mesh::failure`] says what fails a collective; the decision is core's
//! [`Disagreements`].

use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::collective::disagreement::Disagreements;
use tensorwire_core::collective::inbox::Admission;
use tensorwire_core::collective::stage_failure::StageReport;
use tensorwire_core::collective::SIGNATURE_LEN;
use tensorwire_core::ports::process_group::{DeathCause, MeshViolation, ProcessGroupError};
use tensorwire_core::ports::runtime::Runtime;
use tensorwire_core::ports::transport::{Connection, TransportError};
use tensorwire_core::protocol::mesh::GroupFrame;
use tensorwire_core::protocol::ProtocolViolation;
use tensorwire_core::wire::Frame;
use tokio::task::JoinHandle;
use tracing::warn;

mod group;
mod peer_inbox;
mod reader;
mod setup;

pub use group::{GroupMesh, MAX_GROUP_ID};
pub use setup::MeshSetup;

use group::split_key;
use peer_inbox::{Inbox, PeerStatus};

/// How long a dying mesh tries to tell each other peer which rank died (and a rank that drops
/// a peer, that peer why).
pub const ABORT_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// The store key under which `rank` of `group` publishes its address.
pub fn address_key(group: &str, rank: usize) -> String {
    format!("tensorwire/pg/{group}/addr/{rank}")
}

/// Where the frames on a group's connections that are not the group's own go: the RPC
/// agent's traffic, multiplexed over the same connection per pair of ranks.
///
/// Called on the connection's reader task, in the order the frames arrive.
pub trait FrameSink: Send + Sync {
    /// A frame (kind [`FrameKind::Message`](tensorwire_core::wire::FrameKind::Message) or
    /// [`FrameKind::Control`](tensorwire_core::wire::FrameKind::Control)) from world rank
    /// `peer`, on `conn`. An error means the peer broke the protocol above: its connection is
    /// dropped, which the group takes as that rank dying.
    ///
    /// The error is what the peer did wrong in the RPC protocol (the layer that shares the
    /// group's connections); the group names the peer and the frame's kind
    /// ([`ProcessGroupError::RefusedFrame`]) and tells the peer why before it closes.
    fn on_frame(
        &self,
        peer: usize,
        conn: &Arc<dyn Connection>,
        frame: Frame,
    ) -> Result<(), ProtocolViolation>;
    /// Rank `peer`'s connection delivers nothing more: it said goodbye, or it broke (or
    /// broke the protocol).
    fn on_closed(&self, peer: usize, end: &PeerEnd);
}

/// How a peer's connection ended ([`FrameSink::on_closed`]). Exhaustive: a layer above
/// decides what each end means for it, and a new kind of end must reach those decisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerEnd {
    /// It said goodbye: it shut its group down, in order.
    Goodbye,
    /// Its connection broke or closed: the transport's error.
    Transport(TransportError),
    /// The layer above refused a frame it sent ([`FrameSink::on_frame`]'s error).
    Refused(Box<ProtocolViolation>),
    /// It sent a group frame it had no right to send: the group dropped it.
    Misbehaved(MeshViolation),
    /// It aborted its group, saying why (its own words, checked to be in its own name), and
    /// then its connection ended: a rank that drops this one for breaking the protocol says
    /// so first.
    Aborted {
        /// What it said.
        reason: String,
    },
}

impl std::fmt::Display for PeerEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerEnd::Goodbye => f.write_str("it shut its group down"),
            PeerEnd::Transport(e) => e.fmt(f),
            PeerEnd::Refused(v) => write!(f, "it broke the RPC protocol: {v}"),
            PeerEnd::Misbehaved(v) => write!(f, "it broke the group's protocol: {v}"),
            PeerEnd::Aborted { reason } => write!(f, "it aborted its group: {reason}"),
        }
    }
}

/// One collective message as it arrived.
#[derive(Debug)]
pub struct Incoming {
    /// The encoded signature of the round the sender ran.
    pub signature: [u8; SIGNATURE_LEN],
    /// The message bytes.
    pub payload: Bytes,
}

struct PeerLink {
    conn: Arc<dyn Connection>,
    inbox: Inbox,
    /// `true` once the peer's reader has ended (everything the peer sent was read).
    read_all: tokio::sync::watch::Sender<bool>,
}

struct Shared {
    rank: usize,
    /// The clock and timers of every wait here (the mesh reads no other).
    runtime: Arc<dyn Runtime>,
    /// One entry per rank; `None` for this rank.
    peers: Vec<Option<PeerLink>>,
    /// Set once, to the first failure that broke the mesh.
    failure: std::sync::OnceLock<ProcessGroupError>,
    /// The disagreements found here or reported by peers, and which collectives they fail
    /// (not the earlier ones of their group: see [`Disagreements`]).
    disagreements: Mutex<Disagreements<ProcessGroupError>>,
    /// Where frames that are not the group's own go (see [`FrameSink`]).
    sink: std::sync::OnceLock<Arc<dyn FrameSink>>,
    /// The groups made here and how far this rank is in each: what every collective frame is
    /// checked against before it is filed.
    admission: Mutex<Admission>,
}

impl Shared {
    fn peer(&self, rank: usize) -> Option<&PeerLink> {
        self.peers.get(rank).and_then(Option::as_ref)
    }

    fn admission(&self) -> MutexGuard<'_, Admission> {
        self.admission.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a collective already running here may take a message filed under `key`: a
    /// point-to-point message, or one of a collective this rank has reached.
    fn may_be_taken(&self, key: u64) -> bool {
        split_key(key).is_none_or(|(group, seq)| self.admission().reached(group, seq))
    }

    fn disagreements(&self) -> MutexGuard<'_, Disagreements<ProcessGroupError>> {
        self.disagreements.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The disagreement recorded here that fails the collective (or point-to-point message)
    /// under `key`, if one does.
    fn refusal(&self, key: u64) -> Option<ProcessGroupError> {
        self.disagreements().failure(split_key(key)).cloned()
    }

    /// Whether a disagreement recorded here fails the collective under `key`: its inboxes
    /// take nothing more for it.
    fn refused(&self, key: u64) -> bool {
        self.disagreements().failure(split_key(key)).is_some()
    }

    /// Records a disagreement about collective `seq` of group `group`, found here or reported
    /// by a peer: the collectives it fails (that one and the group's later ones, every other
    /// group's and point-to-point messages) fail from now on, and those waiting wake; the
    /// group's earlier collectives go on taking their messages.
    fn disagree(&self, group: u64, seq: u64, error: ProcessGroupError) {
        let new = self.disagreements().record(group, seq, error);
        if !new {
            return;
        }
        for link in self.peers.iter().flatten() {
            link.inbox.refuse(|key| self.refused(key));
        }
    }

    /// This rank sends, awaits or takes a message under collective key `key`.
    fn touch(&self, key: u64) {
        if let Some((group, seq)) = split_key(key) {
            self.admission().touched(group, seq);
        }
    }

    /// Records the first failure and ends delivery from every peer, so that every waiting
    /// collective wakes and reports it; returns whether this call set it.
    fn fail(&self, error: ProcessGroupError) -> bool {
        let first = self.failure.set(error).is_ok();
        for link in self.peers.iter().flatten() {
            link.inbox
                .close(PeerStatus::Dead, |key| self.may_be_taken(key));
        }
        first
    }
}

/// How a peer's connection ended (see [`Mesh::peer_gone`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerStatusKind {
    /// It said goodbye (shut down).
    Left,
    /// The connection broke.
    Dead,
}

/// A fully connected set of ranks.
pub struct Mesh {
    shared: Arc<Shared>,
    world: usize,
    readers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("rank", &self.shared.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        for reader in &self.readers {
            reader.abort();
        }
    }
}

impl Mesh {
    /// Group `id` (a subgroup of `members`, world ranks) is made on this rank: from now on its
    /// frames are taken only from its members. A non-member whose frames for it arrived
    /// before (held while the group was unknown here) broke the protocol: its frames are
    /// dropped, its connection closed, and the mesh fails naming it.
    fn register_group(&self, id: u64, members: &[usize]) {
        self.shared.admission().register_group(id, members);
        for (rank, link) in self.shared.peers.iter().enumerate() {
            let Some(link) = link else { continue };
            if members.contains(&rank)
                || !link
                    .inbox
                    .purge(|key| split_key(key).is_some_and(|(g, _)| g == id))
            {
                continue;
            }
            let violation = MeshViolation::NotInGroup { group: id };
            warn!(rank = self.shared.rank, peer = rank, %violation, "dropping a peer");
            self.shared
                .fail(ProcessGroupError::Misbehaved { rank, violation });
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let conn = link.conn.clone();
                rt.spawn(async move {
                    let _ = conn.close().await;
                });
            }
        }
    }

    /// Sends the frames on these connections that are not the group's own (every kind but
    /// [`FrameKind::Collective`](tensorwire_core::wire::FrameKind::Collective)) to `sink`;
    /// `false` if a sink was set already.
    pub fn route_frames(&self, sink: Arc<dyn FrameSink>) -> bool {
        self.shared.sink.set(sink).is_ok()
    }

    /// The connection to each other rank, by world rank.
    pub fn connections(&self) -> Vec<(usize, Arc<dyn Connection>)> {
        self.shared
            .peers
            .iter()
            .enumerate()
            .filter_map(|(r, l)| l.as_ref().map(|l| (r, Arc::clone(&l.conn))))
            .collect()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The clock and timers of the mesh (given at setup): those of every layer over it too.
    pub fn runtime(&self) -> &Arc<dyn Runtime> {
        &self.shared.runtime
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The failure that broke the mesh, if any: a dead or misbehaving peer, an abort, a
    /// timeout, a shutdown. A disagreement does not break it, but fails only some
    /// collectives: see [`Mesh::failure`].
    pub fn broken(&self) -> Option<ProcessGroupError> {
        self.shared.failure.get().cloned()
    }

    /// Whether the mesh is broken ([`broken`](Self::broken) without the clone).
    pub fn is_broken(&self) -> bool {
        self.shared.failure.get().is_some()
    }

    /// What fails the collective (or point-to-point message) under `key`, if anything: a
    /// disagreement recorded here that covers it (about it or an earlier collective of its
    /// group, or in another group; see
    /// [`tensorwire_core::collective::disagreement`]), else the failure that broke the mesh.
    pub fn failure(&self, key: u64) -> Option<ProcessGroupError> {
        self.shared.refusal(key).or_else(|| self.broken())
    }

    /// Breaks the mesh with `error` (kept only if it is the first failure).
    pub fn fail(&self, error: ProcessGroupError) {
        self.shared.fail(error);
    }

    /// Receives `peer`'s next message of collective `seq` (`None`: its connection ended, or
    /// a disagreement fails that collective: [`Mesh::failure`] says which).
    pub async fn recv(&self, peer: usize, seq: u64) -> Option<Incoming> {
        let link = self.shared.peer(peer)?;
        self.shared.touch(seq);
        let refused = |key| self.shared.refused(key);
        std::future::poll_fn(|cx| link.inbox.poll_recv(seq, cx, refused)).await
    }

    /// Polls whether a message of collective `seq` from `peer` waits, without taking it:
    /// `Ready(false)` once its connection has ended with none left (or there is none), or a
    /// disagreement fails that collective.
    pub fn poll_arrived(&self, peer: usize, seq: u64, cx: &mut Context<'_>) -> Poll<bool> {
        self.shared.touch(seq);
        match self.shared.peer(peer) {
            Some(link) => link
                .inbox
                .poll_arrived(seq, cx, |key| self.shared.refused(key)),
            None => Poll::Ready(false),
        }
    }

    /// Whether a message of collective `seq` from `peer` is waiting.
    pub fn has_message(&self, peer: usize, seq: u64) -> bool {
        self.shared
            .peer(peer)
            .is_some_and(|l| l.inbox.has_message(seq))
    }

    /// Forgets `peer`'s messages of collective `seq`.
    pub fn release(&self, peer: usize, seq: u64) {
        if let Some(link) = self.shared.peer(peer) {
            link.inbox.release(seq);
        }
    }

    /// Whether `peer`'s connection has ended (it said goodbye, or the connection broke), for
    /// waits that do not go through the inbox (the group arena's); `None` while it is open.
    pub fn peer_gone(&self, peer: usize) -> Option<PeerStatusKind> {
        match self.shared.peer(peer).map(|l| l.inbox.status()) {
            Some(PeerStatus::Left) => Some(PeerStatusKind::Left),
            Some(PeerStatus::Dead) => Some(PeerStatusKind::Dead),
            _ => None,
        }
    }

    /// The error for a receive from `peer` that found the channel closed.
    pub fn closed_error(
        &self,
        peer: usize,
        collective: &'static str,
        seq: u64,
    ) -> ProcessGroupError {
        if let Some(e) = self.broken() {
            return e;
        }
        match self.shared.peer(peer).map(|l| l.inbox.status()) {
            Some(PeerStatus::Left) => ProcessGroupError::PeerLeft {
                rank: peer,
                collective,
                seq,
            },
            _ => ProcessGroupError::PeerDied {
                rank: peer,
                reported_by: None,
                cause: DeathCause::ConnectionClosed,
            },
        }
    }

    /// Records a disagreement this rank saw in group `group` (which fails that collective
    /// and what comes after it, not the group's earlier ones: see [`Mesh::failure`]), and
    /// tells every other rank.
    pub async fn report_disagreement(&self, group: u64, error: &ProcessGroupError) {
        let ProcessGroupError::Disagreement {
            seq,
            peer,
            theirs,
            ours,
            here: true,
            ..
        } = error
        else {
            return;
        };
        self.shared.disagree(group, *seq, error.clone());
        let notice = GroupFrame::Disagreement {
            group,
            seq: *seq,
            peer: *peer as u32,
            theirs: *theirs,
            ours: *ours,
        }
        .frame(Vec::new());
        for link in self.shared.peers.iter().flatten() {
            if matches!(link.inbox.status(), PeerStatus::Left) {
                continue;
            }
            let _ = self
                .shared
                .runtime
                .timeout(ABORT_SEND_TIMEOUT, link.conn.send(notice.clone()))
                .await;
        }
    }

    /// Group `id` runs hierarchically over `hosts` (world ranks, each host's ascending): the
    /// reports of its failed stages are checked against them.
    pub fn register_hosts(&self, id: u64, hosts: Vec<Vec<usize>>) {
        self.shared.admission().register_hosts(id, hosts);
    }

    /// Tells `to` (world ranks) that a stage of a collective of hierarchical group `group`
    /// failed here on the ranks `report` names, each send bounded by the abort's bound, all at
    /// once (a peer that does not read delays no other).
    pub async fn report_stage_failure(&self, group: u64, to: &[usize], report: StageReport) {
        let notice = GroupFrame::StageFailed { group, report }.frame(Vec::new());
        let mut sends = tokio::task::JoinSet::new();
        for peer in to {
            let Some(link) = self.shared.peer(*peer) else {
                continue;
            };
            if matches!(link.inbox.status(), PeerStatus::Left) {
                continue;
            }
            let conn = Arc::clone(&link.conn);
            let notice = notice.clone();
            let runtime = Arc::clone(&self.shared.runtime);
            sends.spawn(async move {
                let _ = runtime.timeout(ABORT_SEND_TIMEOUT, conn.send(notice)).await;
            });
        }
        while sends.join_next().await.is_some() {}
    }

    /// Sends one collective message to `peer`.
    pub async fn send(
        &self,
        peer: usize,
        seq: u64,
        signature: &[u8; SIGNATURE_LEN],
        payload: Bytes,
    ) -> Result<(), ProcessGroupError> {
        let link = self
            .shared
            .peer(peer)
            .ok_or(ProcessGroupError::NoConnection { rank: peer })?;
        self.shared.touch(seq);
        let header = GroupFrame::data_header(seq, signature);
        let payloads = if payload.is_empty() {
            Vec::new()
        } else {
            vec![payload]
        };
        let Err(e) = link.conn.send(Frame::collective(header, payloads)).await else {
            return Ok(());
        };
        // A peer that aborted sent why before it closed: its reader may not have read that
        // yet. Waited for (bounded), so that the error names the abort, not the closed socket.
        let mut read_all = link.read_all.subscribe();
        let _ = self
            .shared
            .runtime
            .timeout(ABORT_SEND_TIMEOUT, read_all.wait_for(|done| *done))
            .await;
        Err(self.broken().unwrap_or_else(|| ProcessGroupError::Send {
            rank: peer,
            source: Box::new(e),
        }))
    }

    /// Says goodbye to every peer and closes the connections; collectives fail afterwards.
    /// The goodbyes go out side by side, each within `timeout`: a peer that does not read
    /// delays nobody else's. The readers end here, or when the mesh is dropped if this is
    /// cut short.
    pub async fn shutdown(&self, timeout: Duration) {
        self.shared.fail(ProcessGroupError::ShutDown);
        let mut goodbyes = tokio::task::JoinSet::new();
        for (peer, link) in self.shared.peers.iter().enumerate() {
            let Some(link) = link else { continue };
            let conn = Arc::clone(&link.conn);
            let runtime = self.shared.runtime.clone();
            goodbyes.spawn(async move {
                let said = runtime
                    .timeout(timeout, async {
                        let _ = conn.send(GroupFrame::Goodbye.frame(Vec::new())).await;
                        let _ = conn.close().await;
                    })
                    .await;
                if said.is_err() {
                    tracing::debug!(peer, "the goodbye did not go out within {timeout:?}");
                }
            });
        }
        while goodbyes.join_next().await.is_some() {}
        for reader in &self.readers {
            reader.abort();
        }
    }
}
