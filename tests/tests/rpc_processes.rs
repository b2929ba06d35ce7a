//! The RPC agent across real OS processes (`tw-rpc-worker`), rendezvous through `env://` with
//! rank 0 hosting the store, every connection authenticated with a cluster secret.
//!
//! Every test runs twice, once per device backend: `NAME::simulated` (two simulated CUDA
//! devices per worker) and `NAME::cuda` (the real CUDA backend). Without a GPU the `cuda`
//! variants print `SKIPPED: <reason>` (the workers' reason) and pass.

use std::time::{Duration, Instant};
use tensorwire_tests::world::{World, WorldCommand};

fn spawn(scenario: &str, n: usize, devices: &str) -> World {
    spawn_with(scenario, n, devices, &[])
}

/// Starts `n` workers of `scenario` with `TW_DEVICES=devices` and `extra_env` (see
/// [`World::start`]: rank 0 says where its store listens, then the others start).
fn spawn_with(scenario: &str, n: usize, devices: &str, extra_env: &[(&str, &str)]) -> World {
    let bin = worker();
    let mut env = vec![("TW_DEVICES", devices)];
    env.extend_from_slice(extra_env);
    World::start(
        WorldCommand {
            bin: &bin,
            scenario,
            n,
            env: &env,
        },
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The `tw-rpc-worker` binary.
fn worker() -> std::path::PathBuf {
    tensorwire_tests::worker_bin("tw-rpc-worker", env!("CARGO_BIN_EXE_tw-rpc-worker"))
}

/// Starts `n` workers of `scenario` on simulated devices.
fn start_world(scenario: &str, n: usize, limit: Duration) -> Result<World, String> {
    let bin = worker();
    World::start(
        WorldCommand {
            bin: &bin,
            scenario,
            n,
            env: &[("TW_DEVICES", "simulated")],
        },
        limit,
    )
}

/// Whether the workers skipped (no device for their backend); prints their reason where the
/// test runner shows it.
fn skipped(scenario: &str, lines: &[(usize, String)]) -> bool {
    use std::io::Write;
    let Some((_, why)) = lines.iter().find(|(_, l)| l.starts_with("SKIPPED")) else {
        return false;
    };
    // Written to the stream directly: libtest captures `println!` of passing tests.
    let _ = writeln!(std::io::stdout().lock(), "{scenario}: {why}");
    true
}

/// Runs `scenario` on `n` workers and checks that each exits 0 having printed
/// `OK <scenario> rank R`; `None` when they skipped.
fn assert_all_ok(scenario: &str, n: usize, devices: &str) -> Option<Vec<(usize, String)>> {
    let (codes, lines) = spawn(scenario, n, devices).finish(Duration::from_secs(120));
    if skipped(scenario, &lines) {
        return None;
    }
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "{scenario} x{n}: exit codes {codes:?}\n{lines:#?}"
    );
    for rank in 0..n {
        assert!(
            lines
                .iter()
                .any(|(r, l)| *r == rank && l.starts_with(&format!("OK {scenario} rank {rank}"))),
            "rank {rank} did not report OK: {lines:#?}"
        );
    }
    Some(lines)
}

/// Defines each test as a module with one test per device backend.
macro_rules! on_both_backends {
    ($($(#[doc = $doc:literal])* fn $name:ident($devices:ident) $body:block)*) => {$(
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn run($devices: &str) $body

            #[test]
            fn simulated() {
                run("simulated")
            }

            #[test]
            fn cuda() {
                run("cuda")
            }
        }
    )*};
}

on_both_backends! {
fn calls_rrefs_tensors_and_shutdown_across_2_and_4_processes(devices) {
    assert_all_ok("basic", 2, devices);
    assert_all_ok("basic", 4, devices);
}

fn dynamic_groups_across_processes(devices) {
    let Some(lines) = assert_all_ok("dynamic", 3, devices) else {
        return;
    };
    assert_eq!(
        lines
            .iter()
            .filter(|(_, l)| l.starts_with("OK dynamic-joined"))
            .count(),
        3,
        "{lines:#?}"
    );
}

fn the_quic_backend_across_processes(devices) {
    // A folder of its own: the variants of this test may run at once in one process.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tls");
    let dir_s = dir.to_string_lossy().into_owned();
    let (codes, lines) =
        spawn_with("quic", 3, devices, &[("TW_TLS_DIR", &dir_s)]).finish(Duration::from_secs(120));
    if skipped("quic", &lines) {
        return;
    }
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "exit codes {codes:?}\n{lines:#?}"
    );
    for rank in 0..3 {
        assert!(
            lines
                .iter()
                .any(|(r, l)| *r == rank && l == &format!("OK quic rank {rank}")),
            "{lines:#?}"
        );
    }
    assert!(
        dir.join("ca.pem").exists(),
        "the workers shared one cluster CA"
    );
}

fn graceful_shutdown_waits_for_calls_in_flight(devices) {
    assert_all_ok("inflight", 2, devices);
}

fn thirty_two_workers_start_and_stop(devices) {
    let t0 = Instant::now();
    let Some(lines) = assert_all_ok("scale", 32, devices) else {
        return;
    };
    let max = |key: &str| {
        lines
            .iter()
            .filter_map(|(_, l)| {
                l.split(key)
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .max()
            .unwrap()
    };
    println!(
        "32 workers: slowest init_rpc {} ms, slowest graceful shutdown {} ms, whole run {} ms",
        max("init_ms="),
        max("shutdown_ms="),
        t0.elapsed().as_millis()
    );
}

fn a_bad_device_map_fails_init_on_every_worker(devices) {
    let (codes, lines) = spawn("bad-map", 2, devices).finish(Duration::from_secs(60));
    if skipped("bad-map", &lines) {
        return;
    }
    assert_eq!(codes, vec![Some(0), Some(0)], "{lines:#?}");
    for rank in 0..2 {
        assert!(
            lines.iter().any(|(r, l)| *r == rank
                && l.contains("OK init-error")
                && l.contains(
                    "Node w0 has target devices with invalid indices in its device map for w1"
                )),
            "{lines:#?}"
        );
    }
}

fn a_killed_worker_is_named_by_the_others_within_the_timeout(devices) {
    let n = 3;
    let mut world = spawn("dead-peer", n, devices);
    if world.skipped().is_some() {
        let (_, lines) = world.finish(Duration::from_secs(60));
        assert!(skipped("dead-peer", &lines));
        return;
    }
    for _ in 0..n {
        world
            .wait_for(Duration::from_secs(60), |_, l| l.starts_with("READY"))
            .unwrap_or_else(|e| panic!("not all ready: {e}"));
    }
    world.kill(n - 1);
    let t0 = Instant::now();
    let (codes, lines) = world.finish(Duration::from_secs(60));
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(&codes[..n - 1], &[Some(0), Some(0)], "{lines:#?}");
    for rank in 0..n - 1 {
        let call = lines
            .iter()
            .find(|(r, l)| *r == rank && l.starts_with("OK call-error"))
            .unwrap_or_else(|| panic!("{lines:#?}"));
        assert!(
            call.1.contains("w2"),
            "the call error names the dead worker: {}",
            call.1
        );
        let shut = lines
            .iter()
            .find(|(r, l)| *r == rank && l.starts_with("OK shutdown-error"))
            .unwrap_or_else(|| panic!("{lines:#?}"));
        assert!(
            shut.1.contains("waiting for rank 2 (w2)"),
            "the shutdown error names the dead worker: {}",
            shut.1
        );
    }
}

fn a_worker_calls_itself_with_a_device_map(devices) {
    assert_all_ok("self-rpc", 1, devices);
}

fn device_tensors_move_by_device_maps_between_processes(devices) {
    assert_all_ok("device-tensors", 3, devices);
}
}

/// One world of three processes: init, immediate shutdown, exit.
fn init_then_shutdown_once() -> Result<(), String> {
    let limit = Duration::from_secs(60);
    let mut world = start_world("init-shutdown", 3, limit)?;
    let codes = world.exits(&[0, 1, 2], limit)?;
    if codes.iter().any(|c| *c != Some(0)) {
        return Err(format!("exit codes {codes:?}: {:#?}", world.seen()));
    }
    for rank in 0..3 {
        let ok = format!("OK init-shutdown rank {rank}");
        if !world.seen().iter().any(|(r, l)| *r == rank && *l == ok) {
            return Err(format!(
                "rank {rank} did not report OK: {:#?}",
                world.seen()
            ));
        }
    }
    Ok(())
}

/// Runs `once` in `worlds` worlds, `at_once` at a time; fails naming how many failed and the
/// first failure. For races: a 1-in-3 race fails 50 runs with certainty (1 - (2/3)^50).
fn in_worlds(worlds: usize, at_once: usize, once: fn() -> Result<(), String>) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..at_once {
            s.spawn(|| {
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < worlds {
                    if let Err(e) = once() {
                        failures.lock().unwrap().push(e);
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {worlds} worlds failed; the first: {}",
        failures.len(),
        failures[0]
    );
}

/// Rank 0 hosts the store and may exit the moment its `init_rpc` returns: no other rank may
/// still need the store for init then (a final barrier through the store failed one world
/// in about 20 with "Connection reset by peer").
#[test]
fn init_then_immediate_shutdown_in_100_worlds_of_3_processes() {
    in_worlds(100, 4, init_then_shutdown_once);
}

/// One world of three processes running the `chains` scenario: every hop of every chain ran.
fn chains_once() -> Result<(), String> {
    let limit = Duration::from_secs(60);
    let mut world = start_world("chains", 3, limit)?;
    let codes = world.exits(&[0, 1, 2], limit)?;
    if codes.iter().any(|c| *c != Some(0)) {
        return Err(format!("exit codes {codes:?}: {:#?}", world.seen()));
    }
    let hops: usize = world
        .seen()
        .iter()
        .filter_map(|(_, l)| l.strip_prefix("HOPS "))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok())
        .sum();
    if hops != 60 {
        return Err(format!("{hops} of 60 hops ran: {:#?}", world.seen()));
    }
    Ok(())
}

/// Every worker starts a 20-hop chain of fire-and-forget `rpc_async` calls and shuts down
/// gracefully at once: all 60 hops run (PyTorch's shutdown waits until no call is in flight
/// anywhere). Before the shutdown became a termination detection, 21 to 48 of the 60 ran and
/// the rest failed "callee shutting down".
#[test]
fn graceful_shutdown_lets_fire_and_forget_chains_finish_in_50_worlds_of_3_processes() {
    in_worlds(50, 3, chains_once);
}

/// `remote()` and at once a call with that reference to its owner, whose function reads it
/// with `local_value()`: the owner waits for the value being created (it failed about one run
/// in three with "the value is gone"). 200 in a row.
#[test]
fn the_owner_reads_a_value_still_being_created_200_times() {
    let limit = Duration::from_secs(120);
    let mut world = start_world("owner-local", 2, limit).unwrap();
    let codes = world.exits(&[0, 1], limit).unwrap();
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "exit codes {codes:?}: {:#?}",
        world.seen()
    );
    assert!(
        world
            .seen()
            .iter()
            .any(|(r, l)| *r == 0 && l == "OK owner-local rank 0 repeat=200"),
        "{:#?}",
        world.seen()
    );
}

/// A graceful shutdown with a frozen peer (SIGSTOP) ends by its timeout, naming the peer, on
/// every other worker: rank 0 included, whose wait for the others to leave its store shares
/// the one deadline.
#[test]
fn a_graceful_shutdown_with_a_frozen_peer_ends_by_its_timeout_naming_it() {
    const TIMEOUT: Duration = Duration::from_secs(2);
    const MARGIN: Duration = Duration::from_millis(1000);
    let limit = Duration::from_secs(60);
    let mut world = start_world("frozen-peer", 3, limit).unwrap();
    while world
        .seen()
        .iter()
        .filter(|(_, l)| l.starts_with("READY"))
        .count()
        < 3
    {
        world
            .wait_for(limit, |_, l| l.starts_with("READY"))
            .unwrap();
    }
    let frozen = world.child(2).unwrap().id() as libc::pid_t;
    // SAFETY: a child of ours, running (it printed READY and waits on its stdin).
    assert_eq!(unsafe { libc::kill(frozen, libc::SIGSTOP) }, 0);
    let mut status = 0;
    // SAFETY: as above; WUNTRACED returns once it has stopped, without reaping it.
    let stopped = unsafe { libc::waitpid(frozen, &mut status, libc::WUNTRACED) };
    assert!(stopped == frozen && libc::WIFSTOPPED(status), "{status:#x}");
    let t0 = Instant::now();
    for rank in 0..2 {
        use std::io::Write;
        let child = world.child(rank).unwrap();
        let stdin = child.stdin.as_mut().unwrap();
        stdin.write_all(b"GO\n").unwrap();
        stdin.flush().unwrap();
    }
    let codes = world.exits(&[0, 1], limit).unwrap();
    let took = t0.elapsed();
    // SAFETY: stopped, not reaped.
    unsafe { libc::kill(frozen, libc::SIGCONT) };
    world.kill(2); // resumed above, killed and reaped
    assert_eq!(codes, vec![Some(0), Some(0)], "{:#?}", world.seen());
    for rank in 0..2 {
        let line = world
            .seen()
            .iter()
            .find(|(r, l)| *r == rank && l.starts_with("OK shutdown-error"))
            .map(|(_, l)| l.clone())
            .unwrap_or_else(|| panic!("{:#?}", world.seen()));
        let after_ms: u64 = line
            .split("after_ms=")
            .nth(1)
            .and_then(|r| r.split(':').next())
            .and_then(|ms| ms.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        assert!(
            Duration::from_millis(after_ms) <= TIMEOUT + MARGIN,
            "rank {rank}'s shutdown took {after_ms} ms with a timeout of {TIMEOUT:?}: {line}"
        );
        assert!(
            line.contains("rank 2 (w2)"),
            "names the frozen worker: {line}"
        );
        println!("{line}");
    }
    assert!(
        took <= TIMEOUT + 2 * MARGIN,
        "the workers exited {took:?} after GO"
    );
}

/// The log filter that makes workers print the transport chosen for each peer.
const SELECT_LOG: (&str, &str) = ("TW_LOG", "tensorwire_transport_shm::select=info");

/// The transports named by the workers' "connected to a peer" and "accepted a peer" lines.
fn chosen_transports(lines: &[(usize, String)]) -> Vec<String> {
    lines
        .iter()
        .filter(|(_, l)| l.contains("connected to a peer") || l.contains("accepted a peer"))
        .filter_map(|(_, l)| {
            let rest = &l[l.find("transport=")? + "transport=".len()..];
            Some(rest.split_whitespace().next()?.trim_matches('"').to_owned())
        })
        .collect()
}

/// The transports the agents report per peer (`Agent::connections`, printed by the worker's
/// `basic` scenario as `PEER-TRANSPORT rank peer transport`).
fn reported_transports(lines: &[(usize, String)]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|(_, l)| l.strip_prefix("PEER-TRANSPORT "))
        .filter_map(|rest| Some(rest.split_whitespace().nth(2)?.to_owned()))
        .collect()
}

/// Runs `scenario` on `n` simulated workers with `env` and transport logging; every worker must
/// succeed. Returns the transports chosen: as logged, and in the `basic` scenario also as each
/// agent reports them per peer (which must agree with the log).
fn transports_of(scenario: &str, n: usize, env: &[(&str, &str)]) -> Vec<String> {
    let mut env = env.to_vec();
    env.push(SELECT_LOG);
    let (codes, lines) =
        spawn_with(scenario, n, "simulated", &env).finish(Duration::from_secs(120));
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "{scenario} x{n} {env:?}: exit codes {codes:?}\n{lines:#?}"
    );
    let mut chosen = chosen_transports(&lines);
    assert!(!chosen.is_empty(), "no transport was logged: {lines:#?}");
    if scenario == "basic" {
        let reported = reported_transports(&lines);
        assert_eq!(
            reported.len(),
            n * (n - 1),
            "every agent reports a transport for every peer: {lines:#?}"
        );
        let mut logged = chosen.clone();
        logged.sort();
        let mut sorted = reported.clone();
        sorted.sort();
        logged.dedup();
        sorted.dedup();
        assert_eq!(logged, sorted, "the agents report what was logged");
        chosen.extend(reported);
    }
    chosen
}

/// Workers on one host reach each other over shared memory, agent and process group alike,
/// and say so in their logs and in `Agent::connections` (per peer).
#[test]
fn workers_on_one_host_pick_shared_memory() {
    for scenario in ["basic", "pg"] {
        let chosen = transports_of(scenario, 3, &[]);
        assert!(chosen.iter().all(|t| t == "shm"), "{scenario}: {chosen:?}");
    }
}

/// `TENSORWIRE_TRANSPORT=tcp` forces TCP between workers of one host; `shm` forces shared
/// memory.
#[test]
fn tensorwire_transport_overrides_the_choice() {
    for scenario in ["basic", "pg"] {
        let chosen = transports_of(scenario, 3, &[("TENSORWIRE_TRANSPORT", "tcp")]);
        assert!(chosen.iter().all(|t| t == "tcp"), "{scenario}: {chosen:?}");
        let chosen = transports_of(scenario, 3, &[("TENSORWIRE_TRANSPORT", "shm")]);
        assert!(chosen.iter().all(|t| t == "shm"), "{scenario}: {chosen:?}");
    }
}

/// A value of `TENSORWIRE_TRANSPORT` that names no transport fails init with an error naming the
/// variable and the value.
#[test]
fn a_bad_tensorwire_transport_fails_init_naming_it() {
    let (codes, lines) = spawn_with(
        "basic",
        2,
        "simulated",
        &[("TENSORWIRE_TRANSPORT", "carrier-pigeon")],
    )
    .finish(Duration::from_secs(120));
    assert!(codes.iter().all(|c| *c != Some(0)), "{codes:?}\n{lines:#?}");
    assert!(
        lines.iter().any(|(r, l)| *r == 0
            && l.contains("TENSORWIRE_TRANSPORT")
            && l.contains("carrier-pigeon")),
        "{lines:#?}"
    );
}
