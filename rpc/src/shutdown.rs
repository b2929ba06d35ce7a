//! Stopping an agent: the graceful termination detection of a static group (decided by the
//! endpoint), and the release of everything the agent holds, within one deadline.

use std::time::{Duration, Instant};

use tensorwire_core::ports::process_group::ProcessGroup;
use tensorwire_core::protocol::shutdown::graceful_deadline;
use tensorwire_core::protocol::shutdown::plan::Stage;
use tensorwire_core::protocol::{Endpoint, WorkerId};
use tokio::sync::oneshot;
use tracing::{debug, info};

use crate::error::{RpcError, WaitingFor};
use crate::init::GROUP_KIND;
use crate::state::Agent;
use crate::state::Body;

/// Stops the endpoint (pending calls fail), ends every task of the agent and waits for
/// them, then lets go of the store. Writers get until `deadline` to send what is queued and
/// close their connections. (A graceful shutdown of a static group runs over the members'
/// connections, not the store: rank 0, which hosts it, need not wait for anyone.)
pub(crate) async fn stop_and_release(this: &Agent, deadline: Instant) {
    // The task sets are taken out under the lock and ended after it (ending a task may drop
    // what takes the lock).
    let (writers, mut others) = {
        let mut st = this.lock();
        st.owned.closed = true;
        st.node.ep_mut().stop();
        (
            std::mem::take(&mut st.owned.writers),
            std::mem::take(&mut st.owned.others),
        )
    };
    this.inner.peer_events.close();
    // Deliver the failures of pending calls now (the driver is about to stop).
    this.pump();
    // The values this worker kept for others go too, dropped once the guard is gone (they
    // may hold remote references, whose `Drop` takes the lock; kept, they would also keep
    // the agent alive through those references). Dropping the links lets the writers
    // finish; a waiter still left learns that the agent stopped. A call that ended keeps its
    // outcome for its future, which may be awaited after the shutdown returned.
    let (values, peers, waiting) = {
        let mut st = this.lock();
        (
            std::mem::take(&mut st.values),
            std::mem::take(&mut st.peers),
            st.waiters.take_waiting(),
        )
    };
    // A call still waited for is woken to find its waiter gone.
    waiting.into_iter().for_each(std::task::Waker::wake);
    drop((values, peers));
    others.abort_all();
    while others.join_next().await.is_some() {}
    let mut writers = writers;
    let flushed = this
        .runtime()
        .timeout_at(deadline, async {
            while writers.join_next().await.is_some() {}
        })
        .await;
    if flushed.is_err() {
        writers.abort_all();
        while writers.join_next().await.is_some() {}
    }
    // The group's goodbyes close the shared connections (its readers end with them).
    let group = this.lock().owned.group.take();
    if let Some(group) = group {
        if this
            .runtime()
            .timeout_at(deadline, group.shutdown())
            .await
            .is_err()
        {
            debug!("the group's goodbyes did not all go out before the deadline");
        }
    }
    let store = this.lock().owned.store.take();
    drop(store);
    let rdv = this.lock().owned.rendezvous.take();
    if let Some(rdv) = rdv {
        rdv.shutdown().await;
    }
}

/// A graceful shutdown of a static group, decided by the endpoint (see
/// `tensorwire_core::protocol::shutdown`): our calls answered, every member's calls
/// answered, nothing outstanding here, every member idle; over the members' connections.
/// Fails naming the members that were lost, or at the deadline those it still waits for.
pub(crate) async fn graceful(
    this: &Agent,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), RpcError> {
    let info = this.debug_info();
    if info.protocol.holds_references() {
        info!(
            "graceful shutdown while this worker still holds remote references (they stop working): {info}"
        );
    }
    let members: Vec<WorkerId> = (this.lock().node.directory().workers())
        .map(|w| w.id)
        .collect();
    let ends = graceful_deadline(deadline, timeout);
    this.run_shutdown(timeout, |ep| {
        ep.begin_graceful_shutdown(members, Some(ends));
    })
    .await
}

/// Starts a shutdown of the endpoint with `begin` and waits for its outcome (the driver
/// delivers it as an event).
pub(crate) async fn run_shutdown(
    this: &Agent,
    timeout: Duration,
    begin: impl FnOnce(&mut Endpoint<Body>),
) -> Result<(), RpcError> {
    let (tx, rx) = oneshot::channel();
    {
        let mut st = this.lock();
        st.shutdown_waiter = Some(tx);
        begin(st.node.ep_mut());
    }
    // The driver sends what it produced and delivers its outcome.
    this.wake();
    match rx.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(if e.lost {
            RpcError::ShutdownIncomplete {
                waiting_for: e.missing.iter().map(|r| this.worker(*r)).collect(),
                source: e,
            }
        } else {
            RpcError::Timeout {
                what: format!("shutdown: {e}"),
                after: timeout,
                waiting_for: Some(WaitingFor::Workers(
                    e.missing.iter().map(|r| this.worker(*r)).collect(),
                )),
            }
        }),
        Err(_) => Err(RpcError::NotRunning),
    }
}

/// [`Agent::shutdown`]: the stages within one deadline, then the release on a task of its own.
pub(crate) async fn shutdown(this: &Agent, how: crate::Shutdown) -> Result<(), RpcError> {
    let plan = how.plan(this.inner.dynamic, this.inner.me.id);
    let timeout = plan.timeout;
    let deadline = this.runtime().deadline_after(timeout);
    let stages = async {
        let outcome = match plan.stage {
            Stage::Graceful => self::graceful(this, deadline, timeout).await,
            Stage::Leave => crate::init::dynamic::leave(this, timeout).await,
            Stage::Nothing => Ok(()),
        };
        if plan.clears_group_kind {
            if let Ok(store) = this.store() {
                if let Err(e) = store.delete_key(GROUP_KIND).await {
                    debug!("could not remove {GROUP_KIND} from the store: {e}");
                }
            }
        }
        outcome
    };
    // Every wait of the stages ends by the deadline and says for whom; past it, the store
    // is what did not answer.
    let result = this
        .runtime()
        .timeout_at(deadline, stages)
        .await
        .unwrap_or_else(|_| {
            Err(RpcError::Timeout {
                what: "shutdown".into(),
                after: timeout,
                waiting_for: Some(WaitingFor::Store),
            })
        });
    // On a task of its own: shutdown may be called from a task of the agent (a served
    // function), which ending the agent's tasks cancels; the agent still stops whole.
    let agent = this.clone();
    this.runtime()
        .spawn(Box::pin(async move {
            agent.stop_and_release(deadline).await;
        }))
        .await;
    result
}
