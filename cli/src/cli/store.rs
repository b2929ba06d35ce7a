//! `tensorwire store serve|set|get|add|wait|barrier|check|delete|num-keys`: a c10d-compatible store
//! server and a client for scripts and debugging. Both work with PyTorch's `TCPStore` too.

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;

use super::Usage;
use tensorwire_store::{
    ClientConfig, ClusterSecret, ServerConfig, Store, TcpStoreClient, TcpStoreServer,
};

/// Arguments of `tensorwire store`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Run a standalone store server until Ctrl-C (prints its address first).
    Serve {
        /// Port to listen on (0 picks a free one).
        #[arg(long)]
        port: u16,
        /// Address to listen on (all interfaces by default, as PyTorch's store).
        #[arg(long, default_value = "0.0.0.0")]
        host: IpAddr,
        /// File holding the cluster secret; clients must then authenticate, which PyTorch's
        /// clients cannot (leave it out for mixed jobs, on a trusted network).
        #[arg(long)]
        secret_file: Option<PathBuf>,
    },
    /// Set KEY to VALUE.
    Set {
        #[command(flatten)]
        client: ClientArgs,
        /// The key.
        key: String,
        /// The value (bytes of this argument).
        value: String,
    },
    /// Print the value of KEY (raw bytes, no newline), waiting for it up to --timeout.
    Get {
        #[command(flatten)]
        client: ClientArgs,
        /// The key.
        key: String,
    },
    /// Add DELTA (default 1) to the integer in KEY and print the new value.
    Add {
        #[command(flatten)]
        client: ClientArgs,
        /// The key.
        key: String,
        /// The amount to add.
        #[arg(default_value_t = 1, allow_negative_numbers = true)]
        delta: i64,
    },
    /// Wait until all KEYS exist (up to --timeout).
    Wait {
        #[command(flatten)]
        client: ClientArgs,
        /// The keys.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Count this process in at the barrier KEY and wait (up to --timeout) until WORLD_SIZE
    /// arrivals have been counted there; PyTorch's `store.barrier(KEY, WORLD_SIZE)`. The count
    /// stays in KEY: a later arrival on a reached KEY returns at once, and one that times out
    /// has still counted.
    Barrier {
        #[command(flatten)]
        client: ClientArgs,
        /// The barrier's key.
        key: String,
        /// How many arrivals release the barrier.
        #[arg(allow_negative_numbers = true)]
        world_size: i64,
    },
    /// Print `ready` (exit 0) when all KEYS exist, else `not ready` (exit 1).
    Check {
        #[command(flatten)]
        client: ClientArgs,
        /// The keys.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Delete KEY; prints `deleted` or `absent`.
    Delete {
        #[command(flatten)]
        client: ClientArgs,
        /// The key.
        key: String,
    },
    /// Print the number of keys in the store.
    NumKeys {
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Debug, clap::Args)]
struct ClientArgs {
    /// The store's address, HOST:PORT.
    #[arg(long, value_parser = host_port)]
    addr: String,
    /// Seconds to wait for the server, for keys and for replies.
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Prefix added to every key; "/" matches what PyTorch's TCPStore clients use.
    #[arg(long, default_value = "/")]
    prefix: String,
    /// File holding the cluster secret, when the server requires one.
    #[arg(long)]
    secret_file: Option<PathBuf>,
}

pub(crate) fn run(args: Args) -> ExitCode {
    // The server on one thread, as PyTorch's libuv store: a request is a read, a map lookup and a
    // write, so the cost is system calls and wake-ups, which a second worker thread only adds to
    // (hand-overs between threads) on a loaded machine.
    let mut builder = if matches!(args.command, Command::Serve { .. }) {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(execute(args.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            super::exit_code(&e)
        }
    }
}

/// `--addr` must be HOST:PORT: anything else is a usage error at once, not retries until the
/// timeout.
fn host_port(s: &str) -> Result<String, String> {
    match s.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(s.to_owned()),
        _ => Err(format!(
            "{s:?} is not HOST:PORT (a host and a port number, such as 127.0.0.1:29500)"
        )),
    }
}

fn read_secret(path: &Option<PathBuf>) -> anyhow::Result<Option<ClusterSecret>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let bytes = std::fs::read(path).map_err(|e| {
        Usage(format!(
            "cannot read the secret file {}: {e}",
            path.display()
        ))
    })?;
    // A trailing newline from `echo` is not part of the secret.
    let trimmed = bytes.strip_suffix(b"\n").unwrap_or(&bytes).to_vec();
    ClusterSecret::new(trimmed)
        .map(Some)
        .map_err(|_| Usage(format!("the secret file {} is empty", path.display())).into())
}

async fn connect(args: &ClientArgs) -> anyhow::Result<TcpStoreClient> {
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        return Err(Usage("--timeout must be a positive number of seconds".into()).into());
    }
    let timeout = Duration::from_secs_f64(args.timeout);
    let config = ClientConfig {
        timeout,
        connect_timeout: timeout,
        key_prefix: args.prefix.clone(),
        secret: read_secret(&args.secret_file)?,
        ..ClientConfig::default()
    };
    Ok(TcpStoreClient::connect(&args.addr, config).await?)
}

async fn execute(command: Command) -> anyhow::Result<ExitCode> {
    let mut stdout = std::io::stdout();
    match command {
        Command::Serve {
            port,
            host,
            secret_file,
        } => {
            let config = ServerConfig {
                secret: read_secret(&secret_file)?,
                ..ServerConfig::default()
            };
            if config.secret.is_none() {
                eprintln!(
                    "tensorwire store: warning: no --secret-file: any client that can reach \
                     {host}:{port} may read, change and delete every key (needed for PyTorch \
                     clients; keep it to a trusted network)"
                );
            }
            let server = TcpStoreServer::bind((host, port), config)
                .await
                .with_context(|| format!("cannot listen on {host}:{port}"))?;
            writeln!(
                stdout,
                "tensorwire store listening on {}",
                server.local_addr()
            )?;
            stdout.flush()?;
            wait_for_stop_signal().await?;
            server.shutdown().await;
            // Whoever started us may have stopped reading (a benchmark that read the address and
            // closed the pipe): a clean stop is still a clean stop, not a panic on EPIPE.
            let _ = writeln!(std::io::stdout(), "tensorwire store stopped");
        }
        Command::Set { client, key, value } => {
            connect(&client).await?.set(&key, value.as_bytes()).await?;
        }
        Command::Get { client, key } => {
            let value = connect(&client).await?.get(&key).await?;
            stdout.write_all(&value)?;
        }
        Command::Add { client, key, delta } => {
            let n = connect(&client).await?.add(&key, delta).await?;
            writeln!(stdout, "{n}")?;
        }
        Command::Wait { client, keys } => {
            let timeout = Duration::from_secs_f64(client.timeout);
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            connect(&client).await?.wait(&keys, timeout).await?;
        }
        Command::Barrier {
            client,
            key,
            world_size,
        } => {
            let timeout = Duration::from_secs_f64(client.timeout);
            connect(&client)
                .await?
                .barrier(&key, world_size, timeout)
                .await?;
        }
        Command::Check { client, keys } => {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let ready = connect(&client).await?.check(&keys).await?;
            writeln!(stdout, "{}", if ready { "ready" } else { "not ready" })?;
            if !ready {
                return Ok(ExitCode::from(1));
            }
        }
        Command::Delete { client, key } => {
            let deleted = connect(&client).await?.delete_key(&key).await?;
            writeln!(stdout, "{}", if deleted { "deleted" } else { "absent" })?;
        }
        Command::NumKeys { client } => {
            let n = connect(&client).await?.num_keys().await?;
            writeln!(stdout, "{n}")?;
        }
    }
    stdout.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// Ctrl-C (SIGINT), or SIGTERM on Unix.
async fn wait_for_stop_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r?,
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c().await?;
    Ok(())
}
