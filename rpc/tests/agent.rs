//! Agents of a group in one process. Most run over the in-memory transport and store in
//! virtual time (tokio's paused clock: timeouts and slow functions take no real time); the
//! backend tests run over real loopback TCP (or QUIC) with a cluster secret, meeting through a
//! file store, so no port is picked in advance.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::device::Device;
use tensorwire_core::devices_sim::SimulatedDevices;
use tensorwire_core::tensor::Tensor;
use tensorwire_rpc::{
    init_rpc, Agent, CallError, Functions, RRef, RemoteErrorKind, RpcError, RpcOptions, Runtime,
    TokioRuntime,
};

use tensorwire_core::ports::store::{Store, StoreError};
use tensorwire_rpc::{start_agent, RRefError, Rendezvous, WaitingFor};
use tensorwire_store::InMemoryStore;
use tensorwire_testkit::{base_options, MemoryCluster as Cluster, TcpCluster};
use tensorwire_transport_memory::MemoryTransport;

/// The options of this file's agents: the testkit's, serving [`functions`].
fn options() -> RpcOptions {
    RpcOptions {
        functions: functions(),
        ..base_options()
    }
}

#[derive(Default)]
struct Counter(AtomicI64);

fn functions() -> Functions {
    let f = Functions::new();
    f.register(
        "add",
        |(a, b): (i64, i64)| async move { Ok::<_, String>(a + b) },
    )
    .unwrap();
    f.register("fail", |msg: String| async move {
        Err::<(), _>(format!("refused: {msg}"))
    })
    .unwrap();
    f.register("boom", |(): ()| async move {
        if true {
            panic!("kaboom");
        }
        Ok::<(), String>(())
    })
    .unwrap();
    f.register("sleep_ms", |ms: u64| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, String>(ms)
    })
    .unwrap();
    f.register("make_vec", |n: usize| async move {
        Ok::<_, String>((0..n as i64).collect::<Vec<i64>>())
    })
    .unwrap();
    f.register("make_counter", |start: i64| async move {
        Ok::<_, String>(Counter(AtomicI64::new(start)))
    })
    .unwrap();
    f.register_method("increment", |c: Arc<Counter>, by: i64| async move {
        Ok::<_, String>(c.0.fetch_add(by, Ordering::SeqCst) + by)
    })
    .unwrap();
    // Tensors: report where the argument landed, and send back a tensor on the same device.
    f.register("where_and_double", |t: Tensor| async move {
        let device = t.device().to_string();
        Ok::<_, String>((device, t))
    })
    .unwrap();
    f.register("make_counter_slowly", |start: i64| async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        Ok::<_, String>(Counter(AtomicI64::new(start)))
    })
    .unwrap();
    f.register("bump", |c: RRef<Counter>| async move {
        c.rpc_sync::<_, i64>("increment", &1i64, None)
            .await
            .map_err(|e| e.to_string())
    })
    .unwrap();
    f.register("sum_remote", |r: RRef<Vec<i64>>| async move {
        let v = r.to_here(None).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(v.iter().sum::<i64>())
    })
    .unwrap();
    f
}

impl serde::Serialize for Counter {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.load(Ordering::SeqCst).serialize(s)
    }
}

/// A static group of `n` in-memory agents.
async fn group(n: usize, tweak: impl Fn(usize, &mut RpcOptions)) -> Vec<Result<Agent, RpcError>> {
    group_in(&Cluster::new(), n, tweak).await
}

/// A static group of `n` in-memory agents in `cluster`, serving [`functions`].
async fn group_in(
    cluster: &Cluster,
    n: usize,
    tweak: impl Fn(usize, &mut RpcOptions),
) -> Vec<Result<Agent, RpcError>> {
    cluster
        .start_all(n, |rank, o| {
            o.functions = functions();
            tweak(rank, o);
        })
        .await
}

/// A static group of `n` agents over the real transports, through `init_rpc`, serving
/// [`functions`] (the cluster keeps their rendezvous folder).
async fn tcp_group(
    n: usize,
    tweak: impl Fn(usize, &mut RpcOptions),
) -> (TcpCluster, Vec<Result<Agent, RpcError>>) {
    let cluster = TcpCluster::new();
    let agents = cluster
        .start_all(n, |rank, o| {
            o.secret = Some(b"in-process test secret".to_vec());
            o.functions = functions();
            tweak(rank, o);
        })
        .await;
    (cluster, agents)
}

async fn ok_group(n: usize) -> Vec<Agent> {
    group(n, |_, _| {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
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

#[tokio::test(start_paused = true)]
async fn calls_errors_panics_and_timeouts() {
    let agents = ok_group(2).await;
    let a = &agents[0];
    assert_eq!(
        a.rpc_sync::<_, i64>("w1", "add", &(2i64, 3i64), None)
            .await
            .unwrap(),
        5
    );
    assert_eq!(
        a.rpc_sync::<_, i64>(1u32, "add", &(1i64, 1i64), None)
            .await
            .unwrap(),
        2
    );
    assert_eq!(
        a.rpc_sync::<_, i64>("w0", "add", &(4i64, 4i64), None)
            .await
            .unwrap(),
        8,
        "calls to self"
    );

    let e = a
        .rpc_sync::<_, ()>("w1", "nope", &(), None)
        .await
        .unwrap_err();
    assert_eq!(e.remote().unwrap().kind, RemoteErrorKind::UnknownFunction);
    assert!(e.to_string().contains("\"nope\""), "{e}");

    let e = a
        .rpc_sync::<_, ()>("w1", "fail", &"x".to_string(), None)
        .await
        .unwrap_err();
    assert_eq!(e.remote().unwrap().kind, RemoteErrorKind::Failed);
    assert!(e.to_string().contains("refused: x"), "{e}");

    let e = a
        .rpc_sync::<_, ()>("w1", "boom", &(), None)
        .await
        .unwrap_err();
    assert_eq!(e.remote().unwrap().kind, RemoteErrorKind::Panicked);
    assert!(e.to_string().contains("kaboom"), "{e}");
    // The callee keeps serving after a panic.
    assert_eq!(
        a.rpc_sync::<_, i64>("w1", "add", &(1i64, 2i64), None)
            .await
            .unwrap(),
        3
    );

    let e = a
        .rpc_sync::<_, u64>(
            "w1",
            "sleep_ms",
            &2_000u64,
            Some(Duration::from_millis(100)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RpcError::Call {
                source: CallError::Timeout { .. },
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("timed out"), "{e}");
    assert_eq!(
        a.rpc_sync::<_, u64>("w1", "sleep_ms", &50u64, Some(Duration::ZERO))
            .await
            .unwrap(),
        50
    );

    // postcard is not self-describing: too few bytes is what it can always detect.
    let e = a
        .rpc_sync::<_, i64>("w1", "add", &(), None)
        .await
        .unwrap_err();
    assert_eq!(e.remote().unwrap().kind, RemoteErrorKind::Serialization);
    let e = a
        .rpc_sync::<_, i64>("w9", "add", &(1i64, 1i64), None)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::UnknownWorker { .. }), "{e}");
    shutdown_all(agents).await;
}

/// Every agent names, per peer, the transport its connection runs over; a lost peer is no
/// longer listed.
#[tokio::test(start_paused = true)]
async fn agents_report_the_transport_of_each_peer() {
    let cluster = Cluster::new();
    let agents: Vec<Agent> = group_in(&cluster, 3, |_, _| {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for (rank, a) in agents.iter().enumerate() {
        let seen: Vec<_> = a
            .connections()
            .into_iter()
            .map(|c| (c.peer.id, c.peer.name, c.transport))
            .collect();
        let expected: Vec<_> = (0..3u32)
            .filter(|r| *r as usize != rank)
            .map(|r| (r, format!("w{r}"), "memory"))
            .collect();
        assert_eq!(seen, expected, "rank {rank}");
    }
    // Rank 2 dies: once rank 0 has noticed (a call to it fails), it lists rank 1 only.
    cluster.kill(2);
    assert!(agents[0]
        .rpc_sync::<_, i64>("w2", "add", &(1i64, 1i64), None)
        .await
        .is_err());
    let left: Vec<_> = agents[0].connections().iter().map(|c| c.peer.id).collect();
    assert_eq!(left, [1]);
    for a in agents {
        let _ = a.shutdown(tensorwire_rpc::Shutdown::Immediate).await;
    }
}

#[tokio::test(start_paused = true)]
async fn many_async_calls_in_flight() {
    let agents = ok_group(2).await;
    let futs: Vec<_> = (0..2000i64)
        .map(|i| {
            agents[0]
                .rpc_async::<_, i64>("w1", "add", &(i, i), None)
                .unwrap()
        })
        .collect();
    for (i, f) in futs.into_iter().enumerate() {
        assert_eq!(f.await.unwrap(), 2 * i as i64);
    }
    shutdown_all(agents).await;
}

#[tokio::test(start_paused = true)]
async fn remote_references_live_until_the_last_is_dropped() {
    let agents = ok_group(3).await;
    let (a, b, owner) = (&agents[0], &agents[1], &agents[2]);
    let r: RRef<Vec<i64>> = a.remote("w2", "make_vec", &4usize, None).unwrap();
    assert_eq!(r.owner().name, "w2");
    assert!(!r.is_owner());
    assert_eq!(r.to_here(None).await.unwrap(), vec![0, 1, 2, 3]);
    assert!(r.confirmed_by_owner());
    // Passed to a third worker, which fetches it from the owner.
    assert_eq!(
        a.rpc_sync::<_, i64>("w1", "sum_remote", &r, None)
            .await
            .unwrap(),
        6
    );
    assert_eq!(owner.owned_value_count(), 1);
    drop(r);
    wait_until(|| owner.owned_value_count() == 0).await;

    // Methods mutate the owner's value; local_value works on the owner only.
    let c: RRef<Counter> = b.remote("w0", "make_counter", &10i64, None).unwrap();
    assert_eq!(
        c.rpc_sync::<_, i64>("increment", &5i64, None)
            .await
            .unwrap(),
        15
    );
    assert_eq!(
        c.rpc_sync::<_, i64>("increment", &1i64, None)
            .await
            .unwrap(),
        16
    );
    // Not the owner: the error says so, typed, naming the owner.
    let e = c
        .local_value()
        .await
        .err()
        .expect("only the owner has the value");
    assert!(
        matches!(&e, RpcError::RRef { reason: RRefError::NotOwner { owner }, .. } if owner.name == "w0"),
        "{e}"
    );
    let own: RRef<Vec<i64>> = owner.remote("w2", "make_vec", &2usize, None).unwrap();
    assert!(own.is_owner());
    assert_eq!(*own.local_value().await.unwrap(), vec![0, 1]);

    // A remote whose function fails reports it on use.
    let bad: RRef<()> = a.remote("w1", "fail", &"no".to_string(), None).unwrap();
    let e = bad.to_here(None).await.unwrap_err();
    assert!(e.to_string().contains("refused: no"), "{e}");
    drop((c, own, bad));
    wait_until(|| agents.iter().all(|a| a.owned_value_count() == 0)).await;
    shutdown_all(agents).await;
}

/// Waits (in virtual time) until `cond` holds: the agents' tasks run between the checks.
async fn wait_until(cond: impl Fn() -> bool) {
    tensorwire_testkit::wait_until("condition", Duration::from_secs(10), cond).await;
}

/// Every worker's init failed because w0's map for w1 names a device w1 does not have.
fn assert_every_init_refuses_w0s_map(results: Vec<Result<Agent, RpcError>>) {
    for r in results {
        let e = r.unwrap_err();
        assert!(
            e.to_string().contains(
                "Node w0 has target devices with invalid indices in its device map for w1"
            ),
            "{e}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_bad_device_map_fails_init_on_every_worker() {
    let results = group(2, |rank, o| {
        o.device_backend = Arc::new(SimulatedDevices::new(1));
        if rank == 0 {
            o.set_device_map("w1", &[("cuda:0", "cuda:3")]).unwrap();
        }
    })
    .await;
    assert_every_init_refuses_w0s_map(results);
}

/// With the feature `cuda` the agent's default device backend is the CUDA one. Without a GPU
/// (CI) it has no devices, so a map naming `cuda:0` fails validation on every worker with the
/// usual invalid-index error; with one, the same map is accepted.
#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_cuda_feature_the_default_backend_is_cuda() {
    use std::io::Write;
    let backend = RpcOptions::default().device_backend;
    assert_eq!(backend.name(), "cuda");
    let results = group(2, |rank, o| {
        if rank == 0 {
            o.set_device_map("w1", &[("cpu", "cuda:0")]).unwrap();
        }
    })
    .await;
    if let Some(why) = backend.unavailable() {
        assert_every_init_refuses_w0s_map(results);
        let _ = writeln!(
            std::io::stdout().lock(),
            "SKIPPED the GPU half: no CUDA device ({why})"
        );
        return;
    }
    let agents: Vec<Agent> = results.into_iter().map(Result::unwrap).collect();
    shutdown_all(agents).await;
}

/// `Duration::MAX` as a timeout means no deadline: init and a graceful shutdown with it work
/// (the deadline was `now + timeout`, which panicked).
#[tokio::test(start_paused = true)]
async fn timeouts_of_duration_max_are_no_deadline_not_a_panic() {
    let agents: Vec<Agent> = group(2, |_, o| o.init_timeout = Duration::MAX)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let sum: i64 = agents[0]
        .rpc_sync("w1", "add", &(2i64, 3i64), Some(Duration::MAX))
        .await
        .unwrap();
    assert_eq!(sum, 5);
    let tasks: Vec<_> = agents
        .into_iter()
        .map(|a| {
            tokio::spawn(async move {
                a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::MAX))
                    .await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn after_shutdown_calls_fail_clearly() {
    let agents = ok_group(2).await;
    let keep = agents[0].clone();
    shutdown_all(agents).await;
    let e = keep
        .rpc_sync::<_, i64>("w1", "add", &(1i64, 1i64), None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no longer running"), "{e}");
}

#[tokio::test(start_paused = true)]
async fn tensors_move_by_device_maps() {
    // w0 has 2 (simulated) devices and maps its cuda:0 to w1's cuda:1 and cpu to w1's cuda:0;
    // w1 has 2 devices and no maps: its responses go back by the reverse map.
    let agents: Vec<Agent> = group(2, |rank, o| {
        o.device_backend = Arc::new(SimulatedDevices::new(2));
        if rank == 0 {
            o.set_device_map("w1", &[("cuda:0", "cuda:1"), ("cpu", "cuda:0")])
                .unwrap();
        }
    })
    .await
    .into_iter()
    .map(Result::unwrap)
    .collect();
    let a = &agents[0];
    let values = [1.0f32, 2.0, 3.0];
    let cpu = Tensor::from_f32(vec![3], &values).unwrap();

    // A CPU tensor lands on cuda:0 (the map's cpu entry); the reply comes back by the reverse
    // map: w1's cuda:0 -> w0's cpu.
    let (landed, back): (String, Tensor) = a
        .rpc_sync("w1", "where_and_double", &cpu, None)
        .await
        .unwrap();
    assert_eq!(landed, "cuda:0");
    assert_eq!(back.device(), Device::Cpu);
    assert_eq!(back.to_f32_vec().unwrap(), values);

    // w1 -> w0: no map, so CPU tensors stay on the CPU.
    let (landed, _): (String, Tensor) = agents[1]
        .rpc_sync("w0", "where_and_double", &cpu, None)
        .await
        .unwrap();
    assert_eq!(landed, "cpu");
    assert_eq!(a.devices(), &[Device::Cuda(0)]);
    shutdown_all(agents).await;
}

#[tokio::test(start_paused = true)]
async fn a_cuda_tensor_without_a_map_fails_at_once_and_the_agent_stays_usable() {
    let agents: Vec<Agent> = group(2, |_, o| {
        o.device_backend = Arc::new(SimulatedDevices::new(1))
    })
    .await
    .into_iter()
    .map(Result::unwrap)
    .collect();
    let a = &agents[0];
    let sim = SimulatedDevices::new(1);
    let cpu = Tensor::from_f32(vec![2], &[1.0, 2.0]).unwrap();
    let on_gpu = tensorwire_core::ports::device::relocate(&sim, &cpu, Device::Cuda(0))
        .await
        .unwrap();
    let e = a
        .rpc_async::<_, (String, Tensor)>("w1", "where_and_double", &on_gpu, None)
        .err()
        .expect("refused before sending");
    let msg = e.to_string();
    assert!(
        msg.contains("cannot send a tensor on cuda:0 to worker w1"),
        "{msg}"
    );
    assert!(
        matches!(
            &e,
            RpcError::Tensors { source, .. }
                if matches!(**source, tensorwire_rpc::TensorTransferError::Placement(_))
        ),
        "{e:?}"
    );
    // Still usable.
    let (landed, _): (String, Tensor) = a
        .rpc_sync("w1", "where_and_double", &cpu, None)
        .await
        .unwrap();
    assert_eq!(landed, "cpu");
    shutdown_all(agents).await;
}

#[tokio::test(start_paused = true)]
async fn methods_wait_for_a_value_still_being_created() {
    let agents = ok_group(2).await;
    let owner = &agents[0];
    // The owner creates the value on itself (slowly) and passes the reference on at once: the
    // method call from w1 must wait for the value, not fail.
    let c: RRef<Counter> = owner
        .remote("w0", "make_counter_slowly", &41i64, None)
        .unwrap();
    let got: i64 = owner.rpc_sync("w1", "bump", &c, None).await.unwrap();
    assert_eq!(got, 42);
    drop(c);
    shutdown_all(agents).await;
}

/// A user-defined backend: the TCP agent, counting how often it was started.
struct Counting(Arc<AtomicI64>);

#[async_trait::async_trait]
impl tensorwire_core::registry::RpcBackend for Counting {
    type Options = RpcOptions;
    type Store = tensorwire_rpc::Rendezvous;
    type Agent = Agent;
    type Error = RpcError;

    fn construct_options(
        &self,
        rpc_timeout: Duration,
        init_method: &str,
    ) -> Result<RpcOptions, RpcError> {
        tensorwire_rpc::TcpBackend.construct_options(rpc_timeout, init_method)
    }

    async fn init_backend(
        &self,
        store: tensorwire_rpc::Rendezvous,
        name: &str,
        rank: usize,
        world_size: Option<usize>,
        options: RpcOptions,
    ) -> Result<Agent, RpcError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        tensorwire_rpc::TcpBackend
            .init_backend(store, name, rank, world_size, options)
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_backends_are_registered_and_selected_by_name() {
    use tensorwire_rpc::{backend_registered, construct_rpc_backend_options, register_backend};
    let starts = Arc::new(AtomicI64::new(0));
    assert!(!backend_registered("COUNTING"));
    register_backend("COUNTING", Arc::new(Counting(Arc::clone(&starts)))).unwrap();
    assert!(backend_registered("COUNTING") && backend_registered("TCP"));
    let e = register_backend("TCP", Arc::new(tensorwire_rpc::TcpBackend)).unwrap_err();
    assert_eq!(e.to_string(), "RPC backend TCP: already registered");
    let o = construct_rpc_backend_options("COUNTING", Duration::from_secs(7), "env://").unwrap();
    assert_eq!(
        (o.rpc_timeout, o.backend.as_str()),
        (Duration::from_secs(7), "COUNTING")
    );

    let (_cluster, agents) = tcp_group(2, |_, o| o.backend = "COUNTING".into()).await;
    let agents: Vec<Agent> = agents.into_iter().map(Result::unwrap).collect();
    assert_eq!(starts.load(Ordering::SeqCst), 2);
    assert_eq!(
        agents[0]
            .rpc_sync::<_, i64>("w1", "add", &(20i64, 22i64), None)
            .await
            .unwrap(),
        42
    );
    shutdown_all(agents).await;

    let e = init_rpc(
        "solo",
        0,
        Some(1),
        RpcOptions {
            backend: "NOPE".into(),
            ..RpcOptions::default()
        },
    )
    .await
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("RPC backend NOPE: not registered (registered: TCP"),
        "{e}"
    );
}

#[cfg(feature = "quic")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quic_backend_runs_the_agent_over_mutual_tls() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tls");
    let (_cluster, agents) = tcp_group(3, |_, o| {
        o.backend = "QUIC".into();
        o.tls_dir = Some(dir.clone());
    })
    .await;
    let agents: Vec<Agent> = agents.into_iter().map(Result::unwrap).collect();
    for a in &agents {
        let transports: Vec<_> = a.connections().iter().map(|c| c.transport).collect();
        assert_eq!(transports, ["quic", "quic"], "{}", a.worker_info());
    }
    assert_eq!(
        agents[0]
            .rpc_sync::<_, i64>("w2", "add", &(40i64, 2i64), None)
            .await
            .unwrap(),
        42
    );
    let r: RRef<Vec<i64>> = agents[1].remote("w2", "make_vec", &3usize, None).unwrap();
    assert_eq!(
        agents[1]
            .rpc_sync::<_, i64>("w0", "sum_remote", &r, None)
            .await
            .unwrap(),
        3
    );
    drop(r);
    shutdown_all(agents).await;
    assert!(dir.join("ca.pem").exists() && dir.join("ca.key.pem").exists());

    // Without TLS material the backend says what it needs.
    let e = tcp_group(1, |_, o| o.backend = "QUIC".into())
        .await
        .1
        .pop()
        .unwrap()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("the QUIC backend needs RpcOptions::tls_dir or TENSORWIRE_TLS_DIR"),
        "{e}"
    );
    assert!(
        matches!(
            e,
            RpcError::Init(tensorwire_rpc::InitError::NoTlsDir { .. })
        ),
        "{e:?}"
    );
}

/// Worker `w{rank}` joins the dynamic group of `cluster`.
async fn dynamic(
    rank: usize,
    cluster: &Cluster,
    tweak: impl FnOnce(&mut RpcOptions),
) -> Result<Agent, RpcError> {
    let mut options = options();
    tweak(&mut options);
    cluster.start(rank, None, options).await
}

#[tokio::test(start_paused = true)]
async fn dynamic_groups_let_workers_join_and_leave() {
    let cluster = Cluster::new();
    let a0 = dynamic(0, &cluster, |_| {}).await.unwrap();
    assert!(a0.is_dynamic());
    let a1 = dynamic(1, &cluster, |_| {}).await.unwrap();
    assert_eq!(
        a0.rpc_sync::<_, i64>("w1", "add", &(1i64, 2i64), None)
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        a1.rpc_sync::<_, i64>("w0", "add", &(2i64, 2i64), None)
            .await
            .unwrap(),
        4
    );

    // A joiner whose map breaks a rule is refused (it withdraws), and the coordinator goes on.
    let e = dynamic(2, &cluster, |o| {
        o.device_backend = Arc::new(SimulatedDevices::new(1));
        o.set_device_map("w0", &[("cuda:3", "cpu")]).unwrap();
    })
    .await
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("Node w2 has source devices with invalid indices"),
        "{e}"
    );

    // A map to a worker that has not joined yet is fine in a dynamic group.
    let a2 = dynamic(2, &cluster, |o| {
        o.device_backend = Arc::new(SimulatedDevices::new(1));
        o.set_device_map("w7", &[("cuda:0", "cuda:0")]).unwrap();
    })
    .await
    .unwrap();
    let names = |a: &Agent| {
        a.worker_infos()
            .into_iter()
            .map(|w| w.name)
            .collect::<Vec<_>>()
    };
    assert_eq!(names(&a0), ["w0", "w1", "w2"]);
    assert_eq!(names(&a2), ["w0", "w1", "w2"]);
    assert_eq!(
        a0.rpc_sync::<_, i64>("w2", "add", &(5i64, 5i64), None)
            .await
            .unwrap(),
        10
    );
    assert_eq!(
        a2.rpc_sync::<_, i64>("w1", "add", &(6i64, 6i64), None)
            .await
            .unwrap(),
        12
    );
    let r: RRef<Vec<i64>> = a2.remote("w0", "make_vec", &3usize, None).unwrap();
    assert_eq!(
        a2.rpc_sync::<_, i64>("w1", "sum_remote", &r, None)
            .await
            .unwrap(),
        3
    );
    // An RRef can only be sent by the agent that holds it, and the error says so.
    let e = a1
        .rpc_sync::<_, i64>("w2", "sum_remote", &r, None)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("only be sent by the agent that holds it"),
        "{e}"
    );
    drop(r);

    // w2 leaves; the others forget it; it can join again.
    a2.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
        .await
        .unwrap();
    wait_until(|| names(&a0) == ["w0", "w1"] && names(&a1) == ["w0", "w1"]).await;
    let e = a0
        .rpc_sync::<_, i64>("w2", "add", &(1i64, 1i64), None)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::UnknownWorker { .. }), "{e}");
    let again = dynamic(2, &cluster, |_| {}).await.unwrap();
    assert_eq!(
        a1.rpc_sync::<_, i64>("w2", "add", &(7i64, 7i64), None)
            .await
            .unwrap(),
        14
    );
    // The same rank or name twice is refused.
    let e = dynamic(1, &cluster, |_| {}).await.unwrap_err();
    assert!(e.to_string().contains("is already a member"), "{e}");
    // The coordinator (w0) refuses it, and the error names it.
    match &e {
        RpcError::Init(tensorwire_rpc::InitError::JoinRefused {
            coordinator,
            reason,
        }) => {
            assert_eq!(
                (coordinator.name.as_str(), coordinator.id),
                ("w0", 0),
                "{e}"
            );
            assert!(reason.contains("w1 (rank 1)"), "{e}");
        }
        other => panic!("not refused by the coordinator: {other:?}"),
    }

    for a in [again, a1, a0] {
        a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
            .await
            .unwrap();
    }
}

/// A worker that a member of its static group drops (here for a violation found above the
/// endpoint, as distributed autograd reports one) hears why: its loss of that member names
/// the cause, not a connection closed by its peer.
#[tokio::test(start_paused = true)]
async fn a_dropped_worker_hears_why() {
    use tensorwire_core::protocol::ProtocolViolation;
    use tensorwire_rpc::PeerEvent;
    let cluster = Cluster::new();
    let agents: Vec<Agent> = group_in(&cluster, 2, |_, _| {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let mut events = agents[1].peer_events();
    agents[0].fail_peer(
        1,
        ProtocolViolation::UnknownId {
            id: 77,
            what: "reply",
        },
    );
    let cause = match events.recv().await {
        Some(PeerEvent::Lost { worker: 0, cause }) => cause.to_string(),
        other => panic!("w1 did not lose w0: {other:?}"),
    };
    assert_eq!(
        cause,
        "it aborted its group: it dropped rank 1: it broke the RPC protocol: it sent a reply \
         for message 77, which this worker never sent"
    );
    let e = agents[1]
        .rpc_sync::<_, i64>("w0", "add", &(1i64, 2i64), None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("it dropped rank 1"), "{e}");
}

/// A joiner whose coordinator died (its record still in the store, nothing listening) tries
/// again until its init timeout, then fails naming that coordinator, with the last try's error
/// kept as data: which link step failed, not its text.
#[tokio::test(start_paused = true)]
async fn a_join_through_a_dead_coordinator_times_out_naming_it_and_why() {
    let cluster = Cluster::new();
    let a0 = dynamic(0, &cluster, |_| {}).await.unwrap();
    assert!(cluster.kill(0));
    let e = dynamic(1, &cluster, |o| o.init_timeout = Duration::from_secs(3))
        .await
        .unwrap_err();
    let RpcError::Timeout {
        waiting_for: Some(w @ WaitingFor::LastTry(last)),
        after,
        ..
    } = &e
    else {
        panic!("not a join's timeout naming its last try: {e:?}");
    };
    assert_eq!(*after, Duration::from_secs(3));
    assert!(w.names("w0"), "{e}");
    assert_eq!(
        (last.coordinator.name.as_str(), last.coordinator.id),
        ("w0", 0)
    );
    assert!(
        matches!(
            &last.error,
            tensorwire_core::protocol::membership::TryError::Unreachable(
                tensorwire_rpc::IntroductionError::Unreachable(_)
                    | tensorwire_rpc::IntroductionError::NoWelcome(_)
                    | tensorwire_rpc::IntroductionError::NoAnswer
            )
        ),
        "{e}"
    );
    let text = e.to_string();
    assert!(text.contains("w0 (rank 0) at "), "{text}");
    drop(a0);
}

/// A worker that leaves a dynamic group: new calls to it are refused while it settles, calls it
/// took are answered, and once it is gone the values it referred to on the others are freed and
/// the references to values it owned fail naming it.
#[tokio::test(start_paused = true)]
async fn a_leaving_worker_takes_its_references_with_it() {
    let cluster = Cluster::new();
    let a0 = dynamic(0, &cluster, |_| {}).await.unwrap();
    let a1 = dynamic(1, &cluster, |_| {}).await.unwrap();
    let a2 = dynamic(2, &cluster, |_| {}).await.unwrap();
    // w2 keeps a value on w0 alive through its reference; w0 refers to a value on w2.
    let on_w0: RRef<Vec<i64>> = a2.remote("w0", "make_vec", &3usize, None).unwrap();
    let on_w2: RRef<Vec<i64>> = a0.remote("w2", "make_vec", &4usize, None).unwrap();
    assert_eq!(on_w0.to_here(None).await.unwrap().len(), 3);
    assert_eq!(on_w2.to_here(None).await.unwrap().len(), 4);
    assert_eq!(a0.owned_value_count(), 1);
    // A slow call to w2 is in flight as it begins to leave: it is answered.
    let slow = a1
        .rpc_async::<_, u64>("w2", "sleep_ms", &50u64, None)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let leaving = {
        let a2 = a2.clone();
        tokio::spawn(async move {
            a2.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    let refused = a1
        .rpc_sync::<_, i64>("w2", "add", &(1i64, 1i64), None)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("is leaving the group"),
        "{refused}"
    );
    assert_eq!(slow.await.unwrap(), 50);
    leaving.await.unwrap().unwrap();
    // w2 went without dropping its reference: w0 frees the value it kept for it.
    wait_until(|| a0.owned_value_count() == 0).await;
    let e = on_w2.to_here(None).await.unwrap_err();
    assert!(e.to_string().contains("is gone"), "{e}");
    drop((on_w0, on_w2));
    for a in [a1, a0] {
        a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
            .await
            .unwrap();
    }
}

/// A reference to a value on a worker that left stays dead when a new worker joins under the
/// same rank: a method call through it fails at once (the new worker never had the value),
/// even with no timeout. Before, the call went to the new worker and waited there for a
/// creation that never comes: forever with a zero timeout.
#[tokio::test(start_paused = true)]
async fn a_reference_to_a_worker_that_left_stays_dead_when_its_rank_rejoins() {
    let cluster = Cluster::new();
    let a0 = dynamic(0, &cluster, |_| {}).await.unwrap();
    let a1 = dynamic(1, &cluster, |_| {}).await.unwrap();
    let counter: RRef<Counter> = a0.remote("w1", "make_counter", &10i64, None).unwrap();
    assert_eq!(
        counter
            .rpc_sync::<_, i64>("increment", &1i64, None)
            .await
            .unwrap(),
        11
    );
    a1.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
        .await
        .unwrap();
    wait_until(|| a0.worker_infos().len() == 1).await;
    let again = dynamic(1, &cluster, |_| {}).await.unwrap();
    wait_until(|| a0.worker_infos().len() == 2).await;
    // The rank is back, but not the value: no timeout, and still an answer at once.
    let e = tokio::time::timeout(
        Duration::from_secs(5),
        counter.rpc_sync::<_, i64>("increment", &1i64, Some(Duration::ZERO)),
    )
    .await
    .expect("a method call through a dead reference must not wait")
    .unwrap_err();
    assert!(matches!(e, RpcError::RRef { .. }), "{e}");
    assert!(
        format!("{counter:?}").contains(&format!("{:?}", rref_of(&e))),
        "{e}"
    );
    // A remote method through it is refused when made, too.
    let e = counter
        .remote::<_, i64>("increment", &1i64, Some(Duration::ZERO))
        .unwrap_err();
    assert!(matches!(e, RpcError::RRef { .. }), "{e}");
    drop(counter);
    for a in [again, a0] {
        a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
            .await
            .unwrap();
    }
}

fn rref_of(e: &RpcError) -> &str {
    match e {
        RpcError::RRef { rref, .. } => rref,
        _ => "",
    }
}

#[tokio::test(start_paused = true)]
async fn static_and_dynamic_members_do_not_mix() {
    let cluster = Cluster::new();
    let statics: Vec<Agent> = {
        let mut tasks = Vec::new();
        for rank in 0..2usize {
            let options = options();
            let cluster = cluster.clone();
            tasks.push(tokio::spawn(async move {
                cluster.start(rank, Some(2), options).await
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap().unwrap());
        }
        out
    };
    let e = dynamic(2, &cluster, |_| {}).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("mixing static and dynamic members is refused"),
        "{e}"
    );
    assert!(e.to_string().contains("this group is static"), "{e}");
    assert!(
        matches!(&e, RpcError::Start(tensorwire_core::protocol::start::StartError::GroupKindMismatch { group, worker: "dynamic" }) if group == "static"),
        "{e:?}"
    );
    shutdown_all(statics).await;
}

/// Values that hold remote references: releasing such a value drops its references, whose
/// `Drop` talks to the agent. That must never happen under the agent's lock (it deadlocked).
#[tokio::test(start_paused = true)]
async fn values_holding_rrefs_are_released_without_deadlock() {
    type Pair = (RRef<Vec<i64>>, RRef<Vec<i64>>);
    let agents = group(3, |_, options| {
        options
            .functions
            .register(
                "hold_pair",
                |pair: Pair| async move { Ok::<_, String>(pair) },
            )
            .unwrap();
        options
            .functions
            .register("sum_pair", |(x, y): Pair| async move {
                let (x, y) = (x.to_here(None).await, y.to_here(None).await);
                let (x, y) = (x.map_err(|e| e.to_string())?, y.map_err(|e| e.to_string())?);
                Ok::<_, String>(x.iter().chain(&y).sum::<i64>())
            })
            .unwrap();
    })
    .await
    .into_iter()
    .map(Result::unwrap)
    .collect::<Vec<_>>();
    let (a, holder, owner) = (&agents[0], &agents[1], &agents[2]);
    let work = async {
        let mut held: Vec<RRef<Pair>> = Vec::new();
        for i in 0..20usize {
            let x: RRef<Vec<i64>> = a.remote("w2", "make_vec", &i, None).unwrap();
            let y: RRef<Vec<i64>> = a.remote("w2", "make_vec", &(i + 1), None).unwrap();
            held.push(a.remote("w1", "hold_pair", &(x, y), None).unwrap());
        }
        wait_until(|| owner.owned_value_count() == 40).await;
        for (i, pair) in held.iter().enumerate() {
            // Fetch the pair (forks of both references come here), and use it.
            let (x, y) = pair.to_here(None).await.unwrap();
            let expected = (0..i as i64).sum::<i64>() + (0..=i as i64).sum::<i64>();
            let sum: i64 = a.rpc_sync("w1", "sum_pair", &(x, y), None).await.unwrap();
            assert_eq!(sum, expected);
        }
        wait_until(|| holder.owned_value_count() == 20).await;
        drop(held);
        wait_until(|| holder.owned_value_count() == 0 && owner.owned_value_count() == 0).await;
        // The holder still answers.
        let three: i64 = a.rpc_sync("w1", "add", &(1i64, 2i64), None).await.unwrap();
        assert_eq!(three, 3);
    };
    tokio::time::timeout(Duration::from_secs(60), work)
        .await
        .expect("the agents froze releasing values that hold remote references");
    tokio::time::timeout(Duration::from_secs(60), shutdown_all(agents))
        .await
        .expect("graceful shutdown froze");
}

/// A worker whose process dies: calls in flight to it and new calls fail naming it, in virtual
/// time and at once (no timeout waited out), and the survivors shut down without it.
#[tokio::test(start_paused = true)]
async fn a_killed_worker_fails_its_calls_naming_it() {
    let cluster = Cluster::new();
    let agents: Vec<Agent> = group_in(&cluster, 3, |_, _| {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let t0 = tokio::time::Instant::now();
    let in_flight = agents[0]
        .rpc_async::<_, u64>("w2", "sleep_ms", &60_000u64, None)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    cluster.kill(2);
    let e = in_flight.await.unwrap_err();
    assert!(e.to_string().contains("w2"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    let e = agents[1]
        .rpc_sync::<_, i64>("w2", "add", &(1i64, 1i64), None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("w2"), "{e}");
    // The survivors still talk.
    assert_eq!(
        agents[1]
            .rpc_sync::<_, i64>("w0", "add", &(1i64, 1i64), None)
            .await
            .unwrap(),
        2
    );
    let mut agents = agents;
    let dead = agents.pop().unwrap();
    for a in &agents {
        a.shutdown(tensorwire_rpc::Shutdown::Immediate)
            .await
            .unwrap();
    }
    let _ = dead.shutdown(tensorwire_rpc::Shutdown::Immediate).await;
}

/// After a clean init and shutdown the store holds no key the agents made.
#[tokio::test(start_paused = true)]
async fn a_clean_init_and_shutdown_leaves_no_store_keys() {
    let cluster = Cluster::new();
    let agents: Vec<Agent> = group_in(&cluster, 3, |_, _| {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        agents[0]
            .rpc_sync::<_, i64>("w2", "add", &(1i64, 2i64), None)
            .await
            .unwrap(),
        3
    );
    // Init's own keys are gone once init is over; the group's kind stays while it runs.
    assert_eq!(cluster.store().num_keys().await.unwrap(), 1);
    // Barriers and all_gathers leave nothing behind once every worker is through, and a
    // name may then be used again.
    for round in 0..2 {
        let t = Duration::from_secs(10);
        let tasks: Vec<_> = agents
            .iter()
            .cloned()
            .map(|a| {
                tokio::spawn(async move {
                    a.barrier("b", t).await.unwrap();
                    let rank = a.worker_info().id;
                    a.all_gather("g", &(rank, round), t).await.unwrap()
                })
            })
            .collect();
        for task in tasks {
            assert_eq!(
                task.await.unwrap(),
                vec![(0, round), (1, round), (2, round)]
            );
        }
        assert_eq!(
            cluster.store().num_keys().await.unwrap(),
            1,
            "round {round}"
        );
    }
    shutdown_all(agents).await;
    assert_eq!(cluster.store().num_keys().await.unwrap(), 0);
}

/// A dynamic group through which 1,000 joins and leaves have passed keeps its store's key
/// count bounded (the same as after the first), and the last member's leave removes them all.
#[tokio::test(start_paused = true)]
async fn a_thousand_joins_and_leaves_keep_the_store_bounded() {
    let cluster = Cluster::new();
    let a0 = dynamic(0, &cluster, |_| {}).await.unwrap();
    let mut after_first = None;
    for i in 0..1_000 {
        let rank = 1 + i % 3;
        let joiner = dynamic(rank, &cluster, |_| {}).await.unwrap();
        if i % 100 == 0 {
            let sum: i64 = joiner
                .rpc_sync("w0", "add", &(i as i64, 1i64), None)
                .await
                .unwrap();
            assert_eq!(sum, i as i64 + 1);
            // The members' barrier and all_gather leave no key behind either.
            let t = Duration::from_secs(10);
            let (b0, b1) = tokio::join!(a0.barrier("b", t), joiner.barrier("b", t));
            b0.unwrap();
            b1.unwrap();
            let (g0, g1) = tokio::join!(a0.all_gather("g", &i, t), joiner.all_gather("g", &i, t));
            assert_eq!(g0.unwrap(), vec![i, i]);
            assert_eq!(g1.unwrap(), vec![i, i]);
        }
        joiner
            .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
            .await
            .unwrap();
        let keys = cluster.store().num_keys().await.unwrap();
        let first = *after_first.get_or_insert(keys);
        assert_eq!(keys, first, "after {} joins and leaves", i + 1);
    }
    assert!(after_first.unwrap() <= 3, "{after_first:?}");
    a0.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(cluster.store().num_keys().await.unwrap(), 0);
}

/// A dynamic group's barrier and all_gather run over RPC through the leader (as PyTorch's
/// `_all_gather`), not the store: no key is ever written for them, values come in rank order,
/// a member that never arrives is named on timeout, and the leader keeps nothing of a round
/// that timed out (the same name works again at once).
#[tokio::test(start_paused = true)]
async fn dynamic_barriers_and_all_gathers_run_over_rpc_and_name_who_is_missing() {
    let cluster = Cluster::new();
    let mut agents = Vec::new();
    for rank in 0..3 {
        agents.push(dynamic(rank, &cluster, |_| {}).await.unwrap());
    }
    let keys = cluster.store().num_keys().await.unwrap();
    let t = Duration::from_secs(10);
    let gathered = futures_join(agents.iter().map(|a| {
        let a = a.clone();
        async move {
            let me = a.worker_info().id as i64;
            a.all_gather("g", &(me * 10), t).await
        }
    }))
    .await;
    for g in gathered {
        assert_eq!(g.unwrap(), vec![0, 10, 20]);
    }
    let passed = futures_join(agents.iter().map(|a| {
        let a = a.clone();
        async move { a.barrier("b", t).await }
    }))
    .await;
    assert!(passed.iter().all(Result::is_ok), "{passed:?}");
    // Back to back under one name: a fast member's next round never meets the last one.
    let rounds = futures_join(agents.iter().map(|a| {
        let a = a.clone();
        async move {
            for i in 0..20u32 {
                let got = a.all_gather("again", &i, t).await?;
                assert_eq!(got, vec![i; 3]);
            }
            Ok::<_, RpcError>(())
        }
    }))
    .await;
    assert!(rounds.iter().all(Result::is_ok), "{rounds:?}");
    assert_eq!(cluster.store().num_keys().await.unwrap(), keys);

    // w2 never arrives: the others fail by their timeout, naming it.
    let short = Duration::from_secs(1);
    let started = tokio::time::Instant::now();
    let (e0, e1) = tokio::join!(
        agents[0].barrier("late", short),
        agents[1].barrier("late", short)
    );
    for e in [e0.unwrap_err(), e1.unwrap_err()] {
        assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("rank 2 (w2)"), "{e}");
        assert!(
            !e.to_string().contains("(w0)") && !e.to_string().contains("(w1)"),
            "{e}"
        );
    }
    assert!(started.elapsed() < short + Duration::from_secs(1));
    // Nothing of that round is left: all three pass the same barrier now.
    let passed = futures_join(agents.iter().map(|a| {
        let a = a.clone();
        async move { a.barrier("late", t).await }
    }))
    .await;
    assert!(passed.iter().all(Result::is_ok), "{passed:?}");
    assert_eq!(cluster.store().num_keys().await.unwrap(), keys);
    for a in agents.into_iter().rev() {
        a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
            .await
            .unwrap();
    }
}

/// A dynamic group's gather fails at once, naming the member, when a member that has not sent
/// its value is lost: the leader does not wait out the timeout for a value that cannot come.
#[tokio::test(start_paused = true)]
async fn a_dynamic_gather_fails_at_once_when_a_missing_member_is_lost() {
    let cluster = Cluster::new();
    let mut agents = Vec::new();
    for rank in 0..3 {
        agents.push(dynamic(rank, &cluster, |_| {}).await.unwrap());
    }
    let long = Duration::from_secs(60);
    let t0 = tokio::time::Instant::now();
    let waiting = futures_join(agents[..2].iter().map(|a| {
        let a = a.clone();
        async move { a.barrier("never", long).await }
    }));
    let kill = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        cluster.kill(2);
    };
    let (results, ()) = tokio::join!(waiting, kill);
    for r in results {
        let e = r.unwrap_err();
        assert!(e.to_string().contains("member 2 was lost"), "{e}");
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let dead = agents.pop().unwrap();
    for a in &agents {
        a.shutdown(tensorwire_rpc::Shutdown::Immediate)
            .await
            .unwrap();
    }
    drop(dead);
}

/// Runs the futures at once (each on its own task), in order of their outputs.
async fn futures_join<F>(futures: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let tasks: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// `peer_events`: each survivor's subscription hears of a killed worker once, at once (virtual
/// time: no timeout is waited out), whether or not a call to it was pending; the subscription
/// ends when the agent shuts down (a peer that shut down first is told as lost).
#[tokio::test(start_paused = true)]
async fn peer_events_tell_each_survivor_once_of_a_lost_worker() {
    use tensorwire_rpc::PeerEvent;
    let cluster = Cluster::new();
    let agents: Vec<Agent> = group_in(&cluster, 3, |_, _| {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let mut events: Vec<_> = agents[..2].iter().map(Agent::peer_events).collect();
    assert!(events.iter_mut().all(|e| e.try_recv().is_none()));
    let t0 = tokio::time::Instant::now();
    cluster.kill(2);
    for (rank, e) in events.iter_mut().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(1), e.recv())
            .await
            .unwrap_or_else(|_| panic!("w{rank} never heard of w2's loss"));
        match got {
            Some(PeerEvent::Lost { worker: 2, cause }) => {
                // Killed: its connection broke (not a misbehaviour, not a leave).
                assert!(
                    matches!(cause, tensorwire_core::protocol::LostCause::Transport(_)),
                    "{cause:?}"
                )
            }
            other => panic!("w{rank}: {other:?}"),
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    // A call to the dead worker fails; the loss is not told twice.
    assert!(agents[0]
        .rpc_sync::<_, i64>("w2", "add", &(1i64, 1i64), None)
        .await
        .is_err());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        events.iter_mut().all(|e| e.try_recv().is_none()),
        "a loss told twice"
    );
    let mut agents = agents;
    let dead = agents.pop().unwrap();
    for a in &agents {
        a.shutdown(tensorwire_rpc::Shutdown::Immediate)
            .await
            .unwrap();
    }
    // A worker that shut down is gone too; then the subscription ends.
    for e in &mut events {
        while let Some(ev) = e.recv().await {
            assert!(
                matches!(ev, PeerEvent::Lost { worker: 0 | 1, .. }),
                "{ev:?}"
            );
        }
    }
    let _ = dead.shutdown(tensorwire_rpc::Shutdown::Immediate).await;
}

/// A worker that shuts down at once while the others run is told to them as shut down
/// (`LostCause::Shutdown`: its group said goodbye), not as a broken connection.
#[tokio::test(start_paused = true)]
async fn a_worker_that_shuts_down_at_once_is_told_as_shut_down() {
    use tensorwire_core::protocol::LostCause;
    use tensorwire_rpc::PeerEvent;
    let cluster = Cluster::new();
    let mut agents: Vec<Agent> = group_in(&cluster, 3, |_, _| {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let mut events: Vec<_> = agents[..2].iter().map(Agent::peer_events).collect();
    let leaving = agents.pop().unwrap();
    leaving
        .shutdown(tensorwire_rpc::Shutdown::Immediate)
        .await
        .unwrap();
    for (rank, e) in events.iter_mut().enumerate() {
        match tokio::time::timeout(Duration::from_secs(5), e.recv()).await {
            Ok(Some(PeerEvent::Lost { worker: 2, cause })) => {
                assert_eq!(cause, LostCause::Shutdown, "w{rank}")
            }
            other => panic!("w{rank}: {other:?}"),
        }
    }
    // The others still call each other.
    let sum: i64 = agents[0]
        .rpc_sync("w1", "add", &(1i64, 2i64), None)
        .await
        .unwrap();
    assert_eq!(sum, 3);
    for a in &agents {
        a.shutdown(tensorwire_rpc::Shutdown::Immediate)
            .await
            .unwrap();
    }
}

/// A transport that counts the connections it dialled (every connection has one dialler).
#[derive(Debug)]
struct CountingTransport {
    inner: MemoryTransport,
    dialled: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait::async_trait]
impl tensorwire_core::ports::transport::Transport for CountingTransport {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn listen(
        &self,
        addr: std::net::SocketAddr,
    ) -> Result<
        Box<dyn tensorwire_core::ports::transport::Listener>,
        tensorwire_core::ports::transport::TransportError,
    > {
        self.inner.listen(addr).await
    }

    async fn connect(
        &self,
        addr: std::net::SocketAddr,
    ) -> Result<
        Box<dyn tensorwire_core::ports::transport::Connection>,
        tensorwire_core::ports::transport::TransportError,
    > {
        let conn = self.inner.connect(addr).await?;
        self.dialled.fetch_add(1, Ordering::SeqCst);
        Ok(conn)
    }
}

/// A store that notes every key written to it.
struct RecordingStore {
    inner: InMemoryStore,
    written: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

impl RecordingStore {
    fn note(&self, key: &str) {
        self.written.lock().unwrap().insert(key.to_owned());
    }
}

#[async_trait::async_trait]
impl Store for RecordingStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.note(key);
        self.inner.set(key, value).await
    }
    async fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.inner.get(key).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.note(key);
        self.inner.add(key, delta).await
    }
    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        self.inner.check(keys).await
    }
    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.inner.wait(keys, timeout).await
    }
    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        self.note(key);
        self.inner.compare_set(key, expected, desired).await
    }
    async fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete_key(key).await
    }
    async fn num_keys(&self) -> Result<i64, StoreError> {
        self.inner.num_keys().await
    }
    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.note(key);
        self.inner.append(key, value).await
    }
    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        self.inner.multi_get(keys).await
    }
    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
        for k in keys {
            self.note(k);
        }
        self.inner.multi_set(keys, values).await
    }
    async fn barrier(
        &self,
        key: &str,
        world_size: i64,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        self.note(key);
        self.inner.barrier(key, world_size, timeout).await
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}

/// The agent and its world process group share one connection per pair of workers: a static
/// group of 4 dials 6 connections in all, through init, calls both ways, barriers and
/// all_gathers; and the agent never writes a key to the store but the group's kind (no worker
/// records, no barrier or all_gather keys: they run over the group).
#[tokio::test(start_paused = true)]
async fn the_agent_and_its_group_share_one_connection_per_pair_of_workers() {
    let recording = Arc::new(RecordingStore {
        inner: InMemoryStore::new(),
        written: Default::default(),
    });
    let cluster = Cluster::new().with_store(recording.clone());
    let dialled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let n = 4;
    let mut tasks = Vec::new();
    for rank in 0..n {
        let (store, options) = (cluster.store(), options());
        let transport = Arc::new(CountingTransport {
            inner: cluster.network().transport(),
            dialled: Arc::clone(&dialled),
        });
        tasks.push(tokio::spawn(async move {
            let rdv = Rendezvous::from_store(store, rank, n);
            start_agent(transport, rdv, &format!("w{rank}"), rank, Some(n), options).await
        }));
    }
    let mut agents = Vec::new();
    for t in tasks {
        agents.push(t.await.unwrap().unwrap());
    }
    assert_eq!(
        cluster.store().num_keys().await.unwrap(),
        1,
        "only the group's kind"
    );
    for a in &agents {
        assert_eq!(a.connections().len(), n - 1);
        for b in &agents {
            let sum: i64 = a
                .rpc_sync(b.worker_info().name.as_str(), "add", &(1i64, 2i64), None)
                .await
                .unwrap();
            assert_eq!(sum, 3);
        }
    }
    let t = Duration::from_secs(10);
    let gathers: Vec<_> = agents
        .iter()
        .cloned()
        .map(|a| {
            tokio::spawn(async move {
                a.barrier("b", t).await.unwrap();
                let ids = a.all_gather("g", &a.worker_info().id, t).await.unwrap();
                // The world group itself, beside the agent, on the same connections.
                use tensorwire_core::ports::process_group::ProcessGroup;
                use tensorwire_process_group::CollectivesExt;
                let pg = a.process_group().expect("a static group has one");
                let ranks: Vec<usize> = pg.all_gather_object(&pg.rank()).await.unwrap();
                assert_eq!(ranks, vec![0, 1, 2, 3]);
                ids
            })
        })
        .collect();
    for g in gathers {
        assert_eq!(g.await.unwrap(), vec![0, 1, 2, 3]);
    }
    assert_eq!(dialled.load(Ordering::SeqCst), n * (n - 1) / 2);
    assert_eq!(cluster.store().num_keys().await.unwrap(), 1);
    shutdown_all(agents).await;
    assert_eq!(cluster.store().num_keys().await.unwrap(), 0);
    // The agent's one key, the group's published addresses (ranks 1 to 3; rank 0 dials
    // everyone and so publishes none), and the name of the group's arena (all four workers
    // share this host), which rank 0 removes once every rank has joined.
    let mut written: Vec<String> = recording.written.lock().unwrap().iter().cloned().collect();
    let arena = written
        .iter()
        .position(|k| k.starts_with("tensorwire/pg/rpc/world-arena/"))
        .expect("the arena's name was published");
    written.remove(arena);
    assert_eq!(
        written,
        [
            "rpc/group_kind",
            "tensorwire/pg/rpc/addr/1",
            "tensorwire/pg/rpc/addr/2",
            "tensorwire/pg/rpc/addr/3"
        ]
    );
}

/// A barrier among some workers (PyTorch's `test_rpc_barrier_subset`): only the listed workers
/// take part, by name or rank, in a static group; one that does not come is named at the
/// timeout; a worker not in its own list, or an unknown one, is refused at once.
#[tokio::test(start_paused = true)]
async fn a_barrier_among_some_workers_needs_only_them() {
    let cluster = Cluster::new();
    let agents: Vec<Agent> = group_in(&cluster, 4, |_, _| {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let keys = cluster.store().num_keys().await.unwrap();
    let t = Duration::from_secs(5);
    // w1 and w3 only (the leader is w1); w0 and w2 do nothing.
    let (a, b) = tokio::join!(
        agents[1].barrier_among("odd", ["w1", "w3"], t),
        agents[3].barrier_among("odd", [1u32, 3u32], t)
    );
    assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    // Back to back, and a subset with w0 and w2 beside it under another name.
    for round in 0..3 {
        let (a, b, c, d) = tokio::join!(
            agents[1].barrier_among("odd", ["w1", "w3"], t),
            agents[3].barrier_among("odd", ["w1", "w3"], t),
            agents[0].barrier_among("even", ["w0", "w2"], t),
            agents[2].barrier_among("even", ["w0", "w2"], t),
        );
        for r in [a, b, c, d] {
            assert!(r.is_ok(), "round {round}: {r:?}");
        }
    }
    // w3 does not come: w1 fails by its timeout, naming it.
    let e = agents[1]
        .barrier_among("late", ["w1", "w3"], t)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, RpcError::Timeout { waiting_for: Some(w), .. } if w.names("w3")),
        "{e}"
    );
    let e = agents[0]
        .barrier_among("x", ["w1", "w3"], t)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::InvalidArgument(_)), "{e}");
    let e = agents[0]
        .barrier_among("x", ["w0", "w9"], t)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::UnknownWorker { .. }), "{e}");
    assert_eq!(cluster.store().num_keys().await.unwrap(), keys);
    let down = futures_join(agents.iter().map(|a| {
        let a = a.clone();
        async move {
            a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(10)))
                .await
        }
    }))
    .await;
    assert!(down.iter().all(Result::is_ok), "{down:?}");
}

/// A barrier that times out in a static group names the workers that did not arrive and
/// leaves no key in the store.
#[tokio::test(start_paused = true)]
async fn a_barrier_that_times_out_names_who_is_missing_and_leaves_no_key() {
    let cluster = Cluster::new();
    let agents: Vec<Agent> = group_in(&cluster, 3, |_, _| {})
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let t = Duration::from_secs(5);
    let (b0, b1) = tokio::join!(agents[0].barrier("b", t), agents[1].barrier("b", t));
    // Rank 0 monitors the barrier: it names who did not arrive.
    let e = b0.unwrap_err();
    assert!(
        matches!(&e, RpcError::Timeout { waiting_for: Some(w), .. } if w.names("w2")),
        "{e}"
    );
    assert!(b1.is_err());
    assert_eq!(
        cluster.store().num_keys().await.unwrap(),
        1,
        "only the group's kind"
    );
    // Calls go on.
    let sum: i64 = agents[2]
        .rpc_sync("w0", "add", &(2i64, 2i64), None)
        .await
        .unwrap();
    assert_eq!(sum, 4);
    for a in agents {
        a.shutdown(tensorwire_rpc::Shutdown::Immediate)
            .await
            .unwrap();
    }
    assert_eq!(cluster.store().num_keys().await.unwrap(), 0);
}

/// A static init that a worker never joins fails by the init timeout on the others, naming
/// the missing rank, and leaves no key of the group in the store.
#[tokio::test(start_paused = true)]
async fn an_init_that_a_worker_never_joins_times_out_naming_it() {
    let cluster = Cluster::new();
    let mut tasks = Vec::new();
    for rank in 0..2 {
        let cluster = cluster.clone();
        tasks.push(tokio::spawn(async move {
            cluster.start(rank, Some(3), options()).await
        }));
    }
    for t in tasks {
        let e = t.await.unwrap().unwrap_err();
        assert!(
            matches!(&e, RpcError::Timeout { waiting_for: Some(WaitingFor::Ranks(r)), .. } if r == &[2]),
            "{e}"
        );
    }
}

/// tokio's runtime, recording every time the agent asks to be woken at and every task it
/// spawns on it.
#[derive(Debug, Default)]
struct RecordingRuntime {
    wakes: std::sync::Mutex<Vec<std::time::Instant>>,
    spawned: AtomicI64,
}

impl Runtime for RecordingRuntime {
    fn now(&self) -> std::time::Instant {
        TokioRuntime.now()
    }

    fn sleep_until(&self, at: std::time::Instant) -> tensorwire_rpc::runtime::BoxFuture {
        self.wakes.lock().unwrap().push(at);
        TokioRuntime.sleep_until(at)
    }

    fn spawn(
        &self,
        task: tensorwire_rpc::runtime::BoxFuture,
    ) -> tensorwire_rpc::runtime::BoxFuture {
        self.spawned.fetch_add(1, Ordering::SeqCst);
        TokioRuntime.spawn(task)
    }
}

/// The runtime in the options is the one the agent keeps time on: a call's deadline is a
/// wake-up asked of it (and fires in virtual time), and shutdown's last stage is spawned on it.
#[tokio::test(start_paused = true)]
async fn the_agent_keeps_time_on_the_runtime_it_was_given() {
    let runtime = Arc::new(RecordingRuntime::default());
    let injected: Arc<dyn Runtime> = runtime.clone();
    let agents: Vec<Agent> = group(2, move |rank, o| {
        if rank == 0 {
            o.runtime = Arc::clone(&injected);
        }
    })
    .await
    .into_iter()
    .map(Result::unwrap)
    .collect();
    let t0 = runtime.now();
    let e = agents[0]
        .rpc_sync::<_, u64>("w1", "sleep_ms", &60_000u64, Some(Duration::from_secs(7)))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RpcError::Call {
                source: CallError::Timeout { .. },
                ..
            }
        ),
        "{e}"
    );
    let waited = runtime.now() - t0;
    assert!(
        waited >= Duration::from_secs(7) && waited < Duration::from_secs(8),
        "{waited:?}"
    );
    assert!(
        runtime
            .wakes
            .lock()
            .unwrap()
            .contains(&(t0 + Duration::from_secs(7))),
        "the call's deadline was not a wake-up asked of the injected runtime"
    );
    assert_eq!(runtime.spawned.load(Ordering::SeqCst), 0);
    for a in agents {
        a.shutdown(tensorwire_rpc::Shutdown::Immediate)
            .await
            .unwrap();
    }
    assert_eq!(runtime.spawned.load(Ordering::SeqCst), 1);
}
