//! `init_rpc`, the user's entry point: the rendezvous, then the backend named in the options,
//! which starts the agent (`crate::init::start_agent`). Above the backends, so that a backend
//! can start an agent without this module and this module can pick a backend.

use tensorwire_core::auth::ClusterSecret;
use tensorwire_core::name::check_worker_name;
use tensorwire_core::protocol::start;
use tensorwire_process_group::{rendezvous, RendezvousOptions};

use crate::error::{InitError, RpcError};
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
    start::check_rank(rank, world_size)?;
    options.endpoint.check().map_err(InitError::Endpoint)?;
    let backend = crate::backend::lookup(&options.backend)?;
    let secret = secret_bytes(&options);
    let rdv_options = RendezvousOptions {
        timeout: options.init_timeout,
        secret: secret.and_then(|s| ClusterSecret::new(s).ok()),
        // A dynamic group has no size to wait for: rank 0 hosts the store, the others join it.
        wait_for_all: world_size.is_some(),
        ..RendezvousOptions::default()
    };
    let url = start::rendezvous_url(&options.init_method, rank, world_size);
    let rdv = rendezvous(&url, rdv_options).await?;
    start::check_rendezvous((rank, world_size), (rdv.rank, rdv.world_size))?;
    backend
        .init_backend(rdv, name, rank, world_size, options)
        .await
}
