//! A world of worker processes for the multi-process tests: rank 0 starts with
//! `MASTER_PORT=0`, says where its store listens (see [`crate::announce_store_addr`]), and the
//! other ranks start with that port, so no port is reserved and released first.
//!
//! Every line the workers print is read on threads of its own and kept in order
//! ([`World::seen`]). Nothing here sleeps to wait: lines are waited for on their channel, exits
//! on threads that wait for the process, each with a deadline, after which the workers are
//! killed and the error shows every line seen.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Worlds started by this test process: each gets a cluster secret of its own.
static WORLDS_STARTED: AtomicUsize = AtomicUsize::new(0);

/// One worker process and the threads reading its output.
struct Worker {
    child: Option<Child>,
    readers: Vec<JoinHandle<()>>,
}

impl Worker {
    fn start(
        command: &WorldCommand<'_>,
        rank: usize,
        port: &str,
        secret: &str,
        lines: &mpsc::Sender<(usize, String)>,
    ) -> Worker {
        let mut child = Command::new(command.bin)
            .arg(command.scenario)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", command.n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port)
            .env("TENSORWIRE_SECRET", secret)
            .envs(command.env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", command.bin.display()));
        let streams = [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ];
        let readers = streams
            .into_iter()
            .flatten()
            .map(|stream| {
                let tx = lines.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stream).lines().map_while(Result::ok) {
                        let _ = tx.send((rank, line));
                    }
                })
            })
            .collect();
        Worker {
            child: Some(child),
            readers,
        }
    }
}

impl Drop for Worker {
    /// Nothing is left running: a worker still there (a stopped one too) is resumed and killed.
    fn drop(&mut self) {
        let Some(child) = &mut self.child else {
            return;
        };
        if let Ok(None) = child.try_wait() {
            // SAFETY: signals to a child of ours that has not been reaped (try_wait said so).
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGCONT) };
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What a [`World`] runs: `bin SCENARIO` on `n` ranks with `env` added.
pub struct WorldCommand<'a> {
    /// The worker binary (see [`crate::worker_bin`]).
    pub bin: &'a std::path::Path,
    /// The scenario, the worker's only argument.
    pub scenario: &'a str,
    /// The world size.
    pub n: usize,
    /// Environment added to every worker's.
    pub env: &'a [(&'a str, &'a str)],
}

/// Worker processes of one world, and every line they printed.
pub struct World {
    workers: Vec<Worker>,
    lines: mpsc::Receiver<(usize, String)>,
    seen: Vec<(usize, String)>,
    /// Lines of `seen` already handed out by [`World::next_line`] or passed by
    /// [`World::wait_for`].
    taken: usize,
    skipped: Option<String>,
}

impl World {
    /// Starts rank 0, waits (up to `limit`) for it to say where its store listens (the
    /// rendezvous's log line, or `PORT <port>`), then starts the other ranks. A rank 0 that
    /// prints `SKIPPED: …` (no device for its backend) is the only process started
    /// ([`World::skipped`]).
    pub fn start(command: WorldCommand<'_>, limit: Duration) -> Result<World, String> {
        let secret = format!(
            "test-secret-{}-{}",
            std::process::id(),
            WORLDS_STARTED.fetch_add(1, Ordering::Relaxed)
        );
        let (tx, lines) = mpsc::channel();
        let mut world = World {
            workers: vec![Worker::start(&command, 0, "0", &secret, &tx)],
            lines,
            seen: Vec::new(),
            taken: 0,
            skipped: None,
        };
        // The lines read here stay untaken: the test may wait for them too.
        let deadline = Instant::now() + limit;
        let announced = loop {
            if let Some((_, line)) = world.seen.iter().find(|(r, l)| {
                *r == 0
                    && (l.contains("hosts the store")
                        || l.starts_with("PORT ")
                        || l.starts_with("SKIPPED"))
            }) {
                break line.clone();
            }
            if let Err(e) = world.read_one(deadline) {
                return Err(format!(
                    "rank 0 never said where its store listens ({e}): {:#?}",
                    world.seen
                ));
            }
        };
        if announced.starts_with("SKIPPED") {
            world.skipped = Some(announced);
            return Ok(world);
        }
        let port = match announced.strip_prefix("PORT ") {
            Some(port) => port.trim().to_owned(),
            None => announced
                .split_whitespace()
                .find_map(|w| w.strip_prefix("addr="))
                .and_then(|a| a.rsplit_once(':'))
                .map(|(_, p)| p.to_owned())
                .ok_or_else(|| format!("no addr=HOST:PORT in {announced:?}"))?,
        };
        for rank in 1..command.n {
            world
                .workers
                .push(Worker::start(&command, rank, &port, &secret, &tx));
        }
        Ok(world)
    }

    /// The `SKIPPED: …` line of a rank 0 that had no device for its backend.
    pub fn skipped(&self) -> Option<&str> {
        self.skipped.as_deref()
    }

    /// Every line read so far, in the order read, tagged with its rank.
    pub fn seen(&self) -> &[(usize, String)] {
        &self.seen
    }

    /// Reads one more line into `seen`, waiting until `deadline`.
    fn read_one(&mut self, deadline: Instant) -> Result<(), String> {
        match self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(line) => {
                self.seen.push(line);
                Ok(())
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err("no line came in time".into()),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err("every worker closed its output".into())
            }
        }
    }

    /// The next line not yet taken, waiting up to `limit` for it.
    pub fn next_line(&mut self, limit: Duration) -> Option<(usize, String)> {
        if self.taken == self.seen.len() {
            self.read_one(Instant::now() + limit).ok()?;
        }
        self.taken += 1;
        Some(self.seen[self.taken - 1].clone())
    }

    /// The first line not yet taken for which `wanted(rank, line)` holds, waiting up to
    /// `limit`; the lines before it are taken too.
    pub fn wait_for(
        &mut self,
        limit: Duration,
        wanted: impl Fn(usize, &str) -> bool,
    ) -> Result<String, String> {
        let deadline = Instant::now() + limit;
        loop {
            while self.taken < self.seen.len() {
                let (rank, line) = &self.seen[self.taken];
                self.taken += 1;
                if wanted(*rank, line) {
                    return Ok(line.clone());
                }
            }
            if let Err(e) = self.read_one(deadline) {
                return Err(format!(
                    "no such line within {limit:?} ({e}): {:#?}",
                    self.seen
                ));
            }
        }
    }

    /// The process of `rank` (to signal it or write to its stdin); `None` once it was waited
    /// for.
    pub fn child(&mut self, rank: usize) -> Option<&mut Child> {
        self.workers.get_mut(rank)?.child.as_mut()
    }

    /// Kills `rank` and drops its process (reaped).
    pub fn kill(&mut self, rank: usize) {
        if let Some(mut child) = self.workers[rank].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits for the workers `ranks` to exit (killing them after `limit`) and reads all they
    /// printed: their exit codes, in the order of `ranks`.
    pub fn exits(&mut self, ranks: &[usize], limit: Duration) -> Result<Vec<Option<i32>>, String> {
        let (tx, rx) = mpsc::channel();
        let mut waiting = Vec::new();
        let mut codes = vec![None; ranks.len()];
        let mut expected = 0;
        for (at, &rank) in ranks.iter().enumerate() {
            let Some(mut child) = self.workers.get_mut(rank).and_then(|w| w.child.take()) else {
                continue; // killed or not started (skipped): no exit code
            };
            expected += 1;
            let pid = child.id() as libc::pid_t;
            let tx = tx.clone();
            waiting.push((
                pid,
                std::thread::spawn(move || {
                    let code = child.wait().ok().and_then(|s| s.code());
                    let _ = tx.send((at, code));
                }),
            ));
        }
        drop(tx);
        let deadline = Instant::now() + limit;
        let mut late = false;
        for _ in 0..expected {
            let (at, code) =
                match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(got) => got,
                    Err(_) => {
                        late = true;
                        for (pid, waiter) in &waiting {
                            if !waiter.is_finished() {
                                // SAFETY: its waiter has not reaped it yet.
                                unsafe { libc::kill(*pid, libc::SIGKILL) };
                            }
                        }
                        rx.recv().map_err(|e| e.to_string())?
                    }
                };
            codes[at] = code;
        }
        for (_, waiter) in waiting {
            let _ = waiter.join();
        }
        for &rank in ranks {
            if let Some(worker) = self.workers.get_mut(rank) {
                for reader in worker.readers.drain(..) {
                    let _ = reader.join();
                }
            }
        }
        self.seen.extend(self.lines.try_iter());
        if late {
            return Err(format!(
                "ranks {ranks:?} still running after {limit:?}; output: {:#?}",
                self.seen
            ));
        }
        Ok(codes)
    }

    /// Waits for every worker to exit (panicking, with every line seen, if one is still
    /// running after `limit`): the exit codes by rank and every line printed.
    pub fn finish(mut self, limit: Duration) -> (Vec<Option<i32>>, Vec<(usize, String)>) {
        let ranks: Vec<usize> = (0..self.workers.len()).collect();
        let codes = self.exits(&ranks, limit).unwrap_or_else(|e| panic!("{e}"));
        (codes, std::mem::take(&mut self.seen))
    }
}
