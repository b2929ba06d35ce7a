//! The raw barriers of `bench collectives` and `bench curve collectives`: the dissemination
//! barrier the process groups run, among `world` *processes* (the shape of the groups measured
//! against them: one process per rank), without framing, agent or runtime.
//!
//! In round k, rank r signals rank r + 2^k and waits for rank r - 2^k (modulo the world). Two
//! media:
//! - [`Medium::Tcp`]: one byte over blocking loopback sockets, one socket per pair of ranks;
//! - [`Medium::Shm`]: a counter per (rank, round) on its own cache line of a shared memfd,
//!   polled while the processes have a core each, `sched_yield` between looks otherwise (the
//!   rule of [`tensorwire_core::spin`]).
//!
//! [`copies`] runs the shared-memory barrier with a `memcpy` of a given size after each, in
//! every rank: the `memcpy` floor of a collective in the shape of the group (every rank copying
//! what it must receive at once, on the cores they share), beside the one-process floor.
//!
//! Rank 0 runs in this process and is timed; ranks 1.. are this binary re-run with the hidden
//! `bench raw-barrier-rank`, given the descriptors they inherit. The same barrier among threads
//! of one process ([`threads`]) is kept beside it: thread switches are cheaper than process
//! switches, so it is the lower figure, and the two together show what the process shape costs.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How long a rank waits for a signal before giving up.
const PATIENCE: Duration = Duration::from_secs(30);

/// What the ranks signal each other over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Medium {
    /// One byte over a loopback TCP socket per pair of ranks.
    Tcp,
    /// Counters in shared memory.
    Shm,
}

/// Arguments of the hidden `bench raw-barrier-rank`.
#[derive(Debug, clap::Args)]
pub(crate) struct RankArgs {
    /// This rank (1 or more: rank 0 is the process that started it).
    #[arg(long)]
    rank: usize,
    /// Ranks in all.
    #[arg(long)]
    world: usize,
    /// Barriers to run (the first tenth are warm-up, as rank 0 counts them).
    #[arg(long)]
    iters: usize,
    /// The medium.
    #[arg(long, value_enum)]
    medium: Medium,
    /// With `tcp`: the inherited socket to each other rank, as `peer:fd`, comma-separated.
    #[arg(long, value_delimiter = ',')]
    sockets: Vec<String>,
    /// With `shm`: the inherited memfd of the counters.
    #[arg(long)]
    fd: Option<i32>,
    /// Bytes to copy (`memcpy`, private buffers) after each barrier ([`copies`]); 0: none.
    #[arg(long, default_value_t = 0)]
    copy_bytes: usize,
    /// The size of the buffers the bytes are copied through, again and again until all are
    /// copied ([`copies`]); 0: the bytes' own size, one copy.
    #[arg(long, default_value_t = 0)]
    copy_window: usize,
}

/// What each rank copies after each barrier: `bytes` in all, through buffers of `window` bytes
/// (the last piece shorter); none if `bytes` is 0.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CopyPlan {
    /// Bytes copied in all.
    pub(crate) bytes: usize,
    /// The buffers' size (clamped to 1..=bytes).
    pub(crate) window: usize,
}

impl CopyPlan {
    const NONE: CopyPlan = CopyPlan {
        bytes: 0,
        window: 0,
    };

    /// The length of the buffers copied between.
    pub(crate) fn buffer_len(self) -> usize {
        if self.window == 0 {
            self.bytes
        } else {
            self.window.min(self.bytes)
        }
    }

    /// Copies `bytes` from `src` to `dst` (both `buffer_len` long), a window at a time.
    pub(crate) fn run(self, src: &[u8], dst: &mut [u8]) {
        let mut left = self.bytes;
        while left > 0 {
            let n = left.min(src.len());
            dst[..n].copy_from_slice(std::hint::black_box(&src[..n]));
            std::hint::black_box(&mut *dst);
            left -= n;
        }
    }
}

/// Rounds of the dissemination barrier among `world` ranks.
fn rounds(world: usize) -> usize {
    (usize::BITS - world.saturating_sub(1).leading_zeros()) as usize
}

/// Whether `world` busy ranks outnumber the cores this process may run on.
fn outnumbered(world: usize) -> bool {
    world > std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// One rank's side of the barrier: signal a rank, wait for one.
trait Links {
    /// Rank `to` may pass round `k` of barrier `epoch` (1, 2, ...) as far as we are concerned.
    fn signal(&mut self, to: usize, k: usize) -> Result<()>;
    /// Waits until rank `from` signalled round `k` of barrier `epoch`.
    fn wait(&mut self, from: usize, k: usize, epoch: u64) -> Result<()>;
}

/// Runs `total` barriers as `rank`, each followed by the copy `copy` plans (none if empty); the
/// times of those after the first tenth. With a copy, a barrier waits for every rank's previous
/// copy, so each time is that of the slowest rank's copy.
fn run_rank(
    rank: usize,
    world: usize,
    total: usize,
    copy: CopyPlan,
    links: &mut impl Links,
) -> Result<Vec<Duration>> {
    let warm = total / 11;
    let mut times = Vec::with_capacity(total - warm);
    // Faulted in before the first barrier (the floor is the copy, not the page faults).
    let src = vec![7u8; copy.buffer_len()];
    let mut dst = vec![0u8; copy.buffer_len()];
    dst.copy_from_slice(&src);
    for i in 0..total {
        let t = Instant::now();
        let mut distance = 1;
        let mut k = 0;
        while distance < world {
            links.signal((rank + distance) % world, k)?;
            links.wait((rank + world - distance) % world, k, i as u64 + 1)?;
            distance *= 2;
            k += 1;
        }
        copy.run(&src, &mut dst);
        if i >= warm {
            times.push(t.elapsed());
        }
    }
    Ok(times)
}

/// TCP links: `peers[j]` is the socket to rank j.
struct TcpLinks {
    peers: Vec<Option<TcpStream>>,
}

impl Links for TcpLinks {
    fn signal(&mut self, to: usize, _k: usize) -> Result<()> {
        let s = self.peers[to].as_mut().context("no socket to that rank")?;
        s.write_all(&[1]).context("raw barrier: sending")
    }

    fn wait(&mut self, from: usize, k: usize, _epoch: u64) -> Result<()> {
        let s = self.peers[from]
            .as_mut()
            .context("no socket from that rank")?;
        let mut byte = [0u8; 1];
        s.read_exact(&mut byte)
            .with_context(|| format!("raw barrier: waiting for rank {from} in round {k}"))
    }
}

/// A socket per pair of ranks: `[i][j]` is rank i's end towards rank j.
#[allow(clippy::needless_range_loop)] // pairs (i, j) fill both conns[i][j] and conns[j][i]
fn socket_pairs(world: usize) -> Result<Vec<Vec<Option<TcpStream>>>> {
    let mut conns: Vec<Vec<Option<TcpStream>>> = (0..world)
        .map(|_| (0..world).map(|_| None).collect())
        .collect();
    let listener = TcpListener::bind("127.0.0.1:0")?;
    for i in 0..world {
        for j in i + 1..world {
            let a = TcpStream::connect(listener.local_addr()?)?;
            let (b, _) = listener.accept()?;
            for s in [&a, &b] {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(PATIENCE))?;
            }
            conns[i][j] = Some(a);
            conns[j][i] = Some(b);
        }
    }
    Ok(conns)
}

/// The counters in shared memory: `[rank * rounds + k]` counts the signals rank got for
/// round k, each on its own cache line.
struct Counters {
    ptr: *mut u8,
    len: usize,
    rounds: usize,
    yield_each: bool,
}

/// Bytes between counters (one cache line each).
const LINE: usize = 64;

impl Counters {
    fn len_for(world: usize) -> usize {
        (world * rounds(world).max(1) * LINE).next_multiple_of(4096)
    }

    fn map(fd: impl AsFd, world: usize) -> Result<Self> {
        let len = Self::len_for(world);
        let size = rustix::fs::fstat(&fd)
            .context("the raw barrier's memfd")?
            .st_size;
        if size < len as i64 {
            bail!("the raw barrier's memfd holds {size} bytes, not {len}");
        }
        // Unmapped only on drop; every access to it is atomic.
        let ptr = super::bench_raw_shm::map_shared(fd, len, "the raw barrier's counters")?;
        Ok(Counters {
            ptr,
            len,
            rounds: rounds(world),
            yield_each: outnumbered(world),
        })
    }

    fn counter(&self, rank: usize, k: usize) -> &AtomicU64 {
        let offset = (rank * self.rounds + k) * LINE;
        assert!(offset + LINE <= self.len, "counter out of the mapping");
        // SAFETY: in bounds (above), 64-byte aligned in a page-aligned mapping that lives as
        // long as `self`.
        unsafe { &*self.ptr.add(offset).cast::<AtomicU64>() }
    }
}

impl Drop for Counters {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length; no reference into it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// Shared-memory links of one rank.
struct ShmLinks {
    counters: Counters,
    rank: usize,
    /// How long a wait may take before it fails ([`PATIENCE`]).
    patience: Duration,
}

impl Links for ShmLinks {
    fn signal(&mut self, to: usize, k: usize) -> Result<()> {
        self.counters.counter(to, k).fetch_add(1, Ordering::Release);
        Ok(())
    }

    fn wait(&mut self, from: usize, k: usize, epoch: u64) -> Result<()> {
        let mine = self.counters.counter(self.rank, k);
        let started = Instant::now();
        let mut spins = 0u32;
        while mine.load(Ordering::Acquire) < epoch {
            if self.counters.yield_each {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            spins = spins.wrapping_add(1);
            if spins % (1 << 16) == 0 && started.elapsed() > self.patience {
                bail!(
                    "raw barrier: rank {} waited {:?} for rank {from} in round {k}",
                    self.rank,
                    self.patience
                );
            }
        }
        Ok(())
    }
}

/// A descriptor a child inherits: close-on-exec cleared while it is spawned.
fn inheritable(fd: impl AsFd, on: bool) -> Result<()> {
    let flags = if on {
        rustix::io::FdFlags::empty()
    } else {
        rustix::io::FdFlags::CLOEXEC
    };
    rustix::io::fcntl_setfd(fd, flags).context("marking a descriptor for the raw barrier's ranks")
}

/// The median time of rank 0's barriers among `world` processes over `medium`, in µs (after a
/// tenth as many for warm-up).
pub(crate) fn processes(medium: Medium, world: usize, iters: usize) -> Result<f64> {
    processes_copying(medium, world, iters, CopyPlan::NONE)
}

/// The `memcpy` floor in the group's shape: `world` processes pass the shared-memory barrier
/// and then each copies what `copy` plans (between private buffers faulted in beforehand),
/// `iters` times (after a tenth as many for warm-up); the median of rank 0's barrier-and-copy,
/// in µs. With more ranks than cores, the ranks share the cores for their copies as a
/// collective's ranks do.
pub(crate) fn copies(world: usize, copy: CopyPlan, iters: usize) -> Result<f64> {
    processes_copying(Medium::Shm, world, iters, copy)
}

fn processes_copying(medium: Medium, world: usize, iters: usize, copy: CopyPlan) -> Result<f64> {
    if world < 2 {
        bail!("a raw barrier needs 2 ranks or more, not {world}");
    }
    let total = iters + iters / 10;
    let exe = std::env::current_exe()?;
    let mut children = Vec::with_capacity(world - 1);
    let times = match medium {
        Medium::Tcp => {
            let mut conns = socket_pairs(world)?;
            for (rank, peers) in conns.iter().enumerate().skip(1) {
                let fds: Vec<String> = peers
                    .iter()
                    .enumerate()
                    .filter_map(|(j, s)| s.as_ref().map(|s| format!("{j}:{}", s.as_raw_fd())))
                    .collect();
                for s in peers.iter().flatten() {
                    inheritable(s, true)?;
                }
                let child = spawn_rank(&exe, medium, rank, world, total, copy)
                    .arg("--sockets")
                    .arg(fds.join(","))
                    .spawn();
                for s in peers.iter().flatten() {
                    inheritable(s, false)?;
                }
                children.push(child.context("starting a raw barrier rank")?);
            }
            // Only the children hold their ends now.
            let mine = std::mem::take(&mut conns[0]);
            drop(conns);
            run_rank(0, world, total, copy, &mut TcpLinks { peers: mine })
        }
        Medium::Shm => {
            let fd: OwnedFd =
                rustix::fs::memfd_create("tensorwire-raw-barrier", rustix::fs::MemfdFlags::empty())
                    .context("memfd_create for the raw barrier")?;
            rustix::fs::ftruncate(&fd, Counters::len_for(world) as u64)
                .context("sizing the raw barrier's counters")?;
            let counters = Counters::map(&fd, world)?;
            for rank in 1..world {
                let child = spawn_rank(&exe, medium, rank, world, total, copy)
                    .arg("--fd")
                    .arg(fd.as_raw_fd().to_string())
                    .spawn()
                    .context("starting a raw barrier rank")?;
                children.push(child);
            }
            drop(fd);
            run_rank(
                0,
                world,
                total,
                copy,
                &mut ShmLinks {
                    counters,
                    rank: 0,
                    patience: PATIENCE,
                },
            )
        }
    };
    let mut failed = None;
    for (i, mut child) in children.into_iter().enumerate() {
        if times.is_err() {
            let _ = child.kill();
        }
        let status = child.wait()?;
        if !status.success() && failed.is_none() {
            failed = Some(format!("raw barrier rank {} failed: {status}", i + 1));
        }
    }
    let times = times?;
    if let Some(why) = failed {
        bail!(why);
    }
    Ok(super::bench_common::median_us(times))
}

fn spawn_rank(
    exe: &std::path::Path,
    medium: Medium,
    rank: usize,
    world: usize,
    total: usize,
    copy: CopyPlan,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["bench", "raw-barrier-rank", "--medium"])
        .arg(match medium {
            Medium::Tcp => "tcp",
            Medium::Shm => "shm",
        })
        .args(["--rank", &rank.to_string()])
        .args(["--world", &world.to_string()])
        .args(["--iters", &total.to_string()])
        .args(["--copy-bytes", &copy.bytes.to_string()])
        .args(["--copy-window", &copy.window.to_string()])
        .stdin(std::process::Stdio::null());
    cmd
}

/// `bench raw-barrier-rank`: one rank of [`processes`], over the descriptors it inherited.
pub(crate) fn rank(args: &RankArgs) -> Result<()> {
    let usage = |m: String| -> anyhow::Error { super::Usage(m).into() };
    if args.world < 2 || args.rank == 0 || args.rank >= args.world {
        return Err(usage(format!(
            "--rank {} of --world {}: a raw barrier rank is 1 to world - 1",
            args.rank, args.world
        )));
    }
    match args.medium {
        Medium::Tcp => {
            let mut peers: Vec<Option<TcpStream>> = (0..args.world).map(|_| None).collect();
            for s in &args.sockets {
                let parsed = s
                    .split_once(':')
                    .and_then(|(j, fd)| Some((j.parse::<usize>().ok()?, fd.parse::<i32>().ok()?)));
                let Some((j, fd)) =
                    parsed.filter(|&(j, fd)| j < args.world && j != args.rank && fd >= 0)
                else {
                    return Err(usage(format!("--sockets: {s:?} is not peer:fd")));
                };
                rustix::fs::fstat(
                    // SAFETY: only borrowed to check that it is open.
                    unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
                )
                .map_err(|_| usage(format!("--sockets: {fd} is not an open descriptor")))?;
                // SAFETY: the parent passed this open socket for this process alone.
                peers[j] = Some(unsafe { TcpStream::from_raw_fd(fd) });
            }
            if let Some(j) = (0..args.world).find(|&j| j != args.rank && peers[j].is_none()) {
                return Err(usage(format!("--sockets names no socket to rank {j}")));
            }
            run_rank(
                args.rank,
                args.world,
                args.iters,
                CopyPlan {
                    bytes: args.copy_bytes,
                    window: args.copy_window,
                },
                &mut TcpLinks { peers },
            )?;
        }
        Medium::Shm => {
            let Some(fd) = args.fd.filter(|&fd| fd >= 0) else {
                return Err(usage("--medium shm needs --fd".into()));
            };
            rustix::fs::fstat(
                // SAFETY: only borrowed to check that it is open.
                unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
            )
            .map_err(|_| usage(format!("--fd {fd} is not an open descriptor")))?;
            // SAFETY: the parent passed this memfd, inherited and open, for this process alone.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let counters = Counters::map(&fd, args.world)?;
            drop(fd);
            let mut links = ShmLinks {
                counters,
                rank: args.rank,
                patience: PATIENCE,
            };
            run_rank(
                args.rank,
                args.world,
                args.iters,
                CopyPlan {
                    bytes: args.copy_bytes,
                    window: args.copy_window,
                },
                &mut links,
            )?;
        }
    }
    Ok(())
}

/// The same barrier among `world` threads of this process (cheaper switches than processes):
/// the median of rank 0's times, in µs.
pub(crate) fn threads(medium: Medium, world: usize, iters: usize) -> Result<f64> {
    if world < 2 {
        bail!("a raw barrier needs 2 ranks or more, not {world}");
    }
    let total = iters + iters / 10;
    let handles: Vec<_> = match medium {
        Medium::Tcp => socket_pairs(world)?
            .into_iter()
            .enumerate()
            .map(|(rank, peers)| {
                std::thread::spawn(move || {
                    run_rank(rank, world, total, CopyPlan::NONE, &mut TcpLinks { peers })
                })
            })
            .collect(),
        Medium::Shm => {
            let fd: OwnedFd =
                rustix::fs::memfd_create("tensorwire-raw-barrier", rustix::fs::MemfdFlags::CLOEXEC)
                    .context("memfd_create for the raw barrier")?;
            rustix::fs::ftruncate(&fd, Counters::len_for(world) as u64)
                .context("sizing the raw barrier's counters")?;
            let mut handles = Vec::with_capacity(world);
            for rank in 0..world {
                let counters = Counters::map(&fd, world)?;
                handles.push(std::thread::spawn(move || {
                    run_rank(
                        rank,
                        world,
                        total,
                        CopyPlan::NONE,
                        &mut ShmLinks {
                            counters,
                            rank,
                            patience: PATIENCE,
                        },
                    )
                }));
            }
            handles
        }
    };
    let mut first = None;
    for h in handles {
        let times = h
            .join()
            .map_err(|_| anyhow::anyhow!("raw barrier thread panicked"))??;
        first.get_or_insert(times);
    }
    Ok(super::bench_common::median_us(first.unwrap_or_default()))
}

// SAFETY: the mapping is plain shared memory accessed through atomics only.
unsafe impl Send for Counters {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_barriers_complete_for_every_world_size_and_time_something() {
        for medium in [Medium::Tcp, Medium::Shm] {
            for world in [2, 3, 5, 8] {
                let us = threads(medium, world, 50).expect("barrier");
                assert!(us > 0.0 && us.is_finite(), "{medium:?} world {world}: {us}");
            }
        }
    }

    #[test]
    fn a_wait_passes_only_once_the_rank_it_waits_for_has_signalled() {
        // Two ranks over one set of counters, driven by hand: rank 0 has signalled rank 1,
        // but rank 1 has not signalled rank 0, so rank 0's wait must not pass.
        let fd = rustix::fs::memfd_create("test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, Counters::len_for(2) as u64).unwrap();
        let links = |rank| ShmLinks {
            counters: Counters::map(&fd, 2).unwrap(),
            rank,
            patience: Duration::ZERO,
        };
        let (mut r0, mut r1) = (links(0), links(1));
        r0.signal(1, 0).unwrap();
        let err = r0.wait(1, 0, 1).unwrap_err().to_string();
        assert!(
            err.contains("rank 0 waited") && err.contains("rank 1"),
            "{err}"
        );
        // Rank 1 had its signal: it passes at once, then signals rank 0, which passes too.
        r1.wait(0, 0, 1).unwrap();
        r1.signal(0, 0).unwrap();
        r0.wait(1, 0, 1).unwrap();
        // The next barrier (epoch 2) waits again.
        assert!(r0.wait(1, 0, 2).is_err());
    }
}
