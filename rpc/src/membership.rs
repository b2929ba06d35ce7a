//! A running member of a dynamic group: the driver's side of the membership that core's node
//! owns (`tensorwire_core::protocol::membership::dynamic`, in `Node`) once this worker is in
//! (or joining) the group. The node takes the membership's frames, lost peers and timer with
//! the endpoint's; here the driver acts on its events (dial a member, add or remove one, tell a
//! waiting join or leave), welcomes joiners on the listener and keeps the coordinator's record
//! in the store (`rpc/dyn/coordinator`).
//!
//! Joining and leaving (the steps a caller waits on) are in `init::dynamic`, which starts what
//! is here.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use tensorwire_core::ports::transport::{Connection, IdentityError, Listener, Transport};
use tensorwire_core::protocol::membership::{
    Accepted, DynamicMembership, MemberRecord, MembershipError, MembershipEvent,
};
use tensorwire_core::protocol::mesh::HelloReply;
use tensorwire_core::protocol::WorkerId;
use tensorwire_mesh::link;
use tracing::warn;

use crate::error::{RpcError, WaitingFor};
use crate::runtime::Runtime;
use crate::state::Agent;
use crate::state::RPC_GROUP;

pub(crate) const COORDINATOR: &str = "rpc/dyn/coordinator";

/// Runs `f` on the node's membership (if this worker has one), then moves the node's output
/// along (its timer, if `f` moved it, is the driver's: the pump wakes it).
pub(crate) fn with_membership<T>(
    agent: &Agent,
    f: impl FnOnce(&mut DynamicMembership) -> T,
) -> Option<T> {
    let now = agent.now();
    let out = agent.lock().node.with_membership(now, f);
    agent.pump();
    out
}

/// Keeps this worker's record and the transport a joiner dials the members with.
pub(crate) fn set_up(agent: &Agent, record: MemberRecord, transport: Arc<dyn Transport>) {
    let mut st = agent.lock();
    st.dyn_state.record = Some(record);
    st.dyn_state.transport = Some(transport);
}

/// Starts the node's membership with `membership` (a founder's, or a join's, then told by
/// `join_waiter` how it ends). What it produced goes out with the caller's next pump (a
/// joiner's, once the connection to the coordinator is attached).
pub(crate) fn start(
    agent: &Agent,
    membership: DynamicMembership,
    join_waiter: Option<oneshot::Sender<Result<(), MembershipError>>>,
) {
    {
        let now = agent.now();
        let mut st = agent.lock();
        st.node.set_membership(membership, now);
        if join_waiter.is_some() {
            st.dyn_state.join_waiter = join_waiter;
        }
    }
}

/// `tx` is told how the leave this worker begins ends.
pub(crate) fn wait_leave(agent: &Agent, tx: oneshot::Sender<Result<bool, MembershipError>>) {
    agent.lock().dyn_state.leave_waiter = Some(tx);
}

/// The group's coordinator, as this worker's membership knows it.
pub(crate) fn coordinator(agent: &Agent) -> Option<WaitingFor> {
    let rank = agent
        .lock()
        .node
        .membership()
        .and_then(DynamicMembership::coordinator)?;
    Some(WaitingFor::Workers(vec![agent.worker(rank)]))
}

/// Acts on a membership event the node handed up (what concerns the endpoint, the node has
/// applied already: ids of a new incarnation, a member joined, one that left).
pub(crate) fn on_membership_event(agent: &Agent, ev: MembershipEvent) {
    match ev {
        MembershipEvent::Connect(records) => {
            for record in records {
                agent.spawn(dial_member(agent.clone(), record));
            }
        }
        MembershipEvent::MemberAdded(record) => agent.add_member(record),
        MembershipEvent::Admitted { .. } => {}
        MembershipEvent::MemberRemoved { rank, left } => {
            if left {
                agent.member_left(rank);
            }
            agent.remove_member(rank);
        }
        MembershipEvent::Joined => {
            if let Some(tx) = agent.lock().dyn_state.join_waiter.take() {
                let _ = tx.send(Ok(()));
            }
        }
        MembershipEvent::JoinFailed(e) => {
            if let Some(tx) = agent.lock().dyn_state.join_waiter.take() {
                let _ = tx.send(Err(e));
            }
        }
        MembershipEvent::Left { last } => {
            if let Some(tx) = agent.lock().dyn_state.leave_waiter.take() {
                let _ = tx.send(Ok(last));
            }
        }
        MembershipEvent::LeaveFailed(e) => {
            if let Some(tx) = agent.lock().dyn_state.leave_waiter.take() {
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
    agent
        .lock()
        .dyn_state
        .record
        .clone()
        .ok_or(RpcError::NotRunning)
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
    let (record, transport, join_deadline) = {
        let st = agent.lock();
        let join_deadline = st
            .node
            .membership()
            .and_then(DynamicMembership::join_deadline);
        match (st.dyn_state.record.clone(), st.dyn_state.transport.clone()) {
            (Some(r), Some(t)) => (r, t, join_deadline),
            _ => return,
        }
    };
    let left = join_deadline.map_or(Duration::from_secs(30), |d| {
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

/// A peer whose connection is being set up (a joiner being welcomed, the coordinator a joiner
/// dialled): the membership's frames for it wait (in the agent's state) until its connection
/// is attached, which sends them; dropped, whatever is left goes.
pub(crate) struct Connecting<'a> {
    agent: &'a Agent,
    rank: WorkerId,
}

impl<'a> Connecting<'a> {
    pub(crate) fn begin(agent: &'a Agent, rank: WorkerId) -> Self {
        agent.lock().connecting.insert(rank, Vec::new());
        Self { agent, rank }
    }
}

impl Drop for Connecting<'_> {
    fn drop(&mut self) {
        self.agent.lock().connecting.remove(&self.rank);
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
    // What the membership says to it from here waits for its connection (after the welcome);
    // a welcome that ends early takes that back.
    let _connecting = Connecting::begin(&agent, rank);
    // The membership decides whether this connection is one it expects.
    let accepted = with_membership(&agent, |m| m.handle_connected(rank, Some(&record)));
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
    agent.pump();
}
