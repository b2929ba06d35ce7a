//! `Agent::barrier` and `Agent::all_gather` in a dynamic group, over RPC (as PyTorch's
//! `rpc.api._all_gather`): a dynamic group has no process group, so every member sends its value
//! to the leader (the lowest rank among the members it sees), which answers all of them once
//! every expected member has sent, with every value in rank order. Nothing goes through the
//! store, and the leader keeps a round only while its callers wait: a round that times out is
//! forgotten by the leader as its callers give up, so memory stays bounded.
//!
//! The leader's wait ends a little before the callers' calls time out, so that a gather that
//! cannot complete fails with [`RpcError::Timeout`] naming the members that did not send,
//! rather than with a bare call timeout.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tensorwire_core::protocol::{CallError, RemoteError, RemoteErrorKind, WorkerId};
use tokio::sync::watch;

use crate::agent::Agent;
use crate::error::RpcError;
use crate::functions::{finish, Handler, Invocation};

/// The internal function the members call on the leader (not in the user's table).
pub(crate) const GATHER: &str = "__tw/gather";

/// How much longer than the leader's wait a member's call to it may take.
const REPLY_MARGIN: Duration = Duration::from_secs(2);

/// What a member sends the leader.
#[derive(Debug, Serialize, Deserialize)]
struct Contribution {
    /// The gather's name: the rounds of different names never mix.
    name: String,
    /// The members the sender expects to take part (its view of the group), ascending.
    expected: Vec<WorkerId>,
    /// How long the leader waits for the others, from this contribution's arrival.
    wait: Duration,
    /// The sender's encoded value.
    value: Vec<u8>,
}

/// What the leader answers.
#[derive(Debug, Serialize, Deserialize)]
enum Outcome {
    /// Every expected member's value, in rank order.
    Done(Vec<(WorkerId, Vec<u8>)>),
    /// The wait ended before these members sent.
    Missing(Vec<WorkerId>),
    /// The contribution does not fit the round under way.
    Refused(String),
}

/// Every value of a completed round, in rank order (`None` until then).
type Gathered = Option<Arc<Vec<(WorkerId, Vec<u8>)>>>;

/// One gather under way on the leader.
struct Round {
    /// Which round under this name: a caller only settles the round it joined.
    id: u64,
    /// Complete, or a caller gave up on it: the next contribution under its name starts a new
    /// round (a member may call the next gather of that name before the last caller of this
    /// one was answered).
    closed: bool,
    expected: BTreeSet<WorkerId>,
    values: BTreeMap<WorkerId, Vec<u8>>,
    done: watch::Sender<Gathered>,
    /// Callers not yet answered; the round is forgotten when none is left.
    waiting: usize,
}

/// The rounds this worker leads, by name.
#[derive(Default)]
pub(crate) struct Gathers {
    rounds: Mutex<HashMap<String, Round>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl Gathers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Round>> {
        self.rounds.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes `from`'s contribution and waits until the round completes or `c.wait` passes.
    async fn contribute(&self, agent: &Agent, from: WorkerId, c: Contribution) -> Outcome {
        let expected: BTreeSet<WorkerId> = c.expected.iter().copied().collect();
        if !expected.contains(&from) {
            return Outcome::Refused(format!(
                "{} sent a value for {:?} without counting itself among the members",
                agent.name_of(from),
                c.name
            ));
        }
        let (id, mut rx) = {
            let mut rounds = self.lock();
            if rounds.get(&c.name).is_some_and(|r| r.closed) {
                rounds.remove(&c.name);
            }
            let round = rounds.entry(c.name.clone()).or_insert_with(|| Round {
                id: self
                    .next_id
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                closed: false,
                expected: expected.clone(),
                values: BTreeMap::new(),
                done: watch::channel(None).0,
                waiting: 0,
            });
            if round.expected != expected {
                return Outcome::Refused(format!(
                    "the members disagree on who takes part in {:?}: {:?} against {:?} (a member joined or left meanwhile)",
                    c.name, round.expected, expected
                ));
            }
            if round.values.insert(from, c.value).is_some() {
                return Outcome::Refused(format!(
                    "{} sent a second value for {:?} before the first round ended",
                    agent.name_of(from),
                    c.name
                ));
            }
            round.waiting += 1;
            if round.values.len() == round.expected.len() {
                let all = round.values.iter().map(|(r, v)| (*r, v.clone())).collect();
                round.done.send_replace(Some(Arc::new(all)));
                round.closed = true;
            }
            (round.id, round.done.subscribe())
        };
        let done = match tokio::time::timeout(c.wait, rx.wait_for(Option::is_some)).await {
            Ok(Ok(v)) => v.clone(),
            _ => None,
        };
        let mut rounds = self.lock();
        let Some(round) = rounds.get_mut(&c.name).filter(|r| r.id == id) else {
            // Replaced once it was closed: completed (answered below) or given up.
            return done.map_or(Outcome::Missing(Vec::new()), |all| {
                Outcome::Done(all.as_ref().clone())
            });
        };
        round.waiting -= 1;
        let outcome = match done {
            Some(all) => Outcome::Done(all.as_ref().clone()),
            None => {
                // Gave up: the round is over for everyone (the others give up at about the
                // same time); a later contribution under this name starts a new one.
                round.closed = true;
                Outcome::Missing(
                    round
                        .expected
                        .iter()
                        .filter(|m| !round.values.contains_key(m))
                        .copied()
                        .collect(),
                )
            }
        };
        if round.waiting == 0 {
            rounds.remove(&c.name);
        }
        outcome
    }
}

/// The leader's side: the handler of [`GATHER`].
pub(crate) fn handler() -> Handler {
    Arc::new(|mut inv: Invocation| {
        Box::pin(async move {
            let c: Contribution = inv.arguments().await?;
            let agent = inv.agent.clone();
            let outcome = agent.gathers().contribute(&agent, inv.caller, c).await;
            finish::<_, String>(Ok(outcome))
        })
    })
}

impl Agent {
    /// A member's side: sends `value` to the leader and returns every member's, in rank order.
    pub(crate) async fn gather_dynamic(
        &self,
        what: &str,
        name: &str,
        value: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, RpcError> {
        let everyone: BTreeSet<WorkerId> = self.worker_infos().iter().map(|w| w.id).collect();
        self.gather_among(what, name, value, timeout, everyone)
            .await
    }

    /// [`gather_dynamic`](Self::gather_dynamic) among `members` only (this worker one of
    /// them): the leader is the lowest of them, and only they take part.
    pub(crate) async fn gather_among(
        &self,
        what: &str,
        name: &str,
        value: Vec<u8>,
        timeout: Duration,
        members: BTreeSet<WorkerId>,
    ) -> Result<Vec<Vec<u8>>, RpcError> {
        let expected: Vec<WorkerId> = members.into_iter().collect();
        let leader = *expected.first().ok_or(RpcError::NotRunning)?;
        // Zero: no deadline, as for calls.
        let (wait, call_timeout) = if timeout.is_zero() {
            (Duration::MAX, Duration::ZERO)
        } else {
            (timeout, timeout.saturating_add(REPLY_MARGIN))
        };
        let contribution = Contribution {
            name: name.to_owned(),
            expected,
            wait,
            value,
        };
        let outcome: Outcome = self
            .rpc_sync(leader, GATHER, &contribution, Some(call_timeout))
            .await?;
        match outcome {
            Outcome::Done(all) => Ok(all.into_iter().map(|(_, v)| v).collect()),
            Outcome::Missing(missing) => Err(RpcError::Timeout {
                what: what.to_owned(),
                after: timeout,
                waiting_for: Some(
                    missing
                        .iter()
                        .map(|r| format!("rank {r} ({})", self.name_of(*r)))
                        .collect::<Vec<_>>()
                        .join(", "),
                ),
            }),
            Outcome::Refused(message) => Err(RpcError::Call {
                to: self.name_of(leader),
                function: what.to_owned(),
                source: CallError::Remote(RemoteError {
                    worker: leader,
                    kind: RemoteErrorKind::Failed,
                    message,
                }),
            }),
        }
    }
}
