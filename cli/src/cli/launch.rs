//! `tensorwire launch`: starts workers torchrun-style, on one node or across several.
//!
//! On one node: `tensorwire launch --nproc-per-node N -- PROGRAM ARGS...` (`--nproc` is the
//! same option). Across nodes, run on every node, with the same `--nnodes`, `--master-addr`
//! and `--master-port` everywhere and that node's `--node-rank`:
//! `tensorwire launch --nnodes 3 --node-rank R --nproc-per-node 2 --master-addr A --master-port M`.
//!
//! Each worker gets `RANK` (global: `node_rank * nproc_per_node + local_rank`), `LOCAL_RANK`,
//! `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` (the node rank), `GROUP_WORLD_SIZE` (the
//! number of nodes), `MASTER_ADDR`, `MASTER_PORT` and the cluster secret `TENSORWIRE_SECRET`
//! (from `--secret-file`, else from the launcher's own `TENSORWIRE_SECRET`; on one node a
//! fresh one is made when neither is given, across nodes that is an error, since every node
//! must use the same; `--insecure` passes none and sets `TENSORWIRE_INSECURE=1`). Output lines
//! are prefixed with `[rank N]`. With `--quic-certs CA_DIR`, each worker also gets its own QUIC
//! certificate for its rank (`rank-N`) in a folder named by `TENSORWIRE_TLS_DIR`, issued from a
//! CA whose key only the launcher reads. When a worker fails, the others are stopped (SIGTERM, then
//! SIGKILL after `--grace`), and the launcher exits with the failed worker's code (128 + signal
//! for a worker killed by a signal). Ctrl-C stops everyone.
//!
//! # Across nodes: the job's store watches for failures
//!
//! With `--nnodes` > 1, node 0's launcher serves the job's store on `MASTER_PORT` (all
//! interfaces; clients must know the secret) and every node's launcher connects to it, so
//! failures cross nodes through the store, as torchrun's agents share theirs:
//!
//! - Workers are told `TENSORWIRE_LAUNCHER_STORE=1`: rank 0 connects to the launcher's store
//!   instead of starting its own (so the store outlives any one worker).
//! - A launcher whose worker fails (or that is interrupted) stops its own workers and writes
//!   `launch/failed` (compare-and-set: the first failure wins) with the exit code, the node and
//!   the rank: `7 node 1: rank 3 exited with code 7`.
//! - Every launcher parks a `wait` on `launch/failed`; when it returns, it stops its workers,
//!   prints `node 1: rank 3 exited with code 7; stopping the workers of node N`, and exits with
//!   that code. A launcher that loses the store (node 0's launcher is gone) stops its workers
//!   and exits 1, saying so.
//! - When its workers are done, a launcher writes `launch/exit/<node>`. Node 0's launcher keeps
//!   the store up until every node has written it (after a failure, at most `--grace` + 10 s),
//!   so the last workers can still use the store. A node whose launcher is killed with SIGKILL
//!   never writes it: end node 0's launcher with Ctrl-C then.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rustix::process::{kill_process_group, Pid, Signal};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

use tensorwire_rendezvous::LAUNCHER_STORE_ENV;
use tensorwire_store::{
    ClientConfig, ClusterSecret, ServerConfig, Store, StoreError, TcpStoreClient, TcpStoreServer,
};

/// Arguments of `tensorwire launch`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Number of worker processes on this node.
    #[arg(long = "nproc-per-node", visible_alias = "nproc", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    nproc: u32,
    /// Number of nodes in the job (run `tensorwire launch` on each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    nnodes: u32,
    /// This node's rank, from 0 to --nnodes - 1 (node 0 serves the job's store).
    #[arg(long, default_value_t = 0)]
    node_rank: u32,
    /// Address of the job's store (node 0), given to every worker as MASTER_ADDR.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the job's store (MASTER_PORT); default on one node: a free port. Required with
    /// --nnodes > 1.
    #[arg(long)]
    master_port: Option<u16>,
    /// Read the cluster secret from this file instead of TENSORWIRE_SECRET or a fresh one.
    #[arg(long, conflicts_with = "insecure")]
    secret_file: Option<PathBuf>,
    /// Run without a cluster secret (anyone who reaches the ports can join).
    #[arg(long)]
    insecure: bool,
    /// Issue each worker a QUIC certificate for its rank (`rank-N`) from the cluster CA in
    /// this folder (`ca.pem`, `ca.key.pem`; made there on one node when missing, required
    /// with --nnodes > 1). Each worker gets a folder of its own, named in `TENSORWIRE_TLS_DIR`,
    /// with `ca.pem` and its own certificate and key, never the CA key: no worker can then
    /// take another's rank over QUIC. Removed when the launcher exits.
    #[arg(long, value_name = "CA_DIR")]
    quic_certs: Option<PathBuf>,
    /// How long stopped workers get between SIGTERM and SIGKILL, in seconds.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// With --nnodes > 1: how long to keep trying to reach node 0's store, in seconds.
    #[arg(long, default_value_t = 300.0)]
    join_timeout: f64,
    /// Do not prefix output lines with the worker's rank.
    #[arg(long)]
    no_prefix: bool,
    /// The program to run, and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    pub(crate) command: Vec<String>,
}

impl Args {
    /// `nproc` local workers running `command`, with a fresh cluster secret.
    pub(crate) fn local(nproc: u32, command: Vec<String>) -> Self {
        Self {
            nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            secret_file: None,
            insecure: false,
            quic_certs: None,
            grace: 5.0,
            join_timeout: 300.0,
            no_prefix: false,
            command,
        }
    }

    /// The same, with `--quic-certs ca_dir`.
    pub(crate) fn with_quic_certs(mut self, ca_dir: PathBuf) -> Self {
        self.quic_certs = Some(ca_dir);
        self
    }
}

pub(crate) fn run(args: Args) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tensorwire launch: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(launch(args)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("tensorwire launch: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn free_port(addr: &str) -> Result<u16> {
    let ip = addr.parse().unwrap_or(Ipv4Addr::LOCALHOST);
    let l =
        TcpListener::bind((ip, 0)).with_context(|| format!("cannot find a free port on {ip}"))?;
    Ok(l.local_addr()?.port())
}

fn secret(args: &Args) -> Result<Option<String>> {
    if args.insecure {
        eprintln!(
            "tensorwire launch: warning: --insecure: the workers{} accept any peer that can \
             reach them, with no cluster secret; use it only on a trusted network",
            if args.nnodes > 1 {
                " and the job's store"
            } else {
                ""
            }
        );
        return Ok(None);
    }
    if let Some(path) = &args.secret_file {
        let s = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the secret file {}", path.display()))?;
        let s = s.trim().to_owned();
        if s.is_empty() {
            bail!("the secret file {} is empty", path.display());
        }
        return Ok(Some(s));
    }
    if let Ok(s) = std::env::var("TENSORWIRE_SECRET") {
        if !s.is_empty() {
            return Ok(Some(s));
        }
    }
    if args.nnodes > 1 {
        bail!(
            "--nnodes {} needs the cluster secret shared by every node: give --secret-file \
             FILE (the same file content on each node) or set TENSORWIRE_SECRET in the \
             launcher's environment, or pass --insecure on a trusted network",
            args.nnodes
        );
    }
    // A cryptographically secure generator seeded from the OS (rand's thread RNG).
    let bytes: [u8; 32] = rand::random();
    Ok(Some(bytes.iter().map(|b| format!("{b:02x}")).collect()))
}

/// The environment variable that names a worker's TLS folder (the QUIC backend's).
const TLS_DIR_ENV: &str = "TENSORWIRE_TLS_DIR";

/// The per-worker TLS folders of `--quic-certs`: `<temp>/tensorwire-launch-<pid>-<n>/rank-N/`
/// (mode 0700) with `ca.pem`, `rank-N.pem` and `rank-N.key.pem`, issued by a CA whose key stays
/// in the launcher. Removed when dropped (the launcher exits after its workers).
struct WorkerCerts {
    root: PathBuf,
}

impl WorkerCerts {
    #[cfg(feature = "quic")]
    fn issue(
        ca_dir: &std::path::Path,
        ranks: std::ops::Range<u32>,
        multi_node: bool,
    ) -> Result<Self> {
        use tensorwire_core::identity::rank_name;
        use tensorwire_transport_quic::certs::{ClusterCa, CA_CERT_FILE, CA_KEY_FILE};
        let ca = if multi_node {
            // Every node must issue from the same CA: it is not made here.
            let read = |file: &str| {
                let path = ca_dir.join(file);
                std::fs::read_to_string(&path).with_context(|| {
                    format!(
                        "--quic-certs with --nnodes > 1 needs the same cluster CA on every \
                         node: cannot read {}",
                        path.display()
                    )
                })
            };
            ClusterCa::from_pem(&read(CA_CERT_FILE)?, &read(CA_KEY_FILE)?)?
        } else {
            ClusterCa::load_or_generate(ca_dir)?
        };
        let root = std::env::temp_dir().join(format!(
            "tensorwire-launch-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let certs = WorkerCerts { root };
        private_dir(&certs.root)?;
        for rank in ranks {
            let dir = certs.dir(rank);
            private_dir(&dir)?;
            std::fs::write(dir.join(CA_CERT_FILE), ca.cert_pem())
                .with_context(|| format!("cannot write into {}", dir.display()))?;
            ca.issue_node(&rank_name(rank))?
                .write_pem_files(&dir, &rank_name(rank))?;
        }
        Ok(certs)
    }

    #[cfg(not(feature = "quic"))]
    fn issue(_: &std::path::Path, _: std::ops::Range<u32>, _: bool) -> Result<Self> {
        bail!("--quic-certs: this build has no QUIC transport (feature `quic`)")
    }

    /// Rank `rank`'s folder.
    fn dir(&self, rank: u32) -> PathBuf {
        self.root.join(tensorwire_core::identity::rank_name(rank))
    }
}

impl Drop for WorkerCerts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Creates `dir` readable by this user only.
#[cfg(feature = "quic")]
fn private_dir(dir: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("cannot create {}", dir.display()))
}

/// How one worker ended.
struct Exit {
    code: u8,
    description: String,
}

async fn launch(args: Args) -> Result<u8> {
    if !(args.grace.is_finite() && args.grace >= 0.0) {
        bail!("--grace must be a non-negative number of seconds");
    }
    if !(args.join_timeout.is_finite() && args.join_timeout >= 0.0) {
        bail!("--join-timeout must be a non-negative number of seconds");
    }
    if args.node_rank >= args.nnodes {
        bail!(
            "--node-rank {} is out of range: with --nnodes {} it must be below {}",
            args.node_rank,
            args.nnodes,
            args.nnodes
        );
    }
    let multi_node = args.nnodes > 1;
    let port = match (args.master_port, multi_node) {
        (Some(p), _) => p,
        (None, false) => free_port(&args.master_addr)?,
        (None, true) => bail!(
            "--nnodes {} needs --master-port: every node must name the same port of node 0",
            args.nnodes
        ),
    };
    let secret = secret(&args)?;
    let (program, rest) = args.command.split_first().context("no program given")?;
    let grace = Duration::from_secs_f64(args.grace);
    let node = args.node_rank;
    let world_size = args.nnodes * args.nproc;

    let certs = match &args.quic_certs {
        Some(ca_dir) => Some(WorkerCerts::issue(
            ca_dir,
            node * args.nproc..(node + 1) * args.nproc,
            multi_node,
        )?),
        None => None,
    };

    let mut job = if multi_node {
        Some(JobStore::join(&args, port, secret.as_deref()).await?)
    } else {
        None
    };
    let (failed_elsewhere, mut watching) = match &job {
        Some(job) => (job.watch(), true),
        None => (tokio::sync::oneshot::channel().1, false),
    };
    tokio::pin!(failed_elsewhere);

    // Pids of workers still running (None once reaped), so that no signal goes to a reused pid.
    let pids: Alive = Arc::new(Mutex::new(Vec::new()));
    let mut waits = JoinSet::new();
    let mut output = JoinSet::new();
    for local in 0..args.nproc {
        let rank = node * args.nproc + local;
        let mut cmd = Command::new(program);
        cmd.args(rest)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc.to_string())
            .env("GROUP_RANK", node.to_string())
            .env("GROUP_WORLD_SIZE", args.nnodes.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so that stopping a worker stops what it started too.
            .process_group(0)
            .kill_on_drop(true);
        if let Some(certs) = &certs {
            cmd.env(TLS_DIR_ENV, certs.dir(rank));
        }
        if multi_node {
            cmd.env(LAUNCHER_STORE_ENV, "1");
        } else {
            cmd.env_remove(LAUNCHER_STORE_ENV);
        }
        match &secret {
            Some(s) => cmd
                .env("TENSORWIRE_SECRET", s)
                .env_remove("TENSORWIRE_INSECURE"),
            None => cmd
                .env_remove("TENSORWIRE_SECRET")
                .env("TENSORWIRE_INSECURE", "1"),
        };
        let mut child: Child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                terminate(&pids);
                let why = format!("cannot start {program:?} for rank {rank}: {e}");
                if let Some(job) = job.take() {
                    job.publish_failure(2, &format!("node {node}: {why}")).await;
                    job.finish(node, args.nnodes, Some(grace)).await;
                }
                bail!(why);
            }
        };
        let prefix = (!args.no_prefix).then(|| format!("[rank {rank}] "));
        if let Some(out) = child.stdout.take() {
            output.spawn(relay(out, prefix.clone(), false));
        }
        if let Some(err) = child.stderr.take() {
            output.spawn(relay(err, prefix, true));
        }
        lock(&pids).push(child.id());
        let alive = Arc::clone(&pids);
        waits.spawn(async move {
            let status = child.wait().await;
            lock(&alive)[local as usize] = None;
            (rank, status)
        });
    }

    let stop = |pids: &Alive| {
        terminate(pids);
        // Escalate after the grace period if anyone is still running.
        let pids = Arc::clone(pids);
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            kill(&pids);
        });
    };
    let mut failure: Option<Exit> = None;
    let interrupted = loop {
        tokio::select! {
            next = waits.join_next() => {
                let Some(joined) = next else { break false };
                let (rank, status) = joined.context("a worker watcher failed")?;
                let mut exit = describe(rank, status);
                if multi_node {
                    exit.description = format!("node {node}: {}", exit.description);
                }
                if exit.code != 0 && failure.is_none() {
                    eprintln!("tensorwire launch: {}; stopping the other workers", exit.description);
                    stop(&pids);
                    if let Some(job) = &job {
                        job.publish_failure(exit.code, &exit.description).await;
                    }
                    failure = Some(exit);
                }
            }
            elsewhere = &mut failed_elsewhere, if watching => {
                watching = false;
                if failure.is_none() {
                    let exit = match elsewhere {
                        Ok(Ok(notice)) => Exit {
                            code: notice.code,
                            description: notice.description,
                        },
                        Ok(Err(lost)) => Exit { code: 1, description: lost },
                        Err(_) => Exit {
                            code: 1,
                            description: "the watch on the job's store ended".into(),
                        },
                    };
                    eprintln!(
                        "tensorwire launch: {}; stopping the workers of node {node}",
                        exit.description
                    );
                    stop(&pids);
                    failure = Some(exit);
                }
            }
            _ = tokio::signal::ctrl_c() => {
                eprintln!("tensorwire launch: interrupted; stopping the workers");
                stop(&pids);
                if let Some(job) = &job {
                    let why = format!("node {node}: the launcher was interrupted");
                    job.publish_failure(130, &why).await;
                }
                while waits.join_next().await.is_some() {}
                break true;
            }
        }
    };
    // Workers are gone; a grandchild they left behind may still hold the pipes open, so the
    // output gets a moment to drain and no more.
    let drain = async { while output.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(2), drain)
        .await
        .is_err()
    {
        output.abort_all();
    }
    if let Some(job) = job {
        let failed = interrupted || failure.is_some();
        job.finish(node, args.nnodes, failed.then_some(grace)).await;
    }
    if interrupted {
        return Ok(130);
    }
    Ok(failure.map_or(0, |f| f.code))
}

/// A failure published in the job's store by some node's launcher.
struct Notice {
    code: u8,
    description: String,
}

/// The job's store as the launchers of a multi-node job use it (see the module documentation).
struct JobStore {
    /// Node 0 serves it; dropping it stops the server.
    server: Option<TcpStoreServer>,
    /// For commands (a parked wait holds a connection, so the watch has its own).
    commands: TcpStoreClient,
    watcher: TcpStoreClient,
    addr: String,
}

const FAILED_KEY: &str = "launch/failed";

impl JobStore {
    async fn join(args: &Args, port: u16, secret: Option<&str>) -> Result<Self> {
        let secret = secret
            .map(|s| ClusterSecret::new(s.as_bytes().to_vec()))
            .transpose()
            .context("the cluster secret is unusable")?;
        let server = if args.node_rank == 0 {
            // All interfaces: MASTER_ADDR may name a service address that is not this host's
            // own (a Kubernetes Service); the secret keeps strangers out.
            let bind = if args.master_addr.contains(':') {
                SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port)
            } else {
                SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port)
            };
            let config = ServerConfig {
                secret: secret.clone(),
                ..ServerConfig::default()
            };
            Some(
                TcpStoreServer::bind(bind, config)
                    .await
                    .with_context(|| format!("node 0 cannot serve the job's store on {bind}"))?,
            )
        } else {
            None
        };
        let addr = if args.master_addr.contains(':') {
            format!("[{}]:{port}", args.master_addr)
        } else {
            format!("{}:{port}", args.master_addr)
        };
        let connect = |timeout: Duration| {
            TcpStoreClient::connect(
                &addr,
                ClientConfig {
                    timeout,
                    connect_timeout: Duration::from_secs_f64(args.join_timeout),
                    secret: secret.clone(),
                    ..ClientConfig::default()
                },
            )
        };
        let reach = |e| {
            anyhow::Error::new(e).context(format!(
                "node {} cannot reach the job's store at {addr} (node 0's launcher)",
                args.node_rank
            ))
        };
        let commands = connect(Duration::from_secs(30)).await.map_err(reach)?;
        let watcher = connect(WATCH_WAIT).await.map_err(reach)?;
        Ok(JobStore {
            server,
            commands,
            watcher,
            addr,
        })
    }

    /// Resolves with the first failure any launcher publishes, or with why the store was lost.
    fn watch(&self) -> tokio::sync::oneshot::Receiver<std::result::Result<Notice, String>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let watcher = self.watcher.clone();
        let addr = self.addr.clone();
        tokio::spawn(async move {
            let outcome = loop {
                match watcher.wait(&[FAILED_KEY], WATCH_WAIT).await {
                    Ok(()) => break read_notice(&watcher, &addr).await,
                    Err(StoreError::Timeout { .. }) => continue,
                    Err(e) => {
                        break Err(format!(
                            "lost the job's store at {addr} (node 0's launcher is gone?): {e}"
                        ))
                    }
                }
            };
            let _ = tx.send(outcome);
        });
        rx
    }

    /// Tells every node that this one failed (the first failure published wins).
    async fn publish_failure(&self, code: u8, description: &str) {
        let notice = format!("{code} {description}");
        let publish = self
            .commands
            .compare_set(FAILED_KEY, b"", notice.as_bytes());
        match tokio::time::timeout(Duration::from_secs(10), publish).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => eprintln!(
                "tensorwire launch: cannot tell the other nodes through the store at {}: {e}",
                self.addr
            ),
            Err(_) => eprintln!(
                "tensorwire launch: cannot tell the other nodes: the store at {} does not answer",
                self.addr
            ),
        }
    }

    /// Says this node is done; node 0 then keeps the store up until every node is (after a
    /// failure, for at most `after_failure` + 10 s).
    async fn finish(self, node: u32, nnodes: u32, after_failure: Option<Duration>) {
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            self.commands.set(&format!("launch/exit/{node}"), b"1"),
        )
        .await;
        let Some(server) = self.server else { return };
        let keys: Vec<String> = (0..nnodes).map(|n| format!("launch/exit/{n}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let limit = after_failure.map(|g| g + Duration::from_secs(10));
        loop {
            let step = limit.unwrap_or(WATCH_WAIT);
            match self.commands.wait(&keys, step).await {
                Err(StoreError::Timeout { .. }) if limit.is_none() => continue,
                Ok(()) => break,
                Err(e) => {
                    eprintln!("tensorwire launch: not every node said it was done: {e}");
                    break;
                }
            }
        }
        server.shutdown().await;
    }
}

/// How long one parked wait on the job's store lasts before it is parked again.
const WATCH_WAIT: Duration = Duration::from_secs(3600);

async fn read_notice(store: &TcpStoreClient, addr: &str) -> std::result::Result<Notice, String> {
    let raw = store
        .get(FAILED_KEY)
        .await
        .map_err(|e| format!("cannot read {FAILED_KEY} from the store at {addr}: {e}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (code, description) = text.split_once(' ').unwrap_or(("1", &text));
    Ok(Notice {
        code: code.parse().unwrap_or(1),
        description: description.to_owned(),
    })
}

fn describe(rank: u32, status: std::io::Result<std::process::ExitStatus>) -> Exit {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(c), _) => Exit {
                code: u8::try_from(c).unwrap_or(1),
                description: format!("rank {rank} exited with code {c}"),
            },
            (None, Some(sig)) => Exit {
                code: 128u8.saturating_add(u8::try_from(sig).unwrap_or(0)),
                description: format!("rank {rank} was killed by signal {sig}"),
            },
            (None, None) => Exit {
                code: 1,
                description: format!("rank {rank} ended with status {s}"),
            },
        },
        Err(e) => Exit {
            code: 1,
            description: format!("cannot wait for rank {rank}: {e}"),
        },
    }
}

type Alive = Arc<Mutex<Vec<Option<u32>>>>;

fn lock(alive: &Alive) -> std::sync::MutexGuard<'_, Vec<Option<u32>>> {
    alive
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn signal_all(alive: &Alive, signal: Signal) {
    // Under the lock, a pid is still ours: the watcher marks it None right after reaping it.
    let pids = lock(alive);
    for pid in pids.iter().flatten() {
        let Some(pid) = i32::try_from(*pid).ok().and_then(Pid::from_raw) else {
            continue;
        };
        // Each worker leads its own process group: the signal reaches what it started too. A
        // group already gone (ESRCH) is what we wanted.
        let _ = kill_process_group(pid, signal);
    }
}

fn terminate(alive: &Alive) {
    signal_all(alive, Signal::TERM);
}

fn kill(alive: &Alive) {
    signal_all(alive, Signal::KILL);
}

async fn relay(stream: impl AsyncRead + Unpin, prefix: Option<String>, stderr: bool) {
    let mut lines = BufReader::new(stream).lines();
    let mut out: Box<dyn tokio::io::AsyncWrite + Unpin + Send> = if stderr {
        Box::new(tokio::io::stderr())
    } else {
        Box::new(tokio::io::stdout())
    };
    while let Ok(Some(line)) = lines.next_line().await {
        let text = match &prefix {
            Some(p) => format!("{p}{line}\n"),
            None => format!("{line}\n"),
        };
        if out.write_all(text.as_bytes()).await.is_err() {
            break;
        }
        let _ = out.flush().await;
    }
}
