//! The agent's errors.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::auth::AuthError;
use tensorwire_core::device::DeviceParseError;
use tensorwire_core::name::NameError;
use tensorwire_core::ports::store::StoreError;
use tensorwire_core::ports::transport::TransportError;
use tensorwire_core::protocol::{CallError, RemoteError, WorkerId};
use tensorwire_core::validate::DeviceMapError;
use tensorwire_rendezvous::RendezvousError;

use tensorwire_core::protocol::membership::{LastTry, WorkerInfo};
use tensorwire_core::protocol::mesh::MeshFrameError;
use tensorwire_core::protocol::start::StartError;
use tensorwire_mesh::link::LinkError;

/// Who a wait that timed out was waiting for: kept as data (ranks, names, the error of the last
/// try), rendered only when displayed.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum WaitingFor {
    /// These workers, in rank order ("rank 2 (w2), ..."; "nobody in particular" when empty).
    Workers(Vec<WorkerInfo>),
    /// These ranks, whose names are not known yet (a static group's init exchanges names
    /// after its connections are up).
    Ranks(Vec<WorkerId>),
    /// The store, which did not answer.
    Store,
    /// A join retried until the deadline: the coordinator it last asked (its record's address)
    /// and why that try failed.
    LastTry(Arc<LastTry<IntroductionError>>),
}

/// Why a worker this one introduced itself to (a dynamic group's coordinator, or a member the
/// join asked it to connect to) did not welcome it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IntroductionError {
    /// It could not be reached, or the introduction could not be sent.
    #[error(transparent)]
    Unreachable(#[from] LinkError),
    /// It answered with something other than a welcome or a refusal.
    #[error("it answered the introduction with something else: {0}")]
    Garbled(#[source] MeshFrameError),
    /// The connection failed before its answer came.
    #[error("it did not welcome this worker: {0}")]
    NoWelcome(#[source] TransportError),
    /// No answer came within the limit.
    #[error("it did not answer the introduction")]
    NoAnswer,
}

impl WaitingFor {
    /// Whether it names worker `name` (a worker by its name, or a join's coordinator).
    pub fn names(&self, name: &str) -> bool {
        match self {
            WaitingFor::Workers(w) => w.iter().any(|w| w.name == name),
            WaitingFor::LastTry(last) => last.coordinator.name == name,
            WaitingFor::Ranks(_) | WaitingFor::Store => false,
        }
    }
}

impl std::fmt::Display for WaitingFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitingFor::Workers(w) => f.write_str(&by_rank(w)),
            WaitingFor::Ranks(ranks) => {
                let ranks: Vec<String> = ranks.iter().map(|r| format!("rank {r}")).collect();
                f.write_str(&ranks.join(", "))
            }
            WaitingFor::Store => f.write_str("the store, which did not answer"),
            WaitingFor::LastTry(last) => last.fmt(f),
        }
    }
}

/// `workers` as "rank 0 (w0), rank 1 (w1)" (as the agent's other waits name them), or
/// "nobody in particular".
fn by_rank(workers: &[WorkerInfo]) -> String {
    if workers.is_empty() {
        return "nobody in particular".to_owned();
    }
    workers
        .iter()
        .map(|w| format!("rank {} ({})", w.id, w.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `workers` as "w0 (rank 0), w1 (rank 1)", or `none` when there are none.
fn list(workers: &[WorkerInfo], none: &str) -> String {
    if workers.is_empty() {
        return none.to_owned();
    }
    workers
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why an agent could not start ([`RpcError::Init`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    /// The QUIC backend was given no folder for the cluster's TLS material.
    #[error("the QUIC backend needs RpcOptions::tls_dir or {env} (a folder for the cluster CA)")]
    NoTlsDir {
        /// The environment variable that names one.
        env: &'static str,
    },
    /// The cluster's TLS material in `dir` cannot be loaded, made or used.
    #[cfg(feature = "quic")]
    #[error("QUIC TLS material in {}: {source}", .dir.display())]
    Tls {
        /// The folder.
        dir: std::path::PathBuf,
        /// Why.
        #[source]
        source: tensorwire_transport_quic::QuicError,
    },
    /// The folder holds the cluster CA's certificate without its key (so no certificate can be
    /// issued here), and no certificate of this worker's (by name or by rank).
    #[error("QUIC TLS material in {}: the cluster CA is there without its key, and neither {name}.pem nor {}.pem (this worker's certificate)", .dir.display(), tensorwire_core::identity::rank_name(*.rank))]
    NoCertificate {
        /// The folder.
        dir: std::path::PathBuf,
        /// This worker's name.
        name: String,
        /// Its rank.
        rank: WorkerId,
    },
    /// The QUIC transport could not be set up (its liveness settings, its socket, ...).
    #[cfg(feature = "quic")]
    #[error("QUIC transport: {0}")]
    QuicTransport(#[source] tensorwire_transport_quic::QuicError),
    /// A dynamic group's coordinator has this worker's rank or name already.
    #[error("{} cannot join: {} is already a member", .joiner, .member)]
    AlreadyAMember {
        /// This worker.
        joiner: WorkerInfo,
        /// The member with its rank or name (the coordinator).
        member: WorkerInfo,
    },
    /// The coordinator of a dynamic group refused this worker, saying why.
    #[error("{coordinator} refused this worker: {reason}")]
    JoinRefused {
        /// The coordinator.
        coordinator: WorkerInfo,
        /// Its reason, as it sent it (text from another process).
        reason: String,
    },
    /// The coordinator's record in the store (`rpc/dyn/coordinator`) does not parse.
    #[error("the coordinator's record in the store: {0}")]
    CoordinatorRecord(#[source] tensorwire_core::codec::Undecodable),
    /// Joining a dynamic group failed for a reason the membership protocol gives (and no
    /// retry helps).
    #[error("joining the group: {0}")]
    Join(#[source] tensorwire_core::protocol::membership::MembershipError),
    /// A part of the agent that starts tasks was set up outside a tokio runtime.
    #[error("{what} must be called inside a tokio runtime ({why})")]
    NoRuntime {
        /// What was called.
        what: &'static str,
        /// Why it needs one.
        why: &'static str,
    },
    /// A setting of [`RpcOptions::endpoint`](crate::RpcOptions::endpoint) no agent can work
    /// with (core's check says which and why).
    #[error("the endpoint's settings: {0}")]
    Endpoint(#[source] tensorwire_core::protocol::ConfigError),
    /// The task starting the agent ended without its outcome (it panicked or was cancelled).
    #[error("the task starting the agent failed: {0}")]
    StartTask(#[source] tokio::task::JoinError),
}

/// What can go wrong in RPC.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The call failed: timeout, remote error or panic, unreachable peer, or RPC not running.
    #[error("RPC {function:?} to {to}: {source}")]
    Call {
        /// The callee's name.
        to: String,
        /// The function called.
        function: String,
        /// Why.
        #[source]
        source: CallError,
    },
    /// The call's tensors cannot go where the device maps say (a CUDA tensor without a map
    /// entry for its device, a device copy that failed, ...): nothing was sent. Or a result's
    /// tensors could not be placed where they land here.
    #[error("RPC {function:?} to {to}: {source}")]
    Tensors {
        /// The callee's name.
        to: String,
        /// The function called.
        function: String,
        /// What is wrong.
        #[source]
        source: Box<tensorwire_core::protocol::tensors::TensorTransferError>,
    },
    /// No worker has this name or rank.
    #[error("unknown worker {worker}; known workers: {}", list(.known, "none"))]
    UnknownWorker {
        /// The name, or "rank N", asked for.
        worker: String,
        /// The workers of the group at that moment, in rank order.
        known: Vec<WorkerInfo>,
    },
    /// Arguments or results could not be (de)serialized.
    #[error("cannot {what}: {source}")]
    Serialization {
        /// What failed, said with its verb ("encode the arguments of …").
        what: String,
        /// The codec's error (core's value codec, or postcard's for an all_gather value).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A worker name breaks the naming rule.
    #[error(transparent)]
    Name(#[from] NameError),
    /// The group's device maps are invalid (every worker fails init with this error).
    #[error("invalid device maps: {0}")]
    DeviceMaps(#[from] Box<DeviceMapError>),
    /// A device string is invalid.
    #[error(transparent)]
    Device(#[from] DeviceParseError),
    /// A device map change is refused (not one-to-one, or conflicting with an earlier entry).
    #[error("set_device_map({to:?}): {reason}")]
    DeviceMapConfig {
        /// The destination worker.
        to: String,
        /// Which entry, and which rule it breaks.
        #[source]
        reason: tensorwire_core::device::DeviceMapChange,
    },
    /// The RPC backend is not registered (the message lists the registered ones), or a name
    /// is registered twice.
    #[error(transparent)]
    Backend(#[from] tensorwire_core::registry::RegistryError),
    /// No address peers can reach could be chosen (a bad `TENSORWIRE_IFNAME`, or loopback in a
    /// group that spans hosts).
    #[error(transparent)]
    Address(#[from] tensorwire_rendezvous::AddressError),
    /// Rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// The process group under a static group failed (it carries the agent's init, barriers
    /// and all_gathers).
    #[error(transparent)]
    ProcessGroup(#[from] tensorwire_core::ports::process_group::ProcessGroupError),
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Init failed in a way that has no variant of its own here (a dynamic join refused, a
    /// backend's TLS material unusable, ...): the [`InitError`] says which, with its data.
    #[error("init_rpc: {0}")]
    Init(#[from] InitError),
    /// `init_rpc` cannot start with what it was given or what the rendezvous and the store
    /// say (a rank not below the world size, a rendezvous that assigned another rank, a group
    /// of the other kind): core decides it ([`StartError`]).
    #[error(transparent)]
    Start(#[from] StartError),
    /// The cluster secret cannot be used (it is empty).
    #[error("init_rpc: the cluster secret: {0}")]
    Secret(#[source] AuthError),
    /// In a static group's exchange of worker records, a rank sent another rank's record.
    #[error("init_rpc: rank {rank} sent the record of rank {claimed}")]
    RecordOfAnotherRank {
        /// The rank that sent it.
        rank: WorkerId,
        /// The rank the record claims.
        claimed: WorkerId,
    },
    /// Two workers of a group have the same name.
    #[error("init_rpc: worker name {name:?} is used by ranks {first} and {second}")]
    DuplicateName {
        /// The name.
        name: String,
        /// The lower rank using it.
        first: WorkerId,
        /// The other rank using it.
        second: WorkerId,
    },
    /// A worker gave a name its credentials are not issued for (QUIC node certificates: see
    /// `Connection::check_peer_name`). With a cluster secret every member may take any name,
    /// so this is only ever said where peers hold credentials of their own.
    #[error("init_rpc: rank {rank} says it is {name:?}, but {source}")]
    NotCertified {
        /// The rank.
        rank: WorkerId,
        /// The name it gave.
        name: String,
        /// What its credentials say.
        #[source]
        source: tensorwire_core::ports::transport::IdentityError,
    },
    /// Something did not happen in time outside a call (init, shutdown).
    #[error("{what} timed out after {:.1} s{}", .after.as_secs_f64(), .waiting_for.as_ref().map(|w| format!("; waiting for {w}")).unwrap_or_default())]
    Timeout {
        /// What timed out.
        what: String,
        /// The limit.
        after: Duration,
        /// Who did not answer, if known.
        waiting_for: Option<WaitingFor>,
    },
    /// A graceful shutdown could not complete because a member was lost before it was done.
    #[error("shutdown did not complete: {source}; waiting for {}", by_rank(.waiting_for))]
    ShutdownIncomplete {
        /// What was not done: the endpoint's account (the phase, the members missing, who
        /// reported the failure).
        #[source]
        source: tensorwire_core::protocol::ShutdownError,
        /// The workers it still waited for, in rank order.
        waiting_for: Vec<WorkerInfo>,
    },
    /// The agent is not running (shut down).
    #[error("RPC is no longer running on this worker")]
    NotRunning,
    /// Creating the value behind a remote reference failed, or its `remote()` timed out before
    /// the owner confirmed it; fetching it, calling methods on it and passing it on fail so.
    #[error("remote reference {rref} owned by {owner}: {source}")]
    RRefCreation {
        /// The reference.
        rref: String,
        /// Its owner.
        owner: String,
        /// The creation's error.
        #[source]
        source: CallError,
    },
    /// A function name is registered already on this worker ([`Functions`](crate::Functions)
    /// never replaces one silently).
    #[error("function {0:?} is already registered on this worker")]
    FunctionRegistered(String),
    /// A remote reference was used where it cannot be (a local value asked for on a user, a
    /// value of another type, ...).
    #[error("remote reference {rref}: {reason}")]
    RRef {
        /// The reference.
        rref: String,
        /// Why.
        #[source]
        reason: RRefError,
    },
    /// An argument of an agent method that cannot be used (the message says which and why).
    #[error("{0}")]
    InvalidArgument(String),
}

/// Why a remote reference could not be used ([`RpcError::RRef`]): core decides which and
/// says it.
pub use tensorwire_core::protocol::RRefError;

impl RpcError {
    /// The remote error, if the callee reported one.
    pub fn remote(&self) -> Option<&RemoteError> {
        match self {
            RpcError::Call {
                source: CallError::Remote(e),
                ..
            } => Some(e),
            _ => None,
        }
    }

    /// Whether the call timed out.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            RpcError::Call {
                source: CallError::Timeout { .. },
                ..
            } | RpcError::Timeout { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire_core::protocol::{Endpoint, EndpointConfig, Event, LostCause, ShutdownError};

    /// The error of a graceful shutdown whose member 2 was lost, as an endpoint reports it.
    fn lost_member() -> ShutdownError {
        let now = tensorwire_core::sim::Clock::new().now();
        let mut ep = Endpoint::<Vec<u8>>::new(0, EndpointConfig::default());
        ep.begin_graceful_shutdown([1, 2], None);
        ep.handle_peer_lost(2, LostCause::Shutdown, now);
        std::iter::from_fn(|| ep.poll_event())
            .find_map(|ev| match ev {
                Event::ShutdownComplete { outcome: Err(e) } => Some(e),
                _ => None,
            })
            .expect("a lost member fails the shutdown")
    }

    fn w(name: &str, id: WorkerId) -> WorkerInfo {
        WorkerInfo {
            name: name.to_owned(),
            id,
        }
    }

    #[test]
    fn lists_of_workers_are_rendered_when_displayed() {
        let e = RpcError::UnknownWorker {
            worker: "w9".into(),
            known: vec![w("w0", 0), w("w1", 1)],
        };
        assert_eq!(
            e.to_string(),
            "unknown worker w9; known workers: w0 (rank 0), w1 (rank 1)"
        );
        let e = RpcError::ShutdownIncomplete {
            source: lost_member(),
            waiting_for: vec![w("w2", 2)],
        };
        assert_eq!(
            e.to_string(),
            "shutdown did not complete: not every member reported that it is idle (a member \
             was lost: rank 2: it shut down); waiting for rank 2 (w2)"
        );
        let source = std::error::Error::source(&e).expect("the endpoint's error is the source");
        assert!(source.is::<ShutdownError>(), "{source:?}");
        let e = RpcError::ShutdownIncomplete {
            source: lost_member(),
            waiting_for: Vec::new(),
        };
        assert!(e.to_string().ends_with("waiting for nobody in particular"));
    }
}
