//! `tensorwire launch --nproc N -- PROGRAM ARGS...`: starts N local workers, torchrun-style.
//!
//! Each worker gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` and the cluster secret `TENSORWIRE_SECRET` (taken from the environment, from
//! `--secret-file`, or freshly generated; `--insecure` passes none and sets
//! `TENSORWIRE_INSECURE=1`). Output lines are prefixed with `[rank N]`. When a worker fails, the
//! others are stopped (SIGTERM, then SIGKILL after `--grace`), and the launcher exits with the
//! failed worker's code (128 + signal for a worker killed by a signal). Ctrl-C stops everyone.

use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

/// Arguments of `tensorwire launch`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Number of worker processes.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    nproc: u32,
    /// Address of rank 0's store server, given to every worker as MASTER_ADDR.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of rank 0's store server (MASTER_PORT); default: a free port.
    #[arg(long)]
    master_port: Option<u16>,
    /// Read the cluster secret from this file instead of TENSORWIRE_SECRET or a fresh one.
    #[arg(long, conflicts_with = "insecure")]
    secret_file: Option<PathBuf>,
    /// Run without a cluster secret (anyone who reaches the ports can join).
    #[arg(long)]
    insecure: bool,
    /// How long stopped workers get between SIGTERM and SIGKILL, in seconds.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// Do not prefix output lines with the worker's rank.
    #[arg(long)]
    no_prefix: bool,
    /// The program to run, and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<String>,
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
    let mut bytes = [0u8; 32];
    getrandom(&mut bytes)?;
    Ok(Some(bytes.iter().map(|b| format!("{b:02x}")).collect()))
}

fn getrandom(buf: &mut [u8]) -> Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .context("cannot read /dev/urandom to make a cluster secret")
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
    let port = match args.master_port {
        Some(p) => p,
        None => free_port(&args.master_addr)?,
    };
    let secret = secret(&args)?;
    let (program, rest) = args.command.split_first().context("no program given")?;

    // Pids of workers still running (None once reaped), so that no signal goes to a reused pid.
    let pids: Alive = Arc::new(Mutex::new(Vec::new()));
    let mut waits = JoinSet::new();
    let mut output = JoinSet::new();
    for rank in 0..args.nproc {
        let mut cmd = Command::new(program);
        cmd.args(rest)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", args.nproc.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so that stopping a worker stops what it started too.
            .process_group(0)
            .kill_on_drop(true);
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
                bail!("cannot start {program:?} for rank {rank}: {e}");
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
            lock(&alive)[rank as usize] = None;
            (rank, status)
        });
    }

    let mut failure: Option<Exit> = None;
    let interrupted = loop {
        tokio::select! {
            next = waits.join_next() => {
                let Some(joined) = next else { break false };
                let (rank, status) = joined.context("a worker watcher failed")?;
                let exit = describe(rank, status);
                if exit.code != 0 && failure.is_none() {
                    eprintln!("tensorwire launch: {}; stopping the other workers", exit.description);
                    terminate(&pids);
                    failure = Some(exit);
                    // Escalate after the grace period if anyone is still running.
                    let pids = Arc::clone(&pids);
                    let grace = Duration::from_secs_f64(args.grace);
                    tokio::spawn(async move {
                        tokio::time::sleep(grace).await;
                        kill(&pids);
                    });
                }
            }
            _ = tokio::signal::ctrl_c() => {
                eprintln!("tensorwire launch: interrupted; stopping the workers");
                terminate(&pids);
                let pids = Arc::clone(&pids);
                let grace = Duration::from_secs_f64(args.grace);
                tokio::spawn(async move {
                    tokio::time::sleep(grace).await;
                    kill(&pids);
                });
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
    if interrupted {
        return Ok(130);
    }
    Ok(failure.map_or(0, |f| f.code))
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

fn signal_all(alive: &Alive, signal: i32) {
    // Under the lock, a pid is still ours: the watcher marks it None right after reaping it.
    let pids = lock(alive);
    for pid in pids.iter().flatten() {
        let Ok(pid) = i32::try_from(*pid) else {
            continue;
        };
        // SAFETY: kill(2) has no memory-safety preconditions; the pid is a child not yet marked
        // as reaped, and it leads its own process group (the negative pid names the group).
        unsafe {
            libc::kill(-pid, signal);
        }
    }
}

fn terminate(alive: &Alive) {
    signal_all(alive, libc::SIGTERM);
}

fn kill(alive: &Alive) {
    signal_all(alive, libc::SIGKILL);
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
