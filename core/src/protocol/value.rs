//! The wire format of values: arguments and results of calls, and values of remote references.
//! It decides how a reference travels inside a value, which is the reference protocol's
//! business, so it lives beside the endpoint; the agent only supplies its references
//! ([`References`]).
//!
//! Values are postcard. A remote reference inside them is encoded as fork data: encoding it
//! *forks* it for the destination, decoding it *accepts* the fork. Both need the agent and (for
//! encoding) the destination: a context made for the one encode or decode ([`encode`],
//! [`decode`]), which the format's serializer carries to every value inside (wrapped by the
//! private `encoder` and `decoder` modules). A reference serializes as a newtype struct named
//! [`RREF_TOKEN`], which only these wrappers understand: anywhere else (another format, or
//! postcard without the wrapper) serializing or deserializing an `RRef` fails, saying so.

mod decoder;
mod encoder;

use std::cell::RefCell;
use std::fmt::Display;

use crate::protocol::{CallError, RRefForkData, RRefHandle, WorkerId};
use crate::tensor::{sidecar, Tensor};
use bytes::Bytes;
use postcard::ser_flavors::Flavor as _;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// What the codec needs of the agent whose values it encodes and decodes: the references
/// inside them are forked for the destination when encoded and accepted when decoded. The agent
/// implements it; the codec names no agent type.
pub trait References {
    /// A number that tells this agent apart from every other alive (an [`Outgoing`]'s
    /// `agent`), so that a reference is sent only by the agent holding it.
    fn identity(&self) -> u64;
    /// Forks `handle` for worker `to`.
    fn fork(&self, handle: RRefHandle, to: WorkerId) -> Result<RRefForkData, CallError>;
    /// Undoes the forks made for `to` by an encode whose bytes will not be sent.
    fn cancel_forks(&self, to: WorkerId, forks: &[RRefForkData]);
    /// Accepts a fork received from a peer, as a handle of this agent's.
    fn accept(&self, data: RRefForkData) -> RRefHandle;
    /// Files the accepted `handle` for the reference's visitor, under the ticket returned
    /// (serde lets the decoder hand a visitor nothing but data).
    fn hand_over(&self, handle: RRefHandle) -> u64;
    /// Lets go of the handle under `ticket` if the visitor did not take it.
    fn take_back(&self, ticket: u64);
}

/// The name of the newtype struct a remote reference serializes as: what the codec's wrappers
/// recognise (`$` keeps it apart from every Rust type's name).
pub const RREF_TOKEN: &str = "$tensorwire::RRef";

/// Why a value could not be encoded or decoded, with the message of whoever failed: the
/// codec's own (a reference that cannot be sent), a value's own `Serialize` or `Deserialize`
/// (postcard alone would keep only "Serde Serialization Error"), or the format's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure(String);

impl Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Failure {}

impl serde::ser::Error for Failure {
    fn custom<T: Display>(msg: T) -> Self {
        Failure(msg.to_string())
    }
}

impl serde::de::Error for Failure {
    fn custom<T: Display>(msg: T) -> Self {
        Failure(msg.to_string())
    }
}

/// Carries a [`Failure`] across the format's own code, whose error type keeps no message: a
/// failure going out through the format is kept here ([`lower`](Self::lower)) and taken back
/// when the format's error comes back ([`lift`](Self::lift)).
#[derive(Default)]
struct Errors {
    kept: RefCell<Option<Failure>>,
}

impl Errors {
    /// `failure`, as the error of the format it goes through.
    fn lower<E: serde::ser::Error>(&self, failure: Failure) -> E {
        let e = E::custom(&failure);
        *self.kept.borrow_mut() = Some(failure);
        e
    }

    /// `failure`, as the error of the format it goes through (deserializing).
    fn lower_de<E: serde::de::Error>(&self, failure: Failure) -> E {
        let e = E::custom(&failure);
        *self.kept.borrow_mut() = Some(failure);
        e
    }

    /// The format's error `e`: the failure it carries, if one went through it.
    fn lift<E: Display>(&self, e: E) -> Failure {
        self.kept
            .borrow_mut()
            .take()
            .unwrap_or_else(|| Failure(e.to_string()))
    }
}

/// What one encode needs beyond the value: the agent, the destination, the forks made for the
/// references inside (for the message, or to undo), and the failure being carried out.
pub(super) struct EncodeContext<'a> {
    agent: &'a dyn References,
    to: WorkerId,
    forks: RefCell<Vec<RRefForkData>>,
    errors: Errors,
}

impl EncodeContext<'_> {
    /// Forks for the destination the reference whose [`Outgoing`] is `token`.
    fn fork<T: Serialize + ?Sized>(&self, token: &T) -> Result<RRefForkData, Failure> {
        let Outgoing { agent, handle } = Outgoing::read(token)?;
        if agent != self.agent.identity() {
            return Err(Failure(
                "an RRef can only be sent by the agent that holds it".into(),
            ));
        }
        let data = self
            .agent
            .fork(handle, self.to)
            .map_err(|e| Failure(e.to_string()))?;
        self.forks.borrow_mut().push(data);
        Ok(data)
    }
}

/// What one decode needs beyond the bytes: the agent, the forks the message announced (each
/// reference in the bytes must be one of them), the references accepted so far, and the failure
/// being carried out.
pub(super) struct DecodeContext<'a> {
    agent: &'a dyn References,
    /// The forks the message announced beside its bytes and not yet met in them.
    announced: RefCell<Vec<RRefForkData>>,
    /// The first fork met in the bytes that the message did not announce.
    unannounced: std::cell::Cell<Option<RRefForkData>>,
    accepted: RefCell<Vec<RRefHandle>>,
    errors: Errors,
}

/// What a remote reference hands the encoder: the agent holding it ([`References::identity`])
/// and its handle. It serializes only into the encoder (which reads it back): into anything
/// else it fails, which is how an `RRef` serialized outside a call says that it cannot be.
pub struct Outgoing {
    /// The agent holding the reference ([`References::identity`]).
    pub agent: u64,
    /// The reference's handle there.
    pub handle: RRefHandle,
}

const OUTSIDE_A_CALL: &str =
    "an RRef can only be sent as an argument or result of a tensorwire call";

impl Serialize for Outgoing {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error as _, SerializeTuple as _};
        let mut t = serializer.serialize_tuple(2)?;
        t.serialize_element(&self.agent)?;
        t.serialize_element(&self.handle)?;
        Err(S::Error::custom(OUTSIDE_A_CALL))
    }
}

impl Outgoing {
    /// The reference's agent and handle, from the [`Outgoing`] inside `token`.
    fn read<T: Serialize + ?Sized>(token: &T) -> Result<Self, Failure> {
        let mut words = postcard::Serializer {
            output: postcard::ser_flavors::AllocVec::new(),
        };
        // Fails by design, once the words are out.
        let _ = token.serialize(&mut words);
        let bytes = words
            .output
            .finalize()
            .map_err(|e| Failure(e.to_string()))?;
        let (agent, handle) = postcard::from_bytes::<(u64, RRefHandle)>(&bytes)
            .map_err(|_| Failure(OUTSIDE_A_CALL.into()))?;
        Ok(Outgoing { agent, handle })
    }
}

/// Encodes `value` for worker `to`, with the forks made for the references inside it. A
/// failed encode undoes the forks it made; a caller that then does not send the bytes must
/// undo them with [`References::cancel_forks`].
pub fn encode<T: Serialize + ?Sized>(
    agent: &dyn References,
    to: WorkerId,
    value: &T,
) -> Result<(Bytes, Vec<RRefForkData>), Failure> {
    let ctx = EncodeContext {
        agent,
        to,
        forks: RefCell::new(Vec::new()),
        errors: Errors::default(),
    };
    // Written in the thread's scratch buffer and copied out at its size (one allocation).
    let encoded = crate::wire::exact_bytes(|buf| {
        let mut out = postcard::Serializer {
            output: postcard::ser_flavors::ExtendFlavor::new(buf),
        };
        value
            .serialize(encoder::Encoder::new(&mut out, &ctx))
            .and_then(|()| out.output.finalize().map_err(|e| ctx.errors.lift(e)))
    });
    let forks = ctx.forks.into_inner();
    match encoded {
        Ok(bytes) => Ok((bytes, forks)),
        Err(e) => {
            agent.cancel_forks(to, &forks);
            Err(e)
        }
    }
}

/// Why received bytes did not decode into the expected value.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The bytes do not form the value (too few, or malformed).
    #[error("{0}")]
    Malformed(Failure),
    /// The bytes hold a remote reference that their message did not announce beside them (or
    /// announced fewer times): refused before it was accepted (see [`decode_with_references`]).
    #[error("the value holds {rref} (fork {fork}), which its message did not announce: a sender that hides a reference from the checks is refused")]
    Unannounced {
        /// The reference.
        rref: super::RRefId,
        /// The fork the bytes name.
        fork: super::ForkId,
    },
    /// The value decoded, with bytes to spare: the sender encoded something else (one argument
    /// too many, or another type). postcard is not self-describing, so this is what shows it.
    #[error(
        "{left} of {total} bytes were left over after decoding a {ty} (the sender sent more, or other types, than this side expects)"
    )]
    TrailingBytes {
        /// Bytes not consumed.
        left: usize,
        /// Bytes received.
        total: usize,
        /// The type decoded.
        ty: &'static str,
    },
}

/// Decodes a value received by this worker, with the tensors that came beside it and the
/// forks its message announced ([`Envelope::forks`](super::envelope::Envelope::forks) for a
/// request, [`Header::Reply`](super::Header::Reply)'s for a reply). Every byte must be used:
/// leftovers are an error, not silently ignored.
pub fn decode<T: DeserializeOwned>(
    agent: &dyn References,
    bytes: &[u8],
    tensors: Vec<Tensor>,
    announced: &[RRefForkData],
) -> Result<T, DecodeError> {
    decode_with_references(agent, bytes, tensors, announced).map(|(value, _)| value)
}

/// [`decode`], also returning the remote references the value holds (accepted here while
/// decoding), so that a function can wait until their owners have confirmed them.
///
/// A reference in the bytes must be one the message announced, each at most once: the
/// receiving endpoint checked and held those before anything decoded (the owner holds its
/// values from a request's arrival; a late reply's forks are released). One the message did
/// not announce is a [`DecodeError::Unannounced`], refused before it is accepted, so a peer
/// cannot slip past those checks a fork it does not hold.
pub fn decode_with_references<T: DeserializeOwned>(
    agent: &dyn References,
    bytes: &[u8],
    tensors: Vec<Tensor>,
    announced: &[RRefForkData],
) -> Result<(T, Vec<RRefHandle>), DecodeError> {
    let ctx = DecodeContext {
        agent,
        announced: RefCell::new(announced.to_vec()),
        unannounced: std::cell::Cell::new(None),
        accepted: RefCell::new(Vec::new()),
        errors: Errors::default(),
    };
    let mut input = postcard::Deserializer::from_bytes(bytes);
    let decoded = sidecar::provide_tensors(tensors, || {
        T::deserialize(decoder::Decoder::new(&mut input, &ctx))
    });
    let accepted = ctx.accepted.into_inner();
    // On failure, the references accepted so far went down with the partial value.
    let value = decoded.map_err(|e| match ctx.unannounced.get() {
        Some(f) => DecodeError::Unannounced {
            rref: f.rref,
            fork: f.fork,
        },
        None => DecodeError::Malformed(e),
    })?;
    let rest = input
        .finalize()
        .map_err(|e| DecodeError::Malformed(Failure(e.to_string())))?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            left: rest.len(),
            total: bytes.len(),
            ty: std::any::type_name::<T>(),
        });
    }
    Ok((value, accepted))
}

#[cfg(test)]
mod tests;
