//! Rendezvous: how the ranks of a group find a shared [`Store`], as `torch.distributed` does it.
//!
//! - `env://`: `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE` from the environment
//!   (`rank` and `world_size` may also come from the URL's query, which wins); under Slurm,
//!   its variables stand in for unset ones ([`crate::launcher_env`]).
//! - `tcp://host:port?rank=R&world_size=N`
//! - `file:///path?rank=R&world_size=N`: a [`FileStore`] in `path`.
//!
//! Missing pieces give PyTorch's own messages, such as `Error initializing torch.distributed
//! using env:// rendezvous: environment variable MASTER_ADDR expected, but not set`.
//!
//! For `env://` and `tcp://`, rank 0 starts the [`TcpStoreServer`] by default (PyTorch's
//! default too) and keeps it alive inside the returned [`Rendezvous`]: rank 0 must keep that
//! value until the group is done. Every rank connects as a client with retries, exponential
//! backoff and jitter until the timeout. Ranks then join: each adds 1 to the key `init/` (the
//! counter PyTorch's `TCPStore` uses, so PyTorch ranks in the same job count too) and waits
//! until all `world_size` have arrived; a timeout says how many of how many did.
//!
//! Under a launcher that serves the store itself, nobody starts one ([`store_host`]):
//! `tensorwire launch` (`TENSORWIRE_LAUNCHER_STORE=1`, authenticated with the cluster secret)
//! and torchrun (`TORCHELASTIC_USE_AGENT_STORE=True` for its `MASTER_ADDR:MASTER_PORT`), whose
//! agent serves PyTorch's `TCPStore`: every rank connects to it as a plain c10d client, as
//! PyTorch's workers do, and the cluster secret is then proved only between the workers.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tensorwire_rendezvous::{rendezvous, RendezvousOptions};
//!
//! // MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=2 in the environment:
//! let group = rendezvous("env://", RendezvousOptions::default()).await?;
//! group.store.set(&format!("addr/{}", group.rank), b"10.0.0.1:4000").await?;
//! # Ok(()) }
//! ```

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::ports::store::{Store, StoreError};
use tokio::time::Instant;
use tracing::{debug, info};

use crate::launcher_env::launcher_var;
use tensorwire_store::{
    ClientConfig, ClusterSecret, FileStore, ServerConfig, TcpStoreClient, TcpStoreServer,
    DEFAULT_TIMEOUT,
};

/// Set to `1` by a launcher that serves the job's store on `MASTER_ADDR:MASTER_PORT` itself
/// (`tensorwire launch --nnodes N`, as torchrun's `TORCHELASTIC_USE_AGENT_STORE`): rank 0 then
/// connects to that store instead of starting one.
pub const LAUNCHER_STORE_ENV: &str = "TENSORWIRE_LAUNCHER_STORE";

/// Set to `True` by torchrun's elastic agent, which serves the job's store on
/// `MASTER_ADDR:MASTER_PORT` (PyTorch's `TCPStore`, unauthenticated): every rank connects to it
/// as a plain c10d client ([`StoreHost::TorchElasticAgent`]).
pub const TORCHELASTIC_AGENT_STORE_ENV: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// Who serves the TCP store of a `tcp://` or `env://` rendezvous, as the environment says
/// ([`store_host`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreHost {
    /// Rank 0 starts it (PyTorch's default), unless [`RendezvousOptions::embed_server`] is
    /// off; it requires the cluster secret when one is set.
    RankZero,
    /// `tensorwire launch` serves it ([`LAUNCHER_STORE_ENV`] is `1`): every rank connects, with the
    /// cluster secret when one is set.
    Launcher,
    /// torchrun's elastic agent serves it ([`TORCHELASTIC_AGENT_STORE_ENV`] is `True` and the
    /// URL's host and port are `MASTER_ADDR` and `MASTER_PORT`, PyTorch's own test): every rank
    /// connects as a plain c10d client, without the cluster secret, which PyTorch's `TCPStore`
    /// cannot check. Whoever reaches that port may read and write the store, as in PyTorch;
    /// the workers still prove the secret (or their certificates) to each other on every
    /// connection, so an address written there by an outsider is only dialled, never trusted.
    TorchElasticAgent,
}

/// Who serves the store at `host:port`, from the launcher's variables in `env`.
///
/// torchrun's `TORCHELASTIC_USE_AGENT_STORE=True` counts only for the agent's own
/// `MASTER_ADDR:MASTER_PORT` (as PyTorch's `_agent_store_serves`: the flag promises a server
/// there and nowhere else), and then wins over `TENSORWIRE_LAUNCHER_STORE=1` (what serves that
/// port is PyTorch's store, whoever set the other variable).
pub fn store_host(host: &str, port: u16, env: impl Fn(&str) -> Option<String>) -> StoreHost {
    let agent = env(TORCHELASTIC_AGENT_STORE_ENV).is_some_and(|v| v == "True")
        && env("MASTER_ADDR").is_some_and(|a| a == host)
        && env("MASTER_PORT").is_some_and(|p| p.trim().parse::<u16>() == Ok(port));
    if agent {
        StoreHost::TorchElasticAgent
    } else if env(LAUNCHER_STORE_ENV).is_some_and(|v| v == "1") {
        StoreHost::Launcher
    } else {
        StoreHost::RankZero
    }
}

/// The join counter, unprefixed: the key PyTorch's `TCPStore` counts workers with.
const JOIN_COUNTER: &str = "init/";
/// Set by the rank that completes the join, to release the others at once.
const JOIN_DONE: &str = "init/complete";

/// How to rendezvous.
#[derive(Debug, Clone)]
pub struct RendezvousOptions {
    /// Store timeout, and the limit for connecting and for the join.
    pub timeout: Duration,
    /// Cluster secret for the TCP store (every rank must use the same; PyTorch ranks cannot).
    pub secret: Option<ClusterSecret>,
    /// Whether rank 0 starts the TCP store server (`false`: one runs elsewhere, for example
    /// `tensorwire store serve`).
    pub embed_server: bool,
    /// Where rank 0's server listens; by default the address `MASTER_ADDR`/the URL's host
    /// resolves to, on the given port.
    pub bind_addr: Option<IpAddr>,
    /// Whether to wait until all `world_size` ranks have joined.
    pub wait_for_all: bool,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        RendezvousOptions {
            timeout: DEFAULT_TIMEOUT,
            secret: None,
            embed_server: true,
            bind_addr: None,
            wait_for_all: true,
        }
    }
}

/// The outcome of a rendezvous: a shared store, this process's rank and the world size.
pub struct Rendezvous {
    /// The store every rank shares.
    pub store: Arc<dyn Store>,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks (for a group of no fixed size, `world_size=-1` in the URL as PyTorch
    /// writes it for dynamic RPC groups: this rank + 1).
    pub world_size: usize,
    server: Option<TcpStoreServer>,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl Rendezvous {
    /// A rendezvous that is already done: rank `rank` of `world_size` sharing `store` (an
    /// [`InMemoryStore`](tensorwire_store::InMemoryStore) for workers in one process, or a store a launcher
    /// set up). It hosts no server.
    pub fn from_store(store: Arc<dyn Store>, rank: usize, world_size: usize) -> Rendezvous {
        Rendezvous {
            store,
            rank,
            world_size,
            server: None,
        }
    }

    /// The address of the store server this process hosts (rank 0 with an embedded server).
    pub fn server_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(TcpStoreServer::local_addr)
    }

    /// Lets go of the store and, on the rank that hosts it, stops the server and waits until
    /// its listener and connections are closed (dropping a `Rendezvous` only signals the
    /// server to stop). Other holders of [`store`](Rendezvous::store) keep their handle.
    pub async fn shutdown(self) {
        drop(self.store);
        if let Some(server) = self.server {
            server.shutdown().await;
        }
    }
}

/// Why a rendezvous failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// The URL's scheme is not `env`, `tcp` or `file`.
    #[error("No rendezvous handler for {scheme}://")]
    UnknownScheme {
        /// The scheme found.
        scheme: String,
    },
    /// A piece of configuration is missing or malformed (PyTorch's wording).
    #[error("Error initializing torch.distributed using {scheme}:// rendezvous: {reason}")]
    Invalid {
        /// `env`, `tcp` or `file`.
        scheme: String,
        /// What is missing or wrong.
        reason: String,
    },
    /// Rank 0 could not start the store server.
    #[error("rank 0 could not start the store server on {addr}: {reason}")]
    Bind {
        /// The address it tried.
        addr: String,
        /// Why.
        reason: String,
    },
    /// Not all ranks joined in time.
    #[error("rendezvous timed out after {timeout:?}: {arrived} of {world_size} ranks arrived")]
    JoinTimeout {
        /// Ranks counted at the deadline.
        arrived: i64,
        /// Ranks expected.
        world_size: usize,
        /// The limit.
        timeout: Duration,
    },
    /// The store failed.
    #[error("rendezvous store error (rank {rank}): {source}")]
    Store {
        /// This process's rank.
        rank: usize,
        /// The store's error.
        #[source]
        source: StoreError,
    },
}

/// Rendezvous through `url`, reading `env://` variables from the process environment.
pub async fn rendezvous(
    url: &str,
    options: RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    rendezvous_with_env(url, options, |name| std::env::var(name).ok()).await
}

/// Like [`rendezvous`], with the environment given as a lookup function (for launchers and
/// tests that must not touch the process environment).
pub async fn rendezvous_with_env(
    url: &str,
    options: RendezvousOptions,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Rendezvous, RendezvousError> {
    let mut options = options;
    match parse(url, &env)? {
        Target::Tcp {
            host,
            port,
            rank,
            world_size,
        } => {
            match store_host(&host, port, &env) {
                StoreHost::RankZero => {}
                // `tensorwire launch --nnodes N` serves the job's store itself (and watches it
                // for failures); rank 0 then connects to it like every other rank.
                StoreHost::Launcher => options.embed_server = false,
                StoreHost::TorchElasticAgent => {
                    if options.secret.is_some() {
                        info!(
                            "connecting to torchrun's store at {host}:{port} without the cluster \
                             secret (PyTorch's TCPStore has none); connections between workers \
                             still prove it"
                        );
                    }
                    options.embed_server = false;
                    options.secret = None;
                }
            }
            tcp(host, port, rank, world_size, options).await
        }
        Target::File {
            path,
            rank,
            world_size,
        } => {
            // Without a fixed size, no handle removes the file (PyTorch's `FileStore(path, -1)`).
            let store = FileStore::with_timeout(&path, world_size, options.timeout);
            if let Some(world_size) = world_size.filter(|_| options.wait_for_all) {
                join(&store, "init/", world_size, rank, options.timeout).await?;
            }
            Ok(Rendezvous {
                store: Arc::new(store),
                rank,
                world_size: world_size.unwrap_or(rank + 1),
                server: None,
            })
        }
    }
}

/// A parsed rendezvous URL.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Tcp {
        host: String,
        port: u16,
        rank: usize,
        /// `None`: a group of no fixed size (`world_size=-1`).
        world_size: Option<usize>,
    },
    File {
        path: String,
        rank: usize,
        world_size: Option<usize>,
    },
}

fn parse(url: &str, env: &impl Fn(&str) -> Option<String>) -> Result<Target, RendezvousError> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    let invalid = |reason: String| RendezvousError::Invalid {
        scheme: scheme.to_owned(),
        reason,
    };
    let query = query_pairs(query).map_err(&invalid)?;
    let from_query = |name: &str| {
        query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let int = |name: &str, value: String| -> Result<usize, RendezvousError> {
        value.trim().parse::<usize>().map_err(|_| {
            invalid(format!(
                "{name} must be a non-negative integer, got {value:?}"
            ))
        })
    };
    // PyTorch's `rendezvous(url, rank, world_size=None)` writes `world_size=-1`: no fixed size.
    let size = |name: &str, value: String| -> Result<Option<usize>, RendezvousError> {
        if value.trim() == "-1" {
            Ok(None)
        } else {
            int(name, value).map(Some)
        }
    };
    let target = match scheme {
        "env" => {
            // PyTorch's order and wording; an empty variable counts as not set. Slurm's
            // variables stand in for unset ones (see `launcher_env`).
            let var = |name: &str| {
                launcher_var(name, env)
                    .map_err(|e| invalid(e.to_string()))?
                    .ok_or_else(|| {
                        invalid(format!("environment variable {name} expected, but not set"))
                    })
            };
            let rank = match from_query("rank") {
                Some(v) => int("rank", v)?,
                None => int("RANK", var("RANK")?)?,
            };
            let world_size = match from_query("world_size") {
                Some(v) => size("world_size", v)?,
                None => size("WORLD_SIZE", var("WORLD_SIZE")?)?,
            };
            let host = var("MASTER_ADDR")?;
            let port = int("MASTER_PORT", var("MASTER_PORT")?)?;
            Target::Tcp {
                host,
                port: port_u16(port).map_err(&invalid)?,
                rank,
                world_size,
            }
        }
        "tcp" => {
            let authority = before_query.split('/').next().unwrap_or_default();
            let (host, port) = split_host_port(authority);
            let port = match port {
                Some(p) if !p.is_empty() => int("port", p.to_owned())?,
                _ => 0,
            };
            if port == 0 {
                return Err(invalid("port number missing".to_owned()));
            }
            let rank =
                from_query("rank").ok_or_else(|| invalid("rank parameter missing".to_owned()))?;
            let world_size = from_query("world_size")
                .ok_or_else(|| invalid("world size parameter missing".to_owned()))?;
            if host.is_empty() {
                return Err(invalid("host name missing".to_owned()));
            }
            Target::Tcp {
                host: host.to_owned(),
                port: port_u16(port).map_err(&invalid)?,
                rank: int("rank", rank)?,
                world_size: size("world_size", world_size)?,
            }
        }
        "file" => {
            // As Python's urlparse: the path starts at the first '/' after the authority.
            let path = before_query
                .find('/')
                .map(|i| &before_query[i..])
                .unwrap_or("");
            if path.is_empty() {
                return Err(invalid("path missing".to_owned()));
            }
            let rank =
                from_query("rank").ok_or_else(|| invalid("rank parameter missing".to_owned()))?;
            let world_size = from_query("world_size")
                .ok_or_else(|| invalid("world size parameter missing".to_owned()))?;
            Target::File {
                path: path.to_owned(),
                rank: int("rank", rank)?,
                world_size: size("world_size", world_size)?,
            }
        }
        other => {
            return Err(RendezvousError::UnknownScheme {
                scheme: other.to_owned(),
            })
        }
    };
    let (rank, world_size) = match &target {
        Target::Tcp {
            rank, world_size, ..
        }
        | Target::File {
            rank, world_size, ..
        } => (*rank, *world_size),
    };
    if world_size == Some(0) {
        return Err(invalid("world size must be at least 1".to_owned()));
    }
    if let Some(world_size) = world_size.filter(|&n| rank >= n) {
        return Err(invalid(format!(
            "rank {rank} is not below the world size {world_size}"
        )));
    }
    Ok(target)
}

/// `rank=0&world_size=2` as pairs (PyTorch's `_query_to_dict`; empty parts are skipped).
fn query_pairs(query: &str) -> Result<Vec<(String, String)>, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| format!("query parameter {pair:?} has no '='"))
        })
        .collect()
}

fn split_host_port(authority: &str) -> (&str, Option<&str>) {
    if let Some(rest) = authority.strip_prefix('[') {
        // [v6]:port
        if let Some((host, after)) = rest.split_once(']') {
            return (host, after.strip_prefix(':'));
        }
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (authority, None),
    }
}

fn port_u16(port: usize) -> Result<u16, String> {
    u16::try_from(port).map_err(|_| format!("port must have value from 0 to 65535 but was {port}."))
}

async fn tcp(
    host: String,
    port: u16,
    rank: usize,
    world_size: Option<usize>,
    options: RendezvousOptions,
) -> Result<Rendezvous, RendezvousError> {
    let store_err = |source| RendezvousError::Store { rank, source };
    let server = if rank == 0 && options.embed_server {
        let bind = match options.bind_addr {
            Some(ip) => SocketAddr::new(ip, port),
            None => resolve(&host, port)
                .await
                .map_err(|reason| RendezvousError::Bind {
                    addr: format!("{host}:{port}"),
                    reason,
                })?,
        };
        let config = ServerConfig {
            secret: options.secret.clone(),
            ..ServerConfig::default()
        };
        let server =
            TcpStoreServer::bind(bind, config)
                .await
                .map_err(|e| RendezvousError::Bind {
                    addr: bind.to_string(),
                    reason: e.to_string(),
                })?;
        info!(addr = %server.local_addr(), ?world_size, "rank 0 hosts the store");
        Some(server)
    } else {
        None
    };
    let addr = match &server {
        Some(s) => {
            let mut local = s.local_addr();
            if local.ip().is_unspecified() {
                local.set_ip(if local.is_ipv4() {
                    IpAddr::from([127, 0, 0, 1])
                } else {
                    IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
                });
            }
            local.to_string()
        }
        None if host.contains(':') => format!("[{host}]:{port}"),
        None => format!("{host}:{port}"),
    };
    let client = TcpStoreClient::connect(
        &addr,
        ClientConfig {
            timeout: options.timeout,
            connect_timeout: options.timeout,
            secret: options.secret.clone(),
            ..ClientConfig::default()
        },
    )
    .await
    .map_err(store_err)?;
    if let Some(world_size) = world_size.filter(|_| options.wait_for_all) {
        join(
            &client.with_prefix(""),
            JOIN_COUNTER,
            world_size,
            rank,
            options.timeout,
        )
        .await?;
    }
    Ok(Rendezvous {
        store: Arc::new(client),
        rank,
        world_size: world_size.unwrap_or(rank + 1),
        server,
    })
}

async fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))
}

/// Counts this rank in under `counter` and waits until `world_size` ranks are in.
///
/// The rank that completes the count sets a key that releases the parked others at once; the
/// count is also re-read now and then (backing off to 1 s), so that ranks which only count
/// themselves in, as PyTorch's do, complete the join too.
async fn join(
    store: &dyn Store,
    counter: &str,
    world_size: usize,
    rank: usize,
    timeout: Duration,
) -> Result<(), RendezvousError> {
    let store_err = |source| RendezvousError::Store { rank, source };
    let done = format!("{counter}complete");
    let done = if counter == JOIN_COUNTER {
        JOIN_DONE
    } else {
        done.as_str()
    };
    let deadline = Instant::now() + timeout;
    let arrived = store.add(counter, 1).await.map_err(store_err)?;
    debug!(rank, arrived, world_size, "joined");
    if arrived >= world_size as i64 {
        store.set(done, b"1").await.map_err(store_err)?;
        return Ok(());
    }
    let mut step = Duration::from_millis(10);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            let arrived = store.add(counter, 0).await.map_err(store_err)?;
            return Err(RendezvousError::JoinTimeout {
                arrived,
                world_size,
                timeout,
            });
        }
        match store.wait(&[done], step.min(remaining)).await {
            Ok(()) => return Ok(()),
            Err(StoreError::Timeout { .. }) => {
                if store.add(counter, 0).await.map_err(store_err)? >= world_size as i64 {
                    store.set(done, b"1").await.map_err(store_err)?;
                    return Ok(());
                }
                step = (step * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(store_err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    fn err(url: &str, vars: &[(&str, &str)]) -> String {
        parse(url, &env_of(vars)).unwrap_err().to_string()
    }

    #[test]
    fn env_errors_are_pytorchs_in_pytorchs_order() {
        let all = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        for missing in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            let vars: Vec<_> = all.iter().copied().filter(|(k, _)| *k != missing).collect();
            assert_eq!(
                err("env://", &vars),
                format!(
                    "Error initializing torch.distributed using env:// rendezvous: environment variable {missing} expected, but not set"
                )
            );
        }
        // Empty counts as unset, as in PyTorch.
        let mut vars = all.to_vec();
        vars[2] = ("MASTER_ADDR", "");
        assert!(err("env://", &vars)
            .ends_with("environment variable MASTER_ADDR expected, but not set"));
        assert_eq!(
            parse("env://", &env_of(&all)).unwrap(),
            Target::Tcp {
                host: "10.0.0.1".into(),
                port: 29500,
                rank: 1,
                world_size: Some(2)
            }
        );
        // The query overrides RANK and WORLD_SIZE.
        assert_eq!(
            parse("env://?rank=0&world_size=4", &env_of(&all[2..])).unwrap(),
            Target::Tcp {
                host: "10.0.0.1".into(),
                port: 29500,
                rank: 0,
                world_size: Some(4)
            }
        );
    }

    #[test]
    fn env_reads_slurm_where_explicit_variables_are_unset() {
        let slurm = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_JOB_NODELIST", "node[07-09]"),
            ("SLURM_JOB_ID", "123"),
        ];
        assert_eq!(
            parse("env://", &env_of(&slurm)).unwrap(),
            Target::Tcp {
                host: "node07".into(),
                port: 15123,
                rank: 3,
                world_size: Some(6)
            }
        );
        let mut vars = slurm.to_vec();
        vars.extend([("MASTER_ADDR", "10.0.0.9"), ("RANK", "1")]);
        assert_eq!(
            parse("env://", &env_of(&vars)).unwrap(),
            Target::Tcp {
                host: "10.0.0.9".into(),
                port: 15123,
                rank: 1,
                world_size: Some(6)
            }
        );
        let mut vars = slurm.to_vec();
        vars[2] = ("SLURM_JOB_NODELIST", "node[07-");
        assert_eq!(
            err("env://", &vars),
            "Error initializing torch.distributed using env:// rendezvous: cannot take MASTER_ADDR from SLURM_JOB_NODELIST: host list \"node[07-\" has unbalanced brackets"
        );
    }

    #[test]
    fn tcp_and_file_errors_are_pytorchs() {
        let p = "Error initializing torch.distributed using";
        assert_eq!(
            err("tcp://h?rank=0&world_size=1", &[]),
            format!("{p} tcp:// rendezvous: port number missing")
        );
        assert_eq!(
            err("tcp://h:0?rank=0&world_size=1", &[]),
            format!("{p} tcp:// rendezvous: port number missing")
        );
        assert_eq!(
            err("tcp://h:1?world_size=1", &[]),
            format!("{p} tcp:// rendezvous: rank parameter missing")
        );
        assert_eq!(
            err("tcp://h:1?rank=0", &[]),
            format!("{p} tcp:// rendezvous: world size parameter missing")
        );
        assert_eq!(
            err("file://?rank=0&world_size=1", &[]),
            format!("{p} file:// rendezvous: path missing")
        );
        assert_eq!(
            err("file:///tmp/x?world_size=1", &[]),
            format!("{p} file:// rendezvous: rank parameter missing")
        );
        assert_eq!(
            err("file:///tmp/x?rank=0", &[]),
            format!("{p} file:// rendezvous: world size parameter missing")
        );
        assert_eq!(err("gloo://x", &[]), "No rendezvous handler for gloo://");
        assert!(err("tcp://h:1?rank=x&world_size=1", &[])
            .contains("rank must be a non-negative integer, got \"x\""));
        assert!(err("tcp://h:1?rank=2&world_size=2", &[])
            .contains("rank 2 is not below the world size 2"));
        assert!(err("tcp://h:70000?rank=0&world_size=1", &[])
            .contains("port must have value from 0 to 65535 but was 70000."));
    }

    #[test]
    fn the_store_host_follows_the_launcher() {
        let torchrun = [
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let host = |vars: &[(&str, &str)], h: &str, p: u16| store_host(h, p, env_of(vars));
        assert_eq!(host(&[], "10.0.0.1", 29500), StoreHost::RankZero);
        assert_eq!(
            host(&torchrun, "10.0.0.1", 29500),
            StoreHost::TorchElasticAgent
        );
        // The agent serves MASTER_ADDR:MASTER_PORT only (PyTorch's `_agent_store_serves`).
        assert_eq!(host(&torchrun, "10.0.0.1", 29501), StoreHost::RankZero);
        assert_eq!(host(&torchrun, "10.0.0.2", 29500), StoreHost::RankZero);
        // PyTorch compares with str(True) exactly.
        let mut vars = torchrun.to_vec();
        vars[0] = ("TORCHELASTIC_USE_AGENT_STORE", "1");
        assert_eq!(host(&vars, "10.0.0.1", 29500), StoreHost::RankZero);
        // tensorwire's launcher: its store, unless torchrun's agent serves this port.
        let launcher = [("TENSORWIRE_LAUNCHER_STORE", "1")];
        assert_eq!(host(&launcher, "10.0.0.1", 29500), StoreHost::Launcher);
        let mut vars = torchrun.to_vec();
        vars.extend(launcher);
        assert_eq!(host(&vars, "10.0.0.1", 29500), StoreHost::TorchElasticAgent);
        assert_eq!(host(&vars, "10.0.0.1", 29501), StoreHost::Launcher);
    }

    #[test]
    fn a_world_size_of_minus_one_is_no_fixed_size() {
        assert_eq!(
            parse("file:///tmp/rdzv?rank=5&world_size=-1", &env_of(&[])).unwrap(),
            Target::File {
                path: "/tmp/rdzv".into(),
                rank: 5,
                world_size: None
            }
        );
        assert!(err("tcp://h:1?rank=0&world_size=-2", &[])
            .contains("world_size must be a non-negative integer, got \"-2\""));
    }

    #[test]
    fn urls_parse() {
        assert_eq!(
            parse("tcp://127.0.0.1:23456?rank=1&world_size=3", &env_of(&[])).unwrap(),
            Target::Tcp {
                host: "127.0.0.1".into(),
                port: 23456,
                rank: 1,
                world_size: Some(3)
            }
        );
        assert_eq!(
            parse("tcp://[::1]:5?world_size=2&rank=0", &env_of(&[])).unwrap(),
            Target::Tcp {
                host: "::1".into(),
                port: 5,
                rank: 0,
                world_size: Some(2)
            }
        );
        assert_eq!(
            parse("file:///tmp/rdzv?rank=0&world_size=2", &env_of(&[])).unwrap(),
            Target::File {
                path: "/tmp/rdzv".into(),
                rank: 0,
                world_size: Some(2)
            }
        );
    }
}
