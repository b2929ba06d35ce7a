//! The envelope of every agent message frame (`FrameKind::Message`): the protocol [`Header`],
//! for a method the reference it is called on, for a request the references passed in its
//! arguments, and the metadata of the tensors whose bytes follow as payloads. Decoding is split in two so that a driver can check the announced
//! tensors (device IPC) between parsing the envelope and taking the payloads.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::{Header, MalformedMessage, MethodTarget, Payload, ProtocolViolation, RRefForkData};
use crate::codec::{self, Format};
use crate::tensor::TensorMeta;
use crate::wire::{Frame, FrameKind, Payloads};

/// The capacity a message header is encoded into (most are smaller; a larger one grows).
const ENCODE_CAPACITY: usize = 128;

/// The header of every agent frame: the protocol header and, for methods, the reference whose
/// value the function is called on with the caller's fork of it (the owner runs the method
/// only for a holder of that fork).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// The protocol header.
    pub header: Header,
    /// For a method: the reference whose value it is called on, and the caller's fork of it.
    pub target: Option<MethodTarget>,
    /// For a request (a call or a `remote`): the forks made for the receiver of the references
    /// inside its arguments ([`Payload::forks`]), so that the receiving
    /// endpoint checks them and holds the values it owns among them from the request's arrival,
    /// before anything decodes the arguments. Empty for a reply, whose header carries its own
    /// ([`Header::Reply`]).
    pub forks: Vec<RRefForkData>,
    /// The tensors whose bytes follow the encoded value as payloads, in order.
    pub tensors: Vec<TensorMeta>,
}

/// A message's body as a frame carries it: the encoded value, and each tensor's metadata with
/// its bytes. The agent's messages carry it through the endpoint as their [`Payload`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FrameBody {
    /// For a method: the reference whose value it is called on, and the caller's fork of it.
    pub target: Option<MethodTarget>,
    /// The forks made for the receiver of the references inside `data`: a request's
    /// ([`Envelope::forks`]), a reply's (its [`Header::Reply`]'s).
    pub forks: Vec<RRefForkData>,
    /// The encoded arguments or result (the first payload).
    pub data: Bytes,
    /// The tensors, in the order the envelope announced them.
    pub tensors: Vec<(TensorMeta, Bytes)>,
}

impl Payload for FrameBody {
    fn forks(&self) -> Vec<RRefForkData> {
        self.forks.clone()
    }

    fn target(&self) -> Option<MethodTarget> {
        self.target
    }

    fn wire_bytes(&self) -> usize {
        (self.tensors.iter())
            .map(|(_, b)| b.len())
            .fold(self.data.len(), usize::saturating_add)
    }
}

impl Envelope {
    /// The message frame of `header` and `body`, as [`decode`](Self::decode) and
    /// [`attach`](Self::attach) read it back: the envelope (a request's forks in it, a reply's
    /// in its header), then the encoded value and each tensor's bytes as payloads.
    ///
    /// # Errors
    /// [`encode`](Self::encode)'s.
    pub fn frame(header: Header, body: Option<FrameBody>) -> Result<Frame, postcard::Error> {
        // Written in the thread's scratch buffer and copied out at its size: one allocation,
        // where `encode`'s buffer with room to spare cost `Bytes` a second (its shared header).
        Self::frame_with(header, body, |envelope| {
            crate::wire::exact_bytes(|buf| postcard::to_extend(envelope, buf))
        })
    }

    /// [`frame`](Self::frame), with the message header copied into `room` (see
    /// [`wire::bytes_in`](crate::wire::bytes_in)): a sender's buffer for its frames to one
    /// peer, from which the headers are split off with no allocation of their own.
    ///
    /// # Errors
    /// [`encode`](Self::encode)'s.
    pub fn frame_in(
        header: Header,
        body: Option<FrameBody>,
        room: &mut bytes::BytesMut,
    ) -> Result<Frame, postcard::Error> {
        // The usual call and reply written straight into the room, with no envelope made.
        if let Some(written) = plain_writer::write_in(&header, body.as_ref(), room) {
            return Ok(Frame {
                kind: FrameKind::Message,
                header: written,
                payloads: body.map_or_else(Payloads::new, |b| Payloads::one(b.data)),
            });
        }
        Self::frame_with(header, body, |envelope| {
            crate::wire::bytes_in(room, |buf| postcard::to_extend(envelope, buf))
        })
    }

    fn frame_with(
        header: Header,
        body: Option<FrameBody>,
        encode: impl FnOnce(&Envelope) -> Result<Bytes, postcard::Error>,
    ) -> Result<Frame, postcard::Error> {
        let request = matches!(header, Header::Call { .. } | Header::Remote { .. });
        let (target, forks, payloads, tensors) = match body {
            Some(b) => {
                let (metas, bytes): (Vec<_>, Vec<_>) = b.tensors.into_iter().unzip();
                // No list for the usual body without tensors: its value held in the frame.
                let mut payloads = Payloads::with_capacity(1 + bytes.len());
                payloads.push(b.data);
                payloads.extend(bytes);
                let forks = if request { b.forks } else { Vec::new() };
                (b.target, forks, payloads, metas)
            }
            None => (None, Vec::new(), Payloads::new(), Vec::new()),
        };
        let envelope = Envelope {
            header,
            target,
            forks,
            tensors,
        };
        let header = encode(&envelope)?;
        Ok(Frame {
            kind: FrameKind::Message,
            header,
            payloads,
        })
    }

    /// Encodes the envelope as a frame's message header: the one encoder (the agent's links
    /// and every test or fuzz helper use it), as [`decode`](Self::decode) is the one decoder.
    ///
    /// # Errors
    /// postcard's, which its serializer into a `Vec` gives only for types it cannot size; the
    /// envelope's fields are all sized, so a caller may treat one as a bug to log.
    pub fn encode(&self) -> Result<Vec<u8>, postcard::Error> {
        // Room for a call's or a reply's header at once: grown from empty, the buffer was
        // reallocated three or four times per message.
        postcard::to_extend(self, Vec::with_capacity(ENCODE_CAPACITY))
    }

    /// Parses a frame's message header; what does not parse is a
    /// [`ProtocolViolation::Malformed`] of the sender.
    pub fn decode(header: &[u8]) -> Result<Envelope, ProtocolViolation> {
        if let Some(envelope) = plain::decode(header) {
            return Ok(envelope);
        }
        codec::decode(Format::MessageHeader, header)
            .map_err(|e| ProtocolViolation::Malformed(MalformedMessage::Undecodable(e)))
    }

    /// The protocol header, and the body the frame's `payloads` carry: none without payloads,
    /// else the encoded value (the first) and one payload per announced tensor. A frame whose
    /// payloads do not match the announced tensors is a [`ProtocolViolation::Malformed`].
    pub fn attach(
        self,
        payloads: Payloads,
    ) -> Result<(Header, Option<FrameBody>), ProtocolViolation> {
        // The payloads after the first (the encoded value) are the tensors' bytes.
        let Some(carried) = payloads.len().checked_sub(1) else {
            return Ok((self.header, None));
        };
        if carried != self.tensors.len() {
            return Err(ProtocolViolation::Malformed(
                MalformedMessage::TensorCount {
                    announced: self.tensors.len(),
                    carried,
                },
            ));
        }
        // The forks the body's bytes may hold: a request's travel in the envelope, a
        // reply's in its header; decoding the value refuses any other.
        let forks = match &self.header {
            Header::Reply { forks, .. } => forks.clone(),
            _ => self.forks,
        };
        let (data, tensors) = if carried == 0 {
            // The usual message without tensors: its one payload taken out, no list built.
            let mut payloads = payloads;
            (payloads.pop().unwrap_or_default(), Vec::new())
        } else {
            let mut payloads = payloads.into_iter();
            let data = payloads.next().unwrap_or_default();
            (data, self.tensors.into_iter().zip(payloads).collect())
        };
        let body = FrameBody {
            target: self.target,
            forks,
            data,
            tensors,
        };
        Ok((self.header, Some(body)))
    }
}

mod plain_writer;

/// The two messages of nearly every call read without serde's machinery (about 450 of the
/// 490 to 660 instructions postcard's derived decoder took for them): a call with no target,
/// forks or tensors, and its reply `Ok` with no forks. Says `None` for anything else, or for
/// any byte it is not sure of, and the caller then asks postcard: what it reads, postcard
/// reads as the same envelope (each varint no longer than one postcard accepts whatever its
/// last byte, a name that is UTF-8, nanoseconds under a second, bytes after the envelope
/// ignored as `postcard::from_bytes` ignores them), so every refusal stays postcard's.
mod plain {
    use std::time::Duration;

    use super::Envelope;
    use crate::protocol::Header;

    /// `Header::Call`'s and `Header::Reply`'s variant indices (their order in the enum).
    const CALL: u8 = 0;
    const REPLY: u8 = 3;
    /// A call's tail (no target, no forks, no tensors); a reply's (`Ok`, no forks in its
    /// header, then the same).
    const CALL_TAIL: [u8; 3] = [0; 3];
    const REPLY_TAIL: [u8; 5] = [0; 5];

    pub(super) fn decode(bytes: &[u8]) -> Option<Envelope> {
        let (&tag, rest) = bytes.split_first()?;
        let (id, rest) = varint(rest, 9)?;
        let header = match tag {
            CALL => {
                let (len, rest) = varint(rest, 9)?;
                let (name, rest) = rest.split_at_checked(usize::try_from(len).ok()?)?;
                let function = std::str::from_utf8(name).ok()?.to_owned();
                let (secs, rest) = varint(rest, 9)?;
                let (nanos, rest) = varint(rest, 5)?;
                // Under a second, so within a `u32` (a fifth byte over 15 is not).
                if nanos >= 1_000_000_000 || !rest.starts_with(&CALL_TAIL) {
                    return None;
                }
                let timeout = Duration::new(secs, u32::try_from(nanos).ok()?);
                Header::Call {
                    id,
                    function,
                    timeout,
                }
            }
            REPLY if rest.starts_with(&REPLY_TAIL) => Header::Reply {
                id,
                outcome: Ok(()),
                forks: Vec::new(),
            },
            _ => return None,
        };
        Some(Envelope {
            header,
            target: None,
            forks: Vec::new(),
            tensors: Vec::new(),
        })
    }

    /// A varint of at most `max` bytes, and what follows it: 9 hold 63 bits, within a `u64`,
    /// so postcard accepts any such one (an id over 2^63 is left to it); 5 for a `u32`, whose
    /// value the caller bounds.
    fn varint(bytes: &[u8], max: usize) -> Option<(u64, &[u8])> {
        let mut value = 0;
        for (i, &b) in bytes.iter().take(max).enumerate() {
            value |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Some((value, &bytes[i + 1..]));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::device::Device;
    use crate::protocol::{GlobalId, MethodTarget, RRefForkData};
    use crate::tensor::DType;

    fn meta() -> TensorMeta {
        TensorMeta {
            dtype: DType::U8,
            shape: vec![3],
            device: Device::Cpu,
            ipc: None,
        }
    }

    fn envelope(tensors: usize) -> Envelope {
        Envelope {
            header: Header::Call {
                id: 7,
                function: "add".into(),
                timeout: Duration::from_secs(1),
            },
            target: Some(MethodTarget {
                rref: GlobalId {
                    created_on: 1,
                    local: 2,
                },
                fork: GlobalId {
                    created_on: 3,
                    local: 4,
                },
            }),
            forks: vec![RRefForkData {
                rref: GlobalId {
                    created_on: 1,
                    local: 2,
                },
                fork: GlobalId {
                    created_on: 3,
                    local: 5,
                },
                owner: 4,
                parent: 3,
                secret: 6,
            }],
            tensors: vec![meta(); tensors],
        }
    }

    #[test]
    fn an_envelope_round_trips_and_its_payloads_become_the_body() {
        let bytes = postcard::to_allocvec(&envelope(2)).unwrap();
        let decoded = Envelope::decode(&bytes).unwrap();
        assert_eq!(decoded, envelope(2));
        let payloads = vec![
            Bytes::from_static(b"args"),
            Bytes::from_static(b"abc"),
            Bytes::from_static(b"def"),
        ];
        let (header, body) = decoded.attach(payloads.into()).unwrap();
        assert_eq!(header, envelope(0).header);
        let body = body.unwrap();
        assert_eq!(body.target, envelope(0).target);
        assert_eq!(body.forks, envelope(0).forks);
        assert_eq!(body.data, Bytes::from_static(b"args"));
        assert_eq!(
            body.tensors,
            vec![
                (meta(), Bytes::from_static(b"abc")),
                (meta(), Bytes::from_static(b"def"))
            ]
        );
    }

    /// A call's body with `tensors`.
    fn body_with(tensors: Vec<(TensorMeta, Bytes)>) -> FrameBody {
        FrameBody {
            target: envelope(0).target,
            forks: envelope(0).forks,
            data: Bytes::from_static(b"args"),
            tensors,
        }
    }

    /// A frame made by `Envelope::frame`, read back as the agent reads it, with `payloads`
    /// frame payloads.
    fn read_back(f: Frame, payloads: usize) -> (Header, Option<FrameBody>) {
        assert_eq!((f.kind, f.payloads.len()), (FrameKind::Message, payloads));
        Envelope::decode(&f.header)
            .unwrap()
            .attach(f.payloads)
            .unwrap()
    }

    /// `frame` is `decode` and `attach` backwards: a request's forks travel in its envelope,
    /// a reply's only in its header (the envelope's are dropped), and a body-less message has
    /// no payloads.
    #[test]
    fn a_frame_made_reads_back_as_its_header_and_body() {
        // With a tensor (its bytes a payload after the data's) and without (the usual body:
        // the data its one payload).
        for (tensors, payloads) in [(vec![(meta(), Bytes::from_static(b"abc"))], 2), (vec![], 1)] {
            let body = body_with(tensors);
            let read = |f: Frame| read_back(f, payloads);
            let call = envelope(0).header;
            let (header, got) = read(Envelope::frame(call.clone(), Some(body.clone())).unwrap());
            assert_eq!((header, got.as_ref()), (call, Some(&body)));
            // A reply's forks are its header's; the body's are dropped.
            let reply = Header::Reply {
                id: 7,
                outcome: Ok(()),
                forks: Vec::new(),
            };
            let (header, got) = read(Envelope::frame(reply.clone(), Some(body.clone())).unwrap());
            assert_eq!(header, reply);
            let got = got.unwrap();
            assert_eq!(
                (got.forks, got.data, got.tensors),
                (Vec::new(), body.data, body.tensors)
            );
        }
        let reply = Header::Reply {
            id: 7,
            outcome: Ok(()),
            forks: envelope(0).forks,
        };
        assert_eq!(
            read_back(Envelope::frame(reply.clone(), None).unwrap(), 0),
            (reply, None)
        );
    }

    #[test]
    fn a_frame_without_payloads_has_no_body() {
        let (header, body) = envelope(0).attach(Payloads::new()).unwrap();
        assert_eq!(header, envelope(0).header);
        assert_eq!(body, None);
    }

    #[test]
    fn a_header_that_does_not_parse_is_malformed() {
        let e = Envelope::decode(&[0xff, 0xff, 0xff]).unwrap_err();
        assert!(
            matches!(
                &e,
                ProtocolViolation::Malformed(MalformedMessage::Undecodable(codec::Undecodable {
                    format: Format::MessageHeader,
                    ..
                }))
            ),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .starts_with("it sent a malformed message: a message header that does not parse ("),
            "{e}"
        );
    }

    #[test]
    fn payloads_that_do_not_match_the_announced_tensors_are_malformed() {
        for (announced, carried) in [(2, 1), (0, 1), (1, 3)] {
            let mut payloads = vec![Bytes::from_static(b"args")];
            payloads.extend((0..carried).map(|_| Bytes::from_static(b"x")));
            let e = envelope(announced).attach(payloads.into()).unwrap_err();
            assert_eq!(
                e,
                ProtocolViolation::Malformed(MalformedMessage::TensorCount { announced, carried })
            );
            assert_eq!(
                e.to_string(),
                format!(
                    "it sent a malformed message: a message that announces {announced} tensors \
                     and carries {carried}"
                )
            );
        }
    }

    /// The envelopes the plain reader takes and some it must leave to postcard: a call, with
    /// or without a target, forks or tensors, and a reply `Ok` or not, with or without forks.
    fn some_envelope() -> impl proptest::strategy::Strategy<Value = Envelope> {
        use proptest::prelude::*;
        let call = (any::<u64>(), ".{0,12}", any::<u64>(), 0..1_000_000_000u32).prop_map(
            |(id, function, secs, nanos)| Header::Call {
                id,
                function,
                timeout: Duration::new(secs, nanos),
            },
        );
        let reply = (any::<u64>(), any::<bool>()).prop_map(|(id, ok)| Header::Reply {
            id,
            outcome: if ok {
                Ok(())
            } else {
                Err(crate::protocol::RemoteError {
                    worker: 2,
                    kind: crate::protocol::RemoteErrorKind::Failed,
                    message: "no".into(),
                })
            },
            forks: Vec::new(),
        });
        (prop_oneof![call, reply], any::<bool>(), 0..2usize).prop_map(|(header, extra, n)| {
            let full = envelope(n);
            Envelope {
                header,
                target: full.target.filter(|_| extra),
                forks: if extra { full.forks } else { Vec::new() },
                tensors: full.tensors,
            }
        })
    }

    proptest::proptest! {
        /// Whatever the plain reader makes of a header, postcard makes the same of it: an
        /// encoded envelope, cut short, with a byte changed, or with bytes after it.
        #[test]
        fn the_plain_reader_reads_what_postcard_reads(
            e in some_envelope(),
            cut in proptest::prelude::any::<proptest::sample::Index>(),
            at in proptest::prelude::any::<proptest::sample::Index>(),
            byte in proptest::prelude::any::<u8>(),
            how in 0..4u8,
        ) {
            let mut bytes = e.encode().unwrap();
            match how {
                0 => {}
                1 => bytes.truncate(cut.index(bytes.len() + 1)),
                2 => {
                    let i = at.index(bytes.len());
                    bytes[i] = byte;
                }
                _ => bytes.push(byte),
            }
            let postcard: Result<Envelope, _> = codec::decode(Format::MessageHeader, &bytes);
            if let Some(plain) = plain::decode(&bytes) {
                proptest::prop_assert_eq!(Some(&plain), postcard.as_ref().ok());
            }
            if how == 0 || how == 3 {
                // Whole (bytes after it ignored): both read it back, and the plain reader
                // takes a call or reply with nothing else.
                proptest::prop_assert_eq!(postcard.as_ref().ok(), Some(&e));
                // (A varint of 63 bits or fewer: a larger id or second count is left to postcard.)
                let short = |v: u64| v < 1 << 63;
                let usual = e.target.is_none() && e.forks.is_empty() && e.tensors.is_empty()
                    && match &e.header {
                        Header::Call { id, timeout, .. } => short(*id) && short(timeout.as_secs()),
                        Header::Reply { id, outcome: Ok(()), .. } => short(*id),
                        _ => false,
                    };
                proptest::prop_assert_eq!(plain::decode(&bytes).is_some(), usual);
            }
        }

        /// Any bytes: the plain reader takes none that postcard refuses or reads otherwise.
        #[test]
        fn the_plain_reader_takes_nothing_postcard_refuses(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
        ) {
            if let Some(plain) = plain::decode(&bytes) {
                let postcard: Result<Envelope, _> = codec::decode(Format::MessageHeader, &bytes);
                proptest::prop_assert_eq!(Some(plain), postcard.ok());
            }
        }
    }

    /// The plain reader takes the usual call and reply (so the path measured is its), and
    /// leaves the rest to postcard.
    #[test]
    fn the_plain_reader_takes_the_usual_call_and_reply_only() {
        let call = Envelope {
            target: None,
            forks: Vec::new(),
            ..envelope(0)
        };
        let reply = Envelope {
            header: Header::Reply {
                id: 300,
                outcome: Ok(()),
                forks: Vec::new(),
            },
            ..call.clone()
        };
        for e in [&call, &reply] {
            assert_eq!(plain::decode(&e.encode().unwrap()).as_ref(), Some(e));
        }
        for e in [envelope(0), envelope(1)] {
            let bytes = e.encode().unwrap();
            assert_eq!(plain::decode(&bytes), None);
            assert_eq!(Envelope::decode(&bytes), Ok(e));
        }
    }
}
