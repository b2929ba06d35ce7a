//! [`GroupMesh`]: one group's view of a shared [`Mesh`], and the collective keys that keep
//! groups over one mesh apart.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::collective::stage_failure::StageReport;
use tensorwire_core::collective::SIGNATURE_LEN;
use tensorwire_core::ports::process_group::ProcessGroupError;
use tensorwire_core::ports::transport::Connection;

use super::{FrameSink, Incoming, Mesh};

/// Bits of a collective key below a group's id: a group's collectives count up from zero
/// in the low 48 bits, and its id (0 for the world group) sits above them, so groups over one
/// mesh never file two messages under one key.
const GROUP_SHIFT: u32 = 48;
/// The bit that marks a point-to-point key (process groups' `send` and `recv`): such keys
/// belong to a pair of ranks, not to a group, and pass through a [`GroupMesh`] unchanged.
pub(super) const P2P_BIT: u64 = 1 << 63;
/// The largest subgroup id: ids fill the 15 bits between the sequence numbers and
/// `P2P_BIT`.
pub const MAX_GROUP_ID: u64 = (1 << (63 - GROUP_SHIFT)) - 1;

/// One group's view of a shared [`Mesh`]: the world group, or a subgroup of some of its ranks
/// over the same connections.
///
/// Group ranks are translated to world ranks (`members[group rank]`) and a collective's
/// sequence number to a key holding the group's id, so every group numbers its collectives
/// from zero and the messages of groups used at once never mix. The failure state is the
/// mesh's: a dead peer or a timeout in any group breaks every group over these connections
/// (the ranks of one group no longer agree where its collectives stand, and a rank that is
/// out of step in one group cannot vouch for another). A disagreement about collective N of
/// one group fails N and that group's later collectives, and every other group's, while the
/// group's collectives before N still complete
/// ([`tensorwire_core::collective::disagreement`]).
pub struct GroupMesh {
    mesh: Arc<Mesh>,
    /// The group's id: 0 for the world group.
    id: u64,
    /// World rank of each group rank, ascending.
    members: Arc<[usize]>,
    /// This rank in the group.
    rank: usize,
    /// Set when this subgroup (not the mesh) was shut down.
    closed: std::sync::OnceLock<ProcessGroupError>,
}

impl std::fmt::Debug for GroupMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupMesh")
            .field("id", &self.id)
            .field("rank", &self.rank)
            .field("members", &self.members)
            .finish_non_exhaustive()
    }
}

impl GroupMesh {
    /// The world group over `mesh`.
    pub fn whole(mesh: Mesh) -> Self {
        let members: Arc<[usize]> = (0..mesh.world()).collect();
        GroupMesh {
            rank: mesh.rank(),
            mesh: Arc::new(mesh),
            id: 0,
            members,
            closed: std::sync::OnceLock::new(),
        }
    }

    /// Subgroup `id` of `members` (ascending world ranks, this rank among them) over the
    /// same mesh.
    pub fn subgroup(&self, id: u64, members: Arc<[usize]>) -> Option<Self> {
        debug_assert!(id > 0 && id <= MAX_GROUP_ID);
        let here = self.mesh.rank();
        self.mesh.register_group(id, &members);
        let rank = members.iter().position(|r| *r == here)?;
        Some(GroupMesh {
            mesh: self.mesh.clone(),
            id,
            members,
            rank,
            closed: std::sync::OnceLock::new(),
        })
    }

    /// See [`Mesh::route_frames`]; on the world group only (`false` on a subgroup).
    pub fn route_frames(&self, sink: Arc<dyn FrameSink>) -> bool {
        self.id == 0 && self.mesh.route_frames(sink)
    }

    /// The connections under the group, by world rank.
    pub fn connections(&self) -> Vec<(usize, Arc<dyn Connection>)> {
        self.mesh.connections()
    }

    /// The group's id (0: the world group).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// World rank of each group rank.
    pub fn members(&self) -> &Arc<[usize]> {
        &self.members
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The clock and timers of the mesh (given at setup): those of every layer over it too.
    pub fn runtime(&self) -> &Arc<dyn tensorwire_core::ports::runtime::Runtime> {
        self.mesh.runtime()
    }

    /// The group's size.
    pub fn world(&self) -> usize {
        self.members.len()
    }

    fn peer(&self, peer: usize) -> usize {
        // Out of range maps to a rank with no link, which the mesh reports as such.
        self.members.get(peer).copied().unwrap_or(usize::MAX)
    }

    fn key(&self, seq: u64) -> u64 {
        if seq & P2P_BIT != 0 {
            return seq;
        }
        debug_assert!(seq < 1 << GROUP_SHIFT, "2^48 collectives in one group");
        self.id << GROUP_SHIFT | seq
    }

    /// Whether group rank `peer`'s connection has ended (see [`Mesh::peer_gone`]).
    pub fn peer_gone(&self, peer: usize) -> Option<super::PeerStatusKind> {
        self.mesh.peer_gone(self.peer(peer))
    }

    /// The failure that broke the group, if any (see [`Mesh::broken`]: a disagreement fails
    /// only some collectives, which [`GroupMesh::failure`] tells).
    pub fn broken(&self) -> Option<ProcessGroupError> {
        self.closed.get().cloned().or_else(|| self.mesh.broken())
    }

    /// Whether [`broken`](Self::broken) would say something, without cloning it (looked at
    /// before every collective on the arena's synchronous path).
    pub fn is_broken(&self) -> bool {
        self.closed.get().is_some() || self.mesh.is_broken()
    }

    /// What fails collective `seq` of this group (or the point-to-point message under key
    /// `seq`), if anything: this subgroup's shutdown, a disagreement that covers it, or the
    /// failure that broke the mesh (see [`Mesh::failure`]).
    pub fn failure(&self, seq: u64) -> Option<ProcessGroupError> {
        self.closed
            .get()
            .cloned()
            .or_else(|| self.mesh.failure(self.key(seq)))
    }

    /// Breaks the mesh, and so every group over it, with `error`.
    pub fn fail(&self, error: ProcessGroupError) {
        self.mesh.fail(error);
    }

    /// Receives group rank `peer`'s next message of collective `seq`.
    pub async fn recv(&self, peer: usize, seq: u64) -> Option<Incoming> {
        self.mesh.recv(self.peer(peer), self.key(seq)).await
    }

    /// Polls whether a message of collective `seq` from group rank `peer` waits, without
    /// taking it (see [`Mesh::poll_arrived`]).
    pub fn poll_arrived(&self, peer: usize, seq: u64, cx: &mut Context<'_>) -> Poll<bool> {
        self.mesh.poll_arrived(self.peer(peer), self.key(seq), cx)
    }

    /// Whether a message of collective `seq` from group rank `peer` is waiting.
    pub fn has_message(&self, peer: usize, seq: u64) -> bool {
        self.mesh.has_message(self.peer(peer), self.key(seq))
    }

    /// Forgets group rank `peer`'s messages of collective `seq`.
    pub fn release(&self, peer: usize, seq: u64) {
        self.mesh.release(self.peer(peer), self.key(seq));
    }

    /// The error for a receive from group rank `peer` that found the channel closed: a peer
    /// that left is named by its group rank, a dead one (which broke every group) by its
    /// world rank.
    pub fn closed_error(
        &self,
        peer: usize,
        collective: &'static str,
        seq: u64,
    ) -> ProcessGroupError {
        if let Some(e) = self.closed.get() {
            return e.clone();
        }
        match self.mesh.closed_error(self.peer(peer), collective, seq) {
            ProcessGroupError::PeerLeft { collective, .. } => ProcessGroupError::PeerLeft {
                rank: peer,
                collective,
                seq,
            },
            other => other,
        }
    }

    /// Records a disagreement this rank saw (in group ranks), which fails that collective and
    /// later ones, and tells every other rank (in world ranks); see
    /// [`Mesh::report_disagreement`].
    pub async fn report_disagreement(&self, error: &ProcessGroupError) {
        let ProcessGroupError::Disagreement {
            seq,
            peer,
            theirs,
            ours,
            here,
            ..
        } = error
        else {
            return;
        };
        let world = ProcessGroupError::Disagreement {
            seq: *seq,
            peer: self.peer(*peer),
            theirs: *theirs,
            rank: self.mesh.rank(),
            ours: *ours,
            here: *here,
        };
        self.mesh.report_disagreement(self.id, &world).await;
    }

    /// This group runs hierarchically over `hosts` (group ranks, each host's ascending): reports
    /// of its failed stages are believed only as they fit them.
    pub fn register_hosts(&self, hosts: &[Vec<usize>]) {
        let world = hosts
            .iter()
            .map(|h| h.iter().map(|r| self.peer(*r)).collect())
            .collect();
        self.mesh.register_hosts(self.id, world);
    }

    /// Tells every other member of this (hierarchical) group that a stage of one of its
    /// collectives failed here on the ranks `report` names (world ranks); see
    /// [`Mesh::report_stage_failure`].
    pub async fn report_stage_failure(&self, report: StageReport) {
        let here = self.mesh.rank();
        let to: Vec<usize> = self
            .members
            .iter()
            .copied()
            .filter(|r| *r != here)
            .collect();
        self.mesh.report_stage_failure(self.id, &to, report).await;
    }

    /// Sends one message of collective `seq` to group rank `peer`.
    pub async fn send(
        &self,
        peer: usize,
        seq: u64,
        signature: &[u8; SIGNATURE_LEN],
        payload: Bytes,
    ) -> Result<(), ProcessGroupError> {
        self.mesh
            .send(self.peer(peer), self.key(seq), signature, payload)
            .await
    }

    /// The world group says goodbye and closes the connections (every group over them then
    /// fails with [`ProcessGroupError::ShutDown`]); a subgroup only stops taking collectives.
    pub async fn shutdown(&self, timeout: Duration) {
        if self.id == 0 {
            self.mesh.shutdown(timeout).await;
        } else {
            let _ = self.closed.set(ProcessGroupError::ShutDown);
        }
    }
}

/// The (group id, sequence number) of a collective key; `None` for a point-to-point key.
pub(super) fn split_key(key: u64) -> Option<(u64, u64)> {
    (key & P2P_BIT == 0).then_some((key >> GROUP_SHIFT, key & ((1 << GROUP_SHIFT) - 1)))
}
