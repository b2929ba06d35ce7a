//! The CUDA device backend of tensorwire: an adapter of the
//! [`DeviceBackend`] port on
//! [`cudarc`](https://docs.rs/cudarc), with the driver loaded at run time.
//!
//! Nothing CUDA is needed to build this crate, and a binary using it starts on a machine without
//! a GPU: [`CudaDevices::new`] then reports zero devices and
//! [`unavailable`](DeviceBackend::unavailable) says why (driver
//! library not found, no device, driver too old, initialisation failed). Every copy then fails
//! with [`DeviceError::Unavailable`]; nothing panics and nothing waits.
//!
//! # How copies work
//!
//! - Each device gets its own primary context and one copy stream, created on first use.
//! - Host to device and device to host go through pinned (page-locked) host staging buffers of
//!   [`STAGING_CHUNK`] bytes, two per transfer, so the CPU fills (or drains) one while the DMA
//!   engine moves the other. Staging buffers are pooled per device.
//! - Device to device: on the same device a stream-ordered copy; between devices a peer copy
//!   when `cuDeviceCanAccessPeer` allows it (peer access is enabled once per pair), otherwise
//!   staged through host memory.
//! - Every call waits for its copy to complete (an event on the copy stream) before it returns,
//!   so a buffer handed to the user is ready.
//! - To another process of this host: CUDA IPC handles ([`DeviceIpc`], used by the RPC agent
//!   where `tensorwire_core::ipc` decides so): the receiver copies device to device out of the
//!   sender's memory, which the sender holds until the receiver releases it.
//!
//! # Runtimes
//!
//! The copies block while the DMA runs. Inside a Tokio runtime they run on
//! [`spawn_blocking`](tokio::task::spawn_blocking) threads, so the async workers stay free;
//! outside one (any other executor, or a plain `block_on`) they run inline on the polling
//! thread.

use std::collections::HashSet;
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use bytes::Bytes;
use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DriverError, PinnedHostSlice,
};
use tensorwire_core::device::Device;
use tensorwire_core::ports::device::{DeviceBackend, DeviceError, DeviceIpc, DeviceUnavailable};
use tensorwire_core::tensor::DeviceBuffer;

pub use cudarc;

mod ipc;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nccl")]
pub mod nccl_group;
mod pinned;
mod probe;

use pinned::HostPool;
use rayon::prelude::*;

/// Default size in bytes of one pinned staging buffer (a transfer uses two, alternating).
///
/// Measured on an H100 (PCIe, 16 cores) moving 256 MiB from pageable memory: 8 MiB × 1 thread
/// reached 0.15× the raw pinned-copy rate, 32 MiB × 8 threads 0.54×, 64 MiB × 16 threads 0.59×.
pub const STAGING_CHUNK: usize = 32 << 20;

/// How host transfers are staged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingOptions {
    /// Bytes per pinned staging buffer (at least 4 KiB; default [`STAGING_CHUNK`]).
    pub chunk: usize,
    /// Threads that copy between pageable memory and a staging buffer (default: the number of
    /// cores, at most 8). A single thread's `memcpy` is much slower than the DMA engine (8 vs
    /// 55 GB/s on an H100 machine); more threads split each chunk (on rayon's pool).
    pub copy_threads: usize,
    /// Idle pinned bytes kept for the outputs of device-to-host copies (default 1 GiB). Copies
    /// of [`PINNED_OUTPUT_MIN`] bytes or more land directly in pooled pinned memory returned as
    /// `Bytes`; dropping those `Bytes` returns the memory to the pool. 0 turns this off: such
    /// copies are staged into ordinary heap memory.
    pub pinned_pool: usize,
}

/// Device-to-host copies at least this large land directly in pooled pinned memory.
pub const PINNED_OUTPUT_MIN: usize = 1 << 20;

impl Default for StagingOptions {
    fn default() -> Self {
        Self {
            chunk: STAGING_CHUNK,
            copy_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
            pinned_pool: 1 << 30,
        }
    }
}

/// Copies `src` into `dst` (same length), split over `threads` threads when it is worth it.
fn copy_parallel(dst: &mut [MaybeUninit<u8>], src: &[u8], threads: usize) {
    const MIN_PER_THREAD: usize = 256 << 10;
    assert_eq!(dst.len(), src.len());
    let copy = |d: &mut [MaybeUninit<u8>], s: &[u8]| {
        // SAFETY: `d` and `s` have the same length and do not overlap (one is borrowed
        // mutably, the other shared).
        unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), d.as_mut_ptr().cast::<u8>(), s.len()) }
    };
    let threads = threads.min(src.len() / MIN_PER_THREAD).max(1);
    if threads == 1 {
        copy(dst, src);
        return;
    }
    let part = src.len().div_ceil(threads);
    dst.par_chunks_mut(part)
        .zip(src.par_chunks(part))
        .for_each(|(d, s)| copy(d, s));
}

/// `&mut [u8]` seen as possibly uninitialised bytes (only initialised bytes are written).
fn as_uninit(bytes: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: same layout; callers only write initialised values through it.
    unsafe { &mut *(bytes as *mut [u8] as *mut [MaybeUninit<u8>]) }
}

/// Staging buffers kept per device for reuse (beyond these, buffers are freed after use).
const POOLED_STAGING: usize = 4;

static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// The CUDA devices of this machine, as a device backend.
///
/// Cheap to clone; clones share contexts, streams and staging buffers.
#[derive(Clone)]
pub struct CudaDevices {
    inner: Arc<Inner>,
}

struct Inner {
    instance: u64,
    driver: Result<probe::Driver, DeviceUnavailable>,
    gpus: Vec<OnceLock<Result<Arc<Gpu>, DeviceError>>>,
    /// Ordered pairs (from, to) whose peer access has been enabled.
    peers: Mutex<HashSet<(u32, u32)>>,
    staging: StagingOptions,
    host: Arc<HostPool>,
}

/// One device: its context, copy stream and staging pool.
struct Gpu {
    ordinal: u32,
    options: StagingOptions,
    host: Arc<HostPool>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    staging: Mutex<Vec<StagingBuffer>>,
    /// Exportable allocations for CUDA IPC (see `ipc`).
    ipc: ipc::GpuIpc,
}

/// A pinned host buffer and the event marking the end of the last copy that used it.
struct StagingBuffer {
    host: PinnedHostSlice<u8>,
    done: CudaEvent,
}

/// The handle inside a [`DeviceBuffer`] made by [`CudaDevices`]: owns the device memory.
pub struct CudaBuffer {
    owner: u64,
    ordinal: u32,
    /// `None` for an empty buffer (no device allocation is made for zero bytes).
    slice: Option<CudaSlice<u8>>,
}

impl CudaBuffer {
    /// The device memory (`None` when the buffer is empty).
    pub fn slice(&self) -> Option<&CudaSlice<u8>> {
        self.slice.as_ref()
    }

    /// The device ordinal the memory is on.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("ordinal", &self.ordinal)
            .field("len", &self.slice.as_ref().map_or(0, |s| s.len()))
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for CudaDevices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevices")
            .field("device_count", &self.device_count())
            .field("unavailable", &self.unavailable())
            .finish_non_exhaustive()
    }
}

impl Default for CudaDevices {
    fn default() -> Self {
        Self::new()
    }
}

impl CudaDevices {
    /// Finds the driver (`libcuda.so.1`, `libcuda.so`; `nvcuda.dll` on Windows) and counts the
    /// devices. Never fails: without a usable driver the backend has zero devices and
    /// [`unavailable`](DeviceBackend::unavailable) says why. Contexts are created on first use
    /// of each device.
    pub fn new() -> Self {
        Self::with_driver_names(probe::DEFAULT_NAMES)
    }

    /// The process-wide backend (made by [`new`](Self::new) on first use). The RPC agent's
    /// default device backend (feature `cuda`) and the `nccl` process groups use it, so that
    /// their copies and collectives on a device share one stream and one staging pool.
    pub fn shared() -> &'static CudaDevices {
        static SHARED: OnceLock<CudaDevices> = OnceLock::new();
        SHARED.get_or_init(CudaDevices::new)
    }

    /// Like [`new`](Self::new), probing the given library names instead of the default ones.
    /// Meant for tests of the no-driver path: cudarc itself always opens the driver by its own
    /// list of names, so pass names that are either absent or the real driver.
    pub fn with_driver_names(names: &[&str]) -> Self {
        Self::with_config(names, StagingOptions::default())
    }

    /// Like [`new`](Self::new) with other staging options.
    pub fn with_staging(staging: StagingOptions) -> Self {
        Self::with_config(probe::DEFAULT_NAMES, staging)
    }

    fn with_config(names: &[&str], staging: StagingOptions) -> Self {
        let staging = StagingOptions {
            chunk: staging.chunk.max(4096),
            copy_threads: staging.copy_threads.max(1),
            ..staging
        };
        let driver = probe::probe(names);
        match &driver {
            Ok(d) => tracing::info!(
                devices = d.count,
                driver = %probe::version_string(d.version),
                "CUDA driver loaded"
            ),
            Err(why) => tracing::info!(%why, "no CUDA devices"),
        }
        let count = driver.as_ref().map_or(0, |d| d.count);
        Self {
            inner: Arc::new(Inner {
                instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
                driver,
                gpus: (0..count).map(|_| OnceLock::new()).collect(),
                peers: Mutex::new(HashSet::new()),
                staging,
                host: HostPool::new(staging.pinned_pool),
            }),
        }
    }

    /// The staging options in use.
    pub fn staging(&self) -> StagingOptions {
        self.inner.staging
    }

    /// The CUDA version the driver supports, as `(major, minor)`, when a driver was found.
    pub fn driver_version(&self) -> Option<(u32, u32)> {
        let v = self.inner.driver.as_ref().ok()?.version;
        let v = u32::try_from(v).ok()?;
        Some((v / 1000, (v % 1000) / 10))
    }

    /// The device's name as the driver reports it (e.g. `NVIDIA H100 80GB HBM3`).
    pub fn device_name(&self, device: Device) -> Result<String, DeviceError> {
        let ordinal = self.inner.check(device)?;
        guarded(device, "cuDeviceGetName", || {
            let dev = result::device::get(ordinal as i32)?;
            result::device::get_name(dev)
        })
    }

    /// Total memory of the device in bytes.
    pub fn total_memory(&self, device: Device) -> Result<usize, DeviceError> {
        let ordinal = self.inner.check(device)?;
        guarded(device, "cuDeviceTotalMem", || {
            let dev = result::device::get(ordinal as i32)?;
            // SAFETY: `dev` is a valid device handle from cuDeviceGet.
            unsafe { result::device::total_mem(dev) }
        })
    }

    /// Whether `from` can read and write `to`'s memory directly (`cuDeviceCanAccessPeer`).
    pub fn can_access_peer(&self, from: Device, to: Device) -> Result<bool, DeviceError> {
        let a = self.inner.check(from)?;
        let b = self.inner.check(to)?;
        if a == b {
            return Ok(true);
        }
        guarded(from, "cuDeviceCanAccessPeer", || peer_capable(a, b))
    }

    /// The device's primary context (created on first use), for code that wants to issue its
    /// own cudarc work next to this backend's (benchmarks, collectives).
    pub fn context(&self, device: Device) -> Result<Arc<CudaContext>, DeviceError> {
        Ok(self.inner.gpu(device)?.ctx.clone())
    }

    /// The stream this backend copies on for `device`. Work a caller queues on it is ordered
    /// with the backend's copies.
    pub fn stream(&self, device: Device) -> Result<Arc<CudaStream>, DeviceError> {
        Ok(self.inner.gpu(device)?.stream.clone())
    }

    /// Wraps a device slice made elsewhere (on this backend's context for `device`) as a
    /// [`DeviceBuffer`] of this backend.
    pub fn wrap(&self, device: Device, slice: CudaSlice<u8>) -> Result<DeviceBuffer, DeviceError> {
        let ordinal = self.inner.check(device)?;
        if slice.ordinal() != ordinal as usize {
            return Err(DeviceError::Backend {
                device,
                op: "wrap",
                message: format!("the slice is on cuda:{}", slice.ordinal()),
            });
        }
        Ok(self.inner.buffer(device, Some(slice)))
    }

    /// Runs `f` off the async runtime (see the crate docs), turning a panic into an error.
    async fn blocking<T: Send + 'static>(
        &self,
        device: Device,
        op: &'static str,
        f: impl FnOnce(&Inner) -> Result<T, DeviceError> + Send + 'static,
    ) -> Result<T, DeviceError> {
        let inner = self.inner.clone();
        let job = move || {
            catch_unwind(AssertUnwindSafe(|| f(&inner)))
                .unwrap_or_else(|p| Err(panicked(device, op, p.as_ref())))
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => handle
                .spawn_blocking(job)
                .await
                .map_err(|e| DeviceError::Backend {
                    device,
                    op,
                    message: format!("the copy task failed: {e}"),
                })?,
            Err(_) => job(),
        }
    }
}

/// `cuDeviceCanAccessPeer(from, to)`.
fn peer_capable(from: u32, to: u32) -> Result<bool, DriverError> {
    let a = result::device::get(from as i32)?;
    let b = result::device::get(to as i32)?;
    let mut can: std::ffi::c_int = 0;
    // SAFETY: valid device handles and an out pointer to a live integer.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) }.result()?;
    Ok(can != 0)
}

/// Runs a cudarc call, turning its errors and panics into [`DeviceError::Backend`].
fn guarded<T>(
    device: Device,
    op: &'static str,
    f: impl FnOnce() -> Result<T, DriverError>,
) -> Result<T, DeviceError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| driver_error(device, op, e)),
        Err(p) => Err(panicked(device, op, p.as_ref())),
    }
}

fn driver_error(device: Device, op: &'static str, e: DriverError) -> DeviceError {
    DeviceError::Backend {
        device,
        op,
        message: e.to_string(),
    }
}

fn panicked(device: Device, op: &'static str, p: &(dyn std::any::Any + Send)) -> DeviceError {
    let what = tensorwire_core::protocol::served::panic_message(p);
    DeviceError::Backend {
        device,
        op,
        message: format!("the CUDA bindings panicked: {what}"),
    }
}

impl Inner {
    /// The ordinal of `device` if it exists here.
    fn check(&self, device: Device) -> Result<u32, DeviceError> {
        let count = match &self.driver {
            Ok(d) => d.count,
            Err(why) => return Err(DeviceError::Unavailable(why.clone())),
        };
        match device {
            Device::Cuda(i) if u32::from(i) < count => Ok(u32::from(i)),
            _ => Err(DeviceError::NoSuchDevice { device, count }),
        }
    }

    /// The device's context and stream, created on first use.
    fn gpu(&self, device: Device) -> Result<Arc<Gpu>, DeviceError> {
        let ordinal = self.check(device)?;
        self.gpus[ordinal as usize]
            .get_or_init(|| {
                guarded(device, "creating the context", || {
                    let ctx = CudaContext::new(ordinal as usize)?;
                    let stream = ctx.new_stream()?;
                    Ok(Arc::new(Gpu {
                        ordinal,
                        options: self.staging,
                        host: self.host.clone(),
                        ctx,
                        stream,
                        staging: Mutex::new(Vec::new()),
                        ipc: ipc::GpuIpc::default(),
                    }))
                })
            })
            .clone()
    }

    fn buffer(&self, device: Device, slice: Option<CudaSlice<u8>>) -> DeviceBuffer {
        let len = slice.as_ref().map_or(0, |s| s.len());
        let ordinal = device.index().map_or(0, u32::from);
        DeviceBuffer::new(
            device,
            len,
            Arc::new(CudaBuffer {
                owner: self.instance,
                ordinal,
                slice,
            }),
        )
    }

    fn ours<'a>(&self, buffer: &'a DeviceBuffer) -> Result<&'a CudaBuffer, DeviceError> {
        match buffer.handle::<CudaBuffer>() {
            Some(b) if b.owner == self.instance => Ok(b),
            _ => Err(DeviceError::ForeignBuffer(buffer.device())),
        }
    }

    /// Enables peer access from `to`'s context to `from`'s memory, once per pair.
    fn enable_peer(&self, from: &Gpu, to: &Gpu) -> Result<(), DriverError> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if peers.contains(&(from.ordinal, to.ordinal)) {
            return Ok(());
        }
        to.ctx.bind_to_thread()?;
        // SAFETY: both contexts are live primary contexts; the current one is `to`'s.
        match unsafe { sys::cuCtxEnablePeerAccess(from.ctx.cu_ctx(), 0) }.result() {
            Ok(()) => {}
            Err(DriverError(sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)) => {}
            Err(e) => return Err(e),
        }
        peers.insert((from.ordinal, to.ordinal));
        Ok(())
    }
}

impl Gpu {
    /// Two staging buffers from the pool (allocated when the pool is short).
    fn take_staging(&self) -> Result<[StagingBuffer; 2], DriverError> {
        let mut taken = {
            let mut pool = self.staging.lock().unwrap_or_else(|e| e.into_inner());
            let keep = pool.len().saturating_sub(2);
            pool.split_off(keep)
        };
        while taken.len() < 2 {
            // SAFETY: the memory is uninitialised; it is only read after a copy fills it.
            let host = unsafe {
                self.ctx.alloc_pinned_with_flags::<u8>(
                    self.options.chunk,
                    sys::CU_MEMHOSTALLOC_PORTABLE,
                )
            }?;
            let done = self.ctx.new_event(None)?;
            taken.push(StagingBuffer { host, done });
        }
        let b = taken.pop().expect("two buffers");
        let a = taken.pop().expect("two buffers");
        Ok([a, b])
    }

    /// Returns staging buffers whose copies have completed to the pool.
    fn return_staging(&self, buffers: [StagingBuffer; 2]) {
        let mut pool = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        for b in buffers {
            if pool.len() < POOLED_STAGING {
                pool.push(b);
            }
        }
    }

    /// Waits until everything queued on the copy stream so far has run.
    fn finish(&self) -> Result<(), DriverError> {
        let done = self.stream.record_event(None)?;
        done.synchronize()?;
        self.ctx.check_err()
    }

    /// Copies host bytes into a new device allocation through the staging buffers.
    fn upload(&self, data: &[u8]) -> Result<Option<CudaSlice<u8>>, DriverError> {
        if data.is_empty() {
            return Ok(None);
        }
        self.ctx.bind_to_thread()?;
        let stream = &self.stream;
        // SAFETY: every byte is written by the copies below before anyone reads it.
        let mut dst = unsafe { stream.alloc::<u8>(data.len()) }?;
        if self.host.contains(data) {
            // Already pinned (it came off a device through the pool): one DMA, no staging.
            let copied = {
                let (dptr, _record) = dst.device_ptr_mut(stream);
                // SAFETY: `dst` holds `data.len()` bytes; `data` is pinned and outlives the
                // copy, which `finish` waits for.
                unsafe { result::memcpy_htod_async(dptr, data, stream.cu_stream()) }
            };
            let finished = self.finish();
            copied.and(finished)?;
            return Ok(Some(dst));
        }
        let mut staging = self.take_staging()?;
        let copied = (|| {
            let (dptr, _record) = dst.device_ptr_mut(stream);
            let size = self.options.chunk;
            for (i, chunk) in data.chunks(size).enumerate() {
                let s = &mut staging[i % 2];
                // The previous copy out of this buffer must be done before it is refilled.
                s.done.synchronize()?;
                let host = &mut s.host.as_mut_slice()?[..chunk.len()];
                copy_parallel(as_uninit(host), chunk, self.options.copy_threads);
                let at = dptr + (i * size) as sys::CUdeviceptr;
                // SAFETY: `at..at+len` lies inside `dst`; `host` is pinned and stays alive
                // (and unmodified) until `done` fires, which is waited for before reuse or
                // before the buffer is returned or dropped.
                unsafe { result::memcpy_htod_async(at, host, stream.cu_stream()) }?;
                s.done.record(stream)?;
            }
            Ok(())
        })();
        let finished = self.finish();
        copied.and(finished)?;
        self.return_staging(staging);
        Ok(Some(dst))
    }

    /// Copies a device allocation into host memory: directly into pooled pinned memory when it
    /// is large enough and the pool is on, else through the staging buffers.
    fn download(&self, src: &CudaSlice<u8>) -> Result<Bytes, DriverError> {
        let len = src.len();
        if len < PINNED_OUTPUT_MIN || self.options.pinned_pool == 0 {
            return self.download_staged(src).map(Bytes::from);
        }
        self.ctx.bind_to_thread()?;
        let stream = &self.stream;
        let mut buf = self.host.take(&self.ctx, len)?;
        let copied = (|| {
            let host = &mut buf.as_mut_slice()?[..len];
            let (sptr, _record) = src.device_ptr(stream);
            // SAFETY: `host` is pinned, `len` bytes long like `src`, and not read until
            // `finish` has waited for the copy.
            unsafe { result::memcpy_dtoh_async(host, sptr, stream.cu_stream()) }
        })();
        let finished = self.finish();
        match copied.and(finished) {
            Ok(()) => self.host.into_bytes(buf, len),
            Err(e) => {
                self.host.discard(buf);
                Err(e)
            }
        }
    }

    /// Copies a device allocation into heap memory through the staging buffers.
    fn download_staged(&self, src: &CudaSlice<u8>) -> Result<Vec<u8>, DriverError> {
        let len = src.len();
        let mut out = Vec::with_capacity(len);
        self.ctx.bind_to_thread()?;
        let stream = &self.stream;
        let mut staging = self.take_staging()?;
        let size = self.options.chunk;
        let chunks = len.div_ceil(size);
        let copied = (|| {
            let (sptr, _record) = src.device_ptr(stream);
            let issue = |i: usize, s: &mut StagingBuffer| -> Result<(), DriverError> {
                let at = i * size;
                let n = size.min(len - at);
                let host = &mut s.host.as_mut_slice()?[..n];
                // SAFETY: `sptr+at..+n` lies inside `src`; `host` is pinned and not read until
                // `done` fires.
                unsafe {
                    result::memcpy_dtoh_async(
                        host,
                        sptr + at as sys::CUdeviceptr,
                        stream.cu_stream(),
                    )
                }?;
                s.done.record(stream)
            };
            issue(0, &mut staging[0])?;
            for i in 0..chunks {
                if i + 1 < chunks {
                    // The buffer for chunk i+1 was drained in the previous iteration.
                    issue(i + 1, &mut staging[(i + 1) % 2])?;
                }
                let s = &mut staging[i % 2];
                s.done.synchronize()?;
                let n = size.min(len - i * size);
                let at = out.len();
                let host = &s.host.as_slice()?[..n];
                copy_parallel(
                    &mut out.spare_capacity_mut()[..n],
                    host,
                    self.options.copy_threads,
                );
                // SAFETY: the `n` bytes after `at` were just written.
                unsafe { out.set_len(at + n) };
            }
            Ok(())
        })();
        let finished = self.finish();
        copied.and(finished)?;
        self.return_staging(staging);
        Ok(out)
    }
}

#[async_trait]
impl DeviceBackend for CudaDevices {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> u32 {
        self.inner.driver.as_ref().map_or(0, |d| d.count)
    }

    fn unavailable(&self) -> Option<DeviceUnavailable> {
        self.inner.driver.as_ref().err().cloned()
    }

    async fn to_device(&self, data: Bytes, device: Device) -> Result<DeviceBuffer, DeviceError> {
        self.inner.check(device)?;
        self.blocking(device, "host-to-device copy", move |inner| {
            let gpu = inner.gpu(device)?;
            let slice = gpu
                .upload(&data)
                .map_err(|e| driver_error(device, "host-to-device copy", e))?;
            Ok(inner.buffer(device, slice))
        })
        .await
    }

    async fn to_host(&self, buffer: &DeviceBuffer) -> Result<Bytes, DeviceError> {
        let device = buffer.device();
        if self.inner.ours(buffer)?.slice.is_none() {
            return Ok(Bytes::new());
        }
        let buffer = buffer.clone();
        self.blocking(device, "device-to-host copy", move |inner| {
            let gpu = inner.gpu(device)?;
            let src = inner.ours(&buffer)?.slice.as_ref().expect("checked above");
            gpu.download(src)
                .map_err(|e| driver_error(device, "device-to-host copy", e))
        })
        .await
    }

    async fn between(
        &self,
        buffer: &DeviceBuffer,
        to: Device,
    ) -> Result<DeviceBuffer, DeviceError> {
        self.inner.check(to)?;
        let ours = self.inner.ours(buffer)?;
        let from = Device::Cuda(ours.ordinal as u8);
        if ours.slice.is_none() {
            return Ok(self.inner.buffer(to, None));
        }
        let buffer = buffer.clone();
        self.blocking(to, "device-to-device copy", move |inner| {
            let src = inner.ours(&buffer)?.slice.as_ref().expect("checked above");
            let src_gpu = inner.gpu(from)?;
            let dst_gpu = inner.gpu(to)?;
            let err = |e| driver_error(to, "device-to-device copy", e);
            // Peer copy when the destination can reach the source's memory directly.
            let direct = src_gpu.ordinal == dst_gpu.ordinal
                || guarded(to, "cuDeviceCanAccessPeer", || {
                    peer_capable(dst_gpu.ordinal, src_gpu.ordinal)
                })?;
            let slice = if direct {
                if src_gpu.ordinal != dst_gpu.ordinal {
                    inner.enable_peer(&src_gpu, &dst_gpu).map_err(err)?;
                }
                dst_gpu.ctx.bind_to_thread().map_err(err)?;
                let copy = dst_gpu.stream.clone_dtod(src);
                let finished = dst_gpu.finish();
                let slice = copy.map_err(err)?;
                finished.map_err(err)?;
                Some(slice)
            } else {
                let bytes = src_gpu.download(src).map_err(err)?;
                dst_gpu.upload(&bytes).map_err(err)?
            };
            Ok(inner.buffer(to, slice))
        })
        .await
    }

    /// CUDA IPC with other processes of this host, when a driver and a device are there (see
    /// the `ipc` module: `cuIpcGetMemHandle`, `cuIpcOpenMemHandle`, interprocess events).
    fn ipc(&self) -> Option<&dyn DeviceIpc> {
        self.inner.driver.is_ok().then_some(self as &dyn DeviceIpc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_copies_copy_every_byte() {
        let src: Vec<u8> = (0..(3 << 20) + 7)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        for threads in [1, 2, 3, 8, 64] {
            let mut dst = vec![0u8; src.len()];
            copy_parallel(as_uninit(&mut dst), &src, threads);
            assert!(dst == src, "{threads} threads");
        }
        let mut out: Vec<u8> = Vec::with_capacity(10);
        copy_parallel(&mut out.spare_capacity_mut()[..10], &src[..10], 4);
        // SAFETY: the 10 bytes were just written.
        unsafe { out.set_len(10) };
        assert_eq!(out, src[..10]);
    }

    #[test]
    fn staging_options_are_clamped() {
        let cuda = CudaDevices::with_config(
            &["libtensorwire-no-such-driver.so"],
            StagingOptions {
                chunk: 1,
                copy_threads: 0,
                pinned_pool: 5,
            },
        );
        assert_eq!(
            cuda.staging(),
            StagingOptions {
                chunk: 4096,
                copy_threads: 1,
                pinned_pool: 5
            }
        );
    }
}
