//! The simulated device backend: host memory posing as N CUDA devices.
//!
//! Every device-map path (host to device, device to host, device to device, wrong indices) can
//! run in CI without a GPU. A buffer remembers the device it was "placed" on; copies are real
//! copies of the bytes, so a test that compares bytes after a round trip checks something.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use crate::device::Device;
use crate::ports::device::{DeviceBackend, DeviceError, DeviceUnavailable};
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
}

impl SimulatedDevices {
    /// A backend with `count` simulated devices (`cuda:0` .. `cuda:{count-1}`).
    pub fn new(count: u32) -> Self {
        Self {
            count,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            copies: AtomicU64::new(0),
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::device::relocate;
    use crate::tensor::Tensor;
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
