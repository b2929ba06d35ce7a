use super::*;

fn host(boot: &str, pid: u32) -> HostIdentity {
    HostIdentity {
        boot_id: boot.into(),
        ipc_namespace: 7,
        pid_namespace: 9,
        pid,
    }
}

fn gpu(n: u8) -> GpuIdentity {
    GpuIdentity {
        uuid: [n; 16],
        mig: false,
    }
}

/// A process on host `boot` with GPUs whose UUIDs are `gpus`.
fn who(boot: &str, pid: u32, gpus: &[u8]) -> IpcIdentity {
    IpcIdentity {
        host: host(boot, pid),
        gpus: gpus.iter().map(|&n| gpu(n)).collect(),
    }
}

const C0: Device = Device::Cuda(0);
const C1: Device = Device::Cuda(1);

#[test]
fn ipc_needs_one_host_one_container_two_processes_and_one_plain_gpu() {
    let a = who("h1", 10, &[1, 2]);
    let b = who("h1", 11, &[1, 2]);
    assert_eq!(decide(Some(&a), Some(&b), C0, C0), Ok(()));
    assert_eq!(decide(Some(&a), Some(&b), C1, C1), Ok(()));
    assert_eq!(
        decide(Some(&a), Some(&b), C0, C1),
        Err(StagedReason::OtherGpu { from: C0, to: C1 })
    );
    // The peer sees GPU 1 as its cuda:1 (another CUDA_VISIBLE_DEVICES): same physical GPU.
    let c = who("h1", 12, &[2, 1]);
    assert_eq!(decide(Some(&a), Some(&c), C0, C1), Ok(()));
    assert_eq!(
        decide(None, Some(&b), C0, C0),
        Err(StagedReason::NotSupported)
    );
    assert_eq!(
        decide(Some(&a), None, C0, C0),
        Err(StagedReason::PeerNotSupported)
    );
    assert_eq!(
        decide(Some(&a), Some(&who("h2", 11, &[1])), C0, C0),
        Err(StagedReason::OtherHost)
    );
    let mut other_ipc_ns = b.clone();
    other_ipc_ns.host.ipc_namespace = 8;
    assert_eq!(
        decide(Some(&a), Some(&other_ipc_ns), C0, C0),
        Err(StagedReason::OtherContainer { namespace: "ipc" })
    );
    let mut other_pid_ns = b.clone();
    other_pid_ns.host.pid_namespace = 8;
    assert_eq!(
        decide(Some(&a), Some(&other_pid_ns), C0, C0),
        Err(StagedReason::OtherContainer { namespace: "pid" })
    );
    assert_eq!(
        decide(Some(&a), Some(&a), C0, C0),
        Err(StagedReason::SameProcess)
    );
    let mut mig = b.clone();
    mig.gpus[0].mig = true;
    assert_eq!(
        decide(Some(&a), Some(&mig), C0, C0),
        Err(StagedReason::Mig { device: C0 })
    );
    assert_eq!(
        decide(Some(&mig), Some(&a), C0, C0),
        Err(StagedReason::Mig { device: C0 })
    );
    assert_eq!(
        decide(Some(&a), Some(&b), Device::Cuda(5), C0),
        Err(StagedReason::UnknownDevice {
            device: Device::Cuda(5),
            side: "sender"
        })
    );
    assert_eq!(
        decide(Some(&a), Some(&b), C0, Device::Cuda(2)),
        Err(StagedReason::UnknownDevice {
            device: Device::Cuda(2),
            side: "receiver"
        })
    );
    assert!(StagedReason::OtherContainer { namespace: "ipc" }
        .to_string()
        .contains("another ipc namespace (another container)"));
}

/// Delivers every queued message of `from` to `to`, returning what each release freed.
fn deliver(from: &mut IpcState<u32>, from_id: WorkerId, to: &mut IpcState<u32>) -> Vec<u32> {
    let mut freed = Vec::new();
    while let Some((dest, msg)) = from.poll_transmit() {
        assert_ne!(dest, from_id);
        freed.extend(to.handle_message(from_id, msg).unwrap());
    }
    freed
}

#[test]
fn the_first_tensor_is_staged_while_the_peers_introduce_themselves_then_ipc_until_released() {
    let mut a = IpcState::<u32>::new(Some(who("h", 1, &[1])), IpcConfig::default());
    let mut b = IpcState::<u32>::new(Some(who("h", 2, &[1])), IpcConfig::default());
    assert_eq!(
        a.route(1, C0, C0, 100),
        Route::Staged(StagedReason::PeerUnknown)
    );
    // One hello only, however many tensors go before the answer.
    assert_eq!(
        a.route(1, C0, C0, 100),
        Route::Staged(StagedReason::PeerUnknown)
    );
    let hello = a.poll_transmit().unwrap();
    assert!(matches!(hello, (1, IpcMessage::Hello(Some(_)))));
    assert_eq!(a.poll_transmit(), None);
    b.handle_message(0, hello.1).unwrap();
    // b answers with its own hello, once.
    assert!(deliver(&mut b, 1, &mut a).is_empty());
    assert_eq!(a.poll_transmit(), None, "a already introduced itself");

    let Route::Ipc(id) = a.route(1, C0, C0, 100) else {
        panic!("same host, same GPU: IPC")
    };
    assert_eq!(a.held(1), (1, 100));
    b.check_import(0).unwrap();
    a.exported(1, id, 42);
    b.imported(0, id);
    assert_eq!(deliver(&mut b, 1, &mut a), vec![42]);
    assert_eq!(a.held(1), (0, 0));
    let report = a.report();
    assert_eq!(report.len(), 1);
    assert_eq!(
        (report[0].sent_ipc, report[0].sent_staged, report[0].ipc_now),
        (1, 2, true)
    );
    assert_eq!(report[0].last_staged, Some(StagedReason::PeerUnknown));
    assert_eq!(b.report()[0].received_ipc, 1);
}

#[test]
fn a_worker_that_cannot_share_says_so_and_its_peers_stage_at_once() {
    let mut a = IpcState::<u32>::new(Some(who("h", 1, &[1])), IpcConfig::default());
    let mut b = IpcState::<u32>::new(None, IpcConfig::default());
    assert_eq!(
        b.route(0, C0, C0, 1),
        Route::Staged(StagedReason::NotSupported)
    );
    assert_eq!(b.poll_transmit(), None, "b only answers hellos");
    a.route(1, C0, C0, 1);
    deliver(&mut a, 0, &mut b);
    deliver(&mut b, 1, &mut a);
    assert_eq!(
        a.route(1, C0, C0, 1),
        Route::Staged(StagedReason::PeerNotSupported)
    );
    assert!(!a.report()[0].ipc_now);
    // And b refuses descriptors: it never agreed.
    assert_eq!(
        b.check_import(0),
        Err(IpcViolation::Unannounced(StagedReason::NotSupported))
    );
    // A worker that never introduced itself refuses them too.
    let fresh = IpcState::<u32>::new(Some(who("h", 3, &[1])), IpcConfig::default());
    assert_eq!(
        fresh.check_import(0),
        Err(IpcViolation::Unannounced(StagedReason::PeerUnknown))
    );
}

/// Two introduced workers, a to b (ranks 0 and 1).
fn pair(config: IpcConfig) -> (IpcState<u32>, IpcState<u32>) {
    let mut a = IpcState::new(Some(who("h", 1, &[1])), config);
    let mut b = IpcState::new(Some(who("h", 2, &[1])), config);
    a.route(1, C0, C0, 0);
    deliver(&mut a, 0, &mut b);
    deliver(&mut b, 1, &mut a);
    (a, b)
}

fn send(a: &mut IpcState<u32>, bytes: u64, held: u32) -> ExportId {
    let Route::Ipc(id) = a.route(1, C0, C0, bytes) else {
        panic!("expected IPC")
    };
    a.exported(1, id, held);
    id
}

#[test]
fn forged_releases_are_violations_that_change_nothing() {
    let (mut a, _b) = pair(IpcConfig::default());
    let sent = send(&mut a, 10, 1);
    let Route::Ipc(reserved) = a.route(1, C0, C0, 20) else {
        panic!()
    };
    let before = a.held(1);
    assert_eq!(before, (2, 30));
    for (from, ids, want) in [
        (1, vec![99], IpcViolation::UnknownExport { id: 99 }),
        (1, vec![sent, 99], IpcViolation::UnknownExport { id: 99 }),
        (
            1,
            vec![sent, sent],
            IpcViolation::ReleasedTwice { id: sent },
        ),
        (1, vec![reserved], IpcViolation::NotYetSent { id: reserved }),
        // Another peer releasing what went to worker 1.
        (2, vec![sent], IpcViolation::UnknownExport { id: sent }),
    ] {
        assert_eq!(
            a.handle_message(from, IpcMessage::Release(ids.clone())),
            Err(want),
            "{from} releasing {ids:?}"
        );
        assert_eq!(a.held(1), before, "nothing released");
    }
    assert_eq!(
        a.handle_message(1, IpcMessage::Release(vec![sent])),
        Ok(vec![1])
    );
    assert_eq!(
        a.handle_message(1, IpcMessage::Release(vec![sent])),
        Err(IpcViolation::ReleasedTwice { id: sent })
    );
    assert_eq!(
        a.handle_message(1, IpcMessage::Hello(Some(who("h", 77, &[1])))),
        Err(IpcViolation::IdentityChanged)
    );
    // The same hello again is harmless.
    assert_eq!(
        a.handle_message(1, IpcMessage::Hello(Some(who("h", 2, &[1])))),
        Ok(vec![])
    );
}

#[test]
fn a_peer_that_does_not_release_is_bounded_by_count_and_bytes() {
    let (mut a, _b) = pair(IpcConfig::new(2, 1000));
    let first = send(&mut a, 10, 1);
    send(&mut a, 10, 2);
    let staged = a.route(1, C0, C0, 10);
    assert_eq!(
        staged,
        Route::Staged(StagedReason::Bound {
            held: 2,
            held_bytes: 20,
            max_exports: 2,
            max_bytes: 1000
        })
    );
    assert_eq!(
        a.handle_message(1, IpcMessage::Release(vec![first])),
        Ok(vec![1])
    );
    // One slot free, but not for more bytes than allowed.
    assert!(matches!(
        a.route(1, C0, C0, 991),
        Route::Staged(StagedReason::Bound { held: 1, .. })
    ));
    assert!(matches!(a.route(1, C0, C0, 990), Route::Ipc(_)));
}

#[test]
fn failed_exports_and_refused_imports_fall_back_to_staging_for_good() {
    let (mut a, mut b) = pair(IpcConfig::default());
    let Route::Ipc(id) = a.route(1, C0, C0, 10) else {
        panic!()
    };
    a.export_failed(1, id, "cuIpcGetMemHandle: not supported".into());
    assert_eq!(a.held(1), (0, 0));
    assert!(matches!(
        a.route(1, C0, C0, 10),
        Route::Staged(StagedReason::PeerRefused(ref m)) if m.contains("not supported")
    ));

    let (mut a, _) = pair(IpcConfig::default());
    let id = send(&mut a, 10, 5);
    b.import_failed(0, id, "cuIpcOpenMemHandle: invalid context".into());
    assert_eq!(deliver(&mut b, 1, &mut a), vec![5], "released all the same");
    assert!(matches!(
        a.route(1, C0, C0, 10),
        Route::Staged(StagedReason::PeerRefused(ref m)) if m.contains("invalid context")
    ));
}

#[test]
fn releases_to_one_peer_travel_together_and_a_lost_peer_frees_everything() {
    let (mut a, mut b) = pair(IpcConfig::default());
    let ids: Vec<_> = (0..3).map(|i| send(&mut a, 1, i)).collect();
    for &id in &ids {
        b.imported(0, id);
    }
    assert_eq!(b.poll_transmit(), Some((0, IpcMessage::Release(ids))));
    assert_eq!(b.poll_transmit(), None);

    let (mut a, _) = pair(IpcConfig::default());
    send(&mut a, 1, 7);
    send(&mut a, 1, 8);
    a.route(1, C0, C0, 1); // reserved, being exported: nothing to hand back yet
    let mut freed = a.peer_lost(1);
    freed.sort();
    assert_eq!(freed, vec![7, 8]);
    assert_eq!(a.held(1), (0, 0));
    // A worker joining again under the rank is unknown until it says hello.
    assert_eq!(
        a.route(1, C0, C0, 1),
        Route::Staged(StagedReason::PeerUnknown)
    );
}

#[test]
fn messages_round_trip_and_other_control_frames_are_not_ipc() {
    for msg in [
        IpcMessage::Hello(Some(who("h", 1, &[1, 2]))),
        IpcMessage::Hello(None),
        IpcMessage::Release(vec![0, 5, u64::MAX]),
        IpcMessage::Refused("no".into()),
    ] {
        assert_eq!(decode_message(&encode_message(&msg)), Some(Ok(msg)));
    }
    assert_eq!(decode_message(&[0, 1, 2]), None);
    assert!(matches!(
        decode_message(b"TWIPC1\xff\xff"),
        Some(Err(IpcViolation::Malformed(crate::codec::Undecodable {
            format: crate::codec::Format::IpcMessage,
            ..
        })))
    ));
}

mod simulation {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// a sends a tensor of this many bytes to b.
        Send(u64),
        /// The next message from a to b arrives.
        DeliverToB,
        /// The next message from b to a arrives.
        DeliverToA,
        /// b forges a release of an export it has no right to release: one released already
        /// (picked by this index), or one never made.
        Forge(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1u64..400).prop_map(Op::Send),
            3 => Just(Op::DeliverToB),
            3 => Just(Op::DeliverToA),
            1 => (0u64..40).prop_map(Op::Forge),
        ]
    }

    proptest! {
        /// Whatever the interleaving, a buffer is handed back exactly once and only after b
        /// copied it out; forged releases change nothing; the bounds always hold; and once
        /// every message has arrived nothing is held.
        #[test]
        fn every_export_is_released_once_after_its_copy(ops in proptest::collection::vec(op(), 1..120)) {
            let config = IpcConfig::new(4, 1000);
            let mut a = IpcState::<u64>::new(Some(who("h", 1, &[1])), config);
            let mut b = IpcState::<u64>::new(Some(who("h", 2, &[1])), config);
            let mut to_b: VecDeque<IpcMessage> = VecDeque::new();
            let mut to_a: VecDeque<IpcMessage> = VecDeque::new();
            // Descriptors travel with messages, in order with a's IPC messages.
            let mut descriptors: VecDeque<(usize, ExportId)> = VecDeque::new();
            let mut copied = std::collections::BTreeSet::new();
            let mut freed = Vec::new();
            let mut next = 0u64;
            let pump = |a: &mut IpcState<u64>, b: &mut IpcState<u64>,
                            to_b: &mut VecDeque<IpcMessage>, to_a: &mut VecDeque<IpcMessage>| {
                while let Some((_, m)) = a.poll_transmit() { to_b.push_back(m); }
                while let Some((_, m)) = b.poll_transmit() { to_a.push_back(m); }
            };
            for op in ops {
                match op {
                    Op::Send(bytes) => {
                        if let Route::Ipc(id) = a.route(1, C0, C0, bytes) {
                            a.exported(1, id, next);
                            descriptors.push_back((to_b.len(), id));
                            next += 1;
                        }
                    }
                    Op::DeliverToB => {
                        if let Some(m) = to_b.pop_front() {
                            b.handle_message(0, m).unwrap();
                        }
                        // Descriptors sent before the next message arrive with it.
                        while descriptors.front().is_some_and(|(after, _)| *after == 0) {
                            let (_, id) = descriptors.pop_front().unwrap();
                            prop_assert!(b.check_import(0).is_ok());
                            copied.insert(id);
                            b.imported(0, id);
                        }
                        for d in descriptors.iter_mut() { d.0 = d.0.saturating_sub(1); }
                    }
                    Op::DeliverToA => {
                        if let Some(m) = to_a.pop_front() {
                            for held in a.handle_message(1, m).unwrap() {
                                prop_assert!(copied.contains(&held), "freed {held} before its copy");
                                freed.push(held);
                            }
                        }
                    }
                    Op::Forge(pick) => {
                        let id = if freed.is_empty() {
                            1000 + pick
                        } else {
                            freed[pick as usize % freed.len()]
                        };
                        let before = a.held(1);
                        let forged = a.handle_message(1, IpcMessage::Release(vec![id]));
                        prop_assert!(forged.is_err(), "forged release of {} accepted", id);
                        prop_assert_eq!(a.held(1), before);
                    }
                }
                pump(&mut a, &mut b, &mut to_b, &mut to_a);
                let (held, bytes) = a.held(1);
                prop_assert!(held <= 4 && bytes <= 1000);
            }
            // Drain.
            loop {
                pump(&mut a, &mut b, &mut to_b, &mut to_a);
                if to_b.is_empty() && to_a.is_empty() && descriptors.is_empty() { break; }
                if let Some(m) = to_b.pop_front() { b.handle_message(0, m).unwrap(); }
                while let Some((_, id)) = descriptors.pop_front() { copied.insert(id); b.imported(0, id); }
                pump(&mut a, &mut b, &mut to_b, &mut to_a);
                while let Some(m) = to_a.pop_front() { freed.extend(a.handle_message(1, m).unwrap()); }
            }
            freed.sort_unstable();
            prop_assert_eq!(freed, (0..next).collect::<Vec<_>>());
            prop_assert_eq!(a.held(1), (0, 0));
        }
    }
}
