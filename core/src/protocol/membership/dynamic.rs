//! Joining and leaving a dynamic group (`world_size = None`), decided here, sans-IO.
//!
//! One member *coordinates*: the oldest (the first to join, then by admission order). It
//! serializes joins and leaves in the order their requests arrive, so that a joiner always
//! learns a member list that nobody changes while it connects. The store only tells a joiner
//! where the coordinator listens (the driver publishes the coordinator's [`MemberRecord`]
//! when [`MembershipEvent::Coordinate`] says so); everything else runs over the members' own
//! connections as [`DynMessage`]s.
//!
//! A join (worker J, coordinator C):
//! 1. J connects to C and asks ([`DynMessage::JoinRequest`]). C queues it.
//! 2. At the head of the queue C refuses a name or rank already in use, else tells every
//!    member to expect J ([`DynMessage::Joining`]) and waits for each to say so
//!    ([`DynMessage::Expecting`]; a member lost meanwhile is not waited for).
//! 3. C sends J the member list ([`DynMessage::Admit`]). J validates every member's device plan
//!    with its own by the dynamic rules; if they break a rule J withdraws. Else J connects to
//!    every member, each of which accepts J (only J: a connection nobody announced is refused)
//!    and counts it a member from then on.
//! 4. Connected to all, J tells C ([`DynMessage::Connected`]); C counts J a member and
//!    welcomes it ([`DynMessage::Welcome`]): J's join is complete, and C takes the next request.
//!
//! A leave (worker L, after its endpoint drained L's own calls and answered what it was asked):
//! L asks C ([`DynMessage::LeaveRequest`]); at the head of the queue C tells every member and L
//! itself [`DynMessage::Left`]. Members drop L ([`MembershipEvent::MemberRemoved`]: the driver
//! hands it to the endpoint as a lost peer, so calls still with L fail naming it, forks L held
//! no longer keep values alive, and forks of values L owned are forgotten); L's leave is
//! complete. When C itself leaves, the next oldest member coordinates; requests queued at C are
//! refused as retryable, and a member whose leave request C had not granted sends it again.
//!
//! Deadlines: a join that does not complete by C's operation timeout is refused (and the
//! members that were told to expect J forget it); a joiner or leaver whose own deadline passes
//! fails naming whom it waited for.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::protocol::WorkerId;
use crate::validate::{validate_device_maps, DeviceMapError, GroupKind, WorkerDeviceInfo};

/// What a member publishes of itself: its rank, where it listens, and its device plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// Its rank.
    pub rank: WorkerId,
    /// Where it accepts connections.
    pub addr: SocketAddr,
    /// Its name and device plan.
    pub devices: WorkerDeviceInfo,
}

impl MemberRecord {
    /// Its name.
    pub fn name(&self) -> &str {
        &self.devices.name
    }
}

/// A message of the membership protocol (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DynMessage {
    /// Joiner to coordinator: admit me.
    JoinRequest {
        /// The joiner's record.
        record: MemberRecord,
    },
    /// Coordinator to members: expect a connection from this joiner.
    Joining {
        /// Its place in the admission order.
        seq: u64,
        /// Its record.
        record: MemberRecord,
    },
    /// Member to coordinator: it expects the joiner of this rank.
    Expecting {
        /// The joiner.
        rank: WorkerId,
    },
    /// Coordinator to joiner: connect to these members.
    Admit {
        /// The joiner's place in the admission order.
        seq: u64,
        /// Every member, with its place in the admission order.
        members: Vec<(u64, MemberRecord)>,
    },
    /// Joiner to coordinator: connected to every member.
    Connected,
    /// Joiner to coordinator: it gives up.
    Withdraw {
        /// Why.
        reason: String,
    },
    /// Coordinator to joiner: the join is complete.
    Welcome,
    /// Coordinator to joiner or leaver: the request is refused.
    Refused {
        /// Why.
        reason: String,
        /// Whether asking again (the coordinator was leaving) may succeed.
        retry: bool,
    },
    /// Member to coordinator: it wants to leave.
    LeaveRequest,
    /// Coordinator to members: this worker left (or its join was abandoned).
    Left {
        /// The worker.
        rank: WorkerId,
    },
}

/// What the driver must do or learn. Exhaustive on purpose, as [`Event`](crate::protocol::Event)
/// is: a new event is a compile error in each driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipEvent {
    /// Joiner: the coordinator admitted it at place `seq` of the admission order. The driver
    /// starts the endpoint's ids there
    /// ([`Endpoint::begin_incarnation`](crate::protocol::Endpoint::begin_incarnation)) before
    /// any member can reach it.
    Admitted {
        /// Its place.
        seq: u64,
    },
    /// Joiner: connect to these members (send them this worker's record in the hello), and
    /// report each with [`DynamicMembership::handle_connected`] or
    /// [`DynamicMembership::handle_connect_failed`].
    Connect(Vec<MemberRecord>),
    /// A worker became a member (its connection is up): address calls to it by its name.
    MemberAdded(MemberRecord),
    /// A member is gone: `left` (it asked) or lost. The driver hands it to the endpoint as a
    /// lost peer and closes its connection.
    MemberRemoved {
        /// The member.
        rank: WorkerId,
        /// Whether it left (else: its connection was lost).
        left: bool,
    },
    /// Joiner: the join is complete; this worker is a member.
    Joined,
    /// Joiner: the join failed.
    JoinFailed(MembershipError),
    /// Leaver: the leave is complete (`last`: no member is left, so the group is over).
    Left {
        /// Whether this worker was the last member.
        last: bool,
    },
    /// Leaver: the leave failed.
    LeaveFailed(MembershipError),
    /// This worker coordinates now: publish its record as the coordinator's.
    Coordinate,
}

/// Why a join or leave failed, or why a message or connection is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MembershipError {
    /// The coordinator refused the request.
    #[error("{reason}")]
    Refused {
        /// Why.
        reason: String,
        /// Whether asking again may succeed (the coordinator was leaving).
        retry: bool,
    },
    /// The device plans of the members and the joiner break a rule.
    #[error(transparent)]
    DeviceMaps(Box<DeviceMapError>),
    /// The deadline passed.
    #[error("{what} (waiting for ranks {missing:?})")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// Who, in rank order.
        missing: Vec<WorkerId>,
    },
    /// A worker the join needed was lost.
    #[error("rank {peer} was lost while {what}")]
    Lost {
        /// The worker.
        peer: WorkerId,
        /// What was going on.
        what: &'static str,
    },
    /// A peer sent what it had no right to send; its message or connection is refused and
    /// nothing changes.
    #[error("rank {peer}: {what}")]
    Violation {
        /// The peer.
        peer: WorkerId,
        /// What it did wrong.
        what: &'static str,
    },
}

impl MembershipError {
    /// Whether the driver may start the join again (with the coordinator the store names).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Refused { retry, .. } => *retry,
            Self::Lost { what, .. } => *what == LOST_COORDINATOR,
            _ => false,
        }
    }
}

const LOST_COORDINATOR: &str = "it coordinated this join";

/// The wait before a joiner dials a member again after its first failed dial; it doubles with
/// each further failure up to [`REDIAL_MAX`], and the join's own deadline bounds the whole.
pub const REDIAL_FIRST: Duration = Duration::from_millis(50);
/// The longest wait between two dials of one member.
pub const REDIAL_MAX: Duration = Duration::from_secs(2);

/// How a connection from a peer was taken ([`DynamicMembership::handle_connected`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Accepted {
    /// A joiner this member was told to expect: a member from now on.
    Member,
    /// A worker asking the coordinator to join: it may send membership messages, no calls.
    Applicant,
    /// A member the joiner was admitted to connect to (the joiner's own dial).
    Dialled,
}

#[derive(Debug)]
enum Role {
    /// Asking to join, through `coordinator`.
    Joining(Join),
    /// A member.
    Member,
    /// A member whose leave request went to `to`.
    Leaving {
        to: WorkerId,
        deadline: Option<Instant>,
    },
    /// Not a member any more (left, or the join failed).
    Gone,
}

#[derive(Debug)]
struct Join {
    coordinator: WorkerId,
    deadline: Option<Instant>,
    /// Once admitted: this worker's place, and the members to connect to.
    admitted: Option<u64>,
    to_connect: BTreeMap<WorkerId, (u64, MemberRecord)>,
    connected: BTreeSet<WorkerId>,
    /// Whether [`DynMessage::Connected`] went to the coordinator.
    told_connected: bool,
    /// Members whose dial failed: when to dial them again (`None` while that dial is under
    /// way), and how many of their dials failed.
    redial: BTreeMap<WorkerId, (Option<Instant>, u32)>,
}

#[derive(Debug)]
enum Op {
    Join(MemberRecord),
    Leave(WorkerId),
}

/// The coordinator's join in progress.
#[derive(Debug)]
struct CurrentJoin {
    seq: u64,
    record: MemberRecord,
    /// Told to expect the joiner.
    announced: BTreeSet<WorkerId>,
    /// Not yet said Expecting.
    awaiting: BTreeSet<WorkerId>,
    admitted: bool,
    deadline: Option<Instant>,
}

/// One worker's side of a dynamic group's membership (see the [module docs](self)).
#[derive(Debug)]
pub struct DynamicMembership {
    me: MemberRecord,
    role: Role,
    /// Members by admission order (this worker included once it is a member).
    members: BTreeMap<u64, MemberRecord>,
    /// Joiners the coordinator announced: rank -> (place, record).
    expected: BTreeMap<WorkerId, (u64, MemberRecord)>,
    /// Coordinator: connected workers asking to join.
    applicants: BTreeSet<WorkerId>,
    queue: VecDeque<Op>,
    current: Option<CurrentJoin>,
    next_seq: u64,
    op_timeout: Duration,
    last_now: Option<Instant>,
    /// Coordinator messages from members that are not the coordinator yet in this worker's
    /// view (see [`handle_message`](Self::handle_message)).
    early: BTreeMap<WorkerId, VecDeque<DynMessage>>,
    transmits: VecDeque<(WorkerId, DynMessage)>,
    events: VecDeque<MembershipEvent>,
}

/// How many early coordinator messages are kept per member.
const EARLY_KEPT: usize = 64;

impl DynamicMembership {
    fn with_role(me: MemberRecord, role: Role, op_timeout: Duration) -> Self {
        Self {
            me,
            role,
            members: BTreeMap::new(),
            expected: BTreeMap::new(),
            applicants: BTreeSet::new(),
            queue: VecDeque::new(),
            current: None,
            next_seq: 0,
            op_timeout,
            last_now: None,
            early: BTreeMap::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// The first member of a new group: it coordinates. A join it coordinates that is not
    /// complete within `op_timeout` is refused.
    pub fn found(me: MemberRecord, op_timeout: Duration) -> Self {
        let mut m = Self::with_role(me.clone(), Role::Member, op_timeout);
        m.members.insert(0, me);
        m.next_seq = 1;
        m
    }

    /// A worker joining through `coordinator` (connected, or being connected to: the driver
    /// sends the request once it is), by `deadline`.
    pub fn join(
        me: MemberRecord,
        coordinator: WorkerId,
        op_timeout: Duration,
        deadline: Option<Instant>,
    ) -> Self {
        let mut m = Self::with_role(
            me.clone(),
            Role::Joining(Join {
                coordinator,
                deadline,
                admitted: None,
                to_connect: BTreeMap::new(),
                connected: BTreeSet::new(),
                told_connected: false,
                redial: BTreeMap::new(),
            }),
            op_timeout,
        );
        m.transmits
            .push_back((coordinator, DynMessage::JoinRequest { record: me }));
        m
    }

    // ----- getters -----

    /// This worker's record.
    pub fn me(&self) -> &MemberRecord {
        &self.me
    }

    /// This worker's rank.
    pub fn rank(&self) -> WorkerId {
        self.me.rank
    }

    /// Whether `rank` is a member (this worker counts once its join is complete).
    pub fn is_member(&self, rank: WorkerId) -> bool {
        self.members.values().any(|r| r.rank == rank)
    }

    /// Whether `rank` may send calls and replies here: a member. (A joiner is one for a
    /// member once it connected; an applicant only speaks the membership protocol.)
    pub fn may_call(&self, rank: WorkerId) -> bool {
        match &self.role {
            // Members it connected to count it a member already.
            Role::Joining(j) => j.connected.contains(&rank) && j.to_connect.contains_key(&rank),
            _ => self.is_member(rank),
        }
    }

    /// The members, in admission order.
    pub fn members(&self) -> Vec<MemberRecord> {
        self.members.values().cloned().collect()
    }

    /// The coordinator: the oldest member (`None` before this worker knows any).
    pub fn coordinator(&self) -> Option<WorkerId> {
        match &self.role {
            Role::Joining(j) => Some(j.coordinator),
            _ => self.members.values().next().map(|r| r.rank),
        }
    }

    /// Whether this worker coordinates.
    pub fn is_coordinator(&self) -> bool {
        !matches!(self.role, Role::Joining(_) | Role::Gone)
            && self.coordinator() == Some(self.me.rank)
    }

    /// This worker's place in the admission order (unique in the group's lifetime: a worker
    /// that joins again under the same rank gets a new one), once admitted.
    pub fn seq(&self) -> Option<u64> {
        match &self.role {
            Role::Joining(j) => j.admitted,
            _ => self
                .members
                .iter()
                .find(|(_, r)| r.rank == self.me.rank)
                .map(|(s, _)| *s),
        }
    }

    /// Whether this worker is a member (its join complete, its leave not).
    pub fn is_joined(&self) -> bool {
        matches!(self.role, Role::Member | Role::Leaving { .. })
    }

    // ----- output -----

    /// The next message to send, and to whom.
    pub fn poll_transmit(&mut self) -> Option<(WorkerId, DynMessage)> {
        self.transmits.pop_front()
    }

    /// The next event for the driver.
    pub fn poll_event(&mut self) -> Option<MembershipEvent> {
        self.events.pop_front()
    }

    /// The deadline of this worker's own join while it joins (what a dial may take at most).
    pub fn join_deadline(&self) -> Option<Instant> {
        match &self.role {
            Role::Joining(j) => j.deadline,
            _ => None,
        }
    }

    /// When to call [`handle_timeout`](Self::handle_timeout).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let (own, redial) = match &self.role {
            Role::Joining(j) => (
                j.deadline,
                j.redial.values().filter_map(|(at, _)| *at).min(),
            ),
            Role::Leaving { deadline, .. } => (*deadline, None),
            _ => (None, None),
        };
        let current = self.current.as_ref().and_then(|c| c.deadline);
        [own, redial, current].into_iter().flatten().min()
    }

    // ----- commands -----

    /// Begins leaving (once the endpoint drained this worker's calls): complete with
    /// [`MembershipEvent::Left`], or failed by `deadline`.
    pub fn begin_leave(&mut self, now: Instant, deadline: Option<Instant>) {
        self.last_now = Some(now);
        if !matches!(self.role, Role::Member) {
            return;
        }
        let Some(to) = self.coordinator() else {
            return;
        };
        self.role = Role::Leaving { to, deadline };
        self.send_leave_request(now);
    }

    fn send_leave_request(&mut self, now: Instant) {
        let Role::Leaving { to, .. } = self.role else {
            return;
        };
        if to == self.me.rank {
            self.queue.push_back(Op::Leave(to));
            self.advance(now);
        } else {
            self.transmits.push_back((to, DynMessage::LeaveRequest));
        }
    }

    // ----- input -----

    /// A connection with `peer` is up: accepted from it (with its `record`, from its hello),
    /// or dialled by this joiner (`record: None`). A connection nobody announced is refused:
    /// the driver drops it. On the coordinator, a worker whose rank or name is a member's is
    /// refused with [`MembershipError::Refused`], whose reason the driver tells it.
    pub fn handle_connected(
        &mut self,
        peer: WorkerId,
        record: Option<&MemberRecord>,
    ) -> Result<Accepted, MembershipError> {
        let refuse = |what| Err(MembershipError::Violation { peer, what });
        if peer == self.me.rank {
            return refuse("a connection from this worker's own rank");
        }
        if let Role::Joining(j) = &mut self.role {
            if record.is_some() {
                return refuse("a connection to a worker that is not a member yet");
            }
            if peer == j.coordinator {
                return Ok(Accepted::Dialled);
            }
            if !j.to_connect.contains_key(&peer) || !j.connected.insert(peer) {
                return refuse("a connection this joiner was not admitted to make");
            }
            self.maybe_connected();
            return Ok(Accepted::Dialled);
        }
        let Some(record) = record.filter(|r| r.rank == peer) else {
            return refuse("a connection without the worker's own record");
        };
        if let Some((seq, expected)) = self.expected.get(&peer) {
            if expected != record || self.is_member(peer) {
                return refuse("a connection that does not match the announced joiner");
            }
            let seq = *seq;
            self.expected.remove(&peer);
            self.members.insert(seq, record.clone());
            self.events
                .push_back(MembershipEvent::MemberAdded(record.clone()));
            return Ok(Accepted::Member);
        }
        if self.is_coordinator() {
            if let Some(reason) = self.in_use(record) {
                return Err(MembershipError::Refused {
                    reason,
                    retry: false,
                });
            }
            if self.applicants.insert(peer) {
                return Ok(Accepted::Applicant);
            }
        }
        refuse("a connection from a worker nobody announced")
    }

    /// The joiner could not connect to member `peer` at `now`. The coordinator: the join fails
    /// (the driver may try again). Another member: the joiner dials it again (a
    /// [`MembershipEvent::Connect`] after [`REDIAL_FIRST`], doubling up to [`REDIAL_MAX`]), for
    /// a dial can fail under load while the member is alive; if it died after the joiner was
    /// admitted, the coordinator says so ([`DynMessage::Left`]) and the join goes on without
    /// it; else the join fails at its deadline naming it.
    pub fn handle_connect_failed(&mut self, peer: WorkerId, now: Instant) {
        self.last_now = Some(now);
        let Role::Joining(j) = &mut self.role else {
            return;
        };
        if peer == j.coordinator {
            self.fail_join(MembershipError::Lost {
                peer,
                what: LOST_COORDINATOR,
            });
            return;
        }
        if !j.to_connect.contains_key(&peer) || j.connected.contains(&peer) {
            return;
        }
        let failures = j.redial.get(&peer).map_or(0, |(_, n)| *n);
        let wait = REDIAL_FIRST
            .saturating_mul(1 << failures.min(16))
            .min(REDIAL_MAX);
        j.redial.insert(peer, (Some(now + wait), failures + 1));
    }

    /// A membership message from `from`. One it had no right to send changes nothing and is
    /// a [`MembershipError::Violation`]: the driver drops that peer.
    pub fn handle_message(
        &mut self,
        from: WorkerId,
        msg: DynMessage,
        now: Instant,
    ) -> Result<(), MembershipError> {
        self.last_now = Some(now);
        if matches!(self.role, Role::Gone) {
            // Messages in flight to a worker that left or gave up: nobody waits for them.
            return Ok(());
        }
        let violation = |what| Err(MembershipError::Violation { peer: from, what });
        let from_coordinator = self.coordinator() == Some(from);
        if let DynMessage::Left { rank } = msg {
            if rank == from && !from_coordinator {
                // A worker announcing its own departure (it coordinated its own leave after
                // its coordinator was lost before granting it): authoritative about itself.
                if let Role::Joining(j) = &mut self.role {
                    if j.to_connect.remove(&from).is_some() {
                        j.connected.remove(&from);
                        self.maybe_connected();
                    }
                } else {
                    self.remove(from, true, now);
                }
                self.advance(now);
                return Ok(());
            }
        }
        let known_member = match &self.role {
            Role::Joining(j) => j.connected.contains(&from) && j.to_connect.contains_key(&from),
            _ => self.is_joined() && self.is_member(from),
        };
        if !from_coordinator
            && known_member
            && matches!(msg, DynMessage::Joining { .. } | DynMessage::Left { .. })
        {
            // A member that learned before this worker that it coordinates now (its
            // predecessor left or was lost; that news travels on another connection): its
            // word counts once this worker learns it too. Bounded per member.
            let held = self.early.entry(from).or_default();
            if held.len() >= EARLY_KEPT {
                return violation("spoke as the coordinator, which it is not");
            }
            held.push_back(msg);
            return Ok(());
        }
        match msg {
            DynMessage::JoinRequest { record } => {
                if !self.is_coordinator() || !self.applicants.contains(&from) {
                    return violation("asked to join a worker that does not coordinate");
                }
                if record.rank != from {
                    return violation("asked to join under another rank");
                }
                if matches!(self.role, Role::Leaving { .. }) {
                    self.transmits.push_back((
                        from,
                        DynMessage::Refused {
                            reason: format!(
                                "the coordinator, {} (rank {}), is leaving the group",
                                self.me.name(),
                                self.me.rank
                            ),
                            retry: true,
                        },
                    ));
                    return Ok(());
                }
                self.queue.push_back(Op::Join(record));
            }
            DynMessage::Joining { seq, record } => {
                if !from_coordinator || !self.is_joined() {
                    return violation("announced a joiner without coordinating");
                }
                let rank = record.rank;
                self.next_seq = self.next_seq.max(seq.saturating_add(1));
                self.expected.insert(rank, (seq, record));
                self.transmits
                    .push_back((from, DynMessage::Expecting { rank }));
            }
            DynMessage::Expecting { rank } => {
                if !self.is_coordinator() || !self.is_member(from) {
                    return violation("expected a joiner it was not told of");
                }
                // Late (the join was abandoned meanwhile) is not hostile: ignored.
                if let Some(c) = self.current.as_mut().filter(|c| c.record.rank == rank) {
                    c.awaiting.remove(&from);
                }
            }
            DynMessage::Admit { seq, members } => {
                let Role::Joining(j) = &mut self.role else {
                    return violation("admitted a worker that is not joining");
                };
                if from != j.coordinator || j.admitted.is_some() {
                    return violation("admitted this joiner out of turn");
                }
                j.admitted = Some(seq);
                self.next_seq = self.next_seq.max(seq.saturating_add(1));
                self.events.push_back(MembershipEvent::Admitted { seq });
                // The joiner's own check of everyone's device plans, by the dynamic rules.
                let mut infos: Vec<WorkerDeviceInfo> =
                    members.iter().map(|(_, r)| r.devices.clone()).collect();
                infos.push(self.me.devices.clone());
                if let Err(e) = validate_device_maps(&infos, GroupKind::Dynamic) {
                    let coordinator = j.coordinator;
                    self.transmits.push_back((
                        coordinator,
                        DynMessage::Withdraw {
                            reason: e.to_string(),
                        },
                    ));
                    self.fail_join(MembershipError::DeviceMaps(Box::new(e)));
                    return Ok(());
                }
                let me = self.me.rank;
                let coordinator = j.coordinator;
                j.to_connect = members
                    .into_iter()
                    .filter(|(_, r)| r.rank != me)
                    .map(|(s, r)| (r.rank, (s, r)))
                    .collect();
                // The coordinator's connection is up already.
                if j.to_connect.contains_key(&coordinator) {
                    j.connected.insert(coordinator);
                }
                let dial: Vec<MemberRecord> = j
                    .to_connect
                    .iter()
                    .filter(|(r, _)| **r != coordinator)
                    .map(|(_, (_, rec))| rec.clone())
                    .collect();
                self.events.push_back(MembershipEvent::Connect(dial));
                self.maybe_connected();
            }
            DynMessage::Connected => {
                let ready = self
                    .current
                    .as_ref()
                    .is_some_and(|c| c.admitted && c.record.rank == from);
                if !ready {
                    return violation("said it connected without being admitted");
                }
                if let Some(c) = self.current.take() {
                    self.applicants.remove(&from);
                    self.members.insert(c.seq, c.record.clone());
                    self.events
                        .push_back(MembershipEvent::MemberAdded(c.record));
                    self.transmits.push_back((from, DynMessage::Welcome));
                }
            }
            DynMessage::Withdraw { .. } => {
                let current = self.current.as_ref().is_some_and(|c| c.record.rank == from);
                if current {
                    self.abort_current();
                } else if self.applicants.contains(&from) {
                    self.queue
                        .retain(|op| !matches!(op, Op::Join(r) if r.rank == from));
                } else {
                    return violation("withdrew a join it had not asked for");
                }
            }
            DynMessage::Welcome => {
                let in_turn = matches!(&self.role, Role::Joining(j)
                    if from == j.coordinator && j.told_connected);
                if !in_turn {
                    return violation("welcomed a worker that is not joining, or out of turn");
                }
                if let Role::Joining(j) = std::mem::replace(&mut self.role, Role::Member) {
                    for (s, r) in j.to_connect.into_values() {
                        self.events
                            .push_back(MembershipEvent::MemberAdded(r.clone()));
                        self.members.insert(s, r);
                    }
                    self.members
                        .insert(j.admitted.unwrap_or_default(), self.me.clone());
                }
                self.events.push_back(MembershipEvent::Joined);
            }
            DynMessage::Refused { reason, retry } => {
                if !from_coordinator {
                    return violation("refused a request it did not coordinate");
                }
                match self.role {
                    Role::Joining(_) => self.fail_join(MembershipError::Refused { reason, retry }),
                    Role::Leaving { .. } => {
                        self.role = Role::Member;
                        self.events.push_back(MembershipEvent::LeaveFailed(
                            MembershipError::Refused { reason, retry },
                        ));
                    }
                    _ => return violation("refused a request this worker did not make"),
                }
            }
            DynMessage::LeaveRequest => {
                if !self.is_joined() {
                    return violation("asked to leave a worker that is not a member");
                }
                if !self.is_member(from) {
                    // Removed already (its leave was granted by a coordinator that went before
                    // telling it): say so again.
                    self.transmits
                        .push_back((from, DynMessage::Left { rank: from }));
                    return Ok(());
                }
                // The sender may learn that this worker coordinates (its predecessor left)
                // before this worker does: the request waits until it does.
                self.queue.push_back(Op::Leave(from));
            }
            DynMessage::Left { rank } => {
                if !from_coordinator {
                    return violation("said a member left without coordinating");
                }
                if rank == self.me.rank {
                    if matches!(self.role, Role::Leaving { .. }) {
                        self.finish_leave();
                    }
                    return Ok(());
                }
                if let Role::Joining(j) = &mut self.role {
                    // A member lost while this joiner was admitted: not to be connected to.
                    if j.to_connect.remove(&rank).is_some() {
                        j.connected.remove(&rank);
                        self.maybe_connected();
                    }
                    return Ok(());
                }
                self.remove(rank, true, now);
            }
        }
        self.advance(now);
        Ok(())
    }

    /// The connection to `peer` is gone.
    pub fn handle_lost(&mut self, peer: WorkerId, now: Instant) {
        self.last_now = Some(now);
        if let Role::Joining(j) = &mut self.role {
            if peer == j.coordinator {
                self.fail_join(MembershipError::Lost {
                    peer,
                    what: LOST_COORDINATOR,
                });
            } else if j.to_connect.remove(&peer).is_some() {
                // A member that died after it was listed: the group goes on without it.
                j.connected.remove(&peer);
                self.maybe_connected();
            }
            return;
        }
        self.applicants.remove(&peer);
        self.queue.retain(|op| match op {
            Op::Join(r) => r.rank != peer,
            Op::Leave(r) => *r != peer,
        });
        self.remove(peer, false, now);
        if self.current.as_ref().is_some_and(|c| c.record.rank == peer) {
            self.abort_current();
        } else if let Some(c) = self.current.as_mut() {
            c.awaiting.remove(&peer);
            c.announced.remove(&peer);
            if c.admitted {
                let joiner = c.record.rank;
                self.transmits
                    .push_back((joiner, DynMessage::Left { rank: peer }));
            }
        }
        self.advance(now);
    }

    /// The passing of time: a join the coordinator runs is refused at its deadline; this
    /// worker's own join or leave fails at its own.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.last_now = Some(now);
        let due = |d: Option<Instant>| d.is_some_and(|d| d <= now);
        if let Some(c) = self.current.as_ref().filter(|c| due(c.deadline)) {
            let mut missing: Vec<WorkerId> = c.awaiting.iter().copied().collect();
            if missing.is_empty() {
                missing.push(c.record.rank);
            }
            let joiner = c.record.rank;
            self.transmits.push_back((
                joiner,
                DynMessage::Refused {
                    reason: MembershipError::Timeout {
                        what: "the coordinator waited for the join to complete",
                        missing,
                    }
                    .to_string(),
                    retry: false,
                },
            ));
            self.abort_current();
        }
        if let Role::Joining(j) = &mut self.role {
            if !due(j.deadline) {
                // One that left or connected meanwhile is forgotten.
                let (to_connect, connected) = (&j.to_connect, &j.connected);
                j.redial
                    .retain(|p, _| to_connect.contains_key(p) && !connected.contains(p));
                let mut dial = Vec::new();
                for (peer, (at, _)) in &mut j.redial {
                    if at.is_some_and(|at| at <= now) {
                        // Under way until it connects or fails again.
                        *at = None;
                        if let Some((_, record)) = j.to_connect.get(peer) {
                            dial.push(record.clone());
                        }
                    }
                }
                if !dial.is_empty() {
                    self.events.push_back(MembershipEvent::Connect(dial));
                }
            }
        }
        match &self.role {
            Role::Joining(j) if due(j.deadline) => {
                let missing: Vec<WorkerId> =
                    if j.admitted.is_none() || j.connected.len() == j.to_connect.len() {
                        vec![j.coordinator]
                    } else {
                        j.to_connect
                            .keys()
                            .filter(|r| !j.connected.contains(r))
                            .copied()
                            .collect()
                    };
                self.fail_join(MembershipError::Timeout {
                    what: "joining the group",
                    missing,
                });
            }
            Role::Leaving { to, deadline } if due(*deadline) => {
                let to = *to;
                self.role = Role::Member;
                self.events
                    .push_back(MembershipEvent::LeaveFailed(MembershipError::Timeout {
                        what: "leaving the group",
                        missing: vec![to],
                    }));
            }
            _ => {}
        }
        self.advance(now);
    }

    // ----- internals -----

    fn maybe_connected(&mut self) {
        if let Role::Joining(j) = &mut self.role {
            if j.admitted.is_some() && !j.told_connected && j.connected.len() == j.to_connect.len()
            {
                j.told_connected = true;
                let coordinator = j.coordinator;
                self.transmits
                    .push_back((coordinator, DynMessage::Connected));
            }
        }
    }

    fn fail_join(&mut self, err: MembershipError) {
        if matches!(self.role, Role::Joining(_)) {
            self.role = Role::Gone;
            self.events.push_back(MembershipEvent::JoinFailed(err));
        }
    }

    fn finish_leave(&mut self) {
        self.role = Role::Gone;
        let last = self.members.values().all(|r| r.rank == self.me.rank);
        self.members.clear();
        self.expected.clear();
        self.events.push_back(MembershipEvent::Left { last });
    }

    /// Drops member `rank` (it left, or was lost); if it coordinated, the next oldest does.
    fn remove(&mut self, rank: WorkerId, left: bool, now: Instant) {
        self.expected.remove(&rank);
        self.early.remove(&rank);
        let was_coordinator = self.coordinator() == Some(rank);
        let before = self.members.len();
        self.members.retain(|_, r| r.rank != rank);
        if self.members.len() == before {
            return;
        }
        self.events
            .push_back(MembershipEvent::MemberRemoved { rank, left });
        // (A leaver that inherits coordination only grants its own leave: it never publishes
        // itself for joiners.)
        if was_coordinator && self.is_coordinator() && !matches!(self.role, Role::Leaving { .. }) {
            // Places already given (to members that left since, too) are never given again.
            let after_members = self
                .members
                .keys()
                .next_back()
                .map_or(0, |s| s.saturating_add(1));
            self.next_seq = self.next_seq.max(after_members);
            self.events.push_back(MembershipEvent::Coordinate);
        }
        if was_coordinator {
            // What the new coordinator said before this worker knew it counts now.
            if let Some(next) = self.coordinator() {
                for msg in self.early.remove(&next).unwrap_or_default() {
                    if let Err(e) = self.handle_message(next, msg, now) {
                        // Judged now as it would have been on arrival; nothing changed.
                        let _ = e;
                    }
                }
            }
            if let Role::Leaving { to, .. } = &mut self.role {
                // The old coordinator never granted it: ask the new one.
                if let Some(next) = self.members.values().next().map(|r| r.rank) {
                    *to = next;
                    self.send_leave_request(now);
                }
            }
        }
    }

    /// Abandons the coordinator's current join: the members told to expect the joiner forget it.
    fn abort_current(&mut self) {
        if let Some(c) = self.current.take() {
            let joiner = c.record.rank;
            self.applicants.remove(&joiner);
            for m in c.announced {
                self.transmits
                    .push_back((m, DynMessage::Left { rank: joiner }));
            }
        }
    }

    /// The coordinator takes the next request while none is in progress.
    fn advance(&mut self, now: Instant) {
        if let Some(c) = self.current.as_mut() {
            if !c.admitted && c.awaiting.is_empty() {
                c.admitted = true;
                let joiner = c.record.rank;
                let seq = c.seq;
                let members = self.members.iter().map(|(s, r)| (*s, r.clone())).collect();
                self.transmits
                    .push_back((joiner, DynMessage::Admit { seq, members }));
            }
            return;
        }
        if !self.is_coordinator() {
            return;
        }
        while self.current.is_none() {
            let Some(op) = self.queue.pop_front() else {
                return;
            };
            match op {
                Op::Join(record) => self.start_join(record, now),
                Op::Leave(rank) => {
                    if !self.is_member(rank) {
                        continue;
                    }
                    let others: Vec<WorkerId> = self
                        .members
                        .values()
                        .map(|r| r.rank)
                        .filter(|r| *r != self.me.rank)
                        .collect();
                    for m in others {
                        self.transmits.push_back((m, DynMessage::Left { rank }));
                    }
                    if rank == self.me.rank {
                        // Requests still queued go to the next coordinator.
                        for op in std::mem::take(&mut self.queue) {
                            if let Op::Join(r) = op {
                                self.transmits.push_back((
                                    r.rank,
                                    DynMessage::Refused {
                                        reason: "the coordinator left the group".into(),
                                        retry: true,
                                    },
                                ));
                            }
                        }
                        self.finish_leave();
                        return;
                    }
                    self.remove(rank, true, now);
                }
            }
        }
        // A join just started may already be admitted (no other member to tell).
        if self.current.as_ref().is_some_and(|c| c.awaiting.is_empty()) {
            self.advance(now);
        }
    }

    /// Why `record` cannot join: its rank or name is a member's.
    fn in_use(&self, record: &MemberRecord) -> Option<String> {
        let m = self
            .members
            .values()
            .find(|m| m.rank == record.rank || m.name() == record.name())?;
        Some(format!(
            "{} (rank {}) cannot join: {} (rank {}) is already a member",
            record.name(),
            record.rank,
            m.name(),
            m.rank
        ))
    }

    fn start_join(&mut self, record: MemberRecord, now: Instant) {
        let joiner = record.rank;
        if let Some(reason) = self.in_use(&record) {
            self.applicants.remove(&joiner);
            self.transmits.push_back((
                joiner,
                DynMessage::Refused {
                    reason,
                    retry: false,
                },
            ));
            return;
        }
        let seq = self.next_seq;
        self.next_seq = self.next_seq.saturating_add(1);
        let others: BTreeSet<WorkerId> = self
            .members
            .values()
            .map(|r| r.rank)
            .filter(|r| *r != self.me.rank)
            .collect();
        for m in &others {
            self.transmits.push_back((
                *m,
                DynMessage::Joining {
                    seq,
                    record: record.clone(),
                },
            ));
        }
        self.current = Some(CurrentJoin {
            seq,
            record,
            announced: others.clone(),
            awaiting: others,
            admitted: false,
            deadline: now.checked_add(self.op_timeout),
        });
    }
}

#[cfg(test)]
mod tests;
