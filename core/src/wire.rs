//! The frame format: what every transport puts on the wire.
//!
//! A [`Frame`] is an opaque *message header* (bytes that higher layers encode with postcard) and
//! zero or more *payloads* (raw tensor bytes, never re-encoded). On the wire a frame is:
//!
//! ```text
//! prefix (20 bytes, fixed)                 frame header (postcard)       body
//! +-------+---------+------+----------+-------------+------------+------------------+-----------------+---------+-----+
//! | magic | version | kind | reserved | table_len   | body_len   | message_len,     | message header  | payload | ... |
//! | TWFR  | u8 = 2  | u8   | u16 = 0  | u32 LE      | u64 LE     | payload lengths  | (opaque bytes)  | 0       |     |
//! +-------+---------+------+----------+-------------+------------+------------------+-----------------+---------+-----+
//! ```
//!
//! `table_len` is the length of the postcard-encoded frame header; `body_len` counts everything
//! after the prefix (frame header, message header and payloads), so a receiver can refuse a frame
//! that is too large before it reads anything else.
//!
//! Sending is sans-IO and copy-free: [`OutgoingFrame`] holds the preamble (prefix + frame header,
//! produced by [`encode_preamble`]) next to the message header and payload [`Bytes`], and hands
//! them out as [`IoSlice`]s for one vectored write (or as chunks for a QUIC stream).
//!
//! Receiving is incremental and bounded: [`FrameDecoder`] takes bytes as they arrive, validates
//! every length against [`WireLimits`] *before* it reserves memory for it, splits segments that
//! are already buffered off without copying, and lets a transport read a large payload straight
//! into its final buffer ([`FrameDecoder::direct_read_buf`]). Bad input gives a typed
//! [`WireError`]; the decoder never panics on any input.
//!
//! ```
//! use bytes::{Bytes, BytesMut};
//! use tensorwire_core::wire::{Frame, FrameDecoder, OutgoingFrame, WireLimits};
//!
//! let limits = WireLimits::default();
//! let frame = Frame::message(Bytes::from_static(b"call add"), vec![Bytes::from(vec![7u8; 1000])]);
//! let out = OutgoingFrame::new(frame.clone(), &limits)?;
//! let mut wire = BytesMut::new();
//! for chunk in out.into_chunks() {
//!     wire.extend_from_slice(&chunk);
//! }
//! let mut decoder = FrameDecoder::new(limits);
//! assert_eq!(decoder.decode(&mut wire)?, Some(frame));
//! # Ok::<(), tensorwire_core::wire::WireError>(())
//! ```

use std::io::IoSlice;

use bytes::buf::Limit;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"TWFR";

/// The wire version this build writes and reads. A peer of another version is refused at its
/// first frame ([`WireError::UnknownVersion`]), so builds whose messages differ never misread
/// each other. 2: a fetch and a method call name the caller's fork of the reference.
pub const VERSION: u8 = 2;

/// Length of the fixed prefix in bytes.
pub const PREFIX_LEN: usize = 20;

/// What a frame carries. Transports move both kinds alike; the layers above give them meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FrameKind {
    /// An application message (an RPC request, response, collective block, ...).
    Message,
    /// A control message of the layers above (keep-alive, shutdown, membership, ...).
    Control,
    /// A process group's own traffic (collective messages and the group's control), on a
    /// connection whose [`Message`](FrameKind::Message) and [`Control`](FrameKind::Control)
    /// frames belong to the RPC agent: one connection per pair of workers carries both.
    Collective,
}

impl FrameKind {
    /// The byte that encodes this kind on the wire.
    pub const fn to_wire(self) -> u8 {
        match self {
            FrameKind::Message => 1,
            FrameKind::Control => 2,
            FrameKind::Collective => 3,
        }
    }

    /// The kind a wire byte stands for, if any.
    pub const fn from_wire(byte: u8) -> Option<Self> {
        match byte {
            1 => Some(FrameKind::Message),
            2 => Some(FrameKind::Control),
            3 => Some(FrameKind::Collective),
            _ => None,
        }
    }
}

/// One frame: an opaque message header and raw payloads beside it.
///
/// Its `Debug` output shows lengths, not contents: payloads can be gigabytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Frame {
    /// What the frame carries.
    pub kind: FrameKind,
    /// The message header, encoded by the layers above (postcard); opaque here.
    pub header: Bytes,
    /// Tensor payloads as raw bytes; never re-encoded.
    pub payloads: Vec<Bytes>,
}

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        struct Len(usize);
        impl std::fmt::Debug for Len {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{} bytes", self.0)
            }
        }
        f.debug_struct("Frame")
            .field("kind", &self.kind)
            .field("header", &Len(self.header.len()))
            .field(
                "payloads",
                &self
                    .payloads
                    .iter()
                    .map(|p| Len(p.len()))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Frame {
    /// A [`FrameKind::Message`] frame.
    pub fn message(header: impl Into<Bytes>, payloads: Vec<Bytes>) -> Self {
        Frame {
            kind: FrameKind::Message,
            header: header.into(),
            payloads,
        }
    }

    /// A [`FrameKind::Control`] frame.
    pub fn control(header: impl Into<Bytes>, payloads: Vec<Bytes>) -> Self {
        Frame {
            kind: FrameKind::Control,
            header: header.into(),
            payloads,
        }
    }

    /// A [`FrameKind::Collective`] frame.
    pub fn collective(header: impl Into<Bytes>, payloads: Vec<Bytes>) -> Self {
        Frame {
            kind: FrameKind::Collective,
            header: header.into(),
            payloads,
        }
    }

    /// Bytes of message header and payloads together (what the frame carries, without framing).
    pub fn content_len(&self) -> u64 {
        self.payloads
            .iter()
            .fold(self.header.len() as u64, |sum, p| sum + p.len() as u64)
    }
}

/// Bounds a decoder (and an encoder) enforces on every frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct WireLimits {
    /// Largest frame body (frame header + message header + payloads), in bytes. Default 1 GiB.
    pub max_frame_len: u64,
    /// Largest postcard-encoded frame header (the table of lengths), in bytes. Default 64 KiB,
    /// which is room for several thousand payloads.
    pub max_frame_header_len: u32,
    /// Largest message header, in bytes. Default 64 MiB.
    pub max_message_header_len: u64,
}

impl Default for WireLimits {
    fn default() -> Self {
        WireLimits {
            max_frame_len: 1 << 30,
            max_frame_header_len: 64 << 10,
            max_message_header_len: 64 << 20,
        }
    }
}

impl WireLimits {
    /// These limits with another maximum frame length.
    pub fn with_max_frame_len(mut self, max: u64) -> Self {
        self.max_frame_len = max;
        self
    }

    /// These limits with another maximum frame-header length.
    pub fn with_max_frame_header_len(mut self, max: u32) -> Self {
        self.max_frame_header_len = max;
        self
    }

    /// These limits with another maximum message-header length.
    pub fn with_max_message_header_len(mut self, max: u64) -> Self {
        self.max_message_header_len = max;
        self
    }
}

/// What was wrong with a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The first four bytes are not [`MAGIC`]: the peer does not speak this protocol.
    #[error("bad magic {found:02x?}: not a tensorwire frame (expected {MAGIC:02x?})")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// The peer speaks another wire version.
    #[error("unknown wire version {found}; this build speaks version {VERSION}")]
    UnknownVersion {
        /// The version byte found.
        found: u8,
    },
    /// The kind byte names no known [`FrameKind`].
    #[error(
        "unknown frame kind {found}; known kinds are 1 (message), 2 (control) and 3 (collective)"
    )]
    UnknownKind {
        /// The kind byte found.
        found: u8,
    },
    /// The frame is larger than [`WireLimits::max_frame_len`].
    #[error("frame of {len} bytes exceeds the limit of {max} bytes (WireLimits::max_frame_len)")]
    FrameTooLarge {
        /// The length claimed or needed.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The frame header is larger than [`WireLimits::max_frame_header_len`].
    #[error(
        "frame header of {len} bytes exceeds the limit of {max} bytes \
         (WireLimits::max_frame_header_len); too many payloads?"
    )]
    FrameHeaderTooLarge {
        /// The length claimed or needed.
        len: u64,
        /// The limit.
        max: u32,
    },
    /// The message header is larger than [`WireLimits::max_message_header_len`].
    #[error(
        "message header of {len} bytes exceeds the limit of {max} bytes \
         (WireLimits::max_message_header_len)"
    )]
    MessageHeaderTooLarge {
        /// The length claimed or needed.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The prefix or the frame header is inconsistent or does not decode.
    #[error("malformed frame header: {reason}")]
    MalformedHeader {
        /// What exactly is wrong.
        reason: String,
    },
    /// The input ended in the middle of a frame.
    #[error("truncated frame: input ended after {received} of {expected} bytes of the {part}")]
    Truncated {
        /// Which part was being read: `prefix`, `frame header` or `body`.
        part: &'static str,
        /// Bytes of that part received.
        received: u64,
        /// Bytes of that part expected.
        expected: u64,
    },
}

/// The postcard-encoded frame header: the lengths of the segments that follow it.
#[derive(Debug, Serialize, Deserialize)]
struct FrameHeader {
    message_len: u64,
    payload_lens: Vec<u64>,
}

/// Encodes the preamble of `frame`: the fixed prefix and the frame header.
///
/// The frame's message header and payloads are not copied; write them after the preamble (see
/// [`OutgoingFrame`]). Fails when the frame breaks `limits`, so a sender learns of a frame its
/// peer would refuse before sending it.
pub fn encode_preamble(frame: &Frame, limits: &WireLimits) -> Result<Bytes, WireError> {
    let message_len = frame.header.len() as u64;
    if message_len > limits.max_message_header_len {
        return Err(WireError::MessageHeaderTooLarge {
            len: message_len,
            max: limits.max_message_header_len,
        });
    }
    let table = FrameHeader {
        message_len,
        payload_lens: frame.payloads.iter().map(|p| p.len() as u64).collect(),
    };
    let table = postcard::to_allocvec(&table).map_err(|e| WireError::MalformedHeader {
        reason: format!("could not encode the frame header: {e}"),
    })?;
    let table_len = table.len() as u64;
    if table_len > u64::from(limits.max_frame_header_len) {
        return Err(WireError::FrameHeaderTooLarge {
            len: table_len,
            max: limits.max_frame_header_len,
        });
    }
    let body_len = table_len + frame.content_len();
    if body_len > limits.max_frame_len {
        return Err(WireError::FrameTooLarge {
            len: body_len,
            max: limits.max_frame_len,
        });
    }
    let mut out = BytesMut::with_capacity(PREFIX_LEN + table.len());
    out.put_slice(&MAGIC);
    out.put_u8(VERSION);
    out.put_u8(frame.kind.to_wire());
    out.put_u16_le(0);
    // Fits: table_len <= max_frame_header_len, a u32.
    out.put_u32_le(table_len as u32);
    out.put_u64_le(body_len);
    out.put_slice(&table);
    Ok(out.freeze())
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

/// A frame being sent: preamble, message header and payloads as a list of [`Bytes`] chunks, with
/// a cursor that survives partial writes. Nothing is copied.
#[derive(Debug, Clone)]
pub struct OutgoingFrame {
    chunks: Vec<Bytes>,
    /// Index of the first chunk not fully written.
    next: usize,
    remaining: u64,
}

impl OutgoingFrame {
    /// Prepares `frame` for sending, checking it against `limits`.
    pub fn new(frame: Frame, limits: &WireLimits) -> Result<Self, WireError> {
        let preamble = encode_preamble(&frame, limits)?;
        let mut chunks = Vec::with_capacity(2 + frame.payloads.len());
        chunks.push(preamble);
        chunks.push(frame.header);
        chunks.extend(frame.payloads);
        chunks.retain(|c| !c.is_empty());
        let remaining = chunks.iter().map(|c| c.len() as u64).sum();
        Ok(OutgoingFrame {
            chunks,
            next: 0,
            remaining,
        })
    }

    /// Bytes still to write.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Whether everything has been written.
    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// Fills `dst` with slices of what remains to be written, in order; returns how many it
    /// filled. Pass them to one vectored write, then call [`advance`](Self::advance).
    pub fn io_slices<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        for (slot, chunk) in dst.iter_mut().zip(&self.chunks[self.next..]) {
            *slot = IoSlice::new(chunk);
            n += 1;
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
            let chunk = &mut self.chunks[self.next];
            let step = n.min(chunk.len());
            chunk.advance(step);
            n -= step;
            if chunk.is_empty() {
                self.next += 1;
            }
        }
    }

    /// The chunks still to write, for transports that take owned buffers (QUIC streams).
    pub fn into_chunks(mut self) -> Vec<Bytes> {
        self.chunks.drain(..self.next);
        self.chunks
    }
}

/// Fields of a validated prefix.
#[derive(Debug, Clone, Copy)]
struct Prefix {
    kind: FrameKind,
    table_len: u32,
    body_len: u64,
}

fn parse_prefix(buf: &[u8; PREFIX_LEN], limits: &WireLimits) -> Result<Prefix, WireError> {
    let mut b = &buf[..];
    let mut magic = [0u8; 4];
    b.copy_to_slice(&mut magic);
    if magic != MAGIC {
        return Err(WireError::BadMagic { found: magic });
    }
    let version = b.get_u8();
    if version != VERSION {
        return Err(WireError::UnknownVersion { found: version });
    }
    let kind_byte = b.get_u8();
    let kind =
        FrameKind::from_wire(kind_byte).ok_or(WireError::UnknownKind { found: kind_byte })?;
    let reserved = b.get_u16_le();
    let table_len = b.get_u32_le();
    let body_len = b.get_u64_le();
    if reserved != 0 {
        return Err(WireError::MalformedHeader {
            reason: format!("reserved prefix field is {reserved:#06x}, must be 0"),
        });
    }
    if body_len > limits.max_frame_len {
        return Err(WireError::FrameTooLarge {
            len: body_len,
            max: limits.max_frame_len,
        });
    }
    if table_len > limits.max_frame_header_len {
        return Err(WireError::FrameHeaderTooLarge {
            len: u64::from(table_len),
            max: limits.max_frame_header_len,
        });
    }
    if table_len == 0 {
        return Err(WireError::MalformedHeader {
            reason: "frame header length is 0".to_owned(),
        });
    }
    if u64::from(table_len) > body_len {
        return Err(WireError::MalformedHeader {
            reason: format!("frame header length {table_len} exceeds body length {body_len}"),
        });
    }
    Ok(Prefix {
        kind,
        table_len,
        body_len,
    })
}

/// Decodes and checks the frame header; returns the segment lengths (message header first).
fn parse_table(table: &[u8], prefix: &Prefix, limits: &WireLimits) -> Result<Vec<u64>, WireError> {
    let (header, rest): (FrameHeader, _) =
        postcard::take_from_bytes(table).map_err(|e| WireError::MalformedHeader {
            reason: format!("frame header does not decode: {e}"),
        })?;
    if !rest.is_empty() {
        return Err(WireError::MalformedHeader {
            reason: format!("{} trailing bytes after the frame header", rest.len()),
        });
    }
    if header.message_len > limits.max_message_header_len {
        return Err(WireError::MessageHeaderTooLarge {
            len: header.message_len,
            max: limits.max_message_header_len,
        });
    }
    let mut total = u64::from(prefix.table_len);
    for len in std::iter::once(&header.message_len).chain(&header.payload_lens) {
        total = total
            .checked_add(*len)
            .filter(|t| *t <= prefix.body_len)
            .ok_or_else(|| WireError::MalformedHeader {
                reason: format!(
                    "segment lengths add up to more than the body length {}",
                    prefix.body_len
                ),
            })?;
    }
    if total != prefix.body_len {
        return Err(WireError::MalformedHeader {
            reason: format!(
                "segment lengths add up to {total}, but the body length is {}",
                prefix.body_len
            ),
        });
    }
    let mut segments = Vec::with_capacity(1 + header.payload_lens.len());
    segments.push(header.message_len);
    segments.extend(header.payload_lens);
    Ok(segments)
}

#[derive(Debug)]
enum State {
    Prefix {
        buf: [u8; PREFIX_LEN],
        filled: usize,
    },
    Table {
        prefix: Prefix,
        buf: Vec<u8>,
    },
    Body {
        prefix: Prefix,
        /// Lengths of the segments: message header, then payloads. All validated.
        segments: Vec<u64>,
        /// Completed segments.
        done: Vec<Bytes>,
        /// The segment being filled, once started. Capacity reserved only after validation,
        /// and only as data arrives (see [`GROWTH_STEP`]), unless a free pooled buffer fits.
        current: Option<BytesMut>,
        /// Whether `current` is a pooled buffer (else it joins the pool once complete).
        pooled: bool,
        /// Bytes of the completed segments (for truncation reports).
        received: u64,
    },
    Failed(WireError),
}

/// An incremental, bounded frame decoder (sans-IO).
///
/// Feed it what arrives with [`decode`](Self::decode); it returns each frame once complete.
/// While it waits for a large segment, [`direct_read_buf`](Self::direct_read_buf) exposes the
/// segment's final buffer so a transport can read into it without an intermediate copy. At end
/// of input, [`finish`](Self::finish) says whether a frame was cut off. After an error the
/// decoder stays failed and repeats that error: the stream cannot be resynchronised.
#[derive(Debug)]
pub struct FrameDecoder {
    limits: WireLimits,
    state: State,
    pool: BufferPool,
}

/// Segments at least this large get their buffers from the [`BufferPool`].
const POOL_MIN_SEGMENT: usize = 64 << 10;
/// A fresh segment buffer starts with room for at most this many bytes and at least doubles
/// (never past the segment's length) each time it fills: a peer that announces a large
/// segment and then sends little makes the receiver hold about twice what it sent, not what
/// it announced.
pub const GROWTH_STEP: usize = 1 << 20;
/// At most this many buffers are kept for reuse.
const POOL_MAX_BUFFERS: usize = 8;
/// Default for [`FrameDecoder::with_buffer_reuse`].
pub const DEFAULT_BUFFER_REUSE: usize = 128 << 20;

/// Large segment buffers kept for reuse.
///
/// A payload buffer is handed out frozen inside the frame; once the application drops every
/// [`Bytes`] of it, the pool's handle is the only one left and the allocation can be reused for
/// the next large segment without asking the allocator (which for large sizes means fresh,
/// zeroed pages from the kernel and a page fault per 4 KiB: half the throughput of a
/// 64 MiB transfer on loopback).
#[derive(Debug)]
struct BufferPool {
    /// Empty handles on pooled allocations, with their capacities.
    handles: Vec<(BytesMut, usize)>,
    /// Most bytes kept for reuse.
    budget: usize,
}

impl BufferPool {
    fn pooled(&self) -> usize {
        self.handles.iter().map(|(_, cap)| cap).sum()
    }

    /// An empty buffer for a segment of `len` bytes, and whether it is pooled: a free pooled
    /// allocation that fits (already ours), else a fresh one with room for at most
    /// [`GROWTH_STEP`] bytes, grown by [`grow`] as data arrives.
    fn take(&mut self, len: usize) -> (BytesMut, bool) {
        if (POOL_MIN_SEGMENT..=self.budget).contains(&len) {
            for (handle, cap) in &mut self.handles {
                // Succeeds only when no frame uses the allocation any more.
                if *cap >= len && handle.try_reclaim(len) {
                    return (handle.split_off(0), true);
                }
            }
        }
        (BytesMut::with_capacity(len.min(GROWTH_STEP)), false)
    }

    /// A fresh segment, now complete: kept for reuse (once every frame using it is dropped)
    /// if it is of a pooled size.
    fn adopt(&mut self, segment: BytesMut) -> BytesMut {
        let cap = segment.capacity();
        if segment.len() < POOL_MIN_SEGMENT || cap > self.budget {
            return segment;
        }
        while !self.handles.is_empty()
            && (self.pooled() + cap > self.budget || self.handles.len() >= POOL_MAX_BUFFERS)
        {
            // Forget the oldest; frames still using it keep it alive until they are dropped.
            self.handles.remove(0);
        }
        let mut handle = segment;
        let buf = handle.split_off(0);
        self.handles.push((handle, cap));
        buf
    }
}

/// Makes room in `cur` (a segment of `len` bytes being filled) for at least one more byte
/// when it is full: at least doubles it, never past `len`.
fn grow(cur: &mut BytesMut, len: usize) {
    if cur.capacity() > cur.len() || cur.len() >= len {
        return;
    }
    let cap = cur
        .capacity()
        .max(GROWTH_STEP / 2)
        .saturating_mul(2)
        .min(len);
    let mut bigger = BytesMut::with_capacity(cap);
    bigger.extend_from_slice(cur);
    *cur = bigger;
}

impl FrameDecoder {
    /// A decoder that enforces `limits`.
    pub fn new(limits: WireLimits) -> Self {
        FrameDecoder {
            limits,
            state: State::Prefix {
                buf: [0; PREFIX_LEN],
                filled: 0,
            },
            pool: BufferPool {
                handles: Vec::new(),
                budget: DEFAULT_BUFFER_REUSE,
            },
        }
    }

    /// Keeps at most `bytes` of large payload buffers (64 KiB and up) for reuse once the frames
    /// that carried them are dropped ([`DEFAULT_BUFFER_REUSE`] by default; 0 turns reuse off).
    /// A steady stream of large tensors then costs no allocation and no page faults.
    pub fn with_buffer_reuse(mut self, bytes: usize) -> Self {
        self.pool.budget = bytes;
        self.pool.handles.clear();
        self
    }

    /// The limits this decoder enforces.
    pub fn limits(&self) -> &WireLimits {
        &self.limits
    }

    /// Whether part of a frame has been received but not the whole frame.
    pub fn is_mid_frame(&self) -> bool {
        !matches!(self.state, State::Prefix { filled: 0, .. })
    }

    /// Consumes bytes from the front of `src`, at most up to the end of the current frame, and
    /// returns the frame once it is complete. Bytes after the frame stay in `src`.
    ///
    /// Segments that `src` holds entirely are split off without copying.
    pub fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        let result = self.decode_inner(src);
        if let Err(e) = &result {
            self.state = State::Failed(e.clone());
        }
        result
    }

    fn decode_inner(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        loop {
            match &mut self.state {
                State::Failed(e) => return Err(e.clone()),
                State::Prefix { buf, filled } => {
                    let n = (PREFIX_LEN - *filled).min(src.len());
                    buf[*filled..*filled + n].copy_from_slice(&src[..n]);
                    src.advance(n);
                    *filled += n;
                    if *filled < PREFIX_LEN {
                        return Ok(None);
                    }
                    let prefix = parse_prefix(buf, &self.limits)?;
                    self.state = State::Table {
                        prefix,
                        // Validated against max_frame_header_len above.
                        buf: Vec::with_capacity(prefix.table_len as usize),
                    };
                }
                State::Table { prefix, buf } => {
                    let n = (prefix.table_len as usize - buf.len()).min(src.len());
                    buf.extend_from_slice(&src[..n]);
                    src.advance(n);
                    if buf.len() < prefix.table_len as usize {
                        return Ok(None);
                    }
                    let prefix = *prefix;
                    let segments = parse_table(buf, &prefix, &self.limits)?;
                    self.state = State::Body {
                        prefix,
                        done: Vec::with_capacity(segments.len()),
                        segments,
                        current: None,
                        pooled: false,
                        received: 0,
                    };
                }
                State::Body {
                    segments,
                    done,
                    current,
                    pooled,
                    received,
                    prefix,
                } => {
                    while done.len() < segments.len() {
                        // Segment lengths are bounded by max_frame_len, which the caller chose
                        // to be addressable; saturate rather than wrap on 32-bit targets.
                        let len = usize::try_from(segments[done.len()]).unwrap_or(usize::MAX);
                        match current {
                            None if len == 0 => done.push(Bytes::new()),
                            None if src.len() >= len => {
                                done.push(src.split_to(len).freeze());
                                *received += len as u64;
                            }
                            _ => {
                                let cur = current.get_or_insert_with(|| {
                                    let (buf, from_pool) = self.pool.take(len);
                                    *pooled = from_pool;
                                    buf
                                });
                                let mut n = (len - cur.len()).min(src.len());
                                while n > 0 {
                                    grow(cur, len);
                                    let k = n.min(cur.capacity() - cur.len());
                                    cur.extend_from_slice(&src[..k]);
                                    src.advance(k);
                                    n -= k;
                                }
                                if cur.len() < len {
                                    return Ok(None);
                                }
                                *received += len as u64;
                                let segment = current.take().unwrap_or_default();
                                let segment = if *pooled {
                                    segment
                                } else {
                                    self.pool.adopt(segment)
                                };
                                done.push(segment.freeze());
                            }
                        }
                    }
                    debug_assert_eq!(*received + u64::from(prefix.table_len), prefix.body_len);
                    let kind = prefix.kind;
                    let mut segs = std::mem::take(done).into_iter();
                    let header = segs.next().unwrap_or_default();
                    let frame = Frame {
                        kind,
                        header,
                        payloads: segs.collect(),
                    };
                    self.state = State::Prefix {
                        buf: [0; PREFIX_LEN],
                        filled: 0,
                    };
                    return Ok(Some(frame));
                }
            }
        }
    }

    /// When the decoder waits for at least `min` more bytes of one segment (a message header or
    /// payload), the segment's final buffer, limited to the bytes still missing. Read into it
    /// (e.g. with tokio's `read_buf`), then call [`decode`](Self::decode) (with an empty or
    /// the staging buffer) to pick up the progress.
    ///
    /// `None` while the prefix or frame header is being read, or fewer than `min` bytes remain.
    pub fn direct_read_buf(&mut self, min: usize) -> Option<Limit<&mut BytesMut>> {
        let State::Body {
            segments,
            done,
            current,
            pooled,
            ..
        } = &mut self.state
        else {
            return None;
        };
        let len = usize::try_from(*segments.get(done.len())?).unwrap_or(usize::MAX);
        let filled = current.as_ref().map_or(0, BytesMut::len);
        let missing = len - filled;
        if missing < min.max(1) {
            return None;
        }
        let cur = current.get_or_insert_with(|| {
            let (buf, from_pool) = self.pool.take(len);
            *pooled = from_pool;
            buf
        });
        grow(cur, len);
        Some(cur.limit(missing))
    }

    /// Bytes of the frame being received that have arrived so far (0 between frames).
    pub fn received(&self) -> u64 {
        match &self.finish() {
            Err(WireError::Truncated {
                part: "prefix",
                received,
                ..
            }) => *received,
            // The frame header's and the body's counts start after the prefix.
            Err(WireError::Truncated { received, .. }) => PREFIX_LEN as u64 + *received,
            _ => 0,
        }
    }

    /// Bytes reserved for the segment being received (0 between segments): about what has
    /// arrived of it, not what the peer announced (see [`GROWTH_STEP`]).
    pub fn reserved(&self) -> usize {
        match &self.state {
            State::Body {
                current: Some(c), ..
            } => c.capacity(),
            _ => 0,
        }
    }

    /// Gives up the connection's buffers (the segment being received and the pooled ones),
    /// for a connection that will read nothing more (its peer died or timed out): if a frame
    /// was cut off, the decoder then fails with what [`finish`](Self::finish) said.
    pub fn release(&mut self) {
        if let Err(e) = self.finish() {
            self.state = State::Failed(e);
        }
        self.pool.handles.clear();
    }

    /// Reports whether the input may end here: `Ok` between frames, [`WireError::Truncated`]
    /// in the middle of one (or the earlier error if the decoder failed).
    pub fn finish(&self) -> Result<(), WireError> {
        match &self.state {
            State::Failed(e) => Err(e.clone()),
            State::Prefix { filled: 0, .. } => Ok(()),
            State::Prefix { filled, .. } => Err(WireError::Truncated {
                part: "prefix",
                received: *filled as u64,
                expected: PREFIX_LEN as u64,
            }),
            State::Table { prefix, buf } => Err(WireError::Truncated {
                part: "frame header",
                received: buf.len() as u64,
                expected: u64::from(prefix.table_len),
            }),
            State::Body {
                prefix,
                current,
                received,
                ..
            } => {
                let partial = current.as_ref().map_or(0, |c| c.len() as u64);
                Err(WireError::Truncated {
                    part: "body",
                    received: u64::from(prefix.table_len) + *received + partial,
                    expected: prefix.body_len,
                })
            }
        }
    }
}

/// Decodes one frame from the front of `input`; returns it and the number of bytes it took.
/// Input that ends before the frame does gives [`WireError::Truncated`].
pub fn decode_frame(input: &[u8], limits: &WireLimits) -> Result<(Frame, usize), WireError> {
    let mut src = BytesMut::from(input);
    let mut decoder = FrameDecoder::new(*limits);
    match decoder.decode(&mut src)? {
        Some(frame) => Ok((frame, input.len() - src.len())),
        None => {
            decoder.finish()?;
            // finish() is Ok only between frames, i.e. for empty input.
            Err(WireError::Truncated {
                part: "prefix",
                received: 0,
                expected: PREFIX_LEN as u64,
            })
        }
    }
}

/// Decodes one frame from the front of `input` without copying: the message header and payloads
/// are slices of `input`. For a transport that receives a whole frame in one buffer it owns (the
/// shared-memory transport's sealed segments); returns the frame and the number of bytes it took.
/// Input that ends before the frame does gives [`WireError::Truncated`].
pub fn decode_frame_shared(
    input: &Bytes,
    limits: &WireLimits,
) -> Result<(Frame, usize), WireError> {
    let Some(prefix) = input.get(..PREFIX_LEN) else {
        return Err(WireError::Truncated {
            part: "prefix",
            received: input.len() as u64,
            expected: PREFIX_LEN as u64,
        });
    };
    let mut buf = [0u8; PREFIX_LEN];
    buf.copy_from_slice(prefix);
    let prefix = parse_prefix(&buf, limits)?;
    let body = &input[PREFIX_LEN..];
    // Both validated against the limits, which fit in memory; saturate on 32-bit targets.
    let table_len = prefix.table_len as usize;
    let body_len = usize::try_from(prefix.body_len).unwrap_or(usize::MAX);
    if body.len() < body_len {
        let part = if body.len() < table_len {
            "frame header"
        } else {
            "body"
        };
        let (received, expected) = if part == "body" {
            (body.len() as u64, prefix.body_len)
        } else {
            (body.len() as u64, u64::from(prefix.table_len))
        };
        return Err(WireError::Truncated {
            part,
            received,
            expected,
        });
    }
    let segments = parse_table(&body[..table_len], &prefix, limits)?;
    let mut at = PREFIX_LEN + table_len;
    let mut parts = segments.into_iter().map(|len| {
        // parse_table checked that the lengths add up to body_len, which `input` holds.
        let len = len as usize;
        let part = input.slice(at..at + len);
        at += len;
        part
    });
    let header = parts.next().unwrap_or_default();
    let payloads = parts.collect();
    Ok((
        Frame {
            kind: prefix.kind,
            header,
            payloads,
        },
        PREFIX_LEN + body_len,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame_strategy() -> impl Strategy<Value = Frame> {
        (
            1u8..=3,
            proptest::collection::vec(any::<u8>(), 0..64),
            proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..6),
        )
            .prop_map(|(kind, header, payloads)| Frame {
                kind: FrameKind::from_wire(kind).expect("1 to 3 are kinds"),
                header: Bytes::from(header),
                payloads: payloads.into_iter().map(Bytes::from).collect(),
            })
    }

    fn prefix(kind: u8, table_len: u32, body_len: u64) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&MAGIC);
        v.push(VERSION);
        v.push(kind);
        v.extend_from_slice(&0u16.to_le_bytes());
        v.extend_from_slice(&table_len.to_le_bytes());
        v.extend_from_slice(&body_len.to_le_bytes());
        v
    }

    proptest! {
        #[test]
        fn round_trip_in_one_piece(frames in proptest::collection::vec(frame_strategy(), 1..5)) {
            let limits = WireLimits::default();
            let mut wire = BytesMut::new();
            for f in &frames {
                wire.extend_from_slice(&encode_to_vec(f, &limits).unwrap());
            }
            let mut dec = FrameDecoder::new(limits);
            for f in &frames {
                prop_assert_eq!(dec.decode(&mut wire).unwrap(), Some(f.clone()));
            }
            prop_assert!(wire.is_empty());
            prop_assert!(dec.finish().is_ok());
        }

        #[test]
        fn round_trip_in_pieces(
            frames in proptest::collection::vec(frame_strategy(), 1..4),
            cuts in proptest::collection::vec(1usize..50, 1..200),
            direct in any::<bool>(),
        ) {
            let limits = WireLimits::default();
            let mut wire = Vec::new();
            for f in &frames {
                wire.extend_from_slice(&encode_to_vec(f, &limits).unwrap());
            }
            let mut dec = FrameDecoder::new(limits);
            let mut got = Vec::new();
            let mut pos = 0;
            let mut cut = cuts.iter().cycle();
            let mut staging = BytesMut::new();
            while pos < wire.len() {
                let n = (*cut.next().unwrap()).min(wire.len() - pos);
                if direct {
                    if let Some(mut buf) = dec.direct_read_buf(1) {
                        let n = n.min(buf.remaining_mut());
                        buf.put_slice(&wire[pos..pos + n]);
                        pos += n;
                        if let Some(f) = dec.decode(&mut staging).unwrap() {
                            got.push(f);
                        }
                        continue;
                    }
                }
                staging.extend_from_slice(&wire[pos..pos + n]);
                pos += n;
                while let Some(f) = dec.decode(&mut staging).unwrap() {
                    got.push(f);
                }
            }
            prop_assert_eq!(got, frames);
            prop_assert!(dec.finish().is_ok());
        }

        #[test]
        fn arbitrary_input_never_panics(input in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_frame(&input, &WireLimits::default());
        }

        #[test]
        fn arbitrary_input_after_a_valid_prefix_never_panics(
            table_len in 0u32..100, body_len in 0u64..1000,
            rest in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut input = prefix(1, table_len, body_len);
            input.extend_from_slice(&rest);
            let _ = decode_frame(&input, &WireLimits::default());
        }

        #[test]
        fn every_strict_prefix_is_truncated(f in frame_strategy(), cut in any::<prop::sample::Index>()) {
            let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
            let cut = cut.index(wire.len());
            let err = decode_frame(&wire[..cut], &WireLimits::default()).unwrap_err();
            prop_assert!(matches!(err, WireError::Truncated { .. }), "{err}");
        }
    }

    #[test]
    fn debug_shows_lengths_not_contents() {
        let f = Frame::message(&b"secret-ish"[..], vec![Bytes::from(vec![0u8; 1000])]);
        let text = format!("{f:?}");
        assert_eq!(
            text,
            "Frame { kind: Message, header: 10 bytes, payloads: [1000 bytes] }"
        );
    }

    #[test]
    fn empty_frame_round_trips() {
        let f = Frame::message(Bytes::new(), vec![]);
        let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
        assert_eq!(
            decode_frame(&wire, &WireLimits::default()).unwrap(),
            (f, wire.len())
        );
    }

    #[test]
    fn bad_magic_is_refused() {
        let mut wire =
            encode_to_vec(&Frame::message(&b"x"[..], vec![]), &WireLimits::default()).unwrap();
        wire[0] = b'X';
        let err = decode_frame(&wire, &WireLimits::default()).unwrap_err();
        assert!(
            matches!(err, WireError::BadMagic { found } if found == *b"XWFR"),
            "{err}"
        );
    }

    #[test]
    fn unknown_version_is_refused() {
        let mut wire = prefix(1, 2, 2);
        wire[4] = 9;
        let err = decode_frame(&wire, &WireLimits::default()).unwrap_err();
        assert_eq!(err, WireError::UnknownVersion { found: 9 });
        assert!(err.to_string().contains("version 9"));
    }

    #[test]
    fn unknown_kind_is_refused() {
        let err = decode_frame(&prefix(7, 2, 2), &WireLimits::default()).unwrap_err();
        assert_eq!(err, WireError::UnknownKind { found: 7 });
    }

    #[test]
    fn oversized_length_is_refused_before_anything_is_read() {
        // Claims u64::MAX bytes; no body follows. Must fail from the prefix alone.
        let mut dec = FrameDecoder::new(WireLimits::default());
        let err = dec
            .decode(&mut BytesMut::from(&prefix(1, 2, u64::MAX)[..]))
            .unwrap_err();
        assert_eq!(
            err,
            WireError::FrameTooLarge {
                len: u64::MAX,
                max: 1 << 30
            }
        );
        // The decoder stays failed.
        assert_eq!(dec.decode(&mut BytesMut::new()).unwrap_err(), err);
        assert_eq!(dec.finish().unwrap_err(), err);
    }

    #[test]
    fn configured_limit_applies_to_sender_and_receiver() {
        let small = WireLimits::default().with_max_frame_len(100);
        let f = Frame::message(Bytes::new(), vec![Bytes::from(vec![0u8; 200])]);
        assert!(matches!(
            encode_preamble(&f, &small),
            Err(WireError::FrameTooLarge { max: 100, .. })
        ));
        let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
        assert!(matches!(
            decode_frame(&wire, &small),
            Err(WireError::FrameTooLarge { max: 100, .. })
        ));
    }

    #[test]
    fn oversized_frame_header_is_refused() {
        let err = decode_frame(&prefix(1, 1 << 20, 1 << 21), &WireLimits::default()).unwrap_err();
        assert!(
            matches!(err, WireError::FrameHeaderTooLarge { len: 1_048_576, .. }),
            "{err}"
        );
        let many = Frame::message(Bytes::new(), vec![Bytes::new(); 100]);
        let tight = WireLimits::default().with_max_frame_header_len(10);
        assert!(matches!(
            encode_preamble(&many, &tight),
            Err(WireError::FrameHeaderTooLarge { max: 10, .. })
        ));
    }

    #[test]
    fn oversized_message_header_is_refused() {
        let f = Frame::message(vec![1u8; 50], vec![]);
        let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
        let tight = WireLimits::default().with_max_message_header_len(10);
        assert!(matches!(
            decode_frame(&wire, &tight),
            Err(WireError::MessageHeaderTooLarge { len: 50, max: 10 })
        ));
        assert!(encode_preamble(&f, &tight).is_err());
    }

    #[test]
    fn malformed_frame_headers_are_refused() {
        let limits = WireLimits::default();
        // Lengths that do not add up to the body length.
        let table = postcard::to_allocvec(&FrameHeader {
            message_len: 3,
            payload_lens: vec![5],
        })
        .unwrap();
        let mut wire = prefix(1, table.len() as u32, table.len() as u64 + 7);
        wire.extend_from_slice(&table);
        let err = decode_frame(&wire, &limits).unwrap_err();
        assert!(
            matches!(err, WireError::MalformedHeader { ref reason } if reason.contains("add up to")),
            "{err}"
        );
        // Lengths that overflow u64.
        let table = postcard::to_allocvec(&FrameHeader {
            message_len: u64::MAX,
            payload_lens: vec![u64::MAX],
        })
        .unwrap();
        let mut wire = prefix(1, table.len() as u32, 1000);
        wire.extend_from_slice(&table);
        let limits_big = limits.with_max_message_header_len(u64::MAX);
        assert!(matches!(
            decode_frame(&wire, &limits_big),
            Err(WireError::MalformedHeader { .. })
        ));
        // A frame header that is not postcard: a varint that never ends.
        let mut wire = prefix(1, 4, 4);
        wire.extend_from_slice(&[0xff; 4]);
        assert!(matches!(
            decode_frame(&wire, &limits),
            Err(WireError::MalformedHeader { .. })
        ));
        // Trailing bytes inside the frame header.
        let mut wire = prefix(1, 3, 3);
        wire.extend_from_slice(&[0, 0, 0]);
        let err = decode_frame(&wire, &limits).unwrap_err();
        assert!(
            matches!(err, WireError::MalformedHeader { ref reason } if reason.contains("trailing")),
            "{err}"
        );
        // Reserved bits, empty and inconsistent frame-header lengths.
        let mut wire = prefix(1, 2, 2);
        wire[6] = 1;
        assert!(matches!(
            decode_frame(&wire, &limits),
            Err(WireError::MalformedHeader { .. })
        ));
        assert!(matches!(
            decode_frame(&prefix(1, 0, 0), &limits),
            Err(WireError::MalformedHeader { .. })
        ));
        assert!(matches!(
            decode_frame(&prefix(1, 9, 3), &limits),
            Err(WireError::MalformedHeader { .. })
        ));
    }

    #[test]
    fn a_claimed_payload_count_does_not_allocate() {
        // A frame header claiming 2^60 payloads in a few bytes: postcard must not pre-allocate.
        let mut table = vec![0u8]; // message_len = 0
        table.extend_from_slice(&[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x10]);
        let mut wire = prefix(1, table.len() as u32, table.len() as u64);
        wire.extend_from_slice(&table);
        assert!(matches!(
            decode_frame(&wire, &WireLimits::default()),
            Err(WireError::MalformedHeader { .. })
        ));
    }

    #[test]
    fn truncation_reports_the_part() {
        let f = Frame::message(&b"hello"[..], vec![Bytes::from_static(b"world")]);
        let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
        let err = decode_frame(&wire[..5], &WireLimits::default()).unwrap_err();
        assert_eq!(
            err,
            WireError::Truncated {
                part: "prefix",
                received: 5,
                expected: 20
            }
        );
        let err = decode_frame(&wire[..wire.len() - 1], &WireLimits::default()).unwrap_err();
        assert!(
            matches!(err, WireError::Truncated { part: "body", .. }),
            "{err}"
        );
        let err = decode_frame(&[], &WireLimits::default()).unwrap_err();
        assert!(matches!(
            err,
            WireError::Truncated {
                part: "prefix",
                received: 0,
                ..
            }
        ));
    }

    #[test]
    fn outgoing_frame_survives_partial_writes() {
        let f = Frame::message(
            &b"abc"[..],
            vec![Bytes::from_static(b"defgh"), Bytes::new()],
        );
        let whole = encode_to_vec(&f, &WireLimits::default()).unwrap();
        let mut out = OutgoingFrame::new(f, &WireLimits::default()).unwrap();
        assert_eq!(out.remaining(), whole.len() as u64);
        let mut written = Vec::new();
        while !out.is_done() {
            let mut slices = [IoSlice::new(&[]); 4];
            let n = out.io_slices(&mut slices);
            // A writer that takes at most 3 bytes per call.
            let mut took = 0;
            for s in &slices[..n] {
                let k = s.len().min(3 - took);
                written.extend_from_slice(&s[..k]);
                took += k;
                if took == 3 {
                    break;
                }
            }
            out.advance(took);
        }
        assert_eq!(written, whole);
    }

    /// A peer announces a 1 GiB payload and sends 3 MiB: the receiver holds about what
    /// arrived, whichever way it reads, and gives it up when told the peer is gone.
    #[test]
    fn an_announced_length_is_not_reserved_up_front() {
        let limits = WireLimits::default();
        let big: u64 = (1 << 30) - 64;
        let table = postcard::to_allocvec(&FrameHeader {
            message_len: 0,
            payload_lens: vec![big],
        })
        .unwrap();
        let mut preamble = prefix(1, table.len() as u32, table.len() as u64 + big);
        preamble.extend_from_slice(&table);
        for direct in [false, true] {
            let mut dec = FrameDecoder::new(limits);
            let mut src = BytesMut::from(&preamble[..]);
            assert_eq!(dec.decode(&mut src).unwrap(), None);
            let mut sent = 0usize;
            while sent < 3 << 20 {
                let chunk = [7u8; 64 << 10];
                if direct {
                    let mut buf = dec.direct_read_buf(1).unwrap();
                    let k = chunk.len().min(buf.remaining_mut());
                    buf.put_slice(&chunk[..k]);
                    sent += k;
                    assert_eq!(dec.decode(&mut BytesMut::new()).unwrap(), None);
                } else {
                    let mut src = BytesMut::from(&chunk[..]);
                    assert_eq!(dec.decode(&mut src).unwrap(), None);
                    sent += chunk.len();
                }
                assert!(
                    dec.reserved() <= 2 * sent + GROWTH_STEP,
                    "{} bytes reserved after {sent} arrived (direct: {direct})",
                    dec.reserved()
                );
            }
            dec.release();
            assert_eq!(dec.reserved(), 0);
            assert!(matches!(
                dec.decode(&mut BytesMut::new()),
                Err(WireError::Truncated { part: "body", .. })
            ));
        }
    }

    #[test]
    fn large_buffers_are_reused_once_dropped() {
        let limits = WireLimits::default();
        let frame = Frame::message(Bytes::new(), vec![Bytes::from(vec![5u8; 1 << 20])]);
        let wire = encode_to_vec(&frame, &limits).unwrap();
        let mut dec = FrameDecoder::new(limits);
        let receive = |dec: &mut FrameDecoder| {
            // Force the pooled path: the payload arrives through direct reads.
            let mut staging = BytesMut::from(&wire[..100]);
            assert_eq!(dec.decode(&mut staging).unwrap(), None);
            let mut buf = dec.direct_read_buf(1).unwrap();
            buf.put_slice(&wire[100..]);
            dec.decode(&mut staging).unwrap().unwrap()
        };
        let first = receive(&mut dec);
        let first_ptr = first.payloads[0].as_ptr();
        // Still in use: a new buffer.
        let second = receive(&mut dec);
        assert_ne!(second.payloads[0].as_ptr(), first_ptr);
        assert_eq!(second, frame);
        drop(first);
        // Dropped: its allocation comes back.
        let third = receive(&mut dec);
        assert_eq!(third.payloads[0].as_ptr(), first_ptr);
        assert_eq!(third, frame);
        // Reuse off: still correct.
        let mut dec = FrameDecoder::new(limits).with_buffer_reuse(0);
        assert_eq!(receive(&mut dec), frame);
        assert_eq!(receive(&mut dec), frame);
    }

    #[test]
    fn direct_reads_land_in_the_final_buffer() {
        let payload = Bytes::from(vec![9u8; 10_000]);
        let f = Frame::message(&b"h"[..], vec![payload.clone()]);
        let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
        let mut dec = FrameDecoder::new(WireLimits::default());
        // Prefix, frame header, message header and 100 payload bytes arrive together.
        let first = wire.len() - 9_900;
        let mut staging = BytesMut::from(&wire[..first]);
        assert_eq!(dec.decode(&mut staging).unwrap(), None);
        assert!(dec.direct_read_buf(20_000).is_none());
        let mut buf = dec.direct_read_buf(1024).expect("waiting for the payload");
        assert_eq!(buf.remaining_mut(), 9_900);
        buf.put_slice(&wire[first..]);
        let got = dec.decode(&mut staging).unwrap().unwrap();
        assert_eq!(got, f);
        assert!(!dec.is_mid_frame());
    }

    proptest! {
        #[test]
        fn shared_decoding_matches_the_decoder(frame in frame_strategy(), cut in any::<prop::sample::Index>()) {
            let limits = WireLimits::default();
            let mut wire = encode_to_vec(&frame, &limits).unwrap();
            wire.extend_from_slice(b"next");
            let input = Bytes::from(wire.clone());
            let (got, used) = decode_frame_shared(&input, &limits).unwrap();
            prop_assert_eq!(&got, &frame);
            prop_assert_eq!(used, wire.len() - 4);
            // Any cut before the end of the frame is a truncation, never a panic.
            let cut = cut.index(used);
            let short = input.slice(..cut);
            let truncated = matches!(
                decode_frame_shared(&short, &limits),
                Err(WireError::Truncated { .. })
            );
            prop_assert!(truncated);
        }

        #[test]
        fn shared_decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_frame_shared(&Bytes::from(bytes), &WireLimits::default());
        }
    }
}
