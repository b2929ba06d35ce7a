//! The postcard formats of core's messages and records, in one place: each format's encoder and
//! decoder are methods of its type (the envelope's `Envelope::encode`/`decode`, the dynamic
//! group's `DynMessage` and `MemberRecord`, the gather's `Contribution`, `GatherOutcome` and
//! all_gather values,
//! [`ipc::encode_message`](crate::ipc::encode_message)/`decode_message`), and all of them read
//! through one decoder here, so bytes that do not parse are one typed error, [`Undecodable`],
//! naming the [`Format`] they were read as. Drivers, fault injectors and fuzz targets call those
//! methods; none runs postcard on these types itself.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Which of core's wire formats some bytes were read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Format {
    /// An agent message frame's header ([`Envelope`](crate::protocol::envelope::Envelope)).
    MessageHeader,
    /// A dynamic group's membership message
    /// ([`DynMessage`](crate::protocol::membership::DynMessage)).
    MembershipMessage,
    /// A dynamic group member's record
    /// ([`MemberRecord`](crate::protocol::membership::MemberRecord)).
    MemberRecord,
    /// A member's contribution to a gather
    /// ([`Contribution`](crate::protocol::gather::Contribution)).
    GatherContribution,
    /// A gather leader's answer ([`GatherOutcome`](crate::protocol::gather::GatherOutcome)).
    GatherAnswer,
    /// One member's all_gather value
    /// ([`decode_value`](crate::protocol::gather::decode_value)).
    GatherValue,
    /// A same-host CUDA IPC message ([`IpcMessage`](crate::ipc::IpcMessage)).
    IpcMessage,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::MessageHeader => "a message header",
            Format::MembershipMessage => "a membership message",
            Format::MemberRecord => "a member record",
            Format::GatherContribution => "a gather contribution",
            Format::GatherAnswer => "a gather answer",
            Format::GatherValue => "an all_gather value",
            Format::IpcMessage => "an IPC message",
        })
    }
}

/// Bytes that are no valid [`Format`]: which format, and postcard's reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{format} that does not parse ({source})")]
pub struct Undecodable {
    /// What the bytes were read as.
    pub format: Format,
    /// Why they are not one.
    #[source]
    pub source: postcard::Error,
}

/// Reads `bytes` as one `format` value.
pub(crate) fn decode<T: DeserializeOwned>(format: Format, bytes: &[u8]) -> Result<T, Undecodable> {
    postcard::from_bytes(bytes).map_err(|source| Undecodable { format, source })
}

/// Encodes plain data (structs and enums of sized fields, strings, vectors and maps), which
/// postcard's serializer into a `Vec` always encodes: it fails only for sequences of unknown
/// length, which derived `Serialize` impls never make.
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    match postcard::to_allocvec(value) {
        Ok(bytes) => bytes,
        Err(e) => unreachable!("plain data always encodes with postcard: {e}"),
    }
}
