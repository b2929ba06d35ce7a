//! A running member of a dynamic group: the driver's side of the membership that core's node
//! owns (`tensorwire_core::protocol::membership::dynamic`, in `Node`) once this worker is in
//! (or joining) the group. The node takes the membership's frames, lost peers and timer with
//! the endpoint's, and decides what is to be done; here the driver performs what it asks
//! ([`MemberAction`]: dial a member, name or forget one, complete a waiting join or leave,
//! write a record to the store) and answers joiners on the listener as the node says.
//!
//! Joining and leaving (the steps a caller waits on) are in `init::dynamic`, which starts what
//! is here.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use tensorwire_core::ports::transport::{Connection, Listener, Transport};
use tensorwire_core::protocol::membership::{
    DynamicMembership, MemberRecord, MembershipError, TryEnd,
};
use tensorwire_core::protocol::mesh::HelloReply;
use tensorwire_core::protocol::node::{
    joiner_hello, welcome_wait, Introduced, MemberAction, HELLO_WAIT,
};
use tensorwire_core::protocol::WorkerId;
use tensorwire_mesh::link;
use tracing::warn;

use crate::error::{IntroductionError, RpcError, WaitingFor};
use crate::runtime::Runtime;
use crate::state::Agent;

pub(crate) use tensorwire_core::protocol::node::COORDINATOR_KEY as COORDINATOR;

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

/// Keeps the transport a joiner dials the members with.
pub(crate) fn set_up(agent: &Agent, transport: Arc<dyn Transport>) {
    agent.lock().dyn_state.transport = Some(transport);
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

/// Performs what the node asks for the membership (it applied to the endpoint what concerns
/// it already).
pub(crate) fn perform(agent: &Agent, action: MemberAction) {
    match action {
        MemberAction::Dial {
            record,
            introduction,
            limit,
        } => agent.spawn(dial_member(agent.clone(), record, introduction, limit)),
        // (The node has added it to the endpoint and the directory already.)
        MemberAction::Add(record) => {
            agent
                .inner
                .peer_events
                .emit(crate::peer_events::PeerEvent::Joined {
                    worker: record.rank,
                })
        }
        MemberAction::Remove { rank, close: true } => agent.member_left(rank),
        MemberAction::Remove { close: false, .. } => {}
        MemberAction::JoinDone(outcome) => {
            if let Some(tx) = agent.lock().dyn_state.join_waiter.take() {
                let _ = tx.send(outcome);
            }
        }
        MemberAction::LeaveDone(outcome) => {
            if let Some(tx) = agent.lock().dyn_state.leave_waiter.take() {
                let _ = tx.send(outcome);
            }
        }
        MemberAction::Publish { key, record } => {
            let this = agent.clone();
            agent.spawn(async move {
                let written = match this.store() {
                    Ok(store) => store.set(key, &record).await.map_err(RpcError::from),
                    Err(e) => Err(e),
                };
                if let Err(e) = written {
                    warn!("could not publish this worker as the group's coordinator: {e}");
                }
            });
        }
    }
}

/// Why an introduction did not get a welcome: core's [`TryEnd`] (never its `Ended`, which
/// only a join's membership says).
pub(crate) type Introduction = TryEnd<IntroductionError>;

/// Connects to `addr` (the member named `expected`), says who this worker is, and waits for
/// the welcome. A member whose credentials are not issued for `expected` is not believed.
pub(crate) async fn introduce(
    runtime: &dyn Runtime,
    transport: &dyn Transport,
    (rank, introduction): (WorkerId, Vec<u8>),
    (addr, expected): (std::net::SocketAddr, &str),
    limit: Duration,
) -> Result<Box<dyn Connection>, Introduction> {
    let hello = joiner_hello(rank, introduction);
    let deadline = runtime.deadline_after(limit);
    let conn = link::dial(runtime, transport, addr, &hello, deadline)
        .await
        .map_err(|e| TryEnd::Unreachable(e.into()))?;
    if let Err(e) = conn.check_peer_name(expected) {
        let _ = conn.close().await;
        return Err(TryEnd::NotCertified(e));
    }
    let answer_by = runtime.deadline_after(welcome_wait(limit));
    match runtime.timeout_at(answer_by, conn.recv()).await {
        Ok(Ok(f)) => match HelloReply::from_frame(&f) {
            Ok(HelloReply::Welcome) => Ok(conn),
            Ok(HelloReply::Refused { reason, .. }) => Err(TryEnd::Refused(reason)),
            Err(e) => Err(TryEnd::Unreachable(IntroductionError::Garbled(e))),
        },
        Ok(Err(e)) => Err(TryEnd::Unreachable(IntroductionError::NoWelcome(e))),
        Err(_) => Err(TryEnd::Unreachable(IntroductionError::NoAnswer)),
    }
}

/// A joiner connects to a member the coordinator admitted it to (a [`MemberAction::Dial`]).
async fn dial_member(agent: Agent, member: MemberRecord, introduction: Vec<u8>, limit: Duration) {
    let Some(transport) = agent.lock().dyn_state.transport.clone() else {
        return;
    };
    let me = agent.worker_info().id;
    let runtime = &*agent.inner.runtime;
    let target = (member.addr, member.name());
    let dialled = introduce(runtime, &*transport, (me, introduction), target, limit).await;
    let now = agent.now();
    let reached = match dialled {
        Ok(conn) => {
            agent.attach(member.rank, conn);
            true
        }
        Err(e) => {
            let (name, rank, addr) = (member.name(), member.rank, member.addr);
            warn!("cannot connect to {name} (rank {rank}) at {addr}: {e}");
            false
        }
    };
    let handled = agent.lock().node.handle_dialled(now, member.rank, reached);
    agent.pump();
    if let Err(e) = handled {
        warn!("a connection the join did not ask for: {e}");
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
/// dialled): the node holds the membership's frames for it until its connection is attached,
/// which sends them; dropped, whatever is left goes.
pub(crate) struct Connecting<'a> {
    agent: &'a Agent,
    rank: WorkerId,
}

impl<'a> Connecting<'a> {
    pub(crate) fn begin(agent: &'a Agent, rank: WorkerId) -> Self {
        agent.lock().node.begin_connecting(rank);
        Self { agent, rank }
    }
}

impl Drop for Connecting<'_> {
    fn drop(&mut self) {
        self.agent.lock().node.handle_connecting_ended(self.rank);
    }
}

async fn welcome(agent: Agent, conn: Box<dyn Connection>) {
    let peer = conn.peer_addr();
    let runtime = &*agent.inner.runtime;
    let deadline = runtime.deadline_after(HELLO_WAIT);
    let hello = match link::read_hello(runtime, &*conn, deadline).await {
        Ok(hello) => hello,
        Err(e) => {
            warn!("dropping a connection: {e}");
            return;
        }
    };
    let rank = hello.rank;
    // The node checks that the hello is a joiner's, reads its record, checks that its
    // credentials are issued for the name it gives (QUIC node certificates), and asks the
    // membership whether it is expected. What it
    // says to it from here waits for its connection (after the welcome).
    let answer = {
        let now = agent.now();
        let certify = |name: &str| conn.check_peer_name(name);
        let answer = agent.lock().node.handle_hello(now, &hello, certify);
        agent.pump();
        answer
    };
    match answer {
        Introduced::Welcome => {}
        Introduced::Refuse(reply) => {
            if let HelloReply::Refused { reason, .. } = &reply {
                warn!("refusing rank {rank} from {peer}: {reason}");
            }
            // Told why, so that its init fails with the reason rather than a timeout.
            let _ = conn.send(reply.frame()).await;
            let _ = conn.close().await;
            return;
        }
        Introduced::Drop(None) => return,
        Introduced::Drop(Some(e)) => {
            warn!("dropping a connection from {peer}: {e}");
            return;
        }
        Introduced::Unreadable(e) => {
            warn!("dropping a connection from {peer}: {e}");
            return;
        }
    }
    // Whatever is held for it goes if it is not attached.
    let _connecting = Connecting {
        agent: &agent,
        rank,
    };
    if let Err(e) = conn.send(HelloReply::Welcome.frame()).await {
        warn!("could not welcome rank {rank}: {e}");
        let now = agent.now();
        agent.lock().node.handle_welcome_failed(rank, now);
        agent.pump();
        return;
    }
    agent.attach(rank, conn);
    agent.pump();
}
