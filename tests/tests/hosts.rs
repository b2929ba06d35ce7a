//! Workers on simulated hosts: 3 network namespaces joined by a bridge (`tensorwire_tests::netns`),
//! 2 worker processes (`tw-rpc-worker`) on each, rank 0 on host 0 (`10.77.0.1`) hosting the store.
//!
//! Every namespace is new, so the store's port is fixed (nothing else listens there). Without
//! root or `ip` (iproute2), each test prints `SKIPPED: <reason>` and passes.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tensorwire_tests::netns::Hosts;

const HOSTS: usize = 3;
const PER_HOST: usize = 2;
const WORLD: usize = HOSTS * PER_HOST;
const PORT: &str = "29500";

fn hosts() -> Option<Hosts> {
    match Hosts::create(HOSTS, "node") {
        Ok(h) => Some(h),
        Err(why) => {
            println!("SKIPPED: cannot simulate hosts with network namespaces: {why}");
            None
        }
    }
}

/// Worker processes on the hosts, their output lines (rank, line) and their stdins.
struct Workers<'h> {
    hosts: &'h Hosts,
    children: Vec<usize>,
    stdins: Vec<Option<std::process::ChildStdin>>,
    lines: mpsc::Receiver<(usize, String)>,
    seen: Vec<(usize, String)>,
}

/// Starts `WORLD` workers running `scenario`, rank `r` on host `r / PER_HOST`, with the usual
/// rendezvous variables plus `env(rank)`; with `slurm`, only Slurm's variables.
fn start<'h>(
    hosts: &'h Hosts,
    scenario: &str,
    slurm: bool,
    env: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Workers<'h> {
    let (tx, lines) = mpsc::channel();
    let mut children = Vec::new();
    let mut stdins = Vec::new();
    for rank in 0..WORLD {
        let mut cmd = hosts.command(rank / PER_HOST, env!("CARGO_BIN_EXE_tw-rpc-worker"));
        cmd.arg(scenario)
            .env("TENSORWIRE_SECRET", format!("hosts-{}", hosts.prefix()))
            .env_remove("TENSORWIRE_IFNAME");
        if slurm {
            cmd.env("SLURM_PROCID", rank.to_string())
                .env("SLURM_NTASKS", WORLD.to_string())
                .env("SLURM_LOCALID", (rank % PER_HOST).to_string())
                .env("SLURM_JOB_NODELIST", format!("node[1-{HOSTS}]"))
                .env("SLURM_JOB_ID", "4242");
            for v in [
                "RANK",
                "WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "LOCAL_RANK",
            ] {
                cmd.env_remove(v);
            }
        } else {
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", WORLD.to_string())
                .env("MASTER_ADDR", Hosts::ip_of(0).to_string())
                .env("MASTER_PORT", PORT);
        }
        cmd.envs(env(rank));
        let index = hosts.spawn(&mut cmd);
        let (stdin, stdout, stderr) = hosts.take(index);
        for stream in [
            Box::new(stdout.unwrap()) as Box<dyn Read + Send>,
            Box::new(stderr.unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send((rank, line));
                }
            });
        }
        children.push(index);
        stdins.push(stdin);
    }
    Workers {
        hosts,
        children,
        stdins,
        lines,
        seen: Vec::new(),
    }
}

impl Workers<'_> {
    /// Reads output until `done(seen)` holds; panics with everything seen after `limit`.
    fn until(&mut self, limit: Duration, done: impl Fn(&[(usize, String)]) -> bool) {
        let deadline = Instant::now() + limit;
        while !done(&self.seen) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(e) => panic!("{e:?} while waiting; output so far: {:#?}", self.seen),
            }
        }
    }

    /// Waits until every worker has exited (all output read), bounded by `limit`, and returns
    /// the exit codes.
    fn finish(&mut self, limit: Duration) -> Vec<Option<i32>> {
        self.stdins.clear();
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(e) => panic!("{e:?}: workers still running; output: {:#?}", self.seen),
            }
        }
        self.children
            .iter()
            .map(|&i| self.hosts.with_child(i, |c| c.wait().unwrap().code()))
            .collect()
    }

    fn lines_with(&self, needle: &str) -> Vec<&(usize, String)> {
        self.seen
            .iter()
            .filter(|(_, l)| l.contains(needle))
            .collect()
    }
}

fn init_ms(line: &str) -> u64 {
    line.split("init_ms=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn static_rpc_group_across_three_hosts() {
    let Some(hosts) = hosts() else { return };
    let mut w = start(&hosts, "basic", false, |_| Vec::new());
    let codes = w.finish(Duration::from_secs(60));
    assert_eq!(codes, vec![Some(0); WORLD], "{:#?}", w.seen);
    // Init time, 3 hosts x 2 workers (from start of init_rpc to its return, per worker).
    let mut w = start(&hosts, "scale", false, |_| Vec::new());
    let codes = w.finish(Duration::from_secs(60));
    assert_eq!(codes, vec![Some(0); WORLD], "{:#?}", w.seen);
    let times: Vec<u64> = w
        .lines_with("OK scale")
        .iter()
        .map(|(_, l)| init_ms(l))
        .collect();
    assert_eq!(times.len(), WORLD, "{:#?}", w.seen);
    println!(
        "init_rpc across {HOSTS} hosts x {PER_HOST} workers: max {} ms, min {} ms",
        times.iter().max().unwrap(),
        times.iter().min().unwrap()
    );
}

#[test]
fn process_group_and_store_across_three_hosts() {
    let Some(hosts) = hosts() else { return };
    // Odd ranks name their interface; even ones find it by the route to MASTER_ADDR.
    let mut w = start(&hosts, "pg", false, |rank| {
        let mut env = vec![
            ("TW_PER_HOST", PER_HOST.to_string()),
            (
                "TW_LOG",
                "tensorwire_transport_shm::select=info".to_string(),
            ),
        ];
        if rank % 2 == 1 {
            env.push(("TENSORWIRE_IFNAME", "eth0".to_string()));
        }
        env
    });
    let codes = w.finish(Duration::from_secs(60));
    assert_eq!(codes, vec![Some(0); WORLD], "{:#?}", w.seen);
    let oks = w.lines_with("OK pg");
    assert_eq!(oks.len(), WORLD, "{:#?}", w.seen);
    let max = oks.iter().map(|(_, l)| init_ms(l)).max().unwrap();
    println!("new_group across {HOSTS} hosts x {PER_HOST} workers: max {max} ms");
    // Transport selection: shared memory to a rank on the same host, TCP to the others.
    let dialled: Vec<&(usize, String)> = w.lines_with("connected to a peer");
    assert!(!dialled.is_empty(), "{:#?}", w.seen);
    for (rank, line) in dialled {
        let own = format!("peer={}:", Hosts::ip_of(rank / PER_HOST));
        let want = if line.contains(&own) { "shm" } else { "tcp" };
        assert!(
            line.contains(&format!("transport=\"{want}\"")),
            "rank {rank}: {line}"
        );
    }
}

#[test]
fn slurm_variables_alone_make_the_group() {
    let Some(hosts) = hosts() else { return };
    // node1..node3 resolve to the hosts; MASTER_ADDR is node1, MASTER_PORT 15000 + 4242.
    let mut w = start(&hosts, "pg", true, |_| {
        vec![("TW_PER_HOST", PER_HOST.to_string())]
    });
    let codes = w.finish(Duration::from_secs(60));
    assert_eq!(codes, vec![Some(0); WORLD], "{:#?}", w.seen);
    for rank in 0..WORLD {
        let want = format!("OK pg rank {rank} local {} ", rank % PER_HOST);
        assert_eq!(w.lines_with(&want).len(), 1, "{want}: {:#?}", w.seen);
    }
}

#[test]
fn dynamic_rpc_group_across_three_hosts() {
    let Some(hosts) = hosts() else { return };
    let mut w = start(&hosts, "dynamic", false, |_| Vec::new());
    let codes = w.finish(Duration::from_secs(60));
    assert_eq!(codes, vec![Some(0); WORLD], "{:#?}", w.seen);
    assert_eq!(
        w.lines_with("OK dynamic rank").len(),
        WORLD,
        "{:#?}",
        w.seen
    );
}

#[test]
fn a_cut_link_fails_calls_to_that_hosts_workers_within_the_timeout() {
    let Some(hosts) = hosts() else { return };
    let mut w = start(&hosts, "cut", false, |_| {
        vec![("TW_CALL_TIMEOUT_MS", "1000".to_string())]
    });
    w.until(Duration::from_secs(60), |seen| {
        seen.iter().filter(|(_, l)| l.starts_with("READY")).count() == WORLD
    });
    hosts.cut(HOSTS - 1).unwrap();
    let stdin = w.stdins[0].as_mut().unwrap();
    stdin.write_all(b"go\n").unwrap();
    stdin.flush().unwrap();
    w.until(Duration::from_secs(30), |seen| {
        seen.iter()
            .filter(|(r, l)| *r == 0 && l.starts_with("OK "))
            .count()
            == WORLD - 1
    });
    let cut_off: Vec<usize> = ((HOSTS - 1) * PER_HOST..WORLD).collect();
    for peer in 1..WORLD {
        if cut_off.contains(&peer) {
            let failed = w.lines_with(&format!("OK failed w{peer} "));
            assert_eq!(failed.len(), 1, "w{peer}: {:#?}", w.seen);
            let line = &failed[0].1;
            // The error names the worker, and came within the bound (plus scheduling slack).
            assert!(line.contains(&format!("to w{peer}")), "{line}");
            let after: u64 = line
                .split("after_ms=")
                .nth(1)
                .unwrap()
                .split(':')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!((900..3000).contains(&after), "{line}");
        } else {
            assert_eq!(
                w.lines_with(&format!("OK reached w{peer}")).len(),
                1,
                "w{peer}: {:#?}",
                w.seen
            );
        }
    }
}

#[test]
fn loopback_in_a_multi_host_group_fails_init_saying_what_to_set() {
    let Some(hosts) = hosts() else { return };
    // Two workers on two hosts, both told to advertise `lo`: init fails once the group has met,
    // naming the address, where it came from and what to set.
    let mut started = Vec::new();
    for rank in 0..2 {
        let mut cmd = hosts.command(rank, env!("CARGO_BIN_EXE_tw-rpc-worker"));
        cmd.arg("scale")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", Hosts::ip_of(0).to_string())
            .env("MASTER_PORT", PORT)
            .env("TENSORWIRE_SECRET", "s")
            .env("TENSORWIRE_IFNAME", "lo");
        started.push(hosts.spawn(&mut cmd));
    }
    for (rank, index) in started.into_iter().enumerate() {
        let (_, _, stderr) = hosts.take(index);
        let mut err = String::new();
        stderr.unwrap().read_to_string(&mut err).unwrap();
        let code = hosts.with_child(index, |c| c.wait().unwrap().code());
        assert_eq!(code, Some(1), "{err}");
        if rank == 1 {
            // Rank 1 may instead lose the store that rank 0 hosted, as rank 0 exits.
            continue;
        }
        assert!(
            err.contains("loopback address 127.0.0.1 (from TENSORWIRE_IFNAME)")
                && err.contains("MASTER_ADDR=10.77.0.1 is not a loopback address")
                && err.contains("set TENSORWIRE_IFNAME"),
            "{err}"
        );
    }
}
