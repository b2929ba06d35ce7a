//! The arena's tests: ranks of one process (and a child process that dies) through real
//! segments, on tokio's clock (paused where time matters).

use super::*;
use tensorwire_core::collective::{ElementType, ReduceOp};
use tensorwire_core::ports::runtime::BoxFuture;

/// tokio's clock (virtual when paused), as the mesh's `TokioRuntime`.
#[derive(Debug)]
struct Tokio;

impl Runtime for Tokio {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
    fn sleep_until(&self, at: Instant) -> BoxFuture {
        Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(at)))
    }
    fn spawn(&self, task: BoxFuture) -> BoxFuture {
        let handle = tokio::spawn(task);
        Box::pin(async move {
            let _ = handle.await;
        })
    }
}

fn rt() -> &'static dyn Runtime {
    &Tokio
}

fn alive(_: usize) -> Option<Gone> {
    None
}

fn bounds(timeout: Duration) -> Bounds<'static> {
    Bounds {
        runtime: &Tokio,
        deadline: rt().deadline_after(timeout),
        timeout,
        signature: 7,
        gone: &alive,
    }
}

async fn arenas(world: usize, bytes: usize) -> Vec<Arena> {
    let pids = vec![std::process::id(); world];
    let deadline = rt().deadline_after(Duration::from_secs(10));
    let host = ArenaHost::create(world, bytes).unwrap();
    let name = host.name().to_owned();
    let spin = Duration::from_micros(20);
    let mut joins = Vec::new();
    for r in 1..world {
        let (name, pids) = (name.clone(), pids.clone());
        joins.push(tokio::spawn(async move {
            Arena::join(&name, r, &pids, 0, spin, &Tokio, deadline).await
        }));
    }
    let mut out = vec![host.accept(0, &pids, spin, &Tokio, deadline).await.unwrap()];
    for j in joins {
        out.push(j.await.unwrap().unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_of_one_process_all_reduce_and_all_gather_through_an_arena() {
    let world = 4;
    // A small arena: every collective is chunked.
    let arenas = arenas(world, 2 * 64 * world * world).await;
    let slot = arenas[0].slot_bytes();
    let mut tasks = Vec::new();
    for (r, mut arena) in arenas.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let bounds = bounds(Duration::from_secs(20));
            let count = 5000;
            let mut data: Vec<u8> = (0..count)
                .flat_map(|i| ((i * (r + 1)) as i32).to_le_bytes())
                .collect();
            let plan =
                arena::all_reduce(r, world, count, ElementType::I32, ReduceOp::Sum, slot).unwrap();
            let never = never();
            tokio::pin!(never);
            arena
                .run(&plan, &mut data, &bounds, never.as_mut())
                .await
                .unwrap();
            let lens = vec![3000; world];
            let plan = arena::all_gather(r, &lens, slot).unwrap();
            let mut gathered = vec![0u8; plan.buffer_len()];
            gathered[plan.input_range()].fill(r as u8 + 1);
            arena
                .run(&plan, &mut gathered, &bounds, never.as_mut())
                .await
                .unwrap();
            // Into a buffer of the run's own, never cleared (the plan fills it): blocks of
            // every size, from none to several phases.
            let lens: Vec<usize> = (0..world).map(|q| q * 1100).collect();
            let plan = arena::all_gather(r, &lens, slot).unwrap();
            assert!(plan.fills_buffer());
            let mine = vec![r as u8 + 1; lens[r]];
            if lens[r] > 0 {
                // Refused before anything is written (the others do not wait for it).
                let short = arena
                    .run_fresh(&plan, &mine[1..], &bounds, never.as_mut())
                    .await;
                assert!(matches!(short, Err(ArenaError::PlanMismatch { .. })));
            }
            let fresh = arena
                .run_fresh(&plan, &mine, &bounds, never.as_mut())
                .await
                .unwrap();
            let mut at = 0;
            for (q, len) in lens.iter().enumerate() {
                assert!(fresh[at..at + len].iter().all(|b| *b == q as u8 + 1));
                at += len;
            }
            assert_eq!(fresh.len(), at);
            let barrier = arena::barrier(r, world, slot).unwrap();
            for _ in 0..100 {
                arena
                    .run(&barrier, &mut [], &bounds, never.as_mut())
                    .await
                    .unwrap();
            }
            (data, gathered)
        }));
    }
    for t in tasks {
        let (data, gathered) = t.await.unwrap();
        for (i, c) in data.chunks(4).enumerate() {
            assert_eq!(i32::from_le_bytes(c.try_into().unwrap()), (i * 10) as i32);
        }
        for (q, block) in gathered.chunks(3000).enumerate() {
            assert!(block.iter().all(|b| *b == q as u8 + 1));
        }
    }
}

/// Ranks 0 to 2 of 4 run a barrier that rank 3 never comes to: each fails at the deadline
/// on the group's clock (here a paused one: two minutes pass in a few seconds, so the
/// deadline is the runtime's and not the system clock's), naming rank 3, and every later
/// collective fails with the same.
#[tokio::test(start_paused = true)]
async fn every_rank_at_a_barrier_names_the_rank_that_never_came_at_the_deadline_on_its_clock() {
    let world = 4;
    let arenas = arenas(world, DEFAULT_ARENA_BYTES).await;
    let slot = arenas[0].slot_bytes();
    let timeout = Duration::from_secs(120);
    let started = std::time::Instant::now();
    let t0 = Tokio.now();
    let mut tasks = Vec::new();
    for (r, mut arena) in arenas.into_iter().enumerate().take(3) {
        tasks.push(tokio::spawn(async move {
            let bounds = bounds(timeout);
            let plan = arena::barrier(r, world, slot).unwrap();
            let never = never();
            tokio::pin!(never);
            let err = arena
                .run(&plan, &mut [], &bounds, never.as_mut())
                .await
                .unwrap_err();
            let again = arena
                .run(&plan, &mut [], &bounds, never.as_mut())
                .await
                .unwrap_err();
            (err, again)
        }));
    }
    for t in tasks {
        let (err, again) = t.await.unwrap();
        assert_eq!(
            err,
            ArenaError::Failed(ArenaFailure::Timeout {
                waiting_on: vec![3],
                timeout
            })
        );
        assert_eq!(again, err, "the arena is broken for good");
    }
    assert!(Tokio.now() >= t0 + timeout);
    assert!(started.elapsed() < timeout);
}

/// A caller that gives up before the deadline (a `Work::wait` with a shorter timeout)
/// fails the collective at once, naming every rank still awaited, with its own duration.
#[tokio::test(start_paused = true)]
async fn a_caller_that_gives_up_gets_a_timeout_naming_every_missing_rank() {
    let world = 4;
    let mut arenas = arenas(world, DEFAULT_ARENA_BYTES).await;
    let slot = arenas[0].slot_bytes();
    let plan = arena::barrier(1, world, slot).unwrap();
    let short = Duration::from_millis(300);
    let give_up = async move {
        Tokio.sleep_until(rt().deadline_after(short)).await;
        short
    };
    tokio::pin!(give_up);
    let err = arenas[1]
        .run(
            &plan,
            &mut [],
            &bounds(Duration::from_secs(3600)),
            give_up.as_mut(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err,
        ArenaError::Failed(ArenaFailure::Timeout {
            waiting_on: vec![0, 2, 3],
            timeout: short
        })
    );
}

/// A rank that the group says is gone is named at the next look, long before the deadline.
#[tokio::test(start_paused = true)]
async fn a_rank_the_group_says_is_gone_is_named() {
    let world = 2;
    let mut arenas = arenas(world, DEFAULT_ARENA_BYTES).await;
    let slot = arenas[0].slot_bytes();
    let plan = arena::barrier(0, world, slot).unwrap();
    let t0 = Tokio.now();
    let gone = |q: usize| (q == 1).then_some(Gone::Left);
    let bounds = Bounds {
        gone: &gone,
        ..bounds(Duration::from_secs(3600))
    };
    let never = never();
    tokio::pin!(never);
    let err = arenas[0]
        .run(&plan, &mut [], &bounds, never.as_mut())
        .await
        .unwrap_err();
    assert_eq!(
        err,
        ArenaError::Failed(ArenaFailure::Gone {
            rank: 1,
            why: Gone::Left
        })
    );
    assert!(Tokio.now() < t0 + Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_is_not_the_rank_it_claims_gets_no_arena() {
    // Rank 1 is announced with another process id than ours.
    let pids = vec![std::process::id(), 1];
    let deadline = rt().deadline_after(Duration::from_millis(300));
    let host = ArenaHost::create(2, DEFAULT_ARENA_BYTES).unwrap();
    let name = host.name().to_owned();
    let pids2 = pids.clone();
    let join = tokio::spawn(async move {
        Arena::join(&name, 1, &pids2, 0, Duration::ZERO, &Tokio, deadline).await
    });
    let err = host
        .accept(0, &pids, Duration::ZERO, &Tokio, deadline)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("ranks [1] did not fetch"), "{err}");
    assert!(join.await.unwrap().is_err());
}

/// A leader that hands out something other than an eventfd as a rank's wake-up (here a
/// memfd: a file would have 8 bytes written into it at every wake-up) gives no arena.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_wake_up_descriptor_is_not_an_eventfd_gives_no_arena() {
    let pids = vec![std::process::id(); 3];
    let deadline = rt().deadline_after(Duration::from_secs(10));
    let mut host = ArenaHost::create(3, DEFAULT_ARENA_BYTES).unwrap();
    host.wakes[2] = mem::memfd("not-an-eventfd", 64).unwrap();
    let name = host.name().to_owned();
    let pids2 = pids.clone();
    let join = tokio::spawn(async move {
        Arena::join(&name, 1, &pids2, 0, Duration::ZERO, &Tokio, deadline).await
    });
    let _ = host
        .accept(
            0,
            &pids,
            Duration::ZERO,
            &Tokio,
            rt().deadline_after(Duration::from_millis(300)),
        )
        .await;
    let err = join.await.unwrap().unwrap_err();
    assert!(
        err.to_string()
            .contains("the leader's wake-up descriptor for rank 2 is not an eventfd"),
        "{err}"
    );
}

/// A rank asleep in a wait for a rank whose process then dies learns it at once (the
/// pidfd is in the reactor), not at its next look on the clock: on a paused clock it fails
/// naming the rank before [`LIVENESS_PERIOD`] has passed.
#[tokio::test(start_paused = true)]
async fn a_sleeping_rank_learns_at_once_that_the_rank_it_waits_for_died() {
    let mut child = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    let pids = vec![std::process::id(), child.id()];
    let host = ArenaHost::create(2, DEFAULT_ARENA_BYTES).unwrap();
    let mut arena = Arena::over(
        host.fd,
        host.wakes,
        0,
        2,
        DEFAULT_ARENA_BYTES,
        &pids,
        Duration::from_micros(20),
    )
    .unwrap();
    let plan = arena::barrier(0, 2, arena.slot_bytes()).unwrap();
    let t0 = Tokio.now();
    let late = LIVENESS_PERIOD / 4;
    let killer = tokio::spawn(async move {
        Tokio.sleep_until(t0 + late).await;
        child.kill().unwrap();
        child.wait().unwrap();
    });
    let never = never();
    tokio::pin!(never);
    let err = arena
        .run(
            &plan,
            &mut [],
            &bounds(Duration::from_secs(60)),
            never.as_mut(),
        )
        .await
        .unwrap_err();
    killer.await.unwrap();
    assert_eq!(err, ArenaError::Failed(ArenaFailure::Died { rank: 1 }));
    let took = Tokio.now() - t0;
    assert!(
        took >= late && took < LIVENESS_PERIOD,
        "named after {took:?}: by the clock's look, not by the pidfd"
    );
}

/// A rank asleep in a wait is woken by the publication it waits for (its eventfd), not by
/// the next look the clock brings: on a paused clock it ends when the other rank arrives,
/// well before [`LIVENESS_PERIOD`].
#[tokio::test(start_paused = true)]
async fn a_sleeping_rank_is_woken_by_the_publication_it_waits_for() {
    let world = 2;
    let arenas = arenas(world, DEFAULT_ARENA_BYTES).await;
    let slot = arenas[0].slot_bytes();
    let late = LIVENESS_PERIOD / 4;
    let t0 = Tokio.now();
    let mut tasks = Vec::new();
    for (r, mut arena) in arenas.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            if r == 1 {
                Tokio.sleep_until(t0 + late).await;
            }
            let plan = arena::barrier(r, world, slot).unwrap();
            let never = never();
            tokio::pin!(never);
            for _ in 0..3 {
                arena
                    .run(
                        &plan,
                        &mut [],
                        &bounds(Duration::from_secs(60)),
                        never.as_mut(),
                    )
                    .await
                    .unwrap();
            }
            Tokio.now()
        }));
    }
    for t in tasks {
        let ended = t.await.unwrap();
        assert!(
            ended < t0 + LIVENESS_PERIOD,
            "a rank ended {:?} after the start: woken by the clock, not by the publication",
            ended - t0
        );
        assert!(ended >= t0 + late);
    }
}

/// The synchronous path: a rank whose peer has not come stops where its spin ends (having
/// published its phase), the peer runs the whole plan in its call, and the first rank's
/// `resume` finishes with the same result as the peer's; a barrier likewise; and a rank whose
/// signature differs from the phase's is told in its call.
#[tokio::test]
async fn try_run_stops_where_its_spin_ends_and_resume_finishes_with_the_same_result() {
    let world = 2;
    let mut arenas = arenas(world, 1 << 16).await;
    let slot = arenas[0].slot_bytes();
    let never = never();
    tokio::pin!(never);
    let plans: Vec<ArenaPlan> = (0..world)
        .map(|r| arena::all_reduce(r, world, 2, ElementType::I32, ReduceOp::Sum, slot).unwrap())
        .collect();
    let mut data: Vec<Vec<u8>> = (0..world)
        .map(|r| {
            [r as i32 + 1, 10 * (r as i32 + 1)]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        })
        .collect();
    let (first, rest) = arenas.split_at_mut(1);
    let (a0, a1) = (&mut first[0], &mut rest[0]);
    let (d0, d1) = data.split_at_mut(1);
    let unfinished = a0.try_run(&plans[0], &mut d0[0], 7).unwrap();
    let unfinished = unfinished.expect("rank 1 has not come: rank 0 cannot finish");
    assert_eq!(a1.try_run(&plans[1], &mut d1[0], 7).unwrap(), None);
    // A plan that does not fit where the run stopped is refused, and changes nothing.
    let barrier0 = arena::barrier(0, world, slot).unwrap();
    let bounds = bounds(Duration::from_secs(5));
    let mismatch = a0
        .resume(&barrier0, &mut [], &bounds, never.as_mut(), unfinished)
        .await;
    assert!(matches!(mismatch, Err(ArenaError::PlanMismatch { .. })));
    a0.resume(&plans[0], &mut d0[0], &bounds, never.as_mut(), unfinished)
        .await
        .unwrap();
    let expected: Vec<u8> = [3i32, 30].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(data, vec![expected.clone(), expected]);

    let barrier1 = arena::barrier(1, world, slot).unwrap();
    let bounds = Bounds {
        signature: 9,
        ..bounds
    };
    for _ in 0..3 {
        let unfinished = a0.try_run(&barrier0, &mut [], 9).unwrap().unwrap();
        assert_eq!(a1.try_run(&barrier1, &mut [], 9).unwrap(), None);
        a0.resume(&barrier0, &mut [], &bounds, never.as_mut(), unfinished)
            .await
            .unwrap();
    }
    // Rank 0 runs a barrier as 11, rank 1 as 12: rank 1 sees rank 0's signature at once.
    let _ = a0.try_run(&barrier0, &mut [], 11).unwrap().unwrap();
    let e = a1.try_run(&barrier1, &mut [], 12).unwrap_err();
    assert_eq!(
        e,
        ArenaError::Failed(ArenaFailure::Disagreement { rank: 0 })
    );
    // And every later run of rank 1 fails with the same, without a wait.
    assert_eq!(a1.try_run(&barrier1, &mut [], 12).unwrap_err(), e);
}

/// A plan that only signals (a barrier) runs on its own short path in `try_run`: where its
/// spin ends it stops exactly where the general step ([`Arena::advance`]) stops the same plan,
/// having published the same, and `resume` finishes it alike.
#[tokio::test]
async fn a_barrier_on_the_short_path_stops_where_the_general_step_stops() {
    let world = 2;
    let (mut short, mut general) = (arenas(world, 1 << 16).await, arenas(world, 1 << 16).await);
    let slot = short[0].slot_bytes();
    let plans: Vec<ArenaPlan> = (0..world)
        .map(|r| arena::barrier(r, world, slot).unwrap())
        .collect();
    assert!(plans.iter().all(ArenaPlan::signals_only));
    let by_short = short[0].try_run(&plans[0], &mut [], 5).unwrap();
    let by_short = by_short.expect("rank 1 has not come: rank 0 cannot finish");
    let mut at = At::START;
    let empty = Buffer {
        ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
        len: 0,
    };
    let blocked = general[0].advance(&plans[0], empty, &mut at, 5, Look::Spin);
    assert_eq!(blocked, Ok(Some(Blocked::Phase)));
    at.spun = true;
    assert_eq!(by_short.parts(), (at, Some((5, 0, 1))));
    let published = |a: &Arena| {
        let (tag, sig) = a.signature_words(0, 0);
        (
            a.counter_value(0),
            tag.load(Ordering::Relaxed),
            sig.load(Ordering::Relaxed),
            a.state.phase(),
        )
    };
    assert_eq!(published(&short[0]), published(&general[0]));
    assert_eq!(published(&short[0]), (arena::counter(1), 0, 5, 1));
    // Rank 1 comes (on the short path, in both pairs); rank 0 resumes.
    let bounds = Bounds {
        signature: 5,
        ..bounds(Duration::from_secs(5))
    };
    let never = never();
    tokio::pin!(never);
    for pair in [&mut short, &mut general] {
        assert_eq!(pair[1].try_run(&plans[1], &mut [], 5).unwrap(), None);
        pair[0]
            .resume(&plans[0], &mut [], &bounds, never.as_mut(), by_short)
            .await
            .unwrap();
        assert_eq!(pair[0].state.phase(), 1);
    }
}
