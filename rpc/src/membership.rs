//! A running member of a dynamic group: the driver of
//! `tensorwire_core::protocol::membership::dynamic` once this worker is in (or joining) the
//! group. It hands the membership the control frames and lost peers, moves its messages to the
//! peers' writers, acts on its events (dial a member, add or remove one, tell a waiting join or
//! leave), runs its timer, welcomes joiners on the listener and keeps the coordinator's record
//! in the store (`rpc/dyn/coordinator`).
//!
//! Joining and leaving (the steps a caller waits on) are in `init::dynamic`, which starts what
//! is here.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tensorwire_core::ports::transport::{Connection, IdentityError, Listener, Transport};
use tensorwire_core::protocol::membership::{
    Accepted, DynMessage, DynamicMembership, MemberRecord, MembershipError, MembershipEvent,
};
use tensorwire_core::protocol::mesh::HelloReply;
use tensorwire_core::protocol::{MalformedMessage, ProtocolViolation, WorkerId};
use tensorwire_core::wire::Frame;
use tensorwire_mesh::link;
use tracing::warn;

use crate::error::RpcError;
use crate::runtime::Runtime;
use crate::state::RPC_GROUP;
use crate::state::{Agent, DynState};

pub(crate) const COORDINATOR: &str = "rpc/dyn/coordinator";

pub(crate) fn dyn_state(agent: &Agent) -> std::sync::MutexGuard<'_, DynState> {
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
    let msg = DynMessage::decode(&frame.header)
        .map_err(|e| ProtocolViolation::Malformed(MalformedMessage::Undecodable(e)))?;
    let now = agent.now();
    let handled = with_membership(agent, |m| m.handle_message(from, msg, now));
    match handled {
        Some(Ok(())) => Ok(()),
        Some(Err(e)) => Err(ProtocolViolation::Membership(e)),
        None => Err(ProtocolViolation::MembershipInStaticGroup),
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
            agent.send_control(to, Frame::control(msg.encode(), vec![]));
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
    }
}

pub(crate) async fn publish_coordinator(agent: &Agent) -> Result<(), RpcError> {
    let record = own_record(agent)?;
    agent.store()?.set(COORDINATOR, &record.encode()).await?;
    Ok(())
}

pub(crate) fn own_record(agent: &Agent) -> Result<MemberRecord, RpcError> {
    dyn_state(agent).record.clone().ok_or(RpcError::NotRunning)
}

/// The membership's timer: calls `handle_timeout` at its `poll_timeout`, for as long as the
/// agent runs.
pub(crate) async fn membership_timer(agent: Agent) {
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

/// Why an introduction did not get a welcome.
pub(crate) enum Introduction {
    /// The member refused this worker, saying why.
    Refused(String),
    /// It could not be reached, or did not answer.
    Failed(String),
    /// Its credentials are not issued for the name it is known by (an impostor, or a
    /// certificate made for another worker): nothing was sent to it but the hello.
    NotCertified(IdentityError),
}

impl std::fmt::Display for Introduction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(s) | Self::Failed(s) => f.write_str(s),
            Self::NotCertified(e) => e.fmt(f),
        }
    }
}

/// Connects to `addr` (the member named `expected`), says who this worker is, and waits for
/// the welcome. A member whose credentials are not issued for `expected` is not believed.
pub(crate) async fn introduce(
    runtime: &dyn Runtime,
    transport: &dyn Transport,
    record: &MemberRecord,
    (addr, expected): (std::net::SocketAddr, &str),
    limit: Duration,
) -> Result<Box<dyn Connection>, Introduction> {
    let failed = |e: String| Introduction::Failed(e);
    let hello = link::Hello {
        group: RPC_GROUP.to_owned(),
        rank: record.rank,
        world: None,
        introduction: record.encode(),
    };
    let deadline = runtime.deadline_after(limit);
    let conn = link::dial(runtime, transport, addr, &hello, deadline)
        .await
        .map_err(|e| failed(e.to_string()))?;
    if let Err(e) = conn.check_peer_name(expected) {
        let _ = conn.close().await;
        return Err(Introduction::NotCertified(e));
    }
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
pub(crate) async fn dial_member(agent: Agent, member: MemberRecord) {
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
        (member.addr, member.name()),
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
pub(crate) async fn accept_connections(agent: Agent, listener: Box<dyn Listener>) {
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
    let runtime = &*agent.inner.runtime;
    let deadline = runtime.deadline_after(Duration::from_secs(30));
    let hello = match link::read_hello(runtime, &*conn, deadline).await {
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
    let record = match MemberRecord::decode(&hello.introduction) {
        Ok(record) if record.rank == rank => record,
        Ok(record) => {
            warn!(
                "dropping a connection from {peer}: rank {rank} introduced itself with the \
                 record of rank {}",
                record.rank
            );
            return;
        }
        Err(e) => {
            warn!("dropping a connection from {peer} whose introduction is {e}");
            return;
        }
    };
    // Its credentials must be issued for the name it gives (QUIC node certificates; with a
    // cluster secret any member may take any name).
    if let Err(e) = conn.check_peer_name(record.name()) {
        warn!("refusing rank {rank} from {peer}: {e}");
        let reason = format!("this worker's credentials do not name it: {e}");
        let _ = conn
            .send(
                HelloReply::Refused {
                    reason,
                    retry: false,
                }
                .frame(),
            )
            .await;
        let _ = conn.close().await;
        return;
    }
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

/// The shared handle for the state above, created with the agent.
pub(crate) fn new_state() -> Mutex<DynState> {
    Mutex::new(DynState::default())
}
