//! Process groups of real OS processes: `tw-pg-worker` started N times with `env://`
//! variables, as a [`World`]; rank 0 embeds the store server on a free port and tells us which
//! (`PORT <port>`). Nothing here sleeps to wait: lines and exits are waited for with deadlines.

use std::path::Path;
use std::time::{Duration, Instant};

use tensorwire_tests::world::{World, WorldCommand};

const WORKER: &str = env!("CARGO_BIN_EXE_tw-pg-worker");

/// Starts `scenario` on `world` processes with `env` added.
fn launch(world: usize, scenario: &str, env: &[(&str, String)]) -> World {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    World::start(
        WorldCommand {
            bin: Path::new(WORKER),
            scenario,
            n: world,
            env: &env,
        },
        Duration::from_secs(20),
    )
    .unwrap_or_else(|e| panic!("world of {world} for {scenario}: {e}"))
}

/// The lines `rank` printed (stdout and stderr), in order.
fn lines_of(seen: &[(usize, String)], rank: usize) -> Vec<&str> {
    seen.iter()
        .filter(|(r, _)| *r == rank)
        .map(|(_, l)| l.as_str())
        .collect()
}

/// Waits for every rank's `READY rank R`.
fn wait_ready(cluster: &mut World, world: usize) {
    for _ in 0..world {
        cluster
            .wait_for(Duration::from_secs(20), |_, l| l.starts_with("READY rank "))
            .unwrap_or_else(|e| panic!("not every rank got ready: {e}"));
    }
}

fn run_check(world: usize, bound: Duration) {
    run_scenario(world, "check", &[], bound);
}

/// Runs `scenario` on `world` processes; every rank must exit 0 and print `OK <what> rank R`.
fn run_scenario(world: usize, scenario: &str, env: &[(&str, String)], bound: Duration) {
    let (codes, seen) = launch(world, scenario, env).finish(bound);
    for (rank, code) in codes.iter().enumerate() {
        let lines = lines_of(&seen, rank);
        assert_eq!(
            *code,
            Some(0),
            "world {world}: rank {rank} failed; its output: {lines:#?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("OK ") && l.contains(&format!("rank {rank} "))),
            "world {world}: rank {rank} printed {lines:#?}"
        );
    }
}

#[test]
fn worlds_of_2_4_and_8_processes_compute_the_right_results() {
    for world in [2, 4, 8] {
        run_check(world, Duration::from_secs(30));
    }
}

#[test]
fn a_world_of_32_processes_computes_the_right_results() {
    run_check(32, Duration::from_secs(45));
}

/// Issue 20, defect 1: 1,000 all_gathers in flight, issued in the same order on every rank,
/// each returns its own blocks; with 1-element blocks (one round each), 64-element blocks
/// (two rounds each) and 100,000-element blocks (two rounds, 400 KB per rank: 20 in flight,
/// which keeps memory and time small and still has many second rounds racing).
#[test]
fn a_thousand_all_gathers_in_flight_return_their_own_blocks() {
    for (elems, inflight) in [(1usize, 1000usize), (64, 1000), (100_000, 20)] {
        let env = [
            ("TW_ELEMS", elems.to_string()),
            ("TW_INFLIGHT", inflight.to_string()),
        ];
        run_scenario(4, "inflight", &env, Duration::from_secs(30));
    }
}

#[test]
fn killing_a_rank_makes_the_others_fail_naming_it() {
    let world = 4;
    let victim = 2;
    let timeout = Duration::from_secs(20);
    let env = [
        ("TW_VICTIM", victim.to_string()),
        ("TW_TIMEOUT_MS", timeout.as_millis().to_string()),
    ];
    let mut cluster = launch(world, "kill", &env);
    // Everyone is set up and past the first barrier.
    wait_ready(&mut cluster, world);
    let killed_at = Instant::now();
    cluster.kill(victim);
    let others: Vec<usize> = (0..world).filter(|&r| r != victim).collect();
    let codes = cluster
        .exits(&others, timeout + Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("a rank hung after the kill: {e}"));
    for (&rank, code) in others.iter().zip(codes) {
        let lines = lines_of(cluster.seen(), rank);
        assert_eq!(code, Some(3), "rank {rank}: {lines:#?}");
        assert!(
            lines
                .iter()
                .any(|l| l.contains(&format!("rank {victim} died"))),
            "rank {rank} does not name rank {victim}: {lines:#?}"
        );
    }
    // Detected from the closed connections, well before the collective timeout.
    assert!(
        killed_at.elapsed() < timeout,
        "the others took {:?} to notice",
        killed_at.elapsed()
    );
}

/// Two processes form an `nccl` group (rank r on `cuda:r`). With two GPUs and NCCL they run
/// every collective; without (this project's CI), `new_group` fails on both ranks at once,
/// each naming every rank that cannot join and why.
#[cfg(feature = "nccl")]
#[test]
fn an_nccl_group_of_two_processes_runs_or_fails_at_setup_naming_the_reason() {
    use tensorwire_core::device::Device;
    use tensorwire_devices_cuda::nccl_group::{local_readiness, shared_devices};

    let bound = Duration::from_secs(60);
    let started = Instant::now();
    let (codes, seen) = launch(2, "nccl", &[("TW_TIMEOUT_MS", "30000".into())]).finish(bound);
    let readiness: Vec<Result<(), String>> = (0..2u8)
        .map(|d| local_readiness(shared_devices(), Device::Cuda(d)))
        .collect();
    for (rank, code) in codes.into_iter().enumerate() {
        let lines = lines_of(&seen, rank);
        if readiness.iter().all(Result::is_ok) {
            assert_eq!(code, Some(0), "rank {rank}: {lines:#?}");
            assert!(
                lines
                    .iter()
                    .any(|l| l.starts_with(&format!("OK nccl rank {rank} "))),
                "{lines:?}"
            );
            continue;
        }
        assert_eq!(code, Some(4), "rank {rank}: {lines:#?}");
        let line = lines
            .iter()
            .find(|l| l.starts_with("SETUP-ERROR"))
            .unwrap_or_else(|| panic!("rank {rank}: {lines:#?}"));
        for (other, why) in readiness.iter().enumerate() {
            if let Err(why) = why {
                assert!(
                    line.contains(&format!("rank {other} cannot join: {why}")),
                    "rank {rank} does not name rank {other}'s reason: {line}"
                );
            }
        }
        if rank == 0 {
            use std::io::Write;
            let _ = writeln!(
                std::io::stdout().lock(),
                "SKIPPED the collectives (no two usable GPUs with NCCL here): {line}"
            );
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "setup failed at once, not at the 30 s timeout"
    );
}

/// Issue 20, items 3 and 4: every type with gloo's ops, and reduce, reduce_scatter, gather,
/// scatter, all_to_all(_single), send/recv, isend/irecv and monitored_barrier, against known
/// values, at world sizes 2, 3 and 4.
#[test]
fn every_operation_and_type_at_worlds_of_2_3_and_4() {
    for world in [2, 3, 4] {
        run_scenario(world, "ops", &[], Duration::from_secs(30));
    }
}

/// Runs the `monitored` scenario with ranks `absent` staying away; returns rank 0's output
/// once it has exited with 3.
fn monitored_barrier_failure(world: usize, absent: &str, wait_all: bool) -> String {
    let env = [
        ("TW_ABSENT", absent.to_owned()),
        ("TW_WAIT_ALL", if wait_all { "1" } else { "0" }.to_owned()),
        ("TW_MB_MS", "3000".to_owned()),
    ];
    let mut cluster = launch(world, "monitored", &env);
    wait_ready(&mut cluster, world);
    let codes = cluster
        .exits(&[0], Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("rank 0 did not report within its timeout: {e}"));
    // The others (absent, or waiting for rank 0's answer) are ended when the world drops.
    let output = lines_of(cluster.seen(), 0).join("\n");
    assert_eq!(codes, [Some(3)], "rank 0: {output}");
    output
}

#[test]
fn a_monitored_barrier_names_every_rank_that_did_not_arrive() {
    let output = monitored_barrier_failure(4, "1,3", true);
    assert!(
        output.contains("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 3s"),
        "{output}"
    );
}

#[test]
fn a_monitored_barrier_without_wait_all_ranks_names_the_first() {
    let output = monitored_barrier_failure(4, "2,3", false);
    assert!(
        output.contains("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 3s"),
        "{output}"
    );
}

#[test]
fn subgroups_and_split_groups_run_beside_the_world_group_in_4_processes() {
    run_scenario(4, "groups", &[], Duration::from_secs(60));
}

#[test]
fn work_handles_progress_unpolled_complete_out_of_order_and_time_out_naming_the_rank() {
    // On both paths: the group arena (the default on one host) and the links.
    for path in ["arena", "links"] {
        run_scenario(
            4,
            "work",
            &[("TENSORWIRE_COLLECTIVES", path.into())],
            Duration::from_secs(60),
        );
    }
}
