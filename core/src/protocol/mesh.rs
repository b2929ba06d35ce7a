//! The mesh's frames: what goes on a link before and beside the layers' own messages, encoded
//! and decoded here (the mesh crate keeps the I/O).
//!
//! Every one is a [`wire::Frame`](crate::wire::Frame) whose message header is a postcard value
//! of this module, like every other header of [`protocol`](crate::protocol):
//!
//! - [`Hello`]: the first frame on every link ([`FrameKind::Control`]): who dials, for which
//!   group. A dynamic RPC group's member answers a joiner's hello with a [`HelloReply`]
//!   (also [`FrameKind::Control`]).
//! - [`GroupFrame`]: a process group's own frames ([`FrameKind::Collective`]): a collective
//!   message's header ([`GroupFrame::Data`], the message itself is the frame's payload), and
//!   the group's control (goodbye, abort, disagreement, a failed stage of a collective across
//!   hosts).
//!
//! Decoding takes the whole header or nothing: bytes that do not parse, trailing bytes, a
//! frame of the wrong kind, or a signature no collective produces are a [`MeshFrameError`]
//! naming what was wrong; it never panics.

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::collective::stage_failure::{StageCause, StageReport};
use crate::collective::{Signature, SIGNATURE_LEN};
use crate::wire::{Frame, FrameKind};

pub use crate::wire::MeshFrameError;

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain values into a vector cannot fail (no maps, no custom
    // serializers); an empty header would be refused by the receiver, never misread.
    postcard::to_allocvec(value).unwrap_or_default()
}

fn decode<T: DeserializeOwned>(what: &'static str, header: &[u8]) -> Result<T, MeshFrameError> {
    let (value, rest) =
        postcard::take_from_bytes(header).map_err(|e| MeshFrameError::Malformed {
            what,
            reason: e.to_string(),
        })?;
    if !rest.is_empty() {
        return Err(MeshFrameError::Trailing {
            what,
            extra: rest.len(),
        });
    }
    Ok(value)
}

fn expect_kind(
    what: &'static str,
    frame: &Frame,
    expected: FrameKind,
) -> Result<(), MeshFrameError> {
    if frame.kind == expected {
        Ok(())
    } else {
        Err(MeshFrameError::WrongKind {
            what,
            kind: frame.kind,
            expected,
        })
    }
}

/// The first frame on every link: who is dialling, and for which group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The group the link belongs to (a process group's name; the RPC agent's group).
    pub group: String,
    /// The dialler's rank.
    pub rank: u32,
    /// The dialler's world size; `None` in a group without one (a dynamic RPC group).
    pub world: Option<u32>,
    /// What the layer above tells about the dialler (a dynamic RPC group's joiner sends its
    /// encoded record); empty for process groups.
    pub introduction: Vec<u8>,
}

impl Hello {
    /// The hello as a frame ([`FrameKind::Control`]).
    pub fn frame(&self) -> Frame {
        Frame::control(encode(self), Vec::new())
    }

    /// The hello `frame` carries.
    pub fn from_frame(frame: &Frame) -> Result<Hello, MeshFrameError> {
        expect_kind("hello", frame, FrameKind::Control)?;
        decode("hello", &frame.header)
    }
}

/// A dynamic group member's answer to a joiner's [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HelloReply {
    /// The connection is accepted: the layers' messages follow.
    Welcome,
    /// The joiner is refused; the connection closes.
    Refused {
        /// Why.
        reason: String,
        /// Whether asking again (the member was leaving) may succeed.
        retry: bool,
    },
}

impl HelloReply {
    /// The answer as a frame ([`FrameKind::Control`]).
    pub fn frame(&self) -> Frame {
        Frame::control(encode(self), Vec::new())
    }

    /// The answer `frame` carries.
    pub fn from_frame(frame: &Frame) -> Result<HelloReply, MeshFrameError> {
        expect_kind("answer to a hello", frame, FrameKind::Control)?;
        decode("answer to a hello", &frame.header)
    }
}

/// A process group's own frame ([`FrameKind::Collective`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupFrame {
    /// A collective message: its key (the group's sequence number) and the round's
    /// [`Signature`] (encoded; the collective checks it against its own). The message is the
    /// frame's payload.
    Data {
        /// The key it is filed under.
        seq: u64,
        /// The sender's encoded signature of the round.
        signature: [u8; SIGNATURE_LEN],
    },
    /// The sender shuts its group down cleanly; no more messages follow.
    Goodbye,
    /// The sender aborted its group (it saw a failure: a rank dying, a violation).
    Abort {
        /// The sender's own rank: a rank may only report its own abort, and an abort naming
        /// another rank is a violation of its sender (core's `collective::inbox::check_abort`).
        rank: u32,
        /// What the sender saw, in its words.
        reason: String,
    },
    /// The sender received, as collective `seq` of group `group`, a message of `peer` that
    /// ran `theirs` while it ran `ours`; it has broken its group. The receiver believes it only
    /// if its sender could have seen it (core's
    /// `collective::inbox::Admission::check_disagreement`), else it is a violation of its
    /// sender.
    Disagreement {
        /// The group's id (0: the world group).
        group: u64,
        /// The sequence number (the group's own).
        seq: u64,
        /// The rank whose message disagreed.
        peer: u32,
        /// What that rank ran.
        theirs: Signature,
        /// What the sender ran.
        ours: Signature,
    },
    /// The sender's own stage of a collective of hierarchical group `group` (a group spanning
    /// hosts) failed on ranks it waited for ([`crate::collective::stage_failure`]); it has
    /// broken its group. The receiver believes it only if its sender could have waited for
    /// them (core's `collective::stage_failure::check_stage_report`), else it is a violation of
    /// its sender.
    StageFailed {
        /// The hierarchical group's id (0: the world group).
        group: u64,
        /// Whom it blames and why.
        report: StageReport,
    },
}

/// Why a stage failed, as it is on the wire.
#[derive(Serialize, Deserialize)]
enum WireStageCause {
    Died,
    TimedOut { waited_micros: u64 },
}

/// [`GroupFrame`] as it is on the wire (signatures as bytes).
#[derive(Serialize, Deserialize)]
enum WireGroupFrame {
    Data {
        seq: u64,
        signature: [u8; SIGNATURE_LEN],
    },
    Goodbye,
    Abort {
        rank: u32,
        reason: String,
    },
    Disagreement {
        group: u64,
        seq: u64,
        peer: u32,
        theirs: [u8; SIGNATURE_LEN],
        ours: [u8; SIGNATURE_LEN],
    },
    StageFailed {
        group: u64,
        ranks: Vec<u32>,
        cause: WireStageCause,
    },
}

impl GroupFrame {
    /// The header of a collective message (for [`Frame::collective`] with its payload).
    pub fn data_header(seq: u64, signature: &[u8; SIGNATURE_LEN]) -> Bytes {
        Bytes::from(encode(&WireGroupFrame::Data {
            seq,
            signature: *signature,
        }))
    }

    /// The frame's header.
    pub fn header(&self) -> Bytes {
        let wire = match self {
            GroupFrame::Data { seq, signature } => WireGroupFrame::Data {
                seq: *seq,
                signature: *signature,
            },
            GroupFrame::Goodbye => WireGroupFrame::Goodbye,
            GroupFrame::Abort { rank, reason } => WireGroupFrame::Abort {
                rank: *rank,
                reason: reason.clone(),
            },
            GroupFrame::Disagreement {
                group,
                seq,
                peer,
                theirs,
                ours,
            } => WireGroupFrame::Disagreement {
                group: *group,
                seq: *seq,
                peer: *peer,
                theirs: theirs.encode(),
                ours: ours.encode(),
            },
            GroupFrame::StageFailed { group, report } => WireGroupFrame::StageFailed {
                group: *group,
                ranks: report
                    .ranks
                    .iter()
                    .map(|r| u32::try_from(*r).unwrap_or(u32::MAX))
                    .collect(),
                cause: match report.cause {
                    StageCause::Died => WireStageCause::Died,
                    StageCause::TimedOut { waited } => WireStageCause::TimedOut {
                        waited_micros: u64::try_from(waited.as_micros()).unwrap_or(u64::MAX),
                    },
                },
            },
        };
        Bytes::from(encode(&wire))
    }

    /// The frame, with `payloads` (a collective message's; none for the others).
    pub fn frame(&self, payloads: impl Into<crate::wire::Payloads>) -> Frame {
        Frame::collective(self.header(), payloads)
    }

    /// The group frame `frame` carries.
    pub fn from_frame(frame: &Frame) -> Result<GroupFrame, MeshFrameError> {
        expect_kind("group frame", frame, FrameKind::Collective)?;
        Self::decode(&frame.header)
    }

    /// The group frame a [`FrameKind::Collective`] frame's `header` encodes.
    pub fn decode(header: &[u8]) -> Result<GroupFrame, MeshFrameError> {
        const WHAT: &str = "group frame";
        Ok(match decode::<WireGroupFrame>(WHAT, header)? {
            WireGroupFrame::Data { seq, signature } => GroupFrame::Data { seq, signature },
            WireGroupFrame::Goodbye => GroupFrame::Goodbye,
            WireGroupFrame::Abort { rank, reason } => GroupFrame::Abort { rank, reason },
            WireGroupFrame::Disagreement {
                group,
                seq,
                peer,
                theirs,
                ours,
            } => {
                let (Some(theirs), Some(ours)) =
                    (Signature::decode(&theirs), Signature::decode(&ours))
                else {
                    return Err(MeshFrameError::BadSignature { what: WHAT });
                };
                GroupFrame::Disagreement {
                    group,
                    seq,
                    peer,
                    theirs,
                    ours,
                }
            }
            WireGroupFrame::StageFailed {
                group,
                ranks,
                cause,
            } => GroupFrame::StageFailed {
                group,
                report: StageReport {
                    ranks: ranks.into_iter().map(|r| r as usize).collect(),
                    cause: match cause {
                        WireStageCause::Died => StageCause::Died,
                        WireStageCause::TimedOut { waited_micros } => StageCause::TimedOut {
                            waited: std::time::Duration::from_micros(waited_micros),
                        },
                    },
                },
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_frames_round_trip() {
        for f in [
            GroupFrame::Data {
                seq: u64::MAX,
                signature: Signature::Barrier.encode(),
            },
            GroupFrame::Goodbye,
            GroupFrame::Abort {
                rank: 2,
                reason: "reset".into(),
            },
            GroupFrame::Disagreement {
                group: 3,
                seq: 7,
                peer: 1,
                theirs: Signature::Barrier,
                ours: Signature::AllGatherLengths,
            },
            GroupFrame::StageFailed {
                group: 2,
                report: StageReport {
                    ranks: vec![3, 5],
                    cause: StageCause::TimedOut {
                        waited: std::time::Duration::from_micros(1_750_000),
                    },
                },
            },
            GroupFrame::StageFailed {
                group: 0,
                report: StageReport {
                    ranks: vec![1],
                    cause: StageCause::Died,
                },
            },
        ] {
            let frame = f.frame(Vec::new());
            assert_eq!(frame.kind, FrameKind::Collective);
            assert_eq!(GroupFrame::from_frame(&frame), Ok(f));
        }
        let sig = Signature::AllToAll.encode();
        assert_eq!(
            GroupFrame::decode(&GroupFrame::data_header(77, &sig)),
            Ok(GroupFrame::Data {
                seq: 77,
                signature: sig
            })
        );
    }

    #[test]
    fn bad_group_frames_are_typed_errors() {
        let good = GroupFrame::data_header(77, &Signature::Barrier.encode());
        // Every strict prefix is malformed; an extra byte is trailing.
        for n in 0..good.len() {
            assert!(
                matches!(
                    GroupFrame::decode(&good[..n]),
                    Err(MeshFrameError::Malformed { .. })
                ),
                "{n}"
            );
        }
        let mut long = good.to_vec();
        long.push(0);
        assert_eq!(
            GroupFrame::decode(&long),
            Err(MeshFrameError::Trailing {
                what: "group frame",
                extra: 1
            })
        );
        assert!(matches!(
            GroupFrame::decode(&[9]),
            Err(MeshFrameError::Malformed { .. })
        ));
        let bad = encode(&WireGroupFrame::Disagreement {
            group: 0,
            seq: 1,
            peer: 0,
            theirs: [0xff; SIGNATURE_LEN],
            ours: Signature::Barrier.encode(),
        });
        assert_eq!(
            GroupFrame::decode(&bad),
            Err(MeshFrameError::BadSignature {
                what: "group frame"
            })
        );
        let e = GroupFrame::from_frame(&Frame::message(good, Vec::new())).unwrap_err();
        assert!(matches!(e, MeshFrameError::WrongKind { .. }), "{e}");
    }

    #[test]
    fn hellos_and_replies_round_trip_and_other_frames_are_not_them() {
        let h = Hello {
            group: "rpc".into(),
            rank: 3,
            world: Some(8),
            introduction: vec![1, 2],
        };
        assert_eq!(Hello::from_frame(&h.frame()), Ok(h.clone()));
        let e = Hello::from_frame(&Frame::message(h.frame().header, Vec::new())).unwrap_err();
        assert!(e.to_string().contains("Message"), "{e}");
        let e = Hello::from_frame(&Frame::control(vec![0xff; 3], Vec::new())).unwrap_err();
        assert!(matches!(e, MeshFrameError::Malformed { .. }), "{e}");
        for r in [
            HelloReply::Welcome,
            HelloReply::Refused {
                reason: "w1 is taken".into(),
                retry: false,
            },
        ] {
            assert_eq!(HelloReply::from_frame(&r.frame()), Ok(r));
        }
        // A hello is no answer to one, and the other way round.
        assert!(HelloReply::from_frame(&h.frame()).is_err());
        assert!(Hello::from_frame(&HelloReply::Welcome.frame()).is_err());
    }
}
