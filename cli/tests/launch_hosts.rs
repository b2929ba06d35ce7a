//! `tensorwire launch --nnodes 3` on simulated hosts (network namespaces joined by a bridge):
//! one launcher per host, 2 workers each. Without root or `ip`, prints `SKIPPED: <reason>`.

use std::io::Read;
use std::time::{Duration, Instant};

use tensorwire_tests::netns::Hosts;

const NODES: usize = 3;

/// Runs one launcher per host with `worker` as the workers' shell script; returns each
/// launcher's exit code, stdout and stderr, and how long the slowest took.
fn launch_everywhere(
    hosts: &Hosts,
    worker: &str,
) -> (Vec<(Option<i32>, String, String)>, Duration) {
    let start = Instant::now();
    let started: Vec<usize> = (0..NODES)
        .map(|node| {
            let mut cmd = hosts.command(node, env!("CARGO_BIN_EXE_tensorwire"));
            cmd.args(["launch", "--nnodes", "3", "--node-rank", &node.to_string()])
                .args(["--nproc-per-node", "2", "--master-addr", "10.77.0.1"])
                .args([
                    "--master-port",
                    "29400",
                    "--grace",
                    "1",
                    "--join-timeout",
                    "30",
                ])
                .args(["--", "sh", "-c", worker])
                .env("TENSORWIRE_SECRET", "launch-hosts-secret");
            hosts.spawn(&mut cmd)
        })
        .collect();
    let outputs = started
        .into_iter()
        .map(|index| {
            let (_, out, err) = hosts.take(index);
            let err = std::thread::spawn(move || {
                let mut s = String::new();
                err.unwrap().read_to_string(&mut s).unwrap();
                s
            });
            let mut stdout = String::new();
            out.unwrap().read_to_string(&mut stdout).unwrap();
            let stderr = err.join().unwrap();
            let code = hosts.with_child(index, |c| c.wait().unwrap().code());
            (code, stdout, stderr)
        })
        .collect();
    (outputs, start.elapsed())
}

fn hosts() -> Option<Hosts> {
    match Hosts::create(NODES, "node") {
        Ok(h) => Some(h),
        Err(why) => {
            println!("SKIPPED: cannot simulate hosts with network namespaces: {why}");
            None
        }
    }
}

#[test]
fn every_worker_on_every_node_gets_its_global_rank() {
    let Some(hosts) = hosts() else { return };
    let (outputs, _) = launch_everywhere(
        &hosts,
        "echo rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE lws=$LOCAL_WORLD_SIZE group=$GROUP_RANK nodes=$GROUP_WORLD_SIZE addr=$MASTER_ADDR port=$MASTER_PORT store=$TENSORWIRE_LAUNCHER_STORE secret=$TENSORWIRE_SECRET",
    );
    for (node, (code, out, err)) in outputs.iter().enumerate() {
        assert_eq!(*code, Some(0), "node {node}: {err}");
        let mut lines: Vec<&str> = out.lines().collect();
        lines.sort_unstable();
        let want: Vec<String> = (0..2)
            .map(|local| {
                let rank = node * 2 + local;
                format!("[rank {rank}] rank={rank} local={local} world=6 lws=2 group={node} nodes=3 addr=10.77.0.1 port=29400 store=1 secret=launch-hosts-secret")
            })
            .collect();
        assert_eq!(lines, want, "node {node}: {err}");
    }
}

#[test]
fn a_failing_worker_on_one_node_stops_every_node_naming_it() {
    let Some(hosts) = hosts() else { return };
    // Rank 3 (node 1) fails at once, perhaps before other nodes' launchers have even reached
    // the store: a launcher that comes later still finds the failure there. The others ignore
    // SIGTERM, so they are killed after the 1 s grace.
    let (outputs, took) = launch_everywhere(
        &hosts,
        "if [ $RANK = 3 ]; then exit 7; fi; trap '' TERM; exec sleep 60",
    );
    for (node, (code, _, err)) in outputs.iter().enumerate() {
        assert_eq!(*code, Some(7), "node {node}: {err}");
        assert!(
            err.contains("node 1: rank 3 exited with code 7"),
            "node {node}: {err}"
        );
        if node != 1 {
            assert!(
                err.contains(&format!("stopping the workers of node {node}")),
                "{err}"
            );
        }
    }
    // Well before the workers' 60 s: they were stopped (SIGKILL after the 1 s grace).
    assert!(took < Duration::from_secs(20), "took {took:?}");
}
