//! Encoding of arguments, results and agent messages.
//!
//! Arguments and results are postcard. A remote reference inside them is encoded as fork data:
//! encoding it *forks* it for the destination, decoding it *accepts* the fork. Both need the
//! agent and (for encoding) the destination, which a thread-local context provides for the
//! duration of one synchronous encode or decode.

use std::cell::RefCell;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tensorwire_core::protocol::{Header, RRefForkData, RRefHandle, RRefId, WorkerId};
use tensorwire_core::tensor::{sidecar, Tensor, TensorMeta};

use crate::agent::Agent;

thread_local! {
    /// The message of the last custom serialization error on this thread (postcard keeps only
    /// "Serde Serialization Error").
    static NOTE: RefCell<Option<String>> = const { RefCell::new(None) };
    static ENCODING: RefCell<Option<(Agent, WorkerId)>> = const { RefCell::new(None) };
    static DECODING: RefCell<Option<Agent>> = const { RefCell::new(None) };
    /// The references accepted by the decode in progress on this thread.
    static ACCEPTED: RefCell<Vec<RRefHandle>> = const { RefCell::new(Vec::new()) };
    /// The forks made by the encode in progress on this thread.
    static FORKED: RefCell<Vec<RRefForkData>> = const { RefCell::new(Vec::new()) };
}

/// Restores the previous context when dropped (encodes may nest).
struct Restore<T: 'static>(
    &'static std::thread::LocalKey<RefCell<Option<T>>>,
    Option<T>,
);

impl<T: 'static> Drop for Restore<T> {
    fn drop(&mut self) {
        let prev = self.1.take();
        self.0.with(|c| *c.borrow_mut() = prev);
    }
}

/// Encodes `value` for worker `to`, with the forks made for the references inside it. A
/// failed encode undoes the forks it made; a caller that then does not send the bytes must
/// undo them with [`Agent::cancel_forks`].
pub(crate) fn encode<T: Serialize + ?Sized>(
    agent: &Agent,
    to: WorkerId,
    value: &T,
) -> Result<(Bytes, Vec<RRefForkData>), postcard::Error> {
    let prev = ENCODING.with(|c| c.borrow_mut().replace((agent.clone(), to)));
    let _restore = Restore(&ENCODING, prev);
    let outer = FORKED.with(|f| std::mem::take(&mut *f.borrow_mut()));
    let encoded = postcard::to_allocvec(value);
    let forks = FORKED.with(|f| std::mem::replace(&mut *f.borrow_mut(), outer));
    match encoded {
        Ok(bytes) => Ok((Bytes::from(bytes), forks)),
        Err(e) => {
            agent.cancel_forks(to, &forks);
            Err(e)
        }
    }
}

/// Notes a fork made by the encode in progress on this thread.
pub(crate) fn forked(data: RRefForkData) {
    FORKED.with(|f| f.borrow_mut().push(data));
}

/// Why received bytes did not decode into the expected value.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    /// The bytes do not form the value (too few, or malformed).
    #[error("{0}")]
    Malformed(#[from] postcard::Error),
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

/// Decodes a value received by this worker, with the tensors that came beside it. Every byte
/// must be used: leftovers are an error, not silently ignored.
pub(crate) fn decode<T: DeserializeOwned>(
    agent: &Agent,
    bytes: &[u8],
    tensors: Vec<Tensor>,
) -> Result<T, DecodeError> {
    decode_with_references(agent, bytes, tensors).map(|(value, _)| value)
}

/// [`decode`], also returning the remote references the value holds (accepted here while
/// decoding), so that a function can wait until their owners have confirmed them.
pub(crate) fn decode_with_references<T: DeserializeOwned>(
    agent: &Agent,
    bytes: &[u8],
    tensors: Vec<Tensor>,
) -> Result<(T, Vec<RRefHandle>), DecodeError> {
    let prev = DECODING.with(|c| c.borrow_mut().replace(agent.clone()));
    let _restore = Restore(&DECODING, prev);
    let outer = ACCEPTED.with(|a| std::mem::take(&mut *a.borrow_mut()));
    let decoded = sidecar::provide_tensors(tensors, || postcard::take_from_bytes(bytes));
    let accepted = ACCEPTED.with(|a| std::mem::replace(&mut *a.borrow_mut(), outer));
    let (value, rest) = decoded?;
    if !rest.is_empty() {
        return Err(DecodeError::TrailingBytes {
            left: rest.len(),
            total: bytes.len(),
            ty: std::any::type_name::<T>(),
        });
    }
    Ok((value, accepted))
}

/// Notes a reference accepted by the decode in progress on this thread.
pub(crate) fn accepted(handle: RRefHandle) {
    ACCEPTED.with(|a| a.borrow_mut().push(handle));
}

/// Remembers why a value could not be serialized, for the error the caller gets.
pub(crate) fn note(message: impl Into<String>) {
    NOTE.with(|n| *n.borrow_mut() = Some(message.into()));
}

/// The message remembered by [`note`], if any (taking it).
pub(crate) fn take_note() -> Option<String> {
    NOTE.with(|n| n.borrow_mut().take())
}

/// The agent and destination of the encode in progress on this thread.
pub(crate) fn encoding() -> Option<(Agent, WorkerId)> {
    ENCODING.with(|c| c.borrow().clone())
}

/// The agent of the decode in progress on this thread.
pub(crate) fn decoding() -> Option<Agent> {
    DECODING.with(|c| c.borrow().clone())
}

/// The header of every agent frame: the protocol header and, for methods, the reference whose
/// value the function is called on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Envelope {
    pub(crate) header: Header,
    pub(crate) target: Option<RRefId>,
    /// The tensors whose bytes follow the encoded value as payloads, in order.
    pub(crate) tensors: Vec<TensorMeta>,
}
