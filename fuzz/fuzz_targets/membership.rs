//! Fuzzes the membership protocols with forged messages decoded from the input with the
//! decoders the agent uses on a connection (core's `DynMessage::decode`,
//! `Contribution::decode`, `GatherOutcome::decode`, `MemberRecord::decode`), fed to core's
//! sans-IO state machines (the static join's `JoinMessage`, which no driver sends any more, is
//! read with postcard):
//!
//! - the dynamic group (`DynamicMembership`): ranks 0 (the coordinator), 1 and 2 form a group
//!   by the honest protocol; then rank 2 turns hostile: everything it sends is replaced by
//!   [`DynMessage`]s decoded from the input (and rank 3, a stranger that connected as an
//!   applicant, forges too), mixed with deliveries of the honest ranks' own messages, timers
//!   and the hostile connections breaking;
//! - the static group's closing handshake (`StaticJoin`, rank 1 of 3): forged `JoinMessage`s
//!   from rank 2;
//! - the gather protocol (`GatherLeader` at rank 0): honest ranks 0 and 1 gather under one name
//!   while rank 2 sends forged `Contribution`s; and a member's reading of a forged leader's
//!   answer (`gather::resolve`).
//!
//! Invariants checked after every input step, not only "no panic":
//! - a refused message changes nothing at its receiver (members, coordinator, admission
//!   order) and makes it send nothing;
//! - the honest ranks 0 and 1 stay members of each other's group under coordinator 0, and
//!   never see each other removed: nothing rank 2 or 3 sends can evict an honest member;
//! - a forged `JoinMessage` from rank 2 to rank 1 is always refused (only rank 0 says Go);
//! - the gather leader answers every contribution at most once, keeps within its limits, and
//!   any complete answer to the honest ranks carries exactly their values; `resolve` accepts
//!   only one value per member, in rank order.
#![no_main]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use tensorwire_core::protocol::gather::{
    self, Contribution, GatherConfig, GatherLeader, GatherOutcome, GatherToken,
};
use tensorwire_core::protocol::membership::{
    DynMessage, DynamicMembership, MemberRecord, MembershipEvent,
};
use tensorwire_core::protocol::{JoinMessage, JoinPhase, StaticJoin, WorkerId};
use tensorwire_core::validate::WorkerDeviceInfo;

const OP: Duration = Duration::from_secs(30);
const HOSTILE: WorkerId = 2;
const STRANGER: WorkerId = 3;

fn record(rank: WorkerId) -> MemberRecord {
    MemberRecord {
        rank,
        addr: SocketAddr::from(([127, 0, 0, 1], 1000 + rank as u16)),
        devices: WorkerDeviceInfo {
            name: format!("w{rank}"),
            ..WorkerDeviceInfo::default()
        },
    }
}

struct Net {
    now: Instant,
    ms: BTreeMap<WorkerId, DynamicMembership>,
    /// Messages in flight, in order (each link FIFO).
    queue: VecDeque<(WorkerId, WorkerId, DynMessage)>,
    /// Once set, rank 2's own messages are dropped (the input speaks for it).
    hostile: bool,
}

impl Net {
    fn pump(&mut self) {
        loop {
            let mut progress = false;
            let ranks: Vec<WorkerId> = self.ms.keys().copied().collect();
            for w in ranks {
                while let Some((to, msg)) = self.ms.get_mut(&w).unwrap().poll_transmit() {
                    progress = true;
                    if !(self.hostile && w == HOSTILE) {
                        self.queue.push_back((w, to, msg));
                    }
                }
                while let Some(ev) = self.ms.get_mut(&w).unwrap().poll_event() {
                    progress = true;
                    if self.hostile && w != HOSTILE {
                        if let MembershipEvent::MemberRemoved { rank, .. } = &ev {
                            assert!(*rank > 1, "rank {w} removed honest rank {rank}");
                        }
                    }
                    if let MembershipEvent::Connect(list) = ev {
                        for r in list {
                            let me = record(w);
                            let ok = match self.ms.get_mut(&r.rank) {
                                Some(m) => m.handle_connected(w, Some(&me)).is_ok(),
                                None => false,
                            };
                            let now = self.now;
                            let m = self.ms.get_mut(&w).unwrap();
                            if ok {
                                let _ = m.handle_connected(r.rank, None);
                            } else {
                                m.handle_connect_failed(r.rank, now);
                            }
                        }
                    }
                }
            }
            if !progress {
                return;
            }
        }
    }

    /// Delivers one message in flight; `strict`: an honest message must be accepted.
    fn deliver_one(&mut self, strict: bool) -> bool {
        let Some((from, to, msg)) = self.queue.pop_front() else {
            return false;
        };
        if self.hostile && to == HOSTILE {
            return true;
        }
        if let Some(m) = self.ms.get_mut(&to) {
            let r = m.handle_message(from, msg.clone(), self.now);
            if strict {
                r.unwrap_or_else(|e| panic!("{to} refused {msg:?} from {from}: {e}"));
            }
        }
        self.pump();
        true
    }

    fn settle(&mut self) {
        self.pump();
        while self.deliver_one(true) {}
    }

    fn join(&mut self, rank: WorkerId) {
        let deadline = Some(self.now + Duration::from_secs(60));
        self.ms
            .insert(rank, DynamicMembership::join(record(rank), 0, OP, deadline));
        let r = record(rank);
        self.ms
            .get_mut(&0)
            .unwrap()
            .handle_connected(rank, Some(&r))
            .unwrap();
        self.ms
            .get_mut(&rank)
            .unwrap()
            .handle_connected(0, None)
            .unwrap();
        self.settle();
    }

    fn view(&self, w: WorkerId) -> (Vec<WorkerId>, Option<WorkerId>, Option<u64>, bool) {
        let m = &self.ms[&w];
        (
            m.members().iter().map(|r| r.rank).collect(),
            m.coordinator(),
            m.seq(),
            m.is_joined(),
        )
    }

    /// The honest ranks keep each other, under coordinator 0.
    fn check_honest(&self) {
        for w in [0, 1] {
            let (members, coordinator, _, joined) = self.view(w);
            assert!(joined, "honest rank {w} is no longer joined");
            assert_eq!(coordinator, Some(0), "rank {w}'s coordinator");
            assert!(
                members.contains(&0) && members.contains(&1),
                "rank {w}: {members:?}"
            );
            let unique: BTreeSet<_> = members.iter().collect();
            assert_eq!(unique.len(), members.len(), "rank {w}: {members:?}");
        }
    }
}

/// Splits the next `[len, len bytes]` chunk off `rest`.
fn chunk<'a>(rest: &mut &'a [u8]) -> &'a [u8] {
    let Some((&len, tail)) = rest.split_first() else {
        return &[];
    };
    let n = usize::from(len).min(tail.len());
    let (c, after) = tail.split_at(n);
    *rest = after;
    c
}

struct Gather {
    leader: GatherLeader,
    config: GatherConfig,
    /// Tokens of the honest ranks' contributions.
    honest: BTreeSet<GatherToken>,
    answered: BTreeSet<GatherToken>,
    second_sent: bool,
}

impl Gather {
    fn drain(&mut self) {
        while let Some((token, outcome)) = self.leader.poll_answer() {
            assert!(self.answered.insert(token), "token {token} answered twice");
            if self.honest.contains(&token) {
                if let GatherOutcome::Done(values) = &outcome {
                    assert_eq!(
                        values,
                        &vec![(0, b"zero".to_vec()), (1, b"one".to_vec())],
                        "the honest gather got values it was not sent"
                    );
                }
            }
        }
        assert!(self.leader.rounds() <= self.config.max_rounds);
        assert!(self.leader.held_bytes() <= self.config.max_bytes);
    }
}

fuzz_target!(|data: &[u8]| {
    let start = Instant::now();
    let mut net = Net {
        now: start,
        ms: BTreeMap::new(),
        queue: VecDeque::new(),
        hostile: false,
    };
    net.ms.insert(0, DynamicMembership::found(record(0), OP));
    net.join(1);
    net.join(2);
    for w in 0..3 {
        assert_eq!(net.view(w).0, vec![0, 1, 2], "the honest join of rank {w}");
    }
    net.hostile = true;
    // The stranger connected to the coordinator and asked to join.
    let _ = net
        .ms
        .get_mut(&0)
        .unwrap()
        .handle_connected(STRANGER, Some(&record(STRANGER)));
    net.pump();

    let mut join = StaticJoin::new(1, 3, Some(start + Duration::from_secs(60)));
    join.handle_connected(0, false).unwrap();
    join.handle_connected(2, true).unwrap();
    // Connected to every rank: it told rank 0 it is ready and waits for Go.
    assert_eq!(join.poll_transmit(), Some((0, JoinMessage::Ready)));
    assert_eq!(join.phase(), JoinPhase::AwaitingGo);

    let config = GatherConfig::default()
        .with_max_rounds(4)
        .with_max_bytes(1024)
        .with_max_name_len(32)
        .with_max_members(8);
    let mut g = Gather {
        leader: GatherLeader::new(0, config),
        config,
        honest: BTreeSet::new(),
        answered: BTreeSet::new(),
        second_sent: false,
    };
    let honest = |value: &[u8]| Contribution {
        name: "h".into(),
        expected: vec![0, 1],
        wait: Duration::from_secs(10),
        value: value.to_vec(),
    };
    let t = g.leader.handle_contribution(start, 0, honest(b"zero"));
    g.honest.insert(t);

    let mut rest = data;
    while let Some((&op, tail)) = rest.split_first() {
        rest = tail;
        match op % 8 {
            0 | 1 => {
                let bytes = chunk(&mut rest);
                let Ok(msg) = DynMessage::decode(bytes) else {
                    continue;
                };
                let from = if op & 0x10 != 0 { STRANGER } else { HOSTILE };
                let to: WorkerId = if op & 0x20 != 0 { 1 } else { 0 };
                let before = net.view(to);
                let now = net.now;
                let m = net.ms.get_mut(&to).unwrap();
                if let Err(e) = m.handle_message(from, msg.clone(), now) {
                    assert!(!e.to_string().is_empty());
                    assert!(
                        m.poll_transmit().is_none() && m.poll_event().is_none(),
                        "refused {msg:?} from {from} at {to} yet it acted"
                    );
                    assert_eq!(net.view(to), before, "refused {msg:?} changed rank {to}");
                }
                net.pump();
            }
            2 => {
                net.deliver_one(false);
            }
            3 => {
                net.now += Duration::from_millis(u64::from(op >> 3) * 250);
                let now = net.now;
                for m in net.ms.values_mut() {
                    m.handle_timeout(now);
                }
                net.pump();
                g.leader.handle_timeout(now);
                join.handle_timeout(now);
            }
            4 => {
                let lost = if op & 0x10 != 0 { STRANGER } else { HOSTILE };
                let now = net.now;
                for w in [0, 1] {
                    net.ms.get_mut(&w).unwrap().handle_lost(lost, now);
                }
                net.pump();
                if op & 0x20 != 0 {
                    g.leader.handle_peer_lost(HOSTILE);
                }
            }
            5 => {
                let bytes = chunk(&mut rest);
                if let Ok(msg) = postcard::from_bytes::<JoinMessage>(bytes) {
                    let phase = join.phase();
                    let r = join.handle_message(HOSTILE, msg);
                    assert!(r.is_err(), "rank 1 accepted {msg:?} from rank 2");
                    assert_eq!(join.phase(), phase);
                    assert!(join.poll_transmit().is_none());
                }
            }
            6 => {
                let bytes = chunk(&mut rest);
                // A record, as a joiner's introduction or the store's coordinator key is read:
                // what decodes re-encodes to a record equal to it.
                if let Ok(r) = MemberRecord::decode(bytes) {
                    assert_eq!(MemberRecord::decode(&r.encode()).as_ref(), Ok(&r));
                }
                if let Ok(c) = Contribution::decode(bytes) {
                    g.leader.handle_contribution(net.now, HOSTILE, c);
                } else if let Ok(outcome) = GatherOutcome::decode(bytes) {
                    let members: BTreeSet<WorkerId> = [0, 1, 2].into();
                    if let Ok(values) = gather::resolve(&members, outcome) {
                        assert_eq!(values.len(), members.len());
                    }
                }
            }
            _ => {
                if !g.second_sent {
                    g.second_sent = true;
                    let t = g.leader.handle_contribution(net.now, 1, honest(b"one"));
                    g.honest.insert(t);
                }
            }
        }
        net.check_honest();
        g.drain();
    }
    // Everything honest still in flight arrives; time runs out every wait.
    while net.deliver_one(false) {}
    net.check_honest();
    net.now += Duration::from_secs(3600);
    g.leader.handle_timeout(net.now);
    g.drain();
    for t in &g.honest {
        assert!(
            g.answered.contains(t),
            "honest contribution {t} never answered"
        );
    }
});
