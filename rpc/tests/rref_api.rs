//! Remote references as PyTorch has them: creation timeouts, confirmed arguments, local
//! references, proxies on references, the call context, the timeout setting and the debug
//! view. In-process agents over the in-memory transport and store, in virtual time (tokio's
//! paused clock); faults injected by `FaultyBackend` around that transport.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use tensorwire_core::device::Device;
use tensorwire_core::devices_sim::SimulatedDevices;
use tensorwire_core::ports::device::relocate;
use tensorwire_core::tensor::Tensor;
use tensorwire_rpc::{
    Agent, CallContext, CallError, Functions, RRef, RemoteErrorKind, RpcError, RpcOptions,
};
use tensorwire_testkit::faults::{Fault, FaultAction, FaultyBackend, MessageKind};
use tensorwire_testkit::MemoryCluster;

#[derive(Default)]
struct Counter(AtomicI64);

impl serde::Serialize for Counter {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.load(Ordering::SeqCst).serialize(s)
    }
}

fn functions() -> Functions {
    let f = Functions::new();
    f.register("make_vec", |n: usize| async move {
        Ok::<_, String>((0..n as i64).collect::<Vec<i64>>())
    })
    .unwrap();
    f.register(
        "make_counter_after_ms",
        |(ms, start): (u64, i64)| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok::<_, String>(Counter(AtomicI64::new(start)))
        },
    )
    .unwrap();
    f.register("sleep_ms", |ms: u64| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, String>(ms)
    })
    .unwrap();
    f.register_method("increment", |c: Arc<Counter>, by: i64| async move {
        Ok::<_, String>(c.0.fetch_add(by, Ordering::SeqCst) + by)
    })
    .unwrap();
    f.register_method("snapshot", |c: Arc<Counter>, (): ()| async move {
        Ok::<_, String>(vec![c.0.load(Ordering::SeqCst); 2])
    })
    .unwrap();
    f.register_method("total", |v: Arc<Vec<i64>>, (): ()| async move {
        Ok::<_, String>(v.iter().sum::<i64>())
    })
    .unwrap();
    f.register("where_is", |t: Tensor| async move {
        Ok::<_, String>((t.device().to_string(), t))
    })
    .unwrap();
    f.register("confirmed_here", |r: RRef<Vec<i64>>| async move {
        Ok::<_, String>(r.confirmed_by_owner())
    })
    .unwrap();
    f.register("sum", |r: RRef<Vec<i64>>| async move {
        let v = r.to_here(None).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(v.iter().sum::<i64>())
    })
    .unwrap();
    f.register_with_context("double", |ctx: CallContext, x: i64| async move {
        Ok::<_, String>((ctx.caller().name.clone(), 2 * x))
    })
    .unwrap();
    // A reference made on a third worker, returned after `ms`.
    f.register_with_context(
        "slow_ref",
        |ctx: CallContext, (ms, n): (u64, usize)| async move {
            let r: RRef<Vec<i64>> = ctx
                .agent()
                .remote("w2", "make_vec", &n, None)
                .map_err(|e| e.to_string())?;
            r.to_here(None).await.map_err(|e| e.to_string())?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok::<_, String>(r)
        },
    )
    .unwrap();
    // A nested call through the context's agent, with what is left of the caller's deadline.
    f.register_with_context(
        "relay",
        |ctx: CallContext, (to, x): (String, i64)| async move {
            assert!(ctx.deadline().is_some());
            let (asked_by, doubled): (String, i64) = ctx
                .agent()
                .rpc_sync(to.as_str(), "double", &x, ctx.remaining())
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(format!("{} -> {asked_by}: {doubled}", ctx.caller().name))
        },
    )
    .unwrap();
    f
}

/// `n` in-memory agents in one process, over `faults` when given.
async fn group(n: usize, faults: Option<&Arc<FaultyBackend>>) -> Vec<Agent> {
    group_with(n, faults, |_, _| {}).await
}

/// [`group`], with `tweak` applied to each rank's options.
async fn group_with(
    n: usize,
    faults: Option<&Arc<FaultyBackend>>,
    tweak: impl Fn(usize, &mut RpcOptions),
) -> Vec<Agent> {
    let mut cluster = MemoryCluster::new();
    if let Some(f) = faults {
        cluster = cluster.with_faults(Arc::clone(f));
    }
    cluster
        .group(n, |rank, o| {
            o.functions = functions();
            tweak(rank, o);
        })
        .await
        .unwrap()
}

async fn shutdown_all(agents: Vec<Agent>) {
    let tasks: Vec<_> = agents
        .into_iter()
        .map(|a| {
            tokio::spawn(async move {
                a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(20)))
                    .await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

/// Waits for a condition that an event elsewhere makes true (a message in flight).
async fn wait_until(what: &str, cond: impl Fn() -> bool) {
    tensorwire_testkit::wait_until(what, Duration::from_secs(10), cond).await;
}

fn faulty(_name: &str, backend: FaultyBackend) -> Arc<FaultyBackend> {
    Arc::new(backend)
}

/// A method called on a reference whose creation the endpoint has failed, before anyone
/// awaited the creation: the call is refused under the agent's one lock, and the error names
/// the owner from the directory under that same lock (issue 45: a second take of the lock to
/// name it would deadlock, and this call would never return).
#[tokio::test(start_paused = true)]
async fn a_method_on_a_reference_whose_creation_failed_unseen_is_refused_naming_its_owner() {
    let backend = faulty(
        "FAULTY_CREATION_UNSEEN",
        FaultyBackend::new().with_fault(
            0,
            Fault::new(
                MessageKind::Remote,
                FaultAction::Delay(Duration::from_millis(1500)),
                1,
            ),
        ),
    );
    let agents = group(3, Some(&backend)).await;
    let a = &agents[0];
    // (Printed, the agent counts the world from the directory, without waiting for the lock.)
    assert!(format!("{a:?}").contains("world: 3"), "{a:?}");
    let timeout = Duration::from_millis(200);
    let r: RRef<Vec<i64>> = a.remote("w1", "make_vec", &3usize, Some(timeout)).unwrap();
    // The creation times out in the endpoint; nobody awaits it here.
    wait_until("the creation timed out", || {
        a.debug_info()
            .protocol
            .calls_in_flight
            .values()
            .sum::<usize>()
            == 0
    })
    .await;
    let e = r
        .rpc_async::<_, i64>("increment", &1i64, None)
        .err()
        .expect("a method on a failed reference is refused");
    assert!(
        matches!(
            &e,
            RpcError::RRefCreation {
                owner,
                source: CallError::RRefCreationTimedOut { owner: 1, .. },
                ..
            } if owner == "w1"
        ),
        "{e:?}"
    );
    drop(r);
    shutdown_all(agents).await;
}

/// Issue: a `remote` whose creation outlived its timeout returned the value from `to_here`
/// anyway, and the owner kept the value forever after every reference was gone.
#[tokio::test(start_paused = true)]
async fn a_creation_that_times_out_fails_every_use_and_leaks_nothing() {
    // w0's first `remote` reaches w1 only after 1.5 s; its timeout is 200 ms.
    let backend = faulty(
        "FAULTY_CREATION",
        FaultyBackend::new().with_fault(
            0,
            Fault::new(
                MessageKind::Remote,
                FaultAction::Delay(Duration::from_millis(1500)),
                1,
            ),
        ),
    );
    let agents = group(3, Some(&backend)).await;
    let (a, owner) = (&agents[0], &agents[1]);
    let timeout = Duration::from_millis(200);
    let r: RRef<Vec<i64>> = a.remote("w1", "make_vec", &3usize, Some(timeout)).unwrap();

    let e = r.created().await.unwrap_err();
    let check = |e: &RpcError| {
        assert!(
            matches!(
                e,
                RpcError::RRefCreation {
                    owner,
                    source: CallError::RRefCreationTimedOut { owner: 1, after, .. },
                    ..
                } if owner == "w1" && *after == timeout
            ),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("w1") && text.contains("creation timed out"),
            "{text}"
        );
    };
    check(&e);
    assert_eq!(backend.injected(0), 1);
    // to_here, methods, and passing it on fail alike, at once.
    check(&r.to_here(None).await.unwrap_err());
    check(
        &r.rpc_async::<_, i64>("increment", &1i64, None)
            .err()
            .unwrap(),
    );
    let e = a
        .rpc_sync::<_, i64>("w2", "sum", &r, None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("creation timed out"), "{e}");

    // The owner creates the value late, keeps it while the reference lives, and frees it
    // once it is dropped: no leak (the delete follows the delayed creation on the link).
    wait_until("the late value is created", || {
        owner.debug_info().kept_values == 1
    })
    .await;
    drop(r);
    wait_until("the late value is freed", || {
        let info = owner.debug_info();
        info.kept_values == 0 && info.protocol.owned.is_empty()
    })
    .await;
    assert!(a.debug_info().protocol.forks.is_empty());
    shutdown_all(agents).await;
}

/// Issue: `rref.rpc_sync(method, args, 10 ms)` on a reference still being created waited for
/// the creation (2 s) instead of its own timeout; and it failed as a remote-reference error
/// instead of a timeout when the owner's wait noticed the deadline first.
#[tokio::test(start_paused = true)]
async fn a_method_call_on_a_value_being_created_keeps_its_own_timeout() {
    let agents = group(2, None).await;
    let c: RRef<Counter> = agents[0]
        .remote("w1", "make_counter_after_ms", &(3_000u64, 5i64), None)
        .unwrap();
    let started = Instant::now();
    let e = c
        .rpc_sync::<_, i64>("increment", &1i64, Some(Duration::from_millis(10)))
        .await
        .unwrap_err();
    // A timeout, whether the caller's timer or the owner's wait (bounded by the caller's
    // deadline) ended it.
    assert!(e.is_timeout(), "{e}");
    assert!(
        started.elapsed() < Duration::from_millis(2_500),
        "the call waited for the creation: {:?}",
        started.elapsed()
    );
    // So does `to_here` on a value still being created (its fetch parked on the owner).
    let slow: RRef<u64> = agents[0].remote("w1", "sleep_ms", &3_000u64, None).unwrap();
    let e = slow
        .to_here(Some(Duration::from_millis(10)))
        .await
        .unwrap_err();
    assert!(e.is_timeout(), "{e}");
    assert_eq!(slow.to_here(None).await.unwrap(), 3_000);
    drop(slow);
    // Once created, methods work, and `created` says so.
    c.created().await.unwrap();
    assert_eq!(
        c.rpc_sync::<_, i64>("increment", &2i64, None)
            .await
            .unwrap(),
        7
    );
    drop(c);
    shutdown_all(agents).await;
}

/// Issue: inside the callee, `confirmed_by_owner()` was false for an RRef received in the
/// arguments; PyTorch runs the function only once the owner confirmed it.
#[tokio::test(start_paused = true)]
async fn functions_run_once_the_references_in_their_arguments_are_confirmed() {
    // The owner (w2) acknowledges fork requests late: without the wait, w1's function would
    // certainly run first.
    let backend = faulty(
        "FAULTY_ACK",
        FaultyBackend::new().with_fault(
            2,
            Fault::new(
                MessageKind::Ack,
                FaultAction::Delay(Duration::from_millis(300)),
                1,
            ),
        ),
    );
    let agents = group(3, Some(&backend)).await;
    let a = &agents[0];
    let r: RRef<Vec<i64>> = a.remote("w2", "make_vec", &4usize, None).unwrap();
    r.created().await.unwrap();
    let confirmed: bool = a.rpc_sync("w1", "confirmed_here", &r, None).await.unwrap();
    assert!(confirmed);
    assert_eq!(backend.injected(2), 1, "the ack was delayed");
    // The wait is bounded by the call's deadline: a fork whose confirmation comes too late
    // fails the call, naming the reference and its owner.
    let backend2 = faulty(
        "FAULTY_ACK_LATE",
        FaultyBackend::new().with_fault(
            2,
            Fault::new(
                MessageKind::Ack,
                FaultAction::Delay(Duration::from_millis(1_000)),
                1,
            ),
        ),
    );
    drop(r);
    shutdown_all(agents).await;
    let agents = group(3, Some(&backend2)).await;
    let a = &agents[0];
    let r: RRef<Vec<i64>> = a.remote("w2", "make_vec", &4usize, None).unwrap();
    r.created().await.unwrap();
    let e = a
        .rpc_sync::<_, bool>("w1", "confirmed_here", &r, Some(Duration::from_millis(300)))
        .await
        .unwrap_err();
    // Whichever side sees the deadline first reports it: the caller's timer, or the callee's
    // bounded wait naming the reference's owner.
    let callee_gave_up = e.remote().is_some_and(|r| {
        r.kind == RemoteErrorKind::RRef && r.message.contains("owner w2 did not confirm")
    });
    assert!(e.is_timeout() || callee_gave_up, "{e}");
    assert_eq!(backend2.injected(2), 1);
    drop(r);
    shutdown_all(agents).await;
}

#[tokio::test(start_paused = true)]
async fn local_references_proxies_and_the_call_context() {
    let agents = group(3, None).await;
    let (a, b) = (&agents[0], &agents[1]);

    // RRef::new: a value this worker holds, passed to another worker that fetches it.
    let mine = RRef::new(a, vec![1i64, 2, 3]).unwrap();
    assert!(mine.is_owner() && mine.confirmed_by_owner());
    mine.created().await.unwrap();
    assert_eq!(*mine.local_value().await.unwrap(), vec![1, 2, 3]);
    assert_eq!(
        a.rpc_sync::<_, i64>("w1", "sum", &mine, None)
            .await
            .unwrap(),
        6
    );
    assert_eq!(a.debug_info().kept_values, 1);
    drop(mine);
    wait_until("the local value is freed", || {
        a.debug_info().kept_values == 0
    })
    .await;

    // rpc_async and remote on a reference.
    let c: RRef<Counter> = b
        .remote("w2", "make_counter_after_ms", &(0u64, 10i64), None)
        .unwrap();
    let pending = c.rpc_async::<_, i64>("increment", &5i64, None).unwrap();
    assert_eq!(pending.await.unwrap(), 15);
    let snap: RRef<Vec<i64>> = c.remote("snapshot", &(), None).unwrap();
    assert_eq!(snap.owner().name, "w2");
    assert_eq!(snap.to_here(None).await.unwrap(), vec![15, 15]);
    // A method that does not exist is reported on use.
    let bad: RRef<i64> = c.remote("nope", &(), None).unwrap();
    let e = bad.created().await.unwrap_err();
    assert!(
        matches!(&e, RpcError::RRefCreation { source: CallError::Remote(r), .. } if r.kind == RemoteErrorKind::UnknownFunction),
        "{e:?}"
    );
    drop((c, snap, bad));

    // The call context: the caller's name, and nested calls through the agent.
    let relayed: String = a
        .rpc_sync("w1", "relay", &("w2".to_string(), 21i64), None)
        .await
        .unwrap();
    assert_eq!(relayed, "w0 -> w1: 42");
    wait_until("every value is freed", || {
        agents.iter().all(|a| a.debug_info().kept_values == 0)
    })
    .await;
    shutdown_all(agents).await;
}

#[tokio::test(start_paused = true)]
async fn the_default_timeout_can_be_read_and_changed_and_the_debug_view_counts() {
    let agents = group(2, None).await;
    let a = &agents[0];
    assert_eq!(a.rpc_timeout(), tensorwire_rpc::DEFAULT_RPC_TIMEOUT);
    a.set_rpc_timeout(Duration::from_millis(50));
    assert_eq!(a.rpc_timeout(), Duration::from_millis(50));
    let e = a
        .rpc_sync::<_, u64>("w1", "sleep_ms", &2_000u64, None)
        .await
        .unwrap_err();
    assert!(e.is_timeout(), "{e}");
    a.set_rpc_timeout(Duration::from_secs(60));

    // Calls in flight per peer, owned values and forks.
    let slow = [
        a.rpc_async::<_, u64>("w1", "sleep_ms", &300u64, None)
            .unwrap(),
        a.rpc_async::<_, u64>("w1", "sleep_ms", &300u64, None)
            .unwrap(),
    ];
    let r: RRef<Vec<i64>> = a.remote("w1", "make_vec", &2usize, None).unwrap();
    r.created().await.unwrap();
    let info = a.debug_info();
    assert_eq!(info.protocol.calls_in_flight.get(&1), Some(&2), "{info}");
    assert_eq!(info.protocol.forks.len(), 1);
    assert!(info.protocol.forks[0].confirmed);
    assert!(info.protocol.holds_references());
    let owner = agents[1].debug_info();
    assert_eq!(owner.kept_values, 1);
    assert_eq!(owner.protocol.owned.len(), 1);
    // The call that timed out is still being served: a callee does not learn that its caller
    // gave up.
    assert_eq!(owner.protocol.requests_being_served.get(&0), Some(&3));
    assert!(info.to_string().contains("w0 (rank 0)"), "{info}");
    for f in slow {
        f.await.unwrap();
    }
    drop(r);
    shutdown_all(agents).await;
}

/// `remote()` with a tensor on a (simulated) GPU: the reference comes back at once, the
/// creation leaves once the tensor is copied off the device, and the creator's own `to_here`,
/// made at once, never overtakes it. The tensor lands by the device map; the result comes
/// back by the reverse map.
#[tokio::test(start_paused = true)]
async fn remote_takes_device_tensors() {
    let devices = Arc::new(SimulatedDevices::new(2));
    let shared = Arc::clone(&devices);
    let agents = group_with(2, None, move |rank, o| {
        o.device_backend = shared.clone();
        if rank == 0 {
            o.set_device_map("w1", &[("cuda:0", "cuda:1")]).unwrap();
        }
    })
    .await;
    let a = &agents[0];
    let values = [1.5f32, -2.0, 4.25];
    let host = Tensor::from_f32(vec![3], &values).unwrap();
    let on_gpu = relocate(&*devices, &host, Device::Cuda(0)).await.unwrap();
    for _ in 0..20 {
        let r: RRef<(String, Tensor)> = a.remote("w1", "where_is", &on_gpu, None).unwrap();
        let (landed, back) = r.to_here(None).await.unwrap();
        assert_eq!(landed, "cuda:1");
        assert_eq!(back.device(), Device::Cuda(0), "back by the reverse map");
        let back = relocate(&*devices, &back, Device::Cpu).await.unwrap();
        assert_eq!(back.to_f32_vec().unwrap(), values);
        r.created().await.unwrap();
    }
    // A device the map does not cover fails at once, before anything is sent.
    let elsewhere = relocate(&*devices, &host, Device::Cuda(1)).await.unwrap();
    let e = a
        .remote::<_, (String, Tensor)>("w1", "where_is", &elsewhere, None)
        .unwrap_err();
    assert!(e.to_string().contains("cuda:1"), "{e}");
    wait_until("values freed", || agents[1].debug_info().kept_values == 0).await;
    shutdown_all(agents).await;
}

/// A call that fails before it is sent (here: a GPU tensor with no device map for the callee)
/// undoes the forks made while encoding its arguments: the reference passed in it does not
/// stay pinned, and the owner frees the value once the caller drops it.
#[tokio::test(start_paused = true)]
async fn a_call_refused_before_sending_leaves_no_fork_behind() {
    let devices = Arc::new(SimulatedDevices::new(2));
    let shared = Arc::clone(&devices);
    let agents = group_with(3, None, move |_, o| {
        o.device_backend = shared.clone();
    })
    .await;
    let (a, owner) = (&agents[0], &agents[1]);
    let r: RRef<Vec<i64>> = a.remote("w1", "make_vec", &3usize, None).unwrap();
    r.created().await.unwrap();
    let host = Tensor::from_f32(vec![1], &[1.0]).unwrap();
    let on_gpu = relocate(&*devices, &host, Device::Cuda(1)).await.unwrap();
    for _ in 0..3 {
        let e = a
            .rpc_async::<_, i64>("w2", "sum", &(&r, &on_gpu), None)
            .err()
            .expect("refused before sending");
        assert!(e.to_string().contains("cuda:1"), "{e}");
    }
    assert_eq!(owner.debug_info().kept_values, 1);
    drop(r);
    wait_until("the value is freed", || owner.debug_info().kept_values == 0).await;
    assert!(a.debug_info().protocol.forks.is_empty());
    shutdown_all(agents).await;
}

/// A reply that arrives after its call timed out still carries references (forked for the
/// caller): the caller's endpoint releases them, so the value behind them is freed (it was
/// pinned for ever when they were dropped with the body).
#[tokio::test(start_paused = true)]
async fn references_in_a_late_reply_are_released() {
    let agents = group(3, None).await;
    let e = agents[0]
        .rpc_sync::<_, RRef<Vec<i64>>>(
            "w1",
            "slow_ref",
            &(500u64, 3usize),
            Some(Duration::from_millis(100)),
        )
        .await
        .unwrap_err();
    assert!(e.is_timeout(), "{e}");
    assert_eq!(agents[2].owned_value_count(), 1);
    let owner = &agents[2];
    wait_until("the late reply's reference is released", || {
        owner.owned_value_count() == 0
    })
    .await;
    shutdown_all(agents).await;
}

/// Only a holder reads or calls a value, and a worker holds a reference from the moment it
/// receives it: one that came in a result is fetched and called at once, before its owner has
/// confirmed the fork (the fork request travels ahead of the fetch and the call on the same
/// link, so the owner knows the holder by then), as in PyTorch.
#[tokio::test(start_paused = true)]
async fn a_reference_received_in_a_result_is_read_and_called_before_its_owner_confirms_it() {
    // The owner (w2) acknowledges w0's fork request late.
    let backend = faulty(
        "FAULTY_ACK",
        FaultyBackend::new().with_fault(
            2,
            Fault::new(
                MessageKind::Ack,
                FaultAction::Delay(Duration::from_secs(30)),
                1,
            ),
        ),
    );
    let agents = group(3, Some(&backend)).await;
    let a = &agents[0];
    // w1 makes a value on w2 and returns its reference: forked for w0.
    let r: RRef<Vec<i64>> = a
        .rpc_sync("w1", "slow_ref", &(0u64, 4usize), None)
        .await
        .unwrap();
    assert!(!r.confirmed_by_owner());
    assert_eq!(r.to_here(None).await.unwrap(), vec![0, 1, 2, 3]);
    let total: i64 = r.rpc_sync("total", &(), None).await.unwrap();
    assert_eq!(total, 6);
    let again: RRef<i64> = r.remote("total", &(), None).unwrap();
    assert_eq!(again.to_here(None).await.unwrap(), 6);
    assert_eq!(backend.injected(2), 1, "the ack was delayed");
    drop((r, again));
    shutdown_all(agents).await;
}

/// A reference handed to its owner and dropped by the caller at once (a temporary): as the
/// target of a method call or of a remote method, or among the arguments of a call or a
/// `remote`. The caller's delete of its fork travels right behind the request; the owner holds
/// the value from the request's arrival until it answers, so its handler (which looks the
/// value up and decodes its arguments later, in a task of its own) still finds it — it found
/// "no value is kept", or a reference whose value was never created, now and then, when the
/// owner took its handle only as it decoded. Every value is freed at the end. On a
/// multi-thread runtime, where handlers run in tasks of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temporary_reference_given_to_its_owner_stays_until_the_owner_used_it() {
    let agents = group(2, None).await;
    let a = &agents[0];
    // A value the owner has confirmed: dropped, its delete leaves at once.
    let made = |n: usize| async move {
        let r: RRef<Vec<i64>> = a.remote("w1", "make_vec", &n, None).unwrap();
        r.created().await.unwrap();
        r
    };
    for round in 0..100usize {
        let n = round % 7 + 1;
        let total = (0..n as i64).sum::<i64>();
        // rref.rpc_async().method(), on a temporary.
        let by_method = made(n)
            .await
            .rpc_async::<_, i64>("total", &(), None)
            .unwrap();
        // rref.remote().method(), on a temporary.
        let by_remote: RRef<i64> = made(n).await.remote("total", &(), None).unwrap();
        // rpc_async(owner, f, args=(temporary,)).
        let by_argument = a
            .rpc_async::<_, i64>("w1", "sum", &made(n).await, None)
            .unwrap();
        // remote(owner, f, args=(temporary,)).
        let by_remote_argument: RRef<i64> = a.remote("w1", "sum", &made(n).await, None).unwrap();
        assert_eq!(by_method.await.unwrap(), total, "round {round}");
        assert_eq!(
            by_remote.to_here(None).await.unwrap(),
            total,
            "round {round}"
        );
        assert_eq!(by_argument.await.unwrap(), total, "round {round}");
        assert_eq!(
            by_remote_argument.to_here(None).await.unwrap(),
            total,
            "round {round}"
        );
    }
    let owner = &agents[1];
    wait_until("every value is freed", || {
        owner.debug_info().kept_values == 0
    })
    .await;
    assert!(owner.debug_info().protocol.owned.is_empty());
    shutdown_all(agents).await;
}

/// A sender that keeps a reference out of its request's envelope (where the owner checks and
/// holds what a request names) but leaves it in the argument bytes is refused at decode,
/// before the reference is accepted: the function never runs and the caller is told why.
#[tokio::test(start_paused = true)]
async fn a_reference_hidden_from_the_envelope_is_refused_and_nothing_runs() {
    // Two shapes: a reference passed back to its owner (w1), and one owned by a third worker.
    for (owner, function) in [("w1", "sum"), ("w2", "confirmed_here")] {
        let backend = faulty(
            "HIDE_FORKS",
            FaultyBackend::new()
                .with_fault(0, Fault::new(MessageKind::Call, FaultAction::HideForks, 1)),
        );
        let agents = group(3, Some(&backend)).await;
        let a = &agents[0];
        let r: RRef<Vec<i64>> = a.remote(owner, "make_vec", &4usize, None).unwrap();
        r.created().await.unwrap();
        let e = a
            .rpc_sync::<_, i64>("w1", function, &r, None)
            .await
            .unwrap_err();
        assert_eq!(backend.injected(0), 1, "the fork was hidden");
        let remote = e
            .remote()
            .unwrap_or_else(|| panic!("a remote error, got {e}"));
        assert_eq!(remote.kind, RemoteErrorKind::Serialization, "{e}");
        assert!(remote.message.contains("did not announce"), "{e}");
        // The same call, announced, runs.
        if function == "sum" {
            let total: i64 = a.rpc_sync("w1", function, &r, None).await.unwrap();
            assert_eq!(total, 6);
        } else {
            let confirmed: bool = a.rpc_sync("w1", function, &r, None).await.unwrap();
            assert!(confirmed);
        }
        drop(r);
        shutdown_all(agents).await;
    }
}
