//! The ring: a single-producer, single-consumer byte ring in a memfd shared by two processes.
//!
//! ```text
//! memfd: | header (4096 bytes)                                  | data (capacity, a power of two) |
//! header:  @64  write position (u64, producer)   @72 closed (u32, producer)
//!               @76 producer waiting (u32)
//!          @128 read position (u64, consumer)    @136 segments done (u64, consumer)
//!               @144 consumer waiting (u32)
//! ```
//!
//! Positions count bytes since the start and only grow; `pos % capacity` is the offset in the
//! data area. The data is a sequence of records, each at a position that is a multiple of 8:
//!
//! - an 8-byte record header, `kind: u32 LE` then `len: u32 LE`;
//! - `DATA`: `len` bytes of the connection's byte stream (wire frames, as TCP carries them),
//!   wrapping around the end of the data area when needed;
//! - `SEGMENT`: `len = 8`, a `u64 LE`: the length of a frame that travels in a sealed memfd
//!   segment, whose descriptor was sent over the Unix socket before the record was published;
//! - `SLAB`: `len = 24`, `id: u32 LE`, `flags: u32 LE` (bit 0: new; bits 16 to 31: `at`),
//!   `use: u64 LE`, `frame: u64 LE`: a frame of `frame` bytes at offset `at` (below 64 KiB:
//!   where the sender put it so that its largest payload starts aligned) of the sender's slab
//!   `id` (a memfd
//!   sealed against resizing that the sender reuses), its use number `use`. A new slab's
//!   descriptor (and its size) was sent over the Unix socket before the record was published;
//!   it replaces any earlier slab of that id. The consumer stores `use` in "slab i done" once
//!   nothing references the frame any more; only then may the producer write the slab again.
//!
//! then padding up to the next multiple of 8. The producer publishes records by storing the
//! write position (release); the consumer frees space by storing the read position (release).
//!
//! Every value read from the shared memory comes from a peer that may be hostile: each side keeps
//! its own position privately and never reads it back, loads the other side's position once per
//! step and checks it (`write - read` within the capacity), and copies a record header out before
//! checking it. Offsets are always masked into the data area, so nothing a peer writes can make
//! an access leave the mapping; a bad value gives a [`RingError`].

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use bytes::{BufMut, Bytes};
use tensorwire_core::wire::OutgoingFrame;

use crate::mem::{self, Mapping, MemError, RING_SEALS};

/// Size of the header in front of the data area.
pub(crate) const HEADER: usize = 4096;
const WRITE_POS: usize = 64;
const CLOSED: usize = 72;
const PRODUCER_WAITING: usize = 76;
const READ_POS: usize = 128;
const SEGMENTS_DONE: usize = 136;
const CONSUMER_WAITING: usize = 144;
const SLAB_DONE: usize = 1024;

/// Slabs a producer may have per ring.
pub const MAX_SLABS: u32 = 8;

/// Length of a record header.
const RECORD_HEADER: u64 = 8;
/// Record kind: bytes of the stream.
const DATA: u32 = 1;
/// Record kind: a frame in a sealed segment.
const SEGMENT: u32 = 2;
/// Record kind: a frame in a reused slab.
const SLAB: u32 = 3;
/// Space a segment record takes.
pub(crate) const SEGMENT_RECORD: usize = 16;
/// Space a slab record takes.
pub(crate) const SLAB_RECORD: usize = 32;
/// Bit of a slab record's flags: the slab is new (its descriptor came over the socket).
const SLAB_NEW: u32 = 1;
/// Bits of a slab record's flags that hold the frame's offset in the slab.
const SLAB_AT_SHIFT: u32 = 16;

/// What a peer did wrong in the shared memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    /// The producer's write position is behind the read position, more than the capacity
    /// ahead of it, or not a multiple of 8.
    #[error(
        "the peer's write position {write} is not within {capacity} bytes after the read \
         position {read} (or not a multiple of 8)"
    )]
    BadWritePosition {
        /// The write position found.
        write: u64,
        /// Our read position.
        read: u64,
        /// The ring's capacity.
        capacity: u64,
    },
    /// The consumer's read position is ahead of the write position or more than the capacity
    /// behind it.
    #[error(
        "the peer's read position {read} is not within {capacity} bytes before the write \
         position {write}"
    )]
    BadReadPosition {
        /// The read position found.
        read: u64,
        /// Our write position.
        write: u64,
        /// The ring's capacity.
        capacity: u64,
    },
    /// A record claims more bytes than were published, or has a length its kind does not allow.
    #[error(
        "record of kind {kind} and {len} bytes at position {pos} does not fit the {published} \
         bytes published"
    )]
    BadRecord {
        /// Where the record starts.
        pos: u64,
        /// Its kind.
        kind: u32,
        /// Its claimed length.
        len: u32,
        /// Bytes published from its start.
        published: u64,
    },
    /// A record of a kind this version does not know.
    #[error("unknown record kind {kind} at position {pos}")]
    UnknownRecord {
        /// Where the record starts.
        pos: u64,
        /// The kind found.
        kind: u32,
    },
    /// A slab record names a slab that cannot exist, or has unknown flags.
    #[error("slab record at position {pos} names slab {id} with flags {flags:#x}")]
    BadSlab {
        /// Where the record starts.
        pos: u64,
        /// The slab id found.
        id: u32,
        /// The flags found.
        flags: u32,
    },
    /// The consumer claims to have taken more segments than were sent.
    #[error("the peer claims {done} segments taken, but only {sent} were sent")]
    BadSegmentCount {
        /// Segments the peer claims.
        done: u64,
        /// Segments sent.
        sent: u64,
    },
}

/// One direction's ring, mapped.
#[derive(Debug)]
pub(crate) struct Ring {
    map: Mapping,
    cap: u64,
}

fn pad8(n: u64) -> u64 {
    (n + 7) & !7
}

impl Ring {
    /// A fresh ring with `cap` bytes of data (a power of two of at least 4096), and its memfd
    /// (sealed against resizing) to send to the peer.
    pub(crate) fn create(cap: usize) -> Result<(Ring, OwnedFd), MemError> {
        let fd = mem::memfd("tensorwire-shm-ring", (HEADER + cap) as u64)?;
        rustix::fs::fcntl_add_seals(&fd, RING_SEALS).map_err(|e| MemError::Os {
            op: "sealing a ring",
            source: e.into(),
        })?;
        let ring = Ring::open(&fd, cap)?;
        Ok((ring, fd))
    }

    /// Maps the peer's ring of `cap` bytes of data (the capacity the peer announced, checked by
    /// the caller), after checking that the memfd has exactly that size and cannot be resized.
    pub(crate) fn open(fd: impl AsFd, cap: usize) -> Result<Ring, MemError> {
        debug_assert!(cap.is_power_of_two() && cap >= HEADER);
        mem::check_memfd(&fd, (HEADER + cap) as u64, RING_SEALS)?;
        let map = Mapping::map(&fd, HEADER + cap, true, false)?;
        Ok(Ring {
            map,
            cap: cap as u64,
        })
    }

    /// The capacity of the data area.
    pub(crate) fn capacity(&self) -> u64 {
        self.cap
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= HEADER);
        // SAFETY: `off` is a constant within the header, 8-aligned (the mapping is page-aligned);
        // the memory stays mapped while `self` lives; atomics are the one sound way to share it
        // with another process.
        unsafe { &*self.map.ptr().add(off).cast::<AtomicU64>() }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off % 4 == 0 && off + 4 <= HEADER);
        // SAFETY: as in `u64_at`, 4-aligned.
        unsafe { &*self.map.ptr().add(off).cast::<AtomicU32>() }
    }

    /// The producer's write position.
    pub(crate) fn write_pos(&self) -> &AtomicU64 {
        self.u64_at(WRITE_POS)
    }

    /// The consumer's read position.
    pub(crate) fn read_pos(&self) -> &AtomicU64 {
        self.u64_at(READ_POS)
    }

    /// Set by the producer once it has closed its direction.
    pub(crate) fn closed(&self) -> &AtomicU32 {
        self.u32_at(CLOSED)
    }

    /// Set by the producer before it sleeps waiting for space.
    pub(crate) fn producer_waiting(&self) -> &AtomicU32 {
        self.u32_at(PRODUCER_WAITING)
    }

    /// Set by the consumer before it sleeps waiting for data.
    pub(crate) fn consumer_waiting(&self) -> &AtomicU32 {
        self.u32_at(CONSUMER_WAITING)
    }

    /// The last use of the producer's slab `id` that the consumer has finished with.
    pub(crate) fn slab_done(&self, id: u32) -> &AtomicU64 {
        assert!(id < MAX_SLABS, "slab id {id} out of range");
        self.u64_at(SLAB_DONE + 8 * id as usize)
    }

    /// Segments the consumer has taken.
    pub(crate) fn segments_done(&self) -> &AtomicU64 {
        self.u64_at(SEGMENTS_DONE)
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the mapping is HEADER + cap bytes long.
        unsafe { self.map.ptr().add(HEADER) }
    }

    /// Copies `src` into the data area at `pos`, wrapping around its end.
    fn copy_in(&self, pos: u64, src: &[u8]) {
        debug_assert!(src.len() as u64 <= self.cap);
        let off = (pos & (self.cap - 1)) as usize;
        let first = src.len().min(self.cap as usize - off);
        // SAFETY: `off < cap` and `off + first <= cap`; the rest (`src.len() - first <= cap`)
        // goes to the start. The producer writes only bytes the consumer has released.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data().add(off), first);
            // (Nearly every copy ends before the end: no second call for nothing.)
            if first < src.len() {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr().add(first),
                    self.data(),
                    src.len() - first,
                );
            }
        }
    }

    /// Appends `n` bytes of the data area at `pos` to `dst` (which has room for them).
    fn copy_out(&self, pos: u64, n: usize, dst: &mut impl BufMut) {
        debug_assert!(n as u64 <= self.cap && dst.remaining_mut() >= n);
        let mut pos = pos;
        let mut left = n;
        while left > 0 {
            let off = (pos & (self.cap - 1)) as usize;
            let chunk = dst.chunk_mut();
            let k = left.min(self.cap as usize - off).min(chunk.len());
            // SAFETY: `off + k <= cap` stays in the data area; `chunk` has at least `k` bytes
            // of writable room. The bytes may be changed by a hostile peer while we copy, but
            // they land in our private buffer and are validated there.
            unsafe {
                std::ptr::copy_nonoverlapping(self.data().add(off), chunk.as_mut_ptr(), k);
                dst.advance_mut(k);
            }
            pos += k as u64;
            left -= k;
        }
    }

    /// Appends the whole data area to `dst` (which has room for it), for the fuzz seeds.
    pub(crate) fn copy_all(&self, dst: &mut impl BufMut) {
        self.copy_out(0, self.cap as usize, dst);
    }

    /// The 8 bytes at the 8-aligned position `pos` (never wraps: the capacity is a multiple
    /// of 8).
    fn read_u64(&self, pos: u64) -> u64 {
        let off = (pos & (self.cap - 1)) as usize;
        debug_assert!(off % 8 == 0);
        let mut b = [0u8; 8];
        // SAFETY: `off` is 8-aligned and below `cap`, a multiple of 8, so `off + 8 <= cap`.
        unsafe { std::ptr::copy_nonoverlapping(self.data().add(off), b.as_mut_ptr(), 8) };
        u64::from_le_bytes(b)
    }

    fn write_u64(&self, pos: u64, v: u64) {
        let off = (pos & (self.cap - 1)) as usize;
        if off + 8 > self.cap as usize {
            return self.copy_in(pos, &v.to_le_bytes());
        }
        // SAFETY: `off + 8 <= cap` stays in the data area (records start at multiples of 8,
        // so this is every record's case); the producer writes only released bytes.
        unsafe {
            self.data()
                .add(off)
                .cast::<u64>()
                .write_unaligned(v.to_le())
        }
    }
}

/// A record the consumer found, checked by [`decode_record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// `len` bytes of stream follow the record header (`len` may be 0).
    Data {
        /// Bytes of stream.
        len: u64,
    },
    /// A frame of `len` bytes in a sealed segment.
    Segment {
        /// The frame's length, as the peer wrote it (checked against the segment's size).
        len: u64,
    },
    /// A frame of `len` bytes at offset `at` of the producer's slab `id`, use number `seq`;
    /// `new`: the slab's descriptor is next on the socket.
    Slab {
        /// The slab (below [`MAX_SLABS`]).
        id: u32,
        /// Whether the slab is new.
        new: bool,
        /// Where the frame starts in the slab (checked against the slab's size).
        at: u32,
        /// Its use number.
        seq: u64,
        /// The frame's length, as the peer wrote it (checked against the slab's size).
        len: u64,
    },
}

impl Record {
    /// The space the record takes in the ring, header and padding included: a multiple of 8,
    /// at least 8.
    pub fn size(&self) -> u64 {
        match self {
            Record::Data { len } => pad8(RECORD_HEADER + len),
            Record::Segment { .. } => SEGMENT_RECORD as u64,
            Record::Slab { .. } => SLAB_RECORD as u64,
        }
    }
}

/// Checks the producer's write position `write` against the consumer's own read position
/// `read` in a ring of `capacity` bytes; returns the bytes published after `read`.
///
/// # Errors
/// [`RingError::BadWritePosition`] when `write` is behind `read`, more than `capacity` ahead
/// of it, or not a multiple of 8.
pub fn check_write_position(write: u64, read: u64, capacity: u64) -> Result<u64, RingError> {
    let published = write.wrapping_sub(read);
    if write < read || published > capacity || write % 8 != 0 {
        return Err(RingError::BadWritePosition {
            write,
            read,
            capacity,
        });
    }
    Ok(published)
}

/// Checks the consumer's read position `read` against the producer's own write position
/// `write` in a ring of `capacity` bytes; returns the bytes free.
///
/// # Errors
/// [`RingError::BadReadPosition`] when `read` is ahead of `write` or more than `capacity`
/// behind it.
pub fn check_read_position(read: u64, write: u64, capacity: u64) -> Result<u64, RingError> {
    let used = write.wrapping_sub(read);
    if read > write || used > capacity {
        return Err(RingError::BadReadPosition {
            read,
            write,
            capacity,
        });
    }
    Ok(capacity - used)
}

/// Decodes the record a peer wrote at position `pos`, with `published` bytes (more than 0)
/// published from there. `word(i)` reads the record's `i`-th 8-byte word (0: its header),
/// only for words within the published bytes. The record is checked before anything in it is
/// used: it fits the published bytes, its length suits its kind, a slab record names a slab
/// that can exist and no unknown flags.
///
/// # Errors
/// [`RingError::BadRecord`], [`RingError::UnknownRecord`] or [`RingError::BadSlab`].
pub fn decode_record(
    pos: u64,
    published: u64,
    word: impl Fn(u32) -> u64,
) -> Result<Record, RingError> {
    let bad = |kind, len| RingError::BadRecord {
        pos,
        kind,
        len,
        published,
    };
    if published < RECORD_HEADER {
        return Err(bad(0, 0));
    }
    let header = word(0);
    let (kind, len) = (header as u32, (header >> 32) as u32);
    let size = pad8(RECORD_HEADER + u64::from(len));
    if size > published {
        return Err(bad(kind, len));
    }
    match kind {
        DATA => Ok(Record::Data {
            len: u64::from(len),
        }),
        SEGMENT if len == 8 => Ok(Record::Segment { len: word(1) }),
        SLAB if len == 24 => {
            let w = word(1);
            let (id, flags) = (w as u32, (w >> 32) as u32);
            let at_bits = ((1u32 << (32 - SLAB_AT_SHIFT)) - 1) << SLAB_AT_SHIFT;
            if id >= MAX_SLABS || flags & !(SLAB_NEW | at_bits) != 0 {
                return Err(RingError::BadSlab { pos, id, flags });
            }
            Ok(Record::Slab {
                id,
                new: flags & SLAB_NEW != 0,
                at: flags >> SLAB_AT_SHIFT,
                seq: word(2),
                len: word(3),
            })
        }
        SEGMENT | SLAB => Err(bad(kind, len)),
        _ => Err(RingError::UnknownRecord { pos, kind }),
    }
}

/// What the consumer finds next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing published.
    Empty,
    /// `len` bytes of stream at `pos`; read them with [`Consumer::read_into`].
    Data { pos: u64, len: u64 },
    /// A frame of `len` bytes in a segment; once taken, [`Consumer::segment_taken`].
    Segment { len: u64 },
    /// A frame of `len` bytes at offset `at` of the producer's slab `id` (a new one, whose
    /// descriptor is next on the socket, with `new`), use number `seq`; once taken,
    /// [`Consumer::segment_taken`].
    Slab {
        id: u32,
        new: bool,
        at: u32,
        seq: u64,
        len: u64,
    },
}

/// What a SLAB record says (see [`Producer::write_slab`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlabRecord {
    /// The slab.
    pub(crate) id: u32,
    /// Whether its descriptor is next on the socket.
    pub(crate) new: bool,
    /// The frame's offset in it.
    pub(crate) at: u32,
    /// The use number.
    pub(crate) seq: u64,
    /// The frame's length.
    pub(crate) len: u64,
}

/// The consumer's private state.
#[derive(Debug, Default)]
pub(crate) struct Consumer {
    /// Read position (ours; never read back from the shared memory).
    r: u64,
    /// The DATA record being read: bytes left and where it ends.
    data: Option<(u64, u64)>,
    /// The SEGMENT record found: where it ends.
    segment_end: Option<u64>,
}

impl Consumer {
    /// Our read position.
    pub(crate) fn position(&self) -> u64 {
        self.r
    }

    /// The next thing to read, after checking it.
    pub(crate) fn next(&mut self, ring: &Ring) -> Result<Next, RingError> {
        if let Some((left, _)) = self.data {
            return Ok(Next::Data {
                pos: self.r,
                len: left,
            });
        }
        if self.segment_end.is_some() {
            return Err(RingError::BadRecord {
                pos: self.r,
                kind: SEGMENT,
                len: 8,
                published: 0,
            });
        }
        loop {
            let w = ring.write_pos().load(Ordering::Acquire);
            let published = check_write_position(w, self.r, ring.cap)?;
            if published == 0 {
                return Ok(Next::Empty);
            }
            let record = decode_record(self.r, published, |i| {
                ring.read_u64(self.r + RECORD_HEADER * u64::from(i))
            })?;
            let end = self.r + record.size();
            match record {
                Record::Data { len: 0 } => self.r = end,
                Record::Data { len } => {
                    self.r += RECORD_HEADER;
                    self.data = Some((len, end));
                    return Ok(Next::Data { pos: self.r, len });
                }
                Record::Segment { len } => {
                    self.segment_end = Some(end);
                    return Ok(Next::Segment { len });
                }
                Record::Slab {
                    id,
                    new,
                    at,
                    seq,
                    len,
                } => {
                    self.segment_end = Some(end);
                    return Ok(Next::Slab {
                        id,
                        new,
                        at,
                        seq,
                        len,
                    });
                }
            }
        }
    }

    /// Copies up to `max` bytes of the current DATA record into `dst`; returns how many.
    pub(crate) fn read_into(&mut self, ring: &Ring, max: usize, dst: &mut impl BufMut) -> usize {
        let Some((left, end)) = self.data else {
            return 0;
        };
        let n = (left.min(max as u64) as usize).min(dst.remaining_mut());
        ring.copy_out(self.r, n, dst);
        let left = left - n as u64;
        if left == 0 {
            self.r = end;
            self.data = None;
        } else {
            self.r += n as u64;
            self.data = Some((left, end));
        }
        n
    }

    /// The SEGMENT or SLAB record found by [`next`](Self::next) is taken care of.
    pub(crate) fn segment_taken(&mut self) {
        if let Some(end) = self.segment_end.take() {
            self.r = end;
        }
    }

    /// Whether a SEGMENT or SLAB record waits to be taken.
    pub(crate) fn segment_pending(&self) -> bool {
        self.segment_end.is_some()
    }

    /// Releases what was read to the producer.
    pub(crate) fn release(&self, ring: &Ring) {
        ring.read_pos().store(self.r, Ordering::Release);
    }
}

/// A byte stream to send: chunks and a cursor.
#[derive(Debug, Default)]
pub(crate) struct Chunks {
    chunks: Vec<Bytes>,
    next: usize,
    offset: usize,
}

impl Chunks {
    pub(crate) fn new(chunks: Vec<Bytes>) -> Self {
        let mut c = Chunks {
            chunks,
            next: 0,
            offset: 0,
        };
        c.skip_empty();
        c
    }

    fn skip_empty(&mut self) {
        while self.next < self.chunks.len() && self.offset >= self.chunks[self.next].len() {
            self.next += 1;
            self.offset = 0;
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.next >= self.chunks.len()
    }
}

/// Stream bytes to copy into the ring, front first: [`Chunks`], or a frame's own
/// [`OutgoingFrame`] (no list of chunks to build, no preamble to copy out of it).
pub(crate) trait Source {
    /// Whether nothing is left.
    fn is_done(&self) -> bool;
    /// The next bytes to copy (empty only when done).
    fn front(&self) -> &[u8];
    /// Marks the first `n` bytes of [`front`](Self::front) as copied.
    fn consume(&mut self, n: usize);
}

impl Source for Chunks {
    fn is_done(&self) -> bool {
        Chunks::is_done(self)
    }

    fn front(&self) -> &[u8] {
        self.chunks
            .get(self.next)
            .map_or(&[][..], |c| &c[self.offset..])
    }

    fn consume(&mut self, n: usize) {
        self.offset += n;
        self.skip_empty();
    }
}

impl Source for OutgoingFrame {
    fn is_done(&self) -> bool {
        OutgoingFrame::is_done(self)
    }

    fn front(&self) -> &[u8] {
        OutgoingFrame::front(self)
    }

    fn consume(&mut self, n: usize) {
        self.advance(n);
    }
}

/// The producer's private state.
#[derive(Debug, Default)]
pub(crate) struct Producer {
    /// Write position (ours; never read back from the shared memory).
    w: u64,
}

impl Producer {
    /// Bytes free in the ring, after checking the consumer's read position.
    pub(crate) fn free(&self, ring: &Ring) -> Result<u64, RingError> {
        let r = ring.read_pos().load(Ordering::Acquire);
        check_read_position(r, self.w, ring.cap)
    }

    /// Writes as much of `src` as fits in `free` bytes as one DATA record (not yet published);
    /// returns the bytes of stream written (0 when too little room).
    pub(crate) fn write_data(&mut self, ring: &Ring, free: u64, src: &mut impl Source) -> u64 {
        let room = free.saturating_sub(RECORD_HEADER) & !7;
        let room = room.min(u64::from(u32::MAX) & !7);
        let start = self.w + RECORD_HEADER;
        let mut written = 0u64;
        while written < room && !src.is_done() {
            let chunk = src.front();
            let n = (chunk.len() as u64).min(room - written) as usize;
            ring.copy_in(start + written, &chunk[..n]);
            written += n as u64;
            src.consume(n);
        }
        if written > 0 {
            ring.write_u64(self.w, u64::from(DATA) | (written << 32));
            self.w += pad8(RECORD_HEADER + written);
        }
        written
    }

    /// Writes `parts`, one after the other, as one DATA record (not yet published) if they
    /// all fit in `free` bytes; returns whether it wrote them (nothing written otherwise).
    pub(crate) fn write_whole(&mut self, ring: &Ring, free: u64, parts: &[&[u8]]) -> bool {
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let room = free.saturating_sub(RECORD_HEADER) & !7;
        let room = room.min(u64::from(u32::MAX) & !7);
        if len == 0 || len > room {
            return false;
        }
        let mut at = self.w + RECORD_HEADER;
        for part in parts {
            ring.copy_in(at, part);
            at += part.len() as u64;
        }
        ring.write_u64(self.w, u64::from(DATA) | (len << 32));
        self.w += pad8(RECORD_HEADER + len);
        true
    }

    /// Writes a SEGMENT record for a frame of `len` bytes (not yet published); needs
    /// [`SEGMENT_RECORD`] bytes free.
    pub(crate) fn write_segment(&mut self, ring: &Ring, len: u64) {
        ring.write_u64(self.w, u64::from(SEGMENT) | (8 << 32));
        ring.write_u64(self.w + RECORD_HEADER, len);
        self.w += SEGMENT_RECORD as u64;
    }

    /// Writes a SLAB record for a frame of `len` bytes at `at` (below 64 KiB) in slab `id`,
    /// use `seq` (not yet published); needs [`SLAB_RECORD`] bytes free.
    pub(crate) fn write_slab(&mut self, ring: &Ring, slab: SlabRecord) {
        let SlabRecord {
            id,
            new,
            at,
            seq,
            len,
        } = slab;
        debug_assert!(id < MAX_SLABS && at < 1 << (32 - SLAB_AT_SHIFT));
        let flags = if new { SLAB_NEW } else { 0 } | (at << SLAB_AT_SHIFT);
        ring.write_u64(self.w, u64::from(SLAB) | (24 << 32));
        ring.write_u64(
            self.w + RECORD_HEADER,
            u64::from(id) | (u64::from(flags) << 32),
        );
        ring.write_u64(self.w + RECORD_HEADER + 8, seq);
        ring.write_u64(self.w + RECORD_HEADER + 16, len);
        self.w += SLAB_RECORD as u64;
    }

    /// Makes the records written so far visible to the consumer.
    pub(crate) fn publish(&self, ring: &Ring) {
        ring.write_pos().store(self.w, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use proptest::prelude::*;

    const CAP: usize = 4096;

    fn pair() -> (Ring, Ring) {
        let (a, fd) = Ring::create(CAP).unwrap();
        let b = Ring::open(&fd, CAP).unwrap();
        (a, b)
    }

    /// The stream bytes published, and the segment that ends them, if one does.
    fn drain(c: &mut Consumer, ring: &Ring) -> Result<(Vec<u8>, Option<u64>), RingError> {
        let mut out = BytesMut::with_capacity(2 * CAP);
        loop {
            match c.next(ring)? {
                Next::Data { .. } => {
                    c.read_into(ring, usize::MAX, &mut out);
                }
                Next::Segment { len } | Next::Slab { len, .. } => {
                    c.segment_taken();
                    c.release(ring);
                    return Ok((out.to_vec(), Some(len)));
                }
                Next::Empty => {
                    c.release(ring);
                    return Ok((out.to_vec(), None));
                }
            }
        }
    }

    #[test]
    fn streams_wrap_around_and_segments_interleave() {
        let (tx, rx) = pair();
        let (mut p, mut c) = (Producer::default(), Consumer::default());
        let mut sent = Vec::new();
        let mut got = Vec::new();
        for round in 0..50u32 {
            let bytes: Vec<u8> = (0..(round * 97 % 3000))
                .map(|i| (i ^ round) as u8)
                .collect();
            let mut src = Chunks::new(vec![Bytes::from(bytes.clone()), Bytes::new()]);
            while !src.is_done() {
                let free = p.free(&tx).unwrap();
                if p.write_data(&tx, free, &mut src) == 0 {
                    p.publish(&tx);
                    let (bytes, segment) = drain(&mut c, &rx).unwrap();
                    assert_eq!(segment, None);
                    got.extend(bytes);
                }
            }
            sent.extend(bytes);
            if p.free(&tx).unwrap() < SEGMENT_RECORD as u64 {
                p.publish(&tx);
                got.extend(drain(&mut c, &rx).unwrap().0);
            }
            p.write_segment(&tx, u64::from(round));
            p.publish(&tx);
            let (bytes, segment) = drain(&mut c, &rx).unwrap();
            got.extend(bytes);
            assert_eq!(segment, Some(u64::from(round)));
        }
        assert_eq!(got, sent);
        assert_eq!(c.next(&rx).unwrap(), Next::Empty);
    }

    #[test]
    fn slab_records_round_trip_and_bad_ones_are_typed_errors() {
        let (tx, rx) = pair();
        let (mut p, mut c) = (Producer::default(), Consumer::default());
        let rec = |id, new, at, seq, len| SlabRecord {
            id,
            new,
            at,
            seq,
            len,
        };
        p.write_slab(&tx, rec(3, true, 0, 1, 70 << 20));
        p.write_slab(&tx, rec(7, false, 48, 12, 100));
        p.publish(&tx);
        assert_eq!(
            c.next(&rx).unwrap(),
            Next::Slab {
                id: 3,
                new: true,
                at: 0,
                seq: 1,
                len: 70 << 20
            }
        );
        // The record must be taken before anything else is read.
        assert!(c.next(&rx).is_err());
        c.segment_taken();
        assert_eq!(
            c.next(&rx).unwrap(),
            Next::Slab {
                id: 7,
                new: false,
                at: 48,
                seq: 12,
                len: 100
            }
        );
        c.segment_taken();
        assert_eq!(c.next(&rx).unwrap(), Next::Empty);
        // The consumer's "done" counters are where the producer reads them.
        rx.slab_done(3).store(1, Ordering::Release);
        assert_eq!(tx.slab_done(3).load(Ordering::Acquire), 1);

        // A slab id out of range, unknown flags.
        let (tx, rx) = pair();
        let (mut p, mut c) = (Producer::default(), Consumer::default());
        p.write_slab(&tx, rec(0, false, 0, 1, 100));
        p.publish(&tx);
        rx.write_u64(8, u64::from(MAX_SLABS));
        assert!(matches!(
            c.next(&rx),
            Err(RingError::BadSlab { id: MAX_SLABS, .. })
        ));
        rx.write_u64(8, 1 | (4 << 32));
        assert!(matches!(
            c.next(&rx),
            Err(RingError::BadSlab {
                id: 1,
                flags: 4,
                ..
            })
        ));
        // A slab record of the wrong length.
        rx.write_u64(0, u64::from(SLAB) | (16 << 32));
        assert!(matches!(
            c.next(&rx),
            Err(RingError::BadRecord {
                kind: SLAB,
                len: 16,
                ..
            })
        ));
    }

    #[test]
    fn bad_positions_are_typed_errors() {
        let (tx, rx) = pair();
        let mut c = Consumer::default();
        rx.write_pos().store(CAP as u64 + 8, Ordering::Release);
        assert!(matches!(
            c.next(&rx),
            Err(RingError::BadWritePosition { .. })
        ));
        rx.write_pos().store(3, Ordering::Release);
        assert!(matches!(
            c.next(&rx),
            Err(RingError::BadWritePosition { .. })
        ));
        let p = Producer::default();
        tx.read_pos().store(8, Ordering::Release);
        assert!(matches!(
            p.free(&tx),
            Err(RingError::BadReadPosition { .. })
        ));
        // A record longer than what was published, and an unknown kind.
        rx.write_pos().store(16, Ordering::Release);
        rx.write_u64(0, u64::from(DATA) | (4000 << 32));
        assert!(matches!(
            c.next(&rx),
            Err(RingError::BadRecord { len: 4000, .. })
        ));
        rx.write_u64(0, 77);
        assert!(matches!(
            c.next(&rx),
            Err(RingError::UnknownRecord { kind: 77, .. })
        ));
    }

    proptest! {
        /// Whatever a hostile peer writes into the header and data, the consumer gives data
        /// within the ring, a segment, or a typed error; it never panics or reads outside.
        #[test]
        fn hostile_contents_never_panic(
            write in any::<u64>(),
            words in proptest::collection::vec(any::<u64>(), 0..64),
            reads in 1usize..8,
        ) {
            let (_tx, rx) = pair();
            for (i, w) in words.iter().enumerate() {
                rx.write_u64(i as u64 * 8, *w);
            }
            rx.write_pos().store(write % (2 * CAP as u64), Ordering::Release);
            let mut c = Consumer::default();
            let mut out = BytesMut::with_capacity(CAP);
            for _ in 0..reads {
                match c.next(&rx) {
                    Ok(Next::Data { len, .. }) => {
                        prop_assert!(len <= CAP as u64);
                        c.read_into(&rx, CAP, &mut out);
                        out.clear();
                    }
                    Ok(Next::Slab { id, .. }) => {
                        prop_assert!(id < MAX_SLABS);
                        c.segment_taken();
                    }
                    Ok(Next::Segment { .. }) => c.segment_taken(),
                    Ok(Next::Empty) | Err(_) => break,
                }
            }
        }
    }
}
