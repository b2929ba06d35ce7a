//! `init_rpc`, the user's entry point: the rendezvous, then the backend named in the options,
//! which starts the agent (`crate::init::start_agent`). Above the backends, so that a backend
//! can start an agent without this module and this module can pick a backend.

use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::name::check_worker_name;
use tensorwire_process_group::{rendezvous, RendezvousOptions};

use crate::error::RpcError;
use crate::init::secret_bytes;
use crate::options::RpcOptions;
use crate::state::Agent;

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
/// and `shutdown` makes it leave; see `init::dynamic` in this crate. A dynamic group has
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

/// The rendezvous URL of a dynamic group's member: its rank, and `world_size=-1` (no fixed
/// size, as PyTorch writes it): nobody waits for a count, and no store handle counts the
/// others out (a `file://` store stays while members come and go).
fn dynamic_url(url: &str, rank: usize) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut pairs: Vec<String> = query
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with("rank=") && !p.starts_with("world_size="))
        .map(str::to_owned)
        .collect();
    pairs.push(format!("rank={rank}"));
    pairs.push("world_size=-1".to_owned());
    format!("{base}?{}", pairs.join("&"))
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
