//! Process-group backends with `torch.distributed._dist2` semantics.
//!
//! - [`register_backend`]: names a [`ProcessGroupFactory`]; a name registered twice is an
//!   error (`Backend NAME already registered`). The built-in backend over our transports is
//!   registered as `tensorwire`, and as `gloo` so that code written for PyTorch's CPU backend
//!   finds it. With the feature `nccl`, [`NcclFactory`](crate::nccl::NcclFactory) is
//!   registered as `nccl`.
//! - [`new_group`]: `env://` rendezvous, then the named backend's factory with the store, the
//!   rank, the world size, the timeout, the device and the options.
//! - [`current_process_group`] and [`with_process_group`]: the group in scope. Async code uses
//!   a tokio task-local (the scope follows the future, whatever thread polls it);
//!   [`with_process_group_sync`] sets a thread-local for blocking code. Both restore the
//!   previous group when the scope ends, also on panic.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use tensorwire_core::device::Device;
//! use tensorwire_process_group::{current_process_group, new_group, with_process_group, Collectives};
//!
//! // MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (and TENSORWIRE_SECRET) set by the launcher.
//! let pg = new_group("tensorwire", Duration::from_secs(60), Device::Cpu, Vec::new()).await?;
//! with_process_group(pg.clone(), async {
//!     let pg = current_process_group().expect("in scope");
//!     pg.barrier().await
//! })
//! .await?;
//! // Leave cleanly before exiting, so peers still in a collective do not see a dead rank.
//! pg.shutdown().await;
//! # Ok(()) }
//! ```

use std::cell::RefCell;
#[cfg(feature = "tcp")]
use std::net::{IpAddr, SocketAddr};
#[cfg(feature = "tcp")]
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;

#[cfg(any(feature = "tcp", test))]
use async_trait::async_trait;
use tensorwire_core::device::Device;
use tensorwire_core::ports::process_group::{ProcessGroup, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_core::registry::{ProcessGroupFactory, Registry, RegistryError, RegistryKind};
#[cfg(feature = "tcp")]
use tensorwire_transport_tcp::TcpConfig;

#[cfg(feature = "tcp")]
use crate::group::{Group, GroupOptions};
#[cfg(feature = "tcp")]
use tensorwire_rendezvous::advertise_ip;
use tensorwire_rendezvous::env_init::env_rendezvous;
use tensorwire_rendezvous::RendezvousError;

/// Backend options: PyTorch's `**kwargs`, as name/value pairs.
pub type BackendOptions = Vec<(String, String)>;

/// A process-group factory as [`new_group`] calls it.
pub type DynFactory = dyn ProcessGroupFactory<
    Store = Arc<dyn Store>,
    Group = Arc<dyn ProcessGroup>,
    Options = BackendOptions,
    Error = ProcessGroupError,
>;

/// The built-in backend's name (registered with the feature `tcp`, on by default).
pub const TENSORWIRE_BACKEND: &str = "tensorwire";

static BACKENDS: LazyLock<RwLock<Registry<DynFactory>>> = LazyLock::new(|| {
    #[allow(unused_mut)] // without `tcp` and `nccl` nothing is built in
    let mut registry = Registry::new(RegistryKind::ProcessGroup);
    #[cfg(feature = "tcp")]
    {
        let builtin: Arc<DynFactory> = Arc::new(TensorwireFactory);
        registry
            .register(TENSORWIRE_BACKEND, builtin.clone())
            .expect("empty registry");
        registry.register("gloo", builtin).expect("distinct names");
    }
    #[cfg(feature = "nccl")]
    registry
        .register(
            tensorwire_devices_cuda::nccl_group::NCCL_BACKEND,
            Arc::new(tensorwire_devices_cuda::nccl_group::NcclFactory::new()),
        )
        .expect("distinct names");
    RwLock::new(registry)
});

/// Registers a process-group backend under `name`.
///
/// # Errors
/// [`RegistryError::AlreadyRegistered`] (`Backend NAME already registered`) when the name is
/// taken.
pub fn register_backend(name: &str, factory: Arc<DynFactory>) -> Result<(), RegistryError> {
    BACKENDS
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .register(name, factory)
}

/// Whether a backend is registered under `name`.
pub fn backend_registered(name: &str) -> bool {
    BACKENDS
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .is_registered(name)
}

/// Why [`new_group`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NewGroupError {
    /// The backend is not registered.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The `env://` rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// The backend's factory failed.
    #[error(transparent)]
    Backend(#[from] ProcessGroupError),
}

/// Creates a process group with the named backend: `env://` rendezvous (bounded by
/// `timeout`), then the backend's factory. The group is not installed anywhere; use
/// [`with_process_group`] to make it current.
///
/// # Errors
/// [`NewGroupError`]: an unknown backend (checked first, as PyTorch does), a failed
/// rendezvous, or the factory's error.
pub async fn new_group(
    backend: &str,
    timeout: Duration,
    device: Device,
    options: BackendOptions,
) -> Result<Arc<dyn ProcessGroup>, NewGroupError> {
    let factory = BACKENDS
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(backend)?;
    let rv = env_rendezvous(timeout).await?;
    Ok(factory
        .create(rv.store, rv.rank, rv.world_size, timeout, device, options)
        .await?)
}

/// The built-in backend: a [`Group`] over the TCP transport.
///
/// Options: `group_name` (default: `tw<n>` for the n-th group this process creates, so all
/// ranks must create their groups in the same order), `listen_ip` (default: the address of
/// `TENSORWIRE_IFNAME`, else the local address the route to `MASTER_ADDR` leaves from, else
/// 127.0.0.1; see [`tensorwire_rendezvous::address`]), `insecure=true` (run the transport
/// without `TENSORWIRE_SECRET`), `collectives` (`arena`, the default when every rank is on
/// one host, or `links`: see [`GroupOptions::collectives`](crate::GroupOptions::collectives)),
/// `arena_bytes` (see [`GroupOptions::arena_bytes`](crate::GroupOptions::arena_bytes)). Any
/// other option is refused. Only `cpu` is supported: the
/// collectives work on host bytes. Feature `tcp` (on by default); without it, register a
/// factory that passes another transport to [`Group::connect`](crate::Group::connect).
#[cfg(feature = "tcp")]
#[derive(Debug, Clone, Copy, Default)]
pub struct TensorwireFactory;

#[cfg(feature = "tcp")]
static GROUP_COUNTER: AtomicU64 = AtomicU64::new(0);

#[cfg(feature = "tcp")]
#[async_trait]
impl ProcessGroupFactory for TensorwireFactory {
    type Store = Arc<dyn Store>;
    type Group = Arc<dyn ProcessGroup>;
    type Options = BackendOptions;
    type Error = ProcessGroupError;

    async fn create(
        &self,
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        device: Device,
        options: BackendOptions,
    ) -> Result<Arc<dyn ProcessGroup>, ProcessGroupError> {
        if device != Device::Cpu {
            return Err(ProcessGroupError::Setup {
                rank,
                reason: format!(
                    "the tensorwire backend works on host memory; device {device} is not supported"
                ),
            });
        }
        let group = TensorwireFactory::connect(store, rank, world_size, timeout, options).await?;
        Ok(Arc::new(group))
    }
}

#[cfg(feature = "tcp")]
impl TensorwireFactory {
    /// What [`create`](ProcessGroupFactory::create) does for `cpu`, returning the [`Group`]
    /// itself (for front ends that issue work on it, such as the Python package's c10d
    /// backend). Options as for the factory, plus `debug` (`off`, `info` or `detail`: the
    /// agreement check's level, instead of `TENSORWIRE_DEBUG`).
    ///
    /// # Errors
    /// [`ProcessGroupError::Setup`] for a bad option, address or secret, and whatever
    /// [`Group::connect`] returns.
    pub async fn connect(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        options: BackendOptions,
    ) -> Result<Group, ProcessGroupError> {
        let setup = |reason: String| ProcessGroupError::Setup { rank, reason };
        let bad = |key: &str, value: &str, expected| ProcessGroupError::BadOption {
            rank,
            key: key.to_owned(),
            value: value.to_owned(),
            expected,
        };
        let transport = |source| ProcessGroupError::SetupTransport {
            rank,
            doing: "configuring the transport",
            source: Box::new(source),
        };
        let mut name = None;
        let mut listen_ip = None;
        let mut insecure = false;
        let mut debug = None;
        let mut collectives = None;
        let mut arena_bytes = None;
        for (key, value) in options {
            match key.as_str() {
                "collectives" => {
                    collectives = Some(
                        crate::CollectivePath::parse(&value)
                            .ok_or_else(|| bad(&key, &value, crate::group::PATHS))?,
                    )
                }
                "arena_bytes" => {
                    arena_bytes = Some(
                        value
                            .trim()
                            .parse::<usize>()
                            .map_err(|_| bad(&key, &value, "a size in bytes"))?,
                    )
                }
                "group_name" => name = Some(value),
                "listen_ip" => {
                    listen_ip = Some(
                        value
                            .parse::<IpAddr>()
                            .map_err(|_| bad(&key, &value, "an IP address"))?,
                    )
                }
                "insecure" => insecure = value == "true" || value == "1",
                "debug" => {
                    debug = Some(
                        tensorwire_core::collective::DebugLevel::parse(&value)
                            .map_err(|_| bad(&key, &value, "off, info or detail"))?,
                    )
                }
                _ => {
                    return Err(bad(
                        &key,
                        &value,
                        "no such option (known: group_name, listen_ip, insecure, debug, \
                         collectives, arena_bytes)",
                    ))
                }
            }
        }
        let name =
            name.unwrap_or_else(|| format!("tw{}", GROUP_COUNTER.fetch_add(1, Ordering::Relaxed)));
        let ip = advertise_ip(listen_ip).map_err(|e| setup(e.to_string()))?;
        let config = TcpConfig::resolve(None, insecure).map_err(transport)?;
        // Shared memory for ranks on this host, TCP for the others (TENSORWIRE_TRANSPORT).
        #[cfg(target_os = "linux")]
        let transport = Arc::new(
            tensorwire_transport_shm::SelectingTransport::from_tcp_config(config)
                .map_err(transport)?,
        );
        #[cfg(not(target_os = "linux"))]
        let transport =
            Arc::new(tensorwire_transport_tcp::TcpTransport::new(config).map_err(transport)?);
        let mut options = GroupOptions::new(name)
            .with_timeout(timeout)
            .with_listen(SocketAddr::new(ip, 0));
        if let Some(debug) = debug {
            options = options.with_debug(debug);
        }
        if let Some(path) = collectives {
            options = options.with_collectives(path);
        }
        if let Some(bytes) = arena_bytes {
            options = options.with_arena_bytes(bytes);
        }
        Group::connect(store, transport, rank, world_size, options).await
    }
}

tokio::task_local! {
    static CURRENT: Arc<dyn ProcessGroup>;
}

thread_local! {
    static THREAD_CURRENT: RefCell<Option<Arc<dyn ProcessGroup>>> = const { RefCell::new(None) };
}

/// The process group in scope: the innermost [`with_process_group`] of the running task, else
/// the innermost [`with_process_group_sync`] of this thread, else `None`.
pub fn current_process_group() -> Option<Arc<dyn ProcessGroup>> {
    CURRENT
        .try_with(Arc::clone)
        .ok()
        .or_else(|| THREAD_CURRENT.with(|c| c.borrow().clone()))
}

/// Runs `fut` with `pg` as the current process group; the previous one is current again once
/// `fut` completes (or is dropped).
pub async fn with_process_group<F: std::future::Future>(
    pg: Arc<dyn ProcessGroup>,
    fut: F,
) -> F::Output {
    CURRENT.scope(pg, fut).await
}

/// Runs `f` with `pg` as this thread's current process group, restoring the previous one
/// afterwards, also when `f` panics.
pub fn with_process_group_sync<R>(pg: Arc<dyn ProcessGroup>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Arc<dyn ProcessGroup>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            THREAD_CURRENT.with(|c| *c.borrow_mut() = previous);
        }
    }
    let previous = THREAD_CURRENT.with(|c| c.borrow_mut().replace(pg));
    let _restore = Restore(previous);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tensorwire_core::ports::process_group::compose::compose;
    use tensorwire_core::ports::process_group::Collectives;
    use tensorwire_core::ports::process_group::{lazy, Done, Op, Started};

    /// A group of one that only knows its rank, for scope tests.
    struct Fake(usize);

    impl ProcessGroup for Fake {
        fn rank(&self) -> usize {
            self.0
        }
        fn size(&self) -> usize {
            1
        }
        fn start<'a>(&'a self, op: Op<'a>) -> Started<'a> {
            // One rank: every collective gives this rank's data back.
            lazy(Box::pin(async move {
                match op {
                    Op::Barrier => Ok(Done::Unit),
                    Op::AllGather { input, .. } => {
                        Ok(Done::from(vec![input.into_bytes("all_gather", self)?]))
                    }
                    Op::Broadcast { data, .. } | Op::AllReduce { data, .. } => {
                        Ok(data.into_host_mut("all_reduce", self)?.done())
                    }
                    op => compose(self, op).await,
                }
            }))
        }
    }

    struct FakeFactory;

    #[async_trait]
    impl ProcessGroupFactory for FakeFactory {
        type Store = Arc<dyn Store>;
        type Group = Arc<dyn ProcessGroup>;
        type Options = BackendOptions;
        type Error = ProcessGroupError;
        async fn create(
            &self,
            _: Arc<dyn Store>,
            rank: usize,
            _: usize,
            _: Duration,
            _: Device,
            _: BackendOptions,
        ) -> Result<Arc<dyn ProcessGroup>, ProcessGroupError> {
            Ok(Arc::new(Fake(rank)))
        }
    }

    fn rank_of_current() -> Option<usize> {
        current_process_group().map(|pg| pg.rank())
    }

    #[test]
    fn builtin_backends_are_registered_and_names_are_taken_once() {
        assert!(backend_registered("tensorwire"));
        assert!(backend_registered("gloo"));
        assert_eq!(backend_registered("nccl"), cfg!(feature = "nccl"));
        register_backend("fake-once", Arc::new(FakeFactory)).unwrap();
        let err = register_backend("fake-once", Arc::new(FakeFactory)).unwrap_err();
        assert_eq!(err.to_string(), "Backend fake-once already registered");
        let err = register_backend("tensorwire", Arc::new(FakeFactory)).unwrap_err();
        assert_eq!(err.to_string(), "Backend tensorwire already registered");
    }

    #[tokio::test]
    async fn an_unknown_backend_is_refused_before_the_rendezvous() {
        let err = new_group("nccl-ish", Duration::from_secs(1), Device::Cpu, Vec::new())
            .await
            .err()
            .expect("unknown backend");
        assert!(
            err.to_string()
                .starts_with("Backend nccl-ish not registered"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn the_builtin_factory_refuses_unknown_options_and_devices() {
        let store: Arc<dyn Store> = Arc::new(crate::InMemoryStore::new());
        let options = vec![("bogus".to_owned(), "1".to_owned())];
        let err = TensorwireFactory
            .create(
                store.clone(),
                0,
                1,
                Duration::from_secs(1),
                Device::Cpu,
                options,
            )
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&err, ProcessGroupError::BadOption { key, .. } if key == "bogus"),
            "{err}"
        );
        let err = TensorwireFactory
            .create(
                store.clone(),
                0,
                1,
                Duration::from_secs(1),
                Device::Cuda(0),
                Vec::new(),
            )
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("cuda:0"), "{err}");
        // A group of one works without any peer.
        let options = vec![("insecure".to_owned(), "true".to_owned())];
        let pg = TensorwireFactory
            .create(store, 0, 1, Duration::from_secs(5), Device::Cpu, options)
            .await
            .unwrap();
        pg.barrier().await.unwrap();
        assert_eq!(
            pg.all_gather(b"x").await.unwrap(),
            [Bytes::from_static(b"x")]
        );
    }

    #[tokio::test]
    async fn task_scopes_nest_and_restore() {
        assert_eq!(rank_of_current(), None);
        let outer: Arc<dyn ProcessGroup> = Arc::new(Fake(1));
        let inner: Arc<dyn ProcessGroup> = Arc::new(Fake(2));
        with_process_group(outer, async {
            assert_eq!(rank_of_current(), Some(1));
            with_process_group(inner, async {
                tokio::task::yield_now().await;
                assert_eq!(rank_of_current(), Some(2));
            })
            .await;
            assert_eq!(rank_of_current(), Some(1));
            // A spawned task does not inherit the scope: it is a different task.
            let seen = tokio::spawn(async { rank_of_current() }).await.unwrap();
            assert_eq!(seen, None);
        })
        .await;
        assert_eq!(rank_of_current(), None);
    }

    #[test]
    fn thread_scopes_restore_even_on_panic() {
        let a: Arc<dyn ProcessGroup> = Arc::new(Fake(5));
        let b: Arc<dyn ProcessGroup> = Arc::new(Fake(6));
        with_process_group_sync(a, || {
            assert_eq!(rank_of_current(), Some(5));
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                with_process_group_sync(b, || {
                    assert_eq!(rank_of_current(), Some(6));
                    panic!("boom");
                })
            }));
            assert!(caught.is_err());
            assert_eq!(rank_of_current(), Some(5));
        });
        assert_eq!(rank_of_current(), None);
    }
}
