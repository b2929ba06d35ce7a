//! Sending: a frame's preamble, and the frame as slices for one vectored write.

use std::io::IoSlice;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{Frame, WireError, WireLimits, MAGIC, PREFIX_LEN, VERSION};

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
    // The frame header (`FrameHeader` in postcard: varints of the message length, the number
    // of payloads and each payload's length), written in place: no list of lengths and no
    // buffer of its own on every frame sent.
    let table_len = (varint_len(message_len)
        + varint_len(frame.payloads.len() as u64)
        + frame
            .payloads
            .iter()
            .map(|p| varint_len(p.len() as u64))
            .sum::<usize>()) as u64;
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
    // Fits: table_len <= max_frame_header_len, a u32.
    let mut out = BytesMut::with_capacity(PREFIX_LEN + table_len as usize);
    out.put_slice(&MAGIC);
    out.put_u8(VERSION);
    out.put_u8(frame.kind.to_wire());
    out.put_u16_le(0);
    out.put_u32_le(table_len as u32);
    out.put_u64_le(body_len);
    put_varint(&mut out, message_len);
    put_varint(&mut out, frame.payloads.len() as u64);
    for p in &frame.payloads {
        put_varint(&mut out, p.len() as u64);
    }
    Ok(out.freeze())
}

/// The bytes of `v` as a postcard varint (LEB128: seven bits a byte, low bits first).
fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// Writes `v` as a postcard varint ([`varint_len`] bytes).
pub(super) fn put_varint(out: &mut BytesMut, mut v: u64) {
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
