//! Starting an agent: `start_agent` (a backend's entry point, called by `init_rpc` through the
//! backend), and what static and dynamic groups share (the group's kind in the store,
//! the cluster secret, the advertised address). A static group's init is in
//! [`static_group`]; a dynamic group's join in [`dynamic`].

pub(crate) mod dynamic;
pub(crate) mod static_group;

use std::net::IpAddr;
use std::sync::Arc;

use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::name::check_worker_name;
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::Transport;
use tensorwire_core::protocol::start::{self, GroupKind};
use tensorwire_core::protocol::WorkerId;
use tensorwire_process_group::Rendezvous;
use tracing::info;

use crate::driver::drive;
use crate::error::{InitError, RpcError};
use crate::options::RpcOptions;
use crate::state::Agent;
use static_group::join_static;

pub(crate) fn secret_bytes(options: &RpcOptions) -> Option<Vec<u8>> {
    options.secret.clone().or_else(|| {
        std::env::var_os(tensorwire_process_group::env_init::SECRET_ENV)
            .filter(|v| !v.is_empty())
            .map(|v| v.into_encoded_bytes())
    })
}

/// The address peers reach us at: the configured one, else `TENSORWIRE_IFNAME`'s, else the
/// local address that routes to `MASTER_ADDR`, else loopback; a loopback address in a group
/// that spans hosts is an error (see `tensorwire_process_group::address`).
pub(crate) fn advertise_ip(options: &RpcOptions) -> Result<IpAddr, RpcError> {
    Ok(tensorwire_process_group::advertise_ip(options.listen_ip)?)
}

/// The store key that holds a group's kind (`static` or `dynamic`).
pub(crate) const GROUP_KIND: &str = start::GROUP_KIND_KEY;

/// Records the group's kind in the store on first use; core refuses a worker of the other
/// kind.
async fn guard_group_kind(store: &dyn Store, kind: GroupKind) -> Result<(), RpcError> {
    let held = store
        .compare_set(GROUP_KIND, b"", kind.name().as_bytes())
        .await?;
    Ok(kind.admits(&held)?)
}

/// The cluster secret from the options, else from `TENSORWIRE_SECRET`.
#[cfg_attr(not(feature = "tcp"), allow(dead_code))] // the TCP backends use it
pub(crate) fn cluster_secret(options: &RpcOptions) -> Result<Option<ClusterSecret>, RpcError> {
    secret_bytes(options)
        .map(ClusterSecret::new)
        .transpose()
        .map_err(RpcError::Secret)
}

/// The agent over `transport`, for a backend's `init_backend`: the world process group over
/// `transport` on the rendezvous store, an `all_gather_object` of the worker records, their
/// validation, then the agent over the group's connections (see
/// [`init_rpc`](crate::init_rpc()) for what that guarantees). With `world_size = None` it joins a dynamic group instead. A static init that
/// fails shuts the group and the rendezvous down (a store this worker hosts is closed) before
/// it returns the error.
pub async fn start_agent(
    transport: Arc<dyn Transport>,
    rdv: Rendezvous,
    name: &str,
    rank: usize,
    world_size: Option<usize>,
    options: RpcOptions,
) -> Result<Agent, RpcError> {
    let checked = match check_worker_name(name)
        .map_err(RpcError::from)
        .and_then(|()| (options.endpoint.check()).map_err(|e| InitError::Endpoint(e).into()))
    {
        Ok(()) => guard_group_kind(&*rdv.store, GroupKind::of(world_size)).await,
        Err(e) => Err(e),
    };
    if let Err(e) = checked {
        rdv.shutdown().await;
        return Err(e);
    }
    let Some(world_size) = world_size else {
        return dynamic::join(transport, rdv, name, rank, options).await;
    };
    let runtime = Arc::clone(&options.runtime);
    let started = runtime.now();
    let budget = tensorwire_core::budget::Budget::new(options.endpoint.peer_budget);
    let (group, records) =
        match join_static(transport, &rdv, name, rank, world_size, &options, &budget).await {
            Ok(joined) => joined,
            Err(e) => {
                rdv.shutdown().await;
                return Err(e);
            }
        };
    let agent = Agent::new(
        name,
        rank as WorkerId,
        false,
        &records,
        &rdv,
        &options,
        budget,
    );
    agent.lock().owned.rendezvous = Some(rdv);
    if let Err(e) = static_group::attach_group(&agent, group, options.init_timeout).await {
        agent.stop_and_release(agent.now()).await;
        return Err(e);
    }
    agent.spawn(drive(agent.clone()));
    info!(worker = %agent.inner.me, world_size, took = ?runtime.now().saturating_duration_since(started), "RPC agent started");
    Ok(agent)
}
