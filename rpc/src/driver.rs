//! The driver: moves what core's node (the endpoint and a dynamic group's membership)
//! produced along (frames to the peers' writers, events to their handlers) and sleeps until
//! the node's next timer or until woken.
//!
//! Today the node is also pumped on the calling task of an API call or a reader (one
//! wake-up less per message); DESIGN's target is this driver alone polling the node.

use std::sync::Arc;

use tensorwire_core::ports::transport::Connection;
use tensorwire_core::protocol::node::{counts_as_running, NodeEvent, Outgoing};
use tensorwire_core::protocol::{Event, LostCause, ProtocolViolation, RunState, WorkerId};
use tensorwire_core::wire::Frame;

use crate::links::{self, peer_lost_on, until_failed, DirectWrite, Few};
use crate::membership;
use crate::serve;
use crate::state::Agent;
use crate::state::{Body, State};
use tensorwire_core::protocol::gather::GatherOutcome;
use tensorwire_core::protocol::served::ServeFailure;
use tensorwire_core::protocol::{ConfirmError, ShutdownError};
use tokio::sync::oneshot;

/// Attaches an agent-owned connection to `peer` (its writer: see [`links::attach_conn`]) and
/// starts its reader, which hands every frame to the endpoint through [`on_frame`].
pub(crate) fn attach(this: &Agent, peer: WorkerId, conn: Arc<dyn Connection>) {
    let Some(mut reader_failed) =
        links::attach_conn(this, peer, Arc::clone(&conn), true, resume_requests)
    else {
        return;
    };
    let agent = this.clone();
    let cheap_sends = conn.cheap_sends();
    // One receive future for every frame (the adapter's), not a boxed `recv` per frame.
    let mut frames = Arc::clone(&conn).into_frames();
    this.spawn(async move {
        loop {
            let received = tokio::select! {
                biased;
                // The writer fails the peer (its queue passed the bound): stop reading it.
                _ = until_failed(&mut reader_failed) => return,
                received = std::future::poll_fn(|cx| frames.poll_recv(cx)) => received,
            };
            match received {
                Ok(frame) => {
                    let direct = cheap_sends || conn.received_all();
                    if let Err(violation) = on_frame(&agent, peer, frame, direct) {
                        peer_lost_on(
                            &agent,
                            peer,
                            LostCause::Misbehaved(Box::new(violation)),
                            &conn,
                        );
                        return;
                    }
                }
                Err(e) => {
                    if agent.lock().node.ep().state() == RunState::Running {
                        peer_lost_on(&agent, peer, LostCause::Transport(Box::new(e)), &conn);
                    }
                    return;
                }
            }
        }
    });
}

/// Hands a received frame to the endpoint. A frame that breaks the protocol is an error:
/// the connection to that peer is dropped (its calls fail naming it), never a silent loss.
///
/// With `direct` (a connection whose sends are cheap, or one that holds no further frame
/// of the same read: see `Connection::cheap_sends` and `Connection::received_all`), what
/// handling it produced is written on the reader's task, before it waits for the next
/// frame (see [`pump_now`]); else it goes through the writers, which batch
/// it with the replies to the other frames of the same read.
pub(crate) fn on_frame(
    this: &Agent,
    from: WorkerId,
    frame: Frame,
    direct: bool,
) -> Result<(), ProtocolViolation> {
    // Told apart by kind, checked and handed to its part in core, in one place.
    let now = this.now();
    let handled = this.lock().node.handle_frame(now, from, frame);
    if direct {
        pump_now(this);
    } else {
        this.pump();
    }
    handled
}

/// Moves what the endpoint produced along, on the calling task: messages to the peers'
/// writers (in order, under the lock) and events to their handlers. Wakes the driver only
/// when a timer is now due earlier than the one it sleeps on. Must run inside the runtime
/// (dispatching may spawn tasks); `Drop` impls use [`wake`](crate::agent::Agent::wake) instead.
pub(crate) fn pump(this: &Agent) {
    pump_with(this, None);
}

/// [`pump`] for a task that cannot wait (a caller's `rpc_async`): messages to a
/// peer whose writer is idle are written on this task as far as the connection takes them
/// without waiting (one wake-up of the writer less per message); the rest of such a write
/// goes on in a writer task, which shutdown lets finish, holding the peer's write turn (so
/// order is kept).
pub(crate) fn pump_now(this: &Agent) {
    let mut writes = Few::new();
    pump_with(this, Some(&mut writes));
    for mut w in writes.all() {
        // Written here and now when the connection takes it all (no future, no box); else
        // the rest goes on below, as `try_send_now` asks.
        let now = w.conn.try_send_now(&mut w.frames);
        if now.is_some() {
            // What a failed send left is not sent after it; a large batch's room goes.
            w.frames.clear();
            if w.frames.capacity() > links::WRITE_BATCH {
                *w.frames = Vec::new();
            }
        }
        match now {
            Some(Ok(())) => continue,
            Some(Err(e)) => {
                links::peer_lost(this, w.peer, LostCause::Transport(Box::new(e)));
                continue;
            }
            None => {}
        }
        let agent = this.clone();
        let mut write = Box::pin(async move {
            let DirectWrite {
                peer,
                conn,
                mut frames,
            } = w;
            let rest = std::mem::take(&mut *frames);
            if let Err(e) = conn.send_many(rest).await {
                links::peer_lost(&agent, peer, LostCause::Transport(Box::new(e)));
            }
        });
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if std::future::Future::poll(write.as_mut(), &mut cx).is_pending() {
            this.track(true, write);
        }
    }
}

pub(crate) fn pump_with(this: &Agent, mut direct: Option<&mut Few<DirectWrite>>) {
    // One list for every round, filled under the lock and emptied in place after it: a step
    // holds a whole event, and each move of the list (out of the lock's block, into an
    // iterator) and the iterator's drop were a cost of every message.
    let mut steps = Few::new();
    loop {
        let (wake_driver, released) = {
            let mut st = this.lock();
            while let Some(out) = st.node.poll_transmit() {
                match out {
                    Outgoing::Message(t) => links::send(this, &mut st, t, direct.as_deref_mut()),
                    Outgoing::Control { to, frame } => {
                        links::send_control_locked(&mut st, to, frame);
                    }
                }
            }
            // An event that only tells its waiter (a call's reply, above all) has its waiter
            // taken under this lock (no second take per reply); every event is acted on after
            // it, in order.
            while let Some(e) = st.node.poll_event() {
                steps.push(deliver(&mut st, e));
            }
            let wake_driver = st.node.timer_moved_earlier();
            (wake_driver, st.node.take_released())
        };
        // The IPC exports the node let go of, dropped outside the lock.
        drop(released);
        if wake_driver {
            this.wake();
        }
        // Only an event dispatched may have given the node more to do.
        let mut dispatched = false;
        steps.take_each(|step| {
            let e = match step {
                Step::Deliver(d) => return d.send(),
                Step::Dispatch(e) => e,
            };
            dispatched = true;
            match e {
                NodeEvent::Endpoint(e) => run(this, e),
                NodeEvent::OverBudget { peer, over } => links::drop_over_budget(this, peer, over),
                NodeEvent::Member(a) => membership::perform(this, a),
                // Taken care of under the pump's lock (see `deliver`).
                NodeEvent::Gathered { .. } => {}
            }
        });
        if !dispatched {
            return;
        }
    }
}

/// `peer` reads again (its writer saw its queue come down to half the hold mark): the node
/// lets its held requests run while its budget allows, and they are dispatched here.
pub(crate) fn resume_requests(this: &Agent, peer: WorkerId) {
    if this.lock().node.handle_reading_again(peer) {
        this.pump();
    }
}

fn run(this: &Agent, ev: Event<Body>) {
    match ev {
        Event::Call {
            token,
            function,
            body,
            deadline,
        } => {
            let from = running(this, token.from(), &function);
            serve::serve(this, (token, from), function, body, None, deadline);
        }
        Event::Remote {
            token,
            function,
            body,
            rref,
            deadline,
        } => {
            let from = running(this, token.from(), &function);
            serve::serve(this, (token, from), function, body, Some(rref), deadline);
        }
        Event::Fetch { token, rref } => {
            let value = this.lock().values.get(&rref).cloned();
            let from_peer = token.from() != this.inner.me.id;
            let agent = this.clone();
            let answer = async move {
                let me = agent.inner.me.id;
                let outcome = match value {
                    Some(v) => serve::reply_body(&agent, &*v, token.from(), None).await,
                    None => Err(ServeFailure::NoValue {
                        rref,
                        worker: agent.inner.me.name.clone(),
                    }
                    .to_caller(me)),
                };
                agent.lock().node.ep_mut().respond(token, outcome);
            };
            // A value in host memory is answered here and now (the pump that dispatched
            // this sends the reply, in the same write as what it sends already: after a
            // `remote`, its acknowledgement); one with device tensors waits for the copies
            // in a task of its own, as does a fetch by this worker itself (dispatched from
            // inside its `to_here`).
            let mut answer = Box::pin(answer);
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if !from_peer || std::future::Future::poll(answer.as_mut(), &mut cx).is_pending() {
                let agent = this.clone();
                this.spawn(async move {
                    answer.await;
                    pump_now(&agent);
                });
            }
        }
        // Every loss, however it was found (a link's end, a violation, a forgery found after
        // its message), once: subscribers hear of it here and only here.
        Event::PeerLost { peer, cause } => {
            this.inner
                .peer_events
                .emit(crate::peer_events::PeerEvent::Lost {
                    worker: peer,
                    cause,
                })
        }
        // A forgery found after its message (see `Event::Misbehaved`): the endpoint has
        // handled the peer as lost (and reported it); its connection is dropped as for any
        // violation.
        Event::Misbehaved { peer, violation } => crate::links::fail_peer(this, peer, violation),
        // Taken care of under the pump's lock (see `deliver`).
        Event::Completed { .. }
        | Event::ConfirmWaitDone { .. }
        | Event::ReleaseValue { .. }
        | Event::ShutdownComplete { .. }
        | Event::Confirmed { .. } => {}
    }
}

/// A request of `function` from `from` is served: `Some(from)` if it counts as one of its
/// sender's running requests (the node counted it as it came out: its end is told to the node
/// with its answer, `Node::respond`). Core decides, without the node's lock.
fn running(this: &Agent, from: WorkerId, function: &str) -> Option<WorkerId> {
    counts_as_running(this.inner.me.id, from, function).then_some(from)
}

/// The driver: moves the node's output to peers and the application, and runs its one timer
/// (the earliest deadline of the endpoint's and the membership's).
pub(crate) async fn drive(agent: Agent) {
    loop {
        agent.pump();
        let (next, swept) = {
            let mut st = agent.lock();
            let swept = st.sweep_abandoned();
            (st.node.arm_timer(), swept)
        };
        // What was swept (its waiters dropped here, after the lock) may have given the node
        // a message to send (a dropped reference's delete): pumped before the driver sleeps.
        if swept.is_some() {
            continue;
        }
        match next {
            Some(at) => {
                tokio::select! {
                    () = agent.inner.wake.notified() => {}
                    () = agent.inner.runtime.sleep_until(at) => {
                        let now = agent.now();
                        agent.lock().node.handle_timeout(now);
                    }
                }
            }
            None => agent.inner.wake.notified().await,
        }
    }
}

/// What an event that only tells its waiter hands over, taken under the lock and done after
/// it ([`Delivery::send`]).
enum Delivery {
    /// A call ended: its outcome is in its waiter, and this task reads it.
    Call(std::task::Waker),
    Confirmed(
        oneshot::Sender<Result<(), ConfirmError>>,
        Result<(), ConfirmError>,
    ),
    Shutdown(
        oneshot::Sender<Result<(), ShutdownError>>,
        Result<(), ShutdownError>,
    ),
    Gathered(oneshot::Sender<GatherOutcome>, GatherOutcome),
    /// A value released: dropped after the lock (a user value may hold remote references,
    /// whose `Drop` takes the lock again).
    Released(Option<Arc<dyn crate::functions::Value>>),
    /// Its waiter is gone, or none waits.
    Nobody,
}

impl Delivery {
    fn send(self) {
        match self {
            Delivery::Call(waker) => waker.wake(),
            Delivery::Confirmed(tx, outcome) => drop(tx.send(outcome)),
            Delivery::Shutdown(tx, outcome) => drop(tx.send(outcome)),
            Delivery::Gathered(tx, outcome) => drop(tx.send(outcome)),
            Delivery::Released(value) => drop(value),
            Delivery::Nobody => {}
        }
    }
}

/// What the pump does with an event once the lock is let go of.
enum Step {
    /// Tell its waiter (taken under the lock).
    Deliver(Delivery),
    /// Dispatch it.
    Dispatch(NodeEvent<Body>),
}

/// Takes what `e` hands its waiter from `st`, if `e` only tells one (dropped if its waiter
/// is gone, or if none waits: `RRef::confirmed_by_owner` asks the endpoint, `is_confirmed`,
/// and waits for every confirmation end in `ConfirmWaitDone`); else `e` is to be dispatched.
fn deliver(st: &mut State, e: NodeEvent<Body>) -> Step {
    let delivery = match e {
        NodeEvent::Endpoint(Event::Completed { id, outcome }) => {
            st.waiters.end(id, outcome).map(Delivery::Call)
        }
        NodeEvent::Endpoint(Event::ConfirmWaitDone { wait, outcome }) => {
            (st.confirm_waits.remove(&wait)).map(|tx| Delivery::Confirmed(tx, outcome))
        }
        NodeEvent::Endpoint(Event::ShutdownComplete { outcome }) => {
            (st.shutdown_waiter.take()).map(|tx| Delivery::Shutdown(tx, outcome))
        }
        NodeEvent::Endpoint(Event::ReleaseValue { rref }) => {
            Some(Delivery::Released(st.values.remove(&rref)))
        }
        NodeEvent::Endpoint(Event::Confirmed { .. }) => None,
        NodeEvent::Gathered { token, outcome } => {
            (st.gathers_waiting.remove(&token)).map(|tx| Delivery::Gathered(tx, outcome))
        }
        other => return Step::Dispatch(other),
    };
    Step::Deliver(delivery.unwrap_or(Delivery::Nobody))
}
