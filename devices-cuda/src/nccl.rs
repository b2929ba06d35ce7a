//! NCCL through cudarc's bindings, loaded at run time (feature `nccl`).
//!
//! A small standalone wrapper: availability with a clear reason, unique ids, a communicator per
//! rank and an `f32` sum all-reduce on this backend's device buffers. It is not wired into the
//! process group yet.
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
use std::time::Instant;

use bytes::Bytes;
use cudarc::nccl::{Comm, Id, ReduceOp};
use tensorwire_core::device::Device;
use tensorwire_core::ports::device::{DeviceBackend, DeviceError};
use tensorwire_core::tensor::DeviceBuffer;

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
    "ncclAllReduce",
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
        let id = nccl_call("ncclGetUniqueId", Device::Cpu, 0, 0, Id::new)?;
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
/// copies, and block until complete (call them from blocking threads in async code).
pub struct NcclComm {
    comm: Option<Comm>,
    cuda: CudaDevices,
    device: Device,
    rank: usize,
    world_size: usize,
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

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world_size` on `device`. Fails with
    /// [`NcclError::Unavailable`] when NCCL cannot be used. Blocks until every rank has joined.
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
        let stream = cuda.stream(device)?;
        let internal: [c_char; 128] = id.0.map(|b| b as c_char);
        let comm = nccl_call("ncclCommInitRank", device, rank, world_size, || {
            stream.context().bind_to_thread().map_err(|_| {
                cudarc::nccl::result::NcclError(
                    cudarc::nccl::sys::ncclResult_t::ncclUnhandledCudaError,
                )
            })?;
            Comm::from_rank(stream.clone(), rank, world_size, Id::uninit(internal))
        })?;
        Ok(Self {
            comm: Some(comm),
            cuda: cuda.clone(),
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

    /// Sums `buffer` (little-endian `f32`s on this communicator's device) over all ranks into a
    /// new buffer, and waits for the result.
    pub fn all_reduce_sum_f32(&self, buffer: &DeviceBuffer) -> Result<DeviceBuffer, NcclError> {
        let fail = |op: &'static str, message: String| NcclError::Failed {
            op,
            rank: self.rank,
            world_size: self.world_size,
            device: self.device,
            message,
        };
        if buffer.device() != self.device {
            return Err(NcclError::Invalid(format!(
                "the buffer is on {}, the communicator on {}",
                buffer.device(),
                self.device
            )));
        }
        if buffer.len() % 4 != 0 {
            return Err(NcclError::Invalid(format!(
                "an f32 all_reduce needs a multiple of 4 bytes, the buffer has {}",
                buffer.len()
            )));
        }
        let src = buffer
            .handle::<CudaBuffer>()
            .ok_or(DeviceError::ForeignBuffer(buffer.device()))?;
        let Some(src) = src.slice() else {
            return Ok(buffer.clone());
        };
        let comm = self.comm.as_ref().expect("present until drop");
        let stream = comm.stream();
        let n = buffer.len() / 4;
        let out = catch_unwind(AssertUnwindSafe(|| {
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| e.to_string())?;
            // SAFETY: the new allocation is fully written by the all_reduce before use.
            let mut out = unsafe { stream.alloc::<u8>(buffer.len()) }.map_err(|e| e.to_string())?;
            {
                // SAFETY: both slices hold `n` f32 values (length checked above).
                let send = unsafe { src.transmute::<f32>(n) }.ok_or("cannot view as f32")?;
                let mut recv =
                    unsafe { out.transmute_mut::<f32>(n) }.ok_or("cannot view as f32")?;
                comm.all_reduce(&send, &mut recv, &ReduceOp::Sum)
                    .map_err(|e| format!("{:?}", e.0))?;
            }
            stream.synchronize().map_err(|e| e.to_string())?;
            Ok::<_, String>(out)
        }))
        .map_err(|_| fail("ncclAllReduce", "the NCCL bindings panicked".into()))?
        .map_err(|m| fail("ncclAllReduce", m))?;
        Ok(self.cuda.wrap(self.device, out)?)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if let Some(comm) = self.comm.take() {
            // cudarc's Comm panics in drop when ncclCommAbort fails; keep that inside.
            if catch_unwind(AssertUnwindSafe(|| drop(comm))).is_err() {
                tracing::warn!(rank = self.rank, device = %self.device, "ncclCommAbort failed");
            }
        }
    }
}

/// Runs an NCCL call, turning its error and panics into [`NcclError::Failed`].
fn nccl_call<T>(
    op: &'static str,
    device: Device,
    rank: usize,
    world_size: usize,
    f: impl FnOnce() -> Result<T, cudarc::nccl::result::NcclError>,
) -> Result<T, NcclError> {
    let fail = |message| NcclError::Failed {
        op,
        rank,
        world_size,
        device,
        message,
    };
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(fail(format!("{:?}", e.0))),
        Err(_) => Err(fail("the NCCL bindings panicked".into())),
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
    let summed = comm.all_reduce_sum_f32(&buf).map_err(|e| e.to_string())?;
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
