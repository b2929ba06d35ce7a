//! The tensorwire guide: how to use it, from a first call to a job on many machines.
//!
//! Every example here is compiled as a doc test; the ones that need no cluster also run (they
//! start their workers in one process, over loopback). Read in order:
//!
//! 1. [`getting_started`]: workers, typed functions, calls.
//! 2. [`device_maps`]: where tensors land.
//! 3. [`rrefs`]: values that live on another worker.
//! 4. [`process_groups`]: collectives (all_reduce, barrier, ...).
//! 5. [`security`]: who may talk to a worker, and what they may run.
//! 6. [`many_machines`]: `tensorwire launch`, or the launcher you already run.
//! 7. [`examples`]: two whole programs (`ping`, `parameter_server`) to run under
//!    `tensorwire launch`.
//!
//! Then the reference, topic by topic:
//!
//! - [`agent`]: everything the RPC agent does (calls, the call context, remote references,
//!   debugging, tensors, init, shutdown, backends, dynamic groups).
//! - [`autograd`]: distributed autograd and the `DistributedOptimizer` (feature
//!   `autograd-candle`).
//! - [`command_line`]: the `tensorwire` tool's commands.
//! - [`many_hosts`]: `tensorwire launch` across nodes, Slurm and Kubernetes, the advertised
//!   address, dead peers, chaos and soak runs.
//! - [`transports`]: TCP, QUIC and shared memory, the cluster secret, per-peer selection.
//! - [`store`]: rendezvous and the c10d-compatible store.
//! - [`collectives`]: process groups, collectives, subgroups, work handles, mismatches.
//! - [`cuda`]: the CUDA backend and NCCL process groups (feature `cuda`).
//! - [`validate`]: checking a cluster plan's device maps before launch.
//! - [`bad_input`]: what every kind of hostile input gets, and the test that checks it.
//! - [`checks`]: what `cargo xtask ci` and CI run, and the first build.
//! - [`layout`]: the crates of the workspace.
//!
//! The crate's features pick the adapters: `tcp` (default), `quic`, `shm`, `cuda`. A feature
//! removes code: without `tcp` no TCP transport is compiled in. The `tensorwire` command-line
//! tool lives in the `tensorwire-cli` crate (`cargo install --path cli`), with everything built
//! in, so that this library carries no command-line dependencies.

pub mod getting_started {
    //! # Getting started
    //!
    //! A *worker* is a process (or, in tests, a task) with a name and a rank. Workers call each
    //! other's registered functions; nothing else can run remotely. A function is described
    //! once, with its name and types, by a [`Function`](crate::rpc::Function) constant that the
    //! callee uses to serve it and the callers use to call it:
    //!
    //! ```
    //! use std::time::Duration;
    //! use tensorwire::rpc::{init_rpc, Function, Functions, RpcError, RpcOptions, Shutdown};
    //!
    //! /// Shared by every worker (in a real job: in a crate all your binaries use).
    //! const ADD: Function<(i64, i64), i64> = Function::new("add");
    //! const GREET: Function<String, String> = Function::new("greet");
    //!
    //! fn functions() -> Result<Functions, RpcError> {
    //!     let f = Functions::new();
    //!     f.serve(&ADD, |(a, b)| async move { Ok::<_, String>(a + b) })?;
    //!     f.serve(&GREET, |who| async move { Ok::<_, String>(format!("hello, {who}")) })?;
    //!     Ok(f)
    //! }
    //!
    //! #[tokio::main]
    //! async fn main() -> Result<(), RpcError> {
    //!     // Two workers in this process; a real job runs one per process and takes the
    //!     // rendezvous from the environment (`env://`, the default; see `many_machines`).
    //!     let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    //!     let mut starting = Vec::new();
    //!     for rank in 0..2usize {
    //!         let options = RpcOptions::new()
    //!             .with_functions(functions()?)
    //!             .with_init_method(format!("tcp://127.0.0.1:{port}?rank={rank}&world_size=2"))
    //!             .with_secret(b"the same secret on every worker".to_vec());
    //!         starting.push(tokio::spawn(async move {
    //!             init_rpc(&format!("worker{rank}"), rank, Some(2), options).await
    //!         }));
    //!     }
    //!     let mut agents = Vec::new();
    //!     for s in starting {
    //!         agents.push(s.await.expect("init task")?);
    //!     }
    //!
    //!     // Typed calls: the argument and result types come from the descriptor.
    //!     let sum = agents[0].call(&ADD, "worker1", &(2, 3)).await?;
    //!     assert_eq!(sum, 5);
    //!     // By rank, with a timeout, sent now and awaited later.
    //!     let hello = agents[1].call(&GREET, 0u32, &"you".to_owned())
    //!         .timeout(Duration::from_secs(5))
    //!         .send()?;
    //!     assert_eq!(hello.await?, "hello, you");
    //!
    //!     // Counters per peer (also exported through the `metrics` facade).
    //!     assert_eq!(agents[0].metrics().per_peer["worker1"].calls_sent, 1);
    //!
    //!     // A graceful shutdown waits until every worker's calls are answered.
    //!     let mut leaving = Vec::new();
    //!     for a in agents {
    //!         leaving.push(tokio::spawn(async move { a.shutdown(Shutdown::graceful(Duration::from_secs(30))).await }));
    //!     }
    //!     for l in leaving {
    //!         l.await.expect("shutdown task")?;
    //!     }
    //!     Ok(())
    //! }
    //! ```
    //!
    //! What the types buy you:
    //!
    //! - In one codebase, `agents[0].call(&ADD, "worker1", &"two")` does not compile.
    //! - Across binaries, each typed call carries a fingerprint of its types (their
    //!   `std::any::type_name`s and a hash). A callee that serves `add` with other types refuses
    //!   the call before decoding anything, naming the function and both signatures, instead of
    //!   decoding garbage (postcard, the encoding, is not self-describing).
    //! - Registering a name twice is an error ([`RpcError::FunctionRegistered`](crate::rpc::RpcError::FunctionRegistered)).
    //!
    //! When names are chosen at run time, the dynamic form remains:
    //! [`Functions::register`](crate::rpc::Functions::register) and
    //! [`Agent::rpc_sync`](crate::rpc::Agent::rpc_sync) by name, without the fingerprint. A
    //! function that needs to know its caller or make nested calls gets a
    //! [`CallContext`](crate::rpc::CallContext) with
    //! [`Functions::serve_with_context`](crate::rpc::Functions::serve_with_context).
    //!
    //! Errors come back typed: [`RpcError::remote`](crate::rpc::RpcError::remote) gives the
    //! callee's [`RemoteError`](crate::rpc::RemoteError) (a failed or panicking function, bad
    //! arguments), [`RpcError::is_timeout`](crate::rpc::RpcError::is_timeout) tells a timeout.
}

pub mod device_maps {
    //! # Device maps
    //!
    //! A [`Tensor`](crate::core::tensor::Tensor) in the arguments or the result of a call travels
    //! beside the message as raw bytes. A *device map* says, per destination, on which device a
    //! tensor from each of this worker's devices lands: `cuda:0 -> cuda:1` for worker `ps`.
    //! Results come back by the reverse map. A tensor on a device with no entry fails before
    //! anything is sent, naming the destination and the device. All workers check everyone's
    //! maps at init with PyTorch's rules, so a bad map fails init everywhere with the same error
    //! (`tensorwire validate PLAN.json` runs the same checks before a launch).
    //!
    //! Devices come from a [`DeviceBackend`](crate::core::ports::device::DeviceBackend): CUDA
    //! with the feature `cuda`, or the simulated backend, host memory posing as GPUs, which this
    //! example uses:
    //!
    //! ```
    //! use std::sync::Arc;
    //! use std::time::Duration;
    //! use tensorwire::core::device::Device;
    //! use tensorwire::core::devices_sim::SimulatedDevices;
    //! use tensorwire::core::ports::device::relocate;
    //! use tensorwire::core::tensor::Tensor;
    //! use tensorwire::rpc::{init_rpc, Function, Functions, RpcOptions, Shutdown};
    //!
    //! /// Where did the tensor land?
    //! const WHERE: Function<Tensor, String> = Function::new("where");
    //!
    //! #[tokio::main]
    //! async fn main() -> Result<(), Box<dyn std::error::Error>> {
    //!     let gpus = Arc::new(SimulatedDevices::new(2));
    //!     let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    //!     let mut starting = Vec::new();
    //!     for (rank, name) in ["trainer", "ps"].into_iter().enumerate() {
    //!         let functions = Functions::new();
    //!         functions.serve(&WHERE, |t: Tensor| async move { Ok::<_, String>(t.device().to_string()) })?;
    //!         let mut options = RpcOptions::new()
    //!             .with_functions(functions)
    //!             .with_device_backend(gpus.clone())
    //!             .with_init_method(format!("tcp://127.0.0.1:{port}?rank={rank}&world_size=2"))
    //!             .with_secret(b"device maps".to_vec());
    //!         if name == "trainer" {
    //!             // The trainer's cuda:0 tensors land on the parameter server's cuda:1.
    //!             options = options.with_device_map("ps", &[("cuda:0", "cuda:1")])?;
    //!         } else {
    //!             options = options.with_devices(vec![Device::Cuda(1)]);
    //!         }
    //!         starting.push(tokio::spawn(init_rpc(name, rank, Some(2), options)));
    //!     }
    //!     let mut agents = Vec::new();
    //!     for s in starting {
    //!         agents.push(s.await??);
    //!     }
    //!     let grad = relocate(&*gpus, &Tensor::from_f32(vec![4], &[1.0; 4])?, Device::Cuda(0)).await?;
    //!     assert_eq!(agents[0].call(&WHERE, "ps", &grad).await?, "cuda:1");
    //!
    //!     let mut leaving = Vec::new();
    //!     for a in agents {
    //!         leaving.push(tokio::spawn(async move { a.shutdown(Shutdown::graceful(Duration::from_secs(30))).await }));
    //!     }
    //!     for l in leaving {
    //!         l.await??;
    //!     }
    //!     Ok(())
    //! }
    //! ```
    //!
    //! [`RpcOptions::set_device_map`](crate::rpc::RpcOptions::set_device_map) (and the builder
    //! step `with_device_map`) add entries incrementally, as PyTorch's `set_device_map`: a map
    //! must be one-to-one, and an entry that changes an earlier one is refused.
}

pub mod rrefs {
    //! # Remote references
    //!
    //! A value can live on another worker and be used from here through an
    //! [`RRef`](crate::rpc::RRef): `call(...).remote()` runs a function on the callee and keeps
    //! its result there, returning the reference at once. [`Method`](crate::rpc::Method)s run on
    //! the owner, on the value itself, so state kept there (a parameter server's weights) is
    //! shared by every call. The value's type is part of the reference's type, so a method of
    //! another type does not compile.
    //!
    //! ```no_run
    //! use std::sync::{Arc, Mutex};
    //! use tensorwire::rpc::{Agent, Function, Functions, Method, RRef, RpcError};
    //!
    //! #[derive(serde::Serialize)]
    //! struct Server {
    //!     weights: Mutex<Vec<f64>>,
    //! }
    //!
    //! const NEW_SERVER: Function<usize, Server> = Function::new("new_server");
    //! const WEIGHTS: Method<Server, (), Vec<f64>> = Method::new("weights");
    //! const UPDATE: Method<Server, Vec<f64>, ()> = Method::new("update");
    //!
    //! fn functions() -> Result<Functions, RpcError> {
    //!     let f = Functions::new();
    //!     f.serve(&NEW_SERVER, |dim| async move {
    //!         Ok::<_, String>(Server { weights: Mutex::new(vec![0.0; dim]) })
    //!     })?;
    //!     f.serve_method(&WEIGHTS, |s: Arc<Server>, ()| async move {
    //!         Ok::<_, String>(s.weights.lock().map_err(|e| e.to_string())?.clone())
    //!     })?;
    //!     f.serve_method(&UPDATE, |s: Arc<Server>, grad| async move {
    //!         let mut w = s.weights.lock().map_err(|e| e.to_string())?;
    //!         w.iter_mut().zip(&grad).for_each(|(w, g)| *w -= 0.1 * g);
    //!         Ok::<_, String>(())
    //!     })?;
    //!     Ok(f)
    //! }
    //!
    //! async fn train(agent: &Agent) -> Result<(), RpcError> {
    //!     let server: RRef<Server> = agent.call(&NEW_SERVER, "ps", &4).remote()?;
    //!     let w = server.call(&WEIGHTS, &()).await?;
    //!     let grad: Vec<f64> = w.iter().map(|w| w - 1.0).collect();
    //!     server.call(&UPDATE, &grad).await?;
    //!     // A reference can be passed in arguments: the callee gets its own fork of it.
    //!     // `server.to_here(None)` would copy the value here (it must be Deserialize).
    //!     Ok(())
    //! }
    //! ```
    //!
    //! The owner frees the value when the last reference anywhere is dropped. A function runs
    //! only once every reference in its arguments is confirmed by its owner. A `remote` whose
    //! creation fails or times out makes later uses of the reference fail with
    //! [`RpcError::RRefCreation`](crate::rpc::RpcError::RRefCreation), naming the reference and
    //! its owner. [`Agent::local_rref`](crate::rpc::Agent::local_rref) makes a reference to a
    //! value this worker holds; [`Agent::debug_info`](crate::rpc::Agent::debug_info) lists what
    //! is held and pending.
}

pub mod process_groups {
    //! # Process groups
    //!
    //! Collectives (`barrier`, `all_reduce`, `all_gather`, `broadcast`, `reduce_scatter`,
    //! `all_to_all`, point-to-point `send`/`recv`) follow `torch.distributed`. Each runs a
    //! schedule that the pure core checked in a simulator, over the transport's connections, in a
    //! `collective` tracing span (group, signature, sequence number, rank, bytes).
    //!
    //! In a job, [`new_group`](crate::process_group::new_group) does the `env://` rendezvous and
    //! starts the named backend (`tensorwire`, alias `gloo`, over TCP; `nccl` with the feature
    //! `cuda`):
    //!
    //! ```no_run
    //! use std::time::Duration;
    //! use tensorwire::core::{collective::ReduceOp, device::Device};
    //! use tensorwire::process_group::{new_group, Collectives, CollectivesExt};
    //!
    //! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    //! // MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and TENSORWIRE_SECRET from the launcher.
    //! let pg = new_group("tensorwire", Duration::from_secs(60), Device::Cpu, Vec::new()).await?;
    //! let mut grads = vec![1.0f32; 1024];
    //! pg.all_reduce_typed(&mut grads, ReduceOp::Avg).await?;
    //! let names: Vec<String> = pg.all_gather_object(&format!("rank{}", pg.rank())).await?;
    //! pg.barrier().await?;
    //! pg.shutdown().await; // leave cleanly, so peers do not see a dead rank
    //! # Ok(()) }
    //! ```
    //!
    //! Underneath, a [`Group`](crate::process_group::Group) is a store plus any
    //! [`Transport`](crate::core::ports::transport::Transport): here two ranks in one process,
    //! meeting through an in-memory store, over TCP:
    //!
    //! ```
    //! use std::sync::Arc;
    //! use tensorwire::core::collective::ReduceOp;
    //! use tensorwire::core::ports::process_group::ProcessGroup;
    //! use tensorwire::process_group::{ClusterSecret, CollectivesExt, Group, GroupOptions, InMemoryStore};
    //! use tensorwire::transport_tcp::{TcpConfig, TcpTransport};
    //!
    //! #[tokio::main]
    //! async fn main() -> Result<(), Box<dyn std::error::Error>> {
    //!     let store = Arc::new(InMemoryStore::new());
    //!     let mut ranks = Vec::new();
    //!     for rank in 0..2 {
    //!         let secret = ClusterSecret::new(b"collectives".to_vec())?;
    //!         let transport = Arc::new(TcpTransport::new(TcpConfig::new(secret))?);
    //!         let store = store.clone();
    //!         ranks.push(tokio::spawn(async move {
    //!             let group = Group::connect(store, transport, rank, 2, GroupOptions::new("guide")).await?;
    //!             let mut xs = [rank as f32 + 1.0; 3];
    //!             group.all_reduce_typed(&mut xs, ReduceOp::Sum).await?;
    //!             group.shutdown().await;
    //!             Ok::<_, tensorwire::core::ports::process_group::ProcessGroupError>(xs)
    //!         }));
    //!     }
    //!     for r in ranks {
    //!         assert_eq!(r.await??, [3.0; 3]);
    //!     }
    //!     Ok(())
    //! }
    //! ```
    //!
    //! [`register_backend`](crate::process_group::register_backend) adds a backend of your
    //! own (a factory that builds a group from the store, for example over another transport).
}

pub mod security {
    //! # The security model
    //!
    //! - **Only registered functions run.** A call names a function; a worker runs it only if
    //!   it was registered in its [`Functions`](crate::rpc::Functions). There is no remote code,
    //!   no pickling: arguments are plain data (serde, postcard), decoded exactly (a byte left
    //!   over is an error), and typed functions check a type fingerprint before decoding.
    //! - **Every connection is authenticated before a message is read.** With TCP (and the
    //!   shared-memory transport) each side proves it knows the cluster secret with an
    //!   HMAC-SHA256 challenge-response; the rendezvous store requires the same secret. Set
    //!   `TENSORWIRE_SECRET` to the same value on every worker (`tensorwire launch` does it), or
    //!   pass [`RpcOptions::with_secret`](crate::rpc::RpcOptions::with_secret). Without a secret,
    //!   init fails and says so. TCP authenticates but does not encrypt.
    //! - **QUIC encrypts.** The `QUIC` backend (feature `quic`) runs mutual TLS under a
    //!   cluster CA: each worker's certificate is issued for its name, and peers verify it.
    //!   Point [`RpcOptions::with_tls_dir`](crate::rpc::RpcOptions::with_tls_dir) at a folder with
    //!   the CA (generated by the first worker if absent) or with your own PKI's files. Keep the
    //!   CA key off machines that need only their own certificate.
    //! - **What each credential proves.** A cluster secret proves membership, nothing more:
    //!   every member holds the same secret, so any member may claim any rank when a group is
    //!   set up and any worker name (a rank claimed twice fails the setup, naming both
    //!   addresses, but an impostor that arrives first can still block it). Per-worker
    //!   certificates prove a name: with QUIC and a certificate per worker issued by a CA whose
    //!   key no worker holds (your PKI's `<name>.pem` and `<name>.key.pem` in the TLS folder),
    //!   the agent believes a worker name only from a peer whose certificate is issued for it,
    //!   so a compromised worker cannot act as another. With the CA key in the shared folder
    //!   (the default, generated by the first worker) every worker can issue itself any name:
    //!   membership only, as with a secret. Per-rank certificates prove a rank: with
    //!   `tensorwire launch --quic-certs CA_DIR` each worker gets a certificate for `rank-N`
    //!   from a CA only the launcher reads, the mesh refuses a hello whose rank is not its
    //!   certificate's (`ProcessGroupError::RankNotCertified`, naming both; the setup goes on
    //!   for the real rank), and the agent takes each rank-certified peer's own record, whatever
    //!   name it chose. A compromised worker can then impersonate nobody. See
    //!   [transports](crate::guide::transports) for the table of what holds under each
    //!   credential, and the bad-input table's rows for what each check refuses.
    //! - **Insecure is explicit.** [`RpcOptions::insecure`](crate::rpc::RpcOptions::insecure)
    //!   (or `tensorwire launch --insecure`) turns authentication off and logs a warning; anyone
    //!   who reaches the ports can then call registered functions. Only on a trusted network or
    //!   in tests.
    //! - **Bad input is refused, not trusted.** A peer that sends malformed frames, forged
    //!   message ids or unknown references gets a typed error or is disconnected; one bad
    //!   connection never takes the worker down.
    //!
    //! ```no_run
    //! use tensorwire::rpc::{init_rpc, Functions, RpcOptions};
    //!
    //! # async fn run() -> Result<(), tensorwire::rpc::RpcError> {
    //! // Encrypted and mutually authenticated (features `quic`): the CA lives in /shared/tw-ca.
    //! let options = RpcOptions::new()
    //!     .with_functions(Functions::new())
    //!     .with_backend("QUIC")
    //!     .with_tls_dir("/shared/tw-ca");
    //! let agent = init_rpc("worker0", 0, Some(2), options).await?;
    //! # Ok(()) }
    //! ```
}

pub mod many_machines {
    //! # Running on many machines
    //!
    //! Workers meet through a rendezvous store hosted by rank 0, found from the environment
    //! (`env://`, the default `init_method`): `MASTER_ADDR`, `MASTER_PORT`, `RANK`,
    //! `WORLD_SIZE`, and `TENSORWIRE_SECRET` for the secret.
    //!
    //! ## With `tensorwire launch`
    //!
    //! The `tensorwire` tool (crate `tensorwire-cli`) is a torchrun-style launcher: run one per
    //! node with the same `--nnodes`, `--master-addr`, `--master-port` and secret file, and that
    //! node's `--node-rank`:
    //!
    //! ```sh
    //! tensorwire launch --nnodes 3 --node-rank R --nproc-per-node 2 \
    //!     --master-addr 10.0.0.1 --master-port 29500 --secret-file /shared/tw-secret -- ./my-worker
    //! ```
    //!
    //! Each worker gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
    //! `MASTER_ADDR`, `MASTER_PORT` and `TENSORWIRE_SECRET`. When one worker fails, every
    //! launcher stops its workers and exits with that worker's code, naming it. On one machine,
    //! `tensorwire launch --nproc 4 -- ./my-worker` is enough.
    //!
    //! ## With your own launcher
    //!
    //! torchrun, PyTorchJob and Slurm set what `env://` reads (Slurm's `SLURM_PROCID`,
    //! `SLURM_NTASKS`, `SLURM_JOB_NODELIST`, ... when the torch variables are absent).
    //! [`DistEnv::from_env`](crate::process_group::DistEnv::from_env) reads the rank and world
    //! size the same way:
    //!
    //! ```no_run
    //! use tensorwire::process_group::DistEnv;
    //! use tensorwire::rpc::{init_rpc, Functions, RpcOptions, Shutdown};
    //!
    //! #[tokio::main]
    //! async fn main() -> Result<(), Box<dyn std::error::Error>> {
    //!     let env = DistEnv::from_env()?; // rank, world_size, local_rank, master address
    //!     let options = RpcOptions::new().with_functions(Functions::new());
    //!     let agent = init_rpc(&format!("worker{}", env.rank), env.rank, Some(env.world_size), options).await?;
    //!     // ... calls ...
    //!     agent.shutdown(Shutdown::graceful(std::time::Duration::from_secs(60))).await?;
    //!     Ok(())
    //! }
    //! ```
    //!
    //! Or pass the rendezvous explicitly, with no environment at all:
    //!
    //! ```no_run
    //! use tensorwire::rpc::{init_rpc, Functions, RpcOptions};
    //!
    //! # async fn run(rank: usize) -> Result<(), tensorwire::rpc::RpcError> {
    //! let options = RpcOptions::new()
    //!     .with_functions(Functions::new())
    //!     .with_init_method(format!("tcp://10.0.0.1:29500?rank={rank}&world_size=6"))
    //!     .with_secret(std::fs::read("/shared/tw-secret").expect("the secret file"));
    //! let agent = init_rpc(&format!("worker{rank}"), rank, Some(6), options).await?;
    //! # Ok(()) }
    //! ```
    //!
    //! Workers advertise the address that routes to `MASTER_ADDR`; set `TENSORWIRE_IFNAME`
    //! (`ib0`) to pick an interface, or [`RpcOptions::with_listen_ip`](crate::rpc::RpcOptions::with_listen_ip).
    //! A loopback address in a group that spans hosts is refused at init, naming the worker.
    //! Workers may also join and leave while a group runs: `init_rpc(name, rank, None, ...)`
    //! starts a dynamic group (rank 0 hosts the store and stays).
}

pub mod examples {
    //! # Examples
    //!
    //! Whole programs, shipped in this crate's `examples/` folder. Each is one worker; start
    //! several with `tensorwire launch`, which sets `RANK`, `WORLD_SIZE` and the rest:
    //!
    //! ```sh
    //! cargo build --release -p tensorwire-cli --example ping
    //! tensorwire launch --nproc 2 -- target/release/examples/ping
    //! ```
    //!
    //! Started alone, without `RANK`, each exits with code 1 and a message naming the variable.
    //! A third, `dist_autograd` (a model split over three processes), lives in `tensorwire-cli`
    //! beside the `tensorwire demo autograd` it shares its code with.
    //!
    //! ## `ping`: typed calls and their round trip
    //!
    #![doc = concat!("```no_run\n", include_str!("../examples/ping.rs"), "```")]
    //!
    //! ## `parameter_server`: state behind a remote reference
    //!
    #![doc = concat!("```no_run\n", include_str!("../examples/parameter_server.rs"), "```")]
}

#[doc = include_str!("guide/agent.md")]
pub mod agent {}

#[doc = include_str!("guide/autograd.md")]
pub mod autograd {}

#[doc = include_str!("guide/command_line.md")]
pub mod command_line {}

#[doc = include_str!("guide/many_hosts.md")]
pub mod many_hosts {}

#[doc = include_str!("guide/transports.md")]
pub mod transports {}

#[doc = include_str!("guide/store.md")]
pub mod store {}

#[doc = include_str!("guide/collectives.md")]
pub mod collectives {}

#[doc = include_str!("guide/cuda.md")]
pub mod cuda {}

#[doc = include_str!("guide/validate.md")]
pub mod validate {}

#[doc = include_str!("guide/bad_input.md")]
pub mod bad_input {}

#[doc = include_str!("guide/checks.md")]
pub mod checks {}

// Kept last, as it was in the README, so that edits to the table merge easily.
#[doc = include_str!("guide/layout.md")]
pub mod layout {}
