//! Named registries: RPC backends and process-group factories.
//!
//! PyTorch keeps two such tables. `torch.distributed.rpc.backend_registry` maps a backend name
//! (`TENSORPIPE`, or one a user registers) to two hooks: one that constructs the backend's
//! options, one that starts the agent. `torch.distributed._dist2` maps a process-group backend
//! name (`gloo`, `nccl`, ...) to a factory `(store, rank, world_size, timeout, device, options)`.
//! In both, registering a name twice is an error.
//!
//! Here both are a [`Registry`] of trait objects: [`RpcBackend`] for RPC backends and
//! [`ProcessGroupFactory`] for process groups. The traits are generic over the store, agent,
//! group and options types through associated types, so the adapters (which own those types)
//! pick them, while the registry semantics live once, here.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tensorwire_core::registry::{Registry, RegistryKind, RegistryError};
//!
//! let mut reg: Registry<str> = Registry::new(RegistryKind::RpcBackend);
//! reg.register("TCP", Arc::from("tcp backend")).unwrap();
//! assert!(reg.is_registered("TCP"));
//! let err = reg.register("TCP", Arc::from("again")).unwrap_err();
//! assert_eq!(err.to_string(), "RPC backend TCP: already registered");
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use indexmap::IndexMap;

use crate::device::Device;

/// Which table a registry is; it decides how errors read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegistryKind {
    /// RPC backends (`TCP`, `QUIC`, user-defined).
    RpcBackend,
    /// Process-group backends (`tensorwire`, `nccl`, user-defined).
    ProcessGroup,
}

/// A registry lookup or registration failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The name is taken.
    #[error("{}", already_registered(*.kind, .name))]
    AlreadyRegistered {
        /// Which registry.
        kind: RegistryKind,
        /// The name.
        name: String,
    },
    /// No entry has this name.
    #[error("{} (registered: {})", not_registered(*.kind, .name), registered_list(.registered))]
    NotRegistered {
        /// Which registry.
        kind: RegistryKind,
        /// The name asked for.
        name: String,
        /// The names that are registered.
        registered: Vec<String>,
    },
}

fn already_registered(kind: RegistryKind, name: &str) -> String {
    match kind {
        RegistryKind::RpcBackend => format!("RPC backend {name}: already registered"),
        RegistryKind::ProcessGroup => format!("Backend {name} already registered"),
    }
}

fn not_registered(kind: RegistryKind, name: &str) -> String {
    match kind {
        RegistryKind::RpcBackend => format!("RPC backend {name}: not registered"),
        RegistryKind::ProcessGroup => format!("Backend {name} not registered"),
    }
}

fn registered_list(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// A table from names to shared values (usually trait objects), where each name is taken once.
pub struct Registry<T: ?Sized> {
    kind: RegistryKind,
    entries: IndexMap<String, Arc<T>>,
}

impl<T: ?Sized> Registry<T> {
    /// An empty registry.
    pub fn new(kind: RegistryKind) -> Self {
        Self {
            kind,
            entries: IndexMap::new(),
        }
    }

    /// Which table this is.
    pub fn kind(&self) -> RegistryKind {
        self.kind
    }

    /// Registers `value` under `name`; a name already taken is an error that names it.
    pub fn register(
        &mut self,
        name: impl Into<String>,
        value: Arc<T>,
    ) -> Result<(), RegistryError> {
        let name = name.into();
        if self.entries.contains_key(&name) {
            return Err(RegistryError::AlreadyRegistered {
                kind: self.kind,
                name,
            });
        }
        self.entries.insert(name, value);
        Ok(())
    }

    /// Whether `name` is registered (PyTorch's `backend_registered`).
    pub fn is_registered(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The entry named `name`; an unknown name is an error listing the registered ones.
    pub fn get(&self, name: &str) -> Result<Arc<T>, RegistryError> {
        self.entries
            .get(name)
            .cloned()
            .ok_or_else(|| RegistryError::NotRegistered {
                kind: self.kind,
                name: name.to_owned(),
                registered: self.names().map(str::to_owned).collect(),
            })
    }

    /// Registered names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.entries.keys().map(String::as_str)
    }
}

impl<T: ?Sized> fmt::Debug for Registry<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("kind", &self.kind)
            .field("names", &self.entries.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// An RPC backend: PyTorch's pair of hooks, as one trait.
///
/// `construct_options` is `construct_rpc_backend_options_handler(rpc_timeout, init_method)`;
/// `init_backend` is `init_backend_handler(store, name, rank, world_size, options)` and returns
/// the running agent. `world_size: None` asks for a dynamic group.
#[async_trait]
pub trait RpcBackend: Send + Sync {
    /// The backend's options.
    type Options: Send + 'static;
    /// The rendezvous store handed to `init_backend`.
    type Store: Send + 'static;
    /// The agent `init_backend` starts.
    type Agent: Send + 'static;
    /// What can go wrong.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Builds the backend's options from the common ones.
    fn construct_options(
        &self,
        rpc_timeout: Duration,
        init_method: &str,
    ) -> Result<Self::Options, Self::Error>;

    /// Starts the agent for worker `name` of rank `rank`.
    async fn init_backend(
        &self,
        store: Self::Store,
        name: &str,
        rank: usize,
        world_size: Option<usize>,
        options: Self::Options,
    ) -> Result<Self::Agent, Self::Error>;
}

/// An error from an RPC-backend or process-group registry operation: either the lookup failed,
/// or the backend itself did.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError<E> {
    /// The name was not found.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The backend's hook failed.
    #[error(transparent)]
    Backend(E),
}

/// A registry of RPC backends whose associated types are `O`, `S`, `A`, `E`.
pub type RpcBackendRegistry<O, S, A, E> =
    Registry<dyn RpcBackend<Options = O, Store = S, Agent = A, Error = E>>;

impl<O, S, A, E> Registry<dyn RpcBackend<Options = O, Store = S, Agent = A, Error = E>>
where
    O: Send + 'static,
    S: Send + 'static,
    A: Send + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    /// PyTorch's `construct_rpc_backend_options(backend, rpc_timeout, init_method)`.
    pub fn construct_rpc_backend_options(
        &self,
        backend: &str,
        rpc_timeout: Duration,
        init_method: &str,
    ) -> Result<O, BackendError<E>> {
        self.get(backend)?
            .construct_options(rpc_timeout, init_method)
            .map_err(BackendError::Backend)
    }

    /// PyTorch's `init_backend(backend, store, name, rank, world_size, options)`.
    pub async fn init_backend(
        &self,
        backend: &str,
        store: S,
        name: &str,
        rank: usize,
        world_size: Option<usize>,
        options: O,
    ) -> Result<A, BackendError<E>> {
        let backend = self.get(backend)?;
        backend
            .init_backend(store, name, rank, world_size, options)
            .await
            .map_err(BackendError::Backend)
    }
}

/// A process-group backend factory (`_dist2.py`'s `ProcessGroupFactory`).
#[async_trait]
pub trait ProcessGroupFactory: Send + Sync {
    /// The rendezvous store the group is built on.
    type Store: Send + 'static;
    /// The group it creates.
    type Group: Send + 'static;
    /// Backend-specific options (PyTorch's `**kwargs`); a backend refuses ones it does not know.
    type Options: Send + 'static;
    /// What can go wrong.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Creates the group for `rank` of `world_size`, with collectives bounded by `timeout`,
    /// working on `device`.
    async fn create(
        &self,
        store: Self::Store,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        device: Device,
        options: Self::Options,
    ) -> Result<Self::Group, Self::Error>;
}

/// A registry of process-group factories whose associated types are `S`, `G`, `O`, `E`.
pub type ProcessGroupRegistry<S, G, O, E> =
    Registry<dyn ProcessGroupFactory<Store = S, Group = G, Options = O, Error = E>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    /// Runs a future that never waits (our test backends are synchronous underneath).
    fn now<F: Future>(f: F) -> F::Output {
        let mut f = pin!(f);
        match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("test future was not ready"),
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("backend failed: {0}")]
    struct Failed(String);

    #[derive(Debug, PartialEq)]
    struct Opts {
        timeout: Duration,
        init: String,
    }

    /// A user-defined backend whose "agent" is a description of how it was started.
    struct Echo;

    #[async_trait]
    impl RpcBackend for Echo {
        type Options = Opts;
        type Store = Vec<String>;
        type Agent = String;
        type Error = Failed;

        fn construct_options(
            &self,
            rpc_timeout: Duration,
            init_method: &str,
        ) -> Result<Opts, Failed> {
            if init_method.is_empty() {
                return Err(Failed("empty init method".into()));
            }
            Ok(Opts {
                timeout: rpc_timeout,
                init: init_method.into(),
            })
        }

        async fn init_backend(
            &self,
            store: Vec<String>,
            name: &str,
            rank: usize,
            world_size: Option<usize>,
            options: Opts,
        ) -> Result<String, Failed> {
            Ok(format!(
                "{name}/{rank}/{world_size:?}/{}/{}/{}",
                options.init,
                options.timeout.as_secs(),
                store.join(",")
            ))
        }
    }

    type Rpc = RpcBackendRegistry<Opts, Vec<String>, String, Failed>;

    #[test]
    fn rpc_registry_follows_the_seeds() {
        let mut reg = Rpc::new(RegistryKind::RpcBackend);
        assert!(!reg.is_registered("ECHO"));
        reg.register("ECHO", Arc::new(Echo)).unwrap();
        assert!(reg.is_registered("ECHO"));
        let err = reg.register("ECHO", Arc::new(Echo)).unwrap_err();
        assert_eq!(err.to_string(), "RPC backend ECHO: already registered");

        let opts = reg
            .construct_rpc_backend_options("ECHO", Duration::from_secs(60), "env://")
            .unwrap();
        assert_eq!(
            opts,
            Opts {
                timeout: Duration::from_secs(60),
                init: "env://".into()
            }
        );
        let agent =
            now(reg.init_backend("ECHO", vec!["k".into()], "w0", 0, Some(2), opts)).unwrap();
        assert_eq!(agent, "w0/0/Some(2)/env:///60/k");

        assert!(matches!(
            reg.construct_rpc_backend_options("ECHO", Duration::ZERO, ""),
            Err(BackendError::Backend(Failed(_)))
        ));
        let err = reg
            .construct_rpc_backend_options("TENSORPIPE", Duration::ZERO, "env://")
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "RPC backend TENSORPIPE: not registered (registered: ECHO)"
        );
    }

    struct Counting;

    #[async_trait]
    impl ProcessGroupFactory for Counting {
        type Store = ();
        type Group = (usize, usize, Device);
        type Options = Vec<(String, String)>;
        type Error = Failed;

        async fn create(
            &self,
            _store: (),
            rank: usize,
            world_size: usize,
            _timeout: Duration,
            device: Device,
            options: Self::Options,
        ) -> Result<Self::Group, Failed> {
            if let Some((k, _)) = options.first() {
                return Err(Failed(format!("Unknown option {k}")));
            }
            Ok((rank, world_size, device))
        }
    }

    type Pg = ProcessGroupRegistry<(), (usize, usize, Device), Vec<(String, String)>, Failed>;

    #[test]
    fn process_group_registry_follows_dist2() {
        let mut reg: Pg = Registry::new(RegistryKind::ProcessGroup);
        reg.register("count", Arc::new(Counting)).unwrap();
        assert_eq!(
            reg.register("count", Arc::new(Counting))
                .unwrap_err()
                .to_string(),
            "Backend count already registered"
        );
        assert_eq!(
            reg.get("gloo").err().unwrap().to_string(),
            "Backend gloo not registered (registered: count)"
        );
        let f = reg.get("count").unwrap();
        let g = now(f.create((), 1, 4, Duration::from_secs(1), Device::Cuda(0), vec![])).unwrap();
        assert_eq!(g, (1, 4, Device::Cuda(0)));
        let e = now(f.create(
            (),
            1,
            4,
            Duration::from_secs(1),
            Device::Cpu,
            vec![("x".into(), "1".into())],
        ));
        assert_eq!(
            e.unwrap_err().to_string(),
            "backend failed: Unknown option x"
        );
    }
}
