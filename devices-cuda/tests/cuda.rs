//! The CUDA backend against the `DeviceBackend` contract.
//!
//! The first group runs everywhere: on a machine without a driver (CI) it checks the reported
//! reason and that every copy fails cleanly; a forced missing driver checks the same on any
//! machine. The GPU group runs the same round trips as the simulated backend's tests on the
//! real devices and prints `SKIPPED: ...` with the reason when there is none.

use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::device::{Device, DeviceMap, DeviceMaps};
use tensorwire_core::placement::{placements, Direction};
use tensorwire_core::ports::device::{relocate, DeviceBackend, DeviceError, DeviceUnavailable};
use tensorwire_core::tensor::Tensor;
use tensorwire_core::validate::{
    validate_device_maps, DeviceMapErrorKind, GroupKind, WorkerDeviceInfo,
};
use tensorwire_devices_cuda::CudaDevices;

/// Every device wait in these tests is bounded.
async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("a device call did not finish within 60 s")
}

/// Prints a skip so that it shows even though the test harness captures `println!`: it writes
/// to the process's stdout directly, which the harness does not capture.
fn skip(message: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "SKIPPED: {message}");
}

/// The real backend when it has a device; otherwise prints why the test is skipped.
fn gpu_or_skip(test: &str) -> Option<CudaDevices> {
    let cuda = CudaDevices::new();
    match cuda.unavailable() {
        None => Some(cuda),
        Some(why) => {
            skip(format_args!("{test}: no CUDA device ({why})"));
            None
        }
    }
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect::<Vec<u8>>()
        .into()
}

async fn copies_fail_unavailable(cuda: &CudaDevices) {
    let t = Tensor::from_f32(vec![2], &[1.0, 2.0]).unwrap();
    for d in [Device::Cuda(0), Device::Cuda(3)] {
        let e = within(relocate(cuda, &t, d)).await.unwrap_err();
        assert!(matches!(e, DeviceError::Unavailable(_)), "{d}: {e:?}");
        assert!(e.to_string().starts_with("no CUDA devices: "), "{e}");
        let e = within(cuda.to_device(Bytes::from_static(b"abc"), d))
            .await
            .unwrap_err();
        assert!(matches!(e, DeviceError::Unavailable(_)), "{e:?}");
    }
    // CPU to CPU needs no device.
    let same = within(relocate(cuda, &t, Device::Cpu)).await.unwrap();
    assert_eq!(same.to_f32_vec().unwrap(), vec![1.0, 2.0]);
    assert!(cuda.device_name(Device::Cuda(0)).is_err());
    assert!(cuda.context(Device::Cuda(0)).is_err());
}

#[tokio::test]
async fn a_missing_driver_means_zero_devices_and_clean_errors() {
    let cuda = CudaDevices::with_driver_names(&["libtensorwire-test-no-such-libcuda.so.1"]);
    assert_eq!(cuda.name(), "cuda");
    assert_eq!(cuda.device_count(), 0);
    assert_eq!(cuda.driver_version(), None);
    let why = cuda.unavailable().expect("a reason");
    assert!(
        matches!(&why, DeviceUnavailable::LibraryNotFound(m) if m.contains("libtensorwire-test-no-such-libcuda.so.1")),
        "{why:?}"
    );
    copies_fail_unavailable(&cuda).await;
}

#[tokio::test]
async fn the_default_probe_reports_why_there_is_no_device() {
    let cuda = CudaDevices::new();
    if cuda.device_count() > 0 {
        skip(format_args!(
            "the_default_probe_reports_why_there_is_no_device: this machine has {} CUDA device(s)",
            cuda.device_count()
        ));
        return;
    }
    let why = cuda.unavailable().expect("zero devices come with a reason");
    println!("no CUDA here: {why}");
    // Where no driver library can be opened at all (this project's CI), the reason says so.
    let loadable = ["libcuda.so.1", "libcuda.so"]
        .iter()
        // SAFETY: only the CUDA driver is loaded, as the backend itself does.
        .any(|n| unsafe { libloading::Library::new(*n) }.is_ok());
    if !loadable {
        assert!(
            matches!(why, DeviceUnavailable::LibraryNotFound(_)),
            "{why:?}"
        );
        assert!(why.to_string().contains("libcuda.so.1"), "{why}");
    }
    copies_fail_unavailable(&cuda).await;
}

#[test]
fn copies_outside_a_tokio_runtime_do_not_panic() {
    // The backend is runtime-agnostic: a plain executor polls it fine.
    let cuda = CudaDevices::with_driver_names(&["libtensorwire-test-no-such-libcuda.so.1"]);
    let e = futures_lite_block_on(cuda.to_device(Bytes::from_static(b"x"), Device::Cuda(0)));
    assert!(matches!(e, Err(DeviceError::Unavailable(_))));
}

/// A minimal single-future executor (no extra dependency).
fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1_000_000 {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::yield_now();
    }
    panic!("the future never completed")
}

#[test]
fn a_plan_naming_cuda_fails_validation_with_zero_devices() {
    let cuda = CudaDevices::new();
    if cuda.device_count() > 0 {
        skip(format_args!(
            "a_plan_naming_cuda_fails_validation_with_zero_devices: a GPU is present"
        ));
        return;
    }
    let mut maps = DeviceMaps::new();
    maps.insert(
        "ps",
        [(Device::Cuda(0), Device::Cuda(0))]
            .into_iter()
            .collect::<DeviceMap>(),
    );
    let trainer = WorkerDeviceInfo {
        name: "trainer".into(),
        device_count: cuda.device_count(),
        devices: vec![Device::Cuda(0)],
        device_maps: maps,
    };
    let ps = WorkerDeviceInfo {
        name: "ps".into(),
        device_count: cuda.device_count(),
        ..Default::default()
    };
    let err = validate_device_maps(&[trainer, ps], GroupKind::Static).unwrap_err();
    assert_eq!(err.kind(), DeviceMapErrorKind::InvalidDeviceIndices);
    assert_eq!(
        err.to_string(),
        "Node trainer has devices with invalid indices\ndevices = [cuda:0]\ndevice count = 0"
    );
}

// ---- GPU tests: skip with a printed reason when there is no device ----

#[tokio::test]
async fn gpu_round_trips_keep_bytes() {
    let Some(cuda) = gpu_or_skip("gpu_round_trips_keep_bytes") else {
        return;
    };
    let sizes = [
        0,
        1,
        4096,
        tensorwire_devices_cuda::STAGING_CHUNK - 1,
        2 * tensorwire_devices_cuda::STAGING_CHUNK + 17,
    ];
    for (k, &len) in sizes.iter().enumerate() {
        let data = pattern(len, k as u8);
        let buf = within(cuda.to_device(data.clone(), Device::Cuda(0)))
            .await
            .unwrap();
        assert_eq!((buf.device(), buf.len()), (Device::Cuda(0), len));
        let same = within(cuda.between(&buf, Device::Cuda(0))).await.unwrap();
        let back = within(cuda.to_host(&same)).await.unwrap();
        assert!(back == data, "round trip of {len} bytes changed them");
        // Bytes that came off the device (pinned when large) go back up and down again.
        let again = within(cuda.to_device(back.clone(), Device::Cuda(0)))
            .await
            .unwrap();
        drop(back);
        let back = within(cuda.to_host(&again)).await.unwrap();
        assert!(
            back == data,
            "second round trip of {len} bytes changed them"
        );
    }
}

#[tokio::test]
async fn gpu_bad_devices_and_foreign_buffers_are_errors() {
    let Some(cuda) = gpu_or_skip("gpu_bad_devices_and_foreign_buffers_are_errors") else {
        return;
    };
    let n = cuda.device_count();
    let beyond = Device::Cuda(u8::try_from(n).unwrap_or(u8::MAX));
    let e = within(cuda.to_device(Bytes::from_static(b"abcd"), beyond))
        .await
        .unwrap_err();
    assert_eq!(
        e,
        DeviceError::NoSuchDevice {
            device: beyond,
            count: n
        }
    );
    let sim = tensorwire_core::devices_sim::SimulatedDevices::new(1);
    let foreign = within(sim.to_device(Bytes::from_static(b"abcd"), Device::Cuda(0)))
        .await
        .unwrap();
    assert_eq!(
        within(cuda.to_host(&foreign)).await.unwrap_err(),
        DeviceError::ForeignBuffer(Device::Cuda(0))
    );
    let other = CudaDevices::new();
    let theirs = within(other.to_device(Bytes::from_static(b"abcd"), Device::Cuda(0)))
        .await
        .unwrap();
    assert_eq!(
        within(cuda.to_host(&theirs)).await.unwrap_err(),
        DeviceError::ForeignBuffer(Device::Cuda(0))
    );
}

#[tokio::test]
async fn gpu_device_maps_move_tensors_cpu_cuda_cpu() {
    let Some(cuda) = gpu_or_skip("gpu_device_maps_move_tensors_cpu_cuda_cpu") else {
        return;
    };
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let t = Tensor::from_f32(vec![10, 100], &values).unwrap();
    let map: DeviceMap = [(Device::Cpu, Device::Cuda(0))].into_iter().collect();
    let to = placements("ps", Some(&map), [t.device()], Direction::Request).unwrap();
    assert_eq!(to, [Device::Cuda(0)]);
    let there = within(relocate(&cuda, &t, to[0])).await.unwrap();
    assert_eq!(there.device(), Device::Cuda(0));
    let reverse: DeviceMap = [(Device::Cuda(0), Device::Cpu)].into_iter().collect();
    let back_to = placements(
        "trainer",
        Some(&reverse),
        [there.device()],
        Direction::Response,
    )
    .unwrap();
    let back = within(relocate(&cuda, &there, back_to[0])).await.unwrap();
    assert_eq!(back.shape(), &[10, 100]);
    assert_eq!(back.to_f32_vec().unwrap(), values);
}

#[tokio::test]
async fn gpu_peer_copies_between_devices() {
    let Some(cuda) = gpu_or_skip("gpu_peer_copies_between_devices") else {
        return;
    };
    if cuda.device_count() < 2 {
        skip(format_args!(
            "gpu_peer_copies_between_devices: needs 2 CUDA devices, this machine has {}",
            cuda.device_count()
        ));
        return;
    }
    let data = pattern(3 << 20, 7);
    let on0 = within(cuda.to_device(data.clone(), Device::Cuda(0)))
        .await
        .unwrap();
    let on1 = within(cuda.between(&on0, Device::Cuda(1))).await.unwrap();
    assert_eq!(on1.device(), Device::Cuda(1));
    let back = within(cuda.between(&on1, Device::Cuda(0))).await.unwrap();
    assert!(within(cuda.to_host(&back)).await.unwrap() == data);
}

/// Without NCCL (this project's CI) every entry point reports why, before any collective.
#[cfg(feature = "nccl")]
#[test]
fn nccl_unavailable_is_a_clear_error() {
    use tensorwire_devices_cuda::nccl::{nccl_available, NcclComm, NcclError, NcclId};
    match nccl_available() {
        Ok(v) => skip(format_args!(
            "nccl_unavailable_is_a_clear_error: NCCL {v} is installed here"
        )),
        Err(why) => {
            println!("no NCCL here: {why}");
            assert!(why.to_string().contains("NCCL"), "{why}");
            assert!(matches!(NcclId::new(), Err(NcclError::Unavailable(_))));
            let cuda = CudaDevices::new();
            let id = NcclId::from_bytes([0; 128]);
            let e = NcclComm::new(&cuda, Device::Cuda(0), 0, 1, &id).unwrap_err();
            assert!(matches!(e, NcclError::Unavailable(_)), "{e:?}");
            assert!(e.to_string().starts_with("NCCL is unavailable: "), "{e}");
        }
    }
}

#[cfg(feature = "nccl")]
#[tokio::test]
async fn gpu_nccl_one_rank_all_reduce() {
    let Some(cuda) = gpu_or_skip("gpu_nccl_one_rank_all_reduce") else {
        return;
    };
    if let Err(why) = tensorwire_devices_cuda::nccl::nccl_available() {
        skip(format_args!("gpu_nccl_one_rank_all_reduce: {why}"));
        return;
    }
    let line = tensorwire_devices_cuda::nccl::self_check(&cuda)
        .await
        .unwrap();
    assert!(line.contains("equal to the input"), "{line}");
}
