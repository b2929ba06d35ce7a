//! Joining a static group (and, in [`dynamic`], joining and leaving a dynamic one): who dials whom, when the group is complete, and the closing
//! handshake that makes init end on every worker only once no worker needs the store for it.
//!
//! A [`StaticJoin`] is one worker's side, sans-IO like the [`Endpoint`](super::Endpoint): the
//! driver dials the ranks in [`dials`](StaticJoin::dials) (the higher ones: one connection per
//! pair), accepts connections from the lower ones, and reports each connection with
//! [`handle_connected`](StaticJoin::handle_connected) and each handshake message with
//! [`handle_message`](StaticJoin::handle_message); it sends what
//! [`poll_transmit`](StaticJoin::poll_transmit) gives, calls
//! [`handle_timeout`](StaticJoin::handle_timeout) at [`poll_timeout`](StaticJoin::poll_timeout),
//! and ends with [`poll_outcome`](StaticJoin::poll_outcome).
//!
//! The handshake: once connected to every other worker (and so done with the store for init),
//! every worker but rank 0 tells rank 0 [`JoinMessage::Ready`]; rank 0, once connected and
//! told by everyone, tells everyone [`JoinMessage::Go`], and init is over. Rank 0 hosts the
//! store, so it may exit as soon as its own init returns without failing anyone's.
//!
//! Every failure names the ranks it waited for; a peer that breaks the plan (a rank out of
//! range, a second connection, a connection from the wrong direction, a message out of turn)
//! is refused with a [`JoinError`] and the join carries on without that connection.

use std::collections::{BTreeSet, VecDeque};
use std::time::Instant;

mod coding;
pub mod dynamic;
pub use dynamic::{
    Accepted, DynMessage, DynamicMembership, MemberRecord, MembershipError, MembershipEvent,
};
pub mod joining;
pub use joining::{JoinFailure, JoinStart, Joining, LastTry, TryEnd, TryError};
pub mod records;
pub use records::{check_certified, check_static_records, NotCertified, RecordError};
pub mod directory;
pub use directory::{Directory, UnknownWorker, WorkerInfo, WorkerRef};

use serde::{Deserialize, Serialize};

use super::WorkerId;

/// A message of the closing handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JoinMessage {
    /// To rank 0: the sender is connected to every other worker.
    Ready,
    /// From rank 0: every worker is ready; init is over.
    Go,
}

/// How far a join got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinPhase {
    /// Connecting to every other worker.
    Connecting,
    /// Rank 0: waiting for every other worker's [`JoinMessage::Ready`].
    AwaitingReady,
    /// Waiting for rank 0's [`JoinMessage::Go`].
    AwaitingGo,
    /// Init is over (or failed).
    Done,
}

/// Why a join failed, or why a peer's connection or message is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// The deadline passed.
    #[error("{} (waiting for ranks {missing:?})", describe(*.phase))]
    Timeout {
        /// What it was waiting for.
        phase: JoinPhase,
        /// Who, in rank order.
        missing: Vec<WorkerId>,
    },
    /// A peer's connection was lost before init ended.
    #[error("the connection to rank {peer} was lost before init ended")]
    Lost {
        /// The peer.
        peer: WorkerId,
    },
    /// A peer broke the plan; its connection or message is refused.
    #[error("rank {peer}: {what}")]
    Refused {
        /// The peer.
        peer: WorkerId,
        /// What it did wrong.
        what: &'static str,
    },
}

/// What a phase waits for, in words.
pub fn describe(phase: JoinPhase) -> &'static str {
    match phase {
        JoinPhase::Connecting => "connecting to every worker",
        JoinPhase::AwaitingReady => "waiting for every worker to connect to all others",
        JoinPhase::AwaitingGo => "waiting for rank 0 to see every worker connected",
        JoinPhase::Done => "init is over",
    }
}

/// One worker's join of a static group (see the [module docs](self)).
#[derive(Debug)]
pub struct StaticJoin {
    me: WorkerId,
    world_size: u32,
    deadline: Option<Instant>,
    phase: JoinPhase,
    connected: BTreeSet<WorkerId>,
    /// Rank 0: who said Ready.
    ready: BTreeSet<WorkerId>,
    transmits: VecDeque<(WorkerId, JoinMessage)>,
    outcome: Option<Result<(), JoinError>>,
    reported: bool,
}

impl StaticJoin {
    /// Worker `me` of `world_size` (`me < world_size`), finishing by `deadline`.
    pub fn new(me: WorkerId, world_size: u32, deadline: Option<Instant>) -> Self {
        let mut join = Self {
            me,
            world_size: world_size.max(me + 1),
            deadline,
            phase: JoinPhase::Connecting,
            connected: BTreeSet::new(),
            ready: BTreeSet::new(),
            transmits: VecDeque::new(),
            outcome: None,
            reported: false,
        };
        join.advance();
        join
    }

    /// The ranks this worker connects to: the higher ones (the lower ones connect to it).
    pub fn dials(&self) -> Vec<WorkerId> {
        (self.me + 1..self.world_size).collect()
    }

    /// How many connections this worker accepts: one from each lower rank.
    pub fn accepts(&self) -> usize {
        self.me as usize
    }

    /// Whether a handshake message comes from `peer` (so the driver reads one frame from its
    /// connection before init ends): to rank 0 from everyone, to the others from rank 0 only.
    pub fn hears_from(&self, peer: WorkerId) -> bool {
        if self.me == 0 {
            peer != 0
        } else {
            peer == 0
        }
    }

    /// The phase it is in.
    pub fn phase(&self) -> JoinPhase {
        self.phase
    }

    /// The ranks not connected yet, in rank order.
    pub fn missing(&self) -> Vec<WorkerId> {
        (0..self.world_size)
            .filter(|r| *r != self.me && !self.connected.contains(r))
            .collect()
    }

    /// A connection to `peer` is up (dialled by us, or accepted with its hello). A rank out
    /// of range, a second connection, or one from the wrong direction (`dialled`: whether we
    /// dialled it) is refused: the driver drops that connection.
    pub fn handle_connected(&mut self, peer: WorkerId, dialled: bool) -> Result<(), JoinError> {
        let refuse = |what| Err(JoinError::Refused { peer, what });
        if peer >= self.world_size || peer == self.me {
            return refuse("not another rank of this group");
        }
        if dialled != (peer > self.me) {
            return refuse("connected from the wrong direction (lower ranks dial higher ones)");
        }
        if self.phase == JoinPhase::Done || !self.connected.insert(peer) {
            return refuse("a second connection");
        }
        self.advance();
        Ok(())
    }

    /// A handshake message from `from`. Out of turn (Ready to a rank but 0, Go from a rank
    /// but 0, twice) it is refused and changes nothing.
    pub fn handle_message(&mut self, from: WorkerId, msg: JoinMessage) -> Result<(), JoinError> {
        let refuse = |what| Err(JoinError::Refused { peer: from, what });
        if !self.connected.contains(&from) {
            return refuse("a handshake message from a rank not connected");
        }
        match msg {
            JoinMessage::Ready if self.me == 0 => {
                if !self.ready.insert(from) {
                    return refuse("said Ready twice");
                }
            }
            JoinMessage::Ready => return refuse("said Ready to a rank other than 0"),
            JoinMessage::Go if from == 0 && self.phase == JoinPhase::AwaitingGo => {
                self.finish(Ok(()));
            }
            JoinMessage::Go => return refuse("said Go out of turn"),
        }
        self.advance();
        Ok(())
    }

    /// The connection to `peer` broke before init ended: the join fails naming it.
    pub fn handle_lost(&mut self, peer: WorkerId) {
        if self.phase != JoinPhase::Done && peer < self.world_size && peer != self.me {
            self.finish(Err(JoinError::Lost { peer }));
        }
    }

    /// The passing of time: at the deadline an unfinished join fails naming who is missing.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.phase == JoinPhase::Done || self.deadline.is_none_or(|d| d > now) {
            return;
        }
        let missing = match self.phase {
            JoinPhase::Connecting => self.missing(),
            JoinPhase::AwaitingReady => (1..self.world_size)
                .filter(|r| !self.ready.contains(r))
                .collect(),
            JoinPhase::AwaitingGo => vec![0],
            JoinPhase::Done => return,
        };
        let phase = self.phase;
        self.finish(Err(JoinError::Timeout { phase, missing }));
    }

    /// The next handshake message to send, and to whom.
    pub fn poll_transmit(&mut self) -> Option<(WorkerId, JoinMessage)> {
        self.transmits.pop_front()
    }

    /// When to call [`handle_timeout`](Self::handle_timeout).
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.phase != JoinPhase::Done)
            .then_some(self.deadline)
            .flatten()
    }

    /// The outcome, once (after it, the join is over and its connections belong to the agent).
    pub fn poll_outcome(&mut self) -> Option<Result<(), JoinError>> {
        if self.reported {
            return None;
        }
        let outcome = self.outcome.clone()?;
        self.reported = true;
        Some(outcome)
    }

    fn finish(&mut self, outcome: Result<(), JoinError>) {
        self.phase = JoinPhase::Done;
        self.outcome = Some(outcome);
    }

    fn advance(&mut self) {
        loop {
            let next = match self.phase {
                JoinPhase::Connecting if self.missing().is_empty() => {
                    if self.me == 0 {
                        JoinPhase::AwaitingReady
                    } else {
                        self.transmits.push_back((0, JoinMessage::Ready));
                        JoinPhase::AwaitingGo
                    }
                }
                JoinPhase::AwaitingReady if self.ready.len() as u32 + 1 == self.world_size => {
                    for r in 1..self.world_size {
                        self.transmits.push_back((r, JoinMessage::Go));
                    }
                    self.finish(Ok(()));
                    return;
                }
                _ => return,
            };
            self.phase = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Every worker of every world size up to 9, with connections and messages delivered in
    /// an order that depends on `seed`: every join completes, and only after rank 0 heard
    /// every Ready.
    #[test]
    fn every_world_joins_in_any_order() {
        for n in 1..=9u32 {
            for seed in 0..20u64 {
                let mut joins: Vec<StaticJoin> =
                    (0..n).map(|r| StaticJoin::new(r, n, None)).collect();
                // Connections: (dialler, dialled), shuffled by the seed.
                let mut pairs: Vec<(u32, u32)> = (0..n)
                    .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
                    .collect();
                let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for i in (1..pairs.len()).rev() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    pairs.swap(i, (x % (i as u64 + 1)) as usize);
                }
                let mut wire: VecDeque<(u32, u32, JoinMessage)> = VecDeque::new();
                let collect = |joins: &mut Vec<StaticJoin>, wire: &mut VecDeque<_>| {
                    for (from, j) in joins.iter_mut().enumerate() {
                        while let Some((to, m)) = j.poll_transmit() {
                            wire.push_back((from as u32, to, m));
                        }
                    }
                };
                for (a, b) in pairs {
                    assert!(joins[a as usize].dials().contains(&b));
                    joins[a as usize].handle_connected(b, true).unwrap();
                    collect(&mut joins, &mut wire);
                    joins[b as usize].handle_connected(a, false).unwrap();
                    collect(&mut joins, &mut wire);
                }
                while let Some((from, to, m)) = wire.pop_front() {
                    joins[to as usize].handle_message(from, m).unwrap();
                    collect(&mut joins, &mut wire);
                }
                for (r, j) in joins.iter_mut().enumerate() {
                    assert_eq!(j.poll_outcome(), Some(Ok(())), "rank {r} of {n}");
                    assert_eq!(j.poll_outcome(), None);
                }
            }
        }
    }

    #[test]
    fn the_deadline_names_who_is_missing_in_each_phase() {
        let t0 = Instant::now();
        let d = Some(t0 + Duration::from_secs(5));
        let mut j = StaticJoin::new(1, 4, d);
        j.handle_connected(2, true).unwrap();
        j.handle_timeout(t0 + Duration::from_secs(4));
        assert_eq!(j.poll_outcome(), None);
        assert_eq!(j.poll_timeout(), d);
        j.handle_timeout(t0 + Duration::from_secs(5));
        let e = j.poll_outcome().unwrap().unwrap_err();
        assert_eq!(
            e,
            JoinError::Timeout {
                phase: JoinPhase::Connecting,
                missing: vec![0, 3]
            }
        );
        assert!(e.to_string().contains("[0, 3]"), "{e}");

        let mut zero = StaticJoin::new(0, 3, d);
        zero.handle_connected(1, true).unwrap();
        zero.handle_connected(2, true).unwrap();
        zero.handle_message(2, JoinMessage::Ready).unwrap();
        zero.handle_timeout(t0 + Duration::from_secs(9));
        assert_eq!(
            zero.poll_outcome(),
            Some(Err(JoinError::Timeout {
                phase: JoinPhase::AwaitingReady,
                missing: vec![1]
            }))
        );

        let mut two = StaticJoin::new(2, 3, d);
        two.handle_connected(0, false).unwrap();
        two.handle_connected(1, false).unwrap();
        assert_eq!(two.poll_transmit(), Some((0, JoinMessage::Ready)));
        two.handle_lost(0);
        assert_eq!(two.poll_outcome(), Some(Err(JoinError::Lost { peer: 0 })));
    }

    #[test]
    fn peers_that_break_the_plan_are_refused_and_change_nothing() {
        let mut j = StaticJoin::new(1, 3, None);
        assert_eq!(j.dials(), vec![2]);
        assert_eq!(j.accepts(), 1);
        for (peer, dialled) in [(1, false), (7, false), (2, false), (0, true)] {
            assert!(matches!(
                j.handle_connected(peer, dialled),
                Err(JoinError::Refused { .. })
            ));
        }
        j.handle_connected(0, false).unwrap();
        assert!(j.handle_connected(0, false).is_err(), "a second connection");
        assert!(
            j.handle_message(2, JoinMessage::Go).is_err(),
            "not connected"
        );
        assert!(j.handle_message(0, JoinMessage::Ready).is_err());
        assert!(j.handle_message(0, JoinMessage::Go).is_err(), "out of turn");
        assert_eq!(j.phase(), JoinPhase::Connecting);
        assert_eq!(j.missing(), vec![2]);
    }
}
