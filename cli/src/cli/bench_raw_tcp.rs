//! The raw TCP baseline: blocking std sockets, no framing, an echo process (`bench raw-echo`)
//! serving each connection on a thread.

use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::bench_common::SMALL;

/// Modes of a raw connection, named once in its first message (never per exchange, so the
/// baseline carries no framing at all).
const RAW_PING: u8 = 1;
const RAW_BULK: u8 = 2;

/// Serves one raw connection: echoes [`SMALL`]-byte messages, or acknowledges each transfer
/// of the announced size with one byte, until the client closes.
fn raw_connection(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut setup = [0u8; 9];
    s.read_exact(&mut setup)?;
    let size = u64::from_le_bytes(setup[1..].try_into().unwrap_or_default()) as usize;
    let mut buf = vec![0u8; if setup[0] == RAW_PING { SMALL } else { size }];
    loop {
        match s.read_exact(&mut buf) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        if setup[0] == RAW_PING {
            s.write_all(&buf)?;
        } else {
            s.write_all(&[1])?;
        }
    }
}

/// The raw baseline's client: blocking sockets to echo threads, one connection per kind of
/// exchange.
pub(crate) struct Raw {
    /// Ping-pong connections, each served by its own echo thread.
    pings: Vec<TcpStream>,
    bulk: Vec<(usize, TcpStream)>,
    /// The raw echo process.
    server: std::process::Child,
}

/// Accepts `connections` raw connections on `listener` and serves each on a thread.
fn raw_serve(listener: TcpListener, connections: usize) -> std::io::Result<()> {
    let mut handlers = Vec::new();
    for _ in 0..connections {
        let (s, _) = listener.accept()?;
        handlers.push(std::thread::spawn(move || raw_connection(s)));
    }
    for h in handlers {
        h.join()
            .map_err(|_| std::io::Error::other("raw echo thread panicked"))??;
    }
    Ok(())
}

/// `bench raw-echo`: serves raw connections in this process; prints its address first.
pub(crate) fn raw_echo(connections: usize) -> Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("{}", listener.local_addr()?);
    std::io::stdout().flush()?;
    raw_serve(listener, connections)?;
    Ok(())
}

impl Raw {
    /// The baseline with its echo in another process (this binary, `bench raw-echo`).
    pub(crate) fn start_process(bulk_sizes: &[usize]) -> Result<Self> {
        Self::start_process_pings(1, bulk_sizes)
    }

    /// The baseline with `pings` ping-pong connections (at least 1) to the echo process, for
    /// round trips spread over several peers ([`Raw::pingpong_round_robin`]).
    pub(crate) fn start_process_pings(pings: usize, bulk_sizes: &[usize]) -> Result<Self> {
        let pings = pings.max(1);
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .args(["bench", "raw-echo", "--connections"])
            .arg((pings + bulk_sizes.len()).to_string())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("starting the raw echo process")?;
        let mut line = String::new();
        let read = child
            .stdout
            .take()
            .map(|out| std::io::BufReader::new(out).read_line(&mut line));
        let addr = match read {
            Some(Ok(_)) => line.trim().parse::<SocketAddr>().ok(),
            _ => None,
        };
        let Some(addr) = addr else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the raw echo process did not report its address (got {line:?})");
        };
        Self::connect(addr, pings, bulk_sizes, child)
    }

    fn connect(
        addr: SocketAddr,
        pings: usize,
        bulk_sizes: &[usize],
        server: std::process::Child,
    ) -> Result<Self> {
        let open = |mode: u8, size: usize| -> Result<TcpStream> {
            let mut s = TcpStream::connect(addr)?;
            s.set_nodelay(true)?;
            let mut setup = [mode; 9];
            setup[1..].copy_from_slice(&(size as u64).to_le_bytes());
            s.write_all(&setup)?;
            Ok(s)
        };
        let pings = (0..pings)
            .map(|_| open(RAW_PING, SMALL))
            .collect::<Result<_>>()?;
        let bulk = bulk_sizes
            .iter()
            .map(|&size| Ok((size, open(RAW_BULK, size)?)))
            .collect::<Result<_>>()?;
        Ok(Raw {
            pings,
            bulk,
            server,
        })
    }

    /// `n` round trips of [`SMALL`] bytes on the first connection; the time of each.
    pub(crate) fn pingpong(&mut self, n: usize) -> Result<Vec<Duration>> {
        self.pingpong_on(n, 1)
    }

    /// `n` round trips of [`SMALL`] bytes, each on the next of the ping-pong connections in
    /// turn; the time of each.
    pub(crate) fn pingpong_round_robin(&mut self, n: usize) -> Result<Vec<Duration>> {
        self.pingpong_on(n, self.pings.len())
    }

    fn pingpong_on(&mut self, n: usize, connections: usize) -> Result<Vec<Duration>> {
        let msg = [7u8; SMALL];
        let mut back = [0u8; SMALL];
        let mut times = Vec::with_capacity(n);
        for i in 0..n {
            let s = &mut self.pings[i % connections];
            let t = Instant::now();
            s.write_all(&msg)?;
            s.read_exact(&mut back)?;
            times.push(t.elapsed());
        }
        Ok(times)
    }

    /// Sends `data` and waits for the 1-byte acknowledgement.
    pub(crate) fn bulk(&mut self, data: &[u8]) -> Result<Duration> {
        let s = self
            .bulk
            .iter_mut()
            .find(|(size, _)| *size == data.len())
            .map(|(_, s)| s)
            .context("no raw connection for this transfer size")?;
        let t = Instant::now();
        s.write_all(data)?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)?;
        Ok(t.elapsed())
    }

    pub(crate) fn finish(self) -> Result<()> {
        drop(self.pings);
        drop(self.bulk);
        let mut server = self.server;
        let status = server.wait()?;
        if !status.success() {
            bail!("the raw echo process failed: {status}");
        }
        Ok(())
    }
}
