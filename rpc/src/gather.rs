//! `Agent::barrier` and `Agent::all_gather` in a dynamic group, over RPC (as PyTorch's
//! `rpc.api._all_gather`): the driver of [`tensorwire_core::protocol::gather`], which decides
//! everything (who leads, what a round is, when it ends, what is refused, what a peer can make
//! the leader hold). This module only carries bytes and timers:
//!
//! - a member sends its [`Contribution`] to the leader as a call of the internal function
//!   [`GATHER`] ([`gather_among`]) and turns the answer into values or an [`RpcError`]; both
//!   travel as bytes in core's formats (`Contribution::encode`/`decode`,
//!   `GatherOutcome::encode`/`decode`), which the fuzz targets read with the same decoders;
//! - on the leader, each call of [`GATHER`] hands its contribution to the [`GatherLeader`] and
//!   waits for its answer; while it waits it also sleeps until the leader's next deadline and
//!   then passes the time in, so the timers live exactly as long as someone waits. A task
//!   started with the first contribution tells the leader of lost peers.
//!
//! Nothing goes through the store.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tensorwire_core::protocol::gather::{
    self, Contribution, GatherConfig, GatherFailure, GatherLeader, GatherOutcome, GatherToken,
};
use tensorwire_core::protocol::{
    CallError, MalformedMessage, ProtocolViolation, RemoteError, RemoteErrorKind, WorkerId,
};
use tokio::sync::oneshot;

use crate::error::{RpcError, WaitingFor};
use crate::functions::{finish, Handler, HandlerError, Invocation};
use crate::peer_events::PeerEvent;
use crate::state::Agent;
use crate::state::{Gathers, Leading};

/// The internal function the members call on the leader (not in the user's table).
pub(crate) const GATHER: &str = "__tw/gather";

impl Leading {
    /// Hands every answer the leader has to the call waiting for it.
    fn deliver(&mut self) {
        while let Some((token, outcome)) = self.leader.poll_answer() {
            if let Some(tx) = self.waiting.remove(&token) {
                let _ = tx.send(outcome);
            }
        }
    }
}

fn lock(leading: &Mutex<Option<Leading>>) -> MutexGuard<'_, Option<Leading>> {
    leading.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Tells the leader when a call of [`GATHER`] ends without its answer (the handler dropped).
struct Abandon<'a> {
    leading: &'a Mutex<Option<Leading>>,
    token: GatherToken,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        if let Some(l) = lock(self.leading).as_mut() {
            l.waiting.remove(&self.token);
            l.leader.handle_abandoned(self.token);
            l.deliver();
        }
    }
}

/// Starts (once) the task that tells the leader of lost peers. It holds the leader's state
/// only, not the agent, and ends when the agent's peer events end.
fn watch_peers(agent: &Agent, gathers: &Gathers) {
    if gathers.watching.set(()).is_err() {
        return;
    }
    let mut events = agent.peer_events();
    let leading = Arc::clone(&gathers.leading);
    agent.spawn(async move {
        while let Some(event) = events.recv().await {
            if let PeerEvent::Lost { worker, .. } = event {
                if let Some(l) = lock(&leading).as_mut() {
                    l.leader.handle_peer_lost(worker);
                    l.deliver();
                }
            }
        }
    });
}

/// The leader's side of one call: hands `c` to the state machine and waits for its answer,
/// passing the time in at the leader's deadlines meanwhile.
async fn lead(agent: &Agent, from: WorkerId, c: Contribution) -> GatherOutcome {
    let gathers = agent.gathers();
    watch_peers(agent, gathers);
    let (tx, mut rx) = oneshot::channel();
    let token = {
        let mut guard = lock(&gathers.leading);
        let l = guard.get_or_insert_with(|| Leading {
            leader: GatherLeader::new(agent.worker_info().id, GatherConfig::default()),
            waiting: HashMap::new(),
        });
        let token = l.leader.handle_contribution(agent.now(), from, c);
        l.waiting.insert(token, tx);
        l.deliver();
        token
    };
    let _abandon = Abandon {
        leading: &gathers.leading,
        token,
    };
    loop {
        let next = lock(&gathers.leading)
            .as_ref()
            .and_then(|l| l.leader.poll_timeout());
        let Some(at) = next else {
            // Answered already, or no deadline: only the answer (or a lost peer) ends it.
            return (&mut rx)
                .await
                .unwrap_or(GatherOutcome::Missing(Vec::new()));
        };
        tokio::select! {
            outcome = &mut rx => return outcome.unwrap_or(GatherOutcome::Missing(Vec::new())),
            () = agent.inner.runtime.sleep_until(at) => {
                if let Some(l) = lock(&gathers.leading).as_mut() {
                    l.leader.handle_timeout(agent.now());
                    l.deliver();
                }
            }
        }
    }
}

/// What the gathers this worker leads hold now.
pub(crate) fn debug_info(agent: &Agent) -> crate::debug::GatherDebugInfo {
    let mut info = crate::debug::GatherDebugInfo::default();
    if let Some(l) = lock(&agent.gathers().leading).as_ref() {
        info.rounds = l.leader.rounds();
        info.held_bytes = l.leader.held_bytes();
        info.waiting = l.leader.waiting();
    }
    info
}

/// The leader's side: the handler of [`GATHER`].
pub(crate) fn handler() -> Handler<Agent> {
    Arc::new(|mut inv: Invocation<Agent>| {
        Box::pin(async move {
            // The contribution travels as bytes that core's decoder reads (one format, one
            // decoder: the fuzz targets drive the same). What no honest member sends drops its
            // sender, as a forged frame would.
            let bytes: Vec<u8> = inv.arguments().await?;
            let agent = inv.agent.clone();
            let c = match Contribution::decode(&bytes) {
                Ok(c) => c,
                Err(e) => {
                    let refused = HandlerError::BadArguments(e.to_string());
                    if inv.caller != agent.worker_info().id {
                        agent.fail_peer(
                            inv.caller,
                            ProtocolViolation::Malformed(MalformedMessage::Undecodable(e)),
                        );
                    }
                    return Err(refused);
                }
            };
            let outcome = lead(&agent, inv.caller, c).await;
            if let GatherOutcome::Failed(e) = &outcome {
                // What no honest member sends drops its sender, as a forged frame would.
                if e.is_forgery() && inv.caller != agent.worker_info().id {
                    agent.fail_peer(inv.caller, ProtocolViolation::Gather(e.clone()));
                }
            }
            finish::<_, String>(Ok(outcome.encode()))
        })
    })
}

/// A member's side among every member of the group: sends `value` to the leader and returns
/// every member's, in rank order.
pub(crate) async fn gather_dynamic(
    agent: &Agent,
    what: &str,
    name: &str,
    value: Vec<u8>,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>, RpcError> {
    let everyone: BTreeSet<WorkerId> = agent.worker_infos().iter().map(|w| w.id).collect();
    gather_among(agent, what, name, value, timeout, everyone).await
}

/// [`gather_dynamic`] among `members` only (this worker one of them): the leader is the lowest
/// of them, and only they take part.
pub(crate) async fn gather_among(
    agent: &Agent,
    what: &str,
    name: &str,
    value: Vec<u8>,
    timeout: Duration,
    members: BTreeSet<WorkerId>,
) -> Result<Vec<Vec<u8>>, RpcError> {
    let request = gather::request(name, &members, value, timeout).ok_or(RpcError::NotRunning)?;
    let leader = request.leader;
    let answer: Vec<u8> = agent
        .rpc_sync(
            leader,
            GATHER,
            &request.contribution.encode(),
            Some(request.call_timeout),
        )
        .await?;
    let resolved = GatherOutcome::decode(&answer)
        .map_err(GatherFailure::from)
        .and_then(|outcome| gather::resolve(&members, outcome));
    resolved.map_err(|failure| match failure {
        GatherFailure::Missing(missing) => RpcError::Timeout {
            what: what.to_owned(),
            after: timeout,
            waiting_for: Some(WaitingFor::Workers(
                missing.iter().map(|r| agent.worker(*r)).collect(),
            )),
        },
        other => RpcError::Call {
            to: agent.name_of(leader),
            function: what.to_owned(),
            source: CallError::Remote(RemoteError {
                worker: leader,
                kind: RemoteErrorKind::Failed,
                message: other.to_string(),
            }),
        },
    })
}
