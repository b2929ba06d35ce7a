//! Dynamic groups (`init_rpc` with `world_size = None`): workers join and leave while the group
//! runs, as in PyTorch's dynamic RPC.
//!
//! This module is the driver of `tensorwire_core::protocol::membership::dynamic`, which decides
//! everything: who coordinates, the order of joins and leaves, when a joiner is complete, what
//! a leave does. The driver moves its messages over the members' connections (as control
//! frames), dials whom it says, runs its timer, and uses the store only where a joiner must
//! find the group: the key `rpc/dyn/coordinator` holds the coordinating member's record
//! (written by the first member with compare-and-set, rewritten by a member that takes over
//! coordination, deleted with the group's kind by the last member's leave). Rank 0 hosts the
//! store, so no worker can join once it has left.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{Connection, Listener, Transport};
use tensorwire_core::protocol::membership::{
    Accepted, DynMessage, DynamicMembership, MemberRecord, MembershipError, MembershipEvent,
};
use tensorwire_core::protocol::mesh::HelloReply;
use tensorwire_core::protocol::{ProtocolViolation, WorkerId};
use tensorwire_core::validate::WorkerDeviceInfo;
use tensorwire_core::wire::Frame;
use tensorwire_mesh::link;
use tensorwire_rendezvous::Rendezvous;
use tensorwire_store::backoff::Backoff;
use tokio::sync::oneshot;
use tracing::{debug, warn};

use crate::driver::drive;
use crate::error::RpcError;
use crate::init::advertise_ip;
use crate::init::static_group::RPC_GROUP;
use crate::options::RpcOptions;
use crate::runtime::{tokio_instant, Runtime};
use crate::state::{Agent, DynState, WorkerRecord};

const COORDINATOR: &str = "rpc/dyn/coordinator";

fn encode_err(what: &str, e: postcard::Error) -> RpcError {
    RpcError::Serialization {
        what: what.to_owned(),
        message: e.to_string(),
    }
}

fn dyn_state(agent: &Agent) -> std::sync::MutexGuard<'_, DynState> {
    agent
        .inner
        .membership
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` on the membership (if this worker has one), then moves its output along.
pub(crate) fn with_membership<T>(
    agent: &Agent,
    f: impl FnOnce(&mut DynamicMembership) -> T,
) -> Option<T> {
    let out = dyn_state(agent).membership.as_mut().map(f);
    // The call may have moved the next deadline (a redial) without saying anything.
    agent.inner.membership_wake.notify_one();
    pump_membership(agent);
    out
}

/// Whether `from` may send calls and replies: in a dynamic group, a member only.
pub(crate) fn may_call(agent: &Agent, from: WorkerId) -> bool {
    !agent.is_dynamic()
        || dyn_state(agent)
            .membership
            .as_ref()
            .is_some_and(|m| m.may_call(from))
}

/// A membership message from `from` (a control frame on its connection).
pub(crate) fn on_membership_frame(
    agent: &Agent,
    from: WorkerId,
    frame: &Frame,
) -> Result<(), ProtocolViolation> {
    let msg: DynMessage =
        postcard::from_bytes(&frame.header).map_err(|e| ProtocolViolation::Malformed {
            what: format!("a membership message that does not parse ({e})"),
        })?;
    let now = agent.now();
    let handled = with_membership(agent, |m| m.handle_message(from, msg, now));
    match handled {
        Some(Ok(())) => Ok(()),
        Some(Err(e)) => Err(ProtocolViolation::Membership {
            what: e.to_string(),
        }),
        None => Err(ProtocolViolation::Membership {
            what: "a membership message to a worker of a static group".into(),
        }),
    }
}

/// Moves the membership's messages to the peers' writers and acts on its events.
pub(crate) fn pump_membership(agent: &Agent) {
    loop {
        let (transmits, events) = {
            let mut st = dyn_state(agent);
            let Some(m) = st.membership.as_mut() else {
                return;
            };
            let transmits: Vec<_> = std::iter::from_fn(|| m.poll_transmit()).collect();
            let events: Vec<_> = std::iter::from_fn(|| m.poll_event()).collect();
            (transmits, events)
        };
        if transmits.is_empty() && events.is_empty() {
            break;
        }
        agent.inner.membership_wake.notify_one();
        for (to, msg) in transmits {
            match postcard::to_allocvec(&msg) {
                Ok(bytes) => agent.send_control(to, Frame::control(bytes, vec![])),
                Err(e) => warn!("cannot encode a membership message: {e}"),
            }
        }
        for ev in events {
            on_membership_event(agent, ev);
        }
    }
    agent.pump();
}

fn on_membership_event(agent: &Agent, ev: MembershipEvent) {
    match ev {
        MembershipEvent::Connect(records) => {
            for record in records {
                agent.spawn(dial_member(agent.clone(), record));
            }
        }
        MembershipEvent::MemberAdded(record) => agent.add_member(record),
        MembershipEvent::Admitted { seq } => {
            // Ids above every earlier incarnation of this rank's.
            agent.begin_incarnation(seq);
        }
        MembershipEvent::MemberRemoved { rank, left } => {
            if left {
                agent.member_left(rank);
            }
            agent.remove_member(rank);
        }
        MembershipEvent::Joined => {
            if let Some(tx) = dyn_state(agent).join_waiter.take() {
                let _ = tx.send(Ok(()));
            }
        }
        MembershipEvent::JoinFailed(e) => {
            if let Some(tx) = dyn_state(agent).join_waiter.take() {
                let _ = tx.send(Err(e));
            }
        }
        MembershipEvent::Left { last } => {
            if let Some(tx) = dyn_state(agent).leave_waiter.take() {
                let _ = tx.send(Ok(last));
            }
        }
        MembershipEvent::LeaveFailed(e) => {
            if let Some(tx) = dyn_state(agent).leave_waiter.take() {
                let _ = tx.send(Err(e));
            }
        }
        MembershipEvent::Coordinate => {
            let this = agent.clone();
            agent.spawn(async move {
                if let Err(e) = publish_coordinator(&this).await {
                    warn!("could not publish this worker as the group's coordinator: {e}");
                }
            });
        }
        _ => {}
    }
}

async fn publish_coordinator(agent: &Agent) -> Result<(), RpcError> {
    let record = own_record(agent)?;
    let bytes = postcard::to_allocvec(&record).map_err(|e| encode_err("a record", e))?;
    agent.store()?.set(COORDINATOR, &bytes).await?;
    Ok(())
}

fn own_record(agent: &Agent) -> Result<MemberRecord, RpcError> {
    dyn_state(agent).record.clone().ok_or(RpcError::NotRunning)
}

/// The membership's timer: calls `handle_timeout` at its `poll_timeout`, for as long as the
/// agent runs.
async fn membership_timer(agent: Agent) {
    loop {
        let next = dyn_state(&agent)
            .membership
            .as_ref()
            .and_then(DynamicMembership::poll_timeout);
        match next {
            Some(at) => {
                tokio::select! {
                    () = agent.inner.membership_wake.notified() => {}
                    () = agent.inner.runtime.sleep_until(at) => {
                        let now = agent.now();
                        with_membership(&agent, |m| m.handle_timeout(now));
                    }
                }
            }
            None => agent.inner.membership_wake.notified().await,
        }
    }
}

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
    );
    {
        let mut st = dyn_state(&agent);
        st.record = Some(record.clone());
        st.transport = Some(Arc::clone(&transport));
    }
    *agent
        .inner
        .rendezvous
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(rdv);
    agent.spawn(accept_connections(agent.clone(), listener));
    agent.spawn(drive(agent.clone()));
    agent.spawn(membership_timer(agent.clone()));
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
    /// Worth trying again (the coordinator named in the store is gone or leaving).
    Retry(String),
    Fail(RpcError),
}

impl From<RpcError> for Attempt {
    fn from(e: RpcError) -> Self {
        Attempt::Fail(e)
    }
}

/// One try: found the group, or ask its coordinator to be admitted and wait for the outcome.
async fn join_once(
    agent: &Agent,
    transport: &dyn Transport,
    store: &dyn Store,
    record: &MemberRecord,
    op_timeout: Duration,
    deadline: Instant,
) -> Result<(), Attempt> {
    let encoded =
        postcard::to_allocvec(record).map_err(|e| encode_err("this worker's record", e))?;
    let held = store
        .compare_set(COORDINATOR, b"", &encoded)
        .await
        .map_err(RpcError::from)?;
    if held == encoded {
        // The first member: it coordinates.
        dyn_state(agent).membership = Some(DynamicMembership::found(record.clone(), op_timeout));
        return Ok(());
    }
    let coordinator: MemberRecord =
        postcard::from_bytes(&held).map_err(|e| encode_err("the coordinator's record", e))?;
    if coordinator.rank == record.rank || coordinator.name() == record.name() {
        return Err(Attempt::Fail(RpcError::Init(format!(
            "{} (rank {}) cannot join: {} (rank {}) is already a member",
            record.name(),
            record.rank,
            coordinator.name(),
            coordinator.rank
        ))));
    }
    let who = format!(
        "{} (rank {}) at {}",
        coordinator.name(),
        coordinator.rank,
        coordinator.addr
    );
    // A record left by a coordinator that died is replaced by the next one: read it again
    // after a short while rather than dialling a dead address until the deadline.
    let left = deadline.saturating_duration_since(agent.now());
    let conn = match introduce(
        &*agent.inner.runtime,
        transport,
        record,
        coordinator.addr,
        left.min(Duration::from_secs(2)),
    )
    .await
    {
        Ok(c) => c,
        Err(Introduction::Refused(reason)) => return Err(Attempt::Fail(RpcError::Init(reason))),
        Err(Introduction::Failed(e)) => return Err(Attempt::Retry(format!("{who}: {e}"))),
    };
    let (tx, rx) = oneshot::channel();
    {
        let mut st = dyn_state(agent);
        let mut m =
            DynamicMembership::join(record.clone(), coordinator.rank, op_timeout, Some(deadline));
        let _ = m.handle_connected(coordinator.rank, None);
        st.membership = Some(m);
        st.join_waiter = Some(tx);
    }
    agent.attach(coordinator.rank, conn);
    agent.inner.membership_wake.notify_one();
    pump_membership(agent);
    match rx.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            // Whatever this try connected to goes; the next try starts clean.
            agent.close_links();
            if e.is_retryable() {
                Err(Attempt::Retry(format!("{who}: {e}")))
            } else {
                Err(Attempt::Fail(match e {
                    MembershipError::DeviceMaps(e) => RpcError::DeviceMaps(e),
                    MembershipError::Timeout { .. } => RpcError::Timeout {
                        what: format!("joining the group: {e}"),
                        after: op_timeout,
                        waiting_for: Some(who),
                    },
                    other => RpcError::Init(other.to_string()),
                }))
            }
        }
        Err(_) => Err(Attempt::Fail(RpcError::NotRunning)),
    }
}

/// Why an introduction did not get a welcome.
enum Introduction {
    /// The member refused this worker, saying why.
    Refused(String),
    /// It could not be reached, or did not answer.
    Failed(String),
}

impl std::fmt::Display for Introduction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(s) | Self::Failed(s) => f.write_str(s),
        }
    }
}

/// Connects to `addr`, says who this worker is, and waits for the welcome.
async fn introduce(
    runtime: &dyn Runtime,
    transport: &dyn Transport,
    record: &MemberRecord,
    addr: std::net::SocketAddr,
    limit: Duration,
) -> Result<Box<dyn Connection>, Introduction> {
    let failed = |e: String| Introduction::Failed(e);
    let hello = link::Hello {
        group: RPC_GROUP.to_owned(),
        rank: record.rank,
        world: None,
        introduction: postcard::to_allocvec(record).map_err(|e| failed(e.to_string()))?,
    };
    let deadline = tokio_instant(runtime.deadline_after(limit));
    let conn = link::dial(transport, addr, &hello, deadline)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let answer_by = runtime.deadline_after(limit.max(Duration::from_secs(1)));
    match runtime.timeout_at(answer_by, conn.recv()).await {
        Ok(Ok(f)) => match HelloReply::from_frame(&f) {
            Ok(HelloReply::Welcome) => Ok(conn),
            Ok(HelloReply::Refused { reason, .. }) => Err(Introduction::Refused(reason)),
            Err(e) => Err(failed(format!(
                "it answered the introduction with something else: {e}"
            ))),
        },
        Ok(Err(e)) => Err(failed(format!("it did not welcome this worker: {e}"))),
        Err(_) => Err(failed("it did not answer the introduction".into())),
    }
}

/// A joiner connects to a member the coordinator admitted it to.
async fn dial_member(agent: Agent, member: MemberRecord) {
    let (record, transport) = {
        let st = dyn_state(&agent);
        match (st.record.clone(), st.transport.clone()) {
            (Some(r), Some(t)) => (r, t),
            _ => return,
        }
    };
    let left = dyn_state(&agent)
        .membership
        .as_ref()
        .and_then(DynamicMembership::join_deadline)
        .map_or(Duration::from_secs(30), |d| {
            d.saturating_duration_since(agent.now())
        });
    match introduce(
        &*agent.inner.runtime,
        &*transport,
        &record,
        member.addr,
        left,
    )
    .await
    {
        Ok(conn) => {
            agent.attach(member.rank, conn);
            let accepted = with_membership(&agent, |m| m.handle_connected(member.rank, None));
            if let Some(Err(e)) = accepted {
                warn!("a connection the join did not ask for: {e}");
            }
        }
        Err(e) => {
            warn!(
                "cannot connect to {} (rank {}) at {}: {e}",
                member.name(),
                member.rank,
                member.addr
            );
            let now = agent.now();
            with_membership(&agent, |m| m.handle_connect_failed(member.rank, now));
        }
    }
}

/// Accepts connections from joiners (and, on the coordinator, from workers asking to join),
/// for as long as the agent runs.
async fn accept_connections(agent: Agent, listener: Box<dyn Listener>) {
    loop {
        match listener.accept().await {
            Ok(conn) => agent.spawn(welcome(agent.clone(), conn)),
            Err(e) => {
                warn!("the RPC listener failed; no worker can join through this one: {e}");
                return;
            }
        }
    }
}

async fn welcome(agent: Agent, conn: Box<dyn Connection>) {
    let peer = conn.peer_addr();
    let deadline = tokio_instant(agent.inner.runtime.deadline_after(Duration::from_secs(30)));
    let hello = match link::read_hello(&*conn, deadline).await {
        Ok(hello) if hello.group == RPC_GROUP && hello.world.is_none() => hello,
        Ok(hello) => {
            warn!("dropping a connection from {peer} with a hello for another group: {hello:?}");
            return;
        }
        Err(e) => {
            warn!("dropping a connection: {e}");
            return;
        }
    };
    let rank = hello.rank;
    let record = match postcard::from_bytes::<MemberRecord>(&hello.introduction) {
        Ok(record) if record.rank == rank => record,
        _ => {
            warn!("dropping a connection from {peer} that sent no valid introduction");
            return;
        }
    };
    // The membership decides whether this connection is one it expects.
    let accepted = dyn_state(&agent)
        .membership
        .as_mut()
        .map(|m| m.handle_connected(rank, Some(&record)));
    match accepted {
        Some(Ok(Accepted::Member | Accepted::Applicant)) => {}
        Some(Ok(Accepted::Dialled)) | None => return,
        Some(Err(MembershipError::Refused { reason, retry })) => {
            // Told why, so that its init fails with the reason rather than a timeout.
            let _ = conn
                .send(HelloReply::Refused { reason, retry }.frame())
                .await;
            let _ = conn.close().await;
            return;
        }
        Some(Err(e)) => {
            warn!("dropping a connection from {peer}: {e}");
            return;
        }
    }
    if let Err(e) = conn.send(HelloReply::Welcome.frame()).await {
        warn!("could not welcome rank {rank}: {e}");
        let now = agent.now();
        with_membership(&agent, |m| m.handle_lost(rank, now));
        return;
    }
    agent.attach(rank, conn);
    pump_membership(&agent);
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
    dyn_state(agent).leave_waiter = Some(tx);
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
                waiting_for: dyn_state(agent)
                    .membership
                    .as_ref()
                    .and_then(DynamicMembership::coordinator)
                    .map(|c| agent.name_of(c)),
            })
        }
        Err(_) => return Err(RpcError::NotRunning),
    };
    if last {
        // The last member: the group ends, and with it every key the agents made.
        let store = agent.store()?;
        for key in [COORDINATOR, crate::init::GROUP_KIND] {
            store.delete_key(key).await?;
        }
    }
    Ok(())
}

/// The shared handle for the state above, created with the agent.
pub(crate) fn new_state() -> Mutex<DynState> {
    Mutex::new(DynState::default())
}
