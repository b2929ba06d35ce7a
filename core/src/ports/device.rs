//! The `DeviceBackend` port: how tensors get onto, off and between devices.
//!
//! The agent moves a request's tensors by the caller's device map and a response's by the
//! callee's reverse map (see [`placement`](crate::placement)); a backend does the copies. Two
//! adapters implement it: the simulated backend ([`SimulatedDevices`](crate::devices_sim::SimulatedDevices),
//! host memory posing as CUDA devices, for tests and GPU-less machines) and the CUDA backend
//! (`tensorwire-devices-cuda`).

use async_trait::async_trait;
use bytes::Bytes;

use crate::device::Device;
use crate::ipc::IpcIdentity;
use crate::tensor::{DeviceBuffer, Storage, Tensor};

/// Why a backend has no devices.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceUnavailable {
    /// The driver library could not be loaded.
    #[error("the CUDA driver library could not be loaded ({0}); is an NVIDIA driver installed?")]
    LibraryNotFound(String),
    /// The driver loaded but reports no device.
    #[error("the CUDA driver reports no device")]
    NoDevice,
    /// The driver is older than the backend needs.
    #[error("the CUDA driver is too old: it supports CUDA {found}, {needed} or newer is needed")]
    DriverTooOld {
        /// The version the driver supports (e.g. `11.4`).
        found: String,
        /// The version needed.
        needed: String,
    },
    /// Initialising the driver failed.
    #[error("CUDA initialisation failed: {0}")]
    InitFailed(String),
}

/// A device operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The backend has no devices at all.
    #[error("no CUDA devices: {0}")]
    Unavailable(DeviceUnavailable),
    /// The device index is not below the device count.
    #[error("device {device} does not exist (this worker has {count} CUDA devices)")]
    NoSuchDevice {
        /// The device asked for.
        device: Device,
        /// How many there are.
        count: u32,
    },
    /// The buffer was made by another backend.
    #[error("the buffer on {0} belongs to another device backend")]
    ForeignBuffer(Device),
    /// The backend failed.
    #[error("{op} on {device} failed: {message}")]
    Backend {
        /// The device.
        device: Device,
        /// What was being done.
        op: &'static str,
        /// The backend's message.
        message: String,
    },
}

/// Copies between host memory and devices.
#[async_trait]
pub trait DeviceBackend: Send + Sync + 'static {
    /// A short name for logs (`"simulated"`, `"cuda"`).
    fn name(&self) -> &'static str;

    /// How many CUDA devices there are (0 when unavailable).
    fn device_count(&self) -> u32;

    /// Why there are none, when [`device_count`](Self::device_count) is 0.
    fn unavailable(&self) -> Option<DeviceUnavailable>;

    /// Copies host bytes into a new buffer on `device` (a CUDA device).
    async fn to_device(&self, data: Bytes, device: Device) -> Result<DeviceBuffer, DeviceError>;

    /// Copies a device buffer into host memory. When this returns, the bytes are complete.
    async fn to_host(&self, buffer: &DeviceBuffer) -> Result<Bytes, DeviceError>;

    /// Copies a device buffer to another device (peer-to-peer where possible).
    async fn between(&self, buffer: &DeviceBuffer, to: Device)
        -> Result<DeviceBuffer, DeviceError>;

    /// Sharing device memory with other processes on this host (CUDA IPC), when the backend
    /// can. The default: it cannot, and device tensors to other processes are staged through
    /// host memory.
    fn ipc(&self) -> Option<&dyn DeviceIpc> {
        None
    }
}

/// A device buffer exported to another process: what travels, and what keeps it valid.
pub struct IpcExport {
    /// What the receiver's backend needs to open it (the backend's own encoding: for CUDA, the
    /// memory and event handles, the offset and the length).
    pub descriptor: Bytes,
    /// Keeps the memory (and whatever orders it) valid and unused until the receiver releases
    /// it: dropping it lets the memory be reused.
    pub keep: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for IpcExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcExport")
            .field("descriptor", &self.descriptor.len())
            .finish_non_exhaustive()
    }
}

/// Device memory shared between processes of one host (see [`crate::ipc`] for when it is used
/// and how long an export lives).
#[async_trait]
pub trait DeviceIpc: Send + Sync {
    /// Who this process is, for its peers' decision (host, namespaces, GPUs).
    fn identity(&self) -> IpcIdentity;

    /// Exports `buffer` for another process: its descriptor, and what keeps it valid.
    async fn export(&self, buffer: &DeviceBuffer) -> Result<IpcExport, DeviceError>;

    /// Opens another process's export, copies its `len` bytes device to device into a new
    /// buffer on `to`, waits for the copy, and closes the handle. A descriptor that is
    /// malformed, of another length, or cannot be opened is an error.
    async fn import(
        &self,
        descriptor: &[u8],
        len: usize,
        to: Device,
    ) -> Result<DeviceBuffer, DeviceError>;
}

/// Moves `tensor` to `to` through `backend` (no copy when it is already there).
pub async fn relocate(
    backend: &dyn DeviceBackend,
    tensor: &Tensor,
    to: Device,
) -> Result<Tensor, DeviceError> {
    if tensor.device() == to {
        return Ok(tensor.clone());
    }
    let storage = match (tensor.storage(), to) {
        (Storage::Host(b), Device::Cuda(_)) => {
            Storage::Device(backend.to_device(b.clone(), to).await?)
        }
        (Storage::Device(d), Device::Cpu) => Storage::Host(backend.to_host(d).await?),
        (Storage::Device(d), Device::Cuda(_)) => Storage::Device(backend.between(d, to).await?),
        (Storage::Host(_), Device::Cpu) => return Ok(tensor.clone()),
    };
    Ok(tensor
        .with_storage(storage)
        .expect("a backend copy keeps the byte length"))
}
