//! The hierarchical plans run in a simulation: every rank follows its stages, a host's (or the
//! leaders') collective runs when all its members have reached it, and the results are checked
//! against the flat collective's. Ranks that reach different collectives of one group, or that
//! cannot all finish, fail the test.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

/// What one rank holds while a collective runs.
#[derive(Debug, Clone)]
struct RankState {
    /// The value reduced or broadcast (rank `r` starts with `1 << r`, so a sum counts each
    /// rank once: a rank added twice or never shows).
    val: u64,
    /// The ranks whose arrival this rank has heard of (a barrier may end only when all).
    seen: u64,
    /// Its own block, for all_gather.
    input: Vec<u8>,
    /// Packed blocks (all_gather).
    buf: Vec<u8>,
}

fn block_of(rank: usize) -> Vec<u8> {
    vec![rank as u8; (rank * 7) % 5]
}

/// Runs `op` on `plan` and returns every rank's final state; panics on a deadlock or a
/// disagreement.
fn run(plan: &HostPlan, op: HierOp) -> Vec<RankState> {
    let n = plan.world();
    let stages: Vec<Vec<Stage>> = (0..n).map(|r| plan.stages(r, op)).collect();
    let mut state: Vec<RankState> = (0..n)
        .map(|r| RankState {
            val: match op {
                HierOp::Broadcast { root } if r == root => 0xB0AD_CA57,
                _ => 1u64 << r,
            },
            seen: 1u64 << r,
            input: block_of(r),
            buf: pack_blocks(&[&block_of(r)]),
        })
        .collect();
    let mut at = vec![0usize; n];
    let leaders = plan.leaders();
    loop {
        let mut progress = false;
        let mut groups: Vec<(bool, &[usize])> =
            plan.hosts().iter().map(|h| (true, h.as_slice())).collect();
        groups.push((false, &leaders));
        for (on_host, members) in groups {
            let next: Vec<Option<Step>> = members
                .iter()
                .map(|r| match stages[*r].get(at[*r]) {
                    Some(Stage::Host(s)) if on_host => Some(*s),
                    Some(Stage::Leaders(s)) if !on_host => Some(*s),
                    _ => None,
                })
                .collect();
            let reached: Vec<Step> = next.iter().flatten().copied().collect();
            if let Some(first) = reached.first() {
                assert!(
                    reached.iter().all(|s| s == first),
                    "{op:?} on {:?}: members {members:?} reached {next:?}",
                    plan.hosts()
                );
            }
            if reached.len() != members.len() {
                continue;
            }
            apply(plan, &mut state, members, reached[0], on_host);
            for r in members {
                at[*r] += 1;
            }
            progress = true;
        }
        if (0..n).all(|r| at[r] == stages[r].len()) {
            return state;
        }
        assert!(
            progress,
            "{op:?} on {:?} deadlocked at {at:?} of {stages:?}",
            plan.hosts()
        );
    }
}

/// One collective among `members` (group ranks of the whole group, in the collective's order).
fn apply(plan: &HostPlan, state: &mut [RankState], members: &[usize], step: Step, host: bool) {
    let sum = members
        .iter()
        .fold(0u64, |acc, r| acc.wrapping_add(state[*r].val));
    let seen = members.iter().fold(0u64, |acc, r| acc | state[*r].seen);
    match step {
        Step::Barrier => members.iter().for_each(|r| state[*r].seen = seen),
        Step::AllReduce => members.iter().for_each(|r| {
            state[*r].val = sum;
            state[*r].seen = seen;
        }),
        Step::Reduce { root } => {
            state[members[root]].val = sum;
            state[members[root]].seen = seen;
        }
        Step::Broadcast { root } => {
            let from = state[members[root]].clone();
            for r in members {
                state[*r].val = from.val;
                state[*r].buf = from.buf.clone();
                state[*r].seen |= from.seen;
            }
        }
        Step::Gather { root } => {
            let blocks: Vec<&[u8]> = members.iter().map(|r| &state[*r].input[..]).collect();
            let packed = pack_blocks(&blocks);
            state[members[root]].buf = packed;
            state[members[root]].seen = seen;
        }
        Step::AllGather => {
            assert!(!host, "all_gather runs among the leaders only");
            let bufs: Vec<Vec<u8>> = members.iter().map(|r| state[*r].buf.clone()).collect();
            let bufs: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            let all = plan.assemble(&bufs).expect("leaders' blocks parse");
            for r in members {
                state[*r].buf = all.clone();
                state[*r].seen = seen;
            }
        }
    }
}

/// Every collective on `plan`, checked against the flat collectives' results.
fn check_plan(plan: &HostPlan) {
    let n = plan.world();
    let all = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
    let state = run(plan, HierOp::Barrier);
    for (r, s) in state.iter().enumerate() {
        assert_eq!(
            s.seen,
            all,
            "barrier: rank {r} left early on {:?}",
            plan.hosts()
        );
    }
    let state = run(plan, HierOp::AllReduce);
    for (r, s) in state.iter().enumerate() {
        assert_eq!(s.val, all, "all_reduce: rank {r} on {:?}", plan.hosts());
    }
    let state = run(plan, HierOp::AllGather);
    for (r, s) in state.iter().enumerate() {
        let ranges = unpack_blocks(&s.buf, n).expect("every block, packed");
        for (q, range) in ranges.into_iter().enumerate() {
            assert_eq!(
                s.buf[range],
                block_of(q)[..],
                "all_gather: rank {r}'s block of {q} on {:?}",
                plan.hosts()
            );
        }
    }
    for root in 0..n {
        let state = run(plan, HierOp::Reduce { root });
        assert_eq!(
            state[root].val,
            all,
            "reduce to {root} on {:?}",
            plan.hosts()
        );
        let state = run(plan, HierOp::Broadcast { root });
        for (r, s) in state.iter().enumerate() {
            assert_eq!(
                s.val,
                0xB0AD_CA57,
                "broadcast from {root}: rank {r} on {:?}",
                plan.hosts()
            );
        }
    }
}

/// Calls `f` with every assignment of `n` ranks to hosts, up to the hosts' names (every
/// partition of the ranks, as restricted growth strings).
fn every_assignment(n: usize, f: &mut impl FnMut(&[usize])) {
    fn go(hosts: &mut Vec<usize>, n: usize, next: usize, f: &mut impl FnMut(&[usize])) {
        if hosts.len() == n {
            return f(hosts);
        }
        for h in 0..=next {
            hosts.push(h);
            go(hosts, n, next.max(h + 1), f);
            hosts.pop();
        }
    }
    go(&mut Vec::with_capacity(n), n, 0, f);
}

#[test]
fn every_assignment_up_to_eight_ranks_matches_the_flat_collectives() {
    let mut plans = 0;
    for n in 1..=8 {
        every_assignment(n, &mut |hosts| {
            check_plan(&HostPlan::new(hosts));
            plans += 1;
        });
    }
    // The Bell numbers 1..=8 add up to this: every partition was run.
    assert_eq!(plans, 1 + 2 + 5 + 15 + 52 + 203 + 877 + 4140);
}

#[test]
fn seeded_assignments_of_every_world_size_up_to_64_match_the_flat_collectives() {
    let mut rng = ChaCha8Rng::seed_from_u64(47);
    for n in 1..=64usize {
        let mut assignments: Vec<Vec<u64>> = vec![
            vec![0; n],
            (0..n as u64).collect(),
            (0..n).map(|r| (r / 2) as u64).collect(),
            (0..n).map(|r| (r % 3) as u64).collect(),
            (0..n).map(|r| u64::from(r != 0)).collect(),
        ];
        for _ in 0..6 {
            let hosts = 1 + rng.next_u64() % n as u64;
            assignments.push((0..n).map(|_| rng.next_u64() % hosts).collect());
        }
        for hosts in assignments {
            check_plan(&HostPlan::new(&hosts));
        }
    }
}

#[test]
fn plans_name_hosts_by_lowest_rank_and_leaders_lowest() {
    let plan = HostPlan::new(&["b", "a", "b", "c", "a", "a"]);
    assert_eq!(plan.hosts(), &[vec![0, 2], vec![1, 4, 5], vec![3]]);
    assert_eq!(plan.leaders(), vec![0, 1, 3]);
    assert_eq!(plan.host_rank(5), 2);
    assert!(plan.is_hierarchical());
    assert!(!HostPlan::new(&[1, 2, 3]).is_hierarchical());
    assert!(!HostPlan::new(&[1, 1, 1]).is_hierarchical());
    // Rank 5 (host "a", not its leader) in a broadcast from rank 2 (host "b", not its leader):
    // it waits for its leader's broadcast; rank 2's host first hears from rank 2.
    assert_eq!(
        plan.stages(5, HierOp::Broadcast { root: 2 }),
        vec![Stage::Host(Step::Broadcast { root: 0 })]
    );
    assert_eq!(
        plan.stages(0, HierOp::Broadcast { root: 2 }),
        vec![
            Stage::Host(Step::Broadcast { root: 1 }),
            Stage::Leaders(Step::Broadcast { root: 0 })
        ]
    );
    // A host of one rank has no host stages.
    assert_eq!(
        plan.stages(3, HierOp::AllReduce),
        vec![Stage::Leaders(Step::AllReduce)]
    );
    assert_eq!(plan.stages(3, HierOp::Reduce { root: 9 }), vec![]);
}

#[test]
fn packed_blocks_refuse_what_does_not_parse() {
    let packed = pack_blocks(&[b"ab", b"", b"cde"]);
    assert_eq!(
        unpack_blocks(&packed, 3),
        Some(vec![24..26, 26..26, 26..29])
    );
    assert_eq!(unpack_blocks(&packed, 2), None);
    assert_eq!(unpack_blocks(&packed[..28], 3), None);
    let mut huge = packed.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(unpack_blocks(&huge, 3), None);
    assert_eq!(unpack_blocks(&[], usize::MAX), None);
    let plan = HostPlan::new(&[0, 1, 0]);
    let good = pack_blocks(&[b"r0", b"r2"]);
    assert_eq!(
        plan.assemble(&[&good, &packed]),
        Err(Malformed { host: 1 }),
        "host 1 has one rank, not three blocks"
    );
    let one = pack_blocks(&[b"r1"]);
    let all = plan.assemble(&[&good, &one]).unwrap();
    let ranges = unpack_blocks(&all, 3).unwrap();
    let blocks: Vec<&[u8]> = ranges.into_iter().map(|r| &all[r]).collect();
    assert_eq!(blocks, vec![&b"r0"[..], b"r1", b"r2"]);
    assert_eq!(plan.assemble(&[&good]), Err(Malformed { host: 1 }));
}
