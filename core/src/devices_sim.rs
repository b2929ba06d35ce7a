//! The simulated device backend: host memory posing as N CUDA devices.
//!
//! Every device-map path (host to device, device to host, device to device, wrong indices) can
//! run in CI without a GPU. A buffer remembers the device it was "placed" on; copies are real
//! copies of the bytes, so a test that compares bytes after a round trip checks something.
//!
//! With [`SimulatedDevices::sharing`] the backend also shares memory between instances of one
//! process as CUDA IPC would between processes of one host ([`DeviceIpc`]): each instance poses
//! as its own process on a simulated host, an export is registered until the exporter drops
//! it, and an import after that fails as opening a freed handle would, so tests of the
//! lifetime rules can see a buffer released too early.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use bytes::Bytes;

use crate::device::Device;
use crate::ipc::{GpuIdentity, HostIdentity, IpcIdentity};
use crate::ports::device::{DeviceBackend, DeviceError, DeviceIpc, DeviceUnavailable, IpcExport};
use crate::tensor::DeviceBuffer;

/// The bytes of one simulated device buffer.
#[derive(Debug)]
struct SimBuffer {
    /// Which `SimulatedDevices` made it (buffers of one instance are foreign to another).
    owner: u64,
    data: Bytes,
}

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// Host memory posing as `count` CUDA devices.
#[derive(Debug)]
pub struct SimulatedDevices {
    count: u32,
    instance: u64,
    copies: AtomicU64,
    host: Option<SimHost>,
}

/// Where a sharing simulated backend poses to run (see [`SimulatedDevices::sharing`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimHost {
    /// The host's name (its boot id): instances on different hosts never share.
    pub name: String,
    /// The container (its namespaces): instances in different containers never share.
    pub container: u64,
    /// Whether the devices are MIG instances.
    pub mig: bool,
}

impl SimHost {
    /// A host named `name`, one container, no MIG.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            container: 1,
            mig: false,
        }
    }
}

/// Exports alive in this process: key → (host name, bytes).
fn exports() -> &'static Mutex<HashMap<u64, (String, Bytes)>> {
    static EXPORTS: OnceLock<Mutex<HashMap<u64, (String, Bytes)>>> = OnceLock::new();
    EXPORTS.get_or_init(Default::default)
}

static NEXT_EXPORT: AtomicU64 = AtomicU64::new(1);

/// Keeps one simulated export open; dropping it closes it.
#[derive(Debug)]
struct SimExport(u64);

impl Drop for SimExport {
    fn drop(&mut self) {
        exports()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.0);
    }
}

impl SimulatedDevices {
    /// A backend with `count` simulated devices (`cuda:0` .. `cuda:{count-1}`).
    pub fn new(count: u32) -> Self {
        Self {
            count,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            copies: AtomicU64::new(0),
            host: None,
        }
    }

    /// A backend with `count` simulated devices that shares memory (simulated CUDA IPC) with
    /// other sharing instances of this process on the same [`SimHost`]. Each instance poses as
    /// its own process; device `cuda:N` is the same simulated GPU on every instance of a host.
    pub fn sharing(count: u32, host: SimHost) -> Self {
        Self {
            host: Some(host),
            ..Self::new(count)
        }
    }

    /// Exports alive in this process (opened by an exporter, not yet released).
    pub fn live_exports() -> usize {
        exports()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// Copies made so far (tests use it to check that no needless copy happens).
    pub fn copies(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }

    fn check(&self, device: Device) -> Result<(), DeviceError> {
        match device {
            Device::Cuda(i) if u32::from(i) < self.count => Ok(()),
            Device::Cuda(_) if self.count == 0 => {
                Err(DeviceError::Unavailable(DeviceUnavailable::NoDevice))
            }
            _ => Err(DeviceError::NoSuchDevice {
                device,
                count: self.count,
            }),
        }
    }

    fn bytes_of<'a>(&self, buffer: &'a DeviceBuffer) -> Result<&'a Bytes, DeviceError> {
        match buffer.handle::<SimBuffer>() {
            Some(b) if b.owner == self.instance => Ok(&b.data),
            _ => Err(DeviceError::ForeignBuffer(buffer.device())),
        }
    }

    fn place(&self, data: Bytes, device: Device) -> DeviceBuffer {
        self.copies.fetch_add(1, Ordering::Relaxed);
        // A real copy, as a device would make.
        let data = Bytes::copy_from_slice(&data);
        let len = data.len();
        DeviceBuffer::new(
            device,
            len,
            Arc::new(SimBuffer {
                owner: self.instance,
                data,
            }),
        )
    }
}

#[async_trait]
impl DeviceBackend for SimulatedDevices {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn device_count(&self) -> u32 {
        self.count
    }

    fn unavailable(&self) -> Option<DeviceUnavailable> {
        (self.count == 0).then_some(DeviceUnavailable::NoDevice)
    }

    async fn to_device(&self, data: Bytes, device: Device) -> Result<DeviceBuffer, DeviceError> {
        self.check(device)?;
        Ok(self.place(data, device))
    }

    async fn to_host(&self, buffer: &DeviceBuffer) -> Result<Bytes, DeviceError> {
        let data = self.bytes_of(buffer)?;
        self.copies.fetch_add(1, Ordering::Relaxed);
        Ok(Bytes::copy_from_slice(data))
    }

    async fn between(
        &self,
        buffer: &DeviceBuffer,
        to: Device,
    ) -> Result<DeviceBuffer, DeviceError> {
        self.check(to)?;
        let data = self.bytes_of(buffer)?.clone();
        Ok(self.place(data, to))
    }

    fn ipc(&self) -> Option<&dyn DeviceIpc> {
        self.host.as_ref().map(|_| self as &dyn DeviceIpc)
    }
}

#[async_trait]
impl DeviceIpc for SimulatedDevices {
    fn identity(&self) -> IpcIdentity {
        let host = self
            .host
            .clone()
            .unwrap_or_else(|| SimHost::new("unshared"));
        // One simulated GPU per index and host name.
        let gpu = |i: u32| {
            let mut uuid = [0u8; 16];
            let name = host.name.as_bytes();
            for (k, b) in uuid.iter_mut().enumerate() {
                *b = name.get(k).copied().unwrap_or(0) ^ (i as u8);
            }
            uuid[15] = i as u8;
            GpuIdentity {
                uuid,
                mig: host.mig,
            }
        };
        IpcIdentity {
            host: HostIdentity {
                boot_id: host.name.clone(),
                ipc_namespace: host.container,
                pid_namespace: host.container,
                pid: u32::try_from(self.instance).unwrap_or(u32::MAX),
            },
            gpus: (0..self.count).map(gpu).collect(),
        }
    }

    async fn export(&self, buffer: &DeviceBuffer) -> Result<IpcExport, DeviceError> {
        let host = self.host.as_ref().ok_or(DeviceError::Backend {
            device: buffer.device(),
            op: "IPC export",
            message: "this simulated backend does not share memory".into(),
        })?;
        let data = self.bytes_of(buffer)?.clone();
        let key = NEXT_EXPORT.fetch_add(1, Ordering::Relaxed);
        exports()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key, (host.name.clone(), data));
        Ok(IpcExport {
            descriptor: Bytes::copy_from_slice(&key.to_le_bytes()),
            keep: Box::new(SimExport(key)),
        })
    }

    async fn import(
        &self,
        descriptor: &[u8],
        len: usize,
        to: Device,
    ) -> Result<DeviceBuffer, DeviceError> {
        self.check(to)?;
        let fail = |message: String| DeviceError::Backend {
            device: to,
            op: "IPC import",
            message,
        };
        let key: [u8; 8] = descriptor
            .try_into()
            .map_err(|_| fail(format!("a descriptor of {} bytes, not 8", descriptor.len())))?;
        let key = u64::from_le_bytes(key);
        let (host, data) = exports()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&key)
            .cloned()
            .ok_or_else(|| fail(format!("export {key} is not open (released or never made)")))?;
        if self.host.as_ref().map(|h| &h.name) != Some(&host) {
            return Err(fail(format!("export {key} belongs to host {host}")));
        }
        if data.len() != len {
            return Err(fail(format!(
                "export {key} holds {} bytes, the tensor needs {len}",
                data.len()
            )));
        }
        Ok(self.place(data, to))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::device::relocate;
    use crate::tensor::{Storage, Tensor};
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    fn now<F: Future>(f: F) -> F::Output {
        match pin!(f)
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("simulated copies never wait"),
        }
    }

    #[test]
    fn round_trips_keep_bytes_and_devices() {
        let sim = SimulatedDevices::new(2);
        let t = Tensor::from_f32(vec![3], &[1.0, 2.0, 3.0]).unwrap();
        let on0 = now(relocate(&sim, &t, Device::Cuda(0))).unwrap();
        assert_eq!(on0.device(), Device::Cuda(0));
        let on1 = now(relocate(&sim, &on0, Device::Cuda(1))).unwrap();
        assert_eq!(on1.device(), Device::Cuda(1));
        let back = now(relocate(&sim, &on1, Device::Cpu)).unwrap();
        assert_eq!(back.to_f32_vec().unwrap(), vec![1.0, 2.0, 3.0]);
        assert_eq!(sim.copies(), 3);
        // Already there: no copy.
        now(relocate(&sim, &on1, Device::Cuda(1))).unwrap();
        assert_eq!(sim.copies(), 3);
    }

    #[test]
    fn sharing_instances_copy_through_exports_that_live_until_dropped() {
        let a = SimulatedDevices::sharing(1, SimHost::new("h"));
        let b = SimulatedDevices::sharing(1, SimHost::new("h"));
        assert!(SimulatedDevices::new(1).ipc().is_none());
        let (ia, ib) = (a.identity(), b.identity());
        assert_eq!(ia.gpus, ib.gpus, "one simulated GPU");
        assert_ne!(ia.host.pid, ib.host.pid, "two simulated processes");
        let t = Tensor::from_f32(vec![2], &[4.0, 5.0]).unwrap();
        let on_a = now(relocate(&a, &t, Device::Cuda(0))).unwrap();
        let Storage::Device(buf) = on_a.storage() else {
            panic!()
        };
        let export = now(a.ipc().unwrap().export(buf)).unwrap();
        let got = now(b.import(&export.descriptor, 8, Device::Cuda(0))).unwrap();
        let back = now(b.to_host(&got)).unwrap();
        assert_eq!(&back[..], &t.host_bytes().unwrap()[..]);
        let e = now(b.import(&export.descriptor, 4, Device::Cuda(0))).unwrap_err();
        assert!(
            e.to_string().contains("holds 8 bytes, the tensor needs 4"),
            "{e}"
        );
        let elsewhere = SimulatedDevices::sharing(1, SimHost::new("other"));
        let e = now(elsewhere.import(&export.descriptor, 8, Device::Cuda(0))).unwrap_err();
        assert!(e.to_string().contains("belongs to host h"), "{e}");
        let descriptor = export.descriptor.clone();
        drop(export);
        let e = now(b.import(&descriptor, 8, Device::Cuda(0))).unwrap_err();
        assert!(e.to_string().contains("is not open"), "{e}");
        assert!(now(b.import(&[1], 8, Device::Cuda(0))).is_err());
    }

    #[test]
    fn bad_devices_and_foreign_buffers_are_errors() {
        let sim = SimulatedDevices::new(1);
        let t = Tensor::from_f32(vec![1], &[1.0]).unwrap();
        let e = now(relocate(&sim, &t, Device::Cuda(1))).unwrap_err();
        assert_eq!(
            e,
            DeviceError::NoSuchDevice {
                device: Device::Cuda(1),
                count: 1
            }
        );
        assert!(e
            .to_string()
            .contains("cuda:1 does not exist (this worker has 1 CUDA devices)"));
        let other = SimulatedDevices::new(1);
        let on_other = now(relocate(&other, &t, Device::Cuda(0))).unwrap();
        assert_eq!(
            now(relocate(&sim, &on_other, Device::Cpu)).unwrap_err(),
            DeviceError::ForeignBuffer(Device::Cuda(0))
        );
        let none = SimulatedDevices::new(0);
        assert_eq!(none.unavailable(), Some(DeviceUnavailable::NoDevice));
        assert!(matches!(
            now(relocate(&none, &t, Device::Cuda(0))),
            Err(DeviceError::Unavailable(_))
        ));
    }
}
