//! A device backend that records where it copies tensors to.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tensorwire_core::device::Device;
use tensorwire_core::devices_sim::SimulatedDevices;
use tensorwire_core::ports::device::{DeviceBackend, DeviceError, DeviceUnavailable};
use tensorwire_core::tensor::DeviceBuffer;

/// Wraps a [`DeviceBackend`] and records the device of every host-to-device copy (where an
/// arriving tensor landed), in order.
pub struct RecordingDevices {
    inner: Arc<dyn DeviceBackend>,
    to_device: Mutex<Vec<Device>>,
}

impl std::fmt::Debug for RecordingDevices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordingDevices")
            .field("inner", &self.inner.name())
            .field("to_device", &*self.lock())
            .finish()
    }
}

impl RecordingDevices {
    /// Records the copies `inner` makes.
    pub fn new(inner: Arc<dyn DeviceBackend>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            to_device: Mutex::new(Vec::new()),
        })
    }

    /// Records the copies of `devices` simulated CUDA devices (host memory).
    pub fn simulated(devices: u32) -> Arc<Self> {
        Self::new(Arc::new(SimulatedDevices::new(devices)))
    }

    /// The devices copied to since the last call, in order, as PyTorch writes them
    /// (`cuda:1`).
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.lock())
            .into_iter()
            .map(|d| d.to_string())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Device>> {
        self.to_device
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait::async_trait]
impl DeviceBackend for RecordingDevices {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn device_count(&self) -> u32 {
        self.inner.device_count()
    }
    fn unavailable(&self) -> Option<DeviceUnavailable> {
        self.inner.unavailable()
    }
    async fn to_device(&self, data: Bytes, device: Device) -> Result<DeviceBuffer, DeviceError> {
        self.lock().push(device);
        self.inner.to_device(data, device).await
    }
    async fn to_host(&self, buffer: &DeviceBuffer) -> Result<Bytes, DeviceError> {
        self.inner.to_host(buffer).await
    }
    async fn between(
        &self,
        buffer: &DeviceBuffer,
        to: Device,
    ) -> Result<DeviceBuffer, DeviceError> {
        self.inner.between(buffer, to).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_each_copy_to_a_device_in_order_and_passes_it_on() {
        let rec = RecordingDevices::simulated(2);
        assert_eq!(rec.device_count(), 2);
        let a = rec
            .to_device(Bytes::from_static(b"abcd"), Device::Cuda(1))
            .await
            .unwrap();
        let b = rec
            .to_device(Bytes::from_static(b"ef"), Device::Cuda(0))
            .await
            .unwrap();
        // A copy between devices and back to the host is not a landing: not recorded.
        let moved = rec.between(&a, Device::Cuda(0)).await.unwrap();
        assert_eq!(
            rec.to_host(&moved).await.unwrap(),
            Bytes::from_static(b"abcd")
        );
        assert_eq!(rec.to_host(&b).await.unwrap(), Bytes::from_static(b"ef"));
        assert_eq!(rec.take(), vec!["cuda:1", "cuda:0"]);
        assert!(rec.take().is_empty());
    }
}
