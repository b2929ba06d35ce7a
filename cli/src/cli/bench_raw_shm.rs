//! The same-host floor: raw shared-memory baselines without framing, agent or runtime.
//!
//! - [`RawShm`]: ping-pong of [`SMALL`]-byte messages between this process and an echo *process*
//!   (this binary re-run with the hidden `bench raw-shm-echo`), through one shared page (a memfd
//!   the child inherits): the caller writes a message and bumps a sequence number, the echo
//!   polls for it, copies the message back and bumps its own. Both sides busy-poll while the
//!   process may run on more than one core; on one core (`taskset -c 0`) they `sched_yield`
//!   between looks instead, since polling would keep the peer from running at all (the rule of
//!   [`tensorwire_core::spin`]).
//!
//! The raw barriers (over sockets and over shared memory) are in `bench_raw_barrier`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rustix::fd::{AsFd, AsRawFd, OwnedFd};

use super::bench_common::SMALL;

/// Bytes of the shared page.
const PAGE: usize = 4096;
/// Offsets in the page, each on its own cache line: the request's sequence number and bytes,
/// the reply's.
const REQ_SEQ: usize = 0;
const REQ_MSG: usize = 64;
const REPLY_SEQ: usize = 128;
const REPLY_MSG: usize = 192;
/// The request sequence number that tells the echo to exit.
const STOP: u64 = u64::MAX;
/// How long the caller waits for an answer before giving up.
const PATIENCE: Duration = Duration::from_secs(30);
/// How long the echo polls for the next request before it naps between looks (it idles
/// while the agent's blocks run and must not take a core from them).
const ECHO_POLL: Duration = Duration::from_millis(1);
/// The echo's nap between looks once idle.
const IDLE_NAP: Duration = Duration::from_micros(500);

/// Arguments of the hidden `bench raw-shm-echo`.
#[derive(Debug, clap::Args)]
pub(crate) struct RawShmEchoArgs {
    /// The inherited memfd holding the shared page.
    #[arg(long)]
    fd: i32,
}

/// Whether this process may run on one core only (then polling starves the peer).
fn one_core() -> bool {
    std::thread::available_parallelism().map_or(true, |n| n.get() == 1)
}

/// One page of shared memory, mapped read-write.
struct Page {
    ptr: *mut u8,
}

// SAFETY: the page is plain shared memory; every access that races goes through atomics, and
// the message bytes are handed over by the sequence numbers' release/acquire pairs.
unsafe impl Send for Page {}

/// Maps the first `len` bytes of the memfd `fd` shared, read-write (`what` names it in the
/// error). The caller checked that the file is at least `len` long, and unmaps it with
/// `munmap(ptr, len)` when done.
pub(crate) fn map_shared(fd: impl AsFd, len: usize, what: &str) -> Result<*mut u8> {
    // SAFETY: a fresh shared mapping; nothing in this process aliases it until the caller
    // hands out references into it, and the caller unmaps it with the same length.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            fd,
            0,
        )
    }
    .with_context(|| format!("mmap of {what}"))?;
    Ok(ptr.cast())
}

impl Page {
    fn map(fd: impl AsFd) -> Result<Self> {
        Ok(Page {
            ptr: map_shared(fd, PAGE, "the raw shared page")?,
        })
    }

    fn seq(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offset is one of the 64-byte aligned offsets above, inside the page, which
        // lives as long as `self`; page memory is suitably aligned for an AtomicU64.
        unsafe { &*self.ptr.add(offset).cast::<AtomicU64>() }
    }

    /// Copies `buf` into the page at `offset`.
    fn write(&self, offset: usize, buf: &[u8; SMALL]) {
        // SAFETY: in bounds; the peer does not touch these bytes until the sequence number that
        // follows this write is released.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), self.ptr.add(offset), SMALL) }
    }

    /// Copies [`SMALL`] bytes at `offset` out of the page into `buf`.
    fn read(&self, offset: usize, buf: &mut [u8; SMALL]) {
        // SAFETY: in bounds; read after acquiring the sequence number that published them.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), buf.as_mut_ptr(), SMALL) }
    }

    /// Waits until the sequence number at `offset` differs from `old` and returns it. Polls (or
    /// yields, `yield_each`) for `poll_for`, then sleeps [`IDLE_NAP`] between looks; gives up
    /// with an error once `give_up` says so (checked between naps and every 65,536 looks).
    fn wait_change(
        &self,
        offset: usize,
        old: u64,
        yield_each: bool,
        poll_for: Duration,
        give_up: impl Fn(Duration) -> Option<String>,
    ) -> Result<u64> {
        let seq = self.seq(offset);
        let start = Instant::now();
        let mut spins = 0u32;
        let mut napping = false;
        loop {
            let now = seq.load(Ordering::Acquire);
            if now != old {
                return Ok(now);
            }
            if napping {
                std::thread::sleep(IDLE_NAP);
            } else if yield_each {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            spins = spins.wrapping_add(1);
            if napping || spins % (1 << 16) == 0 {
                let waited = start.elapsed();
                if let Some(why) = give_up(waited) {
                    bail!(why);
                }
                napping = waited > poll_for;
            }
        }
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length; no reference into it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), PAGE) };
    }
}

/// The raw shared-memory ping-pong's caller side; the echo is a child process.
pub(crate) struct RawShm {
    page: Page,
    seq: u64,
    yield_each: bool,
    echo: std::process::Child,
}

impl RawShm {
    /// Creates the shared page and starts the echo process (`bench raw-shm-echo`).
    pub(crate) fn start_process() -> Result<Self> {
        // Without CLOEXEC: the echo process inherits it and is told its number.
        let fd: OwnedFd =
            rustix::fs::memfd_create("tensorwire-raw-shm", rustix::fs::MemfdFlags::empty())
                .context("memfd_create for the raw shared-memory baseline")?;
        rustix::fs::ftruncate(&fd, PAGE as u64).context("sizing the raw shared page")?;
        let page = Page::map(&fd)?;
        let echo = std::process::Command::new(std::env::current_exe()?)
            .args(["bench", "raw-shm-echo", "--fd"])
            .arg(fd.as_raw_fd().to_string())
            .stdin(std::process::Stdio::null())
            .spawn()
            .context("starting the raw shared-memory echo process")?;
        // The child holds its own copy now.
        drop(fd);
        Ok(RawShm {
            page,
            seq: 0,
            yield_each: one_core(),
            echo,
        })
    }

    /// `n` round trips of [`SMALL`] bytes; the time of each.
    pub(crate) fn pingpong(&mut self, n: usize) -> Result<Vec<Duration>> {
        let mut msg = [7u8; SMALL];
        let mut back = [0u8; SMALL];
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            self.seq += 1;
            msg[0] = self.seq as u8;
            let t = Instant::now();
            self.page.write(REQ_MSG, &msg);
            self.page.seq(REQ_SEQ).store(self.seq, Ordering::Release);
            let got = self.page.wait_change(
                REPLY_SEQ,
                self.seq - 1,
                self.yield_each,
                PATIENCE,
                |waited| {
                    (waited > PATIENCE).then(|| {
                        format!("the raw shared-memory echo did not answer within {PATIENCE:?}")
                    })
                },
            )?;
            self.page.read(REPLY_MSG, &mut back);
            times.push(t.elapsed());
            if got != self.seq || back != msg {
                bail!("the raw shared-memory echo answered {got} to {}", self.seq);
            }
        }
        Ok(times)
    }

    /// Tells the echo to exit and waits for it.
    pub(crate) fn finish(mut self) -> Result<()> {
        self.page.seq(REQ_SEQ).store(STOP, Ordering::Release);
        let status = self.echo.wait()?;
        if !status.success() {
            bail!("the raw shared-memory echo process failed: {status}");
        }
        Ok(())
    }
}

impl Drop for RawShm {
    fn drop(&mut self) {
        // After an error: do not leave a polling echo behind.
        if self.echo.try_wait().ok().flatten().is_none() {
            self.page.seq(REQ_SEQ).store(STOP, Ordering::Release);
        }
    }
}

/// `bench raw-shm-echo`: answers each request on the inherited page until told to stop.
pub(crate) fn raw_shm_echo(args: &RawShmEchoArgs) -> Result<()> {
    if args.fd < 0 {
        bail!(super::Usage(format!(
            "--fd {} is not a file descriptor",
            args.fd
        )));
    }
    // SAFETY: the parent passed this descriptor, inherited and open, for this process alone.
    let fd = unsafe { <OwnedFd as rustix::fd::FromRawFd>::from_raw_fd(args.fd) };
    let size = rustix::fs::fstat(&fd)
        .with_context(|| format!("--fd {} is not an open file", args.fd))?
        .st_size;
    if size < PAGE as i64 {
        bail!(super::Usage(format!(
            "--fd {}: {size} bytes, not the raw benchmark's page of {PAGE}",
            args.fd
        )));
    }
    let page = Page::map(&fd)?;
    drop(fd);
    let yield_each = one_core();
    let parent = rustix::process::getppid();
    let orphaned = |_: Duration| {
        (rustix::process::getppid() != parent)
            .then(|| "the benchmark that started this raw echo is gone".to_owned())
    };
    let mut last = 0u64;
    let mut msg = [0u8; SMALL];
    loop {
        last = page.wait_change(REQ_SEQ, last, yield_each, ECHO_POLL, orphaned)?;
        if last == STOP {
            return Ok(());
        }
        page.read(REQ_MSG, &mut msg);
        page.write(REPLY_MSG, &msg);
        page.seq(REPLY_SEQ).store(last, Ordering::Release);
    }
}
