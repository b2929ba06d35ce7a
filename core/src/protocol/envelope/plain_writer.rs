//! The two envelopes of nearly every call written without serde's machinery, straight into
//! the sender's room: a call with no target, forks or tensors, and its reply `Ok` with no
//! forks (the shapes the plain reader takes). Each byte is what postcard writes for the same
//! envelope (the tests hold them to it); anything else goes to postcard.

use bytes::{BufMut, Bytes, BytesMut};

use super::FrameBody;
use crate::protocol::Header;
use crate::wire::{put_varint, varint_len, written_in, ROOM_MAX};

/// `Header::Call`'s and `Header::Reply`'s variant indices (their order in the enum).
const CALL: u8 = 0;
const REPLY: u8 = 3;
/// A call's tail (no target, no forks, no tensors); a reply's (`Ok`, no forks in its header,
/// then the same).
const CALL_TAIL: [u8; 3] = [0; 3];
const REPLY_TAIL: [u8; 5] = [0; 5];

/// The envelope of `header` and `body` written into `room` and split off it, if it has one
/// of the two shapes and fits a room ([`ROOM_MAX`]); else `None`, and nothing is written.
/// (A reply's body's forks travel in its header, which must have none: the body's are not
/// written, as the general encoder drops them.)
pub(super) fn write_in(
    header: &Header,
    body: Option<&FrameBody>,
    room: &mut BytesMut,
) -> Option<Bytes> {
    let request = matches!(header, Header::Call { .. });
    let plain_body = body.is_none_or(|b| {
        b.target.is_none() && b.tensors.is_empty() && (!request || b.forks.is_empty())
    });
    if !plain_body {
        return None;
    }
    match header {
        Header::Call {
            id,
            function: name,
            timeout,
        } => {
            let name = name.as_bytes();
            let (secs, nanos) = (timeout.as_secs(), u64::from(timeout.subsec_nanos()));
            let len = 1
                + varint_len(*id)
                + varint_len(name.len() as u64)
                + name.len()
                + varint_len(secs)
                + varint_len(nanos)
                + CALL_TAIL.len();
            (len <= ROOM_MAX).then(|| {
                written_in(room, len, |out| {
                    out.put_u8(CALL);
                    put_varint(out, *id);
                    put_varint(out, name.len() as u64);
                    out.put_slice(name);
                    put_varint(out, secs);
                    put_varint(out, nanos);
                    out.put_slice(&CALL_TAIL);
                })
            })
        }
        Header::Reply {
            id,
            outcome: Ok(()),
            forks,
        } if forks.is_empty() => {
            let len = 1 + varint_len(*id) + REPLY_TAIL.len();
            Some(written_in(room, len, |out| {
                out.put_u8(REPLY);
                put_varint(out, *id);
                out.put_slice(&REPLY_TAIL);
            }))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::{Bytes, BytesMut};
    use proptest::prelude::*;

    use super::write_in;
    use crate::device::Device;
    use crate::protocol::envelope::{Envelope, FrameBody};
    use crate::protocol::{GlobalId, Header, MethodTarget, RRefForkData, RemoteError};
    use crate::tensor::{DType, TensorMeta};

    fn gid(local: u64) -> GlobalId {
        GlobalId {
            created_on: 1,
            local,
        }
    }

    fn fork() -> RRefForkData {
        RRefForkData {
            rref: gid(2),
            fork: gid(5),
            owner: 4,
            parent: 3,
            secret: 6,
        }
    }

    /// Headers of both shapes and of others (a reply with an error or forks, a fetch).
    fn some_header() -> impl Strategy<Value = Header> {
        let call = (any::<u64>(), ".{0,300}", any::<u64>(), 0..1_000_000_000u32).prop_map(
            |(id, function, secs, nanos)| Header::Call {
                id,
                function,
                timeout: Duration::new(secs, nanos),
            },
        );
        let reply = (any::<u64>(), any::<bool>(), any::<bool>()).prop_map(|(id, ok, forks)| {
            Header::Reply {
                id,
                outcome: if ok {
                    Ok(())
                } else {
                    Err(RemoteError {
                        worker: 2,
                        kind: crate::protocol::RemoteErrorKind::Failed,
                        message: "no".into(),
                    })
                },
                forks: if forks { vec![fork()] } else { Vec::new() },
            }
        });
        let fetch = any::<u64>().prop_map(|id| Header::Fetch {
            id,
            rref: gid(2),
            fork: gid(3),
            timeout: Duration::from_secs(1),
        });
        prop_oneof![call, reply, fetch]
    }

    /// No body, or one with or without a target, forks and a tensor.
    fn some_body() -> impl Strategy<Value = Option<FrameBody>> {
        let meta = TensorMeta {
            dtype: DType::U8,
            shape: vec![3],
            device: Device::Cpu,
            ipc: None,
        };
        (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            move |(some, target, forks, tensor)| {
                some.then(|| FrameBody {
                    target: target.then_some(MethodTarget {
                        rref: gid(2),
                        fork: gid(3),
                    }),
                    forks: if forks { vec![fork()] } else { Vec::new() },
                    data: Bytes::from_static(b"args"),
                    tensors: if tensor {
                        vec![(meta.clone(), Bytes::from_static(b"abc"))]
                    } else {
                        Vec::new()
                    },
                })
            },
        )
    }

    proptest! {
        /// A frame made in a room is the frame postcard's general encoder makes, byte for
        /// byte, whichever way it was written; the usual call and reply are written by hand.
        #[test]
        fn the_plain_writer_writes_what_postcard_writes(
            header in some_header(),
            body in some_body(),
        ) {
            let mut room = BytesMut::new();
            let general = Envelope::frame(header.clone(), body.clone()).unwrap();
            let plain = write_in(&header, body.as_ref(), &mut room);
            let usual = body.as_ref().is_none_or(|b| {
                b.target.is_none() && b.tensors.is_empty()
                    && (b.forks.is_empty() || matches!(header, Header::Reply { .. }))
            }) && match &header {
                Header::Call { .. } => general.header.len() <= crate::wire::ROOM_MAX,
                Header::Reply { outcome: Ok(()), forks, .. } => forks.is_empty(),
                _ => false,
            };
            prop_assert_eq!(plain.is_some(), usual);
            if let Some(plain) = plain {
                prop_assert_eq!(&plain, &general.header);
            }
            let framed = Envelope::frame_in(header, body, &mut room).unwrap();
            prop_assert_eq!(framed, general);
        }
    }

    /// The usual call and reply are split off the room (no allocation of their own), one
    /// after the other in the same chunk.
    #[test]
    fn the_usual_call_and_reply_share_the_room() {
        let mut room = BytesMut::new();
        let call = Header::Call {
            id: 7,
            function: "add".into(),
            timeout: Duration::from_secs(1),
        };
        let reply = Header::Reply {
            id: 7,
            outcome: Ok(()),
            forks: Vec::new(),
        };
        let first = write_in(&call, None, &mut room).unwrap();
        let second = write_in(&reply, None, &mut room).unwrap();
        assert_eq!(first.as_ptr().wrapping_add(first.len()), second.as_ptr());
        assert_eq!(Envelope::decode(&first).unwrap().header, call);
        assert_eq!(Envelope::decode(&second).unwrap().header, reply);
    }
}
