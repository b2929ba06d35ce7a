//! Dynamic groups (`init_rpc` with `world_size = None`): workers join and leave while the group
//! runs, as in PyTorch's dynamic RPC.
//!
//! `tensorwire_core::protocol::membership::dynamic` decides everything: who coordinates, the
//! order of joins and leaves, when a joiner is complete, what a leave does. This module holds
//! the steps a caller waits on, joining and leaving; a running member's driver (messages over
//! the members' connections as control frames, dials, the timer, welcoming joiners) is
//! [`crate::membership`]. The store is used only where a joiner must find the group: the key `rpc/dyn/coordinator` holds the coordinating member's record
//! (written by the first member with compare-and-set, rewritten by a member that takes over
//! coordination, deleted with the group's kind by the last member's leave). Rank 0 hosts the
//! store (unless a launcher serves it), so no worker can join once it has left; the members
//! already in go on without it, and leave without it (the last one's cleanup of the store
//! then fails, which is logged).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::Transport;
use tensorwire_core::protocol::membership::{
    DynamicMembership, MemberRecord, MembershipError, WorkerInfo,
};
use tensorwire_core::protocol::WorkerId;
use tensorwire_core::validate::WorkerDeviceInfo;
use tensorwire_rendezvous::Rendezvous;
use tensorwire_store::backoff::Backoff;
use tokio::sync::oneshot;
use tracing::{debug, warn};

use crate::driver::drive;
use crate::error::{InitError, RpcError, WaitingFor};
use crate::init::advertise_ip;
use crate::membership::{
    self, accept_connections, introduce, with_membership, Introduction, COORDINATOR,
};
use crate::options::RpcOptions;
use crate::state::{Agent, WorkerRecord};

/// Joins the dynamic group of `rdv`'s store as worker `name` of rank `rank`.
pub(crate) async fn join(
    transport: Arc<dyn Transport>,
    rdv: Rendezvous,
    name: &str,
    rank: usize,
    options: RpcOptions,
) -> Result<Agent, RpcError> {
    let store = Arc::clone(&rdv.store);
    let me_id = rank as WorkerId;
    let runtime = Arc::clone(&options.runtime);
    let deadline = runtime.deadline_after(options.init_timeout);
    let listener = match transport
        .listen(std::net::SocketAddr::new(advertise_ip(&options)?, 0))
        .await
    {
        Ok(l) => l,
        Err(e) => {
            rdv.shutdown().await;
            return Err(e.into());
        }
    };
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
    let agent = Agent::new(
        name,
        me_id,
        true,
        std::slice::from_ref(&record),
        &rdv,
        &options,
        tensorwire_core::budget::Budget::new(options.endpoint.peer_budget),
    );
    membership::set_up(&agent, Arc::clone(&transport));
    agent.owned().rendezvous = Some(rdv);
    agent.spawn(accept_connections(agent.clone(), listener));
    agent.spawn(drive(agent.clone()));
    let mut backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(50));
    loop {
        let attempt = join_once(
            &agent,
            &*transport,
            &*store,
            &record,
            options.init_timeout,
            deadline,
        )
        .await;
        let delay = backoff.next_delay();
        match attempt {
            Ok(()) => return Ok(agent),
            Err(Attempt::Retry(why)) if runtime.now() + delay < deadline => {
                debug!("joining the group again: {why}");
                runtime.sleep(delay).await;
            }
            Err(Attempt::Retry(why)) => {
                agent.stop_and_release(agent.now()).await;
                return Err(RpcError::Timeout {
                    what: "joining the group".into(),
                    after: options.init_timeout,
                    waiting_for: Some(why),
                });
            }
            Err(Attempt::Fail(e)) => {
                agent.stop_and_release(agent.now()).await;
                return Err(e);
            }
        }
    }
}

enum Attempt {
    /// Worth trying again (the coordinator named in the store is gone or leaving): whom it
    /// asked and why that failed.
    Retry(WaitingFor),
    Fail(RpcError),
}

impl From<RpcError> for Attempt {
    fn from(e: RpcError) -> Self {
        Attempt::Fail(e)
    }
}

/// One try: found the group, or ask its coordinator to be admitted and wait for the outcome.
/// A member's record as the errors name it.
fn info(record: &MemberRecord) -> WorkerInfo {
    WorkerInfo {
        name: record.name().to_owned(),
        id: record.rank,
    }
}

async fn join_once(
    agent: &Agent,
    transport: &dyn Transport,
    store: &dyn Store,
    record: &MemberRecord,
    op_timeout: Duration,
    deadline: Instant,
) -> Result<(), Attempt> {
    let encoded = record.encode();
    let held = store
        .compare_set(COORDINATOR, b"", &encoded)
        .await
        .map_err(RpcError::from)?;
    if held == encoded {
        // The first member: it coordinates.
        membership::start(
            agent,
            DynamicMembership::found(record.clone(), op_timeout),
            None,
        );
        agent.pump();
        return Ok(());
    }
    let coordinator = MemberRecord::decode(&held)
        .map_err(|e| Attempt::Fail(InitError::CoordinatorRecord(e).into()))?;
    if coordinator.rank == record.rank || coordinator.name() == record.name() {
        return Err(Attempt::Fail(
            InitError::AlreadyAMember {
                joiner: info(record),
                member: info(&coordinator),
            }
            .into(),
        ));
    }
    let who = format!(
        "{} (rank {}) at {}",
        coordinator.name(),
        coordinator.rank,
        coordinator.addr
    );
    let retry = |error: String| {
        Attempt::Retry(WaitingFor::LastTry {
            coordinator: Some(who.clone()),
            error,
        })
    };
    // A record left by a coordinator that died is replaced by the next one: read it again
    // after a short while rather than dialling a dead address until the deadline.
    let left = deadline.saturating_duration_since(agent.now());
    let conn = match introduce(
        &*agent.inner.runtime,
        transport,
        (record.rank, encoded.clone()),
        (coordinator.addr, coordinator.name()),
        left.min(Duration::from_secs(2)),
    )
    .await
    {
        Ok(c) => c,
        Err(Introduction::Refused(reason)) => {
            return Err(Attempt::Fail(
                InitError::JoinRefused {
                    coordinator: info(&coordinator),
                    reason,
                }
                .into(),
            ))
        }
        Err(Introduction::NotCertified(source)) => {
            return Err(Attempt::Fail(RpcError::NotCertified {
                rank: coordinator.rank,
                name: coordinator.name().to_owned(),
                source,
            }))
        }
        Err(Introduction::Failed(e)) => return Err(retry(e)),
    };
    let (tx, rx) = oneshot::channel();
    let mut m =
        DynamicMembership::join(record.clone(), coordinator.rank, op_timeout, Some(deadline));
    let _ = m.handle_connected(coordinator.rank, None);
    {
        // Its first words wait for the connection.
        let _connecting = membership::Connecting::begin(agent, coordinator.rank);
        membership::start(agent, m, Some(tx));
        agent.pump();
        agent.attach(coordinator.rank, conn);
    }
    agent.pump();
    match rx.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            // Whatever this try connected to goes; the next try starts clean.
            agent.close_links();
            if e.is_retryable() {
                Err(retry(e.to_string()))
            } else {
                Err(Attempt::Fail(match e {
                    MembershipError::DeviceMaps(e) => RpcError::DeviceMaps(e),
                    MembershipError::Timeout { .. } => RpcError::Timeout {
                        what: format!("joining the group: {e}"),
                        after: op_timeout,
                        waiting_for: Some(WaitingFor::Workers(vec![info(&coordinator)])),
                    },
                    other => InitError::Join(other).into(),
                }))
            }
        }
        Err(_) => Err(Attempt::Fail(RpcError::NotRunning)),
    }
}

/// Leaves the group: waits (bounded) until this worker's own calls are answered, then asks
/// the coordinator, which removes it from every member in turn with joins and other leaves.
/// The caller then closes the connections. The last member removes the group's keys.
pub(crate) async fn leave(agent: &Agent, timeout: Duration) -> Result<(), RpcError> {
    let deadline = agent.inner.runtime.deadline_after(timeout);
    // The endpoint decides when our calls are all answered (or fails by the deadline).
    agent
        .run_shutdown(timeout, |ep| ep.begin_leave(Some(deadline)))
        .await?;
    let (tx, rx) = oneshot::channel();
    membership::wait_leave(agent, tx);
    let now = agent.now();
    if with_membership(agent, |m| m.begin_leave(now, Some(deadline))).is_none() {
        return Err(RpcError::NotRunning);
    }
    let last = match rx.await {
        Ok(Ok(last)) => last,
        Ok(Err(e)) => {
            return Err(RpcError::Timeout {
                what: format!("leaving the group: {e}"),
                after: timeout,
                waiting_for: membership::coordinator(agent),
            })
        }
        Err(_) => return Err(RpcError::NotRunning),
    };
    if last {
        // The last member: the group ends, and with it every key the agents made. The worker
        // has left whatever the store says: a store that is gone (rank 0 hosted it and left
        // first, as a worker of PyTorch's dynamic groups may) has no keys to remove, so a
        // failure here is told, not returned.
        match agent.store() {
            Ok(store) => {
                for key in [COORDINATOR, crate::init::GROUP_KIND] {
                    if let Err(e) = store.delete_key(key).await {
                        warn!(
                            "left the group as its last member, but could not remove the key \
                             {key} from the store: {e}"
                        );
                        break;
                    }
                }
            }
            Err(e) => warn!("left the group as its last member, without its store: {e}"),
        }
    }
    Ok(())
}
