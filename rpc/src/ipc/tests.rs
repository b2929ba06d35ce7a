//! Agents of one process over the in-memory network, on simulated devices that share memory as
//! CUDA IPC would (each backend instance poses as a process of a simulated host).

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::device::Device;
use tensorwire_core::devices_sim::{SimHost, SimulatedDevices};
use tensorwire_core::ipc::{encode_message, IpcMessage, IpcViolation, StagedReason};
use tensorwire_core::ports::device::relocate;
use tensorwire_core::protocol::{LostCause, ProtocolViolation};
use tensorwire_core::tensor::Tensor;
use tensorwire_core::wire::Frame;

use crate::tests::{pair_of, until};
use crate::{Agent, Functions, PeerEvent, RpcOptions, Shutdown};

use super::*;

fn functions() -> Functions {
    let f = Functions::new();
    // Where the argument landed, and the tensor back (on the same device).
    f.register("where_and_back", |t: Tensor| async move {
        Ok::<_, String>((t.device().to_string(), t))
    })
    .unwrap();
    f
}

/// Two agents, w0 and w1, over `backends`, w0 mapping its cuda:0 to w1's `to`.
async fn pair(backends: [Arc<SimulatedDevices>; 2], to: &str) -> Vec<Agent> {
    pair_with(backends, to, |_, _| {}).await
}

/// [`pair`] with each rank's options changed by `tweak`.
async fn pair_with(
    backends: [Arc<SimulatedDevices>; 2],
    to: &str,
    tweak: impl Fn(usize, &mut RpcOptions),
) -> Vec<Agent> {
    pair_of(|rank| {
        let mut o = RpcOptions {
            init_timeout: Duration::from_secs(20),
            functions: functions(),
            listen_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
            ..RpcOptions::default()
        };
        o.device_backend = Arc::clone(&backends[rank]) as _;
        tweak(rank, &mut o);
        if rank == 0 {
            o.set_device_map("w1", &[("cuda:0", to)]).unwrap();
        }
        o
    })
    .await
}

async fn shutdown(agents: Vec<Agent>) {
    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}

/// A tensor of `n` f32 values on `backend`'s cuda:0.
async fn on_gpu(backend: &SimulatedDevices, n: usize) -> (Tensor, Vec<f32>) {
    let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let t = Tensor::from_f32(vec![n], &values).unwrap();
    (
        relocate(backend, &t, Device::Cuda(0)).await.unwrap(),
        values,
    )
}

/// Calls w1's `where_and_back` with `t`, checking the values that come back.
async fn round_trip(a: &Agent, t: &Tensor, values: &[f32], backend: &SimulatedDevices) -> String {
    let (landed, back): (String, Tensor) =
        a.rpc_sync("w1", "where_and_back", t, None).await.unwrap();
    assert_eq!(back.device(), Device::Cuda(0), "back by the reverse map");
    let host = relocate(backend, &back, Device::Cpu).await.unwrap();
    assert_eq!(host.to_f32_vec().unwrap(), values);
    landed
}

#[tokio::test(start_paused = true)]
async fn device_tensors_on_one_host_go_by_ipc_and_each_buffer_is_held_until_released() {
    let host = SimHost::new("host-a");
    let b0 = Arc::new(SimulatedDevices::sharing(1, host.clone()));
    let b1 = Arc::new(SimulatedDevices::sharing(1, host));
    let agents = pair([b0.clone(), b1.clone()], "cuda:0").await;
    let (t, values) = on_gpu(&b0, 1000).await;
    // The first tensor is staged while the workers introduce themselves; then IPC.
    let mut calls = 0;
    while agents[0]
        .device_paths()
        .first()
        .is_none_or(|p| p.sent_ipc == 0)
    {
        assert_eq!(round_trip(&agents[0], &t, &values, &b0).await, "cuda:0");
        calls += 1;
        assert!(
            calls <= 3,
            "never switched to IPC: {:?}",
            agents[0].device_paths()
        );
    }
    let w0 = &agents[0].device_paths()[0];
    assert_eq!(w0.peer, 1);
    assert!(w0.ipc_now);
    assert_eq!(w0.last_staged, Some(StagedReason::PeerUnknown));
    // w1 received by IPC and answered by IPC too (the reverse map: cuda:0 -> cuda:0).
    let w1 = &agents[1].device_paths()[0];
    assert!(w1.received_ipc >= 1 && w1.sent_ipc >= 1, "{w1:?}");
    assert!(w0.received_ipc >= 1, "{w0:?}");
    // Every buffer shared is released once copied out; nothing stays held.
    until(|| agents.iter().all(|a| a.device_paths()[0].held == 0)).await;
    // A staged copy is two backend copies (off and onto the device), an IPC one one.
    let before = b1.copies();
    round_trip(&agents[0], &t, &values, &b0).await;
    assert_eq!(
        b1.copies() - before,
        1,
        "w1 copied the argument device to device only"
    );
    shutdown(agents).await;
}

#[tokio::test(start_paused = true)]
async fn workers_that_cannot_share_stage_and_say_why() {
    let mut mig = SimHost::new("h");
    mig.mig = true;
    let mut other_container = SimHost::new("h");
    other_container.container = 2;
    let cases: Vec<(
        Arc<SimulatedDevices>,
        Arc<SimulatedDevices>,
        &str,
        StagedReason,
    )> = vec![
        (
            Arc::new(SimulatedDevices::sharing(1, SimHost::new("h1"))),
            Arc::new(SimulatedDevices::sharing(1, SimHost::new("h2"))),
            "cuda:0",
            StagedReason::OtherHost,
        ),
        (
            Arc::new(SimulatedDevices::sharing(1, SimHost::new("h"))),
            Arc::new(SimulatedDevices::sharing(1, other_container)),
            "cuda:0",
            StagedReason::OtherContainer { namespace: "ipc" },
        ),
        (
            Arc::new(SimulatedDevices::sharing(1, mig.clone())),
            Arc::new(SimulatedDevices::sharing(1, mig)),
            "cuda:0",
            StagedReason::Mig {
                device: Device::Cuda(0),
            },
        ),
        (
            Arc::new(SimulatedDevices::sharing(2, SimHost::new("h"))),
            Arc::new(SimulatedDevices::sharing(2, SimHost::new("h"))),
            "cuda:1",
            StagedReason::OtherGpu {
                from: Device::Cuda(0),
                to: Device::Cuda(1),
            },
        ),
        (
            Arc::new(SimulatedDevices::sharing(1, SimHost::new("h"))),
            Arc::new(SimulatedDevices::new(1)),
            "cuda:0",
            StagedReason::PeerNotSupported,
        ),
        (
            Arc::new(SimulatedDevices::new(1)),
            Arc::new(SimulatedDevices::sharing(1, SimHost::new("h"))),
            "cuda:0",
            StagedReason::NotSupported,
        ),
    ];
    for (b0, b1, to, why) in cases {
        let agents = pair([b0.clone(), b1], to).await;
        let (t, values) = on_gpu(&b0, 10).await;
        for _ in 0..3 {
            let (landed, back): (String, Tensor) = agents[0]
                .rpc_sync("w1", "where_and_back", &t, None)
                .await
                .unwrap();
            assert_eq!(landed, to);
            let host = relocate(&*b0, &back, Device::Cpu).await.unwrap();
            assert_eq!(host.to_f32_vec().unwrap(), values);
        }
        let paths = agents[0].device_paths();
        assert_eq!(paths.len(), 1, "{paths:?}");
        assert_eq!(
            (
                paths[0].sent_ipc,
                paths[0].sent_staged,
                paths[0].last_staged.as_ref()
            ),
            (0, 3, Some(&why)),
            "{why}"
        );
        // Only two GPUs apart still share one (cuda:0 on both sides).
        assert_eq!(
            paths[0].ipc_now,
            matches!(why, StagedReason::OtherGpu { .. })
        );
        shutdown(agents).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_forged_release_drops_the_peer_and_frees_nothing_it_did_not_copy() {
    let host = SimHost::new("host-f");
    let b0 = Arc::new(SimulatedDevices::sharing(1, host.clone()));
    let b1 = Arc::new(SimulatedDevices::sharing(1, host));
    let agents = pair([b0.clone(), b1], "cuda:0").await;
    let mut events = agents[0].peer_events();
    let (t, values) = on_gpu(&b0, 100).await;
    while agents[0]
        .device_paths()
        .first()
        .is_none_or(|p| p.sent_ipc == 0)
    {
        round_trip(&agents[0], &t, &values, &b0).await;
    }
    // w1 releases an export w0 never made.
    crate::links::send_control_locked(
        &mut agents[1].lock(),
        0,
        Frame::control(encode_message(&IpcMessage::Release(vec![77])), vec![]),
    );
    let Some(PeerEvent::Lost { worker, cause }) = events.recv().await else {
        panic!("w0 kept the peer")
    };
    assert_eq!(worker, 1);
    let reason = cause.to_string();
    assert!(
        matches!(
            &cause,
            LostCause::Misbehaved(v) if matches!(**v, ProtocolViolation::Ipc(_))
        ) && reason.contains(
            "broke the IPC protocol: it released IPC export 77, which this worker never made to it"
        ),
        "{reason}"
    );
    shutdown(agents).await;
}

#[tokio::test(start_paused = true)]
async fn a_descriptor_from_a_peer_that_never_agreed_is_refused_before_anything_happens() {
    let b0 = Arc::new(SimulatedDevices::sharing(1, SimHost::new("h")));
    let agents = pair([b0, Arc::new(SimulatedDevices::new(1))], "cuda:0").await;
    let meta = TensorMeta {
        dtype: tensorwire_core::tensor::DType::F32,
        shape: vec![1],
        device: Device::Cuda(0),
        ipc: Some(0),
    };
    // w1 cannot share, so nothing it sends may be a descriptor.
    let e = agents[1].lock().node.ipc().check_import(0).unwrap_err();
    assert_eq!(e, IpcViolation::Unannounced(StagedReason::NotSupported));
    // w0 never introduced itself to w1 (it sent it no device tensor): refused too.
    let e = agents[0].lock().node.ipc().check_import(1).unwrap_err();
    assert_eq!(e, IpcViolation::Unannounced(StagedReason::PeerUnknown));
    // A frame announcing one from it is w0's node's violation, before the endpoint sees it.
    let header = crate::fuzzing::encode_message_header(
        &tensorwire_core::protocol::Header::Call {
            id: 1,
            function: "where_and_back".into(),
            timeout: Duration::from_secs(1),
        },
        &[meta],
    );
    let frame = Frame::message(
        header,
        vec![
            bytes::Bytes::from_static(b"a"),
            bytes::Bytes::from_static(b"d"),
        ],
    );
    let now = agents[0].now();
    assert_eq!(
        agents[0].lock().node.handle_frame(now, 1, frame),
        Err(ProtocolViolation::Ipc(IpcViolation::Unannounced(
            StagedReason::PeerUnknown
        )))
    );
    shutdown(agents).await;
}

#[tokio::test(start_paused = true)]
async fn a_lost_peer_frees_every_buffer_held_for_it() {
    let host = SimHost::new("host-l");
    let b0 = Arc::new(SimulatedDevices::sharing(1, host.clone()));
    let b1 = Arc::new(SimulatedDevices::sharing(1, host));
    let agents = pair([b0.clone(), b1], "cuda:0").await;
    let (t, values) = on_gpu(&b0, 100).await;
    while agents[0]
        .device_paths()
        .first()
        .is_none_or(|p| p.sent_ipc == 0)
    {
        round_trip(&agents[0], &t, &values, &b0).await;
    }
    // An export w1 never releases (as if it hung), then w1 is lost.
    let route = agents[0]
        .lock()
        .node
        .ipc_mut()
        .route(1, Device::Cuda(0), Device::Cuda(0), 8);
    let Route::Ipc(id) = route else { panic!("IPC") };
    let Storage::Device(buf) = t.storage() else {
        panic!()
    };
    let export = b0.export(buf).await.unwrap();
    let descriptor = export.descriptor.clone();
    agents[0].lock().node.ipc_mut().exported(1, id, export.keep);
    assert_eq!(agents[0].device_paths()[0].held, 1);
    crate::links::peer_lost(&agents[0], 1, LostCause::Shutdown);
    assert!(agents[0].device_paths().is_empty());
    // The export is closed: opening it now fails as a freed handle would.
    let e = b0
        .import(&descriptor, 400, Device::Cuda(0))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("is not open"), "{e}");
    shutdown(agents).await;
}

#[tokio::test(start_paused = true)]
async fn sharing_turned_off_in_the_options_stages_both_ways() {
    let host = SimHost::new("host-o");
    let b0 = Arc::new(SimulatedDevices::sharing(1, host.clone()));
    let b1 = Arc::new(SimulatedDevices::sharing(1, host));
    let agents = pair_with([b0.clone(), b1], "cuda:0", |rank, o| {
        o.share_device_memory = rank == 0;
    })
    .await;
    let (t, values) = on_gpu(&b0, 10).await;
    for _ in 0..3 {
        round_trip(&agents[0], &t, &values, &b0).await;
    }
    let w0 = &agents[0].device_paths()[0];
    assert_eq!((w0.sent_ipc, w0.received_ipc), (0, 0));
    assert_eq!(w0.last_staged, Some(StagedReason::PeerNotSupported));
    let w1 = &agents[1].device_paths()[0];
    assert_eq!(w1.last_staged, Some(StagedReason::NotSupported));
    shutdown(agents).await;
}

#[tokio::test(start_paused = true)]
async fn the_limits_in_the_options_bound_what_a_peer_makes_us_hold() {
    let host = SimHost::new("host-b");
    let b0 = Arc::new(SimulatedDevices::sharing(1, host.clone()));
    let b1 = Arc::new(SimulatedDevices::sharing(1, host));
    // w0 holds at most 100 bytes for a peer: a 400-byte tensor never goes by IPC.
    let agents = pair_with([b0.clone(), b1], "cuda:0", |_, o| {
        o.ipc_limits = tensorwire_core::ipc::IpcConfig::new(8, 100);
    })
    .await;
    let (t, values) = on_gpu(&b0, 100).await;
    for _ in 0..3 {
        round_trip(&agents[0], &t, &values, &b0).await;
    }
    let w0 = &agents[0].device_paths()[0];
    assert_eq!(w0.sent_ipc, 0);
    assert!(
        matches!(
            w0.last_staged,
            Some(StagedReason::Bound { max_bytes: 100, .. })
        ),
        "{w0:?}"
    );
    shutdown(agents).await;
}
