//! Distributed autograd across real OS processes (`tw-autograd-worker`, candle engine), three
//! workers rendezvousing through `env://` with rank 0 hosting the store. Rank 0 starts with
//! `MASTER_PORT=0` and says where its store listens; the others start with that port (no port
//! is reserved and released first).

use std::time::{Duration, Instant};
use tensorwire_tests::world::{World, WorldCommand};

fn spawn(scenario: &str, n: usize) -> World {
    spawn_with(scenario, n, &[])
}

/// [`spawn`] with more environment. A rank 0 that prints `SKIPPED` (no device for
/// `TW_DEVICES`) is the only process started.
fn spawn_with(scenario: &str, n: usize, extra_env: &[(&str, &str)]) -> World {
    let bin = tensorwire_tests::worker_bin(
        "tw-autograd-worker",
        env!("CARGO_BIN_EXE_tw-autograd-worker"),
    );
    World::start(
        WorldCommand {
            bin: &bin,
            scenario,
            n,
            env: extra_env,
        },
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Waits (on the output, no polling) for `rank` to print a line starting with `prefix`.
fn wait_for(world: &mut World, rank: usize, prefix: &str, limit: Duration) {
    if let Err(e) = world.wait_for(limit, |r, l| r == rank && l.starts_with(prefix)) {
        panic!("rank {rank} never printed {prefix:?}: {e}");
    }
}

fn assert_all_ok(scenario: &str) -> Vec<(usize, String)> {
    let (codes, lines) = spawn(scenario, 3).finish(Duration::from_secs(180));
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "{scenario}: exit codes {codes:?}\n{lines:#?}"
    );
    for rank in 0..3 {
        assert!(
            lines
                .iter()
                .any(|(r, l)| *r == rank && l.starts_with(&format!("OK {scenario} rank {rank}"))),
            "rank {rank} did not report OK: {lines:#?}"
        );
    }
    lines
}

/// Chain, longer chain, A→B→C→A (twice through w0), a diamond with a tensor sent twice and a
/// result used twice, RRef method calls: every worker's gradients equal one engine's.
#[test]
fn gradients_across_processes_equal_one_process() {
    let lines = assert_all_ok("gradients");
    for case in ["chain", "chain2", "cycle", "cycle2", "diamond", "rref"] {
        assert!(
            lines
                .iter()
                .any(|(r, l)| *r == 0 && l == &format!("OK case {case}")),
            "{case} not checked: {lines:#?}"
        );
    }
}

/// Flows ported from PyTorch's `dist_autograd_test.py` and `dist_optimizer_test.py`, across
/// processes: the usual model (the input needs no grad, the first stage returns a tensor that
/// does); a backward failing on a remote worker again and again, the context kept everywhere,
/// then a backward that succeeds (`test_multiple_backward_with_errors`); roots refused before
/// anything runs; `to_here` inside a context, tracked (`test_backward_rref*`), with the
/// distributed optimizer stepping the fetched parameter on its owner.
#[test]
fn pytorch_flows_across_processes() {
    let lines = assert_all_ok("pytorch");
    for case in [
        "standard-model",
        "backward-errors",
        "roots",
        "to-here-parameter",
        "to-here-list",
    ] {
        assert!(
            lines
                .iter()
                .any(|(r, l)| *r == 0 && l == &format!("OK case {case}")),
            "{case} not checked: {lines:#?}"
        );
    }
}

/// Two trainers run contexts through one worker at once.
#[test]
fn concurrent_contexts_across_processes() {
    let lines = assert_all_ok("concurrent");
    assert!(lines
        .iter()
        .any(|(r, l)| *r == 1 && l.starts_with("OK trained")));
}

/// A gradient from a worker outside the context is a violation: the receiver drops the
/// sender (as misbehaved, naming it) and keeps working with the others.
#[test]
fn a_violation_across_processes_drops_the_sender_not_the_receiver() {
    let lines = assert_all_ok("violation");
    assert_eq!(
        lines
            .iter()
            .filter(|(r, l)| *r == 2 && l.starts_with("OK refused"))
            .count(),
        1,
        "{lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|(r, l)| *r == 1 && l.starts_with("OK dropped w2") && l.contains("autograd")),
        "{lines:#?}"
    );
}

/// The relay-first race across processes: a guess of w1's context reaches w0 before the
/// context's first honest message there, which w2 relays; w0 asks w1, the pass goes through
/// with exact gradients, and nobody is dropped. (Before, w0 refused the relay's message.)
#[test]
fn a_relay_after_a_guess_goes_through_across_processes() {
    let (codes, lines) = spawn("relay", 4).finish(Duration::from_secs(180));
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "relay: exit codes {codes:?}\n{lines:#?}"
    );
    for rank in 0..4 {
        assert!(
            lines
                .iter()
                .any(|(r, l)| *r == rank && l.starts_with(&format!("OK relay rank {rank}"))),
            "rank {rank} did not report OK: {lines:#?}"
        );
    }
    assert!(
        lines
            .iter()
            .any(|(r, l)| *r == 1 && l.starts_with("OK relayed")),
        "{lines:#?}"
    );
}

/// w2 is SIGKILLed inside its part of the backward: w0's backward fails within its timeout
/// naming w2, and the survivors hold no context afterwards.
#[test]
fn a_worker_killed_mid_backward_fails_it_naming_the_worker() {
    let mut world = spawn("kill", 3);
    wait_for(&mut world, 2, "IN_BACKWARD", Duration::from_secs(90));
    let t0 = Instant::now();
    world.kill(2);
    let (codes, lines) = world.finish(Duration::from_secs(120));
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(&codes[..2], &[Some(0), Some(0)], "{lines:#?}");
    let err = lines
        .iter()
        .find(|(r, l)| *r == 0 && l.starts_with("OK backward-error"))
        .unwrap_or_else(|| panic!("{lines:#?}"));
    assert!(err.1.contains("w2"), "{}", err.1);
    assert!(
        lines
            .iter()
            .any(|(r, l)| *r == 0 && l == "OK context-counts w0=0 w1=0"),
        "{lines:#?}"
    );
}

/// w2 opened a context (its forward went w2→w1→w0 and back) and took part in one of w0's, and
/// no backward runs, when it is SIGKILLed: the survivors drop both contexts on their own, within
/// a bound (PyTorch keeps them, pytorch#26379), and keep w0's context through w1 only, which
/// still trains and releases.
#[test]
fn a_worker_killed_with_contexts_open_leaves_none_of_them_on_the_survivors() {
    let mut world = spawn("lost", 3);
    wait_for(&mut world, 0, "CONTEXTS_OPEN", Duration::from_secs(90));
    let t0 = Instant::now();
    world.kill(2);
    wait_for(
        &mut world,
        0,
        "OK lost-counts w0=1 w1=1",
        Duration::from_secs(60),
    );
    let dropped_after = t0.elapsed();
    let (codes, lines) = world.finish(Duration::from_secs(120));
    assert!(
        dropped_after < Duration::from_secs(20),
        "the survivors dropped w2's contexts only after {dropped_after:?}: {lines:#?}"
    );
    assert_eq!(&codes[..2], &[Some(0), Some(0)], "{lines:#?}");
    assert!(
        lines
            .iter()
            .any(|(r, l)| *r == 0 && l == "OK lost-released"),
        "{lines:#?}"
    );
}

/// Device maps in the backward pass, across processes on simulated devices: the forward's
/// tensors land on w1's and w2's devices, each gradient is put where its tensor landed and goes
/// back by the reverse of the forward's map (nothing reaches w0 on a device), and every
/// worker's gradients equal one engine's, for a chain and A→B→C→A.
#[test]
fn gradients_go_back_by_the_reverse_device_maps_across_processes() {
    let lines = assert_all_ok("devices");
    for case in ["chain2", "cycle"] {
        assert!(
            lines
                .iter()
                .any(|(r, l)| *r == 0 && l == &format!("OK case {case}")),
            "{case} not checked: {lines:#?}"
        );
    }
}

/// The same on real CUDA devices (`TW_DEVICES=cuda`) where a GPU is usable; elsewhere rank 0
/// says why it skips (`SKIPPED: ...`) and exits 0.
#[test]
fn gradients_go_back_by_the_reverse_device_maps_across_processes_on_cuda() {
    let (codes, lines) =
        spawn_with("devices", 3, &[("TW_DEVICES", "cuda")]).finish(Duration::from_secs(180));
    if let Some((_, skipped)) = lines
        .iter()
        .find(|(r, l)| *r == 0 && l.starts_with("SKIPPED"))
    {
        println!("devices on cuda: {skipped}");
        assert_eq!(codes, [Some(0)], "{lines:#?}");
        return;
    }
    assert!(
        codes.iter().all(|c| *c == Some(0)),
        "exit codes {codes:?}\n{lines:#?}"
    );
    for case in ["chain2", "cycle"] {
        assert!(
            lines
                .iter()
                .any(|(r, l)| *r == 0 && l == &format!("OK case {case}")),
            "{case} not checked: {lines:#?}"
        );
    }
}
