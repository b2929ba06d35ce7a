//! A dynamic group's membership as the node hands it to its driver: what the membership
//! decided, turned into what the driver must do ([`MemberAction`]: dial this member, name or
//! forget this one, complete the join or leave it waits on, publish this record), the answer
//! to a worker that introduced itself on the listener ([`Introduced`]), and the membership's
//! frames for a peer whose connection is being set up, held until it is attached
//! ([`Node::handle_link_up`]).
//!
//! The driver performs; it decides nothing here: how long a dial may take, which waiter hears
//! what, whether a removed member's connection closes and what the store's coordinator key
//! holds all come out of the node.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::Node;
use crate::codec::Undecodable;
use crate::ports::transport::IdentityError;
use crate::protocol::membership::{Accepted, MemberRecord, MembershipError, MembershipEvent};
use crate::protocol::mesh::{Hello, HelloReply};
use crate::protocol::{LostCause, Payload, WorkerId};
use crate::wire::Frame;

/// How long a joiner's dial of a member may take when its join has no deadline.
pub const DIAL_WITHOUT_DEADLINE: Duration = Duration::from_secs(30);

/// The store key that holds the coordinating member's record, for joiners to find the group.
pub const COORDINATOR_KEY: &str = "rpc/dyn/coordinator";

/// What the driver must do for a dynamic group's membership ([`NodeEvent::Member`]). The node
/// has applied to the endpoint what concerns it already (a joiner's ids, a member added, one
/// that left). Exhaustive, as every event of the node is.
///
/// [`NodeEvent::Member`]: super::NodeEvent::Member
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberAction {
    /// Joiner: dial this member, introduce this worker with `introduction` (its record,
    /// encoded) and wait for its welcome at most `limit`; report the outcome with
    /// [`Node::handle_dialled`].
    Dial {
        /// The member.
        record: MemberRecord,
        /// This worker's record, encoded (the hello's introduction).
        introduction: Vec<u8>,
        /// How long the dial and the welcome may take (what is left of the join).
        limit: Duration,
    },
    /// A worker became a member (the node's [`Directory`](crate::protocol::membership::Directory)
    /// names it already): tell whoever listens for joined peers.
    Add(MemberRecord),
    /// A member is gone (the node's directory forgot it already). With `close` (it left) its
    /// connection closes once what is queued for it is sent; a lost one's connection is gone
    /// already.
    Remove {
        /// The member.
        rank: WorkerId,
        /// Whether to close its connection.
        close: bool,
    },
    /// The join this worker waits on ended.
    JoinDone(Result<(), MembershipError>),
    /// The leave this worker waits on ended: `Ok(last)` (`last`: no member is left, so the
    /// group and its store keys are over).
    LeaveDone(Result<bool, MembershipError>),
    /// This worker coordinates now: write `record` under `key` in the group's store.
    Publish {
        /// The store key ([`COORDINATOR_KEY`]).
        key: &'static str,
        /// This worker's record, encoded.
        record: Vec<u8>,
    },
}

/// The answer to a worker that introduced itself on this worker's listener
/// ([`Node::handle_introduced`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Introduced {
    /// Welcome it ([`HelloReply::Welcome`]), then attach its connection: the membership's
    /// frames for it wait until then ([`Node::handle_link_up`]).
    Welcome,
    /// Send it this answer (a refusal, told so that its init fails with the reason rather
    /// than a timeout), then close.
    Refuse(HelloReply),
    /// Close without an answer: a connection nobody expects (`Some`: the rule it broke).
    Drop(Option<MembershipError>),
    /// Close without an answer: its introduction is no record of its hello's rank
    /// ([`Node::handle_hello`]).
    Unreadable(IntroductionError),
}

/// Why a worker's introduction on the listener is not read as a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntroductionError {
    /// The introduction is no member record.
    #[error("whose introduction is {0}")]
    Undecodable(#[source] Undecodable),
    /// The record is another rank's than the hello's.
    #[error("rank {rank} introduced itself with the record of rank {record}")]
    OtherRank {
        /// The rank its hello gives.
        rank: WorkerId,
        /// The rank of the record it sent.
        record: WorkerId,
    },
    /// The hello is for another group than a dynamic RPC group's (a process group's, or one
    /// with a world size).
    #[error("whose hello is for group {group:?} (world size {world:?}), not a dynamic RPC group")]
    OtherGroup {
        /// The group the hello names.
        group: String,
        /// The world size it gives.
        world: Option<u32>,
    },
}

/// The name of the mesh group whose connections carry RPC: a static group's world process
/// group (and its store keys) has it, and every RPC connection's hello says it (a worker
/// dialling a dynamic group's member: [`joiner_hello`]).
pub const RPC_GROUP: &str = "rpc";

/// How long a connection on the listener may take to say hello before it is dropped.
pub const HELLO_WAIT: Duration = Duration::from_secs(30);

/// The hello of a worker of rank `rank` dialling a dynamic group's member: the RPC group, no
/// world size, and `introduction` (its record, encoded).
pub fn joiner_hello(rank: WorkerId, introduction: Vec<u8>) -> Hello {
    Hello {
        group: RPC_GROUP.to_owned(),
        rank,
        world: None,
        introduction,
    }
}

/// How long a joiner waits for the answer to its hello once connected, when the dial may
/// take `limit`: as long, and never under a second (an answer needs a round trip even when
/// the dial's limit is nearly spent).
pub fn welcome_wait(limit: Duration) -> Duration {
    limit.max(Duration::from_secs(1))
}

/// The record a worker of rank `rank` (its hello's) introduced itself with.
///
/// # Errors
/// [`IntroductionError`]: not a record, or another rank's.
pub fn read_introduction(
    rank: WorkerId,
    introduction: &[u8],
) -> Result<MemberRecord, IntroductionError> {
    let record = MemberRecord::decode(introduction).map_err(IntroductionError::Undecodable)?;
    if record.rank != rank {
        return Err(IntroductionError::OtherRank {
            rank,
            record: record.rank,
        });
    }
    Ok(record)
}

/// The membership's frames for peers whose connection is being set up (a joiner being
/// welcomed: the welcome goes first; the coordinator a joiner dialled), by peer. A peer cannot
/// add to its own entry (it has no reader before it is attached): only this worker's
/// membership does, a few messages per join.
#[derive(Debug, Default)]
pub(super) struct Connecting {
    held: BTreeMap<WorkerId, Vec<Frame>>,
}

impl Connecting {
    /// Holds `frame` if `to` is being connected; else gives it back.
    pub(super) fn hold(&mut self, to: WorkerId, frame: Frame) -> Option<Frame> {
        match self.held.get_mut(&to) {
            Some(frames) => {
                frames.push(frame);
                None
            }
            None => Some(frame),
        }
    }
}

/// What the driver must do for a membership event (nothing for one the node applies alone:
/// [`MembershipEvent::Admitted`]); a dial may take `limit`.
pub(super) fn action(ev: MembershipEvent, me: &MemberRecord, limit: Duration) -> Vec<MemberAction> {
    match ev {
        MembershipEvent::Admitted { .. } => Vec::new(),
        MembershipEvent::Connect(records) => {
            let introduction = me.encode();
            records
                .into_iter()
                .map(|record| MemberAction::Dial {
                    record,
                    introduction: introduction.clone(),
                    limit,
                })
                .collect()
        }
        MembershipEvent::MemberAdded(record) => vec![MemberAction::Add(record)],
        MembershipEvent::MemberRemoved { rank, left } => {
            vec![MemberAction::Remove { rank, close: left }]
        }
        MembershipEvent::Joined => vec![MemberAction::JoinDone(Ok(()))],
        MembershipEvent::JoinFailed(e) => vec![MemberAction::JoinDone(Err(e))],
        MembershipEvent::Left { last } => vec![MemberAction::LeaveDone(Ok(last))],
        MembershipEvent::LeaveFailed(e) => vec![MemberAction::LeaveDone(Err(e))],
        MembershipEvent::Coordinate => vec![MemberAction::Publish {
            key: COORDINATOR_KEY,
            record: me.encode(),
        }],
    }
}

/// What a joiner's dial may take at `now`: what is left of its join, else
/// [`DIAL_WITHOUT_DEADLINE`].
pub(super) fn dial_limit(join_deadline: Option<Instant>, now: Instant) -> Duration {
    join_deadline.map_or(DIAL_WITHOUT_DEADLINE, |d| d.saturating_duration_since(now))
}

impl<B: Payload, H> Node<B, H> {
    /// The membership's frames for `peer` wait from now until its connection is attached
    /// ([`handle_link_up`](Self::handle_link_up)) or its setup ends
    /// ([`handle_connecting_ended`](Self::handle_connecting_ended)). False if its connection
    /// was being set up already (what is held for it stays).
    pub fn begin_connecting(&mut self, peer: WorkerId) -> bool {
        let fresh = !self.connecting.held.contains_key(&peer);
        self.connecting.held.entry(peer).or_default();
        fresh
    }

    /// `peer`'s connection is attached: the frames held for it go out first, in order.
    pub fn handle_link_up(&mut self, peer: WorkerId) {
        if let Some(frames) = self.connecting.held.remove(&peer) {
            for frame in frames.into_iter().rev() {
                self.control.push_front((peer, frame));
            }
        }
    }

    /// `peer`'s connection setup ended without it being attached (or after: then nothing is
    /// held): what was held for it is dropped.
    pub fn handle_connecting_ended(&mut self, peer: WorkerId) {
        self.connecting.held.remove(&peer);
    }

    /// A worker that dialled this one introduced itself with `record` (read with
    /// [`read_introduction`], its credentials checked for the record's name) at `now`: the
    /// membership decides whether it is expected. On [`Introduced::Welcome`] the membership's
    /// frames for it wait for its connection ([`handle_link_up`](Self::handle_link_up)); on
    /// any other answer nothing is held for it (and what was held for a connection of the
    /// same rank already being set up, say the worker an impostor claims to be, stays).
    pub fn handle_introduced(&mut self, now: Instant, record: &MemberRecord) -> Introduced {
        let rank = record.rank;
        let fresh = self.begin_connecting(rank);
        let accepted = self.with_membership(now, |m| m.handle_connected(rank, Some(record)));
        let answer = match accepted {
            Some(Ok(Accepted::Member | Accepted::Applicant)) => return Introduced::Welcome,
            Some(Ok(Accepted::Dialled)) | None => Introduced::Drop(None),
            Some(Err(MembershipError::Refused { reason, retry })) => {
                Introduced::Refuse(HelloReply::Refused { reason, retry })
            }
            Some(Err(e)) => Introduced::Drop(Some(e)),
        };
        if fresh {
            self.handle_connecting_ended(rank);
        }
        answer
    }

    /// A worker that dialled this one said `hello` at `now`: its rank, and its record
    /// (encoded) as its introduction; `certify` says whether its credentials are issued for a
    /// name. A hello for another group than a dynamic RPC group's is dropped
    /// ([`IntroductionError::OtherGroup`]); its record is read ([`read_introduction`]); a
    /// worker whose credentials do not name it is refused, told why so that its init fails
    /// with the reason (with a cluster secret any member may take any name); else the
    /// membership decides ([`handle_introduced`](Self::handle_introduced)).
    pub fn handle_hello(
        &mut self,
        now: Instant,
        hello: &Hello,
        certify: impl FnOnce(&str) -> Result<(), IdentityError>,
    ) -> Introduced {
        if hello.group != RPC_GROUP || hello.world.is_some() {
            return Introduced::Unreadable(IntroductionError::OtherGroup {
                group: hello.group.clone(),
                world: hello.world,
            });
        }
        let record = match read_introduction(hello.rank, &hello.introduction) {
            Ok(record) => record,
            Err(e) => return Introduced::Unreadable(e),
        };
        if let Err(e) = certify(record.name()) {
            return Introduced::Refuse(HelloReply::Refused {
                reason: format!("this worker's credentials do not name it: {e}"),
                retry: false,
            });
        }
        self.handle_introduced(now, &record)
    }

    /// The welcome to `peer` could not be sent at `now`: the membership counts it lost, and
    /// nothing more is held for it.
    pub fn handle_welcome_failed(&mut self, peer: WorkerId, now: Instant) {
        self.handle_connecting_ended(peer);
        self.with_membership(now, |m| m.handle_lost(peer, now));
    }

    /// A joiner's dial of member `peer` (a [`MemberAction::Dial`]) ended at `now`: `reached`
    /// if it was welcomed (and its connection attached), else the membership dials it again
    /// later or fails the join.
    ///
    /// # Errors
    /// [`MembershipError::Violation`] for a connection the join did not ask for (nothing
    /// changed; the driver drops it).
    pub fn handle_dialled(
        &mut self,
        now: Instant,
        peer: WorkerId,
        reached: bool,
    ) -> Result<(), MembershipError> {
        let out = self.with_membership(now, |m| {
            if reached {
                m.handle_connected(peer, None).map(drop)
            } else {
                m.handle_connect_failed(peer, now);
                Ok(())
            }
        });
        out.unwrap_or(Ok(()))
    }

    /// This worker's own record in its dynamic group (`None` before it founds or joins one).
    pub fn own_record(&self) -> Option<&MemberRecord> {
        self.membership.as_ref().map(|m| m.me())
    }

    /// Applies a membership event to the endpoint and the directory where it concerns them (a
    /// joiner's ids, a member added, one that left or was lost), and queues what the driver
    /// must do for it.
    pub(super) fn apply_membership_event(&mut self, ev: MembershipEvent, now: Instant) {
        match &ev {
            // Ids above every earlier incarnation of this rank's, before any member can
            // reach it.
            MembershipEvent::Admitted { seq } => {
                self.ep.begin_incarnation(*seq);
            }
            MembershipEvent::MemberAdded(record) => {
                self.ep.handle_peer_joined(record.rank);
                self.directory.insert(record.clone());
            }
            MembershipEvent::MemberRemoved { rank, left } => {
                if *left {
                    self.held.drop_peer(&mut self.ep, *rank, now);
                    self.ep.handle_peer_lost(*rank, LostCause::Left, now);
                }
                self.directory.remove(*rank);
            }
            MembershipEvent::Connect(_)
            | MembershipEvent::Joined
            | MembershipEvent::JoinFailed(_)
            | MembershipEvent::Left { .. }
            | MembershipEvent::LeaveFailed(_)
            | MembershipEvent::Coordinate => {}
        }
        let Some(m) = self.membership.as_ref() else {
            return;
        };
        let limit = dial_limit(m.join_deadline(), now);
        let actions = action(ev, m.me(), limit);
        self.events.extend(actions);
    }
}
