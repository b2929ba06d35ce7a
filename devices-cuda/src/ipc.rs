//! CUDA IPC: device buffers shared with other processes of this host ([`DeviceIpc`]).
//!
//! When and with whom memory is shared is decided in `tensorwire_core::ipc`; this module does
//! the driver calls:
//!
//! - **Export** (sender): `cuIpcGetMemHandle` of the buffer's allocation. Memory from the
//!   stream-ordered pool (`cuMemAllocAsync`, what cudarc allocates on every GPU that has memory
//!   pools) cannot be shared by a legacy IPC handle: such a buffer is first copied (on the
//!   device, stream-ordered) into an allocation made with `cuMemAlloc`, kept in a small
//!   per-device pool for reuse. That copy costs a second pass over the memory; sharing pool
//!   memory directly needs `cuMemPoolExportToShareableHandle` and a file descriptor passed
//!   over a Unix socket (not done). An
//!   interprocess event is recorded on the copy stream after the work that wrote the memory and
//!   shared by `cuIpcGetEventHandle`. The [`IpcExport::keep`] value holds the memory and the
//!   event: until the receiver releases the export, nothing reuses them.
//! - **Import** (receiver): `cuIpcOpenMemHandle` (lazy peer access), a range check of the
//!   offset and length against the opened allocation (`cuMemGetAddressRange`),
//!   `cuIpcOpenEventHandle` and `cuStreamWaitEvent` (the copy starts after the sender's work),
//!   a device-to-device copy into a new buffer of this backend, a wait for it, then
//!   `cuIpcCloseMemHandle` and the event destroyed. The import holds nothing afterwards.
//!
//! The descriptor: `b"TWCI"`, a version byte, the 64-byte memory handle, the 64-byte event
//! handle, the offset and length (little-endian `u64`s) and the source GPU's UUID.
//!
//! A process's identity ([`DeviceIpc::identity`]): the host's boot id and the IPC and PID
//! namespaces from `/proc`, the process id, and each GPU's UUID (`cuDeviceGetUuid_v2`). The
//! driver API does not say whether a device is a MIG instance: `CUDA_VISIBLE_DEVICES` naming
//! `MIG-` devices marks them all as MIG (where IPC is unsupported, so peers stage).

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use cudarc::driver::{result, sys, CudaContext, DevicePtr, DriverError};
use tensorwire_core::device::Device;
use tensorwire_core::ipc::{GpuIdentity, HostIdentity, IpcIdentity};
use tensorwire_core::ports::device::{DeviceError, DeviceIpc, IpcExport};
use tensorwire_core::tensor::DeviceBuffer;

use crate::{driver_error, guarded, CudaDevices, Gpu, Inner};

const MAGIC: &[u8; 4] = b"TWCI";
const VERSION: u8 = 1;
const HANDLE: usize = 64;
/// Bytes of a descriptor.
pub(crate) const DESCRIPTOR_LEN: usize = 4 + 1 + HANDLE + HANDLE + 8 + 8 + 16;

/// Exportable allocations kept per device for reuse.
const POOLED_EXPORTABLE: usize = 4;

/// `CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS`.
const IPC_EVENT_FLAGS: u32 = 0x2 | 0x4;

/// A decoded descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Descriptor {
    pub(crate) memory: [u8; HANDLE],
    pub(crate) event: [u8; HANDLE],
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) gpu: [u8; 16],
}

impl Descriptor {
    pub(crate) fn encode(&self) -> Bytes {
        let mut out = Vec::with_capacity(DESCRIPTOR_LEN);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.memory);
        out.extend_from_slice(&self.event);
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.gpu);
        out.into()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() != DESCRIPTOR_LEN {
            return Err(format!(
                "a CUDA IPC descriptor has {DESCRIPTOR_LEN} bytes, this one {}",
                bytes.len()
            ));
        }
        if &bytes[..4] != MAGIC || bytes[4] != VERSION {
            return Err("not a CUDA IPC descriptor of this version".into());
        }
        let mut at = 5;
        let mut take = |n: usize| {
            let s = &bytes[at..at + n];
            at += n;
            s
        };
        let memory = take(HANDLE).try_into().expect("64 bytes");
        let event = take(HANDLE).try_into().expect("64 bytes");
        let offset = u64::from_le_bytes(take(8).try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(take(8).try_into().expect("8 bytes"));
        let gpu = take(16).try_into().expect("16 bytes");
        Ok(Self {
            memory,
            event,
            offset,
            len,
            gpu,
        })
    }
}

/// Device memory from `cuMemAlloc` (shareable by a legacy IPC handle), freed on drop.
pub(crate) struct ExportableAlloc {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl ExportableAlloc {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation of `len` bytes, freed once in `drop`.
        let ptr = unsafe { result::malloc_sync(len) }?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }
}

impl Drop for ExportableAlloc {
    fn drop(&mut self) {
        let freed = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: allocated by `malloc_sync` in `new`, freed only here; cuMemFree waits
            // for work using it.
            unsafe { result::free_sync(self.ptr) }
        });
        if let Err(e) = freed {
            tracing::warn!("freeing an IPC export buffer failed: {e}");
        }
    }
}

/// An interprocess event, destroyed on drop.
struct IpcEvent(sys::CUevent);

// SAFETY: a CUevent handle may be used and destroyed from any thread.
unsafe impl Send for IpcEvent {}
// SAFETY: as above; it is only read.
unsafe impl Sync for IpcEvent {}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        // SAFETY: a live event created or opened by this module, destroyed once.
        let _ = unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// What an export holds until the receiver releases it.
struct Held {
    /// The shared memory: the buffer itself, or the exportable copy (returned to its pool).
    _memory: HeldMemory,
    _event: IpcEvent,
}

/// Held only to be dropped at release: the memory stays allocated and unused until then.
enum HeldMemory {
    Buffer(#[allow(dead_code)] DeviceBuffer),
    Copy(#[allow(dead_code)] Pooled),
}

/// An exportable allocation that goes back to its device's pool when dropped.
struct Pooled {
    alloc: Option<ExportableAlloc>,
    pool: Arc<Mutex<Vec<ExportableAlloc>>>,
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let Some(alloc) = self.alloc.take() else {
            return;
        };
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < POOLED_EXPORTABLE {
            pool.push(alloc);
        }
    }
}

/// Per-device state of IPC: the pool of exportable allocations.
#[derive(Default)]
pub(crate) struct GpuIpc {
    pool: Arc<Mutex<Vec<ExportableAlloc>>>,
}

impl GpuIpc {
    /// An exportable allocation of at least `len` bytes, from the pool when one fits.
    fn take(&self, ctx: &Arc<CudaContext>, len: usize) -> Result<Pooled, DriverError> {
        let found = {
            let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            // The smallest that fits.
            let best = pool
                .iter()
                .enumerate()
                .filter(|(_, a)| a.len >= len)
                .min_by_key(|(_, a)| a.len)
                .map(|(i, _)| i);
            best.map(|i| pool.swap_remove(i))
        };
        let alloc = match found {
            Some(a) => a,
            None => ExportableAlloc::new(ctx, len)?,
        };
        Ok(Pooled {
            alloc: Some(alloc),
            pool: self.pool.clone(),
        })
    }
}

/// `cuDeviceGetUuid_v2` of ordinal `ordinal`.
fn gpu_uuid(ordinal: u32) -> Result<[u8; 16], DriverError> {
    let dev = result::device::get(ordinal as i32)?;
    // SAFETY: CUuuid is plain bytes.
    let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
    // SAFETY: a valid device and an out pointer to a live CUuuid.
    unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) }.result()?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// The inode of `/proc/self/ns/<kind>` (0 when unreadable).
fn namespace(kind: &str) -> u64 {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(format!("/proc/self/ns/{kind}")).map_or(0, |m| m.ino())
    }
    #[cfg(not(unix))]
    {
        let _ = kind;
        0
    }
}

/// This process's host identity.
pub(crate) fn host_identity() -> HostIdentity {
    HostIdentity {
        boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            // Unknown: never equal to another process's, so nothing is shared.
            .unwrap_or_else(|_| format!("unknown-{}", std::process::id())),
        ipc_namespace: namespace("ipc"),
        pid_namespace: namespace("pid"),
        pid: std::process::id(),
    }
}

/// Whether `CUDA_VISIBLE_DEVICES` selects MIG instances.
fn mig_visible() -> bool {
    std::env::var("CUDA_VISIBLE_DEVICES").is_ok_and(|v| v.contains("MIG-"))
}

impl CudaDevices {
    /// Whether this backend shares memory with other processes (a driver and a device).
    pub fn ipc_available(&self) -> bool {
        self.inner.driver.is_ok()
    }
}

#[async_trait]
impl DeviceIpc for CudaDevices {
    fn identity(&self) -> IpcIdentity {
        let count = self.inner.driver.as_ref().map_or(0, |d| d.count);
        let mig = mig_visible();
        let gpus = (0..count)
            .map(|i| GpuIdentity {
                // A GPU whose UUID cannot be read matches no other.
                uuid: guarded(Device::Cuda(i as u8), "cuDeviceGetUuid", || gpu_uuid(i))
                    .unwrap_or([0xff; 16]),
                mig,
            })
            .collect();
        IpcIdentity {
            host: host_identity(),
            gpus,
        }
    }

    async fn export(&self, buffer: &DeviceBuffer) -> Result<IpcExport, DeviceError> {
        let ours = self.inner.ours(buffer)?;
        let device = Device::Cuda(ours.ordinal as u8);
        if ours.slice.is_none() {
            return Err(DeviceError::Backend {
                device,
                op: "IPC export",
                message: "an empty buffer has no memory to share".into(),
            });
        }
        let buffer = buffer.clone();
        self.blocking(device, "IPC export", move |inner| {
            export(inner, &buffer, device).map_err(|e| driver_error(device, "IPC export", e))
        })
        .await
    }

    async fn import(
        &self,
        descriptor: &[u8],
        len: usize,
        to: Device,
    ) -> Result<DeviceBuffer, DeviceError> {
        self.inner.check(to)?;
        let fail = |message: String| DeviceError::Backend {
            device: to,
            op: "IPC import",
            message,
        };
        let d = Descriptor::decode(descriptor).map_err(fail)?;
        if d.len != len as u64 {
            return Err(fail(format!(
                "the descriptor shares {} bytes, the tensor needs {len}",
                d.len
            )));
        }
        if len == 0 {
            return Err(fail("an empty tensor came by IPC handle".into()));
        }
        self.blocking(to, "IPC import", move |inner| {
            import(inner, &d, to).map_err(|e| match e {
                ImportError::Driver(e) => driver_error(to, "IPC import", e),
                ImportError::Range(m) => DeviceError::Backend {
                    device: to,
                    op: "IPC import",
                    message: m,
                },
            })
        })
        .await
    }
}

fn export(inner: &Inner, buffer: &DeviceBuffer, device: Device) -> Result<IpcExport, DriverError> {
    let gpu: Arc<Gpu> = inner
        .gpu(device)
        .map_err(|_| DriverError(sys::CUresult::CUDA_ERROR_INVALID_DEVICE))?;
    gpu.ctx.bind_to_thread()?;
    let stream = &gpu.stream;
    let ours = inner
        .ours(buffer)
        .map_err(|_| DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE))?;
    let slice = ours.slice.as_ref().expect("checked by the caller");
    let len = slice.len();
    let (ptr, _record) = slice.device_ptr(stream);
    // SAFETY: CUipcMemHandle is plain bytes.
    let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // With memory pools, every buffer of this backend comes from the stream-ordered pool,
    // which a legacy IPC handle cannot share (the driver may even hand out a handle that the
    // receiver then fails to open): share a copy. Without pools, the buffer itself.
    let direct = if gpu.ctx.has_async_alloc() {
        Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED))
    } else {
        // SAFETY: `ptr` is a live allocation of this context; `handle` is a live out value.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) }.result()
    };
    let (memory, offset) = match direct {
        Ok(()) => {
            let (mut base, mut size) = (0, 0);
            // SAFETY: out pointers to live values; `ptr` is a live allocation.
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }.result()?;
            (HeldMemory::Buffer(buffer.clone()), ptr - base)
        }
        Err(_) => {
            // Pool memory: share a stream-ordered copy in an exportable allocation.
            let copy = gpu.ipc.take(&gpu.ctx, len)?;
            let dst = copy.alloc.as_ref().expect("taken").ptr;
            // SAFETY: both ranges hold `len` bytes; the copy is ordered on the stream before
            // the event the receiver waits for.
            unsafe { result::memcpy_dtod_async(dst, ptr, len, stream.cu_stream()) }?;
            // SAFETY: as above, on the exportable allocation.
            unsafe { sys::cuIpcGetMemHandle(&mut handle, dst) }.result()?;
            (HeldMemory::Copy(copy), 0)
        }
    };
    let mut event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: an out pointer to a live event handle; flags valid for an IPC event.
    unsafe { sys::cuEventCreate(&mut event, IPC_EVENT_FLAGS) }.result()?;
    let event = IpcEvent(event);
    // SAFETY: a live event and stream of this context.
    unsafe { sys::cuEventRecord(event.0, stream.cu_stream()) }.result()?;
    // SAFETY: CUipcEventHandle is plain bytes.
    let mut event_handle: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
    // SAFETY: a live interprocess event and an out value.
    unsafe { sys::cuIpcGetEventHandle(&mut event_handle, event.0) }.result()?;
    let descriptor = Descriptor {
        memory: handle.reserved.map(|b| b as u8),
        event: event_handle.reserved.map(|b| b as u8),
        offset,
        len: len as u64,
        gpu: gpu_uuid(gpu.ordinal)?,
    };
    Ok(IpcExport {
        descriptor: descriptor.encode(),
        keep: Box::new(Held {
            _memory: memory,
            _event: event,
        }),
    })
}

enum ImportError {
    Driver(DriverError),
    Range(String),
}

impl From<DriverError> for ImportError {
    fn from(e: DriverError) -> Self {
        ImportError::Driver(e)
    }
}

/// An opened IPC memory handle, closed on drop.
struct Opened(sys::CUdeviceptr);

impl Drop for Opened {
    fn drop(&mut self) {
        // SAFETY: opened by cuIpcOpenMemHandle, closed once, after the copies from it finished.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.0) };
    }
}

fn import(inner: &Inner, d: &Descriptor, to: Device) -> Result<DeviceBuffer, ImportError> {
    let gpu = inner
        .gpu(to)
        .map_err(|e| ImportError::Range(e.to_string()))?;
    gpu.ctx.bind_to_thread()?;
    let stream = &gpu.stream;
    // SAFETY: plain bytes.
    let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    handle.reserved = d.memory.map(|b| b as std::ffi::c_char);
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: an out pointer to a live value; the handle bytes come from the peer, and the
    // driver refuses handles that are not valid exports.
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut base,
            handle,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()?;
    let opened = Opened(base);
    let (mut start, mut size) = (0, 0);
    // SAFETY: out pointers; `base` is a live mapping.
    unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) }.result()?;
    let end = d.offset.checked_add(d.len);
    if end.is_none_or(|end| end > size as u64) {
        return Err(ImportError::Range(format!(
            "the descriptor names bytes {}..+{} of an allocation of {size} bytes",
            d.offset, d.len
        )));
    }
    // SAFETY: plain bytes.
    let mut event_handle: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
    event_handle.reserved = d.event.map(|b| b as std::ffi::c_char);
    let mut event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: an out pointer; the driver refuses invalid handles.
    unsafe { sys::cuIpcOpenEventHandle(&mut event, event_handle) }.result()?;
    let event = IpcEvent(event);
    // SAFETY: a live stream and event.
    unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), event.0, 0) }.result()?;
    let len = d.len as usize;
    // SAFETY: every byte is written by the copy below before anyone reads it.
    let mut dst = unsafe { stream.alloc::<u8>(len) }?;
    {
        let (dptr, _record) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dst, stream);
        // SAFETY: `dst` holds `len` bytes; the source range was checked above and stays
        // mapped until `opened` is dropped, after `finish` waited for the copy.
        unsafe {
            result::memcpy_dtod_async(
                dptr,
                opened.0 + d.offset as sys::CUdeviceptr,
                len,
                stream.cu_stream(),
            )
        }?;
    }
    gpu.finish()?;
    drop(opened);
    drop(event);
    Ok(inner.buffer(to, Some(dst)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_bad_ones_are_refused() {
        let d = Descriptor {
            memory: [3; HANDLE],
            event: [4; HANDLE],
            offset: 512,
            len: 1 << 28,
            gpu: [9; 16],
        };
        let bytes = d.encode();
        assert_eq!(bytes.len(), DESCRIPTOR_LEN);
        assert_eq!(Descriptor::decode(&bytes), Ok(d));
        assert!(Descriptor::decode(&bytes[1..])
            .unwrap_err()
            .contains("has 165 bytes, this one 164"));
        let mut bad = bytes.to_vec();
        bad[0] = b'X';
        assert!(Descriptor::decode(&bad).is_err());
    }

    #[test]
    fn identity_names_this_process_and_host() {
        let h = host_identity();
        assert_eq!(h.pid, std::process::id());
        #[cfg(target_os = "linux")]
        {
            assert_ne!(h.ipc_namespace, 0);
            assert_ne!(h.pid_namespace, 0);
            assert!(!h.boot_id.starts_with("unknown"), "{}", h.boot_id);
        }
    }

    #[tokio::test]
    async fn without_a_driver_exports_and_imports_fail_with_the_reason() {
        let cuda = CudaDevices::with_driver_names(&["libtensorwire-no-such-driver.so"]);
        assert!(!cuda.ipc_available());
        assert!(cuda.identity().gpus.is_empty());
        let e = cuda
            .import(&[0; DESCRIPTOR_LEN], 4, Device::Cuda(0))
            .await
            .unwrap_err();
        assert!(matches!(e, DeviceError::Unavailable(_)), "{e:?}");
    }
}
