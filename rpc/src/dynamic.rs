//! Dynamic groups (`init_rpc` with `world_size = None`): workers join and leave while the group
//! runs, as in PyTorch's dynamic RPC.
//!
//! Joining and leaving are serialized by a token in the store (`rpc/dyn/token`, taken with
//! compare-and-set). Holding it, a joiner reads the member list (`rpc/dyn/members`), validates
//! every member's device plan with its own by the dynamic rules (maps may name workers that
//! have not joined yet), connects to every member and introduces itself (its address and device
//! plan); each member adds it, recomputes its reverse maps and device list, and welcomes it.
//! Only then is the joiner added to the list and the token released. A leaving worker waits for
//! its own calls, removes itself from the list under the token and closes its connections; the
//! others drop it from their membership. Rank 0 hosts the store, so it must stay until the end.

use std::time::Duration;

use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{Connection, Listener, Transport};
use tensorwire_core::protocol::WorkerId;
use tensorwire_core::validate::{validate_device_maps, GroupKind, WorkerDeviceInfo};
use tensorwire_core::wire::Frame;
use tensorwire_process_group::backoff::Backoff;
use tensorwire_process_group::Rendezvous;
use tracing::warn;

use crate::agent::{advertise_ip, connect_with_retry, drive, Agent, WorkerRecord};
use crate::codec::Hello;
use crate::error::RpcError;
use crate::options::RpcOptions;

const TOKEN: &str = "rpc/dyn/token";
const MEMBERS: &str = "rpc/dyn/members";
const WELCOME: &[u8] = b"tensorwire-welcome/1";

fn encode_err(what: &str, e: postcard::Error) -> RpcError {
    RpcError::Serialization {
        what: what.to_owned(),
        message: e.to_string(),
    }
}

/// Takes the membership token, waiting (bounded) while another worker holds it.
async fn acquire(store: &dyn Store, name: &str, timeout: Duration) -> Result<(), RpcError> {
    let deadline = tokio::time::Instant::now() + timeout;
    // The one backoff-with-jitter helper, as for every retry loop.
    let mut backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(50));
    loop {
        let held = store.compare_set(TOKEN, b"", name.as_bytes()).await?;
        if held == name.as_bytes() {
            return Ok(());
        }
        let delay = backoff.next_delay();
        if tokio::time::Instant::now() + delay > deadline {
            return Err(RpcError::Timeout {
                what: "waiting for the group's membership token".into(),
                after: timeout,
                waiting_for: Some(format!(
                    "{}, which holds it",
                    String::from_utf8_lossy(&held)
                )),
            });
        }
        tokio::time::sleep(delay).await;
    }
}

async fn release(store: &dyn Store, name: &str) {
    if let Err(e) = store.compare_set(TOKEN, name.as_bytes(), b"").await {
        warn!("could not release the membership token: {e}");
    }
}

async fn read_members(store: &dyn Store) -> Result<Vec<WorkerRecord>, RpcError> {
    if !store.check(&[MEMBERS]).await? {
        return Ok(Vec::new());
    }
    let bytes = store.get(MEMBERS).await?;
    postcard::from_bytes(&bytes).map_err(|e| encode_err("the member list", e))
}

async fn write_members(store: &dyn Store, members: &[WorkerRecord]) -> Result<(), RpcError> {
    let bytes = postcard::to_allocvec(members).map_err(|e| encode_err("the member list", e))?;
    store.set(MEMBERS, &bytes).await?;
    Ok(())
}

/// Joins the dynamic group of `rdv`'s store as worker `name` of rank `rank`.
pub(crate) async fn join(
    transport: std::sync::Arc<dyn Transport>,
    rdv: Rendezvous,
    name: &str,
    rank: usize,
    options: RpcOptions,
) -> Result<Agent, RpcError> {
    let store = std::sync::Arc::clone(&rdv.store);
    acquire(&*store, name, options.init_timeout).await?;
    let joined = join_holding_token(transport, rdv, name, rank, options).await;
    release(&*store, name).await;
    joined
}

async fn join_holding_token(
    transport: std::sync::Arc<dyn Transport>,
    rdv: Rendezvous,
    name: &str,
    rank: usize,
    options: RpcOptions,
) -> Result<Agent, RpcError> {
    let store = std::sync::Arc::clone(&rdv.store);
    let me_id = rank as WorkerId;
    let mut members = read_members(&*store).await?;
    if let Some(m) = members
        .iter()
        .find(|m| m.rank == me_id || m.devices.name == name)
    {
        return Err(RpcError::Init(format!(
            "{name} (rank {rank}) cannot join: {} (rank {}) is already a member",
            m.devices.name, m.rank
        )));
    }
    let listener = transport
        .listen(std::net::SocketAddr::new(advertise_ip(&options)?, 0))
        .await?;
    let record = WorkerRecord {
        rank: me_id,
        addr: listener.local_addr(),
        devices: WorkerDeviceInfo {
            name: name.to_owned(),
            device_count: options.device_backend.device_count(),
            devices: options.devices.clone(),
            device_maps: options.device_maps.clone(),
        },
    };
    let mut all = members.clone();
    all.push(record.clone());
    let infos: Vec<WorkerDeviceInfo> = all.iter().map(|r| r.devices.clone()).collect();
    validate_device_maps(&infos, GroupKind::Dynamic)
        .map_err(|e| RpcError::DeviceMaps(Box::new(e)))?;

    let agent = Agent::new(name, me_id, true, &all, &rdv, &options);
    *agent
        .inner
        .rendezvous
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(rdv);
    agent.spawn(accept_joiners(agent.clone(), listener));

    let hello = postcard::to_allocvec(&Hello {
        rank: me_id,
        name: name.to_owned(),
        record: Some(record.clone()),
    })
    .map_err(|e| encode_err("hello", e))?;
    for m in &members {
        let who = format!("{} (rank {}) at {}", m.devices.name, m.rank, m.addr);
        let conn = connect_with_retry(&*transport, m.addr, options.init_timeout)
            .await
            .map_err(|e| RpcError::Init(format!("cannot connect to {who}: {e}")))?;
        conn.send(Frame::control(hello.clone(), vec![])).await?;
        match tokio::time::timeout(options.init_timeout, conn.recv()).await {
            Ok(Ok(f)) if &f.header[..] == WELCOME => agent.attach(m.rank, conn),
            Ok(Ok(_)) => {
                return Err(RpcError::Init(format!(
                    "{who} answered the introduction with something else"
                )))
            }
            Ok(Err(e)) => {
                return Err(RpcError::Init(format!(
                    "{who} did not welcome this worker: {e}"
                )))
            }
            Err(_) => {
                return Err(RpcError::Timeout {
                    what: "joining the group".into(),
                    after: options.init_timeout,
                    waiting_for: Some(who),
                })
            }
        }
    }
    members.push(record);
    write_members(&*store, &members).await?;
    agent.spawn(drive(agent.clone()));
    Ok(agent)
}

/// Accepts the workers that join after this one, for as long as the agent runs.
async fn accept_joiners(agent: Agent, listener: Box<dyn Listener>) {
    loop {
        match listener.accept().await {
            Ok(conn) => {
                agent.spawn(welcome(agent.clone(), conn));
            }
            Err(e) => {
                warn!("the RPC listener failed; no worker can join through this one: {e}");
                return;
            }
        }
    }
}

async fn welcome(agent: Agent, conn: Box<dyn Connection>) {
    let peer = conn.peer_addr();
    let hello = match tokio::time::timeout(Duration::from_secs(30), conn.recv()).await {
        Ok(Ok(frame)) => postcard::from_bytes::<Hello>(&frame.header),
        Ok(Err(e)) => {
            warn!("dropping a connection from {peer} that failed before its introduction: {e}");
            return;
        }
        Err(_) => {
            warn!("dropping a connection from {peer} that sent no introduction in 30 s");
            return;
        }
    };
    let (rank, record) = match hello {
        Ok(Hello {
            rank,
            record: Some(record),
            ..
        }) if record.rank == rank => (rank, record),
        _ => {
            warn!("dropping a connection from {peer} that sent no valid introduction");
            return;
        }
    };
    agent.add_member(record);
    if let Err(e) = conn.send(Frame::control(WELCOME.to_vec(), vec![])).await {
        warn!("could not welcome rank {rank}: {e}");
        agent.remove_member(rank);
        return;
    }
    agent.attach(rank, conn);
}

/// Leaves the group: waits (bounded) for this worker's own calls, then removes it from the
/// member list under the token. The caller then closes the connections.
pub(crate) async fn leave(agent: &Agent, timeout: Duration) -> Result<(), RpcError> {
    let deadline = tokio::time::Instant::now() + timeout;
    // The endpoint decides when our calls are all answered (or fails by the deadline).
    agent
        .run_shutdown(timeout, |ep| ep.begin_leave(Some(deadline.into_std())))
        .await?;
    let store = agent.store()?;
    let name = agent.worker_info().name.clone();
    acquire(&*store, &name, deadline - tokio::time::Instant::now()).await?;
    let result = async {
        let mut members = read_members(&*store).await?;
        members.retain(|m| m.devices.name != name);
        if members.is_empty() {
            // The last member: the group ends, and with it every key the agents made.
            for key in [MEMBERS, crate::agent::GROUP_KIND, TOKEN] {
                store.delete_key(key).await?;
            }
            return Ok(true);
        }
        write_members(&*store, &members).await.map(|()| false)
    }
    .await;
    if !matches!(result, Ok(true)) {
        release(&*store, &name).await;
    }
    result.map(|_| ())
}
