//! `Agent::barrier` and `Agent::all_gather` in a dynamic group, over RPC (as PyTorch's
//! `rpc.api._all_gather`): the driver of [`tensorwire_core::protocol::gather`], which decides
//! everything (who leads, what a round is, when it ends, what is refused, what a peer can make
//! the leader hold). This module only carries bytes and timers:
//!
//! - a member sends its [`Contribution`](tensorwire_core::protocol::gather::Contribution) to the leader as a call of the internal function
//!   [`GATHER`] ([`gather_among`]) and turns the answer into values or an [`RpcError`]; both
//!   travel as bytes in core's formats (`Contribution::encode`/`decode`,
//!   `GatherOutcome::encode`/`decode`), which the fuzz targets read with the same decoders;
//! - on the leader, each call of [`GATHER`] hands its contribution to core's node (which owns
//!   the [`GatherLeader`](tensorwire_core::protocol::gather::GatherLeader) beside the endpoint)
//!   and waits for its answer; the rounds' deadlines are the node's timer and lost peers the
//!   node's losses, both run by the one driver.
//!
//! Nothing goes through the store.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::protocol::gather::{
    self, GatherEnd, GatherFailure, GatherOutcome, GatherToken,
};
use tensorwire_core::protocol::node::GatherCallRefused;
use tensorwire_core::protocol::WorkerId;
use tokio::sync::oneshot;

use crate::error::{RpcError, WaitingFor};
use crate::functions::{finish, Handler, HandlerError, Invocation};
use crate::state::Agent;

/// The internal function the members call on the leader (not in the user's table).
pub(crate) const GATHER: &str = gather::GATHER_FUNCTION;

/// Tells the node when a call of [`GATHER`] ends without its answer (the handler dropped).
struct Abandon<'a> {
    agent: &'a Agent,
    token: GatherToken,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        {
            let mut st = self.agent.lock();
            if st.gathers_waiting.remove(&self.token).is_some() {
                st.node.handle_gather_abandoned(self.token);
            }
        }
        // The rounds it ended answer the others: the driver moves that along.
        self.agent.wake();
    }
}

/// The leader's side of one call: hands the contribution's bytes to the node (which decodes
/// and checks them) and waits for its answer (the round's deadline is the node's timer, a lost
/// member the node's loss: the driver runs both).
async fn lead(
    agent: &Agent,
    from: WorkerId,
    args: &[u8],
) -> Result<GatherOutcome, Box<GatherCallRefused>> {
    let (tx, rx) = oneshot::channel();
    let token = {
        let now = agent.now();
        let mut st = agent.lock();
        let token = st.node.handle_gather_call(now, from, args)?;
        st.gathers_waiting.insert(token, tx);
        token
    };
    let _abandon = Abandon { agent, token };
    // The driver delivers an answer given at once (a refusal, the round's last value) and
    // the other callers' answers it completes, and sleeps until a new deadline.
    agent.wake();
    Ok(rx.await.unwrap_or(GatherOutcome::Missing(Vec::new())))
}

/// What the gathers this worker leads hold now.
pub(crate) fn debug_info(agent: &Agent) -> crate::debug::GatherDebugInfo {
    agent.lock().node.gathers().debug_info()
}

/// The leader's side: the handler of [`GATHER`].
pub(crate) fn handler() -> Handler<Agent> {
    Arc::new(|mut inv: Invocation<Agent>| {
        Box::pin(async move {
            // The contribution travels as bytes that the node decodes (one format, one
            // decoder: the fuzz targets drive the same). What the node says no honest member
            // sends drops its sender, as a forged frame would.
            let bytes: Vec<u8> = inv.arguments().await?;
            let agent = inv.agent.clone();
            let outcome = lead(&agent, inv.caller, &bytes).await.map_err(|refused| {
                let GatherCallRefused { error, violation } = *refused;
                if let Some(violation) = violation {
                    agent.fail_peer(inv.caller, violation);
                }
                HandlerError::BadArguments(error.to_string())
            })?;
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
    resolved.map_err(|failure| match failure.told(leader) {
        GatherEnd::TimedOut(missing) => RpcError::Timeout {
            what: what.to_owned(),
            after: timeout,
            waiting_for: Some(WaitingFor::Workers(
                missing.iter().map(|r| agent.worker(*r)).collect(),
            )),
        },
        GatherEnd::Failed(source) => RpcError::Call {
            to: agent.name_of(leader),
            function: what.to_owned(),
            source,
        },
    })
}
