//! The frame format: what every transport puts on the wire.
//!
//! A [`Frame`] is an opaque *message header* (bytes that higher layers encode with postcard) and
//! zero or more *payloads* (raw tensor bytes, never re-encoded). On the wire a frame is:
//!
//! ```text
//! prefix (20 bytes, fixed)                 frame header (postcard)       body
//! +-------+---------+------+----------+-------------+------------+------------------+-----------------+---------+-----+
//! | magic | version | kind | reserved | table_len   | body_len   | message_len,     | message header  | payload | ... |
//! | TWFR  | u8 = 3  | u8   | u16 = 0  | u32 LE      | u64 LE     | payload lengths  | (opaque bytes)  | 0       |     |
//! +-------+---------+------+----------+-------------+------------+------------------+-----------------+---------+-----+
//! ```
//!
//! `table_len` is the length of the postcard-encoded frame header; `body_len` counts everything
//! after the prefix (frame header, message header and payloads), so a receiver can refuse a frame
//! that is too large before it reads anything else.
//!
//! Sending is sans-IO and copy-free: [`OutgoingFrame`] holds the preamble (prefix + frame header,
//! produced by [`encode_preamble`]) next to the message header and payload [`Bytes`], and hands
//! them out as [`IoSlice`](std::io::IoSlice)s for one vectored write (or as chunks for a QUIC stream).
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

use bytes::Bytes;
#[cfg(test)]
use serde::{Deserialize, Serialize};

mod decode;
mod encode;
mod error;
mod payloads;
#[cfg(test)]
mod tests;

pub use decode::{
    decode_frame, decode_frame_shared, FrameDecoder, COPY_SEGMENT_MAX, DEFAULT_BUFFER_REUSE,
    GROWTH_STEP,
};
pub use encode::{
    bytes_in, encode_preamble, encode_to_vec, exact_bytes, OutgoingFrame, Preamble, EXACT_COPY_MAX,
    ROOM_CHUNK, ROOM_MAX,
};
pub(crate) use encode::{put_varint, varint_len, written_in};
pub use error::{MeshFrameError, WireError};
pub use payloads::{Payloads, PayloadsIntoIter};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"TWFR";

/// The wire version this build writes and reads. A peer of another version is refused at its
/// first frame ([`WireError::UnknownVersion`]), so builds whose messages differ never misread
/// each other. 2: a fetch and a method call name the caller's fork of the reference. 3: a
/// reference's capability travels in its creation, in each fork passed on and in each fork
/// request ([`crate::protocol::RRefSecret`]). 4: a process group's disagreement notice names
/// its group ([`crate::protocol::mesh::GroupFrame::Disagreement`]), a gather's answer can
/// refuse a value beyond its sender's own share
/// ([`crate::protocol::gather::GatherError::MemberTooManyRounds`]), and a distributed autograd
/// forward call and its answer say which tensors required grad on their sender. 5: a request's
/// envelope announces the references passed in its arguments
/// ([`crate::protocol::envelope::Envelope::forks`]), so that their owner holds them from the
/// request's arrival. 6: a process group may report a failed stage of a collective across hosts
/// ([`crate::protocol::mesh::GroupFrame::StageFailed`]).
pub const VERSION: u8 = 6;

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
    /// Tensor payloads as raw bytes; never re-encoded. One is held in place, with no list.
    pub payloads: Payloads,
}

/// A length shown as "N bytes" in a `Debug` view (a frame's parts show their lengths, not their
/// contents: payloads can be gigabytes).
pub(crate) struct ByteLen(pub(crate) usize);

impl std::fmt::Debug for ByteLen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0)
    }
}

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frame")
            .field("kind", &self.kind)
            .field("header", &ByteLen(self.header.len()))
            .field("payloads", &self.payloads)
            .finish()
    }
}

impl Frame {
    /// A [`FrameKind::Message`] frame.
    pub fn message(header: impl Into<Bytes>, payloads: impl Into<Payloads>) -> Self {
        Frame {
            kind: FrameKind::Message,
            header: header.into(),
            payloads: payloads.into(),
        }
    }

    /// A [`FrameKind::Control`] frame.
    pub fn control(header: impl Into<Bytes>, payloads: impl Into<Payloads>) -> Self {
        Frame {
            kind: FrameKind::Control,
            header: header.into(),
            payloads: payloads.into(),
        }
    }

    /// A [`FrameKind::Collective`] frame.
    pub fn collective(header: impl Into<Bytes>, payloads: impl Into<Payloads>) -> Self {
        Frame {
            kind: FrameKind::Collective,
            header: header.into(),
            payloads: payloads.into(),
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

/// The postcard-encoded frame header: the lengths of the segments that follow it. Written and
/// read by hand (`encode_preamble`, `decode::decode_table`); the tests hold both to postcard.
#[cfg(test)]
#[derive(Debug, Serialize, Deserialize)]
struct FrameHeader {
    message_len: u64,
    payload_lens: Vec<u64>,
}
