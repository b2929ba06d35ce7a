//! The RPC backend registry, with PyTorch's semantics (`torch.distributed.rpc.backend_registry`).
//!
//! A backend is a value of [`RpcBackend`]: two hooks,
//! one that builds the options from the common ones (`construct_options(rpc_timeout,
//! init_method)`), one that starts the agent on a rendezvous (`init_backend(rendezvous, name,
//! rank, world_size, options)`). `TCP` is registered by default. A user can register a backend
//! of their own — typically one that starts [`start_agent`] over another
//! [`Transport`](tensorwire_core::ports::transport::Transport) — and select it with
//! [`RpcOptions::backend`]. Registering a name twice is an error that names it.
//!
//! ```
//! # #[cfg(feature = "tcp")] {
//! use std::time::Duration;
//! use tensorwire_rpc::{backend_registered, construct_rpc_backend_options};
//!
//! assert!(backend_registered("TCP"));
//! let options = construct_rpc_backend_options("TCP", Duration::from_secs(30), "env://").unwrap();
//! assert_eq!(options.rpc_timeout, Duration::from_secs(30));
//! assert!(construct_rpc_backend_options("SMOKE_SIGNALS", Duration::ZERO, "env://").is_err());
//! # }
//! ```

use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;

#[cfg(any(feature = "tcp", feature = "quic"))]
use async_trait::async_trait;
use tensorwire_core::registry::{Registry, RegistryError, RegistryKind, RpcBackend};
use tensorwire_rendezvous::Rendezvous;
#[cfg(feature = "tcp")]
use tensorwire_transport_tcp::{TcpConfig, TcpTransport};

#[cfg(feature = "quic")]
use crate::error::InitError;
use crate::error::RpcError;
#[cfg(feature = "tcp")]
use crate::init::cluster_secret;
#[cfg(any(feature = "tcp", feature = "quic"))]
use crate::init::start_agent;
use crate::options::RpcOptions;
use crate::state::Agent;

/// An RPC backend as this crate's registry holds it.
pub type DynRpcBackend =
    dyn RpcBackend<Options = RpcOptions, Store = Rendezvous, Agent = Agent, Error = RpcError>;

static BACKENDS: LazyLock<RwLock<Registry<DynRpcBackend>>> = LazyLock::new(|| {
    #[allow(unused_mut)] // without `tcp` and `quic` nothing is built in
    let mut registry = Registry::new(RegistryKind::RpcBackend);
    #[cfg(feature = "tcp")]
    registry
        .register(TCP_BACKEND, Arc::new(TcpBackend) as Arc<DynRpcBackend>)
        .unwrap_or_else(|_| unreachable!("the registry starts empty"));
    #[cfg(feature = "quic")]
    registry
        .register(QUIC_BACKEND, Arc::new(QuicBackend) as Arc<DynRpcBackend>)
        .unwrap_or_else(|_| unreachable!("the names differ"));
    RwLock::new(registry)
});

// The built-in backends' names live with the options, whose default names one.
#[cfg(feature = "quic")]
pub use crate::options::QUIC_BACKEND;
pub use crate::options::TCP_BACKEND;

/// Registers `backend` under `name`. A name taken already is an error that names it
/// (`RPC backend NAME: already registered`).
pub fn register_backend(name: &str, backend: Arc<DynRpcBackend>) -> Result<(), RegistryError> {
    BACKENDS
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .register(name, backend)
}

/// Whether a backend is registered under `name`.
pub fn backend_registered(name: &str) -> bool {
    BACKENDS
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .is_registered(name)
}

/// Names of the registered backends, in registration order.
pub fn registered_backends() -> Vec<String> {
    BACKENDS
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .names()
        .map(str::to_owned)
        .collect()
}

/// PyTorch's `construct_rpc_backend_options`: the options of backend `name` from the common ones.
pub fn construct_rpc_backend_options(
    name: &str,
    rpc_timeout: Duration,
    init_method: &str,
) -> Result<RpcOptions, RpcError> {
    let backend = lookup(name)?;
    let mut options = backend.construct_options(rpc_timeout, init_method)?;
    options.backend = name.to_owned();
    Ok(options)
}

pub(crate) fn lookup(name: &str) -> Result<Arc<DynRpcBackend>, RpcError> {
    BACKENDS
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(name)
        .map_err(RpcError::Backend)
}

/// The common options with this backend's name.
#[cfg(any(feature = "tcp", feature = "quic"))]
fn base_options(backend: &str, rpc_timeout: Duration, init_method: &str) -> RpcOptions {
    RpcOptions {
        rpc_timeout,
        init_method: init_method.to_owned(),
        backend: backend.into(),
        ..RpcOptions::default()
    }
}

/// The built-in backend: the agent over tokio TCP with the cluster secret (feature `tcp`).
#[cfg(feature = "tcp")]
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpBackend;

#[cfg(feature = "tcp")]
#[async_trait]
impl RpcBackend for TcpBackend {
    type Options = RpcOptions;
    type Store = Rendezvous;
    type Agent = Agent;
    type Error = RpcError;

    fn construct_options(
        &self,
        rpc_timeout: Duration,
        init_method: &str,
    ) -> Result<RpcOptions, RpcError> {
        Ok(base_options(TCP_BACKEND, rpc_timeout, init_method))
    }

    async fn init_backend(
        &self,
        store: Rendezvous,
        name: &str,
        rank: usize,
        world_size: Option<usize>,
        options: RpcOptions,
    ) -> Result<Agent, RpcError> {
        let transport = Self::selecting_transport(&options)?;
        start_agent(transport, store, name, rank, world_size, options).await
    }
}

#[cfg(feature = "tcp")]
impl TcpBackend {
    /// The TCP transport `options` ask for (the cluster secret, or insecure by opt-in): what
    /// a backend that wraps the agent's transport (a faulty one, say) starts from.
    pub fn transport(options: &RpcOptions) -> Result<TcpTransport, RpcError> {
        let config = TcpConfig::resolve(cluster_secret(options)?, options.insecure)?;
        Ok(TcpTransport::new(config)?)
    }

    /// What the agent runs over: shared memory for peers on this host and TCP for the others,
    /// unless `TENSORWIRE_TRANSPORT` says otherwise (see `tensorwire_transport_shm::select`).
    fn selecting_transport(
        options: &RpcOptions,
    ) -> Result<Arc<dyn tensorwire_core::ports::transport::Transport>, RpcError> {
        let config = TcpConfig::resolve(cluster_secret(options)?, options.insecure)?;
        #[cfg(target_os = "linux")]
        return Ok(Arc::new(
            tensorwire_transport_shm::SelectingTransport::from_tcp_config(config)?,
        ));
        #[cfg(not(target_os = "linux"))]
        return Ok(Arc::new(TcpTransport::new(config)?));
    }
}

/// The environment variable naming the `QUIC` backend's TLS folder when
/// [`RpcOptions::tls_dir`] is not set (`tensorwire launch --quic-certs` sets it per worker).
pub const TLS_DIR_ENV: &str = "TENSORWIRE_TLS_DIR";

/// The QUIC backend: the agent over quinn with mutual TLS under the cluster CA
/// ([`RpcOptions::tls_dir`], else [`TLS_DIR_ENV`]).
#[cfg(feature = "quic")]
#[derive(Debug, Clone, Copy, Default)]
pub struct QuicBackend;

#[cfg(feature = "quic")]
impl QuicBackend {
    fn tls(
        name: &str,
        rank: usize,
        options: &RpcOptions,
    ) -> Result<tensorwire_transport_quic::ClusterTls, RpcError> {
        use tensorwire_transport_quic::certs::{ClusterCa, CA_CERT_FILE, CA_KEY_FILE};
        use tensorwire_transport_quic::ClusterTls;
        let from_env = std::env::var_os(TLS_DIR_ENV).map(std::path::PathBuf::from);
        let dir = options
            .tls_dir
            .as_ref()
            .or(from_env.as_ref())
            .ok_or(InitError::NoTlsDir { env: TLS_DIR_ENV })?;
        let tls_error = |source: tensorwire_transport_quic::QuicError| {
            RpcError::from(InitError::Tls {
                dir: dir.clone(),
                source,
            })
        };
        // This worker's own certificate: issued for its name, or else for its rank (`rank-N`,
        // as `tensorwire launch --quic-certs` issues them).
        let own = [
            name.to_owned(),
            tensorwire_core::identity::rank_name(rank as u32),
        ]
        .into_iter()
        .find(|n| dir.join(format!("{n}.pem")).exists());
        if let Some(own) = &own {
            ClusterTls::from_pem_files(
                &dir.join(CA_CERT_FILE),
                &dir.join(format!("{own}.pem")),
                &dir.join(format!("{own}.key.pem")),
            )
            .map_err(tls_error)
        } else if !dir.join(CA_KEY_FILE).exists() && dir.join(CA_CERT_FILE).exists() {
            Err(InitError::NoCertificate {
                dir: dir.clone(),
                name: name.to_owned(),
                rank: rank as u32,
            }
            .into())
        } else {
            let ca = ClusterCa::load_or_generate(dir).map_err(tls_error)?;
            let identity = ca.issue_node(name).map_err(tls_error)?;
            Ok(ClusterTls::new(identity, vec![ca.cert_der().clone()]))
        }
    }
}

#[cfg(feature = "quic")]
#[async_trait]
impl RpcBackend for QuicBackend {
    type Options = RpcOptions;
    type Store = Rendezvous;
    type Agent = Agent;
    type Error = RpcError;

    fn construct_options(
        &self,
        rpc_timeout: Duration,
        init_method: &str,
    ) -> Result<RpcOptions, RpcError> {
        Ok(base_options(QUIC_BACKEND, rpc_timeout, init_method))
    }

    async fn init_backend(
        &self,
        store: Rendezvous,
        name: &str,
        rank: usize,
        world_size: Option<usize>,
        options: RpcOptions,
    ) -> Result<Agent, RpcError> {
        use tensorwire_transport_quic::{QuicConfig, QuicTransport};
        let tls = Self::tls(name, rank, &options)?;
        let config = QuicConfig::new(tls)
            .with_liveness_from(|name| std::env::var(name).ok())
            .map_err(InitError::QuicTransport)?;
        let transport = QuicTransport::new(config).map_err(InitError::QuicTransport)?;
        start_agent(Arc::new(transport), store, name, rank, world_size, options).await
    }
}
