//! Starting an agent: `init_rpc` (rendezvous, then the backend), `start_agent` (a backend's
//! entry point), and what static and dynamic groups share (the group's kind in the store,
//! the cluster secret, the advertised address, the rendezvous URLs). A static group's init is
//! in [`static_group`]; a dynamic group's join in `crate::dynamic`.

pub(crate) mod static_group;

use std::net::IpAddr;
use std::sync::{Arc, PoisonError};

use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::name::check_worker_name;
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::Transport;
use tensorwire_core::protocol::WorkerId;
use tensorwire_process_group::{rendezvous, Rendezvous, RendezvousOptions};
use tracing::info;

use crate::driver::drive;
use crate::error::RpcError;
use crate::options::RpcOptions;
use crate::state::Agent;
use static_group::join_static;

fn secret_bytes(options: &RpcOptions) -> Option<Vec<u8>> {
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

/// Starts the agent of worker `name` with rank `rank` in a static group of `world_size`
/// workers, as PyTorch's `init_rpc`: rendezvous, then the backend named in `options.backend`
/// (see [`register_backend`](crate::register_backend); `TCP` by default) sets up the world
/// process group over its transport (one connection per pair of workers), gathers every
/// worker's record (name, devices, device maps) with its `all_gather_object`, validates them
/// (the same error on every worker: duplicate names, bad device maps), and starts the agent over
/// the group's connections, ending with a barrier. Calls and the group's collectives share
/// those connections; the store holds no worker record at any time.
///
/// In a static group, when `init_rpc` returns on any worker, every worker is connected to every
/// other, and no worker still needs the store for init: rank 0, which hosts the store, may
/// shut down and exit at once without failing anyone's init. An init that does not finish in
/// `init_timeout` fails with [`RpcError::Timeout`] naming the ranks it waited for.
///
/// With `world_size = None` the group is dynamic: the worker joins the members that are there
/// (rank 0 first: it hosts the store), validating everyone's device maps by the dynamic rules,
/// and `shutdown` makes it leave; see the `dynamic` module of this crate. A dynamic group has
/// no process group (nor has PyTorch's), but dials and greets with the same functions
/// (`tensorwire_process_group::link`). Static and dynamic workers never share a group.
pub async fn init_rpc(
    name: &str,
    rank: usize,
    world_size: Option<usize>,
    options: RpcOptions,
) -> Result<Agent, RpcError> {
    check_worker_name(name)?;
    if let Some(world_size) = world_size {
        if rank >= world_size {
            return Err(RpcError::RankOutOfRange { rank, world_size });
        }
    }
    let backend = crate::backend::lookup(&options.backend)?;
    let secret = secret_bytes(&options);
    let rdv_options = RendezvousOptions {
        timeout: options.init_timeout,
        secret: secret.and_then(|s| ClusterSecret::new(s).ok()),
        // A dynamic group has no size to wait for: rank 0 hosts the store, the others join it.
        wait_for_all: world_size.is_some(),
        ..RendezvousOptions::default()
    };
    let url = match world_size {
        Some(n) => with_rank(&options.init_method, rank, n),
        None => dynamic_url(&options.init_method, rank),
    };
    let rdv = rendezvous(&url, rdv_options).await?;
    if rdv.rank != rank || world_size.is_some_and(|n| rdv.world_size != n) {
        return Err(RpcError::RendezvousMismatch {
            rank,
            world_size,
            got_rank: rdv.rank,
            got_world_size: rdv.world_size,
        });
    }
    backend
        .init_backend(rdv, name, rank, world_size, options)
        .await
}

/// The rendezvous URL of a dynamic group's member: its rank, and a nominal world size that
/// covers it (the rendezvous needs one; nobody waits for it).
fn dynamic_url(url: &str, rank: usize) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut pairs: Vec<String> = query
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with("rank=") && !p.starts_with("world_size="))
        .map(str::to_owned)
        .collect();
    pairs.push(format!("rank={rank}"));
    pairs.push(format!("world_size={}", rank + 1));
    format!("{base}?{}", pairs.join("&"))
}

/// The store key that holds a group's kind (`static` or `dynamic`).
pub(crate) const GROUP_KIND: &str = "rpc/group_kind";

/// Records the group's kind in the store on first use; a worker of the other kind is refused.
async fn guard_group_kind(store: &dyn Store, dynamic: bool) -> Result<(), RpcError> {
    let kind = if dynamic { "dynamic" } else { "static" };
    let held = store.compare_set(GROUP_KIND, b"", kind.as_bytes()).await?;
    if held != kind.as_bytes() {
        return Err(RpcError::GroupKindMismatch {
            group: String::from_utf8_lossy(&held).into_owned(),
            worker: kind,
        });
    }
    Ok(())
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
/// validation, then the agent over the group's connections (see [`init_rpc`] for what that
/// guarantees). With `world_size = None` it joins a dynamic group instead. A static init that
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
    let checked = match check_worker_name(name) {
        Ok(()) => guard_group_kind(&*rdv.store, world_size.is_none()).await,
        Err(e) => Err(e.into()),
    };
    if let Err(e) = checked {
        rdv.shutdown().await;
        return Err(e);
    }
    let Some(world_size) = world_size else {
        return crate::dynamic::join(transport, rdv, name, rank, options).await;
    };
    let runtime = Arc::clone(&options.runtime);
    let started = runtime.now();
    let (group, records) =
        match join_static(transport, &rdv, name, rank, world_size, &options).await {
            Ok(joined) => joined,
            Err(e) => {
                rdv.shutdown().await;
                return Err(e);
            }
        };
    let agent = Agent::new(name, rank as WorkerId, false, &records, &rdv, &options);
    *agent
        .inner
        .rendezvous
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(rdv);
    if let Err(e) = static_group::attach_group(&agent, group, options.init_timeout).await {
        agent.stop_and_release(agent.now()).await;
        return Err(e);
    }
    agent.spawn(drive(agent.clone()));
    info!(worker = %agent.inner.me, world_size, took = ?runtime.now().saturating_duration_since(started), "RPC agent started");
    Ok(agent)
}

/// `url` with `rank` and `world_size` added to its query where it lacks them, for every scheme,
/// as PyTorch's `rendezvous(url, rank, world_size)` does: `tcp://host:port` and
/// `file:///path` work without repeating what `init_rpc` was given.
fn with_rank(url: &str, rank: usize, world_size: usize) -> String {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let has = |key: &str| query.split('&').any(|kv| kv.split('=').next() == Some(key));
    let mut out = url.to_owned();
    for (key, value) in [("rank", rank), ("world_size", world_size)] {
        if !has(key) {
            out.push(if out.contains('?') { '&' } else { '?' });
            out.push_str(&format!("{key}={value}"));
        }
    }
    out
}

pub(crate) fn rank_only(rank: usize) -> String {
    format!("rank {rank}")
}

#[cfg(test)]
mod tests {
    use super::with_rank;

    #[test]
    fn init_urls_get_the_missing_rank_and_world_size() {
        assert_eq!(with_rank("env://", 1, 4), "env://?rank=1&world_size=4");
        assert_eq!(
            with_rank("tcp://10.0.0.1:29500", 0, 2),
            "tcp://10.0.0.1:29500?rank=0&world_size=2"
        );
        assert_eq!(
            with_rank("file:///tmp/x?world_size=2", 1, 2),
            "file:///tmp/x?world_size=2&rank=1"
        );
        assert_eq!(
            with_rank("tcp://h:1?rank=3&world_size=5", 3, 5),
            "tcp://h:1?rank=3&world_size=5"
        );
    }
}
