//! Receiving: the incremental, bounded [`FrameDecoder`] and the one-shot decoders.

use bytes::buf::Limit;
use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{Frame, FrameKind, Payloads, WireError, WireLimits, MAGIC, PREFIX_LEN, VERSION};

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

/// Takes one postcard varint (LEB128, at most 10 bytes, the last one at most 1: 64 bits) from
/// the front of `table`, as postcard decodes a `u64` and a sequence's length; `None` if it is
/// cut off or too long.
fn take_varint(table: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for i in 0..10 {
        let (&byte, rest) = table.split_first()?;
        *table = rest;
        if i == 9 && byte > 1 {
            return None;
        }
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// Decodes the frame header (postcard's `FrameHeader`: the message header's length, then the
/// payloads' lengths as a sequence) into `segments`, message header first, without a list of
/// its own (a frame allocates none for its header; postcard would, for the sequence).
pub(super) fn decode_table(mut table: &[u8], segments: &mut Vec<u64>) -> Result<(), WireError> {
    let bad = |what: &str| WireError::MalformedHeader {
        reason: format!("frame header does not decode: {what}"),
    };
    segments.clear();
    let message_len = take_varint(&mut table).ok_or_else(|| bad("the message header's length"))?;
    let count = take_varint(&mut table).ok_or_else(|| bad("the number of payloads"))?;
    // Each length takes at least a byte: a count past what is left cannot be right (and
    // reserves nothing).
    if count > table.len() as u64 {
        return Err(bad("more payloads than bytes left"));
    }
    segments.reserve(1 + count as usize);
    segments.push(message_len);
    for _ in 0..count {
        segments.push(take_varint(&mut table).ok_or_else(|| bad("a payload's length"))?);
    }
    if !table.is_empty() {
        return Err(WireError::MalformedHeader {
            reason: format!("{} trailing bytes after the frame header", table.len()),
        });
    }
    Ok(())
}

/// Decodes and checks the frame header; the segment lengths (message header first) go into
/// `segments` (emptied first; a decoder passes the list of its last frame).
fn parse_table(
    table: &[u8],
    prefix: &Prefix,
    limits: &WireLimits,
    mut segments: Vec<u64>,
) -> Result<Vec<u64>, WireError> {
    decode_table(table, &mut segments)?;
    let message_len = segments[0];
    if message_len > limits.max_message_header_len {
        return Err(WireError::MessageHeaderTooLarge {
            len: message_len,
            max: limits.max_message_header_len,
        });
    }
    let mut total = u64::from(prefix.table_len);
    for len in &segments {
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
        done: Done,
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

impl State {
    /// The state that reads the body of a frame whose header is parsed.
    fn body(prefix: Prefix, segments: Vec<u64>) -> Self {
        State::Body {
            prefix,
            done: Done {
                header: None,
                // No list for one payload (the usual frame).
                payloads: Payloads::with_capacity(segments.len().saturating_sub(1)),
            },
            segments,
            current: None,
            pooled: false,
            received: 0,
        }
    }
}

/// The completed segments of the frame being received: its message header, then its payloads.
#[derive(Debug, Default)]
struct Done {
    header: Option<Bytes>,
    payloads: Payloads,
}

impl Done {
    fn len(&self) -> usize {
        usize::from(self.header.is_some()) + self.payloads.len()
    }

    fn is_empty(&self) -> bool {
        self.header.is_none()
    }

    fn push(&mut self, segment: Bytes) {
        if self.header.is_none() {
            self.header = Some(segment);
        } else {
            self.payloads.push(segment);
        }
    }
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
    /// The segment lengths' list of the last frame, emptied, for the next one.
    spare: Vec<u64>,
}

/// A decoder keeps its last frame's list of segment lengths for the next frame while it has
/// room for at most this many.
const KEPT_SEGMENT_LENGTHS: usize = 16;

/// Segments at least this large get their buffers from the [`BufferPool`].
const POOL_MIN_SEGMENT: usize = 64 << 10;
/// A fresh segment buffer starts with room for at most this many bytes and at least doubles
/// (never past the segment's length) each time it fills: a peer that announces a large
/// segment and then sends little makes the receiver hold about twice what it sent, not what
/// it announced.
pub const GROWTH_STEP: usize = 1 << 20;
/// At most this many buffers are kept for reuse.
const POOL_MAX_BUFFERS: usize = 8;
/// Payloads up to this size that `src` holds entirely are copied out rather than split off:
/// a split-off segment shares `src`'s allocation, and while the frame lives (the application
/// holds it as the transport reads the next one) `src` cannot grow in place, so every read
/// would allocate a fresh read buffer (64 KiB on TCP) for a frame of a few dozen bytes.
pub const COPY_SEGMENT_MAX: usize = 4 << 10;
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
            spare: Vec::new(),
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
    /// Segments that `src` holds entirely are split off without copying, but for payloads of
    /// [`COPY_SEGMENT_MAX`] bytes or fewer, which are copied so that `src` stays unshared
    /// while the application holds them. The message header is always split off: a holder
    /// decodes it and drops it before the next read (while one is held, `src` cannot make
    /// room in place and a read that needs room allocates a new buffer).
    pub fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        let result = self.decode_inner(src);
        if let Err(e) = &result {
            self.state = State::Failed(e.clone());
        }
        result
    }

    /// A frame with at most one payload that `src` holds whole, taken in one step (the usual
    /// message): the same checks and the same segments as the state machine's, without its
    /// states. `Ok(None)` leaves `src` as it was for the general way (part of a frame, or a
    /// frame with several payloads).
    fn decode_whole(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        let Some(head) = src.first_chunk::<PREFIX_LEN>() else {
            return Ok(None);
        };
        let prefix = parse_prefix(head, &self.limits)?;
        // Validated against the limits; saturate on 32-bit targets.
        let table_len = prefix.table_len as usize;
        let body_len = usize::try_from(prefix.body_len).unwrap_or(usize::MAX);
        if src.len() - PREFIX_LEN < body_len {
            return Ok(None);
        }
        let table = &src[PREFIX_LEN..PREFIX_LEN + table_len];
        let spare = std::mem::take(&mut self.spare);
        let segments = parse_table(table, &prefix, &self.limits, spare)?;
        let (header_len, payload_len) = match segments[..] {
            [header] => (header, None),
            [header, payload] => (header, Some(payload)),
            _ => {
                self.spare = segments;
                return Ok(None);
            }
        };
        self.spare = segments;
        // Each at most body_len (checked in parse_table), which `src` holds.
        let header_len = header_len as usize;
        src.advance(PREFIX_LEN + table_len);
        // Split off in place, as the state machine does (see `decode`).
        let header = if header_len == 0 {
            Bytes::new()
        } else {
            src.split_to(header_len).freeze()
        };
        let payloads = match payload_len.map(|len| len as usize) {
            None => Payloads::new(),
            Some(0) => Payloads::one(Bytes::new()),
            Some(len) if len <= COPY_SEGMENT_MAX => {
                let payload = Bytes::copy_from_slice(&src[..len]);
                src.advance(len);
                Payloads::one(payload)
            }
            Some(len) => Payloads::one(src.split_to(len).freeze()),
        };
        Ok(Some(Frame {
            kind: prefix.kind,
            header,
            payloads,
        }))
    }

    fn decode_inner(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        if let State::Prefix { filled: 0, .. } = self.state {
            if let Some(frame) = self.decode_whole(src)? {
                return Ok(Some(frame));
            }
        }
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
                    // Validated against max_frame_header_len above.
                    let table_len = prefix.table_len as usize;
                    if src.len() >= table_len {
                        // The whole frame header has arrived (the usual case): parsed where
                        // it lies, with no buffer of its own.
                        let spare = std::mem::take(&mut self.spare);
                        let segments =
                            parse_table(&src[..table_len], &prefix, &self.limits, spare)?;
                        src.advance(table_len);
                        self.state = State::body(prefix, segments);
                    } else {
                        self.state = State::Table {
                            prefix,
                            buf: Vec::with_capacity(table_len),
                        };
                    }
                }
                State::Table { prefix, buf } => {
                    let n = (prefix.table_len as usize - buf.len()).min(src.len());
                    buf.extend_from_slice(&src[..n]);
                    src.advance(n);
                    if buf.len() < prefix.table_len as usize {
                        return Ok(None);
                    }
                    let prefix = *prefix;
                    let spare = std::mem::take(&mut self.spare);
                    let segments = parse_table(buf, &prefix, &self.limits, spare)?;
                    self.state = State::body(prefix, segments);
                }
                State::Body {
                    segments,
                    done,
                    current,
                    pooled,
                    received,
                    prefix,
                } => {
                    if current.is_none() && done.is_empty() {
                        // The message header, when it has all arrived, is split off where it
                        // lies: no copy and no allocation (after `src`'s first split, which
                        // makes its buffer shared). Its holder decodes it and drops it before
                        // the transport reads again (the agent's node, the mesh's reader), so
                        // `src` then owns its buffer alone and grows in place, as it does
                        // under a copied header.
                        let len = usize::try_from(segments[0]).unwrap_or(usize::MAX);
                        if len == 0 {
                            done.push(Bytes::new());
                        } else if src.len() >= len {
                            done.push(src.split_to(len).freeze());
                            *received += len as u64;
                        }
                    }
                    if current.is_none() && done.len() + 1 < segments.len() {
                        // Small segments that have all arrived (a call's message header and
                        // its arguments) share one copy: one allocation instead of one each.
                        let rest = &segments[done.len()..];
                        // The lengths add up to at most the body's (checked in parse_table).
                        let total = usize::try_from(rest.iter().sum::<u64>()).unwrap_or(usize::MAX);
                        if total <= COPY_SEGMENT_MAX && total <= src.len() {
                            let all = Bytes::copy_from_slice(&src[..total]);
                            src.advance(total);
                            let mut at = 0;
                            for &len in rest {
                                // Each at most `total`, a usize.
                                let len = len as usize;
                                done.push(all.slice(at..at + len));
                                at += len;
                            }
                            *received += total as u64;
                        }
                    }
                    while done.len() < segments.len() {
                        // Segment lengths are bounded by max_frame_len, which the caller chose
                        // to be addressable; saturate rather than wrap on 32-bit targets.
                        let len = usize::try_from(segments[done.len()]).unwrap_or(usize::MAX);
                        match current {
                            None if len == 0 => done.push(Bytes::new()),
                            None if src.len() >= len && len <= COPY_SEGMENT_MAX => {
                                done.push(Bytes::copy_from_slice(&src[..len]));
                                src.advance(len);
                                *received += len as u64;
                            }
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
                    // The list of lengths serves the next frame (a few words, kept only
                    // while it is small).
                    let lengths = std::mem::take(segments);
                    if lengths.capacity() <= KEPT_SEGMENT_LENGTHS {
                        self.spare = lengths;
                    }
                    let Done { header, payloads } = std::mem::take(done);
                    let frame = Frame {
                        kind,
                        header: header.unwrap_or_default(),
                        payloads,
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
    let segments = parse_table(&body[..table_len], &prefix, limits, Vec::new())?;
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
