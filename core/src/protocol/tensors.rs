//! Tensors beside messages: where they land (device maps) and how their bytes travel, decided
//! here; the agent copies them on and off its devices.
//!
//! Sending ([`prepare`]): the value is encoded with its tensors set aside; each tensor's
//! landing device comes from the caller's device map for the destination (requests) or the
//! callee's reverse map for the caller (responses), and a CUDA tensor without an entry fails at
//! once, naming the destination and the device (the forks the encode made are undone: nothing
//! will be sent). Host tensors travel as they are ([`host_to_wire`]); device tensors are copied
//! to host memory (or shared by IPC handle) by the agent. Receiving ([`landing`]): each tensor
//! is checked for where it is to land before the agent places it, so a handler or a caller sees
//! tensors where the maps say, and a tensor that cannot land here is a typed error
//! ([`TensorTransferError`]).

use bytes::Bytes;
use serde::Serialize;

use super::value as codec;
use super::{RRefForkData, WorkerId};
use crate::device::{Device, DeviceMap};
use crate::placement::{placements, Direction, PlacementError};
use crate::ports::device::DeviceError;
use crate::tensor::{byte_len, sidecar, Tensor, TensorError, TensorMeta};

/// Tensors as they travel: where each lands, and its bytes.
pub type WireTensors = Vec<(TensorMeta, Bytes)>;

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

/// Why a message's tensors could not be sent or received (the agent's `RpcError::Tensors`).
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

impl From<TensorError> for TensorTransferError {
    fn from(e: TensorError) -> Self {
        TensorTransferError::Malformed(e.into())
    }
}

/// A value encoded for `to`, with its tensors and where they land there.
#[derive(Debug)]
pub struct Prepared {
    /// The encoded value.
    pub data: Bytes,
    /// Its tensors, each with its landing device at the destination.
    pub tensors: Vec<(Tensor, Device)>,
    /// The forks made for the references inside: undone if the message is never sent.
    pub forks: Vec<RRefForkData>,
}

impl Prepared {
    /// Whether every tensor is in host memory (nothing to copy before sending).
    pub fn on_host(&self) -> bool {
        self.tensors.iter().all(|(t, _)| t.device().is_cpu())
    }
}

/// Encodes `value` for `to` and decides where its tensors land. A tensor that cannot go to
/// `to` fails it, and the forks the encode made are undone (nothing will be sent).
pub fn prepare<T: Serialize + ?Sized>(
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
pub fn host_to_wire(tensors: Vec<(Tensor, Device)>) -> WireTensors {
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

/// Who receives a tensor that came by IPC handle ([`landing`]'s `ipc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpcReceiver {
    /// No agent: nothing here can open a handle.
    None,
    /// An agent whose device backend cannot open one.
    Unsupported,
    /// An agent whose device backend opens them.
    Opens,
}

/// How a received tensor's bytes become the tensor on its landing device ([`landing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landing {
    /// In host memory: its bytes as they came.
    Host,
    /// On this worker's device: its bytes copied there.
    Device(Device),
    /// Its bytes are an IPC descriptor, opened on its landing device as `len` bytes, copied
    /// device to device and released.
    Ipc {
        /// The landing device.
        device: Device,
        /// The bytes its type and shape take.
        len: usize,
    },
}

/// Where and how the tensor `meta` describes lands here, or why it cannot: a handle where
/// `ipc` cannot open one, a handle landing on the cpu, a shape that overflows, a device this
/// worker does not have (`device_count` is asked only for a CUDA device reached by bytes).
pub fn landing(
    meta: &TensorMeta,
    ipc: IpcReceiver,
    device_count: impl FnOnce() -> u32,
) -> Result<Landing, TensorTransferError> {
    let malformed = |m| Err(TensorTransferError::Malformed(m));
    if meta.ipc.is_some() {
        return match ipc {
            IpcReceiver::None => malformed(MalformedTensor::IpcOutsideAgent),
            IpcReceiver::Unsupported => malformed(MalformedTensor::IpcUnsupported),
            IpcReceiver::Opens if meta.device.is_cpu() => malformed(MalformedTensor::IpcOnCpu),
            IpcReceiver::Opens => Ok(Landing::Ipc {
                device: meta.device,
                len: byte_len(meta.dtype, &meta.shape)?,
            }),
        };
    }
    match meta.device {
        Device::Cpu => Ok(Landing::Host),
        d @ Device::Cuda(i) => {
            let count = device_count();
            if u32::from(i) >= count {
                return Err(TensorTransferError::NoSuchDevice { device: d, count });
            }
            Ok(Landing::Device(d))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    fn meta(device: Device, shape: Vec<usize>, ipc: bool) -> TensorMeta {
        TensorMeta {
            dtype: DType::F32,
            shape,
            device,
            ipc: ipc.then_some(7),
        }
    }

    #[test]
    fn bytes_land_on_the_host_or_a_device_this_worker_has() {
        let never = || -> u32 { panic!("the device count is asked only for CUDA") };
        let cpu = meta(Device::Cpu, vec![2], false);
        assert_eq!(
            landing(&cpu, IpcReceiver::None, never).unwrap(),
            Landing::Host
        );
        let cuda1 = meta(Device::Cuda(1), vec![2], false);
        assert_eq!(
            landing(&cuda1, IpcReceiver::Opens, || 2).unwrap(),
            Landing::Device(Device::Cuda(1))
        );
        let e = landing(&cuda1, IpcReceiver::Opens, || 1).unwrap_err();
        assert!(
            matches!(e, TensorTransferError::NoSuchDevice { count: 1, .. }),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "a tensor is to land on cuda:1, which this worker does not have (1 CUDA devices)"
        );
    }

    #[test]
    fn a_handle_lands_only_where_an_agent_opens_it_on_a_device() {
        let handle = meta(Device::Cuda(0), vec![2, 3], true);
        let malformed = |ipc, m: &TensorMeta| match landing(m, ipc, || 1) {
            Err(TensorTransferError::Malformed(m)) => m,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            malformed(IpcReceiver::None, &handle),
            MalformedTensor::IpcOutsideAgent
        );
        assert_eq!(
            malformed(IpcReceiver::Unsupported, &handle),
            MalformedTensor::IpcUnsupported
        );
        let on_cpu = meta(Device::Cpu, vec![2], true);
        assert_eq!(
            malformed(IpcReceiver::Opens, &on_cpu),
            MalformedTensor::IpcOnCpu
        );
        assert_eq!(
            landing(&handle, IpcReceiver::Opens, || 0).unwrap(),
            Landing::Ipc {
                device: Device::Cuda(0),
                len: 24
            }
        );
        let huge = meta(Device::Cuda(0), vec![usize::MAX, 2], true);
        assert!(matches!(
            malformed(IpcReceiver::Opens, &huge),
            MalformedTensor::Shape(TensorError::Overflow(_))
        ));
    }
}
