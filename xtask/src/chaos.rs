//! `cargo xtask chaos`: faults injected into real worker processes on simulated hosts.
//!
//! Every scenario makes its own hosts (network namespaces joined by a bridge, from
//! `tests/src/netns.rs`, included here as it is: it needs only std), starts `tw-chaos-worker`
//! processes on them (one per host) and injects its fault from outside: `tc netem` on the
//! hosts' interfaces, `SIGSTOP`/`SIGCONT`, `SIGKILL`, or an interface taken down. The workers
//! report what they saw in lines (see `tests/src/bin/tw-chaos-worker.rs`); detection times are
//! measured by this driver from the moment it injected the fault where it can (link cut, QUIC
//! kill), else by the worker from the start of the operation that had to fail.
//!
//! Prints a table (scenario / expected / observed / time to detect) and `N passed, N failed`;
//! fails if any scenario failed. Needs root and iproute2 (`ip`, `tc`); [`available`] says why
//! not, and `cargo xtask ci` then skips it with that reason.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

#[allow(unreachable_pub, dead_code)]
#[path = "../../tests/src/netns.rs"]
pub(crate) mod netns;

use netns::Hosts;

/// The RPC group's store port, and the process group's (both on host 0; every namespace is new).
const RPC_PORT: &str = "29500";
const PG_PORT: &str = "29501";

/// Slack allowed over a configured bound for scheduling and reporting.
const SLACK: Duration = Duration::from_millis(1000);

/// Why chaos cannot run here, if it cannot (not root, no `ip`, no namespaces, no `tc`).
pub(crate) fn available() -> Result<(), String> {
    // Making (and dropping) one host checks root, `ip` and namespace support at once.
    Hosts::create(1, "probe").map(drop)?;
    match Command::new("tc").arg("-V").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err("`tc` (iproute2) is not installed".into()),
    }
}

/// Builds the worker and runs every scenario.
pub(crate) fn chaos(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        bail!("unexpected argument {a:?}; usage: cargo xtask chaos");
    }
    if let Err(why) = available() {
        bail!("chaos needs root, iproute2 and network namespaces: {why}");
    }
    let bin = build_test_bins(&["tw-chaos-worker", "tw-netem"])?;
    let worker = bin.join("tw-chaos-worker");
    let started = Instant::now();
    let mut rows = Vec::new();
    type Scenario = fn(&std::path::Path) -> Result<Vec<Row>>;
    let scenarios: [(&str, Scenario); 6] = [
        ("5 ms ± 2 ms delay, 1% loss", netem),
        ("peer frozen (SIGSTOP)", frozen),
        ("store host killed", |w| store_killed(w, false)),
        ("store host vanished", |w| store_killed(w, true)),
        ("link cut (TCP)", link_cut),
        ("QUIC peer killed", quic_killed),
    ];
    for (name, scenario) in scenarios {
        let t0 = Instant::now();
        eprintln!("xtask: chaos: {name} ...");
        match scenario(&worker) {
            Ok(r) => rows.extend(r),
            Err(e) => rows.push(Row::fail(name, "the scenario runs", format!("{e:#}"), None)),
        }
        eprintln!("xtask: chaos: {name}: {:.1} s", t0.elapsed().as_secs_f64());
    }
    print_table(&rows);
    for r in rows.iter().filter(|r| !r.pass) {
        println!("FAILED {}: {}", r.scenario, r.observed);
    }
    let failed = rows.iter().filter(|r| !r.pass).count();
    println!("chaos took {:.1} s", started.elapsed().as_secs_f64());
    println!("{} passed, {} failed", rows.len() - failed, failed);
    if failed > 0 {
        bail!("{failed} chaos scenario(s) failed");
    }
    Ok(())
}

/// One line of the table.
struct Row {
    scenario: String,
    expected: String,
    observed: String,
    detect: Option<Duration>,
    pass: bool,
}

impl Row {
    fn new(
        pass: bool,
        scenario: &str,
        expected: impl Into<String>,
        observed: impl Into<String>,
        detect: Option<Duration>,
    ) -> Row {
        Row {
            scenario: scenario.into(),
            expected: expected.into(),
            observed: observed.into(),
            detect,
            pass,
        }
    }

    fn fail(
        scenario: &str,
        expected: impl Into<String>,
        observed: impl Into<String>,
        detect: Option<Duration>,
    ) -> Row {
        Row::new(false, scenario, expected, observed, detect)
    }
}

fn print_table(rows: &[Row]) {
    let cut = |s: &str, n: usize| -> String {
        let s = s.replace('\n', " ");
        if s.chars().count() > n {
            format!("{}…", s.chars().take(n - 1).collect::<String>())
        } else {
            s
        }
    };
    println!(
        "{:<34} | {:<4} | {:<48} | {:<9} | observed",
        "scenario", "ok", "expected", "detect"
    );
    println!("{}", "-".repeat(160));
    for r in rows {
        println!(
            "{:<34} | {:<4} | {:<48} | {:<9} | {}",
            cut(&r.scenario, 34),
            if r.pass { "PASS" } else { "FAIL" },
            cut(&r.expected, 48),
            r.detect
                .map(|d| format!("{:.2} s", d.as_secs_f64()))
                .unwrap_or_else(|| "-".into()),
            cut(&r.observed, 200),
        );
    }
}

/// A line a worker printed: its rank, when the driver read it, the text.
type Line = (usize, Instant, String);

/// Workers on hosts, rank `r` on host `r`.
struct Run<'h> {
    hosts: &'h Hosts,
    children: Vec<usize>,
    stdins: Vec<Option<std::process::ChildStdin>>,
    lines: mpsc::Receiver<Line>,
    seen: Vec<Line>,
}

impl<'h> Run<'h> {
    /// Starts one worker in `mode` per host, with the rendezvous variables and `env`.
    fn start(
        hosts: &'h Hosts,
        worker: &std::path::Path,
        mode: &str,
        env: &[(&str, String)],
    ) -> Run<'h> {
        let world = hosts.len();
        let (tx, lines) = mpsc::channel();
        let mut children = Vec::new();
        let mut stdins = Vec::new();
        for rank in 0..world {
            let mut cmd = hosts.command(rank, worker);
            cmd.arg(mode)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", Hosts::ip_of(0).to_string())
                .env("MASTER_PORT", RPC_PORT)
                .env("TW_PG_PORT", PG_PORT)
                .env("TENSORWIRE_SECRET", format!("chaos-{}", hosts.prefix()))
                .env_remove("TENSORWIRE_IFNAME")
                .env_remove("RUST_LOG");
            for (k, v) in env {
                cmd.env(k, v);
            }
            let index = hosts.spawn(&mut cmd);
            let (stdin, stdout, stderr) = hosts.take(index);
            for stream in [
                Box::new(stdout.expect("piped")) as Box<dyn Read + Send>,
                Box::new(stderr.expect("piped")),
            ] {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stream).lines().map_while(Result::ok) {
                        let _ = tx.send((rank, Instant::now(), line));
                    }
                });
            }
            children.push(index);
            stdins.push(stdin);
        }
        Run {
            hosts,
            children,
            stdins,
            lines,
            seen: Vec::new(),
        }
    }

    /// Reads lines until `done` holds, for at most `limit`.
    fn until(&mut self, limit: Duration, done: impl Fn(&[Line]) -> bool) -> Result<()> {
        let deadline = Instant::now() + limit;
        while !done(&self.seen) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(e) => bail!(
                    "{} after {limit:?}; the workers said: {}",
                    match e {
                        mpsc::RecvTimeoutError::Timeout => "timed out",
                        mpsc::RecvTimeoutError::Disconnected => "every worker exited",
                    },
                    self.tail()
                ),
            }
        }
        Ok(())
    }

    /// Waits until each of `ranks` printed a line starting with `prefix`.
    fn each(&mut self, ranks: &[usize], prefix: &str, limit: Duration) -> Result<()> {
        self.until(limit, |seen| {
            ranks
                .iter()
                .all(|r| seen.iter().any(|(s, _, l)| s == r && l.starts_with(prefix)))
        })
    }

    /// The first line of `rank` starting with `prefix`, and when it came.
    fn line(&self, rank: usize, prefix: &str) -> Option<(Instant, &str)> {
        self.seen
            .iter()
            .find(|(r, _, l)| *r == rank && l.starts_with(prefix))
            .map(|(_, t, l)| (*t, l.as_str()))
    }

    /// Writes `line` to `rank`'s stdin.
    fn say(&mut self, rank: usize, line: &str) -> Result<()> {
        let stdin = self.stdins[rank].as_mut().context("stdin taken")?;
        stdin.write_all(format!("{line}\n").as_bytes())?;
        stdin.flush()?;
        Ok(())
    }

    /// Sends `signal` (`STOP`, `CONT`, `KILL`) to `rank`'s process.
    fn signal(&self, rank: usize, signal: &str) -> Result<()> {
        let pid = self.hosts.pid(self.children[rank]);
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -{signal} {pid} failed");
        }
        Ok(())
    }

    /// Waits for `rank`'s process to exit (after a kill).
    fn reap(&self, rank: usize) {
        self.hosts
            .with_child(self.children[rank], |c| drop(c.wait()));
    }

    /// Waits until every worker has exited, then returns their exit codes.
    fn finish(&mut self, limit: Duration) -> Result<Vec<Option<i32>>> {
        self.stdins.clear();
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(_) => bail!("workers still running after {limit:?}: {}", self.tail()),
            }
        }
        Ok(self
            .children
            .iter()
            .map(|&i| {
                self.hosts
                    .with_child(i, |c| c.wait().ok().and_then(|s| s.code()))
            })
            .collect())
    }

    /// The workers' failures and last lines, for errors.
    fn tail(&self) -> String {
        let start = self.seen.len().saturating_sub(12);
        let failures = self.seen[..start]
            .iter()
            .filter(|(_, _, l)| l.starts_with("FAIL") || l.contains("panicked"));
        failures
            .chain(&self.seen[start..])
            .map(|(r, _, l)| format!("[{r}] {l}"))
            .collect::<Vec<_>>()
            .join(" | ")
    }
}

/// `after_ms=N` in a worker's line.
fn after_ms(line: &str) -> Option<Duration> {
    let n = line.split("after_ms=").nth(1)?;
    let n: String = n.chars().take_while(char::is_ascii_digit).collect();
    n.parse().ok().map(Duration::from_millis)
}

/// The error part of a `DETECT ... after_ms=N: ERROR` line.
fn error_of(line: &str) -> &str {
    line.split_once(": ").map_or(line, |(_, e)| e)
}

fn hosts(n: usize) -> Result<Hosts> {
    Hosts::create(n, "node").map_err(|e| anyhow::anyhow!("cannot make hosts: {e}"))
}

/// Delays and drops packets between the hosts: `tc netem` where the kernel has it, else the
/// user-space emulator `tw-netem` on the switch. Returns which one.
fn impair(hosts: &Hosts, worker: &std::path::Path) -> Result<&'static str> {
    let netem = ["delay", "5ms", "2ms", "loss", "1%"];
    match hosts.netem(0, &netem) {
        Ok(()) => {
            for i in 1..hosts.len() {
                hosts.netem(i, &netem).map_err(|e| anyhow::anyhow!(e))?;
            }
            Ok("tc netem")
        }
        Err(why) => {
            eprintln!("xtask: chaos: {why}; emulating in user space (tw-netem) instead");
            let ports = hosts.detach_ports().map_err(|e| anyhow::anyhow!(e))?;
            let emulator = worker.with_file_name("tw-netem");
            let mut cmd = hosts.switch_command(&emulator);
            cmd.args(["5", "2", "0.01"]).args(&ports);
            let index = hosts.spawn(&mut cmd);
            let (_, stdout, _) = hosts.take(index);
            let mut first = String::new();
            BufReader::new(stdout.context("piped")?).read_line(&mut first)?;
            if first.trim() != "NETEM READY" {
                bail!("tw-netem did not start: {first}");
            }
            Ok("tw-netem, user space: this kernel has no sch_netem")
        }
    }
}

/// Runs `rounds` rounds of `traffic` on `hosts`: whether every rank passed, their times, and
/// what they said.
fn traffic(
    hosts: &Hosts,
    worker: &std::path::Path,
    rounds: usize,
) -> Result<(bool, Vec<u64>, String)> {
    let mut run = Run::start(
        hosts,
        worker,
        "traffic",
        &[("TW_ROUNDS", rounds.to_string())],
    );
    let codes = run.finish(Duration::from_secs(180))?;
    let times: Vec<u64> = (0..hosts.len())
        .filter_map(|r| run.line(r, "OK traffic"))
        .filter_map(|(_, l)| l.split("ms=").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    let pass = codes.iter().all(|c| *c == Some(0)) && times.len() == hosts.len();
    Ok((pass, times, format!("exit codes {codes:?}; {}", run.tail())))
}

fn netem(worker: &std::path::Path) -> Result<Vec<Row>> {
    const NAME: &str = "5 ms ± 2 ms delay, 1% loss";
    let expected = "calls, RRefs, collectives, store: all correct";
    let hosts = hosts(3)?;
    let rounds = 10;
    // The same traffic without the impairment first: its time shows the impairment worked.
    let (base_pass, base, base_said) = traffic(&hosts, worker, rounds)?;
    if !base_pass {
        bail!("traffic failed even without impairment: {base_said}");
    }
    let how = impair(&hosts, worker)?;
    let (pass, times, said) = traffic(&hosts, worker, rounds)?;
    let ms = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join("/");
    let observed = if pass {
        format!(
            "3/3 ranks checked {rounds} rounds (calls to all, RRef fork + methods, all_reduce, \
             all_gather_object, store set/get/add/delete) in {} ms, against {} ms unimpaired \
             ({how})",
            ms(&times),
            ms(&base)
        )
    } else {
        said
    };
    Ok(vec![Row::new(pass, NAME, expected, observed, None)])
}

fn frozen(worker: &std::path::Path) -> Result<Vec<Row>> {
    const NAME: &str = "peer frozen (SIGSTOP)";
    let (coll, call) = (Duration::from_secs(4), Duration::from_secs(2));
    let hosts = hosts(3)?;
    let victim = 2;
    let others = [0, 1];
    let mut run = Run::start(
        &hosts,
        worker,
        "frozen",
        &[
            ("TW_COLL_TIMEOUT_MS", coll.as_millis().to_string()),
            ("TW_CALL_TIMEOUT_MS", call.as_millis().to_string()),
        ],
    );
    run.each(&[0, 1, 2], "READY resume", Duration::from_secs(60))?;
    // Frozen before it hears GO (the line waits in its pipe), resumed within the timeouts.
    run.signal(victim, "STOP")?;
    for r in 0..3 {
        run.say(r, "GO")?;
    }
    let frozen_for = Duration::from_millis(1500);
    std::thread::sleep(frozen_for);
    run.signal(victim, "CONT")?;
    let mut rows = Vec::new();
    let resumed = run.each(&others, "OK resumed", coll * 3);
    let took: Vec<Duration> = others
        .iter()
        .filter_map(|&r| run.line(r, "OK resumed").and_then(|(_, l)| after_ms(l)))
        .collect();
    let pass = resumed.is_ok() && took.len() == 2 && took.iter().all(|t| *t < coll);
    rows.push(Row::new(
        pass,
        &format!("{NAME}, SIGCONT after 1.5 s"),
        format!("call ({:?}) + all_reduce ({coll:?}) complete", coll * 2),
        match resumed {
            Ok(()) => format!(
                "both ranks completed, after {} ms",
                took.iter()
                    .map(|t| t.as_millis().to_string())
                    .collect::<Vec<_>>()
                    .join("/")
            ),
            Err(e) => format!("{e:#}"),
        },
        None,
    ));
    run.each(&[0, 1, 2], "READY stay-frozen", Duration::from_secs(30))?;
    run.signal(victim, "STOP")?;
    for r in others {
        run.say(r, "GO")?;
    }
    let detected = run.each(&others, "DETECT collective", (call + coll) * 2);
    // A call names its callee. A collective's timeout names the rank each caller was waiting
    // for: in a ring or doubling schedule that may be a live rank that is itself stuck on
    // the frozen one, so the frozen rank must be named by at least one survivor (the one
    // that waits on it directly) and every survivor must fail within the bound.
    for (what, bound, names, all_name) in [
        ("call", call, "w2", true),
        ("collective", coll, "rank(s) 2", false),
    ] {
        let lines: Vec<&str> = others
            .iter()
            .filter_map(|&r| run.line(r, &format!("DETECT {what}")).map(|(_, l)| l))
            .collect();
        let worst = lines.iter().filter_map(|l| after_ms(l)).max();
        let named = lines.iter().filter(|l| error_of(l).contains(names)).count();
        let pass = detected.is_ok()
            && lines.len() == 2
            && if all_name { named == 2 } else { named >= 1 }
            && worst.is_some_and(|w| w <= bound + SLACK);
        rows.push(Row::new(
            pass,
            &format!("{NAME}: {what}"),
            format!(
                "every survivor fails within its {bound:?} timeout; {} names {names}",
                if all_name {
                    "each"
                } else {
                    "the one waiting on it"
                }
            ),
            match &detected {
                Ok(()) => lines
                    .iter()
                    .map(|l| error_of(l))
                    .collect::<Vec<_>>()
                    .join(" || "),
                Err(e) => format!("{e:#}"),
            },
            worst,
        ));
    }
    let _ = run.signal(victim, "CONT");
    Ok(rows)
}

fn store_killed(worker: &std::path::Path, vanish: bool) -> Result<Vec<Row>> {
    let name = if vanish {
        "store host vanished (link down + kill)"
    } else {
        "store host killed (SIGKILL)"
    };
    let timeout = Duration::from_secs(3);
    let hosts = hosts(3)?;
    let mut run = Run::start(
        &hosts,
        worker,
        "store-kill",
        &[("TW_STORE_TIMEOUT_MS", timeout.as_millis().to_string())],
    );
    run.each(&[0, 1, 2], "READY go", Duration::from_secs(60))?;
    if vanish {
        // No FIN or RST ever reaches the others: only their timeouts can tell.
        hosts.cut(0).map_err(|e| anyhow::anyhow!(e))?;
    }
    run.signal(0, "KILL")?;
    run.reap(0);
    for r in [1, 2] {
        run.say(r, "GO")?;
    }
    let detected = run.until(timeout * 4, |seen| {
        seen.iter()
            .any(|(r, _, l)| *r == 1 && l.starts_with("DETECT store-again"))
            && seen
                .iter()
                .any(|(r, _, l)| *r == 2 && l.starts_with("DETECT rendezvous"))
    });
    let store = Hosts::ip_of(0).to_string();
    let mut rows = Vec::new();
    for (rank, what, label) in [
        (1, "DETECT store ", "store call"),
        (1, "DETECT store-again", "next store call"),
        (2, "DETECT rendezvous", "rendezvous"),
    ] {
        let line = run.line(rank, what).map(|(_, l)| l);
        let took = line.and_then(after_ms);
        let pass = detected.is_ok()
            && line.is_some_and(|l| error_of(l).contains(&store))
            && took.is_some_and(|t| t <= timeout + SLACK);
        rows.push(Row::new(
            pass,
            &format!("{name}: {label}"),
            format!("fails within its {timeout:?} timeout, naming the store"),
            match (line, &detected) {
                (Some(l), _) => error_of(l).to_owned(),
                (None, Err(e)) => format!("{e:#}"),
                (None, Ok(())) => run.tail(),
            },
            took,
        ));
    }
    Ok(rows)
}

fn link_cut(worker: &std::path::Path) -> Result<Vec<Row>> {
    const NAME: &str = "link cut between 2 ranks (TCP)";
    let (keepalive, dead) = (Duration::from_secs(1), Duration::from_secs(3));
    let bound = keepalive + dead + SLACK;
    let hosts = hosts(2)?;
    let mut run = Run::start(
        &hosts,
        worker,
        "link-cut",
        &[
            (
                "TENSORWIRE_TCP_KEEPALIVE_MS",
                keepalive.as_millis().to_string(),
            ),
            ("TENSORWIRE_TCP_DEAD_PEER_MS", dead.as_millis().to_string()),
        ],
    );
    run.each(&[0, 1], "READY go", Duration::from_secs(60))?;
    run.say(0, "GO")?;
    run.say(1, "GO")?;
    run.each(&[0], "CALLING", Duration::from_secs(10))?;
    // Rank 1 runs the call, so its request arrived; the collective's message went out as rank 0
    // began it (if it is still unacknowledged at the cut, the dead-peer bound covers it too).
    // What is then left is an idle connection, which only keepalive can find dead.
    run.each(&[1], "SERVING", Duration::from_secs(10))?;
    hosts.cut(1).map_err(|e| anyhow::anyhow!(e))?;
    let cut_at = Instant::now();
    let detected = run.each(&[0], "DETECT call", Duration::from_secs(60));
    let mut rows = Vec::new();
    for (what, names) in [("call", "w1"), ("collective", "rank 1")] {
        let line = run.line(0, &format!("DETECT {what}"));
        let took = line.map(|(t, _)| t.saturating_duration_since(cut_at));
        let pass = line.is_some_and(|(_, l)| error_of(l).contains(names))
            && took.is_some_and(|t| t <= bound);
        rows.push(Row::new(
            pass,
            &format!("{NAME}: {what} with no timeout"),
            format!(
                "fails within keepalive {keepalive:?} + dead-peer {dead:?} (+1 s), naming {names}"
            ),
            match (line, &detected) {
                (Some((_, l)), _) => error_of(l).to_owned(),
                (None, Err(e)) => format!("{e:#}"),
                (None, Ok(())) => run.tail(),
            },
            took,
        ));
    }
    Ok(rows)
}

fn quic_killed(worker: &std::path::Path) -> Result<Vec<Row>> {
    const NAME: &str = "QUIC peer killed (SIGKILL)";
    let (idle, keep_alive) = (Duration::from_secs(2), Duration::from_millis(500));
    let bound = idle + SLACK;
    let hosts = hosts(2)?;
    let tls = tempdir("chaos-tls")?;
    let mut run = Run::start(
        &hosts,
        worker,
        "quic-kill",
        &[
            (
                "TENSORWIRE_QUIC_IDLE_TIMEOUT_MS",
                idle.as_millis().to_string(),
            ),
            (
                "TENSORWIRE_QUIC_KEEPALIVE_MS",
                keep_alive.as_millis().to_string(),
            ),
            ("TW_TLS_DIR", tls.path().display().to_string()),
        ],
    );
    let outcome = (|| {
        run.each(&[0, 1], "READY go", Duration::from_secs(60))?;
        run.say(0, "GO")?;
        run.say(1, "GO")?;
        run.each(&[0], "CALLING", Duration::from_secs(10))?;
        run.each(&[1], "SERVING", Duration::from_secs(10))?;
        run.signal(1, "KILL")?;
        let killed_at = Instant::now();
        run.reap(1);
        let detected = run.each(&[0], "DETECT call", Duration::from_secs(60));
        let line = run.line(0, "DETECT call");
        let took = line.map(|(t, _)| t.saturating_duration_since(killed_at));
        let pass = line.is_some_and(|(_, l)| error_of(l).contains("w1"))
            && took.is_some_and(|t| t <= bound);
        Ok::<_, anyhow::Error>(Row::new(
            pass,
            &format!("{NAME}: call with no timeout"),
            format!("fails within the idle timeout {idle:?} (keep-alive {keep_alive:?}, +1 s), naming w1"),
            match (line, &detected) {
                (Some((_, l)), _) => error_of(l).to_owned(),
                (None, Err(e)) => format!("{e:#}"),
                (None, Ok(())) => run.tail(),
            },
            took,
        ))
    })();
    drop(tls);
    Ok(vec![outcome?])
}

/// The `--features` of the workspace's test build that `ci` has made (see
/// [`use_test_build`]); `None` until then.
static TEST_BUILD_FEATURES: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Says that the workspace's tests were built with `features` (`ci`'s one test build): the
/// chaos workers are then taken from that build instead of a second one.
pub(crate) fn use_test_build(features: &str) {
    let _ = TEST_BUILD_FEATURES.set(features.to_owned());
}

/// Builds binaries of `tensorwire-tests` (debug, as the tests are) and returns the folder
/// that holds them. After [`use_test_build`], the same command as that test build (`cargo
/// test --no-run`, the whole workspace, its features: dev-dependencies' features included), so
/// that its binaries are found fresh; a plain `cargo build` of the binaries would resolve other
/// dependency features and build them again.
pub(crate) fn build_test_bins(bins: &[&str]) -> Result<PathBuf> {
    let args: Vec<&str> = match TEST_BUILD_FEATURES.get() {
        Some(features) => vec!["test", "--no-run", "--workspace", "--features", features],
        None => {
            let mut args = vec!["build", "-p", "tensorwire-tests"];
            for bin in bins {
                args.extend(["--bin", bin]);
            }
            args
        }
    };
    super::run("cargo", &args, &[])?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| super::workspace_root().join("target"));
    Ok(target.join("debug"))
}

/// A new empty folder under the system's temporary folder, removed when the guard drops.
pub(crate) fn tempdir(what: &str) -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("tw-{what}-"))
        .tempdir()
        .with_context(|| format!("cannot create a temporary folder for {what}"))
}
