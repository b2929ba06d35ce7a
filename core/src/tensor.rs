//! A minimal tensor value: element type, shape, device and storage.
//!
//! tensorwire moves tensors; it does not compute with them. A [`Tensor`] is a carrier: its bytes
//! live either in host memory ([`Storage::Host`]) or in a device buffer owned by a
//! [`DeviceBackend`](crate::ports::device::DeviceBackend) ([`Storage::Device`]).

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::device::Device;

/// Element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DType {
    /// 8-bit unsigned integer (also raw bytes).
    U8,
    /// 32-bit integer.
    I32,
    /// 64-bit integer.
    I64,
    /// 16-bit float.
    F16,
    /// 16-bit brain float.
    BF16,
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 8-bit signed integer.
    I8,
    /// Boolean, one byte: 0 is false, anything else true.
    Bool,
    /// 16-bit signed integer.
    I16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }
}

/// A buffer in a device's memory, created by a device backend. The handle is the backend's own
/// type; only that backend looks inside it.
#[derive(Clone)]
pub struct DeviceBuffer {
    device: Device,
    len: usize,
    handle: Arc<dyn Any + Send + Sync>,
}

impl DeviceBuffer {
    /// Wraps a backend's buffer of `len` bytes on `device`.
    pub fn new(device: Device, len: usize, handle: Arc<dyn Any + Send + Sync>) -> Self {
        Self {
            device,
            len,
            handle,
        }
    }

    /// The device the bytes are on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backend's handle, if it is of type `T`.
    pub fn handle<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.handle.downcast_ref()
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// Where a tensor's bytes are.
#[derive(Debug, Clone)]
pub enum Storage {
    /// Host memory.
    Host(bytes::Bytes),
    /// A device buffer.
    Device(DeviceBuffer),
}

impl Storage {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Storage::Host(b) => b.len(),
            Storage::Device(b) => b.len(),
        }
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a tensor cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// The storage does not hold exactly `shape × dtype` bytes.
    #[error(
        "a {dtype:?} tensor of shape {shape:?} needs {expected} bytes, the storage has {actual}"
    )]
    SizeMismatch {
        /// Element type.
        dtype: DType,
        /// Shape.
        shape: Vec<usize>,
        /// Bytes needed.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The shape's element count overflows.
    #[error("shape {0:?} has too many elements")]
    Overflow(Vec<usize>),
}

/// A tensor: element type, shape, and bytes on a device.
#[derive(Debug, Clone)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage,
}

/// The bytes a tensor of `dtype` and `shape` holds (an error when the product overflows).
pub fn byte_len(dtype: DType, shape: &[usize]) -> Result<usize, TensorError> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| TensorError::Overflow(shape.to_vec()))
}

impl Tensor {
    /// A tensor over `storage`, which must hold exactly the shape's bytes.
    pub fn new(dtype: DType, shape: Vec<usize>, storage: Storage) -> Result<Self, TensorError> {
        let expected = byte_len(dtype, &shape)?;
        let actual = match &storage {
            Storage::Host(b) => b.len(),
            Storage::Device(d) => d.len(),
        };
        if expected != actual {
            return Err(TensorError::SizeMismatch {
                dtype,
                shape,
                expected,
                actual,
            });
        }
        Ok(Self {
            dtype,
            shape,
            storage,
        })
    }

    /// A host tensor of `f32` values.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Self, TensorError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(DType::F32, shape, Storage::Host(bytes.into()))
    }

    /// A host tensor of `f64` values.
    pub fn from_f64(shape: Vec<usize>, values: &[f64]) -> Result<Self, TensorError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(DType::F64, shape, Storage::Host(bytes.into()))
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The device the bytes are on.
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Host(_) => Device::Cpu,
            Storage::Device(d) => d.device(),
        }
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        match &self.storage {
            Storage::Host(b) => b.len(),
            Storage::Device(d) => d.len(),
        }
    }

    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The host bytes, for a CPU tensor.
    pub fn host_bytes(&self) -> Option<&bytes::Bytes> {
        match &self.storage {
            Storage::Host(b) => Some(b),
            Storage::Device(_) => None,
        }
    }

    /// The same tensor over other storage of the same size (after a copy).
    pub fn with_storage(&self, storage: Storage) -> Result<Self, TensorError> {
        Self::new(self.dtype, self.shape.clone(), storage)
    }

    /// The values of a host `f32` tensor.
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        let b = self.host_bytes()?;
        (self.dtype == DType::F32).then(|| {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
    }

    /// The values of a host `f64` tensor.
    pub fn to_f64_vec(&self) -> Option<Vec<f64>> {
        let b = self.host_bytes()?;
        (self.dtype == DType::F64).then(|| {
            b.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked() {
        let t = Tensor::from_f32(vec![2, 3], &[1.0; 6]).unwrap();
        assert_eq!((t.nbytes(), t.device()), (24, Device::Cpu));
        assert_eq!(t.to_f32_vec().unwrap(), vec![1.0; 6]);
        let e = Tensor::from_f32(vec![2, 3], &[1.0; 5]).unwrap_err();
        assert!(
            e.to_string().contains("needs 24 bytes, the storage has 20"),
            "{e}"
        );
        let e = Tensor::new(
            DType::F64,
            vec![usize::MAX, 2],
            Storage::Host(bytes::Bytes::new()),
        );
        assert!(matches!(e, Err(TensorError::Overflow(_))));
    }

    /// A decode given no tensors still runs in a scope of its own: a tensor index in its bytes
    /// is refused as one the message lacks (not as one outside a message), and an outer
    /// scope's tensors are hidden from it and back after it.
    #[test]
    fn a_decode_without_tensors_has_a_scope_of_its_own() {
        let t = Tensor::from_f32(vec![1], &[2.0]).unwrap();
        // What a tensor's `Deserialize` does with the index it read.
        let decode = || sidecar::take(0).map(|t| t.nbytes());
        let e = sidecar::provide_tensors(Vec::new(), decode).unwrap_err();
        assert!(e.contains("no tensor #0"), "{e}");
        let (inner, outer) = sidecar::provide_tensors(vec![t], || {
            let inner = sidecar::provide_tensors(Vec::new(), decode);
            (inner, decode())
        });
        assert!(inner.unwrap_err().contains("no tensor #0"));
        assert_eq!(outer, Ok(4));
        let e = decode().unwrap_err();
        assert!(e.contains("only be decoded from"), "{e}");
    }
}

/// What the receiver needs to rebuild a tensor sent beside a message: element type, shape, and
/// the device it must land on there. Its bytes travel as a raw payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Where the tensor lands at the receiver.
    pub device: Device,
    /// `Some(export)`: the payload is not the bytes but the sender's IPC descriptor of its
    /// buffer, export `export` to this receiver (see [`crate::ipc`]), to be copied device to
    /// device and released.
    pub ipc: Option<crate::ipc::ExportId>,
}

/// Serializing tensors inside messages.
///
/// A [`Tensor`] inside a value being encoded is not written into the encoded bytes: it is set
/// aside (see [`sidecar::collect_tensors`]) and written as its index; its bytes travel beside the message,
/// untouched. Decoding takes the tensors back by index (see [`sidecar::provide_tensors`]). Outside these
/// scopes, serializing a tensor is an error.
pub mod sidecar {
    use std::cell::RefCell;

    use super::Tensor;

    thread_local! {
        static SINK: RefCell<Option<Vec<Tensor>>> = const { RefCell::new(None) };
        static SOURCE: RefCell<Option<Vec<Option<Tensor>>>> = const { RefCell::new(None) };
    }

    /// Runs `f` (an encode) and returns its result with the tensors it set aside, in index order.
    pub fn collect_tensors<R>(f: impl FnOnce() -> R) -> (R, Vec<Tensor>) {
        let prev = SINK.with(|s| s.borrow_mut().replace(Vec::new()));
        let r = f();
        let tensors = SINK
            .with(|s| std::mem::replace(&mut *s.borrow_mut(), prev))
            .unwrap_or_default();
        (r, tensors)
    }

    /// Runs `f` (a decode) with `tensors` available by index; each can be taken once.
    pub fn provide_tensors<R>(tensors: Vec<Tensor>, f: impl FnOnce() -> R) -> R {
        // No list built for the usual message without tensors: an empty one is made in place
        // (no allocation, no collecting pass).
        let slots = if tensors.is_empty() {
            Vec::new()
        } else {
            tensors.into_iter().map(Some).collect()
        };
        let prev = SOURCE.with(|s| s.replace(Some(slots)));
        let r = f();
        SOURCE.with(|s| *s.borrow_mut() = prev);
        r
    }

    pub(super) fn put(t: &Tensor) -> Option<u32> {
        SINK.with(|s| {
            let mut s = s.borrow_mut();
            let v = s.as_mut()?;
            v.push(t.clone());
            u32::try_from(v.len() - 1).ok()
        })
    }

    pub(super) fn take(i: u32) -> Result<Tensor, String> {
        SOURCE.with(|s| {
            let mut s = s.borrow_mut();
            let v = s
                .as_mut()
                .ok_or("a tensor can only be decoded from a tensorwire message")?;
            v.get_mut(i as usize)
                .and_then(Option::take)
                .ok_or_else(|| format!("the message has no tensor #{i} (or it was used twice)"))
        })
    }
}

impl Serialize for Tensor {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let index = sidecar::put(self).ok_or_else(|| {
            serde::ser::Error::custom(
                "a tensor can only be serialized as part of a tensorwire message",
            )
        })?;
        serializer.serialize_u32(index)
    }
}

impl<'de> Deserialize<'de> for Tensor {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let index = u32::deserialize(deserializer)?;
        sidecar::take(index).map_err(serde::de::Error::custom)
    }
}
