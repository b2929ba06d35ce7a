//! Tensors beside messages: the driver of [`tensorwire_core::protocol::tensors`], which
//! decides where they land and why they cannot (encoding and placing for a peer, the checks of
//! a received tensor). Here the device backend copies received tensors onto their landing
//! device.

use bytes::Bytes;
use tensorwire_core::ports::device::DeviceBackend;
use tensorwire_core::protocol::tensors::{landing, IpcReceiver, Landing};
use tensorwire_core::tensor::{Storage, Tensor, TensorMeta};

pub(crate) use tensorwire_core::protocol::tensors::{
    host_to_wire, prepare, Prepared, Routes, WireTensors,
};
pub use tensorwire_core::protocol::tensors::{MalformedTensor, TensorTransferError};

/// Received tensors, each placed on its landing device (bytes only: an IPC descriptor is
/// refused here; the agent's `ipc::from_wire` opens them).
pub(crate) async fn from_wire(
    backend: &dyn DeviceBackend,
    tensors: WireTensors,
) -> Result<Vec<Tensor>, TensorTransferError> {
    let mut out = Vec::with_capacity(tensors.len());
    for (meta, bytes) in tensors {
        let on = landing(&meta, IpcReceiver::None, || backend.device_count())?;
        out.push(place(backend, meta, on, bytes).await?);
    }
    Ok(out)
}

/// One received tensor's bytes, placed where core's [`landing`] says `on`: in host memory, on
/// a device, or (its bytes an IPC descriptor) opened there by the backend's sharing.
pub(crate) async fn place(
    backend: &dyn DeviceBackend,
    meta: TensorMeta,
    on: Landing,
    bytes: Bytes,
) -> Result<Tensor, TensorTransferError> {
    let storage = match on {
        Landing::Host => Storage::Host(bytes),
        Landing::Device(d) => Storage::Device(backend.to_device(bytes, d).await?),
        Landing::Ipc { device, len } => {
            let Some(sharing) = backend.ipc() else {
                return Err(TensorTransferError::Malformed(
                    MalformedTensor::IpcUnsupported,
                ));
            };
            Storage::Device(sharing.import(&bytes, len, device).await?)
        }
    };
    Ok(Tensor::new(meta.dtype, meta.shape, storage)?)
}
