//! NCCL through cudarc's bindings, loaded at run time (feature `nccl`).
//!
//! A thin blocking wrapper: availability with a clear reason, unique ids, a communicator per
//! rank, and all_reduce / broadcast / all_gather on this backend's device buffers, with an abort
//! handle that ends a hung collective from another thread. The `nccl` process-group backend
//! ([`nccl_group`](crate::nccl_group), registered by `tensorwire-process-group`'s feature
//! `nccl`) builds on it.
//!
//! cudarc panics when it cannot open `libnccl` or misses a symbol, so [`nccl_available`] opens
//! the library first, by the same names cudarc uses, checks the entry points and the version,
//! and reports failures as [`NcclUnavailable`]. [`NcclComm::new`] checks it before touching
//! cudarc, so an unavailable NCCL fails there, not at the first collective.
//!
//! Note: cudarc opens NCCL only as `libnccl.so` (and a few other names), not as `libnccl.so.2`,
//! the only name the `nvidia-nccl-cu12`/`-cu13` wheels ship. With a wheel, put a `libnccl.so`
//! symlink to its `libnccl.so.2` in a folder on `LD_LIBRARY_PATH`; [`nccl_available`] says so
//! when it finds only the versioned name.

use std::ffi::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{sys, Id};
use tensorwire_core::collective::ReduceOp;
use tensorwire_core::device::Device;
use tensorwire_core::ports::device::{DeviceBackend, DeviceError};
use tensorwire_core::tensor::{DType, DeviceBuffer};

use crate::{CudaBuffer, CudaDevices};

/// The oldest NCCL supported (every entry point used exists there).
pub const MIN_NCCL_VERSION: NcclVersion = NcclVersion {
    major: 2,
    minor: 18,
    patch: 0,
};

/// Entry points the wrapper (through cudarc) calls.
const REQUIRED_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclAllReduce",
    "ncclAllGather",
    "ncclBroadcast",
    "ncclGetErrorString",
];

/// An NCCL version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl NcclVersion {
    /// Decodes `ncclGetVersion` (`major*10000 + minor*100 + patch` since 2.9, `major*1000 +
    /// minor*100 + patch` before).
    pub fn from_code(code: u32) -> Self {
        if code >= 20_900 {
            Self {
                major: code / 10_000,
                minor: code % 10_000 / 100,
                patch: code % 100,
            }
        } else {
            Self {
                major: code / 1000,
                minor: code % 1000 / 100,
                patch: code % 100,
            }
        }
    }
}

/// Why NCCL cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NcclUnavailable {
    /// No NCCL library could be opened.
    #[error(
        "the NCCL library could not be loaded (tried {tried}); install NCCL {MIN_NCCL_VERSION} or newer and put its folder on LD_LIBRARY_PATH"
    )]
    LibraryNotFound {
        /// Names tried and why each failed.
        tried: String,
    },
    /// NCCL is installed only under its versioned name, which cudarc does not open.
    #[error(
        "NCCL is installed as {found}, but the bindings open it only as one of {names}; put a symlink named libnccl.so pointing to it in a folder on LD_LIBRARY_PATH"
    )]
    OnlyVersionedName {
        /// The versioned name that loads.
        found: String,
        /// The names the bindings try.
        names: String,
    },
    /// The library lacks an entry point.
    #[error("the NCCL library {library} lacks {symbol}")]
    MissingSymbol {
        /// The library opened.
        library: String,
        /// The missing function.
        symbol: String,
    },
    /// The library is too old.
    #[error("NCCL {found} is too old: {MIN_NCCL_VERSION} or newer is needed")]
    TooOld {
        /// The version found.
        found: NcclVersion,
    },
}

/// An NCCL operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// NCCL cannot be used at all.
    #[error("NCCL is unavailable: {0}")]
    Unavailable(#[from] NcclUnavailable),
    /// The device backend failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Bad arguments.
    #[error("{0}")]
    Invalid(String),
    /// The communicator was aborted (by [`NcclAbort::abort`], after a timeout): this call and
    /// every later one fail.
    #[error("{op} on rank {rank}: the NCCL communicator was aborted ({message})")]
    Aborted {
        /// What was being done.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// What the call saw.
        message: String,
    },
    /// A collective did not complete within the communicator's timeout; the communicator was
    /// aborted.
    #[error(
        "{op} on rank {rank} did not complete within {after:?}; the NCCL communicator was aborted"
    )]
    TimedOut {
        /// What was being done.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// How long it waited.
        after: Duration,
    },
    /// NCCL returned an error.
    #[error("{op} (rank {rank} of {world_size} on {device}) failed: {message}")]
    Failed {
        /// What was being done.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
        /// The device.
        device: Device,
        /// NCCL's message.
        message: String,
    },
}

/// Whether NCCL can be used: its version, or why not. The answer is computed once.
pub fn nccl_available() -> Result<NcclVersion, NcclUnavailable> {
    static PROBE: OnceLock<Result<NcclVersion, NcclUnavailable>> = OnceLock::new();
    PROBE.get_or_init(probe).clone()
}

fn probe() -> Result<NcclVersion, NcclUnavailable> {
    let mut names = cudarc::get_lib_name_candidates("nccl");
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    let mut first_error = None;
    for name in &names {
        // SAFETY: opening NCCL runs its initialisers, which are sound to run.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => {
                let version = check(&lib, name)?;
                // cudarc opens the same library; keep it loaded.
                std::mem::forget(lib);
                return Ok(version);
            }
            Err(e) => {
                first_error.get_or_insert_with(|| match std::error::Error::source(&e) {
                    Some(why) => why.to_string(),
                    None => format!("{name}: {e}"),
                });
            }
        }
    }
    // SAFETY: as above.
    if unsafe { libloading::Library::new("libnccl.so.2") }.is_ok() {
        return Err(NcclUnavailable::OnlyVersionedName {
            found: "libnccl.so.2".into(),
            names: names.join(", "),
        });
    }
    Err(NcclUnavailable::LibraryNotFound {
        tried: format!(
            "{} and libnccl.so.2; first error: {}",
            names.join(", "),
            first_error.unwrap_or_default()
        ),
    })
}

fn check(lib: &libloading::Library, name: &str) -> Result<NcclVersion, NcclUnavailable> {
    for symbol in REQUIRED_SYMBOLS {
        // SAFETY: only the symbol's presence is checked.
        if unsafe { lib.get::<*const ()>(symbol.as_bytes()) }.is_err() {
            return Err(NcclUnavailable::MissingSymbol {
                library: name.into(),
                symbol: (*symbol).into(),
            });
        }
    }
    type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
    let mut code: c_int = 0;
    // SAFETY: `ncclGetVersion(int*)` per nccl.h; the symbol exists (checked above).
    let rc = unsafe {
        let f: libloading::Symbol<'_, GetVersion> =
            lib.get(b"ncclGetVersion\0")
                .map_err(|_| NcclUnavailable::MissingSymbol {
                    library: name.into(),
                    symbol: "ncclGetVersion".into(),
                })?;
        f(&mut code)
    };
    let version = NcclVersion::from_code(u32::try_from(code).unwrap_or(0));
    if rc != 0 || version < MIN_NCCL_VERSION {
        return Err(NcclUnavailable::TooOld { found: version });
    }
    Ok(version)
}

/// An NCCL unique id: made by one rank, sent to the others (later through the store).
#[derive(Clone, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`).
    pub fn new() -> Result<Self, NcclError> {
        nccl_available()?;
        let fail = |message| NcclError::Failed {
            op: "ncclGetUniqueId",
            rank: 0,
            world_size: 0,
            device: Device::Cpu,
            message,
        };
        let id = catch_unwind(Id::new)
            .map_err(|_| fail("the NCCL bindings panicked".into()))?
            .map_err(|e| fail(message(e.0)))?;
        Ok(Self(id.internal().map(|c| c as u8)))
    }

    /// The id's bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    /// An id received from another rank.
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        Self(bytes)
    }
}

/// One rank's NCCL communicator on one device of a [`CudaDevices`] backend.
///
/// Collectives run on the backend's copy stream for the device, so they are ordered with its
/// copies, and block until their result is complete (call them from blocking threads in async
/// code). One collective at a time: every rank must issue the same collectives in the same
/// order, so a caller serialises them anyway.
///
/// A collective that hangs (a peer died, or never called it) can be ended from another thread
/// with [`NcclAbort::abort`]: the communicator is aborted, the blocked call returns an error and
/// every later call fails with [`NcclError::Aborted`].
pub struct NcclComm {
    raw: Arc<RawComm>,
    /// How long a collective may run before the communicator is aborted (`None`: no limit).
    timeout: Option<Duration>,
    cuda: CudaDevices,
    stream: Arc<CudaStream>,
    device: Device,
    rank: usize,
    world_size: usize,
}

/// The raw communicator, shared with [`NcclAbort`] handles.
struct RawComm {
    comm: sys::ncclComm_t,
    /// Whether the communicator was aborted (its memory is then gone; nothing may use it).
    aborted: Mutex<bool>,
}

// SAFETY: an NCCL communicator may be used from any thread; calls on it are serialised by
// `NcclComm` (`&self` methods are documented as one-at-a-time and `NcclGroup` holds a lock),
// and `ncclCommAbort` is documented as callable from another thread while a call is blocked.
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

impl RawComm {
    /// Aborts the communicator once; returns whether this call did it.
    fn abort(&self) -> bool {
        let mut aborted = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        if *aborted {
            return false;
        }
        *aborted = true;
        // SAFETY: the communicator is live (not aborted before, checked under the lock).
        let rc = unsafe { sys::ncclCommAbort(self.comm) };
        if rc != sys::ncclResult_t::ncclSuccess {
            tracing::warn!("ncclCommAbort: {}", message(rc));
        }
        true
    }

    /// Runs `f` with the communicator unless it was aborted.
    ///
    /// The lock is released before `f` runs, so an abort from another thread can end a call
    /// blocked inside NCCL. The price is a window between the check and the call: an abort that
    /// lands exactly there frees the communicator under `f`. Aborts from another thread happen
    /// only after a whole timeout has passed since the collective started, so the calling thread
    /// would have to stall for that long between two instructions.
    fn with<T>(&self, f: impl FnOnce(sys::ncclComm_t) -> T) -> Option<T> {
        let aborted = *self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        (!aborted).then(|| f(self.comm))
    }
}

/// Ends a communicator's blocked collective from another thread (see [`NcclComm`]).
#[derive(Clone)]
pub struct NcclAbort(Arc<RawComm>);

impl std::fmt::Debug for NcclAbort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclAbort(..)")
    }
}

impl NcclAbort {
    /// Aborts the communicator (`ncclCommAbort`); returns whether this call did it (false when
    /// it was aborted before).
    pub fn abort(&self) -> bool {
        self.0.abort()
    }

    /// Whether the communicator has been aborted.
    pub fn is_aborted(&self) -> bool {
        *self.0.aborted.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How waiting for a collective ended, when it did not complete.
enum Wait {
    /// Past the communicator's timeout (the communicator was aborted).
    TimedOut(Duration),
    /// Anything else, with the message.
    Failed(String),
}

impl From<String> for Wait {
    fn from(message: String) -> Self {
        Wait::Failed(message)
    }
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("device", &self.device)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

/// NCCL's text for a result code.
fn message(rc: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe {
        let p = sys::ncclGetErrorString(rc);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    format!("{text} ({rc:?})")
}

/// The NCCL element type for a tensor dtype.
pub fn nccl_type(dtype: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as T;
    Some(match dtype {
        DType::U8 => T::ncclUint8,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        // The NCCL 2.22 bindings have no bfloat16 (and DType is non-exhaustive).
        _ => return None,
    })
}

/// The NCCL operation for `op`; `None` for the bitwise operations, which NCCL does not
/// have, and for avg, which the process group does not ask NCCL for.
fn nccl_op(op: ReduceOp) -> Option<sys::ncclRedOp_t> {
    Some(match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Product => sys::ncclRedOp_t::ncclProd,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        _ => return None,
    })
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world_size` on `device`. Fails with
    /// [`NcclError::Unavailable`] when NCCL cannot be used. Blocks until every rank has joined
    /// (make sure they all will: [`NcclGroup`](crate) setups wait for every rank first).
    pub fn new(
        cuda: &CudaDevices,
        device: Device,
        rank: usize,
        world_size: usize,
        id: &NcclId,
    ) -> Result<Self, NcclError> {
        nccl_available()?;
        if rank >= world_size {
            return Err(NcclError::Invalid(format!(
                "rank {rank} is not below the world size {world_size}"
            )));
        }
        let (Ok(nranks), Ok(my_rank)) = (c_int::try_from(world_size), c_int::try_from(rank)) else {
            return Err(NcclError::Invalid(format!(
                "world size {world_size} does not fit NCCL's int"
            )));
        };
        let stream = cuda.stream(device)?;
        let fail = |message| NcclError::Failed {
            op: "ncclCommInitRank",
            rank,
            world_size,
            device,
            message,
        };
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| fail(format!("binding the CUDA context: {e:?}")))?;
        let internal: [c_char; 128] = id.0.map(|b| b as c_char);
        let mut comm = std::mem::MaybeUninit::<sys::ncclComm_t>::uninit();
        // SAFETY: `comm` is a valid out-pointer; the id is 128 bytes as NCCL defines it.
        let rc = catch_unwind(AssertUnwindSafe(|| unsafe {
            sys::ncclCommInitRank(
                comm.as_mut_ptr(),
                nranks,
                sys::ncclUniqueId { internal },
                my_rank,
            )
        }))
        .map_err(|_| fail("the NCCL bindings panicked".into()))?;
        if rc != sys::ncclResult_t::ncclSuccess {
            return Err(fail(message(rc)));
        }
        // SAFETY: ncclCommInitRank succeeded, so it wrote the communicator.
        let comm = unsafe { comm.assume_init() };
        Ok(Self {
            timeout: None,
            raw: Arc::new(RawComm {
                comm,
                aborted: Mutex::new(false),
            }),
            cuda: cuda.clone(),
            stream,
            device,
            rank,
            world_size,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Bounds every later collective: one that has not completed after `timeout` aborts the
    /// communicator and fails with [`NcclError::TimedOut`]. `None` (the default) waits forever.
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// A handle that aborts this communicator from another thread.
    pub fn abort_handle(&self) -> NcclAbort {
        NcclAbort(self.raw.clone())
    }

    fn fail(&self, op: &'static str, message: String) -> NcclError {
        NcclError::Failed {
            op,
            rank: self.rank,
            world_size: self.world_size,
            device: self.device,
            message,
        }
    }

    /// The device memory of `buffer` (`None` when empty), checked to be on this device and of
    /// this backend.
    fn source<'b>(&self, buffer: &'b DeviceBuffer) -> Result<Option<&'b CudaSlice<u8>>, NcclError> {
        if buffer.device() != self.device {
            return Err(NcclError::Invalid(format!(
                "the buffer is on {}, the communicator on {}",
                buffer.device(),
                self.device
            )));
        }
        let handle = buffer
            .handle::<CudaBuffer>()
            .ok_or(DeviceError::ForeignBuffer(buffer.device()))?;
        Ok(handle.slice())
    }

    /// Waits for the work queued on `stream` as NCCL's documentation recommends: polls the
    /// stream (through an event) and the communicator's asynchronous error; on an asynchronous
    /// error (a peer failed, a network error) or past the timeout it aborts the communicator,
    /// which ends the hung kernels.
    fn wait(&self, stream: &CudaStream) -> Result<(), Wait> {
        let done = stream
            .record_event(None)
            .map_err(|e| Wait::Failed(format!("recording an event: {e:?}")))?;
        let start = Instant::now();
        let mut pause = Duration::from_micros(0);
        loop {
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(Wait::Failed(format!("waiting for the stream: {e:?}"))),
            }
            let mut async_error = sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator (`with` checks) and a valid out-pointer.
            let rc = self
                .raw
                .with(|comm| unsafe { sys::ncclCommGetAsyncError(comm, &mut async_error) });
            let Some(rc) = rc else {
                return Err(Wait::Failed(
                    "the communicator was aborted while the collective ran".into(),
                ));
            };
            let failed = [rc, async_error].into_iter().find(|r| {
                !matches!(
                    r,
                    sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                )
            });
            if let Some(r) = failed {
                self.raw.abort();
                return Err(Wait::Failed(format!(
                    "NCCL reported an asynchronous error: {}",
                    message(r)
                )));
            }
            if let Some(limit) = self.timeout {
                let waited = start.elapsed();
                if waited >= limit {
                    self.raw.abort();
                    return Err(Wait::TimedOut(waited));
                }
            }
            // Yield at first (short collectives), then back off to at most 1 ms.
            if pause.is_zero() {
                std::thread::yield_now();
                if start.elapsed() > Duration::from_micros(200) {
                    pause = Duration::from_micros(20);
                }
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
    }

    /// Allocates `len` bytes on the device, runs `enqueue` (which queues one NCCL call on the
    /// stream, given the communicator, the stream and the output's address), waits for the
    /// stream and returns the output. Panics in the bindings become errors.
    fn run(
        &self,
        op: &'static str,
        len: usize,
        enqueue: impl FnOnce(
            sys::ncclComm_t,
            sys::cudaStream_t,
            *mut std::ffi::c_void,
        ) -> sys::ncclResult_t,
    ) -> Result<CudaSlice<u8>, NcclError> {
        let stream = &self.stream;
        let out = catch_unwind(AssertUnwindSafe(|| -> Result<CudaSlice<u8>, Wait> {
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| format!("binding the CUDA context: {e:?}"))?;
            // SAFETY: the allocation is fully written by the collective before anyone reads it.
            let mut out =
                unsafe { stream.alloc::<u8>(len.max(1)) }.map_err(|e| format!("{e:?}"))?;
            let rc = {
                let (dst, _record) = out.device_ptr_mut(stream);
                let raw_stream = stream.cu_stream() as sys::cudaStream_t;
                self.raw
                    .with(|comm| enqueue(comm, raw_stream, dst as *mut std::ffi::c_void))
                    .ok_or_else(|| "the communicator was aborted".to_owned())?
            };
            if rc != sys::ncclResult_t::ncclSuccess {
                return Err(Wait::Failed(message(rc)));
            }
            self.wait(stream)?;
            // An abort ends the kernels without a CUDA error: the output is then garbage.
            if self.abort_handle().is_aborted() {
                return Err(Wait::Failed(
                    "the communicator was aborted while the collective ran".to_owned(),
                ));
            }
            Ok(out)
        }))
        .map_err(|_| self.fail(op, "the NCCL bindings panicked".into()))?;
        match out {
            Ok(out) => Ok(out),
            Err(Wait::TimedOut(after)) => Err(NcclError::TimedOut {
                op,
                rank: self.rank,
                after,
            }),
            Err(Wait::Failed(m)) if self.abort_handle().is_aborted() => Err(NcclError::Aborted {
                op,
                rank: self.rank,
                message: m,
            }),
            Err(Wait::Failed(m)) => Err(self.fail(op, m)),
        }
    }

    /// Reduces `buffer` (elements of `dtype`, on this communicator's device) over all ranks with
    /// `op` into a new buffer, and waits for the result.
    pub fn all_reduce(
        &self,
        buffer: &DeviceBuffer,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<DeviceBuffer, NcclError> {
        let ty = nccl_type(dtype)
            .ok_or_else(|| NcclError::Invalid(format!("NCCL cannot reduce {dtype:?} elements")))?;
        let nccl_op = nccl_op(op)
            .ok_or_else(|| NcclError::Invalid(format!("NCCL cannot reduce with {op}")))?;
        if buffer.len() % dtype.size() != 0 {
            return Err(NcclError::Invalid(format!(
                "{} bytes are not whole {dtype:?} elements",
                buffer.len()
            )));
        }
        let Some(src) = self.source(buffer)? else {
            return Ok(buffer.clone());
        };
        let count = buffer.len() / dtype.size();
        let (src_ptr, _record) = src.device_ptr(&self.stream);
        let out = self.run("ncclAllReduce", buffer.len(), |comm, stream, dst| {
            // SAFETY: `src` and `dst` hold `count` elements on this communicator's device.
            unsafe {
                sys::ncclAllReduce(
                    src_ptr as *const std::ffi::c_void,
                    dst,
                    count,
                    ty,
                    nccl_op,
                    comm,
                    stream,
                )
            }
        })?;
        Ok(self.cuda.wrap(self.device, out)?)
    }

    /// Copies `root`'s `buffer` to every rank (every rank passes a buffer of the same length)
    /// into a new buffer, and waits for it.
    pub fn broadcast(&self, buffer: &DeviceBuffer, root: usize) -> Result<DeviceBuffer, NcclError> {
        let root = c_int::try_from(root)
            .ok()
            .filter(|r| (*r as usize) < self.world_size)
            .ok_or_else(|| {
                NcclError::Invalid(format!(
                    "broadcast root {root} is not below the world size {}",
                    self.world_size
                ))
            })?;
        let Some(src) = self.source(buffer)? else {
            return Ok(buffer.clone());
        };
        let (src_ptr, _record) = src.device_ptr(&self.stream);
        let len = buffer.len();
        let out = self.run("ncclBroadcast", len, |comm, stream, dst| {
            // SAFETY: `src` and `dst` hold `len` bytes on this communicator's device.
            unsafe {
                sys::ncclBroadcast(
                    src_ptr as *const std::ffi::c_void,
                    dst,
                    len,
                    sys::ncclDataType_t::ncclUint8,
                    root,
                    comm,
                    stream,
                )
            }
        })?;
        Ok(self.cuda.wrap(self.device, out)?)
    }

    /// Gathers `buffer` from every rank (every rank passes a buffer of the same length) and
    /// returns one buffer per rank, in rank order.
    pub fn all_gather(&self, buffer: &DeviceBuffer) -> Result<Vec<DeviceBuffer>, NcclError> {
        let len = buffer.len();
        let Some(src) = self.source(buffer)? else {
            return Ok(vec![buffer.clone(); self.world_size]);
        };
        let total = len
            .checked_mul(self.world_size)
            .ok_or_else(|| NcclError::Invalid("the gathered size overflows".into()))?;
        let (src_ptr, _record) = src.device_ptr(&self.stream);
        let flat = self.run("ncclAllGather", total, |comm, stream, dst| {
            // SAFETY: `src` holds `len` bytes, `dst` `len * world_size`, on this device.
            unsafe {
                sys::ncclAllGather(
                    src_ptr as *const std::ffi::c_void,
                    dst,
                    len,
                    sys::ncclDataType_t::ncclUint8,
                    comm,
                    stream,
                )
            }
        })?;
        // One buffer per rank: device-to-device copies out of the flat result.
        let stream = &self.stream;
        let parts = catch_unwind(AssertUnwindSafe(|| {
            let mut parts = Vec::with_capacity(self.world_size);
            for r in 0..self.world_size {
                let part = flat.slice(r * len..(r + 1) * len);
                let copy = stream.clone_dtod(&part).map_err(|e| format!("{e:?}"))?;
                parts.push(copy);
            }
            stream.synchronize().map_err(|e| format!("{e:?}"))?;
            Ok::<_, String>(parts)
        }))
        .map_err(|_| self.fail("ncclAllGather", "the CUDA bindings panicked".into()))?
        .map_err(|m| self.fail("ncclAllGather", m))?;
        parts
            .into_iter()
            .map(|p| Ok(self.cuda.wrap(self.device, p)?))
            .collect()
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Abort rather than finalize: finalizing waits for peers that may be gone.
        let _ = catch_unwind(AssertUnwindSafe(|| self.raw.abort()));
    }
}

/// The GPU check's NCCL step: a one-rank communicator on `cuda:0` and an `f32` sum all_reduce of
/// 1 Mi values, compared with the input (the sum over one rank). Returns a line for the report.
/// (NCCL calls block; they are short here.)
pub async fn self_check(cuda: &CudaDevices) -> Result<String, String> {
    let version = nccl_available().map_err(|e| e.to_string())?;
    let id = NcclId::new().map_err(|e| e.to_string())?;
    let t = Instant::now();
    let comm = NcclComm::new(cuda, Device::Cuda(0), 0, 1, &id).map_err(|e| e.to_string())?;
    let init = t.elapsed();
    let values: Vec<f32> = (0..1 << 20).map(|i| (i % 1000) as f32 * 0.5).collect();
    let bytes: Bytes = values
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect::<Vec<u8>>()
        .into();
    let buf = cuda
        .to_device(bytes.clone(), Device::Cuda(0))
        .await
        .map_err(|e| e.to_string())?;
    let t = Instant::now();
    let summed = comm
        .all_reduce(&buf, DType::F32, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let reduce = t.elapsed();
    let back = cuda.to_host(&summed).await.map_err(|e| e.to_string())?;
    if back != bytes {
        return Err("the 1-rank all_reduce changed the values".into());
    }
    drop(comm);
    Ok(format!(
        "NCCL {version}; 1 rank, 4 MiB f32 sum equal to the input; init {:.0} ms, all_reduce {:.2} ms",
        init.as_secs_f64() * 1e3,
        reduce.as_secs_f64() * 1e3
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_both_encodings() {
        let v = NcclVersion::from_code(22_809);
        assert_eq!((v.major, v.minor, v.patch), (2, 28, 9));
        assert_eq!(v.to_string(), "2.28.9");
        assert_eq!(NcclVersion::from_code(2_804).to_string(), "2.8.4");
        assert!(NcclVersion::from_code(21_805) >= MIN_NCCL_VERSION);
        assert!(NcclVersion::from_code(21_708) < MIN_NCCL_VERSION);
    }
}
