//! The decoder accepts only the references a message announced beside its bytes.

use std::cell::RefCell;
use std::collections::HashMap;

use serde::de::{Deserializer, Visitor};
use serde::Deserialize;

use super::*;
use crate::protocol::{GlobalId, RRefForkData, RRefHandle, RRefId, WorkerId};

/// An agent that records the forks it accepts.
#[derive(Default)]
struct Recorder {
    accepted: RefCell<Vec<RRefForkData>>,
    tickets: RefCell<HashMap<u64, RRefHandle>>,
}

impl References for Recorder {
    fn identity(&self) -> u64 {
        1
    }
    fn fork(&self, _: RRefHandle, _: WorkerId) -> Result<RRefForkData, CallError> {
        unreachable!("these tests only decode")
    }
    fn cancel_forks(&self, _: WorkerId, _: &[RRefForkData]) {}
    fn accept(&self, data: RRefForkData) -> RRefHandle {
        self.accepted.borrow_mut().push(data);
        RRefHandle {
            rref: data.rref,
            fork: data.fork,
            owner: data.owner,
        }
    }
    fn hand_over(&self, handle: RRefHandle) -> u64 {
        let mut tickets = self.tickets.borrow_mut();
        let ticket = tickets.len() as u64;
        tickets.insert(ticket, handle);
        ticket
    }
    fn take_back(&self, _: u64) {}
}

/// A reference as a value decodes it: through the newtype the codec recognises.
#[derive(Debug)]
struct Ref(#[allow(dead_code)] u64);

impl<'de> Deserialize<'de> for Ref {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Ref;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a reference")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Ref, E> {
                Ok(Ref(v))
            }
        }
        d.deserialize_newtype_struct(RREF_TOKEN, V)
    }
}

fn fork(n: u64) -> RRefForkData {
    let id = |local| GlobalId {
        created_on: 2,
        local,
    };
    RRefForkData {
        rref: RRefId::from(id(n)),
        fork: id(100 + n),
        owner: 0,
        parent: 2,
        secret: 7,
    }
}

/// A value holding the references `forks`, as its sender encodes it (a reference travels as
/// its fork data).
fn bytes_of(forks: &[RRefForkData]) -> Vec<u8> {
    postcard::to_allocvec(&(42u32, forks.to_vec())).unwrap()
}

#[test]
fn references_the_message_announced_are_accepted() {
    let agent = Recorder::default();
    let sent = [fork(1), fork(2)];
    let (value, handles) =
        decode_with_references::<(u32, Vec<Ref>)>(&agent, &bytes_of(&sent), Vec::new(), &sent)
            .unwrap();
    assert_eq!(value.0, 42);
    assert_eq!(handles.len(), 2);
    assert_eq!(*agent.accepted.borrow(), sent.to_vec());
}

#[test]
fn a_reference_the_message_did_not_announce_is_refused_before_it_is_accepted() {
    let agent = Recorder::default();
    let hidden = fork(3);
    {
        let announced = [fork(1)];
        let err = decode_with_references::<(u32, Vec<Ref>)>(
            &agent,
            &bytes_of(&[fork(1), hidden]),
            Vec::new(),
            &announced,
        )
        .unwrap_err();
        match err {
            DecodeError::Unannounced { rref, fork } => {
                assert_eq!((rref, fork), (hidden.rref, hidden.fork));
            }
            other => panic!("expected Unannounced, got {other}"),
        }
        assert_eq!(
            *agent.accepted.borrow(),
            vec![fork(1)],
            "the hidden fork was accepted"
        );
        agent.accepted.borrow_mut().clear();
    }
    // With nothing announced, even the first reference is refused.
    let err =
        decode_with_references::<(u32, Vec<Ref>)>(&agent, &bytes_of(&[hidden]), Vec::new(), &[])
            .unwrap_err();
    assert!(err.to_string().contains("did not announce"), "{err}");
    assert!(agent.accepted.borrow().is_empty());
}

#[test]
fn a_reference_announced_once_is_accepted_once() {
    let agent = Recorder::default();
    let f = fork(4);
    let err =
        decode_with_references::<(u32, Vec<Ref>)>(&agent, &bytes_of(&[f, f]), Vec::new(), &[f])
            .unwrap_err();
    assert!(matches!(err, DecodeError::Unannounced { .. }), "{err}");
    assert_eq!(agent.accepted.borrow().len(), 1);
}
