//! `tensorwire bench store --clients N[,N...]`: a rendezvous-shaped load on the store server
//! from one process holding N connections.
//!
//! The server is `tensorwire store serve` in a process of its own (so each side's descriptors
//! count once against the open-file limit, which this process raises to its hard limit first; the
//! server inherits it). For each N, N clients of this process, all at once, on one thread:
//! connect (the c10d validate query and a ping), set their own key, add 1 to a counter, wait for
//! the key `go` (set by the client whose add reached N), and get their neighbour's key (checked).
//! Reported per N: `rendezvous_s` (from the first connect to the last client done),
//! `client_p50_ms` and `client_max_ms` (one client's whole sequence).
//!
//! With `--pytorch PYTHON`, the same load also runs against PyTorch's own server (`TCPStore`
//! with libuv, started by that Python) in the same run, giving `pytorch_rendezvous_s` and the
//! ratio `rendezvous_over_pytorch` per N (our clients speak c10d's protocol to either).
//!
//! With `--baseline BINARY`, the same load also runs against `BINARY store serve` (an older
//! build of tensorwire, say) in the same run, giving `baseline_rendezvous_s` and
//! `rendezvous_over_baseline` per N. The servers take turns; who goes first rotates by round.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map};
use tensorwire_store::{ClientConfig, Store, TcpStoreClient};

use super::bench_common::write_json;

/// Arguments of `tensorwire bench store`.
#[derive(Debug, clap::Args)]
pub(crate) struct StoreArgs {
    /// Numbers of clients, comma-separated; one rendezvous each.
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    clients: Vec<usize>,
    /// Bound on each rendezvous, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Also run the load against PyTorch's TCPStore (libuv) started by this Python interpreter.
    #[arg(long)]
    pytorch: Option<PathBuf>,
    /// Rendezvous per number of clients and server; each figure is the median over them.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Also run the load against `BINARY store serve` (another tensorwire build) in the same run.
    #[arg(long, value_name = "BINARY")]
    baseline: Option<PathBuf>,
    /// Write the results as one JSON object to this file (else to standard output).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Descriptors this process needs beside the clients' (runtime, pipes, the standard streams).
const SPARE_FDS: u64 = 256;

/// Raises the soft open-file limit to the hard one; returns the limit in force.
fn raise_nofile() -> Result<u64> {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let hard = limit.maximum;
    if limit.current != hard {
        rustix::process::setrlimit(
            rustix::process::Resource::Nofile,
            rustix::process::Rlimit {
                current: hard,
                maximum: hard,
            },
        )
        .context("raising the open-file limit (RLIMIT_NOFILE) to its hard limit")?;
    }
    Ok(hard.unwrap_or(u64::MAX))
}

/// A store server in a child process, stopped when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// `BINARY store serve` (this tensorwire, or another build of it) on a free loopback port.
    fn tensorwire(binary: &PathBuf) -> Result<Self> {
        let child = Command::new(binary)
            .args(["store", "serve", "--port", "0", "--host", "127.0.0.1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting `{} store serve`", binary.display()))?;
        Self::read_addr(child, "tensorwire store listening on ")
    }

    /// PyTorch's `TCPStore` (libuv) on a free loopback port, served until stdin closes.
    fn pytorch(python: &PathBuf) -> Result<Self> {
        let script = "import sys, datetime\n\
            from torch.distributed import TCPStore\n\
            s = TCPStore('127.0.0.1', 0, None, True, datetime.timedelta(seconds=600), \
            wait_for_workers=False, use_libuv=True)\n\
            print('pytorch store listening on 127.0.0.1:%d' % s.port, flush=True)\n\
            sys.stdin.read()\n";
        let child = Command::new(python)
            .args(["-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting PyTorch's TCPStore with {}", python.display()))?;
        Self::read_addr(child, "pytorch store listening on ")
    }

    fn read_addr(mut child: Child, prefix: &str) -> Result<Self> {
        let mut line = String::new();
        let read = child
            .stdout
            .take()
            .map(|out| BufReader::new(out).read_line(&mut line));
        match (read, line.trim().strip_prefix(prefix)) {
            (Some(Ok(_)), Some(addr)) => Ok(Server {
                addr: addr.to_owned(),
                child,
            }),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the store server did not report its address (got {line:?})")
            }
        }
    }
}

/// One client's rendezvous: connect, set own key, add to the counter, wait for `go`, get the
/// neighbour's key. Returns how long it took.
async fn client(
    addr: String,
    prefix: String,
    i: usize,
    n: usize,
    timeout: Duration,
) -> Result<Duration> {
    let started = Instant::now();
    let config = ClientConfig {
        timeout,
        connect_timeout: timeout,
        key_prefix: prefix,
        ..ClientConfig::default()
    };
    let store = TcpStoreClient::connect(&addr, config)
        .await
        .with_context(|| format!("client {i}: connecting"))?;
    store
        .set(&format!("rank/{i}"), i.to_string().as_bytes())
        .await?;
    if store.add("count", 1).await? == n as i64 {
        store.set("go", b"1").await?;
    }
    store.wait(&["go"], timeout).await?;
    let next = (i + 1) % n;
    let got = store.get(&format!("rank/{next}")).await?;
    if got != next.to_string().as_bytes() {
        bail!("client {i} read {got:?} for rank {next}");
    }
    Ok(started.elapsed())
}

/// The median of each figure over rounds.
fn medians(runs: &[(f64, f64, f64)]) -> (f64, f64, f64) {
    let median = |pick: fn(&(f64, f64, f64)) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(pick).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(|r| r.0), median(|r| r.1), median(|r| r.2))
}

/// N clients at once against `addr`: (rendezvous time, client p50, client max).
async fn rendezvous(
    addr: &str,
    round: &str,
    n: usize,
    timeout: Duration,
) -> Result<(f64, f64, f64)> {
    let started = Instant::now();
    let prefix = format!("/bench-store-{round}/");
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        tasks.spawn(client(addr.to_owned(), prefix.clone(), i, n, timeout));
    }
    let mut times = Vec::with_capacity(n);
    while let Some(done) = tasks.join_next().await {
        times.push(done.context("a client task failed")??);
    }
    let took = started.elapsed().as_secs_f64();
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Ok((took, ms(times[times.len() / 2]), ms(times[times.len() - 1])))
}

/// `tensorwire bench store`.
pub(crate) fn run(args: &StoreArgs) -> Result<()> {
    if args.clients.is_empty() || args.clients.contains(&0) {
        bail!(super::Usage(
            "--clients takes numbers of clients of at least 1".into()
        ));
    }
    let limit = raise_nofile()?;
    let most = args.clients.iter().copied().max().unwrap_or(1) as u64;
    if most + SPARE_FDS > limit {
        bail!(
            "{most} clients need about {} open files in this process and in the server, but the \
             hard limit (ulimit -Hn) is {limit}",
            most + SPARE_FDS
        );
    }
    let timeout = Duration::from_secs(args.timeout);
    // Ours first; each other server is compared with it.
    let mut servers = vec![("tensorwire", Server::tensorwire(&std::env::current_exe()?)?)];
    if let Some(binary) = &args.baseline {
        servers.push(("baseline", Server::tensorwire(binary)?));
    }
    if let Some(python) = &args.pytorch {
        servers.push(("pytorch", Server::pytorch(python)?));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut out = Map::new();
    let rounds = args.rounds.max(1);
    let mut turn_order = 0;
    for &n in &args.clients {
        let bar =
            super::bench_common::progress(rounds as u64, &format!("rendezvous of {n} clients"));
        let mut runs = vec![Vec::with_capacity(rounds); servers.len()];
        for _ in 0..rounds {
            for turn in 0..servers.len() {
                let k = (turn_order + turn) % servers.len();
                let (who, server) = &servers[k];
                let r = runtime
                    .block_on(rendezvous(
                        &server.addr,
                        &format!("{who}-{turn_order}"),
                        n,
                        timeout,
                    ))
                    .with_context(|| format!("{n} clients against the {who} server"))?;
                runs[k].push(r);
            }
            turn_order += 1;
            bar.inc(1);
        }
        let results: Vec<(f64, f64, f64)> = runs.iter().map(|r| medians(r)).collect();
        bar.finish_and_clear();
        let mine = results[0];
        let mut entry = json!({
            "rendezvous_s": mine.0,
            "client_p50_ms": mine.1,
            "client_max_ms": mine.2,
        });
        for ((who, _), theirs) in servers.iter().zip(&results).skip(1) {
            entry[format!("{who}_rendezvous_s")] = json!(theirs.0);
            entry[format!("{who}_client_p50_ms")] = json!(theirs.1);
            entry[format!("rendezvous_over_{who}")] = json!(mine.0 / theirs.0);
        }
        out.insert(format!("clients_{n}"), entry);
    }
    // PyTorch's server stops when its stdin closes.
    for (_, mut server) in servers {
        drop(server.child.stdin.take());
    }
    out.insert(
        "settings".into(),
        json!({
            "load": "per client: connect (validate, ping), set own key, add a counter, wait for \
                     \"go\" (set by the last add), get the neighbour's key; all clients at once \
                     from one process on one thread; the server in another process",
            "rounds": rounds,
            "open_file_limit": limit,
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        }),
    );
    std::io::stdout().flush()?;
    write_json(&out, args.json.as_ref())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_one() {
        let limit = super::raise_nofile().unwrap();
        let now = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(now.current.unwrap_or(u64::MAX), limit);
    }
}
