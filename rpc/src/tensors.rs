//! Tensors beside messages: where they land (device maps) and how their bytes travel.
//!
//! Sending: the value is encoded with its tensors set aside; each tensor's landing device comes
//! from the caller's device map for the destination (requests) or the callee's reverse map for
//! the caller (responses), and a CUDA tensor without an entry fails at once, naming the
//! destination and the device. Device tensors are copied to host memory by the device backend;
//! host tensors travel as they are. Receiving: each tensor is placed on its landing device
//! before the value is decoded, so a handler or a caller sees tensors where the maps say.

use bytes::Bytes;
use serde::Serialize;
use tensorwire_core::device::{Device, DeviceMap};
use tensorwire_core::placement::{placements, Direction, PlacementError};
use tensorwire_core::ports::device::{DeviceBackend, DeviceError};
use tensorwire_core::protocol::RRefForkData;
use tensorwire_core::protocol::WorkerId;
use tensorwire_core::tensor::{sidecar, Storage, Tensor, TensorError, TensorMeta};

use tensorwire_core::protocol::value as codec;

/// Tensors as they travel: where each lands, and its bytes.
pub(crate) type WireTensors = Vec<(TensorMeta, Bytes)>;

/// What preparing a value for a peer needs of the agent: the codec's references, the peers'
/// names and the device maps toward them. The agent implements it; this module names no agent
/// type.
pub trait Routes: codec::References {
    /// The name of worker `id`.
    fn name_of(&self, id: WorkerId) -> String;
    /// The device map toward worker `to_name` for a message going in `direction`: this
    /// worker's own map for requests, the reverse map (the caller's, read backwards) for
    /// responses.
    fn device_map(&self, to_name: &str, direction: Direction) -> Option<DeviceMap>;
}

/// Why a message's tensors could not be sent or received
/// ([`RpcError::Tensors`](crate::RpcError::Tensors)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TensorTransferError {
    /// The value around the tensors could not be encoded.
    #[error(transparent)]
    Encode(#[from] codec::Failure),
    /// A tensor cannot go where it is (no device map entry for its device, ...).
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// The device backend failed to copy a tensor.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A received tensor is to land on a device this worker does not have.
    #[error(
        "a tensor is to land on {device}, which this worker does not have ({count} CUDA devices)"
    )]
    NoSuchDevice {
        /// Its landing device.
        device: Device,
        /// This worker's CUDA devices.
        count: u32,
    },
    /// A received tensor is malformed.
    #[error("a received tensor is malformed: {0}")]
    Malformed(#[source] MalformedTensor),
}

/// How a received tensor is malformed ([`TensorTransferError::Malformed`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MalformedTensor {
    /// It came by IPC handle where no agent can open one (outside an agent).
    #[error("a tensor came by IPC handle outside an agent")]
    IpcOutsideAgent,
    /// It came by IPC handle, which this worker's device backend cannot open.
    #[error("a tensor came by IPC handle, which this worker's device backend cannot open")]
    IpcUnsupported,
    /// It came by IPC handle while landing on the cpu.
    #[error("a tensor landing on the cpu came by IPC handle")]
    IpcOnCpu,
    /// Its bytes do not fit its type and shape (or the shape overflows).
    #[error(transparent)]
    Shape(#[from] TensorError),
}

/// A value encoded for `to`, with its tensors and where they land there.
pub(crate) struct Prepared {
    pub(crate) data: Bytes,
    pub(crate) tensors: Vec<(Tensor, Device)>,
    /// The forks made for the references inside: undone if the message is never sent.
    pub(crate) forks: Vec<RRefForkData>,
}

impl Prepared {
    /// Whether every tensor is in host memory (nothing to copy before sending).
    pub(crate) fn on_host(&self) -> bool {
        self.tensors.iter().all(|(t, _)| t.device().is_cpu())
    }
}

/// Encodes `value` for `to` and decides where its tensors land.
pub(crate) fn prepare<T: Serialize + ?Sized>(
    agent: &dyn Routes,
    to: WorkerId,
    value: &T,
    direction: Direction,
) -> Result<Prepared, TensorTransferError> {
    let (encoded, tensors) = sidecar::collect_tensors(|| codec::encode(agent, to, value));
    let (data, forks) = encoded?;
    if tensors.is_empty() {
        return Ok(Prepared {
            data,
            tensors: Vec::new(),
            forks,
        });
    }
    let to_name = agent.name_of(to);
    let map = agent.device_map(&to_name, direction);
    let landing = match placements(
        &to_name,
        map.as_ref(),
        tensors.iter().map(Tensor::device),
        direction,
    ) {
        Ok(landing) => landing,
        Err(e) => {
            // Nothing will be sent: the forks made while encoding are undone.
            agent.cancel_forks(to, &forks);
            return Err(e.into());
        }
    };
    Ok(Prepared {
        data,
        tensors: tensors.into_iter().zip(landing).collect(),
        forks,
    })
}

/// Host-only tensors as they travel (no copies, no waiting).
pub(crate) fn host_to_wire(tensors: Vec<(Tensor, Device)>) -> WireTensors {
    tensors
        .into_iter()
        .filter_map(|(t, device)| {
            let bytes = t.host_bytes()?.clone();
            Some((
                TensorMeta {
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    device,
                    ipc: None,
                },
                bytes,
            ))
        })
        .collect()
}

/// Received tensors, each placed on its landing device (bytes only: an IPC descriptor is
/// refused here; the agent's `ipc::from_wire` opens them).
pub(crate) async fn from_wire(
    backend: &dyn DeviceBackend,
    tensors: WireTensors,
) -> Result<Vec<Tensor>, TensorTransferError> {
    let mut out = Vec::with_capacity(tensors.len());
    for (meta, bytes) in tensors {
        if meta.ipc.is_some() {
            return Err(TensorTransferError::Malformed(
                MalformedTensor::IpcOutsideAgent,
            ));
        }
        out.push(place(backend, meta, bytes).await?);
    }
    Ok(out)
}

/// One received tensor's bytes, placed on its landing device.
pub(crate) async fn place(
    backend: &dyn DeviceBackend,
    meta: TensorMeta,
    bytes: Bytes,
) -> Result<Tensor, TensorTransferError> {
    let storage = match meta.device {
        Device::Cpu => Storage::Host(bytes),
        d @ Device::Cuda(i) => {
            let count = backend.device_count();
            if u32::from(i) >= count {
                return Err(TensorTransferError::NoSuchDevice { device: d, count });
            }
            Storage::Device(backend.to_device(bytes, d).await?)
        }
    };
    Tensor::new(meta.dtype, meta.shape, storage)
        .map_err(|e| TensorTransferError::Malformed(e.into()))
}
