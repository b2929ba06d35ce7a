use std::collections::BTreeMap;

use super::*;
use crate::sim::{self, Clock, Faults, Links, SimRng};

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

const OP: Duration = Duration::from_secs(30);

/// Workers' memberships over FIFO links, with connections made as the protocol asks.
struct Net {
    clock: Clock,
    ms: BTreeMap<WorkerId, DynamicMembership>,
    links: Links<(WorkerId, WorkerId), DynMessage>,
    events: BTreeMap<WorkerId, Vec<MembershipEvent>>,
    /// The rank the store names as coordinator.
    published: WorkerId,
}

impl Net {
    fn new() -> Self {
        let mut ms = BTreeMap::new();
        ms.insert(0, DynamicMembership::found(record(0), OP));
        Self {
            clock: Clock::new(),
            ms,
            links: Links::new(),
            events: BTreeMap::new(),
            published: 0,
        }
    }

    /// Like [`new`](Self::new), over links where every message takes a random 1 to 500 ms
    /// (each link stays FIFO, as a TCP connection is), drawn from `seed`.
    fn delayed(seed: u64) -> Self {
        let mut net = Self::new();
        let faults = Faults {
            delay: Some((Duration::from_millis(1), Duration::from_millis(500))),
            ..Faults::NONE
        };
        net.links = Links::with_faults(faults, seed, net.clock.now());
        net
    }

    fn start_join(&mut self, rank: WorkerId) {
        let c = self.published;
        let deadline = Some(self.clock.now() + Duration::from_secs(60));
        self.ms
            .insert(rank, DynamicMembership::join(record(rank), c, OP, deadline));
        let r = record(rank);
        assert_eq!(
            self.ms
                .get_mut(&c)
                .unwrap()
                .handle_connected(rank, Some(&r)),
            Ok(Accepted::Applicant)
        );
        assert_eq!(
            self.ms.get_mut(&rank).unwrap().handle_connected(c, None),
            Ok(Accepted::Dialled)
        );
        self.pump();
    }

    fn pump(&mut self) {
        loop {
            let mut progress = false;
            let ranks: Vec<WorkerId> = self.ms.keys().copied().collect();
            for w in ranks {
                while let Some((to, msg)) = self.ms.get_mut(&w).unwrap().poll_transmit() {
                    progress = true;
                    if self.ms.contains_key(&to) {
                        self.links.send((w, to), msg);
                    }
                }
                while let Some(ev) = self.ms.get_mut(&w).unwrap().poll_event() {
                    progress = true;
                    match &ev {
                        MembershipEvent::Connect(list) => {
                            for r in list {
                                let me = record(w);
                                if let Some(m) = self.ms.get_mut(&r.rank) {
                                    assert_eq!(
                                        m.handle_connected(w, Some(&me)),
                                        Ok(Accepted::Member)
                                    );
                                    assert_eq!(
                                        self.ms.get_mut(&w).unwrap().handle_connected(r.rank, None),
                                        Ok(Accepted::Dialled)
                                    );
                                } else {
                                    let now = self.clock.now();
                                    self.ms
                                        .get_mut(&w)
                                        .unwrap()
                                        .handle_connect_failed(r.rank, now);
                                }
                            }
                        }
                        MembershipEvent::Coordinate => self.published = w,
                        MembershipEvent::MemberRemoved { rank, left: false } => {
                            self.links.clear((w, *rank));
                            self.links.clear((*rank, w));
                        }
                        _ => {}
                    }
                    self.events.entry(w).or_default().push(ev);
                }
            }
            if !progress {
                return;
            }
        }
    }

    fn deliver(&mut self, rng: &mut SimRng) -> bool {
        if self.links.ready().is_empty() {
            // Only delayed messages left: time moves on to the next one.
            let Some(next) = self.links.next_ready_at() else {
                return false;
            };
            self.clock.advance_to(next);
            self.links.set_now(self.clock.now());
        }
        let Some(((from, to), msg)) = self.links.pop_any(rng) else {
            return false;
        };
        if let Some(m) = self.ms.get_mut(&to) {
            m.handle_message(from, msg.clone(), self.clock.now())
                .unwrap_or_else(|e| panic!("{to} refused {msg:?} from {from}: {e}"));
        }
        self.pump();
        true
    }

    fn settle(&mut self, rng: &mut SimRng) {
        while self.deliver(rng) {}
    }

    fn got(&self, w: WorkerId, ev: &MembershipEvent) -> bool {
        self.events.get(&w).is_some_and(|e| e.contains(ev))
    }

    /// Every member's view of the group is the same.
    fn views_agree(&self) -> Vec<WorkerId> {
        let joined: Vec<&DynamicMembership> = self.ms.values().filter(|m| m.is_joined()).collect();
        let view = |m: &DynamicMembership| m.members().iter().map(|r| r.rank).collect::<Vec<_>>();
        let first = view(joined[0]);
        for m in &joined {
            assert_eq!(view(m), first, "the view of rank {}", m.rank());
        }
        first
    }
}

/// Joiners that ask at once, with messages delivered in a seeded order: every join completes,
/// one at a time, and every member ends with the same member list in admission order.
#[test]
fn concurrent_joins_are_serialized_and_views_agree() {
    sim::for_each_seed("concurrent joins", 0..200, |seed| {
        let mut rng = SimRng::new(seed);
        let mut net = Net::new();
        let n = 2 + rng.below(6) as u32;
        for rank in 1..n {
            net.start_join(rank);
            for _ in 0..rng.below(4) {
                net.deliver(&mut rng);
            }
        }
        net.settle(&mut rng);
        for rank in 1..n {
            assert!(
                net.got(rank, &MembershipEvent::Joined),
                "seed {seed} rank {rank}"
            );
        }
        let view = net.views_agree();
        assert_eq!(view.len(), n as usize, "seed {seed}");
        assert_eq!(net.ms[&0].coordinator(), Some(0));
    });
}

/// The same joins over links that delay every message (virtual time moves on to each
/// arrival): every join still completes and the views agree; the run took virtual time.
#[test]
fn concurrent_joins_over_delayed_links_are_serialized_and_views_agree() {
    sim::for_each_seed("concurrent joins, delayed links", 0..200, |seed| {
        let mut rng = SimRng::new(seed);
        let mut net = Net::delayed(seed);
        let n = 2 + rng.below(6) as u32;
        for rank in 1..n {
            net.start_join(rank);
            for _ in 0..rng.below(4) {
                net.deliver(&mut rng);
            }
        }
        net.settle(&mut rng);
        for rank in 1..n {
            assert!(
                net.got(rank, &MembershipEvent::Joined),
                "seed {seed} rank {rank}"
            );
        }
        assert_eq!(net.views_agree().len(), n as usize, "seed {seed}");
        assert!(
            net.clock.elapsed() >= Duration::from_millis(1),
            "seed {seed}"
        );
        let s = net.links.stats();
        assert!(s.delivered > 0 && s.lost == 0, "seed {seed}: {s:?}");
    });
}

#[test]
fn a_name_or_rank_in_use_is_refused() {
    let mut rng = SimRng::new(1);
    let mut net = Net::new();
    net.start_join(1);
    net.settle(&mut rng);
    // Rank 1 again, as a second worker (its own membership replaces the first's here, so
    // check the refusal it gets).
    let c = 0;
    let mut dup = DynamicMembership::join(record(1), c, OP, None);
    let r = record(1);
    // The coordinator sees a connection from a member's rank: refused, saying why.
    match net.ms.get_mut(&c).unwrap().handle_connected(1, Some(&r)) {
        Err(MembershipError::Refused { reason, retry }) => {
            assert!(reason.contains("w1 (rank 1) cannot join: w1 (rank 1) is already a member"));
            assert!(!retry);
        }
        other => panic!("{other:?}"),
    }
    // A fresh rank with a used name is refused by the coordinator's decision.
    let mut same_name = record(5);
    same_name.devices.name = "w1".into();
    assert!(net
        .ms
        .get_mut(&c)
        .unwrap()
        .handle_connected(5, Some(&same_name))
        .is_err());
    // Asked while rank 1 was still joining (so let in as an applicant), it is refused when
    // its turn comes.
    net.ms.get_mut(&c).unwrap().applicants.insert(5);
    net.ms
        .get_mut(&c)
        .unwrap()
        .handle_message(
            5,
            DynMessage::JoinRequest {
                record: same_name.clone(),
            },
            net.clock.now(),
        )
        .unwrap();
    let refusal = std::iter::from_fn(|| net.ms.get_mut(&c).unwrap().poll_transmit())
        .find(|(to, _)| *to == 5)
        .unwrap();
    match refusal.1 {
        DynMessage::Refused { reason, retry } => {
            assert!(
                reason.contains("w1 (rank 5) cannot join: w1 (rank 1) is already a member"),
                "{reason}"
            );
            assert!(!retry);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(dup.poll_transmit().map(|(to, _)| to), Some(0));
}

/// Leaves: members drop the leaver; the coordinator's own leave hands coordination to the
/// next oldest member, which publishes itself; a leave request pending at the old coordinator
/// goes to the new one; the last member's leave ends the group.
#[test]
fn leaves_hand_over_coordination_and_the_last_ends_the_group() {
    let mut rng = SimRng::new(7);
    let mut net = Net::new();
    for rank in 1..4 {
        net.start_join(rank);
        net.settle(&mut rng);
    }
    let now = net.clock.now();
    // Rank 2 asks to leave; before it is granted, the coordinator leaves too.
    net.ms.get_mut(&0).unwrap().begin_leave(now, None);
    net.ms.get_mut(&2).unwrap().begin_leave(now, None);
    net.pump();
    net.settle(&mut rng);
    assert!(net.got(0, &MembershipEvent::Left { last: false }));
    assert!(
        net.got(2, &MembershipEvent::Left { last: false }),
        "{:?} {:?}",
        net.events.get(&2),
        net.ms[&2]
    );
    assert!(net.got(1, &MembershipEvent::Coordinate));
    assert_eq!(net.published, 1);
    net.ms.remove(&0);
    net.ms.remove(&2);
    assert_eq!(net.views_agree(), vec![1, 3]);
    // A new worker joins through the new coordinator, and rank 2 may come back.
    net.start_join(2);
    net.settle(&mut rng);
    assert_eq!(net.views_agree(), vec![1, 3, 2]);
    for w in [3, 2] {
        net.ms.get_mut(&w).unwrap().begin_leave(now, None);
        net.pump();
        net.settle(&mut rng);
        assert!(net.got(w, &MembershipEvent::Left { last: false }));
        net.ms.remove(&w);
    }
    net.ms.get_mut(&1).unwrap().begin_leave(now, None);
    net.pump();
    assert!(net.got(1, &MembershipEvent::Left { last: true }));
}

/// A joiner that stops answering is refused at the coordinator's deadline, the members told
/// to expect it forget it, and the next join goes ahead.
#[test]
fn a_stalled_join_is_refused_at_the_deadline_and_the_next_proceeds() {
    let mut rng = SimRng::new(3);
    let mut net = Net::new();
    net.start_join(1);
    net.settle(&mut rng);
    net.start_join(2);
    // Deliver the request and the announcement, but the joiner never hears its admission.
    while net.deliver(&mut rng) {
        if net.links.is_busy((0, 2)) {
            break;
        }
    }
    net.links.clear((0, 2));
    net.start_join(3);
    net.settle(&mut rng);
    assert!(
        !net.got(3, &MembershipEvent::Joined),
        "the queue is blocked"
    );
    assert_eq!(net.ms[&0].poll_timeout(), Some(net.clock.now() + OP));
    net.clock.advance(OP);
    let now = net.clock.now();
    net.ms.get_mut(&0).unwrap().handle_timeout(now);
    net.pump();
    net.links.clear((0, 2));
    net.settle(&mut rng);
    assert!(net.got(3, &MembershipEvent::Joined));
    net.ms.remove(&2);
    assert_eq!(net.views_agree(), vec![0, 1, 3]);
    assert!(!net.ms[&1].expected.contains_key(&2));
}

/// A joiner lost in the middle of its join: the coordinator abandons it and goes on; a member
/// lost while a joiner connects is not waited for.
#[test]
fn lost_workers_during_a_join_do_not_block_the_group() {
    let mut rng = SimRng::new(11);
    let mut net = Net::new();
    net.start_join(1);
    net.start_join(2);
    net.deliver(&mut rng);
    let now = net.clock.now();
    net.ms.remove(&1);
    net.links.retain(|(f, t)| f != 1 && t != 1);
    net.ms.get_mut(&0).unwrap().handle_lost(1, now);
    if let Some(m) = net.ms.get_mut(&2) {
        m.handle_lost(1, now);
    }
    net.pump();
    net.settle(&mut rng);
    assert!(net.got(2, &MembershipEvent::Joined));
    assert_eq!(net.views_agree(), vec![0, 2]);
}

#[test]
fn messages_out_of_turn_are_violations_and_change_nothing() {
    let mut rng = SimRng::new(5);
    let mut net = Net::new();
    net.start_join(1);
    net.start_join(2);
    net.settle(&mut rng);
    let now = net.clock.now();
    let m1 = net.ms.get_mut(&1).unwrap();
    // Only the coordinator welcomes and admits; a stranger announces nothing.
    for (from, msg) in [
        (2, DynMessage::Welcome),
        (
            2,
            DynMessage::Admit {
                seq: 9,
                members: vec![],
            },
        ),
        (7, DynMessage::Left { rank: 0 }),
    ] {
        assert!(matches!(
            m1.handle_message(from, msg, now),
            Err(MembershipError::Violation { .. })
        ));
    }
    // A member that is not the coordinator here may be the next one (its news travels on
    // another connection): what it announces is held, unapplied, a bounded number of times.
    for _ in 0..EARLY_KEPT {
        m1.handle_message(2, DynMessage::Left { rank: 0 }, now)
            .unwrap();
    }
    assert!(matches!(
        m1.handle_message(
            2,
            DynMessage::Joining {
                seq: 9,
                record: record(9)
            },
            now
        ),
        Err(MembershipError::Violation { peer: 2, .. })
    ));
    assert!(m1.is_member(0) && m1.expected.is_empty());
    // A stranger's connection is refused; a leave request from a non-member is answered
    // with its removal (it was removed already).
    m1.handle_message(7, DynMessage::LeaveRequest, now).unwrap();
    assert_eq!(m1.poll_transmit(), Some((7, DynMessage::Left { rank: 7 })));
    assert!(m1.handle_connected(7, Some(&record(7))).is_err());
    assert_eq!(
        m1.members().iter().map(|r| r.rank).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    let c = net.ms.get_mut(&0).unwrap();
    assert!(c.handle_message(1, DynMessage::Connected, now).is_err());
    assert!(c
        .handle_message(1, DynMessage::JoinRequest { record: record(1) }, now)
        .is_err());
}

/// A joiner whose device plan breaks a rule with the members' withdraws with the typed error,
/// and the coordinator goes on.
#[test]
fn a_joiner_with_a_bad_device_map_withdraws() {
    let mut rng = SimRng::new(2);
    let mut net = Net::new();
    let mut bad = record(1);
    bad.devices.device_count = 1;
    bad.devices.device_maps.insert(
        "w0",
        [(crate::device::Device::Cuda(3), crate::device::Device::Cpu)]
            .into_iter()
            .collect(),
    );
    net.ms
        .insert(1, DynamicMembership::join(bad.clone(), 0, OP, None));
    net.ms
        .get_mut(&0)
        .unwrap()
        .handle_connected(1, Some(&bad))
        .unwrap();
    net.ms
        .get_mut(&1)
        .unwrap()
        .handle_connected(0, None)
        .unwrap();
    net.pump();
    net.settle(&mut rng);
    let failed = net.events[&1].iter().find_map(|e| match e {
        MembershipEvent::JoinFailed(MembershipError::DeviceMaps(e)) => Some(e.to_string()),
        _ => None,
    });
    assert!(failed
        .unwrap()
        .contains("Node w1 has source devices with invalid indices"));
    net.ms.remove(&1);
    net.start_join(2);
    net.settle(&mut rng);
    assert_eq!(net.views_agree(), vec![0, 2]);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Forged membership traffic (any message, from any rank, to any of three members, mixed
    /// with lost connections, new connections and timers): nothing panics, and a violation
    /// leaves the receiver's member list as it was.
    #[test]
    fn forged_membership_messages_never_panic(
        ops in proptest::collection::vec(
            (0u8..13, 0u32..6, 0u32..6, proptest::prelude::any::<u64>()),
            0..64,
        )
    ) {
        let mut rng = SimRng::new(0);
        let mut net = Net::new();
        net.start_join(1);
        net.start_join(2);
        net.settle(&mut rng);
        for (kind, from, rank, x) in ops {
            let now = net.clock.now();
            let to = (x % 3) as WorkerId;
            let Some(m) = net.ms.get_mut(&to) else { continue };
            let msg = match kind {
                0 => DynMessage::JoinRequest { record: record(rank) },
                1 => DynMessage::Joining { seq: x, record: record(rank) },
                2 => DynMessage::Expecting { rank },
                3 => DynMessage::Admit { seq: x, members: vec![(x, record(rank))] },
                4 => DynMessage::Connected,
                5 => DynMessage::Withdraw { reason: "no".into() },
                6 => DynMessage::Welcome,
                7 => DynMessage::Refused { reason: "no".into(), retry: x % 2 == 0 },
                8 => DynMessage::LeaveRequest,
                9 => DynMessage::Left { rank },
                10 => {
                    m.handle_lost(from, now);
                    continue;
                }
                11 => {
                    let _ = m.handle_connected(from, Some(&record(from)));
                    continue;
                }
                _ => {
                    net.clock.advance(Duration::from_secs(x % 100));
                    let now = net.clock.now();
                    m.handle_timeout(now);
                    m.begin_leave(now, Some(now + OP));
                    continue;
                }
            };
            let before = m.members();
            if m.handle_message(from, msg, now).is_err() {
                proptest::prop_assert_eq!(m.members(), before);
            }
            while m.poll_transmit().is_some() {}
            while m.poll_event().is_some() {}
        }
    }
}

/// Issue 29's "dynamic join hung 60 s waiting for ranks [1]": a joiner's one dial to a live
/// member other than the coordinator failed (refused, reset or slow under load), nothing
/// dialled again, and the join waited out its whole deadline (the agent's `init_timeout`, 60 s
/// by default) before failing naming that member. Now a failed dial is tried again after
/// [`REDIAL_FIRST`], doubling up to [`REDIAL_MAX`], and the join completes.
#[test]
fn a_failed_dial_to_a_live_member_is_tried_again_and_the_join_completes() {
    let mut rng = SimRng::new(5);
    let mut net = Net::new();
    net.start_join(1);
    net.settle(&mut rng);
    assert!(net.got(1, &MembershipEvent::Joined));
    let started = net.clock.now();
    net.start_join(2);
    // Everything up to the joiner's admission.
    while !net
        .links
        .messages((0, 2))
        .any(|m| matches!(m, DynMessage::Admit { .. }))
    {
        assert!(net.deliver(&mut rng), "the coordinator admits the joiner");
    }
    // The joiner's dials to member 1 fail three times (member 1 is alive and stays in the
    // group): `pump` finds no member 1 while it is taken out.
    let one = net.ms.remove(&1).unwrap();
    while let Some(msg) = net.links.pop((0, 2)) {
        let now = net.clock.now();
        net.ms
            .get_mut(&2)
            .unwrap()
            .handle_message(0, msg, now)
            .unwrap();
        net.pump();
    }
    let mut waits = Vec::new();
    for _ in 0..3 {
        let at = net.ms[&2].poll_timeout().expect("a redial is due");
        waits.push(at - net.clock.now());
        net.clock.advance_to(at);
        net.ms.get_mut(&2).unwrap().handle_timeout(at);
        net.pump();
    }
    assert_eq!(
        waits,
        [REDIAL_FIRST, REDIAL_FIRST * 2, REDIAL_FIRST * 4],
        "each failed dial doubles the wait"
    );
    assert!(!net.got(2, &MembershipEvent::Joined));
    // Member 1 answers the next dial.
    net.ms.insert(1, one);
    let at = net.ms[&2].poll_timeout().expect("a redial is due");
    assert!(
        at < started + Duration::from_secs(1),
        "long before the join's deadline"
    );
    net.clock.advance_to(at);
    net.ms.get_mut(&2).unwrap().handle_timeout(at);
    net.pump();
    net.settle(&mut rng);
    assert!(net.got(2, &MembershipEvent::Joined), "{:?}", net.events[&2]);
    assert!(
        !net.events[&2]
            .iter()
            .any(|e| matches!(e, MembershipEvent::JoinFailed(_))),
        "the failed dials do not fail the join"
    );
    // Nothing is left to dial: only the group's own timers remain.
    assert!(net.ms[&2]
        .poll_timeout()
        .is_none_or(|t| t >= started + Duration::from_secs(60)));
}

/// A member that keeps refusing dials is dialled at most every [`REDIAL_MAX`] and the join
/// still fails at its deadline naming it (what it did before the redial, only sooner to
/// notice nothing).
#[test]
fn a_member_that_never_answers_fails_the_join_at_its_deadline_naming_it() {
    let mut rng = SimRng::new(6);
    let mut net = Net::new();
    net.start_join(1);
    net.settle(&mut rng);
    let started = net.clock.now();
    net.start_join(2);
    while !net
        .links
        .messages((0, 2))
        .any(|m| matches!(m, DynMessage::Admit { .. }))
    {
        assert!(net.deliver(&mut rng));
    }
    net.ms.remove(&1).unwrap();
    while let Some(msg) = net.links.pop((0, 2)) {
        let now = net.clock.now();
        net.ms
            .get_mut(&2)
            .unwrap()
            .handle_message(0, msg, now)
            .unwrap();
        net.pump();
    }
    let deadline = started + Duration::from_secs(60);
    let mut dials = 0;
    loop {
        let at = net.ms[&2].poll_timeout().expect("a timer is due");
        assert!(at <= deadline);
        if let Some(prev) = Some(net.clock.now()).filter(|_| at < deadline) {
            assert!(at - prev <= REDIAL_MAX);
        }
        net.clock.advance_to(at);
        net.ms.get_mut(&2).unwrap().handle_timeout(at);
        net.pump();
        if at == deadline {
            break;
        }
        dials += 1;
    }
    assert!(dials >= 25, "dialled again {dials} times in 60 s");
    let failed = net.events[&2]
        .iter()
        .find_map(|e| match e {
            MembershipEvent::JoinFailed(e) => Some(e.to_string()),
            _ => None,
        })
        .expect("the join fails at its deadline");
    assert_eq!(failed, "joining the group (waiting for ranks [1])");
}
