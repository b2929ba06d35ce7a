//! Finding the CUDA driver before cudarc does.
//!
//! cudarc panics when it cannot open `libcuda` or a symbol is missing. This module opens the
//! library itself with `libloading`, checks that every entry point the backend uses is there,
//! and asks the driver for its version and device count, so each failure becomes a
//! [`DeviceUnavailable`] instead of a panic.

use std::ffi::{c_char, c_int, c_uint, CStr};

use tensorwire_core::ports::device::DeviceUnavailable;

/// The driver library names tried, in order.
#[cfg(windows)]
pub(crate) const DEFAULT_NAMES: &[&str] = &["nvcuda.dll"];
/// The driver library names tried, in order.
#[cfg(not(windows))]
pub(crate) const DEFAULT_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// The oldest driver API version supported: 12.0 (the cudarc bindings are built for it).
pub(crate) const MIN_DRIVER_VERSION: i32 = 12_000;

/// Every driver entry point the backend (through cudarc) may call. All exist in CUDA 12.0
/// drivers; checking them up front turns a missing one into an error instead of a panic deep
/// inside a copy.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxEnablePeerAccess",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuEventElapsedTime",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuMemsetD8Async",
    "cuGetErrorName",
    "cuGetErrorString",
    // CUDA IPC (the `ipc` module).
    "cuDeviceGetUuid_v2",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
];

const CUDA_ERROR_INSUFFICIENT_DRIVER: c_int = 35;
const CUDA_ERROR_NO_DEVICE: c_int = 100;

/// What the probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Driver {
    /// `cuDriverGetVersion`: 1000 × major + 10 × minor.
    pub(crate) version: i32,
    /// `cuDeviceGetCount` (at least 1).
    pub(crate) count: u32,
}

/// `12040` → `"12.4"`.
pub(crate) fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuIntOut = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// Opens the driver from `names` (first that loads) and checks it.
pub(crate) fn probe(names: &[&str]) -> Result<Driver, DeviceUnavailable> {
    let mut tried = Vec::new();
    let mut lib = None;
    for name in names {
        // SAFETY: loading the CUDA driver runs its initialisers, which are sound to run; we
        // never load arbitrary user libraries here, only the driver names.
        match unsafe { libloading::Library::new(*name) } {
            Ok(l) => {
                lib = Some(l);
                break;
            }
            Err(e) => tried.push(match std::error::Error::source(&e) {
                Some(why) => why.to_string(),
                None => format!("{name}: {e}"),
            }),
        }
    }
    let Some(lib) = lib else {
        return Err(DeviceUnavailable::LibraryNotFound(format!(
            "tried {}",
            tried.join("; ")
        )));
    };
    let result = check(&lib);
    if result.is_ok() {
        // Never unload a driver that has been initialised: cudarc opens the same library and
        // the driver keeps threads and state that outlive a dlclose.
        std::mem::forget(lib);
    }
    result
}

fn check(lib: &libloading::Library) -> Result<Driver, DeviceUnavailable> {
    // SAFETY: the symbol types match the CUDA driver API declarations (cuda.h).
    unsafe {
        let get_version: libloading::Symbol<'_, CuIntOut> = lib
            .get(b"cuDriverGetVersion\0")
            .map_err(|e| DeviceUnavailable::InitFailed(format!("no cuDriverGetVersion: {e}")))?;
        let mut version: c_int = 0;
        let rc = get_version(&mut version);
        if rc != 0 {
            return Err(DeviceUnavailable::InitFailed(format!(
                "cuDriverGetVersion returned error {rc}"
            )));
        }
        if version < MIN_DRIVER_VERSION {
            return Err(too_old(version));
        }
        let missing: Vec<&str> = REQUIRED_SYMBOLS
            .iter()
            .copied()
            .filter(|s| lib.get::<*const ()>(s.as_bytes()).is_err())
            .collect();
        if !missing.is_empty() {
            tracing::warn!(
                ?missing,
                "the CUDA driver lacks entry points the backend uses"
            );
            return Err(too_old(version));
        }
        let error_name: libloading::Symbol<'_, CuErrorName> = lib
            .get(b"cuGetErrorName\0")
            .map_err(|e| DeviceUnavailable::InitFailed(e.to_string()))?;
        let describe = |rc: c_int| {
            let mut p: *const c_char = std::ptr::null();
            if error_name(rc, &mut p) == 0 && !p.is_null() {
                format!("{} ({rc})", CStr::from_ptr(p).to_string_lossy())
            } else {
                format!("error {rc}")
            }
        };
        let init: libloading::Symbol<'_, CuInit> = lib
            .get(b"cuInit\0")
            .map_err(|e| DeviceUnavailable::InitFailed(e.to_string()))?;
        match init(0) {
            0 => {}
            CUDA_ERROR_NO_DEVICE => return Err(DeviceUnavailable::NoDevice),
            CUDA_ERROR_INSUFFICIENT_DRIVER => return Err(too_old(version)),
            rc => {
                return Err(DeviceUnavailable::InitFailed(format!(
                    "cuInit returned {}",
                    describe(rc)
                )))
            }
        }
        let get_count: libloading::Symbol<'_, CuIntOut> = lib
            .get(b"cuDeviceGetCount\0")
            .map_err(|e| DeviceUnavailable::InitFailed(e.to_string()))?;
        let mut count: c_int = 0;
        match get_count(&mut count) {
            0 => {}
            CUDA_ERROR_NO_DEVICE => return Err(DeviceUnavailable::NoDevice),
            rc => {
                return Err(DeviceUnavailable::InitFailed(format!(
                    "cuDeviceGetCount returned {}",
                    describe(rc)
                )))
            }
        }
        match u32::try_from(count) {
            Ok(0) | Err(_) => Err(DeviceUnavailable::NoDevice),
            Ok(count) => Ok(Driver { version, count }),
        }
    }
}

fn too_old(version: i32) -> DeviceUnavailable {
    DeviceUnavailable::DriverTooOld {
        found: version_string(version),
        needed: version_string(MIN_DRIVER_VERSION),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_print_as_major_minor() {
        assert_eq!(version_string(12_040), "12.4");
        assert_eq!(version_string(11_080), "11.8");
        assert_eq!(version_string(13_000), "13.0");
    }

    #[test]
    fn a_missing_library_names_every_file_tried() {
        let e = probe(&["libtensorwire-no-such-driver.so", "libnor-this.so.1"]).unwrap_err();
        let DeviceUnavailable::LibraryNotFound(msg) = &e else {
            panic!("expected LibraryNotFound, got {e:?}");
        };
        assert!(
            msg.contains("libtensorwire-no-such-driver.so") && msg.contains("libnor-this.so.1"),
            "{msg}"
        );
        assert!(
            e.to_string().contains("is an NVIDIA driver installed?"),
            "{e}"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_library_that_is_not_the_driver_is_not_accepted() {
        // libc loads but has no cuDriverGetVersion: initialisation failure, not a panic.
        let e = probe(&["libc.so.6"]).unwrap_err();
        assert!(
            matches!(e, DeviceUnavailable::InitFailed(ref m) if m.contains("cuDriverGetVersion")),
            "{e:?}"
        );
    }
}
