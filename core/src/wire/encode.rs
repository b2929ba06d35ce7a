//! Sending: a frame's preamble, and the frame as slices for one vectored write.

use std::io::IoSlice;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{Frame, Payloads, WireError, WireLimits, MAGIC, PREFIX_LEN, VERSION};

/// Encodes the preamble of `frame`: the fixed prefix and the frame header.
///
/// The frame's message header and payloads are not copied; write them after the preamble (see
/// [`OutgoingFrame`]). Fails when the frame breaks `limits`, so a sender learns of a frame its
/// peer would refuse before sending it.
pub fn encode_preamble(frame: &Frame, limits: &WireLimits) -> Result<Bytes, WireError> {
    let (table_len, body_len) = check_preamble(frame, limits)?;
    // Fits: table_len <= max_frame_header_len, a u32.
    let mut out = BytesMut::with_capacity(PREFIX_LEN + table_len as usize);
    put_preamble(&mut out, frame, table_len, body_len);
    Ok(out.freeze())
}

/// Checks `frame` against `limits`; returns the length of its frame header and of its body.
fn check_preamble(frame: &Frame, limits: &WireLimits) -> Result<(u64, u64), WireError> {
    let message_len = frame.header.len() as u64;
    if message_len > limits.max_message_header_len {
        return Err(WireError::MessageHeaderTooLarge {
            len: message_len,
            max: limits.max_message_header_len,
        });
    }
    // The frame header (`FrameHeader` in postcard: varints of the message length, the number
    // of payloads and each payload's length), written in place: no list of lengths and no
    // buffer of its own on every frame sent. One pass over the payloads for both lengths.
    let payloads: &[Bytes] = &frame.payloads;
    let mut table_len = varint_len(message_len) + varint_len(payloads.len() as u64);
    let mut content_len = message_len;
    for p in payloads {
        table_len += varint_len(p.len() as u64);
        content_len += p.len() as u64;
    }
    let table_len = table_len as u64;
    if table_len > u64::from(limits.max_frame_header_len) {
        return Err(WireError::FrameHeaderTooLarge {
            len: table_len,
            max: limits.max_frame_header_len,
        });
    }
    let body_len = table_len + content_len;
    if body_len > limits.max_frame_len {
        return Err(WireError::FrameTooLarge {
            len: body_len,
            max: limits.max_frame_len,
        });
    }
    Ok((table_len, body_len))
}

/// Writes the preamble of `frame` (checked by [`check_preamble`]) to `out`.
fn put_preamble(out: &mut impl BufMut, frame: &Frame, table_len: u64, body_len: u64) {
    // The fixed prefix made whole, then put at once (one copy, not six puts).
    let mut prefix = [0u8; PREFIX_LEN];
    prefix[..4].copy_from_slice(&MAGIC);
    prefix[4] = VERSION;
    prefix[5] = frame.kind.to_wire();
    // (Two reserved bytes, zero.) At most max_frame_header_len, a u32.
    prefix[8..12].copy_from_slice(&(table_len as u32).to_le_bytes());
    prefix[12..].copy_from_slice(&body_len.to_le_bytes());
    out.put_slice(&prefix);
    put_varint(out, frame.header.len() as u64);
    put_varint(out, frame.payloads.len() as u64);
    for p in &frame.payloads {
        put_varint(out, p.len() as u64);
    }
}

/// The bytes of `v` as a postcard varint (LEB128: seven bits a byte, low bits first).
pub(crate) fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// Writes `v` as a postcard varint ([`varint_len`] bytes).
pub(crate) fn put_varint(out: &mut impl BufMut, mut v: u64) {
    while v >= 0x80 {
        out.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

/// Encodes a whole frame into one contiguous buffer. This copies the payloads; transports use
/// [`OutgoingFrame`] instead. Meant for tests, tools and fuzzing.
pub fn encode_to_vec(frame: &Frame, limits: &WireLimits) -> Result<Vec<u8>, WireError> {
    let out = OutgoingFrame::new(frame.clone(), limits)?;
    let mut v = Vec::with_capacity(out.remaining() as usize);
    for chunk in out.into_chunks() {
        v.extend_from_slice(&chunk);
    }
    Ok(v)
}

thread_local! {
    /// This thread's buffer for small encodings (see [`exact_bytes`]).
    static SCRATCH: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Encodings of at most this many bytes are copied out of the thread's scratch buffer by
/// [`exact_bytes`]; a longer one keeps the buffer it was written in.
pub const EXACT_COPY_MAX: usize = 4 << 10;

/// Runs `encode` on this thread's scratch buffer (empty, with the room earlier encodings left)
/// and returns what it wrote as [`Bytes`] of exactly that size: one allocation per encoding.
/// Grown in a `Vec` of its own, an encoding reallocates as it grows, and with room to spare
/// costs `Bytes::from` a second allocation (its shared header). An encoding longer than
/// [`EXACT_COPY_MAX`] keeps the buffer it was written in (not copied; the thread's next
/// encoding starts from an empty one). An encoding inside `encode` (a nested one) finds the
/// buffer taken and starts from an empty one of its own.
///
/// # Errors
/// `encode`'s (the buffer is then let go of).
pub fn exact_bytes<E>(encode: impl FnOnce(Vec<u8>) -> Result<Vec<u8>, E>) -> Result<Bytes, E> {
    let mut buf = encode(SCRATCH.with(std::cell::Cell::take))?;
    if buf.len() > EXACT_COPY_MAX {
        return Ok(Bytes::from(buf));
    }
    let bytes = Bytes::copy_from_slice(&buf);
    buf.clear();
    SCRATCH.with(|s| s.set(buf));
    Ok(bytes)
}

/// A room ([`bytes_in`]) takes this many bytes at a time: a few dozen message headers.
pub const ROOM_CHUNK: usize = 1 << 10;

/// Encodings of at most this many bytes go into a room ([`bytes_in`]); a longer one is copied
/// out at its size as [`exact_bytes`] does.
pub const ROOM_MAX: usize = 256;

/// [`exact_bytes`], with a small encoding copied into `room` (a buffer kept by whoever encodes a
/// run of frames for one peer) and split off it: the bytes share the room's allocation, and
/// none is made per encoding. Once the room is full it is reclaimed in place if every earlier
/// encoding split off it is gone (frames written and dropped); else a new room of
/// [`ROOM_CHUNK`] bytes is taken, and the old one goes with its last encoding. What a room
/// holds beyond the encodings still alive is at most one chunk, plus the chunks that those
/// encodings, consecutive frames for the same peer, fill.
///
/// # Errors
/// `encode`'s (the scratch buffer is then let go of).
pub fn bytes_in<E>(
    room: &mut BytesMut,
    encode: impl FnOnce(Vec<u8>) -> Result<Vec<u8>, E>,
) -> Result<Bytes, E> {
    let mut buf = encode(SCRATCH.with(std::cell::Cell::take))?;
    if buf.len() > EXACT_COPY_MAX {
        return Ok(Bytes::from(buf));
    }
    let bytes = if buf.len() > ROOM_MAX {
        Bytes::copy_from_slice(&buf)
    } else {
        written_in(room, buf.len(), |out| out.put_slice(&buf))
    };
    buf.clear();
    SCRATCH.with(|s| s.set(buf));
    Ok(bytes)
}

/// The `len` bytes (at most [`ROOM_MAX`]) that `write` puts in `room` (see [`bytes_in`]),
/// split off it: for an encoder that knows its length before it writes (no scratch buffer,
/// no copy). `write` fills a slice of exactly `len` bytes: a plain slice's puts cost a
/// bounds check each, where a `BytesMut`'s check its room and may grow it.
pub(crate) fn written_in(
    room: &mut BytesMut,
    len: usize,
    write: impl FnOnce(&mut &mut [u8]),
) -> Bytes {
    debug_assert!(len <= ROOM_MAX && room.is_empty());
    if room.capacity() < len {
        room.reserve(ROOM_CHUNK);
    }
    room.resize(len, 0);
    let mut out = &mut room[..];
    write(&mut out);
    debug_assert!(out.is_empty(), "{} of {len} bytes not written", out.len());
    room.split().freeze()
}

/// Preambles of at most this many bytes (a frame with a few payloads) are kept in the
/// [`OutgoingFrame`] itself, not in an allocation of their own.
const INLINE_PREAMBLE: usize = 48;

/// A frame's preamble (the prefix and the frame header) written in place, for a frame with a
/// few payloads: what a transport that writes a frame whole at once (into a ring's record, in
/// one vectored write) puts before the frame's message header and payloads, with no
/// [`OutgoingFrame`] made and walked. Checked against the limits as [`OutgoingFrame::new`]
/// checks.
#[derive(Clone, Copy)]
pub struct Preamble {
    bytes: [u8; INLINE_PREAMBLE],
    len: usize,
    /// Bytes of the whole frame: preamble, message header and payloads.
    frame_len: u64,
}

impl std::fmt::Debug for Preamble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Preamble")
            .field("len", &self.len)
            .field("frame_len", &self.frame_len)
            .finish()
    }
}

impl Preamble {
    /// The preamble of `frame`, or `Ok(None)` when it does not fit in place (a frame with many
    /// or very large payloads: an [`OutgoingFrame`] then spills it to a buffer of its own).
    ///
    /// # Errors
    /// [`encode_preamble`]'s: the frame breaks `limits`.
    pub fn new(frame: &Frame, limits: &WireLimits) -> Result<Option<Preamble>, WireError> {
        let (table_len, body_len) = check_preamble(frame, limits)?;
        Ok(Preamble::checked(frame, table_len, body_len))
    }

    /// The preamble of `frame`, checked by [`check_preamble`], if it fits in place.
    fn checked(frame: &Frame, table_len: u64, body_len: u64) -> Option<Preamble> {
        // Fits: table_len <= max_frame_header_len, a u32.
        let len = PREFIX_LEN + table_len as usize;
        if len > INLINE_PREAMBLE {
            return None;
        }
        let mut bytes = [0u8; INLINE_PREAMBLE];
        put_preamble(&mut &mut bytes[..], frame, table_len, body_len);
        Some(Preamble {
            bytes,
            len,
            frame_len: PREFIX_LEN as u64 + body_len,
        })
    }

    /// The preamble's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// Bytes of the whole frame on the wire: the preamble, the message header and the payloads.
    pub fn frame_len(&self) -> u64 {
        self.frame_len
    }
}

/// A frame being sent: preamble, message header and payloads as a list of chunks, with a
/// cursor that survives partial writes. Nothing is copied, and nothing is allocated for a
/// frame with a few payloads (its preamble is kept in place, its payloads in the frame's list).
#[derive(Debug, Clone)]
pub struct OutgoingFrame {
    /// The preamble, in place (its first `preamble_len` bytes) or, when longer, in `spilled`.
    preamble: [u8; INLINE_PREAMBLE],
    preamble_len: usize,
    spilled: Bytes,
    /// How much of the preamble is written.
    preamble_at: usize,
    header: Bytes,
    payloads: Payloads,
    /// Index of the first chunk not fully written: 0 the preamble, 1 the message header, then
    /// the payloads.
    next: usize,
    remaining: u64,
}

impl OutgoingFrame {
    /// Prepares `frame` for sending, checking it against `limits`.
    pub fn new(frame: Frame, limits: &WireLimits) -> Result<Self, WireError> {
        let (table_len, body_len) = check_preamble(&frame, limits)?;
        if let Some(preamble) = Preamble::checked(&frame, table_len, body_len) {
            return Ok(OutgoingFrame::with_preamble(preamble, frame));
        }
        // Fits: table_len <= max_frame_header_len, a u32.
        let mut out = BytesMut::with_capacity(PREFIX_LEN + table_len as usize);
        put_preamble(&mut out, &frame, table_len, body_len);
        Ok(OutgoingFrame {
            preamble: [0; INLINE_PREAMBLE],
            preamble_len: 0,
            spilled: out.freeze(),
            preamble_at: 0,
            header: frame.header,
            payloads: frame.payloads,
            next: 0,
            remaining: PREFIX_LEN as u64 + body_len,
        })
    }

    /// `frame` to send after its `preamble` (made by [`Preamble::new`] from this frame, so
    /// checked): for a transport whose write of the whole frame at once fell short, with what
    /// is left then marked written by [`advance`](Self::advance).
    pub fn with_preamble(preamble: Preamble, frame: Frame) -> Self {
        OutgoingFrame {
            preamble: preamble.bytes,
            preamble_len: preamble.len,
            spilled: Bytes::new(),
            preamble_at: 0,
            header: frame.header,
            payloads: frame.payloads,
            next: 0,
            remaining: preamble.frame_len,
        }
    }

    /// Chunk `i` as it is left to write (see `next`).
    fn chunk(&self, i: usize) -> &[u8] {
        match i {
            0 if self.spilled.is_empty() => &self.preamble[self.preamble_at..self.preamble_len],
            0 => &self.spilled[self.preamble_at..],
            1 => &self.header,
            _ => &self.payloads[i - 2],
        }
    }

    /// Marks `n` bytes (at most its length) of chunk `i` as written.
    fn advance_chunk(&mut self, i: usize, n: usize) {
        match i {
            0 => self.preamble_at += n,
            1 => self.header.advance(n),
            _ => self.payloads[i - 2].advance(n),
        }
    }

    /// Bytes still to write.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Whether everything has been written.
    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// The next bytes to write, in place (empty once everything is written): for a writer
    /// that copies the frame out chunk by chunk, then calls [`advance`](Self::advance).
    pub fn front(&self) -> &[u8] {
        let mut i = self.next;
        while i < 2 + self.payloads.len() {
            let chunk = self.chunk(i);
            if !chunk.is_empty() {
                return chunk;
            }
            i += 1;
        }
        &[]
    }

    /// Fills `dst` with slices of what remains to be written, in order; returns how many it
    /// filled. Pass them to one vectored write, then call [`advance`](Self::advance).
    pub fn io_slices<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        let mut i = self.next;
        while n < dst.len() && i < 2 + self.payloads.len() {
            let chunk = self.chunk(i);
            if !chunk.is_empty() {
                dst[n] = IoSlice::new(chunk);
                n += 1;
            }
            i += 1;
        }
        n
    }

    /// Marks `n` more bytes as written.
    ///
    /// # Panics
    /// When `n` is more than [`remaining`](Self::remaining): a writer never reports more bytes
    /// written than it was given.
    pub fn advance(&mut self, mut n: usize) {
        assert!(
            n as u64 <= self.remaining,
            "advanced past the end of the frame"
        );
        self.remaining -= n as u64;
        while n > 0 {
            let step = n.min(self.chunk(self.next).len());
            self.advance_chunk(self.next, step);
            n -= step;
            if self.chunk(self.next).is_empty() {
                self.next += 1;
            }
        }
    }

    /// The chunks still to write, for transports that take owned buffers (QUIC streams).
    pub fn into_chunks(mut self) -> Vec<Bytes> {
        let mut chunks = Vec::with_capacity(2 + self.payloads.len());
        let preamble = self.chunk(0);
        if self.next == 0 && !preamble.is_empty() {
            chunks.push(if self.spilled.is_empty() {
                Bytes::copy_from_slice(preamble)
            } else {
                self.spilled.slice(self.preamble_at..)
            });
        }
        if self.next <= 1 && !self.header.is_empty() {
            chunks.push(std::mem::take(&mut self.header));
        }
        let first = self.next.saturating_sub(2);
        let payloads = std::mem::take(&mut self.payloads).into_iter();
        chunks.extend(payloads.skip(first).filter(|p| !p.is_empty()));
        chunks
    }
}
