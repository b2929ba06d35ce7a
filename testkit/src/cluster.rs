//! Groups of agents for tests: over the in-memory network, or over real loopback TCP.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::faults::FaultyBackend;
use tensorwire_core::ports::store::Store;
use tensorwire_rpc::{init_rpc, start_agent, Agent, Rendezvous, RpcError, RpcOptions};
use tensorwire_store::InMemoryStore;
use tensorwire_transport_memory::{MemoryNetwork, MemoryTransport};

/// The options every test group starts from: a 20 s init timeout and loopback addresses.
pub fn base_options() -> RpcOptions {
    RpcOptions {
        init_timeout: Duration::from_secs(20),
        listen_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
        ..RpcOptions::default()
    }
}

/// A rank of a group that did not start, and why.
#[derive(Debug)]
pub struct StartError {
    /// The rank.
    pub rank: usize,
    /// Why (a task that panicked reads as [`RpcError::Init`]).
    pub error: RpcError,
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} did not start: {}", self.rank, self.error)
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// Agents named `w{rank}` over one in-memory network and one in-memory store: a group in one
/// process, in virtual time when the test pauses tokio's clock. Cheap to clone; clones share
/// the network, the store and the hosts.
#[derive(Clone)]
pub struct MemoryCluster {
    net: MemoryNetwork,
    store: Arc<dyn Store>,
    hosts: Arc<Mutex<HashMap<usize, MemoryTransport>>>,
    faults: Option<Arc<FaultyBackend>>,
}

impl fmt::Debug for MemoryCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryCluster")
            .field("net", &self.net)
            .field("hosts", &self.lock().keys().collect::<Vec<_>>())
            .field("faults", &self.faults)
            .finish_non_exhaustive()
    }
}

impl Default for MemoryCluster {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryCluster {
    /// A cluster over a network that delivers at once.
    pub fn new() -> Self {
        Self::on(MemoryNetwork::new())
    }

    /// A cluster over `net` (for example [`MemoryNetwork::with_delay`]).
    pub fn on(net: MemoryNetwork) -> Self {
        Self {
            net,
            store: Arc::new(InMemoryStore::new()),
            hosts: Arc::default(),
            faults: None,
        }
    }

    /// Starts every agent through `faults` (each rank sends with the faults it names).
    pub fn with_faults(mut self, faults: Arc<FaultyBackend>) -> Self {
        self.faults = Some(faults);
        self
    }

    /// The store every agent meets through.
    pub fn store(&self) -> Arc<dyn Store> {
        Arc::clone(&self.store)
    }

    /// Meets through `store` instead (one that records or fails, say).
    pub fn with_store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = store;
        self
    }

    /// The network.
    pub fn network(&self) -> &MemoryNetwork {
        &self.net
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, MemoryTransport>> {
        self.hosts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The host of rank `rank` (its kill switch), once it was started.
    pub fn host(&self, rank: usize) -> Option<MemoryTransport> {
        self.lock().get(&rank).cloned()
    }

    /// Kills rank `rank`'s host (its connections break on both ends); false when no such rank
    /// was started.
    pub fn kill(&self, rank: usize) -> bool {
        self.host(rank).map(|h| h.kill()).is_some()
    }

    /// Starts worker `w{rank}` on a new host of the network: of a static group of `world_size`
    /// workers, or (`None`) a member of a dynamic group.
    pub async fn start(
        &self,
        rank: usize,
        world_size: Option<usize>,
        options: RpcOptions,
    ) -> Result<Agent, RpcError> {
        let rdv = Rendezvous::from_store(self.store(), rank, world_size.unwrap_or(rank + 1));
        let host = self.net.transport();
        self.lock().insert(rank, host.clone());
        let transport = Arc::new(host);
        let name = format!("w{rank}");
        match &self.faults {
            Some(f) => {
                f.start(transport, rdv, &name, rank, world_size, options)
                    .await
            }
            None => start_agent(transport, rdv, &name, rank, world_size, options).await,
        }
    }

    /// Starts a static group of `n` workers at once, each with [`base_options`] as `tweak`
    /// adjusts them; returns every rank's outcome, in rank order.
    pub async fn start_all(
        &self,
        n: usize,
        tweak: impl Fn(usize, &mut RpcOptions),
    ) -> Vec<Result<Agent, RpcError>> {
        let mut tasks = Vec::with_capacity(n);
        for rank in 0..n {
            let mut options = base_options();
            tweak(rank, &mut options);
            let cluster = self.clone();
            tasks.push(tokio::spawn(async move {
                cluster.start(rank, Some(n), options).await
            }));
        }
        outcomes(tasks).await
    }

    /// Like [`start_all`](Self::start_all), for a group that must start: the agents in rank
    /// order, or the first rank that failed (the others are shut down).
    pub async fn group(
        &self,
        n: usize,
        tweak: impl Fn(usize, &mut RpcOptions),
    ) -> Result<Vec<Agent>, StartError> {
        all_started(self.start_all(n, tweak).await).await
    }
}

/// Awaits each rank's start, in rank order (a task that panicked reads as an init error).
async fn outcomes(
    tasks: Vec<tokio::task::JoinHandle<Result<Agent, RpcError>>>,
) -> Vec<Result<Agent, RpcError>> {
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(
            t.await
                .unwrap_or_else(|e| Err(tensorwire_rpc::InitError::StartTask(e).into())),
        );
    }
    out
}

/// Every agent, or the first rank that failed (shutting the started ones down).
async fn all_started(outcomes: Vec<Result<Agent, RpcError>>) -> Result<Vec<Agent>, StartError> {
    let mut agents = Vec::with_capacity(outcomes.len());
    let mut first_error = None;
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(agent) => agents.push(agent),
            Err(error) => {
                first_error.get_or_insert(StartError { rank, error });
            }
        }
    }
    match first_error {
        None => Ok(agents),
        Some(e) => {
            for a in agents {
                let _ = a.shutdown(tensorwire_rpc::Shutdown::Immediate).await;
            }
            Err(e)
        }
    }
}

/// Agents over real loopback TCP with a cluster secret, started through `init_rpc`, meeting
/// through a file store in a temporary folder of their own (removed when this is dropped: keep
/// it for the test's duration).
///
/// No port is chosen before it is bound: every agent listens on port 0 and publishes the port
/// it got, so no other process can take it in between (binding port 0, dropping the socket
/// and passing its number on, as tests once did, races).
#[derive(Debug)]
pub struct TcpCluster {
    dir: tempfile::TempDir,
}

impl TcpCluster {
    /// A cluster with a new rendezvous folder.
    ///
    /// # Panics
    /// When no temporary folder can be made (a test cannot go on).
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("no temporary folder: {e}"));
        Self { dir }
    }

    /// The `init_method` of rank `rank` of `world_size`.
    pub fn init_method(&self, rank: usize, world_size: usize) -> String {
        format!(
            "file://{}?rank={rank}&world_size={world_size}",
            self.dir.path().join("rendezvous").display()
        )
    }

    /// Starts `n` workers `w{rank}` at once, each with [`base_options`], this cluster's
    /// `init_method` and a test secret, as `tweak` adjusts them; every rank's outcome, in rank
    /// order.
    pub async fn start_all(
        &self,
        n: usize,
        tweak: impl Fn(usize, &mut RpcOptions),
    ) -> Vec<Result<Agent, RpcError>> {
        let mut tasks = Vec::with_capacity(n);
        for rank in 0..n {
            let mut options = base_options()
                .with_init_method(self.init_method(rank, n))
                .with_secret(b"tensorwire testkit secret".to_vec());
            tweak(rank, &mut options);
            tasks.push(tokio::spawn(async move {
                init_rpc(&format!("w{rank}"), rank, Some(n), options).await
            }));
        }
        outcomes(tasks).await
    }

    /// Like [`start_all`](Self::start_all), for a group that must start.
    pub async fn group(
        &self,
        n: usize,
        tweak: impl Fn(usize, &mut RpcOptions),
    ) -> Result<Vec<Agent>, StartError> {
        all_started(self.start_all(n, tweak).await).await
    }
}

impl Default for TcpCluster {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::{Fault, FaultAction, MessageKind};
    use tensorwire_rpc::{CallError, Functions};

    fn echo() -> Functions {
        let f = Functions::new();
        f.register("echo", |s: String| async move { Ok::<_, String>(s) })
            .unwrap();
        f
    }

    #[tokio::test(start_paused = true)]
    async fn a_memory_group_calls_and_a_killed_host_is_lost() {
        let cluster = MemoryCluster::new();
        let agents = cluster.group(3, |_, o| o.functions = echo()).await.unwrap();
        let names: Vec<String> = agents
            .iter()
            .map(|a| a.worker_info().name.clone())
            .collect();
        assert_eq!(names, ["w0", "w1", "w2"]);
        let got: String = agents[0]
            .rpc_sync("w2", "echo", &"hi".to_string(), None)
            .await
            .unwrap();
        assert_eq!(got, "hi");
        assert!(cluster.kill(2));
        assert!(!cluster.kill(7));
        assert!(cluster.host(2).unwrap().is_killed());
        let e = agents[0]
            .rpc_sync::<_, String>("w2", "echo", &"again".to_string(), None)
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                RpcError::Call {
                    source: CallError::PeerLost { .. },
                    ..
                }
            ),
            "{e}"
        );
        for a in agents {
            let _ = a.shutdown(tensorwire_rpc::Shutdown::Immediate).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_faulty_rank_drops_what_it_was_told_to() {
        let faults = Arc::new(
            FaultyBackend::new()
                .with_fault(1, Fault::new(MessageKind::Reply, FaultAction::Drop, 1)),
        );
        let cluster = MemoryCluster::new().with_faults(Arc::clone(&faults));
        let agents = cluster.group(2, |_, o| o.functions = echo()).await.unwrap();
        let lost = agents[0]
            .rpc_sync::<_, String>(
                "w1",
                "echo",
                &"one".to_string(),
                Some(Duration::from_secs(1)),
            )
            .await;
        assert!(lost.is_err(), "{lost:?}");
        assert_eq!(faults.injected(1), 1);
        let got: String = agents[0]
            .rpc_sync("w1", "echo", &"two".to_string(), None)
            .await
            .unwrap();
        assert_eq!(got, "two");
        for a in agents {
            let _ = a.shutdown(tensorwire_rpc::Shutdown::Immediate).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_group_that_cannot_start_names_the_rank_and_start_all_gives_every_outcome() {
        let bad_map = |rank: usize, o: &mut RpcOptions| {
            o.device_backend = Arc::new(tensorwire_core::devices_sim::SimulatedDevices::new(1));
            if rank == 0 {
                o.set_device_map("w1", &[("cuda:0", "cuda:3")]).unwrap();
            }
        };
        let all = MemoryCluster::new().start_all(2, bad_map).await;
        assert_eq!(all.len(), 2);
        assert!(all.iter().all(Result::is_err));
        let e = MemoryCluster::new().group(2, bad_map).await.unwrap_err();
        assert_eq!(e.rank, 0);
        assert!(e.to_string().starts_with("rank 0 did not start: "), "{e}");
        assert!(e.to_string().contains("device map for w1"), "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tcp_group_meets_without_a_port_chosen_in_advance() {
        let cluster = TcpCluster::new();
        let group = cluster.group(2, |_, o| o.functions = echo()).await.unwrap();
        let got: String = group[1]
            .rpc_sync("w0", "echo", &"over tcp".to_string(), None)
            .await
            .unwrap();
        assert_eq!(got, "over tcp");
        let transports: Vec<String> = group[0]
            .connections()
            .iter()
            .map(|c| format!("{c:?}"))
            .collect();
        assert_eq!(transports.len(), 1, "{transports:?}");
        for a in group {
            let _ = a.shutdown(tensorwire_rpc::Shutdown::Immediate).await;
        }
    }
}
