//! Runs a [`core::collective`](tensorwire_core::collective) schedule over the mesh.
//!
//! The executor follows the rules in the schedule module's docs:
//! - within a step, the sends and the receives run concurrently (one future each, joined);
//! - each send copies its ranges out of the buffer *before* any receive of the step lands, so
//!   sends read the buffer as it was at the start of the step, and a reducing receive may be
//!   applied as soon as its message arrives;
//! - messages from one peer for one collective come out of a FIFO (the connection's order,
//!   filed by sequence number by the mesh's reader task), so the n-th receive from a peer gets
//!   the n-th message that peer sent in this collective;
//! - receives are applied in the step's order, which keeps float reductions reproducible;
//! - every message carries the round's [`Signature`]; a receive whose sender ran another one
//!   under the same sequence number fails with [`ProcessGroupError::Disagreement`] before its
//!   payload is looked at (the caller then fails it and the group's later collectives, and
//!   tells the other ranks).
//!
//! The whole collective has one deadline; a wait that passes it fails with
//! [`ProcessGroupError::Timeout`] naming the ranks whose messages had not arrived. A dead
//! peer, or a broken mesh, ends the wait at once; so does a disagreement about this round or
//! an earlier one of the group (or one in another group), but not one about a later round:
//! this round then completes from its peers' messages ([`GroupMesh::failure`]).

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use std::time::Instant;
use tensorwire_core::collective::{Apply, Schedule, Signature};
use tensorwire_core::ports::process_group::ProcessGroupError;

use tensorwire_mesh::GroupMesh;

/// One collective in progress: the peers it received from, released when it ends.
struct Run<'a> {
    mesh: &'a GroupMesh,
    seq: u64,
    peers: Vec<usize>,
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        for peer in &self.peers {
            self.mesh.release(*peer, self.seq);
        }
    }
}

/// Messages that stand for one range of the buffer each, so that a send of exactly that range
/// forwards the message instead of copying it out of the buffer (the ring all_gather passes
/// every block on this way).
///
/// An entry is *applied* when the buffer holds its bytes too, or *deferred* when only the
/// entry does: with deferral on, a receive that stores a whole message into one range keeps
/// the message and leaves the buffer alone. A deferred entry is copied into the buffer only
/// when something reads or changes bytes it overlaps (a send of other ranges, a reduction, a
/// store over several ranges) or when the caller asks ([`Held::materialize`]); an all_gather
/// can return the messages themselves as its blocks and never touch most of its buffer.
#[derive(Default)]
pub(crate) struct Held {
    entries: Vec<HeldEntry>,
}

struct HeldEntry {
    range: Range<usize>,
    bytes: Bytes,
    applied: bool,
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

impl Held {
    /// The message for exactly `range`, if one is held.
    pub(crate) fn get(&self, range: &Range<usize>) -> Option<Bytes> {
        self.entries
            .iter()
            .find(|e| e.range == *range)
            .map(|e| e.bytes.clone())
    }

    /// Copies every deferred message overlapping one of `ranges` into `buffer`.
    pub(crate) fn materialize(&mut self, ranges: &[Range<usize>], buffer: &mut [u8]) {
        for e in &mut self.entries {
            if !e.applied && ranges.iter().any(|r| overlaps(r, &e.range)) {
                buffer[e.range.clone()].copy_from_slice(&e.bytes);
                e.applied = true;
            }
        }
    }

    /// Forgets every message overlapping `range` (the buffer's bytes there change; deferred
    /// ones must have been materialized first).
    fn invalidate(&mut self, range: &Range<usize>) {
        self.entries.retain(|e| !overlaps(&e.range, range));
    }

    /// Holds `bytes` for `range`; `applied` says whether the buffer has them too.
    pub(crate) fn insert(&mut self, range: Range<usize>, bytes: Bytes, applied: bool) {
        self.invalidate(&range);
        self.entries.push(HeldEntry {
            range,
            bytes,
            applied,
        });
    }
}

/// Copies a send's ranges out of the buffer into one message, or forwards a held message.
fn gather(ranges: &[Range<usize>], buffer: &mut [u8], held: &mut Held) -> Bytes {
    if let [one] = ranges {
        if let Some(bytes) = held.get(one) {
            return bytes;
        }
    }
    held.materialize(ranges, buffer);
    match ranges {
        [] => Bytes::new(),
        [one] => Bytes::copy_from_slice(&buffer[one.clone()]),
        many => {
            let mut out = BytesMut::with_capacity(many.iter().map(|r| r.len()).sum());
            for r in many {
                out.extend_from_slice(&buffer[r.clone()]);
            }
            out.freeze()
        }
    }
}

/// Which collective a run is, and its bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Op {
    /// The collective's sequence number in the group.
    pub(crate) seq: u64,
    /// What the ranks must agree on for this round.
    pub(crate) signature: Signature,
    /// When it must be done.
    pub(crate) deadline: Instant,
    /// The timeout the deadline came from (for error messages).
    pub(crate) timeout: std::time::Duration,
}

/// Runs `schedule` as collective `seq` on `buffer` (which holds the input in
/// [`Schedule::input_range`], or `held` does, and has [`Schedule::buffer_len`] bytes),
/// preceded by `check`'s steps when given (core's agreement check: empty messages under the
/// same sequence number and signature, so that a rank that disagrees fails before anything
/// of the collective's is sent).
/// With `defer`, whole-message stores stay in `held` (see [`Held`]); the caller materializes
/// what it needs from the buffer. A deferred run whose sends are all held messages and whose
/// receives are all whole stores never touches the buffer, which may then be empty.
#[allow(clippy::too_many_arguments)] // one collective's inputs
pub(crate) async fn run(
    mesh: &GroupMesh,
    op: Op,
    check: Option<&Schedule>,
    schedule: &Schedule,
    buffer: &mut [u8],
    held: &mut Held,
    defer: bool,
) -> Result<(), ProcessGroupError> {
    let Op {
        seq,
        signature,
        deadline,
        timeout,
    } = op;
    let ours = signature.encode();
    let name = signature.name();
    // An empty buffer serves a deferred run whose sends are all held messages and whose
    // receives are all whole stores (the all_to_all of blocks): none of them touches it.
    debug_assert!(buffer.len() == schedule.buffer_len() || (defer && buffer.is_empty()));
    if let Some(e) = mesh.failure(seq) {
        return Err(e);
    }
    let mut run = Run {
        mesh,
        seq,
        peers: Vec::new(),
    };
    let rank = mesh.rank();
    // One timer for the whole collective, registered once; it also goes off when a
    // `Work::wait` running this collective gives up (with that wait's timeout).
    let sleep = {
        let expired = crate::work::expired();
        async move {
            tokio::select! {
                () = mesh.runtime().sleep_until(deadline) => timeout,
                after = expired => after,
            }
        }
    };
    tokio::pin!(sleep);
    let send_expired = crate::work::expired();
    tokio::pin!(send_expired);
    let timed_out = |waiting_on: Vec<usize>, timeout| ProcessGroupError::Timeout {
        collective: name,
        seq,
        rank,
        waiting_on,
        timeout,
    };
    let check_steps = check.map(Schedule::steps).unwrap_or_default();
    for step in check_steps.iter().chain(schedule.steps()) {
        let outgoing: Vec<(usize, Bytes)> = step
            .sends()
            .iter()
            .map(|t| (t.peer(), gather(t.ranges(), buffer, held)))
            .collect();
        for r in step.receives() {
            if !run.peers.contains(&r.peer()) {
                run.peers.push(r.peer());
            }
        }
        let mut send_expired = send_expired.as_mut();
        let sends = async move {
            for (peer, payload) in outgoing {
                let send = mesh
                    .runtime()
                    .timeout_at(deadline, mesh.send(peer, seq, &ours, payload));
                tokio::select! {
                    biased;
                    sent = send => sent.map_err(|_| timed_out(vec![peer], timeout))??,
                    after = &mut send_expired => return Err(timed_out(vec![peer], after)),
                }
            }
            Ok::<(), ProcessGroupError>(())
        };
        let mut sleep = sleep.as_mut();
        let buffer = &mut *buffer;
        let held = &mut *held;
        let receives = async move {
            let receives = step.receives();
            for (i, r) in receives.iter().enumerate() {
                let peer = r.peer();
                let message = tokio::select! {
                    biased;
                    m = mesh.recv(peer, seq) => match m {
                        Some(m) => m,
                        None => {
                            return Err(mesh
                                .failure(seq)
                                .unwrap_or_else(|| mesh.closed_error(peer, name, seq)))
                        }
                    },
                    after = &mut sleep => {
                        let mut waiting = vec![peer];
                        for later in &receives[i + 1..] {
                            let empty = !mesh.has_message(later.peer(), seq);
                            if empty && !waiting.contains(&later.peer()) {
                                waiting.push(later.peer());
                            }
                        }
                        return Err(timed_out(waiting, after));
                    }
                };
                if message.signature != ours {
                    return Err(match Signature::decode(&message.signature) {
                        Some(theirs) => ProcessGroupError::Disagreement {
                            seq,
                            peer,
                            theirs,
                            rank,
                            ours: signature,
                            here: true,
                        },
                        None => ProcessGroupError::Mismatch {
                            peer,
                            collective: name,
                            seq,
                            reason: format!(
                                "it ran a collective this rank does not know ({:02x?})",
                                message.signature
                            ),
                        },
                    });
                }
                let mismatch = |reason: String| ProcessGroupError::Mismatch {
                    peer,
                    collective: name,
                    seq,
                    reason,
                };
                match (r.action(), r.ranges()) {
                    (Apply::Store, [one]) if !one.is_empty() => {
                        if message.payload.len() != one.len() {
                            return Err(mismatch(format!(
                                "its message has {} bytes, the schedule expects {}",
                                message.payload.len(),
                                one.len()
                            )));
                        }
                        if !defer {
                            buffer[one.clone()].copy_from_slice(&message.payload);
                        }
                        held.insert(one.clone(), message.payload, !defer);
                    }
                    _ => {
                        held.materialize(r.ranges(), buffer);
                        r.apply(buffer, &message.payload)
                            .map_err(|e| mismatch(e.to_string()))?;
                        for range in r.ranges() {
                            held.invalidate(range);
                        }
                    }
                }
            }
            Ok(())
        };
        tokio::try_join!(sends, receives)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // a slice of one range is what `gather` takes
    fn held_messages_are_forwarded_until_their_bytes_change() {
        let mut held = Held::default();
        let mut buffer = vec![9u8; 16];
        held.insert(4..8, Bytes::from_static(b"abcd"), true);
        // Exactly the held range: the message itself, not the buffer's bytes.
        assert_eq!(&gather(&[4..8], &mut buffer, &mut held)[..], b"abcd");
        // Any other range is copied out of the buffer.
        assert_eq!(&gather(&[4..7], &mut buffer, &mut held)[..], &[9, 9, 9]);
        // A change to an overlapping range forgets it.
        held.invalidate(&(7..9));
        assert_eq!(&gather(&[4..8], &mut buffer, &mut held)[..], &[9; 4]);
        // Adjacent ranges do not overlap.
        held.insert(0..4, Bytes::from_static(b"wxyz"), true);
        held.invalidate(&(4..8));
        assert_eq!(&gather(&[0..4], &mut buffer, &mut held)[..], b"wxyz");
        assert_eq!(&gather(&[], &mut buffer, &mut held)[..], b"");
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn deferred_messages_reach_the_buffer_before_anything_reads_it() {
        let mut held = Held::default();
        let mut buffer = vec![0u8; 8];
        held.insert(0..2, Bytes::from_static(b"ab"), false);
        held.insert(2..4, Bytes::from_static(b"cd"), false);
        assert_eq!(buffer, [0; 8], "deferred: the buffer is untouched");
        // A send spanning both copies them into the buffer first.
        assert_eq!(&gather(&[1..3], &mut buffer, &mut held)[..], b"bc");
        assert_eq!(&buffer[..4], b"abcd");
        // An exact range is still forwarded without a copy.
        assert_eq!(&gather(&[2..4], &mut buffer, &mut held)[..], b"cd");
        held.insert(4..6, Bytes::from_static(b"ef"), false);
        held.materialize(&[5..6], &mut buffer);
        assert_eq!(&buffer[4..6], b"ef");
    }
}
