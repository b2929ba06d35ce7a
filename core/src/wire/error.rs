//! What can be wrong with a frame.

use super::FrameKind;
#[cfg(doc)]
use super::WireLimits;
use super::{MAGIC, VERSION};

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

/// Why a frame is not the mesh frame it should be (its header is a value of
/// `protocol::mesh`, decoded there; the error lives here, below both `protocol` and
/// `collective`, which name it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MeshFrameError {
    /// A frame of another kind where this one was due.
    #[error("its {what} is a {kind:?} frame, not a {expected:?} frame")]
    WrongKind {
        /// What was due.
        what: &'static str,
        /// The kind that came.
        kind: FrameKind,
        /// The kind that was due.
        expected: FrameKind,
    },
    /// The header does not parse.
    #[error("its {what} is malformed ({reason})")]
    Malformed {
        /// What was due.
        what: &'static str,
        /// The decoder's words.
        reason: String,
    },
    /// Bytes after the value.
    #[error("its {what} has {extra} bytes after its end")]
    Trailing {
        /// What was due.
        what: &'static str,
        /// How many.
        extra: usize,
    },
    /// A disagreement notice with a signature that no collective produces.
    #[error("its {what} carries a malformed collective signature")]
    BadSignature {
        /// What was due.
        what: &'static str,
    },
}
