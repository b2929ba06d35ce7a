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
use std::time::Duration;

use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::Transport;
use tensorwire_core::protocol::membership::{
    JoinFailure, JoinStart, Joining, MemberRecord, TryEnd,
};
use tensorwire_core::protocol::WorkerId;
use tensorwire_core::validate::WorkerDeviceInfo;
use tensorwire_rendezvous::Rendezvous;
use tensorwire_store::backoff::Backoff;
use tokio::sync::oneshot;
use tracing::{debug, warn};

use crate::driver::drive;
use crate::error::{InitError, IntroductionError, RpcError, WaitingFor};
use crate::init::advertise_ip;
use crate::membership::{self, accept_connections, introduce, with_membership, COORDINATOR};
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
    agent.lock().owned.rendezvous = Some(rdv);
    agent.spawn(accept_connections(agent.clone(), listener));
    agent.spawn(drive(agent.clone()));
    let joining = Joining::new(record, options.init_timeout, deadline);
    let mut backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(50));
    let failure = loop {
        let (coordinator, end) = match join_once(&agent, &*transport, &*store, &joining).await {
            Ok(()) => return Ok(agent),
            Err(Attempt::Ended(ended)) => *ended,
            Err(Attempt::Failed(e)) => break join_error(*e, options.init_timeout),
            Err(Attempt::Fail(e)) => break e,
        };
        let (now, delay) = (agent.now(), backoff.next_delay());
        match joining.handle_try_ended(&coordinator, end, now, delay) {
            Ok(at) => {
                debug!(
                    "joining the group again; the last try asked {}",
                    coordinator.name()
                );
                runtime.sleep_until(at).await;
            }
            Err(e) => break join_error(e, options.init_timeout),
        }
    };
    agent.stop_and_release(agent.now()).await;
    Err(failure)
}

/// A try that did not make this worker a member.
enum Attempt {
    /// It asked the coordinator (its record), which ended it so (core's [`Joining`] decides
    /// what follows).
    Ended(Box<(MemberRecord, TryEnd<IntroductionError>)>),
    /// Core's [`Joining`] refused it (no try helps).
    Failed(Box<JoinFailure<IntroductionError>>),
    /// The store or the agent failed.
    Fail(RpcError),
}

impl From<RpcError> for Attempt {
    fn from(e: RpcError) -> Self {
        Attempt::Fail(e)
    }
}

/// Why the join failed, as `init_rpc` says it.
fn join_error(e: JoinFailure<IntroductionError>, after: Duration) -> RpcError {
    match e {
        JoinFailure::CoordinatorRecord(e) => InitError::CoordinatorRecord(e).into(),
        JoinFailure::AlreadyAMember { joiner, member } => {
            InitError::AlreadyAMember { joiner, member }.into()
        }
        JoinFailure::Refused {
            coordinator,
            reason,
        } => InitError::JoinRefused {
            coordinator,
            reason,
        }
        .into(),
        JoinFailure::NotCertified {
            coordinator,
            source,
        } => RpcError::NotCertified {
            rank: coordinator.id,
            name: coordinator.name,
            source,
        },
        JoinFailure::DeviceMaps(e) => RpcError::DeviceMaps(e),
        JoinFailure::TimedOut { coordinator, error } => RpcError::Timeout {
            what: format!("joining the group: {error}"),
            after,
            waiting_for: Some(WaitingFor::Workers(vec![coordinator])),
        },
        JoinFailure::Deadline(last) => RpcError::Timeout {
            what: "joining the group".into(),
            after,
            waiting_for: Some(WaitingFor::LastTry(Arc::new(last))),
        },
        JoinFailure::Membership(e) => InitError::Join(e).into(),
    }
}

/// One try: found the group, or ask its coordinator to be admitted and wait for the outcome.
async fn join_once(
    agent: &Agent,
    transport: &dyn Transport,
    store: &dyn Store,
    joining: &Joining,
) -> Result<(), Attempt> {
    let held = store
        .compare_set(COORDINATOR, b"", joining.record())
        .await
        .map_err(RpcError::from)?;
    let (coordinator, limit) = match joining.handle_store(&held, agent.now()) {
        Ok(JoinStart::Found(founder)) => {
            membership::start(agent, *founder, None);
            agent.pump();
            return Ok(());
        }
        Ok(JoinStart::Ask { coordinator, limit }) => (coordinator, limit),
        Err(e) => return Err(Attempt::Failed(Box::new(e))),
    };
    let ended = |end| Err(Attempt::Ended(Box::new((coordinator.clone(), end))));
    let me = (agent.worker_info().id, joining.record().to_vec());
    let target = (coordinator.addr, coordinator.name());
    let conn = match introduce(&*agent.inner.runtime, transport, me, target, limit).await {
        Ok(c) => c,
        Err(end) => return ended(end),
    };
    let (tx, rx) = oneshot::channel();
    {
        // Its first words wait for the connection.
        let _connecting = membership::Connecting::begin(agent, coordinator.rank);
        membership::start(agent, joining.through(&coordinator), Some(tx));
        agent.pump();
        agent.attach(coordinator.rank, conn);
    }
    agent.pump();
    match rx.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            // Whatever this try connected to goes; the next try starts clean.
            agent.close_links();
            ended(TryEnd::Ended(e))
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
