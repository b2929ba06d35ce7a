//! The dynamic group's wire formats, both directions in one place: a [`DynMessage`] is a
//! control frame's header between members, a [`MemberRecord`] is a joiner's introduction (in
//! its hello) and the coordinator's record in the store. The agent, its fault injectors and
//! the `membership` fuzz target all read them with these decoders.

use super::dynamic::{DynMessage, MemberRecord};
use crate::codec::{self, Format, Undecodable};

impl DynMessage {
    /// Encodes the message as a control frame's header.
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Reads a control frame's header as a membership message.
    ///
    /// # Errors
    /// [`Undecodable`] ([`Format::MembershipMessage`]) when the bytes are no message.
    pub fn decode(bytes: &[u8]) -> Result<DynMessage, Undecodable> {
        codec::decode(Format::MembershipMessage, bytes)
    }
}

impl MemberRecord {
    /// Encodes the record (a hello's introduction, the coordinator's record in the store).
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Reads a record.
    ///
    /// # Errors
    /// [`Undecodable`] ([`Format::MemberRecord`]) when the bytes are no record.
    pub fn decode(bytes: &[u8]) -> Result<MemberRecord, Undecodable> {
        codec::decode(Format::MemberRecord, bytes)
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::validate::WorkerDeviceInfo;

    fn record(rank: u32) -> MemberRecord {
        MemberRecord {
            rank,
            addr: SocketAddr::from(([10, 0, 0, 1], 4000 + rank as u16)),
            devices: WorkerDeviceInfo {
                name: format!("w{rank}"),
                ..WorkerDeviceInfo::default()
            },
        }
    }

    #[test]
    fn messages_and_records_round_trip() {
        for m in [
            DynMessage::JoinRequest { record: record(3) },
            DynMessage::Admit {
                seq: 2,
                members: vec![(0, record(0)), (1, record(1))],
            },
            DynMessage::Refused {
                reason: "name in use".into(),
                retry: true,
            },
            DynMessage::Left { rank: 4 },
        ] {
            assert_eq!(DynMessage::decode(&m.encode()), Ok(m));
        }
        assert_eq!(MemberRecord::decode(&record(7).encode()), Ok(record(7)));
    }

    #[test]
    fn what_does_not_parse_names_its_format() {
        let e = DynMessage::decode(&[0xff, 0xff, 0xff]).unwrap_err();
        assert_eq!(e.format, Format::MembershipMessage);
        assert!(
            e.to_string()
                .starts_with("a membership message that does not parse ("),
            "{e}"
        );
        let e = MemberRecord::decode(&[]).unwrap_err();
        assert_eq!(e.format, Format::MemberRecord);
        assert!(
            e.to_string()
                .starts_with("a member record that does not parse ("),
            "{e}"
        );
    }
}
