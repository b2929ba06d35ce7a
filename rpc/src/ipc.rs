//! Same-host CUDA IPC in the agent: the driver of [`tensorwire_core::ipc`].
//!
//! A device tensor to another process on this host, landing on the GPU it leaves, travels as
//! an IPC descriptor instead of its bytes when the device backend can share memory
//! ([`DeviceBackend::ipc`]) and both workers agree ([`tensorwire_core::ipc::decide`]); core
//! decides, this module asks the backend to export and import and moves the IPC messages (hello,
//! release, refused) as control frames. The sender holds each exported buffer until the
//! receiver says it copied it out, or is lost. `RpcOptions::share_device_memory = false` or
//! `TENSORWIRE_CUDA_IPC=0` turns sharing off in a worker (its peers then stage too).

use tensorwire_core::device::Device;
use tensorwire_core::ipc::{IpcConfig, IpcState, Route, StagedReason};
use tensorwire_core::ports::device::{DeviceBackend, DeviceIpc};
use tensorwire_core::protocol::WorkerId;
use tensorwire_core::tensor::{Storage, Tensor, TensorMeta};

use crate::state::Agent;
use crate::state::IpcHeld as Held;
use crate::tensors::{TensorTransferError, WireTensors};
use tensorwire_core::protocol::tensors::{landing, IpcReceiver};

/// The IPC state of an agent over `backend` (sharing unless the backend cannot, `share` is
/// off, or `TENSORWIRE_CUDA_IPC=0`), for its node to own.
pub(crate) fn state(backend: &dyn DeviceBackend, share: bool, limits: IpcConfig) -> IpcState<Held> {
    let enabled = share && std::env::var("TENSORWIRE_CUDA_IPC").map_or(true, |v| v != "0");
    let me = backend.ipc().filter(|_| enabled).map(DeviceIpc::identity);
    IpcState::new(me, limits)
}

/// The bytes of each tensor for `to`: device tensors by IPC descriptor where core says so,
/// else copied off the device.
pub(crate) async fn to_wire(
    agent: &Agent,
    to: WorkerId,
    tensors: Vec<(Tensor, Device)>,
) -> Result<WireTensors, TensorTransferError> {
    let backend = agent.device_backend().clone();
    let me = agent.worker_info().id;
    let mut out = Vec::with_capacity(tensors.len());
    for (t, device) in tensors {
        let mut ipc = None;
        let bytes = match t.storage() {
            Storage::Host(b) => b.clone(),
            Storage::Device(buf) => {
                // An empty buffer has no memory to share: it travels as its (no) bytes.
                let route = match device {
                    Device::Cuda(_) if to != me && !buf.is_empty() => {
                        // A hello this queues goes out with the next frames the node sends
                        // (before the message that carries this tensor).
                        agent.lock().node.ipc_mut().route(
                            to,
                            buf.device(),
                            device,
                            buf.len() as u64,
                        )
                    }
                    _ => Route::Staged(StagedReason::SameProcess),
                };
                let shared = match (route, backend.ipc()) {
                    (Route::Ipc(id), Some(sharing)) => match sharing.export(buf).await {
                        Ok(export) => {
                            agent.lock().node.ipc_mut().exported(to, id, export.keep);
                            ipc = Some(id);
                            Some(export.descriptor)
                        }
                        Err(e) => {
                            tracing::debug!(peer = to, "IPC export failed, staging: {e}");
                            agent
                                .lock()
                                .node
                                .ipc_mut()
                                .export_failed(to, id, e.to_string());
                            None
                        }
                    },
                    (Route::Ipc(id), None) => {
                        let why = "the device backend does not share memory".to_owned();
                        agent.lock().node.ipc_mut().export_failed(to, id, why);
                        None
                    }
                    (Route::Staged(_), _) => None,
                };
                match shared {
                    Some(descriptor) => descriptor,
                    None => backend.to_host(buf).await?,
                }
            }
        };
        out.push((
            TensorMeta {
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
                device,
                ipc,
            },
            bytes,
        ));
    }
    Ok(out)
}

/// Received tensors from `from`, each placed on its landing device; IPC descriptors are
/// opened, copied device to device and released.
pub(crate) async fn from_wire(
    agent: &Agent,
    from: WorkerId,
    tensors: WireTensors,
) -> Result<Vec<Tensor>, TensorTransferError> {
    if tensors.is_empty() {
        // Most calls carry none: no backend, no IPC state to lock.
        return Ok(Vec::new());
    }
    let backend = agent.device_backend().clone();
    let receiver = match backend.ipc() {
        Some(_) => IpcReceiver::Opens,
        None => IpcReceiver::Unsupported,
    };
    let mut out = Vec::with_capacity(tensors.len());
    let (mut failed, mut shared) = (None, false);
    for (meta, bytes) in tensors {
        let on = landing(&meta, receiver, || backend.device_count());
        let Some(id) = meta.ipc else {
            out.push(crate::tensors::place(&*backend, meta, on?, bytes).await?);
            continue;
        };
        shared = true;
        let landed = match on {
            Ok(on) => crate::tensors::place(&*backend, meta, on, bytes).await,
            Err(e) => Err(e),
        };
        {
            let mut st = agent.lock();
            let ipc = st.node.ipc_mut();
            match &landed {
                Ok(_) => ipc.imported(from, id),
                Err(e) => ipc.import_failed(from, id, e.to_string()),
            }
        }
        match landed {
            Ok(t) => out.push(t),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    if shared {
        // The releases (and refusals) queued go out now: the sender holds the buffers.
        agent.pump();
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

#[cfg(test)]
mod tests;
