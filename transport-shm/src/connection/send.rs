//! The sending side of a connection: frames into the ring as stream records, into slabs of
//! ours that the peer maps, or into sealed segments; and the waits for the ring's space.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;

use tensorwire_core::ports::transport::TransportError;
use tensorwire_core::spin::requeue;
use tensorwire_core::wire::{Frame, OutgoingFrame, Preamble, PREFIX_LEN};

use super::{wake, ShmConnection, MAX_SEGMENTS_IN_FLIGHT, SLAB_ALIGN};
use crate::mem;
use crate::ring::{Chunks, Producer, RingError, SlabRecord, Source, SEGMENT_RECORD, SLAB_RECORD};
use crate::sock;

/// A direct send of one frame with at most this many payloads copies it into the ring
/// straight from the frame (its preamble on the stack), with no [`OutgoingFrame`] made.
const WHOLE_PAYLOADS: usize = 2;

/// Bytes a sender copies into a slab between two turns of the runtime's other tasks.
const SLAB_COPY_STEP: usize = 4 << 20;

/// Payloads in a slab start at a multiple of this when they can, so that the receiver can hand
/// them out in place ([`crate::private_view`]): 64 bytes suit every element type and a cache
/// line.
const PAYLOAD_ALIGN: usize = 64;

/// Where in a slab to write the frame `chunks`: the offset (below [`PAYLOAD_ALIGN`]) that
/// puts the start of its largest chunk (its largest tensor's bytes) on a multiple of
/// [`PAYLOAD_ALIGN`].
fn slab_offset(chunks: &[bytes::Bytes]) -> usize {
    let Some(largest) = (0..chunks.len()).max_by_key(|&i| (chunks[i].len(), std::cmp::Reverse(i)))
    else {
        return 0;
    };
    let before: usize = chunks[..largest].iter().map(|c| c.len()).sum();
    (PAYLOAD_ALIGN - before % PAYLOAD_ALIGN) % PAYLOAD_ALIGN
}

/// A slab of ours that the peer maps: we write a frame at its start, the peer hands the bytes
/// up without copying and tells us (`slab_done` in the ring) when nothing references them.
#[derive(Debug)]
struct SendSlab {
    map: mem::Mapping,
    /// The last use (0: never used yet; uses count from 1).
    seq: u64,
}

/// The send side's state, in the connection's slot for it ([`ShmConnection`]'s `tx`): there
/// while no send that waits runs, taken out by one ([`Loan`]) for as long as it runs.
pub(super) struct Tx {
    producer: Producer,
    segments_sent: u64,
    /// Our slabs, by id.
    slabs: Vec<Option<SendSlab>>,
    /// Set when a send failed or was dropped half-way: the ring may hold part of a frame.
    broken: bool,
    /// Frames a [`try_send_now`](tensorwire_core::ports::transport::Connection::try_send_now)
    /// could not finish (the ring was full), the first possibly part-written: the next
    /// `send_many` (or `close`) writes them first.
    held: Vec<Prepared>,
}

/// A frame ready to send: stream chunks for the ring, chunks for a slab, or a sealed segment.
enum Prepared {
    Inline(OutgoingFrame),
    Slab(Vec<bytes::Bytes>),
    Segment(u64, OwnedFd),
}

/// The send side taken out of its slot by a send that waits (`send_many`, `close`) for as
/// long as it runs, with the senders' turn: put back when the send ends, however it ends,
/// marked broken if it ends armed (dropped or failed half-way: the ring may hold part of a
/// frame). While it is out, a `try_send_now` finds the slot empty and takes nothing.
pub(super) struct Loan<'a> {
    conn: &'a ShmConnection,
    /// Always `Some` until the loan drops (an `Option` only so that `drop` can put it back).
    tx: Option<Box<Tx>>,
    armed: bool,
    /// Released after `drop` has put the send side back (fields drop after it).
    _turn: tokio::sync::MutexGuard<'a, ()>,
}

impl Drop for Loan<'_> {
    fn drop(&mut self) {
        if let Some(mut tx) = self.tx.take() {
            tx.broken |= self.armed;
            *self.conn.tx_slot() = Some(tx);
        }
    }
}

impl Tx {
    pub(super) fn new() -> Box<Self> {
        Box::new(Tx {
            producer: Producer::default(),
            segments_sent: 0,
            slabs: (0..crate::ring::MAX_SLABS).map(|_| None).collect(),
            broken: false,
            held: Vec::new(),
        })
    }
}

impl ShmConnection {
    /// [`Connection::send_many`](tensorwire_core::ports::transport::Connection::send_many):
    /// prepares each frame (a large one into a segment, off the runtime's threads), then
    /// writes them in order with the send side on loan (in the senders' turn).
    pub(super) async fn send_prepared(&self, frames: Vec<Frame>) -> Result<(), TransportError> {
        let mut prepared = Vec::with_capacity(frames.len());
        for frame in frames {
            let out =
                OutgoingFrame::new(frame, &self.limits).map_err(|source| TransportError::Wire {
                    peer: self.peer,
                    source,
                })?;
            let len = out.remaining();
            if len < self.slab_min.min(self.segment_min) as u64 {
                prepared.push(Prepared::Inline(out));
                continue;
            }
            let chunks = out.into_chunks();
            if len < self.segment_min as u64 {
                prepared.push(Prepared::Slab(chunks));
                continue;
            }
            // The one copy of a large frame, off the runtime's threads.
            let fd = tokio::task::spawn_blocking(move || mem::write_segment(&chunks, len as usize))
                .await
                .map_err(|e| {
                    TransportError::io(self.peer, "writing a segment", &std::io::Error::other(e))
                })?
                .map_err(|e| {
                    TransportError::io(self.peer, "writing a segment", &std::io::Error::other(e))
                })?;
            prepared.push(Prepared::Segment(len, fd));
        }
        let mut loan = self.lend_tx().await?;
        let Some(tx) = loan.tx.as_deref_mut() else {
            return Err(self.broken_error());
        };
        if tx.broken {
            return Err(self.broken_error());
        }
        if self.shared.is_dead() {
            return Err(self.gone_error("sending"));
        }
        // What a `try_send_now` left goes first: the ring may be in the middle of its frame.
        if !tx.held.is_empty() {
            let mut all = std::mem::take(&mut tx.held);
            all.append(&mut prepared);
            prepared = all;
        }
        loan.armed = true;
        let result = self.send_frames(tx, prepared).await;
        loan.armed = result.is_err();
        result
    }

    /// The send side's slot, for one step that does not wait (a poisoned lock's state is
    /// still whole: nothing under it panics half-way through a change).
    pub(super) fn tx_slot(&self) -> std::sync::MutexGuard<'_, Option<Box<Tx>>> {
        self.tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits for the senders' turn and takes the send side out of its slot until the loan
    /// drops.
    pub(super) async fn lend_tx(&self) -> Result<Loan<'_>, TransportError> {
        let turn = self.turn.lock().await;
        // Only the turn's holder takes the send side out, and it puts it back before the turn
        // passes on: the slot is never empty here.
        let tx = self.tx_slot().take().ok_or_else(|| self.broken_error())?;
        Ok(Loan {
            conn: self,
            tx: Some(tx),
            armed: false,
            _turn: turn,
        })
    }

    /// Writes what a [`try_send_now`](tensorwire_core::ports::transport::Connection::try_send_now)
    /// left (before the end of the stream).
    pub(super) async fn flush_held(&self, loan: &mut Loan<'_>) -> Result<(), TransportError> {
        let Some(tx) = loan.tx.as_deref_mut() else {
            return Ok(());
        };
        let held = std::mem::take(&mut tx.held);
        if held.is_empty() || tx.broken {
            return Ok(());
        }
        loan.armed = true;
        let result = self.send_frames(tx, held).await;
        loan.armed = result.is_err();
        result
    }

    fn broken_error(&self) -> TransportError {
        TransportError::Io {
            addr: self.peer,
            op: "sending",
            kind: std::io::ErrorKind::BrokenPipe,
            message: "an earlier send failed or was cancelled half-way; the connection \
                      cannot send any more"
                .to_owned(),
        }
    }

    /// [`Connection::try_send_now`](tensorwire_core::ports::transport::Connection::try_send_now):
    /// small frames (below the slab and segment sizes) are copied into the ring on this thread
    /// when no other send holds the ring; the reader is woken as a `send_many` wakes it (only
    /// if it sleeps). Frames that the ring's free space does not take are held, and the next
    /// `send_many` writes them first; a frame that could be large takes nothing (the slabs and
    /// segments wait for space and descriptors, which only `send_many` may).
    pub(super) fn try_send_frames(
        &self,
        frames: &mut Vec<Frame>,
    ) -> Option<Result<(), TransportError>> {
        let small = self.slab_min.min(self.segment_min);
        if frames.iter().any(|f| may_reach(f, small)) {
            return None;
        }
        let mut slot = match self.tx.try_lock() {
            Ok(slot) => slot,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        // An empty slot: a `send_many` (or `close`) is under way, and may be half-way through
        // a frame in the ring.
        let tx = slot.as_deref_mut()?;
        if !tx.held.is_empty() {
            // The next `send_many` writes those first.
            return None;
        }
        if tx.broken {
            return Some(Err(self.broken_error()));
        }
        if self.shared.is_dead() {
            return Some(Err(self.gone_error("sending")));
        }
        // No list for the usual single frame: the first apart, the rest (none) collected.
        let wire = |source| {
            Some(Err(TransportError::Wire {
                peer: self.peer,
                source,
            }))
        };
        if let [frame] = &frames[..] {
            // The usual single message: copied into one record straight from the frame.
            match self.try_write_whole(tx, frame) {
                Ok(false) => {}
                Ok(true) => {
                    frames.clear();
                    self.publish(tx);
                    return Some(Ok(()));
                }
                Err(e) => return Some(Err(e)),
            }
        }
        let mut taken = frames.drain(..);
        let Some(first) = taken.next() else {
            return Some(Ok(()));
        };
        let first = match OutgoingFrame::new(first, &self.limits) {
            Ok(out) => out,
            Err(source) => return wire(source),
        };
        let rest: Result<Vec<_>, _> = taken.map(|f| OutgoingFrame::new(f, &self.limits)).collect();
        let rest = match rest {
            Ok(rest) => rest,
            Err(source) => return wire(source),
        };
        let mut outs = std::iter::once(first).chain(rest);
        while let Some(mut out) = outs.next() {
            while !out.is_done() {
                let free = match tx.producer.free(&self.tx_ring) {
                    Ok(free) => free.min(self.max_record),
                    Err(e) => {
                        // What was written of this frame stays unpublished; nothing can follow.
                        tx.broken = true;
                        return Some(Err(self.ring_error(e)));
                    }
                };
                if tx.producer.write_data(&self.tx_ring, free, &mut out) == 0 {
                    // The ring is full: the rest goes with the next `send_many`.
                    self.publish(tx);
                    tx.held = std::iter::once(out)
                        .chain(outs)
                        .map(Prepared::Inline)
                        .collect();
                    return None;
                }
                if !out.is_done() {
                    // A frame of several records: the reader may start on this one.
                    self.publish(tx);
                }
            }
        }
        self.publish(tx);
        Some(Ok(()))
    }

    /// Copies `frame` (with at most [`WHOLE_PAYLOADS`] payloads) into the ring as one record
    /// straight from its parts, its preamble on the stack, when the ring's free space takes it
    /// whole: `Ok(true)` then (not yet published), `Ok(false)` when it wrote nothing (the frame
    /// goes the general way).
    fn try_write_whole(&self, tx: &mut Tx, frame: &Frame) -> Result<bool, TransportError> {
        if frame.payloads.len() > WHOLE_PAYLOADS {
            return Ok(false);
        }
        let preamble = match Preamble::new(frame, &self.limits) {
            Ok(Some(preamble)) => preamble,
            Ok(None) => return Ok(false),
            Err(source) => {
                return Err(TransportError::Wire {
                    peer: self.peer,
                    source,
                })
            }
        };
        let free = match tx.producer.free(&self.tx_ring) {
            Ok(free) => free.min(self.max_record),
            Err(e) => {
                tx.broken = true;
                return Err(self.ring_error(e));
            }
        };
        let mut parts: [&[u8]; 2 + WHOLE_PAYLOADS] = [&[]; 2 + WHOLE_PAYLOADS];
        parts[0] = preamble.as_bytes();
        parts[1] = &frame.header;
        for (part, payload) in parts[2..].iter_mut().zip(frame.payloads.iter()) {
            *part = payload;
        }
        Ok(tx
            .producer
            .write_whole(&self.tx_ring, free, &parts[..2 + frame.payloads.len()]))
    }

    /// Writes `chunks` into the ring, waiting for space as needed. Publishes as it goes.
    async fn write_stream(
        &self,
        tx: &mut Tx,
        chunks: &mut impl Source,
    ) -> Result<(), TransportError> {
        while !chunks.is_done() {
            let free = tx
                .producer
                .free(&self.tx_ring)
                .map_err(|e| self.ring_error(e))?;
            // Small records, each published at once: the consumer copies one out while the next
            // is copied in, and each side sees the other progress within its polling time, so
            // neither goes to sleep (no system call) while a large frame streams through.
            let free = free.min(self.max_record);
            if tx.producer.write_data(&self.tx_ring, free, chunks) == 0 {
                self.wait_for_space(tx, 2 * SEGMENT_RECORD as u64, 0)
                    .await?;
            } else {
                self.publish(tx);
            }
        }
        Ok(())
    }

    fn publish(&self, tx: &Tx) {
        tx.producer.publish(&self.tx_ring);
        wake(self.tx_ring.consumer_waiting(), &self.peer_data_efd);
    }

    /// Waits until `bytes` are free in the ring and fewer than `MAX - segments` segments are in
    /// flight.
    async fn wait_for_space(
        &self,
        tx: &Tx,
        bytes: u64,
        segments: u64,
    ) -> Result<(), TransportError> {
        let check = |tx: &Tx| -> Result<bool, RingError> {
            let done = self.tx_ring.segments_done().load(Ordering::Acquire);
            if done > tx.segments_sent {
                return Err(RingError::BadSegmentCount {
                    done,
                    sent: tx.segments_sent,
                });
            }
            Ok(tx.producer.free(&self.tx_ring)? >= bytes
                && tx.segments_sent - done + segments <= MAX_SEGMENTS_IN_FLIGHT)
        };
        loop {
            if check(tx).map_err(|e| self.ring_error(e))? {
                return Ok(());
            }
            if self.shared.is_dead() {
                return Err(self.gone_error("sending"));
            }
            // A bad value ends the wait; `check` above reports it.
            self.wait(self.tx_ring.producer_waiting(), &self.space_efd, || {
                check(tx).unwrap_or(true)
            })
            .await?;
        }
    }

    async fn send_frames(&self, tx: &mut Tx, outs: Vec<Prepared>) -> Result<(), TransportError> {
        let mut published = true;
        for out in outs {
            match out {
                Prepared::Inline(mut out) => {
                    self.write_stream(tx, &mut out).await?;
                    published = false;
                }
                Prepared::Slab(chunks) => {
                    if !published {
                        self.publish(tx);
                        published = true;
                    }
                    if !self.send_in_slab(tx, &chunks).await? {
                        // Every slab is still referenced by the peer (or the budget is spent):
                        // the frame streams through the ring instead.
                        let mut chunks = Chunks::new(chunks);
                        self.write_stream(tx, &mut chunks).await?;
                        published = false;
                    }
                }
                Prepared::Segment(len, fd) => {
                    if !published {
                        self.publish(tx);
                    }
                    self.wait_for_space(tx, SEGMENT_RECORD as u64, 1).await?;
                    if self.shared.is_dead() {
                        return Err(self.gone_error("sending"));
                    }
                    sock::send_packet(&self.shared.sock, &len.to_le_bytes(), &[fd.as_fd()])
                        .await
                        .map_err(|e| TransportError::io(self.peer, "sending a segment", &e))?;
                    tx.producer.write_segment(&self.tx_ring, len);
                    tx.segments_sent += 1;
                    self.publish(tx);
                    published = true;
                }
            }
        }
        if !published {
            self.publish(tx);
        }
        Ok(())
    }

    /// Picks a slab for a frame of `len` bytes: the smallest free one that holds it, else a
    /// new one (in a free id, or replacing a free one too small) within `slab_bytes`. Returns
    /// its id and whether it is new (its descriptor still to be sent), or `None`.
    fn pick_slab(
        &self,
        tx: &mut Tx,
        len: usize,
    ) -> Result<Option<(u32, Option<OwnedFd>)>, TransportError> {
        let free = |id: usize, slab: &SendSlab| {
            self.tx_ring.slab_done(id as u32).load(Ordering::Acquire) == slab.seq
        };
        let mut best: Option<(usize, usize)> = None;
        let mut replace: Option<usize> = None;
        let mut empty: Option<usize> = None;
        let mut total = 0usize;
        for (id, slot) in tx.slabs.iter().enumerate() {
            match slot {
                None => {
                    empty.get_or_insert(id);
                }
                Some(slab) => {
                    total += slab.map.len();
                    if !free(id, slab) {
                        continue;
                    }
                    let cap = slab.map.len();
                    if cap >= len {
                        if best.is_none_or(|(_, c)| cap < c) {
                            best = Some((id, cap));
                        }
                    } else if replace
                        .is_none_or(|r| tx.slabs[r].as_ref().is_some_and(|s| s.map.len() > cap))
                    {
                        replace = Some(id);
                    }
                }
            }
        }
        if let Some((id, _)) = best {
            return Ok(Some((id as u32, None)));
        }
        let cap = len.div_ceil(SLAB_ALIGN) * SLAB_ALIGN;
        let id = match (empty, replace) {
            (Some(id), _) if total + cap <= self.slab_bytes => id,
            (_, Some(id))
                if total - tx.slabs[id].as_ref().map_or(0, |s| s.map.len()) + cap
                    <= self.slab_bytes =>
            {
                id
            }
            _ => return Ok(None),
        };
        let (map, fd) = mem::create_slab(cap).map_err(|e| {
            TransportError::io(self.peer, "creating a slab", &std::io::Error::other(e))
        })?;
        // A replaced slab keeps counting uses where it was: the peer's "done" is at its last.
        let seq = tx.slabs[id].as_ref().map_or(0, |s| s.seq);
        tx.slabs[id] = Some(SendSlab { map, seq });
        Ok(Some((id as u32, Some(fd))))
    }

    /// Sends one frame, `chunks`, in a slab: one copy into memory the peer maps, then a slab
    /// record in the ring. `false` when no slab is free (nothing was sent).
    async fn send_in_slab(
        &self,
        tx: &mut Tx,
        chunks: &[bytes::Bytes],
    ) -> Result<bool, TransportError> {
        let len: usize = chunks.iter().map(|c| c.len()).sum();
        let start = slab_offset(chunks);
        let Some((id, fd)) = self.pick_slab(tx, start + len)? else {
            return Ok(false);
        };
        // The copy, in steps between which the runtime's other tasks run.
        let mut at = start;
        for chunk in chunks {
            let mut rest = &chunk[..];
            while !rest.is_empty() {
                let n = rest.len().min(SLAB_COPY_STEP);
                let slab = tx.slabs[id as usize]
                    .as_ref()
                    .map(|s| s.map.ptr())
                    .ok_or_else(|| self.gone_error("sending"))?;
                // SAFETY: the slab holds at least `start + len` bytes (`pick_slab`) and
                // `at + n <= start + len`;
                // the peer is done with its last use (`slab_done`), so nothing reads them, and
                // nothing else of ours writes them (we hold the send side).
                unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), slab.add(at), n) };
                at += n;
                rest = &rest[n..];
                if at < start + len {
                    requeue().await;
                }
            }
        }
        let new = fd.is_some();
        if let Some(fd) = fd {
            self.wait_for_space(tx, SLAB_RECORD as u64, 1).await?;
            if self.shared.is_dead() {
                return Err(self.gone_error("sending"));
            }
            let cap = tx.slabs[id as usize].as_ref().map_or(0, |s| s.map.len()) as u64;
            sock::send_packet(&self.shared.sock, &cap.to_le_bytes(), &[fd.as_fd()])
                .await
                .map_err(|e| TransportError::io(self.peer, "sending a slab", &e))?;
            tx.segments_sent += 1;
        } else {
            self.wait_for_space(tx, SLAB_RECORD as u64, 0).await?;
        }
        let slab = tx.slabs[id as usize]
            .as_mut()
            .ok_or_else(|| self.gone_error("sending"))?;
        slab.seq += 1;
        let seq = slab.seq;
        tx.producer.write_slab(
            &self.tx_ring,
            SlabRecord {
                id,
                new,
                at: start as u32,
                seq,
                len: len as u64,
            },
        );
        self.publish(tx);
        Ok(true)
    }

    /// Writes raw bytes into the ring (for the conformance suite's hostile peers).
    #[cfg(feature = "__testing")]
    pub(crate) async fn send_raw(&self, bytes: &[u8]) -> Result<(), TransportError> {
        let mut loan = self.lend_tx().await?;
        let Some(tx) = loan.tx.as_deref_mut() else {
            return Err(self.broken_error());
        };
        let mut chunks = Chunks::new(vec![bytes::Bytes::copy_from_slice(bytes)]);
        self.write_stream(tx, &mut chunks).await?;
        self.publish(tx);
        Ok(())
    }
}

/// Whether `frame` may take `min` bytes or more on the wire: its header and payloads, and a
/// bound on its preamble (the prefix and a varint of at most 10 bytes per length).
fn may_reach(frame: &Frame, min: usize) -> bool {
    let body: usize = frame.payloads.iter().map(|p| p.len()).sum();
    let preamble = PREFIX_LEN + 10 * (frame.payloads.len() + 2);
    body.saturating_add(frame.header.len())
        .saturating_add(preamble)
        >= min
}
