//! `tensorwire store serve|set|get|add|wait|barrier|check|delete|num-keys`: a c10d-compatible store
//! server and a client for scripts and debugging. Both work with PyTorch's `TCPStore` too.

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, Context};

use super::Usage;
use tensorwire_store::{
    ClientConfig, ClusterSecret, ServerConfig, Store, TcpStoreClient, TcpStoreServer,
};

/// The bounds of `tensorwire store serve`; each left out keeps [`ServerConfig::default`]'s.
/// A client that reaches one has its connection closed, with a warning naming the bound and
/// the client; the others are served on.
#[derive(Debug, clap::Args)]
struct BoundArgs {
    /// Most connections open at once [default: 65536].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Seconds a connection may take to authenticate and validate [default: 30].
    #[arg(long, value_name = "SECONDS")]
    handshake_timeout: Option<f64>,
    /// Seconds a connection that has not validated may stay silent [default: 10].
    #[arg(long, value_name = "SECONDS")]
    unauthenticated_idle_timeout: Option<f64>,
    /// Most keys held, queue items included [default: 1048576].
    #[arg(long, value_name = "N")]
    max_keys: Option<usize>,
    /// Most bytes of keys and values held in all [default: 1073741824, 1 GiB].
    #[arg(long, value_name = "BYTES")]
    memory_budget: Option<usize>,
    /// Largest value, including what APPEND grows one to [default: 8388608, 8 MiB].
    #[arg(long, value_name = "BYTES")]
    max_value_size: Option<usize>,
    /// Largest request [default: 67108864, 64 MiB].
    #[arg(long, value_name = "BYTES")]
    max_request_size: Option<usize>,
    /// Largest reply to one request (MULTI_GET, LIST_KEYS) [default: 67108864, 64 MiB].
    #[arg(long, value_name = "BYTES")]
    max_response_size: Option<usize>,
    /// Reply bytes waiting for a client past which its requests are not read until it reads
    /// [default: 16777216, 16 MiB].
    #[arg(long, value_name = "BYTES")]
    max_queued_bytes: Option<usize>,
    /// Seconds a client with replies waiting may read none before it is dropped [default: 30].
    #[arg(long, value_name = "SECONDS")]
    write_stall_timeout: Option<f64>,
}

impl BoundArgs {
    /// `config` with the bounds given on the command line.
    fn apply(&self, mut config: ServerConfig) -> anyhow::Result<ServerConfig> {
        let seconds = |flag: &str, v: Option<f64>, default: Duration| match v {
            None => Ok(default),
            Some(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
            Some(s) => Err(anyhow!(
                "--{flag} must be a positive number of seconds, not {s}"
            )),
        };
        let count = |flag: &str, v: Option<usize>, default: usize| match v {
            None => Ok(default),
            Some(0) => Err(anyhow!("--{flag} must be at least 1")),
            Some(n) => Ok(n),
        };
        config.max_connections = count(
            "max-connections",
            self.max_connections,
            config.max_connections,
        )?;
        config.handshake_timeout = seconds(
            "handshake-timeout",
            self.handshake_timeout,
            config.handshake_timeout,
        )?;
        config.unauthenticated_idle_timeout = seconds(
            "unauthenticated-idle-timeout",
            self.unauthenticated_idle_timeout,
            config.unauthenticated_idle_timeout,
        )?;
        config.max_stored_keys = count("max-keys", self.max_keys, config.max_stored_keys)?;
        config.memory_budget = count("memory-budget", self.memory_budget, config.memory_budget)?;
        config.limits.max_value_len = count(
            "max-value-size",
            self.max_value_size,
            config.limits.max_value_len,
        )?;
        config.limits.max_request_len = count(
            "max-request-size",
            self.max_request_size,
            config.limits.max_request_len,
        )?;
        config.max_response_len = count(
            "max-response-size",
            self.max_response_size,
            config.max_response_len,
        )?;
        config.max_queued_bytes = count(
            "max-queued-bytes",
            self.max_queued_bytes,
            config.max_queued_bytes,
        )?;
        config.write_stall_timeout = seconds(
            "write-stall-timeout",
            self.write_stall_timeout,
            config.write_stall_timeout,
        )?;
        Ok(config)
    }
}

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
        /// The server's bounds (PyTorch's server has none).
        #[command(flatten)]
        bounds: BoundArgs,
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
            bounds,
        } => {
            let config = bounds.apply(ServerConfig {
                secret: read_secret(&secret_file)?,
                ..ServerConfig::default()
            })?;
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
            // Installed before the address is printed: whoever reads it may stop us at once.
            let stop = stop_signal()?;
            writeln!(
                stdout,
                "tensorwire store listening on {}",
                server.local_addr()
            )?;
            stdout.flush()?;
            stop.await?;
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

/// Ctrl-C (SIGINT), or SIGTERM on Unix: the handlers are installed when this is called, and
/// the future it returns ends at the first of the signals.
fn stop_signal() -> anyhow::Result<impl std::future::Future<Output = anyhow::Result<()>>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        Ok(async move {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
            Ok(())
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        tokio::signal::ctrl_c().await?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, clap::Parser)]
    struct Serve {
        #[command(flatten)]
        bounds: BoundArgs,
    }

    fn config(args: &[&str]) -> anyhow::Result<ServerConfig> {
        let parsed = Serve::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))?;
        parsed.bounds.apply(ServerConfig::default())
    }

    #[test]
    fn bounds_left_out_keep_the_defaults_the_help_names() {
        let c = config(&[]).unwrap();
        let d = ServerConfig::default();
        assert_eq!(c.max_connections, 65_536);
        assert_eq!(c.handshake_timeout, Duration::from_secs(30));
        assert_eq!(c.unauthenticated_idle_timeout, Duration::from_secs(10));
        assert_eq!(c.max_stored_keys, 1_048_576);
        assert_eq!(c.memory_budget, 1 << 30);
        assert_eq!(c.limits, d.limits);
        assert_eq!(c.limits.max_value_len, 8 << 20);
        assert_eq!(c.limits.max_request_len, 64 << 20);
        assert_eq!(c.max_response_len, 64 << 20);
        assert_eq!(c.max_queued_bytes, 16 << 20);
        assert_eq!(c.write_stall_timeout, Duration::from_secs(30));
    }

    #[test]
    fn each_bound_has_its_flag_and_nonsense_is_refused() {
        let c = config(&[
            "--max-connections=2",
            "--handshake-timeout=1.5",
            "--unauthenticated-idle-timeout=0.5",
            "--max-keys=3",
            "--memory-budget=4",
            "--max-value-size=5",
            "--max-request-size=6",
            "--max-response-size=7",
            "--max-queued-bytes=8",
            "--write-stall-timeout=9",
        ])
        .unwrap();
        assert_eq!(c.max_connections, 2);
        assert_eq!(c.handshake_timeout, Duration::from_millis(1500));
        assert_eq!(c.unauthenticated_idle_timeout, Duration::from_millis(500));
        assert_eq!(
            (c.max_stored_keys, c.memory_budget, c.limits.max_value_len),
            (3, 4, 5)
        );
        assert_eq!(
            (
                c.limits.max_request_len,
                c.max_response_len,
                c.max_queued_bytes
            ),
            (6, 7, 8)
        );
        assert_eq!(c.write_stall_timeout, Duration::from_secs(9));
        let err = config(&["--handshake-timeout=0"]).unwrap_err();
        assert!(err.to_string().contains("--handshake-timeout"), "{err}");
        let err = config(&["--max-keys=0"]).unwrap_err();
        assert!(err.to_string().contains("--max-keys"), "{err}");
    }
}
