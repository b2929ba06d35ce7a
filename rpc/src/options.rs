//! Options of `init_rpc`.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::ports::device::DeviceBackend;

use tensorwire_core::device::{Device, DeviceMaps};
use tensorwire_core::protocol::EndpointConfig;

use crate::error::RpcError;
use crate::runtime::{Runtime, TokioRuntime};
use crate::state::Functions;

/// The default timeout of a call (PyTorch's too).
pub const DEFAULT_RPC_TIMEOUT: Duration = Duration::from_secs(60);

// How `Agent::shutdown` stops the agent: core decides what each way does (`Shutdown::plan`).
pub use tensorwire_core::protocol::shutdown::plan::{Shutdown, IMMEDIATE_CLOSE_TIMEOUT};

/// How to start an agent.
#[derive(Clone)]
pub struct RpcOptions {
    /// Default timeout of calls; zero means none.
    pub rpc_timeout: Duration,
    /// The RPC backend that starts the agent, by its registered name (`TCP` by default, `QUIC`
    /// when built without `tcp` but with `quic`; see
    /// [`register_backend`](crate::register_backend)).
    pub backend: String,
    /// Rendezvous URL: `env://` (default), `tcp://host:port`, `file:///path`.
    pub init_method: String,
    /// How long init (rendezvous, exchange, connections) may take.
    pub init_timeout: Duration,
    /// The cluster secret (the same bytes on every worker); `None` reads `TENSORWIRE_SECRET`.
    /// It authenticates both the transport and the rendezvous store.
    pub secret: Option<Vec<u8>>,
    /// Run without authentication (only when asked for explicitly).
    pub insecure: bool,
    /// TLS material for the `QUIC` backend: a folder holding either the cluster CA
    /// (`ca.pem` and `ca.key.pem`, created there by the first worker if missing; every worker
    /// then gets a certificate issued for its name), or `ca.pem` plus this worker's
    /// `<name>.pem` and `<name>.key.pem` from your own PKI. Every peer's certificate must be
    /// issued for the name it gives (its common name, or a DNS name it is valid for; else
    /// [`RpcError::NotCertified`]). That binds names to
    /// workers only with your own PKI: whoever holds `ca.key.pem` can issue any name. A
    /// folder with `rank-N.pem` and `rank-N.key.pem` (this worker's rank; what
    /// `tensorwire launch --quic-certs` writes) is used when `<name>.pem` is not there: a rank
    /// certificate binds the rank, and certifies whatever name the worker gives. `None`: the
    /// folder named by `TENSORWIRE_TLS_DIR`, if set.
    pub tls_dir: Option<std::path::PathBuf>,
    /// Where this worker's tensors land on each destination.
    pub device_maps: DeviceMaps,
    /// The devices this worker uses (empty: derived from the maps).
    pub devices: Vec<Device>,
    /// The functions this worker serves.
    pub functions: Functions,
    /// The device backend that moves tensors on and off devices. Default: with the feature
    /// `cuda`, the CUDA backend (`CudaDevices::shared()`: this machine's GPUs, or none with the
    /// reason when there is no driver); without it, a backend with no devices.
    pub device_backend: Arc<dyn DeviceBackend>,
    /// The address other workers reach this one at; by default the loopback address when the
    /// rendezvous address is local, else the local address that routes to it.
    pub listen_ip: Option<std::net::IpAddr>,
    /// Whether device tensors to other processes of this host may go by CUDA IPC handle
    /// (default `true`; `TENSORWIRE_CUDA_IPC=0` turns it off too). Off, they are staged through
    /// host memory; the peers then stage too. See `Agent::device_paths`.
    pub share_device_memory: bool,
    /// What a peer can make this worker hold of its shared device memory, awaiting the peer's
    /// release (default: 64 buffers and 8 GiB per peer; past either, tensors to it are staged).
    pub ipc_limits: tensorwire_core::ipc::IpcConfig,
    /// Where the agent reads the time, sleeps and spawns (default [`TokioRuntime`]: tokio's
    /// clock, which a paused test runtime makes virtual). Every deadline of the agent comes
    /// from it.
    pub runtime: Arc<dyn Runtime>,
    /// The protocol endpoint's settings (default [`EndpointConfig::default`]): the bounds on
    /// what one peer can make this worker hold — requests served per caller
    /// (`requests_per_peer`), fetches parked per caller (`parked_fetches_per_peer`), forks of
    /// values owned here per holder (`references_per_peer`), fork records for references never
    /// created here (`pending_forks_per_peer`), idempotence records
    /// (`idempotence_records_per_peer`), and the memory budget of each peer (`peer_budget`,
    /// 256 MiB: frames queued for it, its collective messages, the frame being received from
    /// it and its records, all together; see [`with_peer_budget`](Self::with_peer_budget)) —
    /// and how often unacknowledged control messages are
    /// sent again (`control_retry`). The guide's bounds table gives each default and what a
    /// peer gets past it. None may be zero: the agent refuses to start with one
    /// ([`InitError::Endpoint`](crate::InitError::Endpoint), core's `EndpointConfig::check`).
    pub endpoint: EndpointConfig,
}

/// The CUDA backend when the feature `cuda` is on, else no devices.
fn default_device_backend() -> Arc<dyn DeviceBackend> {
    #[cfg(feature = "cuda")]
    {
        Arc::new(tensorwire_devices_cuda::CudaDevices::shared().clone())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Arc::new(tensorwire_core::devices_sim::SimulatedDevices::new(0))
    }
}

/// The name of the built-in TCP backend (registered with the feature `tcp`, on by default).
pub const TCP_BACKEND: &str = "TCP";

/// The name of the built-in QUIC backend (feature `quic`).
#[cfg(feature = "quic")]
pub const QUIC_BACKEND: &str = "QUIC";

/// `TCP` when built in (feature `tcp`), else `QUIC` when built in, else `TCP` (an init that
/// names it fails with "not registered" until a backend of that name is registered).
fn default_backend() -> &'static str {
    #[cfg(all(not(feature = "tcp"), feature = "quic"))]
    {
        QUIC_BACKEND
    }
    #[cfg(any(feature = "tcp", not(feature = "quic")))]
    {
        TCP_BACKEND
    }
}

impl Default for RpcOptions {
    fn default() -> Self {
        Self {
            rpc_timeout: DEFAULT_RPC_TIMEOUT,
            backend: default_backend().into(),
            init_method: "env://".into(),
            init_timeout: Duration::from_secs(300),
            secret: None,
            insecure: false,
            tls_dir: None,
            device_maps: DeviceMaps::new(),
            devices: Vec::new(),
            functions: Functions::new(),
            device_backend: default_device_backend(),
            listen_ip: None,
            share_device_memory: true,
            ipc_limits: tensorwire_core::ipc::IpcConfig::default(),
            runtime: Arc::new(TokioRuntime),
            endpoint: EndpointConfig::default(),
        }
    }
}

impl std::fmt::Debug for RpcOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcOptions")
            .field("rpc_timeout", &self.rpc_timeout)
            .field("backend", &self.backend)
            .field("init_method", &self.init_method)
            .field("insecure", &self.insecure)
            .field("device_maps", &self.device_maps)
            .field("devices", &self.devices)
            .field("functions", &self.functions)
            .field("device_backend", &self.device_backend.name())
            .field("share_device_memory", &self.share_device_memory)
            .field("runtime", &self.runtime)
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// Builder methods: each takes the options and returns them changed, so that options read as
/// one expression instead of a struct literal with `..Default::default()`.
///
/// ```
/// use std::time::Duration;
/// use tensorwire_rpc::{Functions, RpcOptions};
///
/// let options = RpcOptions::new()
///     .with_functions(Functions::new())
///     .with_rpc_timeout(Duration::from_secs(10))
///     .with_init_method("tcp://10.0.0.1:29500")
///     .with_device_map("ps", &[("cuda:0", "cuda:1")])?;
/// assert_eq!(options.rpc_timeout, Duration::from_secs(10));
/// # Ok::<(), tensorwire_rpc::RpcError>(())
/// ```
impl RpcOptions {
    /// The defaults: `env://`, the `TCP` backend, a 60 s call timeout, the secret from
    /// `TENSORWIRE_SECRET`, no functions, no device maps.
    pub fn new() -> Self {
        Self::default()
    }

    /// The protocol endpoint's settings, its bounds per peer among them (see
    /// [`endpoint`](Self::endpoint)).
    pub fn with_endpoint_config(mut self, endpoint: EndpointConfig) -> Self {
        self.endpoint = endpoint;
        self
    }

    /// The memory budget of each peer, in bytes ([`EndpointConfig::peer_budget`], default
    /// 256 MiB): what one peer makes this worker hold — frames queued for it that it has not
    /// read, collective messages it sent that no collective took, the frame being received
    /// from it (TCP), the records kept for it — draws from it. A frame queued past it drops
    /// the peer (`LostCause::OverBudget`: its calls fail naming the budget, and what was
    /// queued for it is freed); a collective message past it is the sender's
    /// `MeshViolation::OverBudget`; a frame being received past it closes the connection;
    /// a `remote` or parked fetch past it is answered `Busy`. One item alone (the peer
    /// holding nothing else) always passes.
    pub fn with_peer_budget(mut self, bytes: usize) -> Self {
        self.endpoint.peer_budget = bytes;
        self
    }

    /// The functions this worker serves.
    pub fn with_functions(mut self, functions: Functions) -> Self {
        self.functions = functions;
        self
    }

    /// The default timeout of calls (zero: none).
    pub fn with_rpc_timeout(mut self, timeout: Duration) -> Self {
        self.rpc_timeout = timeout;
        self
    }

    /// The RPC backend, by its registered name (`TCP`, `QUIC`, or one of yours).
    pub fn with_backend(mut self, backend: impl Into<String>) -> Self {
        self.backend = backend.into();
        self
    }

    /// The rendezvous URL: `env://`, `tcp://host:port`, `file:///path`.
    pub fn with_init_method(mut self, url: impl Into<String>) -> Self {
        self.init_method = url.into();
        self
    }

    /// How long init may take.
    pub fn with_init_timeout(mut self, timeout: Duration) -> Self {
        self.init_timeout = timeout;
        self
    }

    /// The cluster secret (instead of `TENSORWIRE_SECRET`).
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// Runs without authentication: anyone who reaches the ports can call registered functions.
    /// Only for trusted networks and tests.
    pub fn insecure(mut self) -> Self {
        self.insecure = true;
        self
    }

    /// The folder of the `QUIC` backend's TLS material (see [`RpcOptions::tls_dir`]).
    pub fn with_tls_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.tls_dir = Some(dir.into());
        self
    }

    /// [`set_device_map`](Self::set_device_map), as a builder step.
    pub fn with_device_map(mut self, to: &str, map: &[(&str, &str)]) -> Result<Self, RpcError> {
        self.set_device_map(to, map)?;
        Ok(self)
    }

    /// The devices this worker uses.
    pub fn with_devices(mut self, devices: Vec<Device>) -> Self {
        self.devices = devices;
        self
    }

    /// The runtime the agent reads time from, sleeps and spawns with (see
    /// [`RpcOptions::runtime`]).
    pub fn with_runtime(mut self, runtime: Arc<dyn Runtime>) -> Self {
        self.runtime = runtime;
        self
    }

    /// The device backend (see [`RpcOptions::device_backend`]).
    pub fn with_device_backend(mut self, backend: Arc<dyn DeviceBackend>) -> Self {
        self.device_backend = backend;
        self
    }

    /// The address other workers reach this one at.
    pub fn with_listen_ip(mut self, ip: std::net::IpAddr) -> Self {
        self.listen_ip = Some(ip);
        self
    }

    /// Adds entries to the device map for `to`, as PyTorch's `set_device_map`: incremental,
    /// one-to-one, and an entry that changes an earlier one is refused.
    pub fn set_device_map(&mut self, to: &str, map: &[(&str, &str)]) -> Result<(), RpcError> {
        let mut parsed = Vec::with_capacity(map.len());
        for (s, t) in map {
            parsed.push((s.parse::<Device>()?, t.parse::<Device>()?));
        }
        // Core decides what may change (and changes nothing when it refuses).
        self.device_maps
            .add(to, &parsed)
            .map_err(|reason| RpcError::DeviceMapConfig {
                to: to.to_owned(),
                reason,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_device_map_is_incremental_and_one_to_one() {
        let mut o = RpcOptions::default();
        o.set_device_map("ps", &[("cuda:0", "cuda:1")]).unwrap();
        o.set_device_map("ps", &[("cuda:1", "cuda:0"), ("cuda:0", "cuda:1")])
            .unwrap();
        assert_eq!(o.device_maps.get("ps").unwrap().len(), 2);
        let e = o.set_device_map("ps", &[("cuda:0", "cuda:2")]).unwrap_err();
        assert!(
            e.to_string().contains("cuda:0 is already mapped to cuda:1"),
            "{e}"
        );
        let e = o.set_device_map("ps", &[("cuda:2", "cuda:1")]).unwrap_err();
        assert!(e.to_string().contains("one-to-one"), "{e}");
        assert!(o.set_device_map("ps", &[("gpu:0", "cuda:1")]).is_err());
    }
}
