//! A worker's way into a dynamic group, try after try: the decisions behind `init_rpc` with no
//! world size, sans-IO. The driver does the I/O of each try and hands its results in:
//!
//! 1. it writes this worker's record ([`Joining::record`]) under the coordinator key with
//!    compare-and-set, and gives the store's answer to [`Joining::handle_store`], which says
//!    whether this worker founds the group ([`JoinStart::Found`]: the key was free) or asks the
//!    coordinator the key names ([`JoinStart::Ask`], with how long the introduction may take);
//! 2. once the coordinator welcomed it, it runs the membership [`Joining::through`] gives;
//! 3. a try that ended without a membership goes to [`Joining::handle_try_ended`] with how it
//!    ended ([`TryEnd`]), with the delay the driver's backoff drew and the time: the answer is
//!    when to try again, or the [`JoinFailure`] to fail with.
//!
//! Worth another try: a coordinator that cannot be reached (its record may be a dead one's,
//! replaced by the next coordinator), and a join the membership says may be asked again
//! ([`MembershipError::is_retryable`]) — as long as the next try starts before the deadline.
//! Never: a record in the store that does not parse, a joiner whose rank or name is a
//! member's already (the coordinator's), a refusal, a coordinator whose credentials do not
//! name it, any other outcome of the membership.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::{DynamicMembership, MemberRecord, MembershipError, WorkerInfo};
use crate::codec::Undecodable;
use crate::ports::transport::IdentityError;
use crate::validate::DeviceMapError;

/// The longest an introduction to the coordinator may take, so that a record left by a
/// coordinator that died is read again soon (the next coordinator replaces it) rather than a
/// dead address dialled until the deadline.
pub const INTRODUCTION_LIMIT: Duration = Duration::from_secs(2);

impl From<&MemberRecord> for WorkerInfo {
    fn from(record: &MemberRecord) -> Self {
        WorkerInfo {
            name: record.name().to_owned(),
            id: record.rank,
        }
    }
}

/// Where a try stands once the store answered ([`Joining::handle_store`]).
#[derive(Debug)]
pub enum JoinStart {
    /// The key was free and holds this worker's record now: it founds the group and
    /// coordinates it.
    Found(Box<DynamicMembership>),
    /// The key names a coordinator: introduce this worker to it, within `limit`.
    Ask {
        /// The coordinator's record.
        coordinator: MemberRecord,
        /// How long the introduction may take.
        limit: Duration,
    },
}

/// How a try that asked a coordinator ended without a membership ([`Joining::handle_try_ended`]).
/// `E` is the driver's error for a coordinator it could not reach (its transport's and links'
/// errors, which core does not name): kept as it is, never flattened to text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TryEnd<E> {
    /// It could not be reached, or did not answer the introduction.
    Unreachable(E),
    /// It refused this worker, saying why (text from another process).
    Refused(String),
    /// Its credentials are not issued for the name it is known by.
    NotCertified(IdentityError),
    /// The join it coordinated ended with this error.
    Ended(MembershipError),
}

/// Says how the try ended: the driver's error, the refusal's reason (as the coordinator sent
/// it), the credentials' error or the membership's.
impl<E: std::fmt::Display> std::fmt::Display for TryEnd<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TryEnd::Unreachable(e) => e.fmt(f),
            TryEnd::Refused(reason) => f.write_str(reason),
            TryEnd::NotCertified(e) => e.fmt(f),
            TryEnd::Ended(e) => e.fmt(f),
        }
    }
}

/// The try the deadline cut short, as a timeout names it ("w0 (rank 0) at addr: why").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{coordinator} at {addr}: {error}")]
pub struct LastTry<E> {
    /// The coordinator it asked.
    pub coordinator: WorkerInfo,
    /// Where it asked it (the address of its record).
    pub addr: SocketAddr,
    /// Why that try failed.
    #[source]
    pub error: TryError<E>,
}

/// Why a try that is worth another failed ([`LastTry::error`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TryError<E> {
    /// The coordinator could not be reached, or did not answer the introduction.
    #[error(transparent)]
    Unreachable(E),
    /// The join it coordinated ended with an error that another try may not meet
    /// ([`MembershipError::is_retryable`]).
    #[error(transparent)]
    Ended(MembershipError),
}

/// Why a join fails (no further try helps). Exhaustive: a new failure breaks the driver's
/// build instead of being said some other way. `E` is [`TryEnd`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinFailure<E> {
    /// The coordinator's record in the store does not parse.
    #[error("the coordinator's record in the store: {0}")]
    CoordinatorRecord(#[source] Undecodable),
    /// The coordinator has this worker's rank or name.
    #[error("{joiner} cannot join: {member} is already a member")]
    AlreadyAMember {
        /// This worker.
        joiner: WorkerInfo,
        /// The member with its rank or name.
        member: WorkerInfo,
    },
    /// The coordinator refused this worker.
    #[error("{coordinator} refused this worker: {reason}")]
    Refused {
        /// The coordinator.
        coordinator: WorkerInfo,
        /// Its reason, as it sent it.
        reason: String,
    },
    /// The coordinator's credentials do not name it.
    #[error("the coordinator {coordinator}: {source}")]
    NotCertified {
        /// The coordinator.
        coordinator: WorkerInfo,
        /// What its credentials say.
        #[source]
        source: IdentityError,
    },
    /// The device plans of the members and this worker break a rule.
    #[error(transparent)]
    DeviceMaps(Box<DeviceMapError>),
    /// The join the coordinator ran did not complete in time.
    #[error("joining the group: {error}")]
    TimedOut {
        /// The coordinator.
        coordinator: WorkerInfo,
        /// The membership's error ([`MembershipError::Timeout`]).
        error: MembershipError,
    },
    /// The join ended with an error of the membership's that no retry helps.
    #[error("joining the group: {0}")]
    Membership(MembershipError),
    /// The deadline passed before a try succeeded.
    #[error("joining the group timed out; the last try asked {0}")]
    Deadline(LastTry<E>),
}

/// One worker's join of a dynamic group, over its tries (see the [module docs](self)).
#[derive(Debug)]
pub struct Joining {
    me: MemberRecord,
    encoded: Vec<u8>,
    op_timeout: Duration,
    deadline: Instant,
}

impl Joining {
    /// Worker `me` joining by `deadline`; a join it coordinates (as the founder) is refused
    /// when not complete within `op_timeout`.
    pub fn new(me: MemberRecord, op_timeout: Duration, deadline: Instant) -> Self {
        let encoded = me.encode();
        Self {
            me,
            encoded,
            op_timeout,
            deadline,
        }
    }

    /// This worker's record, encoded: what a try writes under the coordinator key.
    pub fn record(&self) -> &[u8] {
        &self.encoded
    }

    /// The store answered a try's compare-and-set with `held` (what the key holds now), at
    /// `now`.
    ///
    /// # Errors
    /// [`JoinFailure::CoordinatorRecord`], [`JoinFailure::AlreadyAMember`].
    pub fn handle_store<E>(&self, held: &[u8], now: Instant) -> Result<JoinStart, JoinFailure<E>> {
        if held == self.encoded.as_slice() {
            let founder = DynamicMembership::found(self.me.clone(), self.op_timeout);
            return Ok(JoinStart::Found(Box::new(founder)));
        }
        let coordinator = MemberRecord::decode(held).map_err(JoinFailure::CoordinatorRecord)?;
        if coordinator.rank == self.me.rank || coordinator.name() == self.me.name() {
            return Err(JoinFailure::AlreadyAMember {
                joiner: (&self.me).into(),
                member: (&coordinator).into(),
            });
        }
        let limit = self
            .deadline
            .saturating_duration_since(now)
            .min(INTRODUCTION_LIMIT);
        Ok(JoinStart::Ask { coordinator, limit })
    }

    /// The membership of this worker joining through `coordinator`, which welcomed it (its
    /// connection is up; the request goes out once it is attached).
    pub fn through(&self, coordinator: &MemberRecord) -> DynamicMembership {
        let mut m = DynamicMembership::join(
            self.me.clone(),
            coordinator.rank,
            self.op_timeout,
            Some(self.deadline),
        );
        // The connection this joiner dialled: always taken.
        let _ = m.handle_connected(coordinator.rank, None);
        m
    }

    /// The try that asked `coordinator` ended so, at `now`; the driver's backoff would wait
    /// `delay` before the next. Returns when to try again.
    ///
    /// # Errors
    /// The [`JoinFailure`] to fail with: what no retry helps, or
    /// [`JoinFailure::Deadline`] when the next try would start past the deadline.
    pub fn handle_try_ended<E>(
        &self,
        coordinator: &MemberRecord,
        end: TryEnd<E>,
        now: Instant,
        delay: Duration,
    ) -> Result<Instant, JoinFailure<E>> {
        let who: WorkerInfo = coordinator.into();
        let why = match end {
            TryEnd::Unreachable(why) => TryError::Unreachable(why),
            TryEnd::Ended(e) if e.is_retryable() => TryError::Ended(e),
            TryEnd::Refused(reason) => {
                return Err(JoinFailure::Refused {
                    coordinator: who,
                    reason,
                })
            }
            TryEnd::NotCertified(source) => {
                return Err(JoinFailure::NotCertified {
                    coordinator: who,
                    source,
                })
            }
            TryEnd::Ended(MembershipError::DeviceMaps(e)) => {
                return Err(JoinFailure::DeviceMaps(e))
            }
            TryEnd::Ended(error @ MembershipError::Timeout { .. }) => {
                return Err(JoinFailure::TimedOut {
                    coordinator: who,
                    error,
                })
            }
            TryEnd::Ended(other) => return Err(JoinFailure::Membership(other)),
        };
        let at = now + delay;
        if at < self.deadline {
            return Ok(at);
        }
        Err(JoinFailure::Deadline(LastTry {
            coordinator: who,
            addr: coordinator.addr,
            error: why,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::protocol::membership::DynMessage;
    use crate::protocol::WorkerId;
    use crate::sim::Clock;
    use crate::validate::WorkerDeviceInfo;

    fn record(rank: WorkerId, name: &str) -> MemberRecord {
        MemberRecord {
            rank,
            addr: SocketAddr::from(([127, 0, 0, 1], 1000 + rank as u16)),
            devices: WorkerDeviceInfo {
                name: name.to_owned(),
                ..WorkerDeviceInfo::default()
            },
        }
    }

    const OP: Duration = Duration::from_secs(30);

    fn joining(clock: &Clock, within: Duration) -> Joining {
        Joining::new(record(3, "w3"), OP, clock.now() + within)
    }

    #[test]
    fn a_free_key_founds_the_group_and_a_held_one_asks_its_coordinator() {
        let clock = Clock::new();
        let j = joining(&clock, Duration::from_secs(60));
        match j.handle_store::<Refused>(j.record(), clock.now()) {
            Ok(JoinStart::Found(m)) => {
                assert!(m.is_coordinator());
                assert_eq!(m.me(), &record(3, "w3"));
            }
            other => panic!("the founder coordinates: {other:?}"),
        }
        let c = record(0, "w0");
        match j.handle_store::<Refused>(&c.encode(), clock.now()) {
            Ok(JoinStart::Ask { coordinator, limit }) => {
                assert_eq!(coordinator, c);
                assert_eq!(limit, INTRODUCTION_LIMIT);
            }
            other => panic!("a published coordinator is asked: {other:?}"),
        }
        // Near the deadline, the introduction gets what is left.
        let late = joining(&clock, Duration::from_millis(300));
        match late.handle_store::<Refused>(&c.encode(), clock.now()) {
            Ok(JoinStart::Ask { limit, .. }) => assert_eq!(limit, Duration::from_millis(300)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_record_that_does_not_parse_or_names_this_worker_fails_the_join() {
        let clock = Clock::new();
        let j = joining(&clock, Duration::from_secs(60));
        assert!(matches!(
            j.handle_store::<Refused>(b"\xff\xff\xff", clock.now()),
            Err(JoinFailure::CoordinatorRecord(_))
        ));
        for member in [record(3, "other"), record(0, "w3")] {
            let e = j
                .handle_store::<Refused>(&member.encode(), clock.now())
                .unwrap_err();
            assert_eq!(
                e,
                JoinFailure::AlreadyAMember {
                    joiner: (&record(3, "w3")).into(),
                    member: (&member).into(),
                }
            );
            assert!(e.to_string().contains("is already a member"), "{e}");
        }
    }

    #[test]
    fn the_joiners_membership_asks_the_coordinator_that_welcomed_it() {
        let clock = Clock::new();
        let j = joining(&clock, Duration::from_secs(60));
        let mut m = j.through(&record(0, "w0"));
        assert_eq!(
            m.join_deadline(),
            Some(clock.now() + Duration::from_secs(60))
        );
        assert_eq!(
            m.poll_transmit(),
            Some((
                0,
                DynMessage::JoinRequest {
                    record: record(3, "w3")
                }
            ))
        );
    }

    /// A driver's error for an unreachable coordinator, as a test stands it in.
    #[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
    #[error("connection refused")]
    struct Refused;

    #[test]
    fn an_unreachable_coordinator_is_tried_again_until_the_deadline() {
        let mut clock = Clock::new();
        let j = joining(&clock, Duration::from_secs(1));
        let c = record(0, "w0");
        let delay = Duration::from_millis(40);
        let again = j.handle_try_ended(&c, TryEnd::Unreachable(Refused), clock.now(), delay);
        assert_eq!(again, Ok(clock.now() + delay));
        // A retryable outcome of the membership (the coordinator was leaving) too.
        let leaving = MembershipError::Refused {
            reason: "leaving".into(),
            retry: true,
        };
        assert!(j
            .handle_try_ended(&c, TryEnd::<Refused>::Ended(leaving), clock.now(), delay)
            .is_ok());
        // A next try that would start at the deadline is a timeout naming the last one.
        clock.advance(Duration::from_millis(960));
        let e = j
            .handle_try_ended(&c, TryEnd::Unreachable(Refused), clock.now(), delay)
            .unwrap_err();
        assert_eq!(
            e,
            JoinFailure::Deadline(LastTry {
                coordinator: (&c).into(),
                addr: c.addr,
                error: TryError::Unreachable(Refused),
            })
        );
        assert_eq!(
            e.to_string(),
            "joining the group timed out; the last try asked w0 (rank 0) at 127.0.0.1:1000: \
             connection refused"
        );
    }

    #[test]
    fn what_no_retry_helps_fails_at_once() {
        let clock = Clock::new();
        let j = joining(&clock, Duration::from_secs(60));
        let c = record(0, "w0");
        let who: WorkerInfo = (&c).into();
        let ended = |end: TryEnd<Refused>| {
            j.handle_try_ended(&c, end, clock.now(), Duration::from_millis(1))
        };
        assert_eq!(
            ended(TryEnd::Refused("no".into())),
            Err(JoinFailure::Refused {
                coordinator: who.clone(),
                reason: "no".into()
            })
        );
        let source = IdentityError {
            peer: c.addr,
            name: "w0".into(),
            reason: "issued for w9".into(),
        };
        assert_eq!(
            ended(TryEnd::NotCertified(source.clone())),
            Err(JoinFailure::NotCertified {
                coordinator: who.clone(),
                source
            })
        );
        let timeout = MembershipError::Timeout {
            what: "joining",
            missing: vec![0],
        };
        assert_eq!(
            ended(TryEnd::Ended(timeout.clone())),
            Err(JoinFailure::TimedOut {
                coordinator: who,
                error: timeout
            })
        );
        let refused = MembershipError::Refused {
            reason: "full".into(),
            retry: false,
        };
        assert_eq!(
            ended(TryEnd::Ended(refused.clone())),
            Err(JoinFailure::Membership(refused))
        );
        let lost = MembershipError::Lost {
            peer: 5,
            what: "connecting",
        };
        assert!(matches!(
            ended(TryEnd::Ended(lost)),
            Err(JoinFailure::Membership(_))
        ));
    }

    #[test]
    fn a_try_end_says_why_in_its_own_words() {
        let refused: TryEnd<String> = TryEnd::Refused("rank 3 is taken".into());
        assert_eq!(refused.to_string(), "rank 3 is taken");
        let unreachable: TryEnd<String> = TryEnd::Unreachable("connection refused".into());
        assert_eq!(unreachable.to_string(), "connection refused");
    }
}
