//! A stalled rank in a hierarchical collective, simulated: every other rank follows its stages
//! (a stage's collective completes when all its members reach it; the stalled rank reaches
//! none), gives up at its stage's bound ([`stage_bounds`]) unless a report came first, and
//! reports as [`stage_report`] says. Ranks start at different times and reports take time to
//! arrive; while both stay within the allowance, every other rank must end (done, or failed
//! by its timeout naming only the stalled rank), and every report must pass
//! [`check_stage_report`].

use std::time::Duration;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::stage_report;
use crate::collective::hierarchy::{HierOp, HostPlan, Stage};
use crate::collective::stage_failure::*;
use crate::ports::process_group::{DeathCause, MeshViolation, ProcessGroupError};

const T: Duration = Duration::from_secs(8);

/// How a rank's collective ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum End {
    /// Every stage completed.
    Done,
    /// It failed at `at` (from time zero) naming `ranks`; `reported`: on another rank's word.
    Failed {
        at: Duration,
        ranks: Vec<usize>,
        reported: bool,
    },
}

/// Which stage group a stage runs in: a host (by index) or the leaders.
fn group_of(plan: &HostPlan, rank: usize, stage: Stage) -> (bool, usize) {
    match stage {
        Stage::Host(_) => (true, plan.host_of(rank)),
        Stage::Leaders(_) => (false, 0),
    }
}

fn members_of(plan: &HostPlan, group: (bool, usize)) -> Vec<usize> {
    if group.0 {
        plan.hosts()[group.1].clone()
    } else {
        plan.leaders()
    }
}

/// Runs `op` with rank `stalled` never arriving; ranks start at `start[r]`, a report from `x`
/// reaches `r` after `delay(x, r)`. Returns each rank's end (`None` for the stalled one).
fn run(
    plan: &HostPlan,
    op: HierOp,
    stalled: usize,
    start: &[Duration],
    delay: &mut impl FnMut(usize, usize) -> Duration,
) -> Vec<Option<End>> {
    let n = plan.world();
    let bounds: Vec<Vec<(Stage, Duration)>> =
        (0..n).map(|r| stage_bounds(plan, r, op, T)).collect();
    let mut at = vec![0usize; n];
    let mut ends: Vec<Option<End>> = vec![None; n];
    // Stages complete at once when every member is at them (time only matters to bounds).
    loop {
        let mut moved = false;
        for r in 0..n {
            if r == stalled || ends[r].is_some() {
                continue;
            }
            let Some((stage, _)) = bounds[r].get(at[r]) else {
                ends[r] = Some(End::Done);
                moved = true;
                continue;
            };
            let group = group_of(plan, r, *stage);
            let members = members_of(plan, group);
            let all_here = members.iter().all(|m| {
                *m != stalled
                    && ends[*m].is_none()
                    && bounds[*m]
                        .get(at[*m])
                        .map(|(s, _)| (group_of(plan, *m, *s), *s))
                        == Some((group, *stage))
            });
            if all_here {
                for m in members {
                    at[m] += 1;
                }
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    // The blocked ranks fail, in time order: at their own bound, or when a report reaches them.
    let mut reports: Vec<(Duration, usize, Vec<usize>)> = Vec::new(); // (arrival, to, ranks)
    loop {
        let blocked: Vec<usize> = (0..n)
            .filter(|r| *r != stalled && ends[*r].is_none())
            .collect();
        if blocked.is_empty() {
            return ends;
        }
        let mut next: Option<(Duration, usize, Option<Vec<usize>>)> = None;
        for r in &blocked {
            let own = start[*r] + bounds[*r][at[*r]].1;
            let report = reports
                .iter()
                .filter(|(_, to, _)| to == r)
                .min_by_key(|(t, _, _)| *t);
            let candidate = match report {
                Some((t, _, ranks)) if *t <= own => (*t, *r, Some(ranks.clone())),
                _ => (own, *r, None),
            };
            if next.as_ref().is_none_or(|(t, _, _)| candidate.0 < *t) {
                next = Some(candidate);
            }
        }
        let (t, r, told) = next.expect("a blocked rank");
        match told {
            Some(ranks) => {
                ends[r] = Some(End::Failed {
                    at: t,
                    ranks,
                    reported: true,
                })
            }
            None => {
                let (stage, _) = bounds[r][at[r]];
                let group = group_of(plan, r, stage);
                let members = members_of(plan, group);
                // Its own timeout names the members that have not reached this stage, in the
                // stage's ranks (one that reached it and failed there since has published).
                let waiting_on: Vec<usize> = members
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| {
                        **m == stalled
                            || bounds[**m].get(at[**m]).map(|(s, _)| *s) != Some(stage)
                            || group_of(plan, **m, stage) != group
                    })
                    .map(|(i, _)| i)
                    .collect();
                let error = ProcessGroupError::Timeout {
                    collective: "sim",
                    seq: 0,
                    rank: r,
                    waiting_on,
                    timeout: bounds[r][at[r]].1,
                };
                let report = stage_report(&error, &members).expect("a timeout is reported");
                assert_eq!(
                    check_stage_report(plan.hosts(), 0, r, &report.ranks),
                    Ok(()),
                    "{op:?} on {:?}: rank {r}'s report {report:?}",
                    plan.hosts()
                );
                for to in (0..n).filter(|q| *q != r) {
                    reports.push((t + delay(r, to), to, report.ranks.clone()));
                }
                ends[r] = Some(End::Failed {
                    at: t,
                    ranks: report.ranks,
                    reported: false,
                });
            }
        }
    }
}

fn every_op(world: usize) -> Vec<HierOp> {
    let mut ops = vec![HierOp::Barrier, HierOp::AllReduce, HierOp::AllGather];
    for root in 0..world {
        ops.push(HierOp::Reduce { root });
        ops.push(HierOp::Broadcast { root });
    }
    ops
}

/// Every assignment of `n` ranks to hosts (hosts numbered by first use).
fn every_assignment(n: usize, f: &mut impl FnMut(&[usize])) {
    fn go(hosts: &mut Vec<usize>, n: usize, next: usize, f: &mut impl FnMut(&[usize])) {
        if hosts.len() == n {
            f(hosts);
            return;
        }
        for h in 0..=next {
            hosts.push(h);
            go(hosts, n, next.max(h + 1), f);
            hosts.pop();
        }
    }
    go(&mut Vec::new(), n, 0, f);
}

/// Checks every rank's end for a stalled `stalled`: done, or failed within its timeout naming
/// only it; returns how many failed on a report.
fn check_ends(
    plan: &HostPlan,
    op: HierOp,
    stalled: usize,
    start: &[Duration],
    ends: &[Option<End>],
) -> usize {
    let mut told = 0;
    for (r, end) in ends.iter().enumerate() {
        if r == stalled {
            continue;
        }
        match end.as_ref().expect("every other rank ends") {
            End::Done => {}
            End::Failed {
                at,
                ranks,
                reported,
            } => {
                assert_eq!(
                    ranks,
                    &vec![stalled],
                    "{op:?} on {:?}, rank {stalled} stalled: rank {r} blamed {ranks:?}",
                    plan.hosts()
                );
                assert!(*at <= start[r] + T, "rank {r} failed at {at:?}");
                told += usize::from(*reported);
            }
        }
    }
    told
}

#[test]
fn a_stalled_rank_is_named_by_every_rank_within_the_timeout_on_every_assignment() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5747_e047);
    let a = forward_allowance(T);
    let mut runs = 0;
    let mut told = 0;
    for n in 2..=7 {
        every_assignment(n, &mut |hosts| {
            let plan = HostPlan::new(hosts);
            if !plan.is_hierarchical() {
                return;
            }
            for op in every_op(n) {
                for stalled in 0..n {
                    // Starts and deliveries spread so that each pair stays within the allowance.
                    let spread = |rng: &mut ChaCha8Rng| {
                        Duration::from_micros(rng.next_u64() % (a.as_micros() as u64 * 45 / 100))
                    };
                    let start: Vec<Duration> = (0..n).map(|_| spread(&mut rng)).collect();
                    let mut delay = |_: usize, _: usize| spread(&mut rng);
                    let ends = run(&plan, op, stalled, &start, &mut delay);
                    told += check_ends(&plan, op, stalled, &start, &ends);
                    runs += 1;
                }
            }
        });
    }
    assert!(runs > 20_000, "{runs}");
    // The reports are what names the stalled rank on the other hosts.
    assert!(told > runs / 2, "{told} of {runs}");
}

#[test]
fn without_reports_the_other_hosts_would_name_their_leaders() {
    // Ranks 0, 1 on host 0; 2, 3 on host 1; rank 3 stalls in an all_reduce. Reports that never
    // arrive (delay past every bound) leave rank 0 naming rank 2 and rank 1 naming rank 0:
    // what the reports fix.
    let plan = HostPlan::new(&[0, 0, 1, 1]);
    let start = [Duration::ZERO; 4];
    let ends = run(&plan, HierOp::AllReduce, 3, &start, &mut |_, _| T * 2);
    let blamed = |r: usize| match &ends[r] {
        Some(End::Failed { ranks, .. }) => ranks.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(blamed(2), vec![3]);
    assert_eq!(blamed(0), vec![2]);
    assert_eq!(blamed(1), vec![0]);
    // With them, every rank names rank 3, rank 2 on its own and the others on its word.
    let ends = run(&plan, HierOp::AllReduce, 3, &start, &mut |_, _| {
        Duration::from_millis(5)
    });
    assert_eq!(check_ends(&plan, HierOp::AllReduce, 3, &start, &ends), 2);
}

#[test]
fn stage_bounds_leave_the_allowance_between_levels() {
    let plan = HostPlan::new(&["a", "b", "b", "c", "c"]);
    let t = Duration::from_millis(800);
    let a = forward_allowance(t);
    assert_eq!(a, Duration::from_millis(100));
    assert_eq!(
        forward_allowance(Duration::from_secs(1800)),
        MAX_FORWARD_ALLOWANCE
    );
    // A broadcast from rank 2: its host's stage comes first, the others' last.
    let op = HierOp::Broadcast { root: 2 };
    let bounds: Vec<Vec<Duration>> = (0..5)
        .map(|r| {
            stage_bounds(&plan, r, op, t)
                .into_iter()
                .map(|(_, b)| b)
                .collect()
        })
        .collect();
    assert_eq!(bounds[0], vec![t - a]); // alone on its host: the leaders' stage only
    assert_eq!(bounds[1], vec![t - 2 * a, t - a]);
    assert_eq!(bounds[2], vec![t - 2 * a]);
    assert_eq!(bounds[3], vec![t - a, t]);
    assert_eq!(bounds[4], vec![t]);
    // Every stage list is the plan's, in order.
    for r in 0..5 {
        let stages: Vec<Stage> = stage_bounds(&plan, r, op, t)
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(stages, plan.stages(r, op));
    }
}

#[test]
fn only_failures_seen_here_on_awaited_ranks_are_reported() {
    let members = [4, 7, 9];
    let timeout = |waiting_on: Vec<usize>| ProcessGroupError::Timeout {
        collective: "all_reduce",
        seq: 3,
        rank: 0,
        waiting_on,
        timeout: Duration::from_secs(2),
    };
    // A timeout names the stage group's ranks, reported as world ranks.
    assert_eq!(
        stage_report(&timeout(vec![2, 1, 2]), &members),
        Some(StageReport {
            ranks: vec![7, 9],
            cause: StageCause::TimedOut {
                waited: Duration::from_secs(2)
            }
        })
    );
    // Nobody named (a backend that does not say), or a rank outside the stage: nothing.
    assert_eq!(stage_report(&timeout(vec![]), &members), None);
    assert_eq!(stage_report(&timeout(vec![3]), &members), None);
    let died = |reported_by| ProcessGroupError::PeerDied {
        rank: 9,
        reported_by,
        cause: DeathCause::ConnectionClosed,
    };
    assert_eq!(
        stage_report(&died(None), &members),
        Some(StageReport {
            ranks: vec![9],
            cause: StageCause::Died
        })
    );
    // A death of a rank outside the stage (seen on its link) is not this stage's to report:
    // the receivers would take it for a forged report.
    let elsewhere = ProcessGroupError::PeerDied {
        rank: 5,
        reported_by: None,
        cause: DeathCause::ConnectionClosed,
    };
    assert_eq!(stage_report(&elsewhere, &members), None);
    // What another rank said is not said again.
    assert_eq!(stage_report(&died(Some(4)), &members), None);
    let told = StageReport {
        ranks: vec![9],
        cause: StageCause::TimedOut {
            waited: Duration::from_secs(1),
        },
    }
    .error(4);
    assert_eq!(stage_report(&told, &members), None);
    for other in [
        ProcessGroupError::ShutDown,
        ProcessGroupError::PeerAborted {
            rank: 7,
            reason: "x".into(),
        },
        ProcessGroupError::PeerLeft {
            rank: 7,
            collective: "barrier",
            seq: 1,
        },
    ] {
        assert_eq!(stage_report(&other, &members), None, "{other}");
    }
    // The receiver's error names both the blamed ranks and the reporter.
    let e = told.to_string();
    assert!(
        e.contains("rank(s) 9") && e.contains("reported by rank 4"),
        "{e}"
    );
    assert_eq!(
        StageReport {
            ranks: vec![9],
            cause: StageCause::Died
        }
        .error(4),
        ProcessGroupError::PeerDied {
            rank: 9,
            reported_by: Some(4),
            cause: DeathCause::InStage
        }
    );
}

#[test]
fn a_report_may_blame_only_ranks_that_share_a_stage_with_its_sender() {
    // Hosts {0, 1, 2}, {3, 4}, {5}: leaders 0, 3, 5.
    let hosts = vec![vec![0, 1, 2], vec![3, 4], vec![5]];
    let ok = |sender, ranks: &[usize]| check_stage_report(&hosts, 7, sender, ranks);
    assert_eq!(ok(1, &[2]), Ok(()));
    assert_eq!(ok(0, &[1, 2]), Ok(()));
    assert_eq!(ok(0, &[3, 5]), Ok(()));
    assert_eq!(ok(5, &[0]), Ok(()));
    let forged = |sender, ranks: &[usize], reason| {
        assert_eq!(
            ok(sender, ranks),
            Err(MeshViolation::ForgedStageReport { group: 7, reason }),
            "{sender} blaming {ranks:?}"
        )
    };
    forged(1, &[], "it blamed no rank");
    forged(1, &[1], "it blamed itself");
    forged(8, &[1], "it is not a member of that group");
    forged(1, &[9], "a rank it blamed is not a member of that group");
    // A non-leader waits on nobody off its host; a leader on no other host's non-leader.
    forged(1, &[3], "a rank it blamed shares none of its stages");
    forged(0, &[4], "a rank it blamed shares none of its stages");
    forged(4, &[0], "a rank it blamed shares none of its stages");
}
