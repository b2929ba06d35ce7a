//! The agent's connections to its peers: a writer task per connection fed by a queue, the
//! direct-write fast path (a task of ours writes itself when the peer's writer is idle), the
//! reader tasks that hand received frames to the endpoint, and the loss of a peer.

use std::sync::Arc;

use tensorwire_core::ports::transport::Connection;
use tensorwire_core::protocol::node::Dropped;
use tensorwire_core::protocol::{
    Header, LostCause, MessageId, MethodTarget, ProtocolViolation, Transmit, WorkerId,
};
use tensorwire_core::wire::Frame;
use tensorwire_mesh::mesh::ABORT_SEND_TIMEOUT;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::queue::{frame_bytes, OutQueue};
use crate::state::Agent;
use crate::state::{Body, PeerLink, State};
use crate::tensors;
use tensorwire_core::protocol::envelope::Envelope;

/// At most this many queued frames go out in one `send_many`.
pub(crate) const WRITE_BATCH: usize = 64;

/// Returns once the peer's queue has passed its bound (never, if the sender is gone first).
pub(crate) async fn until_failed(failed: &mut tokio::sync::watch::Receiver<bool>) {
    if failed.wait_for(|f| *f).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Frames a task writes itself, holding its peer's write lock: they are gathered in the list
/// the lock guards, which stays there between writes (emptied; its room kept up to
/// [`WRITE_BATCH`] frames), so that a message's write allocates no list.
pub(crate) struct DirectWrite {
    pub(crate) peer: WorkerId,
    pub(crate) conn: Arc<dyn Connection>,
    pub(crate) frames: tokio::sync::OwnedMutexGuard<Vec<Frame>>,
}

/// A list that holds its first item in place: a pump writes to one peer and runs one event
/// per message, and this allocates only for a second.
pub(crate) struct Few<T>(pub(crate) Option<T>, Vec<T>);

impl<T> Few<T> {
    pub(crate) fn new() -> Self {
        Few(None, Vec::new())
    }

    pub(crate) fn push(&mut self, item: T) {
        match self.0 {
            None => self.0 = Some(item),
            Some(_) => self.1.push(item),
        }
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.0.iter_mut().chain(&mut self.1)
    }

    pub(crate) fn all(self) -> impl Iterator<Item = T> {
        self.0.into_iter().chain(self.1)
    }

    /// Hands each item to `f`, in order, and leaves the list empty (its room kept).
    pub(crate) fn take_each(&mut self, mut f: impl FnMut(T)) {
        if let Some(first) = self.0.take() {
            f(first);
        }
        if !self.1.is_empty() {
            self.1.drain(..).for_each(f);
        }
    }
}

/// Registers the connection to `peer` and starts its writer task. With `owned` the agent
/// owns the connection (its writer closes it at the end, and the driver reads it: see
/// `driver::attach`); else its owner, the static group, reads it and keeps it open.
///
/// `on_reading_again` runs when the peer reads again after its queue held its requests (the
/// driver runs them; passed in, so that links need not know the driver).
///
/// Returns what tells the connection's reader that the writer failed the peer (its queue
/// passed the bound), or `None` if the agent is shut down (the connection closes here).
pub(crate) fn attach_conn(
    this: &Agent,
    peer: WorkerId,
    conn: Arc<dyn Connection>,
    owned: bool,
    on_reading_again: fn(&Agent, WorkerId),
) -> Option<tokio::sync::watch::Receiver<bool>> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Frame>();
    let write = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let budget = {
        let st = this.lock();
        if st.owned.closed {
            // Shut down already: the connection closes here.
            return None;
        }
        st.node.ep().budget().clone()
    };
    // The frame being received from it draws from its budget too (for transports that
    // count it: TCP).
    conn.bill_to(budget.account(peer));
    let queued = Arc::new(OutQueue::new(
        Arc::clone(&this.inner.queued_bytes),
        budget.account(peer),
    ));
    {
        let mut st = this.lock();
        // What the membership said to it while its connection was being set up goes first
        // (with the next pump).
        st.node.handle_link_up(peer);
        st.peers.insert(
            peer,
            PeerLink {
                tx,
                transport: conn.transport(),
                conn: Arc::clone(&conn),
                write: Arc::clone(&write),
                queued: Arc::clone(&queued),
                room: bytes::BytesMut::new(),
            },
        );
    }
    let writer_conn = Arc::clone(&conn);
    let agent = this.clone();
    let mut failed = queued.subscribe_failed();
    let reader_failed = queued.subscribe_failed();
    let writer = async move {
        loop {
            let next = tokio::select! {
                biased;
                _ = until_failed(&mut failed) => None,
                frame = rx.recv() => Some(frame),
            };
            let frame = match next {
                None => break,
                Some(Some(frame)) => frame,
                Some(None) => {
                    if owned {
                        let _ = writer_conn.close().await;
                    }
                    return;
                }
            };
            // Everything queued meanwhile goes out with it, in as few writes as possible.
            let mut batch = vec![frame];
            while batch.len() < WRITE_BATCH {
                match rx.try_recv() {
                    Ok(f) => batch.push(f),
                    Err(_) => break,
                }
            }
            let bytes: usize = batch.iter().map(frame_bytes).sum();
            let sent = tokio::select! {
                biased;
                _ = until_failed(&mut failed) => None,
                sent = async {
                    let _turn = write.lock().await;
                    writer_conn.send_many(batch).await
                } => Some(sent),
            };
            let resumed = queued.sub(bytes);
            match sent {
                None => break,
                Some(Ok(())) => {
                    if resumed {
                        // It reads again: its held requests run (the driver's part).
                        on_reading_again(&agent, peer);
                    }
                }
                Some(Err(e)) => {
                    // Nothing more goes out on it: what is queued is dropped and no longer
                    // counted (`Agent::queued_bytes` drops back; the peer's budget is freed).
                    rx.close();
                    while let Ok(frame) = rx.try_recv() {
                        queued.sub(frame_bytes(&frame));
                    }
                    peer_lost_on(
                        &agent,
                        peer,
                        LostCause::Transport(Box::new(e)),
                        &writer_conn,
                    );
                    return;
                }
            }
        }
        // Past the budget: free what is queued, then fail the peer (its calls fail naming the
        // budget) and close the connection.
        rx.close();
        while let Ok(frame) = rx.try_recv() {
            queued.sub(frame_bytes(&frame));
        }
        drop(rx);
        let cause = queued.cause();
        if let Some(cause) = cause {
            peer_lost_on(&agent, peer, cause, &writer_conn);
        }
        let _ = writer_conn.close().await;
    };
    this.track(true, writer);
    Some(reader_failed)
}

/// [`peer_lost`], if `conn` is still the connection to `peer` (a worker
/// that left and joined again has a new one, which the old one's end must not touch).
pub(crate) fn peer_lost_on(
    this: &Agent,
    peer: WorkerId,
    cause: LostCause,
    conn: &Arc<dyn Connection>,
) {
    let current = this
        .lock()
        .peers
        .get(&peer)
        .is_some_and(|l| Arc::ptr_eq(&l.conn, conn));
    if current {
        peer_lost(this, peer, cause);
    } else {
        debug!("an old connection to rank {peer} ended: {cause}");
    }
}

/// Member `peer` left a dynamic group (the membership decided it): the endpoint treats it
/// as a lost peer (its calls fail naming it, its forks stop keeping our values alive, the
/// forks of its values are forgotten), and its connection closes once what is queued for
/// it is sent.
pub(crate) fn member_left(this: &Agent, peer: WorkerId) {
    // (The endpoint has it as left and its held requests are dropped: the node applied the
    // membership's removal.)
    let link = this.lock().peers.remove(&peer);
    drop(link);
    // For subscribers a member that left is gone as a lost one is (autograd drops the
    // contexts it made or knew): the endpoint's `Event::PeerLost`, dispatched here.
    this.pump();
}

/// Drops every connection (a join that failed, before it is tried again).
pub(crate) fn close_links(this: &Agent) {
    let links = std::mem::take(&mut this.lock().peers);
    drop(links);
}

/// Sends a membership frame under the state's lock, taken by the caller (the pump). (The node holds
/// a frame for a peer whose connection is being set up until it is attached.)
pub(crate) fn send_control_locked(st: &mut State, to: WorkerId, frame: Frame) {
    if let Some(link) = st.peers.get(&to) {
        link.queued.enqueue(&link.tx, frame);
    } else {
        debug!("no connection to rank {to} for a membership message");
    }
}

/// Drops `peer` for `violation`, found above the endpoint (a handler's check: distributed
/// autograd's state), as a frame's violation drops it: lost as
/// [`LostCause::Misbehaved`] (its calls fail naming the violation, subscribers are told once,
/// the contexts and references it took part in go), and its connection is closed at once
/// (what was queued for it is dropped; in a static group the world group's mesh breaks, as
/// for a frame's violation). The node decides: a peer lost already keeps its first cause;
/// this worker itself is never dropped.
pub(crate) fn fail_peer(this: &Agent, peer: WorkerId, violation: ProtocolViolation) {
    // A static group's connection is the group's (the agent's writer does not close it):
    // closed here, as the group closes one whose frame broke the protocol.
    drop_peer(this, peer, LostCause::Misbehaved(Box::new(violation)));
}

/// Drops `peer` for passing its budget outside its queue (its held requests): lost as
/// [`LostCause::OverBudget`], its connection closed, as a queue past the budget drops it.
pub(crate) fn drop_over_budget(
    this: &Agent,
    peer: WorkerId,
    over: tensorwire_core::budget::OverBudget,
) {
    drop_peer(this, peer, LostCause::OverBudget(Box::new(over)));
}

/// Loses `peer` for `cause` and closes its connection, after telling it why where the node
/// says it can hear it (`Node::handle_dropped`: a static group's abort in this worker's name,
/// sent best effort, bounded as the mesh bounds its own).
fn drop_peer(this: &Agent, peer: WorkerId, cause: LostCause) {
    let said = cause.to_string();
    let (conn, dropped) = {
        let mut st = this.lock();
        let conn = st.peers.get(&peer).map(|l| Arc::clone(&l.conn));
        let dropped = st.node.handle_dropped(peer, cause, this.now());
        if dropped != Dropped::Itself {
            st.peers.remove(&peer);
        }
        (conn, dropped)
    };
    let Dropped::Close { tell } = dropped else {
        warn!("a violation of this worker's own messages is not applied: {said}");
        return;
    };
    warn!(
        "lost the connection to {} (rank {peer}): {said}",
        this.name_of(peer)
    );
    this.pump();
    if let Some(conn) = conn {
        let runtime = Arc::clone(&this.inner.runtime);
        this.spawn(async move {
            if let Some(abort) = tell {
                let _ = runtime.timeout(ABORT_SEND_TIMEOUT, conn.send(abort)).await;
            }
            let _ = conn.close().await;
        });
    }
}

/// The connection to `peer` is gone for `cause`: recorded once, in the endpoint (the first
/// cause stays), which tells subscribers once (its `Event::PeerLost`, dispatched by the pump
/// below), whoever found the loss first.
pub(crate) fn peer_lost(this: &Agent, peer: WorkerId, cause: LostCause) {
    let name = this.name_of(peer);
    if matches!(cause, LostCause::Shutdown | LostCause::Left) {
        info!("{name} (rank {peer}) is gone: {cause}");
    } else {
        warn!("lost the connection to {name} (rank {peer}): {cause}");
    }
    {
        let mut st = this.lock();
        st.peers.remove(&peer);
        // The endpoint records it, a dynamic group's membership drops it (handing
        // coordination on, if it coordinated) and its held requests go.
        st.node.handle_peer_lost(peer, cause, this.now());
    }
    this.pump();
}

pub(crate) fn send(
    this: &Agent,
    st: &mut State,
    t: Transmit<Body>,
    direct: Option<&mut Few<DirectWrite>>,
) {
    // A shutdown's last words go through the writers, which shutdown lets finish; a task
    // writing directly may be one that stopping the agent cancels.
    let direct = direct.filter(|_| {
        !matches!(
            t.header,
            Header::Shutdown { .. } | Header::ShutdownFailed { .. }
        )
    });
    // One look-up of the link. Lost earlier: the endpoint keeps that first cause. Never
    // connected: this is its loss, and subscribers hear of it as of any other (once: the
    // endpoint's `Event::PeerLost`, which the pump that sends this dispatches next).
    let to = t.to;
    let lost = |st: &mut State| {
        (st.node.ep_mut()).handle_peer_lost(to, LostCause::NoConnection, this.now());
    };
    let Some(link) = st.peers.get_mut(&t.to) else {
        return lost(st);
    };
    // A request announces the references in its arguments (their owner holds them from its
    // arrival); a reply's header carries its own (core's one encoder decides). The header
    // goes into the link's room (no allocation of its own).
    let frame = match Envelope::frame_in(t.header, t.body, &mut link.room) {
        Ok(f) => f,
        Err(e) => {
            warn!("cannot encode a message header: {e}");
            return;
        }
    };
    if let Some(out) = direct {
        // Already writing to this peer: the frame joins that write.
        if let Some(w) = out.iter_mut().find(|w| w.peer == t.to) {
            w.frames.push(frame);
            return;
        }
        if link.queued.is_empty() {
            if let Ok(mut frames) = Arc::clone(&link.write).try_lock_owned() {
                // (Empty: every direct write sends or takes what it gathered.)
                frames.push(frame);
                out.push(DirectWrite {
                    peer: t.to,
                    conn: Arc::clone(&link.conn),
                    frames,
                });
                return;
            }
        }
    }
    if !link.queued.enqueue(&link.tx, frame) {
        lost(st);
    }
}

/// Copies the device tensors of a deferred call or remote to host memory, then hands its
/// body to the endpoint (or abandons it, failing the call, if a copy fails).
pub(crate) fn supply_when_copied(
    this: &Agent,
    id: MessageId,
    to: WorkerId,
    target: Option<MethodTarget>,
    prepared: tensors::Prepared,
) {
    let agent = this.clone();
    this.spawn(async move {
        let copied = crate::ipc::to_wire(&agent, to, prepared.tensors).await;
        {
            let mut st = agent.lock();
            match copied {
                Ok(wire) => st.node.ep_mut().supply_body(
                    id,
                    Body {
                        target,
                        data: prepared.data,
                        tensors: wire,
                        forks: prepared.forks.clone(),
                    },
                ),
                Err(e) => {
                    let now = agent.now();
                    st.node.ep_mut().abandon(id, &e.to_string(), now);
                    for f in &prepared.forks {
                        st.node.ep_mut().cancel_fork(*f, to, now);
                    }
                }
            }
        }
        agent.pump();
    });
}

#[cfg(test)]
mod tests;
