//! What the agent does with a received frame, up to the protocol endpoint, for the `rpc` fuzz
//! target in `fuzz/`. Not part of the API: it may change at any time.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use tensorwire_core::devices_sim::SimulatedDevices;
use tensorwire_core::protocol::{Header, MethodTarget};
use tensorwire_core::tensor::{Tensor, TensorMeta};
use tensorwire_core::wire::Frame;

use crate::tensors;
use tensorwire_core::protocol::envelope::Envelope;

/// A decoded message's body: its bytes and the tensors beside them.
pub type Body = (bytes::Bytes, Vec<Tensor>);

/// Decodes `frame` as a connection's first frame (who is speaking, for which group), as the
/// agent's dynamic groups and process groups do. Returns the peer's rank and group.
pub fn decode_hello(frame: &Frame) -> Result<(u32, String), String> {
    let hello = tensorwire_mesh::link::Hello::from_frame(frame).map_err(|e| e.to_string())?;
    Ok((hello.rank, hello.group))
}

/// Decodes `frame` as a later message, as the agent does before handing it to its protocol
/// endpoint: the header, the tensors announced against those carried, and each tensor's bytes
/// against its type and shape, landing on a worker with `devices` (simulated) CUDA devices.
/// Returns the header, the body's bytes and its tensors, or why the frame was refused (the
/// agent drops the connection with that reason).
pub fn decode_message(frame: Frame, devices: u32) -> Result<(Header, Option<Body>), String> {
    // The agent's own decoder and payload check (`driver::on_frame`): core's envelope.
    let envelope = Envelope::decode(&frame.header).map_err(|e| e.to_string())?;
    let (header, body) = envelope.attach(frame.payloads).map_err(|e| e.to_string())?;
    let Some(body) = body else {
        return Ok((header, None));
    };
    let backend = SimulatedDevices::new(devices);
    let tensors = ready(tensors::from_wire(&backend, body.tensors)).map_err(|e| e.to_string())?;
    Ok((header, Some((body.data, tensors))))
}

/// Encodes a message header as the agent sends it, announcing `tensors` (no target).
pub fn encode_message_header(header: &Header, tensors: &[TensorMeta]) -> Vec<u8> {
    encode_method_header(header, None, tensors)
}

/// Encodes a message header as the agent sends it for a method call (or remote method) on
/// `target` (`None`: a plain call), announcing `tensors`.
pub fn encode_method_header(
    header: &Header,
    target: Option<MethodTarget>,
    tensors: &[TensorMeta],
) -> Vec<u8> {
    Envelope {
        header: header.clone(),
        target,
        forks: Vec::new(),
        tensors: tensors.to_vec(),
    }
    .encode()
    .expect("a header encodes")
}

/// A connection's first frame, as [`decode_hello`] reads it: rank `rank` of group `group`,
/// without a world size (as a dynamic group's joiner sends it).
pub fn encode_hello(rank: u32, group: &str) -> Frame {
    tensorwire_mesh::link::Hello {
        group: group.to_owned(),
        rank,
        world: None,
        introduction: Vec::new(),
    }
    .frame()
}

/// Runs a future that never waits (the simulated device backend's copies).
fn ready<F: Future>(fut: F) -> F::Output {
    let mut fut = pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("the simulated device backend never waits"),
    }
}
