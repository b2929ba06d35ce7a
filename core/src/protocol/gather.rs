//! Barriers and all_gathers of a dynamic group, through a leader, decided here, sans-IO.
//!
//! A dynamic group has no process group, so its `barrier` and `all_gather` run as PyTorch's
//! `rpc.api._all_gather` does: every member sends its value to the *leader*, the lowest rank
//! among the members taking part, which answers all of them once every expected member has
//! sent, with every value in rank order.
//!
//! A member's side is two pure functions: [`request`] says whom to send what (and how long
//! the call may take), [`resolve`] turns the leader's [`GatherOutcome`] into the values or a
//! [`GatherFailure`]. The leader's side is a [`GatherLeader`], shaped like the other state
//! machines of [`protocol`](crate::protocol):
//!
//! - input: [`handle_contribution`](GatherLeader::handle_contribution) (a member's
//!   [`Contribution`], arrived as a call; it gives a [`GatherToken`] the answer will name),
//!   [`handle_timeout`](GatherLeader::handle_timeout),
//!   [`handle_peer_lost`](GatherLeader::handle_peer_lost),
//!   [`handle_abandoned`](GatherLeader::handle_abandoned) (the call can no longer be answered);
//! - output: [`poll_answer`](GatherLeader::poll_answer) (an outcome for a waiting call),
//!   [`poll_timeout`](GatherLeader::poll_timeout).
//!
//! # Rounds
//! Contributions under one name form a *round*. The leader is a member of every round it
//! leads, and its own contribution fixes who takes part: until it comes, contributions that
//! name different members are kept in different rounds (candidates), and when it comes, the
//! candidates that named other members than the leader's are answered
//! [`GatherError::Disagreement`] and end. So a member cannot hold a name against the others
//! by sending first with a member list of its choosing. A contribution that names other
//! members than the round the leader has joined, comes from a worker that does not count
//! itself among them, is sent to a worker that is not the lowest of them, or is a second one
//! from the same member, is refused with a [`GatherError`] and changes nothing; the refusals no honest member's [`request`] can cause are
//! [forgeries](GatherError::is_forgery), for which the driver also drops the sender. A round ends when
//! every expected member has sent (every caller gets [`GatherOutcome::Done`]), when one of
//! its callers' waits ends ([`GatherOutcome::Missing`], naming who did not send, to every
//! caller: no value can join it any more), or when an expected member that has not sent is
//! lost ([`GatherError::MemberLost`]). The round is then forgotten, so the next contribution
//! under its name starts a new one. A round whose callers are all gone (lost or abandoned) is
//! forgotten too: the leader keeps a round only while someone waits for it.
//!
//! # What a peer can make the leader hold
//! Each bound is a field of [`GatherConfig`] and is refused with its own [`GatherError`]:
//! the number of rounds under way ([`max_rounds`](GatherConfig::max_rounds)), the bytes of
//! values held ([`max_bytes`](GatherConfig::max_bytes)), the length of a name
//! ([`max_name_len`](GatherConfig::max_name_len)) and of a member list
//! ([`max_members`](GatherConfig::max_members)). A member holds at most one value per round,
//! and each member other than the leader has a share of its own
//! ([`max_rounds_per_member`](GatherConfig::max_rounds_per_member),
//! [`max_bytes_per_member`](GatherConfig::max_bytes_per_member)), so that one member cannot
//! use up the bounds the others need. The leader's own contributions count only against the
//! totals.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::WorkerId;

mod coding;
pub use coding::{decode_value, encode_value};

/// How much longer than the leader's wait a member's call to it may take: the leader's
/// answer that the wait ended must arrive before the call itself times out, so that the
/// member's error names who did not send rather than only the leader.
pub const REPLY_MARGIN: Duration = Duration::from_secs(2);

/// What a member sends the leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Contribution {
    /// The gather's name: rounds of different names never mix.
    pub name: String,
    /// The members the sender expects to take part (its view of the group), ascending.
    pub expected: Vec<WorkerId>,
    /// How long the leader waits for the others, from this contribution's arrival
    /// (`Duration::MAX`: no limit).
    pub wait: Duration,
    /// The sender's encoded value.
    pub value: Vec<u8>,
}

/// What the leader answers a contribution.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GatherOutcome {
    /// Every expected member's value, in rank order.
    Done(Vec<(WorkerId, Vec<u8>)>),
    /// The wait ended before these members sent.
    Missing(Vec<WorkerId>),
    /// The contribution was refused, or the round cannot complete.
    Failed(GatherError),
}

/// Why the leader refused a contribution or ended a round without values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum GatherError {
    /// The member list is empty.
    #[error("gather {name:?}: the list of members is empty")]
    NoMembers {
        /// The gather.
        name: String,
    },
    /// The member list is not strictly ascending (unsorted, or a member twice).
    #[error("gather {name:?}: the list of members {members:?} is not strictly ascending")]
    UnsortedMembers {
        /// The gather.
        name: String,
        /// The list sent.
        members: Vec<WorkerId>,
    },
    /// The sender does not count itself among the members.
    #[error(
        "worker {from} sent a value for gather {name:?} without counting itself among the members"
    )]
    NotAMember {
        /// The sender.
        from: WorkerId,
        /// The gather.
        name: String,
    },
    /// The contribution went to a worker that is not the lowest of its members.
    #[error("gather {name:?} is led by worker {leader}, not by worker {me}")]
    NotLeader {
        /// The gather.
        name: String,
        /// The lowest of the members named.
        leader: WorkerId,
        /// The worker that got the contribution.
        me: WorkerId,
    },
    /// The members disagree on who takes part (a member joined or left meanwhile).
    #[error("the members disagree on who takes part in gather {name:?}: {ours:?} against {theirs:?} (a member joined or left meanwhile)")]
    Disagreement {
        /// The gather.
        name: String,
        /// The members of the round under way.
        ours: Vec<WorkerId>,
        /// The members this contribution named.
        theirs: Vec<WorkerId>,
    },
    /// A second value from one member for the round under way.
    #[error("worker {from} sent a second value for gather {name:?} before the first round ended")]
    Duplicate {
        /// The sender.
        from: WorkerId,
        /// The gather.
        name: String,
    },
    /// An expected member was lost before it sent its value.
    #[error("gather {name:?}: member {member} was lost before it sent its value")]
    MemberLost {
        /// The gather.
        name: String,
        /// The lost member.
        member: WorkerId,
    },
    /// The name is longer than [`GatherConfig::max_name_len`].
    #[error("a gather name of {len} bytes is longer than the leader's limit of {limit} (GatherConfig::max_name_len)")]
    NameTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The member list is longer than [`GatherConfig::max_members`].
    #[error("gather {name:?} names {count} members, more than the leader's limit of {limit} (GatherConfig::max_members)")]
    TooManyMembers {
        /// The gather.
        name: String,
        /// How many it names.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// The leader already has [`GatherConfig::max_rounds`] rounds under way.
    #[error("gather {name:?}: the leader already has {limit} gathers under way (GatherConfig::max_rounds)")]
    TooManyRounds {
        /// The gather that would have started.
        name: String,
        /// The limit.
        limit: usize,
    },
    /// The sender already has values in [`GatherConfig::max_rounds_per_member`] rounds under
    /// way.
    #[error("gather {name:?}: worker {from} already has values in {limit} gathers under way (GatherConfig::max_rounds_per_member)")]
    MemberTooManyRounds {
        /// The gather.
        name: String,
        /// The sender.
        from: WorkerId,
        /// The limit.
        limit: usize,
    },
    /// The value would take the bytes the leader holds of the sender's past
    /// [`GatherConfig::max_bytes_per_member`].
    #[error("gather {name:?}: a value of {len} bytes from worker {from} does not fit; the leader holds {held} of its at most {limit} bytes (GatherConfig::max_bytes_per_member)")]
    MemberTooManyBytes {
        /// The gather.
        name: String,
        /// The sender.
        from: WorkerId,
        /// The value's length.
        len: usize,
        /// Bytes of the sender's values already held.
        held: usize,
        /// The limit.
        limit: usize,
    },
    /// The value would take the bytes the leader holds past [`GatherConfig::max_bytes`].
    #[error("gather {name:?}: a value of {len} bytes does not fit; the leader holds {held} of at most {limit} bytes (GatherConfig::max_bytes)")]
    TooManyBytes {
        /// The gather.
        name: String,
        /// The value's length.
        len: usize,
        /// Bytes already held.
        held: usize,
        /// The limit.
        limit: usize,
    },
}

impl GatherError {
    /// Whether no honest member can cause this refusal: [`request`] always names a
    /// non-empty, ascending member list that includes the sender. A contribution refused so
    /// is its sender's violation (the driver drops the sender), not a race between views.
    pub fn is_forgery(&self) -> bool {
        matches!(
            self,
            GatherError::NoMembers { .. }
                | GatherError::UnsortedMembers { .. }
                | GatherError::NotAMember { .. }
        )
    }
}

/// Why a member's gather failed, from the leader's answer ([`resolve`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GatherFailure {
    /// The wait ended before these members sent.
    #[error("members {0:?} did not send their values in time")]
    Missing(Vec<WorkerId>),
    /// The leader refused the contribution or ended the round.
    #[error(transparent)]
    Leader(#[from] GatherError),
    /// The leader's answer does not parse.
    #[error("the leader's answer: {0}")]
    Malformed(#[from] crate::codec::Undecodable),
    /// The leader's answer breaks the protocol (values of other members than expected, not
    /// in rank order, or without this member's own).
    #[error("the leader answered with values of members {got:?}, expected {expected:?}")]
    WrongMembers {
        /// The members whose values came.
        got: Vec<WorkerId>,
        /// The members expected.
        expected: Vec<WorkerId>,
    },
}

/// What the leader of a dynamic group's gathers holds ([`GatherLeader::debug_info`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GatherDebugInfo {
    /// Rounds under way (candidates the leader has not joined included).
    pub rounds: usize,
    /// Bytes of members' values held.
    pub held_bytes: usize,
    /// Calls waiting for their answer.
    pub waiting: usize,
}

/// "gathers led 2 (10 bytes, 1 waiting)".
impl std::fmt::Display for GatherDebugInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "gathers led {} ({} bytes, {} waiting)",
            self.rounds, self.held_bytes, self.waiting
        )
    }
}

/// The bounds of a [`GatherLeader`]: what its peers can make it hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct GatherConfig {
    /// Rounds under way at once (distinct names). Default 1,024.
    pub max_rounds: usize,
    /// Bytes of values held, over every round. Default 256 MiB.
    pub max_bytes: usize,
    /// Bytes of a gather's name. Default 1,024.
    pub max_name_len: usize,
    /// Members of one gather. Default 65,536.
    pub max_members: usize,
    /// Rounds under way in which one member other than the leader has a value. Default 64.
    pub max_rounds_per_member: usize,
    /// Bytes of one member's values held (a member other than the leader). Default 128 MiB.
    pub max_bytes_per_member: usize,
}

impl Default for GatherConfig {
    fn default() -> Self {
        Self {
            max_rounds: 1024,
            max_bytes: 256 << 20,
            max_name_len: 1024,
            max_members: 1 << 16,
            max_rounds_per_member: 64,
            max_bytes_per_member: 128 << 20,
        }
    }
}

impl GatherConfig {
    /// This configuration with another [`max_rounds`](Self::max_rounds).
    pub fn with_max_rounds(mut self, n: usize) -> Self {
        self.max_rounds = n;
        self
    }

    /// This configuration with another [`max_bytes`](Self::max_bytes).
    pub fn with_max_bytes(mut self, n: usize) -> Self {
        self.max_bytes = n;
        self
    }

    /// This configuration with another [`max_name_len`](Self::max_name_len).
    pub fn with_max_name_len(mut self, n: usize) -> Self {
        self.max_name_len = n;
        self
    }

    /// This configuration with another [`max_members`](Self::max_members).
    pub fn with_max_members(mut self, n: usize) -> Self {
        self.max_members = n;
        self
    }

    /// This configuration with another
    /// [`max_rounds_per_member`](Self::max_rounds_per_member).
    pub fn with_max_rounds_per_member(mut self, n: usize) -> Self {
        self.max_rounds_per_member = n;
        self
    }

    /// This configuration with another
    /// [`max_bytes_per_member`](Self::max_bytes_per_member).
    pub fn with_max_bytes_per_member(mut self, n: usize) -> Self {
        self.max_bytes_per_member = n;
        self
    }
}

/// What a member sends, to whom, and how long its call may take ([`request`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherRequest {
    /// The leader: the lowest member.
    pub leader: WorkerId,
    /// What to send it.
    pub contribution: Contribution,
    /// The call's timeout (zero: none, as for calls).
    pub call_timeout: Duration,
}

/// A member's side: the request for a gather `name` among `members` (this worker one of
/// them) with `value`, bounded by `timeout` (zero: no limit). `None` when `members` is empty.
pub fn request(
    name: &str,
    members: &BTreeSet<WorkerId>,
    value: Vec<u8>,
    timeout: Duration,
) -> Option<GatherRequest> {
    let leader = *members.first()?;
    let (wait, call_timeout) = if timeout.is_zero() {
        (Duration::MAX, Duration::ZERO)
    } else {
        (timeout, timeout.saturating_add(REPLY_MARGIN))
    };
    Some(GatherRequest {
        leader,
        contribution: Contribution {
            name: name.to_owned(),
            expected: members.iter().copied().collect(),
            wait,
            value,
        },
        call_timeout,
    })
}

/// A member's side: the values in rank order from the leader's `outcome` for a gather among
/// `members` (what [`request`] was given), checked: a `Done` must carry exactly one value per
/// member, in rank order.
pub fn resolve(
    members: &BTreeSet<WorkerId>,
    outcome: GatherOutcome,
) -> Result<Vec<Vec<u8>>, GatherFailure> {
    match outcome {
        GatherOutcome::Done(all) => {
            if all.len() != members.len() || all.iter().zip(members).any(|((r, _), m)| r != m) {
                return Err(GatherFailure::WrongMembers {
                    got: all.iter().map(|(r, _)| *r).collect(),
                    expected: members.iter().copied().collect(),
                });
            }
            Ok(all.into_iter().map(|(_, v)| v).collect())
        }
        GatherOutcome::Missing(missing) => Err(GatherFailure::Missing(missing)),
        GatherOutcome::Failed(e) => Err(GatherFailure::Leader(e)),
    }
}

/// How a member's gather that failed ends for its caller ([`GatherFailure::told`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatherEnd {
    /// The wait timed out: these members did not send in time.
    TimedOut(Vec<WorkerId>),
    /// Anything else is the leader's failure, as a remote error of its.
    Failed(super::CallError),
}

impl GatherFailure {
    /// What the caller of a gather led by `leader` is told of this failure: members missing
    /// are a timeout naming them; a refusal, a round ended, an answer that does not parse or
    /// names other members are the leader's failure
    /// ([`RemoteErrorKind::Failed`](super::RemoteErrorKind::Failed)).
    pub fn told(self, leader: WorkerId) -> GatherEnd {
        match self {
            GatherFailure::Missing(missing) => GatherEnd::TimedOut(missing),
            other => GatherEnd::Failed(super::CallError::Remote(super::RemoteError {
                worker: leader,
                kind: super::RemoteErrorKind::Failed,
                message: other.to_string(),
            })),
        }
    }
}

/// A gather among workers listed by the caller, who is not among them ([`check_among`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("barrier_among {name:?}: this worker ({me}) is not among the workers listed")]
pub struct NotAmong {
    /// The barrier's name.
    pub name: String,
    /// This worker's name.
    pub me: String,
}

/// A barrier among `members` only is this worker's (`me`, named `my_name`) to take part in
/// only if it is one of them.
pub fn check_among(
    name: &str,
    (me, my_name): (WorkerId, &str),
    members: &BTreeSet<WorkerId>,
) -> Result<(), NotAmong> {
    if members.contains(&me) {
        return Ok(());
    }
    Err(NotAmong {
        name: name.to_owned(),
        me: my_name.to_owned(),
    })
}

/// Names one contribution waiting for its answer at the leader.
pub type GatherToken = u64;

/// The internal function a member calls on the leader with its contribution (not in the
/// user's table). Its calls do not count as running requests of their sender (a gather waits
/// for the other members, holding nothing but its round, which the gathers bound per member
/// themselves): counted, a member's rounds would hold back its requests that the gathers
/// refuse at once.
pub const GATHER_FUNCTION: &str = "__tw/gather";

/// A caller waiting at the leader.
#[derive(Debug, Clone, Copy)]
struct Waiter {
    token: GatherToken,
    deadline: Option<Instant>,
}

/// One gather under way at the leader.
#[derive(Debug)]
struct Round {
    expected: Vec<WorkerId>,
    values: BTreeMap<WorkerId, Vec<u8>>,
    /// Callers not yet answered, by member (one each).
    waiters: BTreeMap<WorkerId, Waiter>,
}

impl Round {
    fn bytes(&self) -> usize {
        self.values.values().map(Vec::len).sum()
    }

    fn missing(&self) -> Vec<WorkerId> {
        self.expected
            .iter()
            .filter(|m| !self.values.contains_key(m))
            .copied()
            .collect()
    }
}

/// A round's key: its name and the members its contributions named. Until the leader's own
/// contribution comes, rounds of one name with different member lists are kept apart (each
/// a candidate); the leader's picks one and ends the others.
type RoundKey = (String, Vec<WorkerId>);

/// The leader's side of the gathers of a dynamic group (see the [module docs](self)).
#[derive(Debug)]
pub struct GatherLeader {
    me: WorkerId,
    config: GatherConfig,
    rounds: BTreeMap<RoundKey, Round>,
    /// Every waiter with a deadline: (deadline, token) → its round.
    deadlines: BTreeMap<(Instant, GatherToken), RoundKey>,
    /// Every waiter: token → (its round, member).
    waiting: HashMap<GatherToken, (RoundKey, WorkerId)>,
    held: usize,
    /// What each member other than the leader has in rounds under way (absent: nothing).
    shares: HashMap<WorkerId, Share>,
    next_token: GatherToken,
    answers: VecDeque<(GatherToken, GatherOutcome)>,
}

/// A member's values held by the leader: in how many rounds, how many bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Share {
    rounds: usize,
    bytes: usize,
}

impl GatherLeader {
    /// The gathers worker `me` leads, bounded by `config`.
    pub fn new(me: WorkerId, config: GatherConfig) -> Self {
        Self {
            me,
            config,
            rounds: BTreeMap::new(),
            deadlines: BTreeMap::new(),
            waiting: HashMap::new(),
            held: 0,
            shares: HashMap::new(),
            next_token: 0,
            answers: VecDeque::new(),
        }
    }

    /// Rounds under way.
    pub fn rounds(&self) -> usize {
        self.rounds.len()
    }

    /// Bytes of values held.
    pub fn held_bytes(&self) -> usize {
        self.held
    }

    /// Callers waiting for an answer.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// What it holds now, for the agent's debug view.
    pub fn debug_info(&self) -> GatherDebugInfo {
        GatherDebugInfo {
            rounds: self.rounds(),
            held_bytes: self.held_bytes(),
            waiting: self.waiting(),
        }
    }

    /// Whether the leader holds nothing and has nothing to say.
    pub fn is_idle(&self) -> bool {
        self.rounds.is_empty() && self.waiting.is_empty() && self.answers.is_empty()
    }

    /// `from`'s contribution arrived at `now`. The answer comes out of
    /// [`poll_answer`](Self::poll_answer) under the token returned (at once when it is
    /// refused, else when the round ends).
    pub fn handle_contribution(
        &mut self,
        now: Instant,
        from: WorkerId,
        c: Contribution,
    ) -> GatherToken {
        let token = self.next_token;
        self.next_token += 1;
        if let Err(e) = self.admit(now, from, token, c) {
            self.answers.push_back((token, GatherOutcome::Failed(e)));
        }
        token
    }

    /// Checks `c` against the limits and the round under way, then files it.
    fn admit(
        &mut self,
        now: Instant,
        from: WorkerId,
        token: GatherToken,
        c: Contribution,
    ) -> Result<(), GatherError> {
        let cfg = self.config;
        if c.name.len() > cfg.max_name_len {
            return Err(GatherError::NameTooLong {
                len: c.name.len(),
                limit: cfg.max_name_len,
            });
        }
        let name = c.name;
        if c.expected.len() > cfg.max_members {
            return Err(GatherError::TooManyMembers {
                name,
                count: c.expected.len(),
                limit: cfg.max_members,
            });
        }
        let Some(&leader) = c.expected.first() else {
            return Err(GatherError::NoMembers { name });
        };
        if c.expected.windows(2).any(|w| w[0] >= w[1]) {
            return Err(GatherError::UnsortedMembers {
                name,
                members: c.expected,
            });
        }
        if c.expected.binary_search(&from).is_err() {
            return Err(GatherError::NotAMember { from, name });
        }
        if leader != self.me {
            return Err(GatherError::NotLeader {
                name,
                leader,
                me: self.me,
            });
        }
        let from_leader = from == self.me;
        // The other rounds of this name: candidates with other member lists, or the round
        // the leader has joined, whose members are the gather's.
        let others: Vec<RoundKey> = self
            .rounds
            .range((name.clone(), Vec::new())..)
            .take_while(|(k, _)| k.0 == name)
            .filter(|(k, _)| k.1 != c.expected)
            .map(|(k, _)| k.clone())
            .collect();
        if let Some(joined) = others
            .iter()
            .find(|k| self.rounds[*k].values.contains_key(&self.me))
        {
            return Err(GatherError::Disagreement {
                ours: joined.1.clone(),
                theirs: c.expected,
                name,
            });
        }
        let key = (name, c.expected);
        match self.rounds.get(&key) {
            Some(round) if round.values.contains_key(&from) => {
                return Err(GatherError::Duplicate { from, name: key.0 })
            }
            Some(_) => {}
            None if self.rounds.len() >= cfg.max_rounds => {
                return Err(GatherError::TooManyRounds {
                    name: key.0,
                    limit: cfg.max_rounds,
                })
            }
            None => {}
        }
        let share = self.shares.get(&from).copied().unwrap_or_default();
        if !from_leader && share.rounds >= cfg.max_rounds_per_member {
            return Err(GatherError::MemberTooManyRounds {
                name: key.0,
                from,
                limit: cfg.max_rounds_per_member,
            });
        }
        if !from_leader && share.bytes.saturating_add(c.value.len()) > cfg.max_bytes_per_member {
            return Err(GatherError::MemberTooManyBytes {
                name: key.0,
                from,
                len: c.value.len(),
                held: share.bytes,
                limit: cfg.max_bytes_per_member,
            });
        }
        if self.held.saturating_add(c.value.len()) > cfg.max_bytes {
            return Err(GatherError::TooManyBytes {
                name: key.0,
                len: c.value.len(),
                held: self.held,
                limit: cfg.max_bytes,
            });
        }
        let deadline = now.checked_add(c.wait);
        self.held += c.value.len();
        if !from_leader {
            let share = self.shares.entry(from).or_default();
            share.rounds += 1;
            share.bytes += c.value.len();
        }
        let round = self.rounds.entry(key.clone()).or_insert_with(|| Round {
            expected: key.1.clone(),
            values: BTreeMap::new(),
            waiters: BTreeMap::new(),
        });
        round.values.insert(from, c.value);
        round.waiters.insert(from, Waiter { token, deadline });
        let complete = round.values.len() == round.expected.len();
        if let Some(at) = deadline {
            self.deadlines.insert((at, token), key.clone());
        }
        self.waiting.insert(token, (key.clone(), from));
        if from_leader {
            // The leader's view of who takes part wins: the candidates that named other
            // members are told so, and end.
            for other in others {
                let refused = GatherOutcome::Failed(GatherError::Disagreement {
                    name: key.0.clone(),
                    ours: key.1.clone(),
                    theirs: other.1.clone(),
                });
                self.end_round(&other, &refused);
            }
        }
        if complete {
            let values: Vec<_> = self.rounds[&key]
                .values
                .iter()
                .map(|(r, v)| (*r, v.clone()))
                .collect();
            self.end_round(&key, &GatherOutcome::Done(values));
        }
        Ok(())
    }

    /// Ends round `key`, answering each of its callers with `outcome`.
    fn end_round(&mut self, key: &RoundKey, outcome: &GatherOutcome) {
        let Some(round) = self.rounds.remove(key) else {
            return;
        };
        self.held -= round.bytes();
        for (member, value) in &round.values {
            if let Some(share) = self.shares.get_mut(member) {
                share.rounds -= 1;
                share.bytes -= value.len();
                if share.rounds == 0 {
                    self.shares.remove(member);
                }
            }
        }
        for w in round.waiters.values() {
            self.forget_waiter(w);
            self.answers.push_back((w.token, outcome.clone()));
        }
    }

    fn forget_waiter(&mut self, w: &Waiter) {
        self.waiting.remove(&w.token);
        if let Some(at) = w.deadline {
            self.deadlines.remove(&(at, w.token));
        }
    }

    /// Time passed: every round one of whose callers' waits ended by `now` ends with
    /// [`GatherOutcome::Missing`] for all its callers.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some((&(at, _), key)) = self.deadlines.first_key_value() {
            if at > now {
                break;
            }
            let key = key.clone();
            let missing = self.rounds.get(&key).map(Round::missing);
            match missing {
                Some(missing) => self.end_round(&key, &GatherOutcome::Missing(missing)),
                // Unreachable while the maps agree; never loop on it.
                None => {
                    self.deadlines.pop_first();
                }
            }
        }
    }

    /// Worker `peer` is lost: its waiting calls are forgotten (no answer can reach it), and
    /// every round that expects a value it has not sent ends with
    /// [`GatherError::MemberLost`]. A round left with no caller is forgotten.
    pub fn handle_peer_lost(&mut self, peer: WorkerId) {
        let keys: Vec<RoundKey> = self
            .rounds
            .iter()
            .filter(|(_, r)| r.expected.binary_search(&peer).is_ok())
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let gone = self
                .rounds
                .get_mut(&key)
                .and_then(|r| r.waiters.remove(&peer));
            if let Some(w) = gone {
                self.forget_waiter(&w);
            }
            let Some(round) = self.rounds.get(&key) else {
                continue;
            };
            if !round.values.contains_key(&peer) {
                let outcome = GatherOutcome::Failed(GatherError::MemberLost {
                    name: key.0.clone(),
                    member: peer,
                });
                self.end_round(&key, &outcome);
            } else if round.waiters.is_empty() {
                self.end_round(&key, &GatherOutcome::Missing(Vec::new()));
            }
        }
    }

    /// The call behind `token` can no longer be answered (its handler ended): it is
    /// forgotten, and its round with it once no caller is left. Its value stays in a round
    /// that others still wait for.
    pub fn handle_abandoned(&mut self, token: GatherToken) {
        self.answers.retain(|(t, _)| *t != token);
        let Some((key, member)) = self.waiting.get(&token).cloned() else {
            return;
        };
        let gone = self
            .rounds
            .get_mut(&key)
            .and_then(|r| r.waiters.remove(&member));
        if let Some(w) = gone {
            self.forget_waiter(&w);
        }
        if self.rounds.get(&key).is_some_and(|r| r.waiters.is_empty()) {
            self.end_round(&key, &GatherOutcome::Missing(Vec::new()));
        }
    }

    /// The next answer to send: the token [`handle_contribution`](Self::handle_contribution)
    /// gave, and the outcome.
    pub fn poll_answer(&mut self) -> Option<(GatherToken, GatherOutcome)> {
        self.answers.pop_front()
    }

    /// The refusal the contribution under `token` got at once, while its answer waits.
    pub(crate) fn refusal(&self, token: GatherToken) -> Option<&GatherError> {
        self.answers.iter().find_map(|(t, outcome)| match outcome {
            GatherOutcome::Failed(e) if *t == token => Some(e),
            _ => None,
        })
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines.first_key_value().map(|(&(at, _), _)| at)
    }
}

#[cfg(test)]
mod tests;
