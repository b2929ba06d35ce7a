//! The reader task of each connection: it takes frames off the connection, checks and files
//! the group's own, hands the others to the [`FrameSink`](super::FrameSink), and records how the peer ended.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tensorwire_core::collective::inbox::{self};
use tensorwire_core::ports::process_group::{DeathCause, MeshViolation, ProcessGroupError};
use tensorwire_core::ports::transport::TransportError;
use tensorwire_core::protocol::mesh::GroupFrame;
use tensorwire_core::protocol::ProtocolViolation;
use tensorwire_core::wire::{FrameKind, Payloads};
use tracing::{debug, warn};

use super::group::split_key;
use super::peer_inbox::PeerStatus;
use super::{Incoming, PeerEnd, Shared, ABORT_SEND_TIMEOUT};

/// Why a peer's connection delivers nothing more.
enum End {
    /// Its connection broke or closed.
    Broken(TransportError),
    /// The layer above refused a frame of this kind that it sent.
    Refused(FrameKind, ProtocolViolation),
    /// It sent a group frame it had no right to send.
    Violation(MeshViolation),
}

/// Joins a frame's payloads into one message (a sender sends at most one).
fn message_bytes(payloads: Payloads) -> Bytes {
    match payloads.len() {
        0 => Bytes::new(),
        1 => payloads.into_iter().next().unwrap_or_default(),
        _ => {
            let mut all = BytesMut::with_capacity(payloads.iter().map(Bytes::len).sum());
            for p in payloads {
                all.extend_from_slice(&p);
            }
            all.freeze()
        }
    }
}

/// Reads `peer`'s connection until it ends: the group's own frames are filed by sequence
/// number or acted on; every other frame goes to the [`FrameSink`](super::FrameSink), on this task.
pub(super) async fn read_loop(shared: Arc<Shared>, peer: usize) {
    let Some(link) = shared.peer(peer) else {
        return;
    };
    // However this ends (or is aborted), a send that failed stops waiting for it.
    struct ReadAll<'a>(&'a tokio::sync::watch::Sender<bool>);
    impl Drop for ReadAll<'_> {
        fn drop(&mut self) {
            self.0.send_replace(true);
        }
    }
    let _read_all = ReadAll(&link.read_all);
    let rank = shared.rank;
    // What the peer said when it aborted its group (it may close right after): how its
    // connection's end is told to the layer above.
    let mut aborted: Option<String> = None;
    // One receive future for every frame (the adapter's), not a boxed `recv` per frame.
    let mut frames = Arc::clone(&link.conn).into_frames();
    let end = 'read: loop {
        let frame = match std::future::poll_fn(|cx| frames.poll_recv(cx)).await {
            Ok(frame) => frame,
            Err(e) => break End::Broken(e),
        };
        if frame.kind != FrameKind::Collective {
            let Some(sink) = shared.sink.get() else {
                // No layer above takes it (a second hello, an agent's message): the sender's
                // violation; the connection is closed below.
                break End::Violation(MeshViolation::NotAGroupFrame { kind: frame.kind });
            };
            let kind = frame.kind;
            if let Err(violation) = sink.on_frame(peer, &link.conn, frame) {
                break End::Refused(kind, violation);
            }
            continue;
        }
        match GroupFrame::decode(&frame.header) {
            Ok(GroupFrame::Data { seq, signature }) => {
                let payload = message_bytes(frame.payloads);
                let len = payload.len();
                let filed = link.inbox.push(
                    seq,
                    Incoming { signature, payload },
                    |held, waited_on| {
                        shared
                            .admission()
                            .check(peer, split_key(seq), len, waited_on, held)
                    },
                    |key| shared.refused(key),
                );
                if let Err(v) = filed {
                    break End::Violation(v);
                }
            }
            Ok(GroupFrame::Goodbye) => {
                debug!(rank, peer, "peer said goodbye");
                link.inbox.close(PeerStatus::Left, |_| true);
                if let Some(sink) = shared.sink.get() {
                    sink.on_closed(peer, &PeerEnd::Goodbye);
                }
                return;
            }
            Ok(GroupFrame::Abort {
                rank: named,
                reason,
            }) => {
                if let Err(v) = inbox::check_abort(peer, named as usize) {
                    break 'read End::Violation(v);
                }
                warn!(rank, peer, %reason, "peer aborted its group");
                aborted = Some(reason.clone());
                // Breaking the mesh wakes every collective waiting on any rank.
                shared.fail(ProcessGroupError::PeerAborted { rank: peer, reason });
            }
            Ok(GroupFrame::Disagreement {
                group,
                seq,
                peer: other,
                theirs,
                ours,
            }) => {
                // Checked before it is believed: a notice blaming a rank the sender could not
                // have seen disagree is the sender's violation, not that rank's fault.
                let checked = shared.admission().check_disagreement(
                    peer,
                    group,
                    other as usize,
                    seq,
                    &theirs,
                    &ours,
                );
                if let Err(v) = checked {
                    break 'read End::Violation(v);
                }
                let error = ProcessGroupError::Disagreement {
                    seq,
                    peer: other as usize,
                    theirs,
                    rank: peer,
                    ours,
                    here: false,
                };
                warn!(rank, peer, %error, "peer reports a disagreement");
                // It fails that collective and what comes after it; the group's earlier
                // collectives still take their messages (this rank may still be finishing
                // one whose last message comes after the notice, on another connection).
                shared.disagree(group, seq, error);
            }
            Ok(GroupFrame::StageFailed { group, report }) => {
                // Checked before it is believed: a rank may blame only ranks it waited for in
                // a stage of that group; anything else is the sender's violation.
                let checked = shared
                    .admission()
                    .check_stage_report(peer, group, &report.ranks);
                if let Err(v) = checked {
                    break 'read End::Violation(v);
                }
                let error = report.error(peer);
                warn!(rank, peer, %error, "peer reports a failed stage");
                // Breaking the mesh wakes every collective waiting here, on the links or in
                // the arena, with the ranks the report names.
                shared.fail(error);
            }
            Err(source) => break End::Violation(MeshViolation::MalformedGroupFrame { source }),
        }
    };
    // A peer dropped for what it sent hears why before its connection closes (best effort,
    // bounded: an abort in this rank's name, as the others get below), so that its own errors
    // name the cause instead of a connection closed by its peer.
    let (error, why, end) = match end {
        End::Broken(e) => {
            let error = ProcessGroupError::PeerDied {
                rank: peer,
                reported_by: None,
                cause: DeathCause::Transport(Box::new(e.clone())),
            };
            (error, None, PeerEnd::Transport(e))
        }
        End::Refused(kind, violation) => {
            // The abort's reason is words on the wire: the peer reads what it did.
            let why = format!("rank {peer} broke the RPC protocol: {violation}");
            let error = ProcessGroupError::RefusedFrame { rank: peer, kind };
            (error, Some(why), PeerEnd::Refused(Box::new(violation)))
        }
        End::Violation(violation) => {
            let error = ProcessGroupError::Misbehaved {
                rank: peer,
                violation: violation.clone(),
            };
            let why = error.to_string();
            (error, Some(why), PeerEnd::Misbehaved(violation))
        }
    };
    let end = match aborted {
        Some(reason) => PeerEnd::Aborted { reason },
        None => end,
    };
    if let Some(sink) = shared.sink.get() {
        sink.on_closed(peer, &end);
    }
    let left = matches!(link.inbox.status(), PeerStatus::Left);
    // The failure is recorded before any inbox closes (`fail` closes them all), so that a
    // collective woken by the close reports why, not just that the connection closed; and
    // before the dropped peer is told, which may take up to the abort's bound.
    let first = !left && {
        warn!(rank, peer, %error, "dropping the peer");
        shared.fail(error.clone())
    };
    if let Some(why) = why {
        let abort = GroupFrame::Abort {
            rank: rank as u32,
            reason: why,
        }
        .frame(Vec::new());
        let _ = shared
            .runtime
            .timeout(ABORT_SEND_TIMEOUT, link.conn.send(abort))
            .await;
        // Dropped: nothing more is read from it.
        let _ = link.conn.close().await;
    }
    if first {
        // Tell the others, in case they cannot see it (a half-open connection elsewhere):
        // this rank aborts, in its own name; the reason says what it saw.
        let abort = GroupFrame::Abort {
            rank: rank as u32,
            reason: error.to_string(),
        }
        .frame(Vec::new());
        for (other, link) in shared.peers.iter().enumerate() {
            let Some(link) = link else { continue };
            if other == peer || matches!(link.inbox.status(), PeerStatus::Left) {
                continue;
            }
            let _ = shared
                .runtime
                .timeout(ABORT_SEND_TIMEOUT, link.conn.send(abort.clone()))
                .await;
        }
    }
}
