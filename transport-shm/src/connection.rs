//! One connection: two rings, eventfd wake-ups, sealed segments for large frames, and a task
//! that watches the Unix socket (segment descriptors, and the peer going away). The sending
//! side is in `send`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::BytesMut;
use tensorwire_core::ports::transport::{
    Connection, EachFrame, FrameReader, IdentityError, TransportError,
};
use tensorwire_core::spin::{requeue, SpinPolicy, SpinStep, SpinWait, Turn};
use tensorwire_core::wire::{
    decode_frame_shared, Frame, FrameDecoder, WireError, WireLimits, PREFIX_LEN,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{Mutex, Notify};
use tokio::task::JoinHandle;

use crate::handshake::Link;
use crate::mem;
use crate::ring::{Consumer, Next, Ring, RingError, SlabRecord, MAX_SLABS, SEGMENT_RECORD};
use crate::sock;

mod send;
use send::Tx;

/// Segments sent and not yet taken by the receiver, at most: bounds the memory a fast sender
/// can pin in a slow receiver (the ring bounds the rest).
const MAX_SEGMENTS_IN_FLIGHT: u64 = 8;
/// Segment descriptors the watcher queues at most; a peer that sends more breaks the protocol.
const MAX_QUEUED: usize = MAX_SEGMENTS_IN_FLIGHT as usize + 1;
/// The largest record of stream data (a few microseconds of copying).
const MAX_RECORD: u64 = 64 << 10;
/// Remaining bytes of a segment from which the consumer copies straight into its final buffer.
const DIRECT_MIN: usize = 4096;
/// Slabs are sized in multiples of this (so that frames of about one size reuse one slab).
const SLAB_ALIGN: usize = 1 << 20;
/// A slab of the peer's, mapped read-only; the last [`SlabView`] of a use releases it.
#[derive(Debug)]
struct RecvSlab {
    /// Listed for private views while the slab is mapped (dropped before `map`).
    _listed: crate::private::Registered,
    map: mem::Mapping,
    id: u32,
    /// The ring whose header says which uses are done.
    ring: Arc<Ring>,
}

/// The bytes of one frame in a slab of the peer's, as the owner of received
/// [`Bytes`](bytes::Bytes): when the last of them drops, the peer may write the slab again.
struct SlabView {
    slab: Arc<RecvSlab>,
    /// Where the frame starts in the slab.
    at: usize,
    len: usize,
    seq: u64,
}

impl AsRef<[u8]> for SlabView {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `at + len <= map.len()` (checked in `take_slab`); the slab's memfd is sealed against
        // shrinking (checked before mapping), so the pages stay backed while the mapping lives,
        // and `self` keeps it alive. The sender does not write the slab until we store `seq` in
        // `slab_done`, which only `drop` does, after every borrow of `self` has ended. A sender
        // that broke that rule could change the bytes under us (never their length or where they
        // are): the same user can write our memory through `/proc/PID/mem` anyway, and the frame
        // structure was decoded and its header copied before any of these bytes were handed out.
        unsafe { std::slice::from_raw_parts(self.slab.map.ptr().add(self.at), self.len) }
    }
}

impl Drop for SlabView {
    fn drop(&mut self) {
        // Release: our reads of the bytes happen before the sender sees the slab free.
        self.slab
            .ring
            .slab_done(self.slab.id)
            .store(self.seq, Ordering::Release);
    }
}

/// A SEGMENT or SLAB record found in the ring, waiting to be taken.
#[derive(Debug, Clone, Copy)]
enum Pending {
    Segment(u64),
    Slab(SlabRecord),
}

/// What the watcher shares with the connection.
#[derive(Debug)]
struct Shared {
    sock: AsyncFd<OwnedFd>,
    inbox: std::sync::Mutex<Inbox>,
    /// Set (after `inbox.gone`) when the peer has gone away.
    dead: AtomicBool,
    notify: Notify,
}

#[derive(Debug, Default)]
struct Inbox {
    /// Segment descriptors with the lengths their packets announced.
    segments: VecDeque<(u64, OwnedFd)>,
    /// Why the socket ended.
    gone: Option<String>,
}

impl Shared {
    fn die(&self, why: String) {
        if let Ok(mut inbox) = self.inbox.lock() {
            inbox.gone.get_or_insert(why);
        }
        self.dead.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Closes the socket both ways: the peer's watcher sees the end at once.
    fn shutdown(&self) {
        let _ = rustix::net::shutdown(self.sock.get_ref(), rustix::net::Shutdown::Both);
    }
}

/// Reads the socket until it ends: queues segment descriptors, and on the end (the peer closed
/// the connection, dropped it, or its process died) wakes every waiter.
async fn watch(shared: Arc<Shared>) {
    loop {
        let mut guard = match shared.sock.readable().await {
            Ok(g) => g,
            Err(e) => return shared.die(format!("watching the socket failed: {e}")),
        };
        let mut buf = [0u8; 9];
        let packet = match guard.try_io(|fd| sock::try_recv_packet(fd.get_ref().as_fd(), &mut buf))
        {
            Err(_would_block) => continue,
            Ok(Err(e)) => return shared.die(format!("reading the socket failed: {e}")),
            Ok(Ok(p)) => p,
        };
        if packet.len == 0 && packet.fds.is_empty() {
            return shared
                .die("the peer closed its socket (it closed the connection or exited)".into());
        }
        let mut fds = packet.fds.into_iter();
        let (Some(fd), None, 8, false) = (fds.next(), fds.next(), packet.len, packet.truncated)
        else {
            shared.shutdown();
            return shared.die(format!(
                "the peer sent a malformed segment packet ({} bytes)",
                packet.len
            ));
        };
        let len = u64::from_le_bytes(buf[..8].try_into().unwrap_or_default());
        let overflow = match shared.inbox.lock() {
            Ok(mut inbox) => {
                inbox.segments.push_back((len, fd));
                inbox.segments.len() > MAX_QUEUED
            }
            Err(_) => true,
        };
        if overflow {
            shared.shutdown();
            return shared.die(format!(
                "the peer sent more than {MAX_QUEUED} segments ahead of the ring"
            ));
        }
        shared.notify.notify_waiters();
    }
}

struct Rx {
    consumer: Consumer,
    decoder: FrameDecoder,
    staging: BytesMut,
    segments_done: u64,
    /// The read position last released to the producer.
    released: u64,
    /// The SEGMENT or SLAB record found (copied once from the ring).
    pending: Option<Pending>,
    /// The peer's slabs, by id.
    slabs: Vec<Option<Arc<RecvSlab>>>,
    /// A protocol error that closed the connection; repeated by later receives.
    failed: Option<TransportError>,
}

/// An authenticated shared-memory connection.
pub(crate) struct ShmConnection {
    peer: SocketAddr,
    limits: WireLimits,
    segment_min: usize,
    slab_min: usize,
    slab_bytes: usize,
    /// How long a wait polls or yields before it sleeps, and whether this process may run on
    /// one core only (then waiting yields instead of polling).
    spin: SpinPolicy,
    /// Whether busy polling pays, as the last wait learnt.
    spin_paid: AtomicBool,
    /// The largest record written: [`MAX_RECORD`] or a quarter of the send ring.
    max_record: u64,
    shared: Arc<Shared>,
    rx_ring: Arc<Ring>,
    tx_ring: Ring,
    data_efd: AsyncFd<OwnedFd>,
    space_efd: AsyncFd<OwnedFd>,
    peer_data_efd: OwnedFd,
    peer_space_efd: OwnedFd,
    /// The receive side, `None` once the connection's reader took it
    /// ([`Connection::into_frames`]: no lock a frame).
    rx: Mutex<Option<Box<Rx>>>,
    /// The send side: taken within one step at a time by a `try_send_now` (a plain lock,
    /// whose uncontended round trip costs a fraction of an async one's), or out of the slot
    /// for as long as a send that waits runs (`send_many`, `close`: [`send::Loan`]).
    tx: std::sync::Mutex<Option<Box<Tx>>>,
    /// The turn of the sends that wait, held across their awaits; a `try_send_now` never
    /// waits for it (it finds the send side's slot empty).
    turn: Mutex<()>,
    watcher: JoinHandle<()>,
}

impl std::fmt::Debug for ShmConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmConnection")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

/// Checks of the ring between two yields to the runtime while polling.
const POLLS_PER_YIELD: usize = 64;

/// Lets the runtime's other tasks run between two looks, as `wait` says (see
/// [`tensorwire_core::spin::Turn`]: every other turn also lets a current-thread runtime's
/// `block_on` future run, which requeueing alone would hold off for the whole budget).
/// A wait that *is* the `block_on` future (no task id) only requeues: that future runs again
/// as soon as the tasks ready before it have, and a runtime turn would cost it a driver poll
/// (a system call) each time for nothing (`bench transport --transport shm` waits there).
async fn give_turn(wait: &mut SpinWait) {
    match wait.turn() {
        Turn::Runtime if tokio::task::try_id().is_some() => tokio::task::yield_now().await,
        Turn::Runtime | Turn::Requeue => requeue().await,
    }
}

/// Wakes the other side if it said it sleeps (the flag), through its eventfd.
fn wake(flag: &AtomicU32, efd: &OwnedFd) {
    // Pairs with the fence in `wait`: either the sleeper sees our update, or we see its flag.
    fence(Ordering::SeqCst);
    if flag.swap(0, Ordering::SeqCst) != 0 {
        // EAGAIN: the counter is saturated, the peer will wake anyway.
        let _ = rustix::io::write(efd, &1u64.to_ne_bytes());
    }
}

impl ShmConnection {
    pub(crate) fn new(
        link: Link,
        peer: SocketAddr,
        limits: WireLimits,
        segment_min: usize,
        (slab_min, slab_bytes): (usize, usize),
        spin: Duration,
        buffer_reuse: usize,
    ) -> Result<Self, TransportError> {
        let efd = |fd: OwnedFd| {
            sock::register(fd, Interest::READABLE)
                .map_err(|e| TransportError::io(peer, "registering an eventfd", &e))
        };
        let shared = Arc::new(Shared {
            sock: link.sock,
            inbox: std::sync::Mutex::new(Inbox::default()),
            dead: AtomicBool::new(false),
            notify: Notify::new(),
        });
        let watcher = tokio::spawn(watch(shared.clone()));
        Ok(ShmConnection {
            peer,
            limits,
            segment_min: segment_min.max(SEGMENT_RECORD + 1),
            slab_min: slab_min.max(PREFIX_LEN + 1),
            slab_bytes,
            spin: SpinPolicy::new(
                spin,
                std::thread::available_parallelism().map_or(true, |n| n.get() == 1),
            ),
            max_record: (link.tx.capacity() / 4).min(MAX_RECORD),
            spin_paid: AtomicBool::new(true),
            shared,
            rx_ring: Arc::new(link.rx),
            tx_ring: link.tx,
            data_efd: efd(link.data_efd)?,
            space_efd: efd(link.space_efd)?,
            peer_data_efd: link.peer_data_efd,
            peer_space_efd: link.peer_space_efd,
            rx: Mutex::new(Some(Box::new(Rx {
                consumer: Consumer::default(),
                decoder: FrameDecoder::new(limits).with_buffer_reuse(buffer_reuse),
                staging: BytesMut::new(),
                segments_done: 0,
                released: 0,
                pending: None,
                slabs: (0..MAX_SLABS).map(|_| None).collect(),
                failed: None,
            }))),
            tx: std::sync::Mutex::new(Some(Tx::new())),
            turn: Mutex::new(()),
            watcher,
        })
    }

    /// Waits until `ready()` holds or the peer is gone: polls or yields for `self.spin`, then sleeps on
    /// `efd` after raising `flag` (which the other side clears when it wakes us).
    async fn wait(
        &self,
        flag: &AtomicU32,
        efd: &AsyncFd<OwnedFd>,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), TransportError> {
        // The decision (poll, yield, sleep, and what each wait teaches) is core's `SpinWait`;
        // see `tensorwire_core::spin`. Here: a poll checks the ring `POLLS_PER_YIELD` times,
        // then lets the runtime's other tasks run (an RPC handler that is about to answer, a
        // sender), so that a reader waiting here never holds a current-thread runtime for the
        // whole budget. A yield first lets those tasks run (on the caller's side, the one that
        // sends the next request: handing the core to the peer before they ran would only bring
        // it back here with nothing new to read), then hands the core over.
        // The clock is read once at the start and once after each turn or yield (the reading
        // that the next step needs), and not around a yield whose length teaches nothing
        // (`times_yields`: one core).
        let mut now = Instant::now();
        let mut wait = self.spin.begin(self.spin_paid.load(Ordering::Relaxed), now);
        loop {
            match wait.step(now) {
                SpinStep::Poll => {
                    for _ in 0..POLLS_PER_YIELD {
                        if ready() || self.shared.is_dead() {
                            self.learn_spin(wait.found());
                            return Ok(());
                        }
                        std::hint::spin_loop();
                    }
                    give_turn(&mut wait).await;
                    now = Instant::now();
                }
                SpinStep::Yield => {
                    if ready() || self.shared.is_dead() {
                        self.learn_spin(wait.found());
                        return Ok(());
                    }
                    give_turn(&mut wait).await;
                    if ready() || self.shared.is_dead() {
                        self.learn_spin(wait.found());
                        return Ok(());
                    }
                    if wait.times_yields() {
                        let before = Instant::now();
                        std::thread::yield_now();
                        now = Instant::now();
                        wait.yielded(now.saturating_duration_since(before));
                    } else {
                        std::thread::yield_now();
                        wait.yielded_untimed();
                        now = Instant::now();
                    }
                }
                SpinStep::Sleep => break,
            }
        }
        self.spin_paid.store(wait.slept(), Ordering::Relaxed);
        if ready() || self.shared.is_dead() {
            return Ok(());
        }
        // The sleep, in a box of its own: its futures (the eventfd's readiness, the watcher's
        // notification) would otherwise make every receive's future larger, and each frame's
        // receive future is written over the last one's (`EachFrame`), copied whole.
        Box::pin(self.sleep(flag, efd, ready)).await
    }

    /// The rest of [`wait`](Self::wait) once its budget is spent: sleeps on `efd` after raising
    /// `flag` (which the other side clears when it wakes us) until `ready()` holds or the peer
    /// is gone.
    async fn sleep(
        &self,
        flag: &AtomicU32,
        efd: &AsyncFd<OwnedFd>,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), TransportError> {
        loop {
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            flag.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if ready() || self.shared.is_dead() {
                flag.store(0, Ordering::SeqCst);
                return Ok(());
            }
            tokio::select! {
                guard = efd.readable() => {
                    let mut guard =
                        guard.map_err(|e| TransportError::io(self.peer, "waiting", &e))?;
                    let mut counter = [0u8; 8];
                    match guard.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut counter)?)) {
                        // The read emptied the counter: it is not readable until the peer
                        // writes again, which the edge-triggered registration reports as a new
                        // event (one tokio does not clear here). Without this, the next wait
                        // would find the stale readiness and pay a read that fails with EAGAIN.
                        Ok(Ok(_)) => guard.clear_ready(),
                        Err(_would_block) => {}
                        Ok(Err(e)) => return Err(TransportError::io(self.peer, "waiting", &e)),
                    }
                }
                () = &mut notified => {}
            }
        }
    }

    /// Remembers what the wait that just ended learnt about polling (`None`: nothing).
    fn learn_spin(&self, paid: Option<bool>) {
        if let Some(paid) = paid {
            self.spin_paid.store(paid, Ordering::Relaxed);
        }
    }

    fn gone_error(&self, op: &'static str) -> TransportError {
        let why = self
            .shared
            .inbox
            .lock()
            .ok()
            .and_then(|i| i.gone.clone())
            .unwrap_or_else(|| "the peer went away".to_owned());
        TransportError::Io {
            addr: self.peer,
            op,
            kind: std::io::ErrorKind::BrokenPipe,
            message: why,
        }
    }

    fn ring_error(&self, e: RingError) -> TransportError {
        TransportError::Wire {
            peer: self.peer,
            source: WireError::MalformedHeader {
                reason: format!("shared-memory ring: {e}"),
            },
        }
    }

    /// Closes the connection after a protocol error: the peer sees it go away at once.
    fn fail(&self, rx: &mut Rx, err: TransportError) -> TransportError {
        self.shared.shutdown();
        tracing::warn!(peer = %self.peer, error = %err, "closing shared-memory connection");
        // Every later receive fails with the same error (it is plain data).
        rx.failed = Some(err.clone());
        err
    }

    fn eof_error(&self, decoder: &FrameDecoder) -> TransportError {
        match decoder.finish() {
            Ok(()) => TransportError::Closed { peer: self.peer },
            Err(e @ WireError::Truncated { .. }) => TransportError::ClosedMidFrame {
                peer: self.peer,
                source: e,
            },
            Err(e) => TransportError::Wire {
                peer: self.peer,
                source: e,
            },
        }
    }

    /// Copies what the ring holds into the decoder until a frame is complete, the ring is
    /// empty, or a segment comes next.
    fn pump(&self, rx: &mut Rx) -> Result<Pumped, TransportError> {
        loop {
            // Between frames with nothing staged the decoder has nothing to do (in its first
            // state, with no input, it returns `Ok(None)` and changes nothing): not asked. A
            // failed decoder counts as mid-frame, so it still repeats its error.
            let idle = !rx.decoder.is_mid_frame() && rx.staging.is_empty();
            let decoded = match idle {
                true => Ok(None),
                false => rx.decoder.decode(&mut rx.staging),
            };
            match decoded {
                Ok(Some(frame)) => return Ok(Pumped::Frame(frame)),
                Ok(None) => {}
                Err(source) => {
                    return Err(TransportError::Wire {
                        peer: self.peer,
                        source,
                    })
                }
            }
            match rx
                .consumer
                .next(&self.rx_ring)
                .map_err(|e| self.ring_error(e))?
            {
                Next::Empty => return Ok(Pumped::Empty),
                next @ (Next::Segment { .. } | Next::Slab { .. }) => {
                    if rx.decoder.is_mid_frame() {
                        return Err(TransportError::Wire {
                            peer: self.peer,
                            source: WireError::MalformedHeader {
                                reason: "a shared-memory segment arrived in the middle of a frame"
                                    .into(),
                            },
                        });
                    }
                    return Ok(Pumped::Pending(match next {
                        Next::Slab {
                            id,
                            new,
                            at,
                            seq,
                            len,
                        } => Pending::Slab(SlabRecord {
                            id,
                            new,
                            at,
                            seq,
                            len,
                        }),
                        Next::Segment { len } => Pending::Segment(len),
                        Next::Empty | Next::Data { .. } => unreachable!("matched above"),
                    }));
                }
                Next::Data { len, .. } => {
                    if let Some(mut direct) = rx.decoder.direct_read_buf(DIRECT_MIN) {
                        rx.consumer
                            .read_into(&self.rx_ring, usize::MAX, &mut direct);
                    } else {
                        rx.staging.reserve(len as usize);
                        rx.consumer
                            .read_into(&self.rx_ring, len as usize, &mut rx.staging);
                    }
                    // Free the space at once: the producer may be waiting for it.
                    self.release(rx);
                }
            }
        }
    }

    /// Takes the next segment descriptor from the watcher; `None` once the peer is gone.
    async fn next_segment(&self) -> Option<(u64, OwnedFd)> {
        loop {
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut inbox = self.shared.inbox.lock().ok()?;
                if let Some(segment) = inbox.segments.pop_front() {
                    return Some(segment);
                }
                if inbox.gone.is_some() {
                    return None;
                }
            }
            notified.await;
        }
    }

    /// The peer closed before the memory of a frame of `len` bytes arrived.
    fn closed_before_body(&self, len: u64) -> TransportError {
        TransportError::ClosedMidFrame {
            peer: self.peer,
            source: WireError::Truncated {
                part: "body",
                received: 0,
                expected: len,
            },
        }
    }

    /// A malformed frame from the peer.
    fn malformed(&self, reason: String) -> TransportError {
        TransportError::Wire {
            peer: self.peer,
            source: WireError::MalformedHeader { reason },
        }
    }

    /// A frame of `len` bytes (with its prefix) is within the limit; returns the limit (with
    /// the prefix).
    fn check_len(&self, len: u64) -> Result<u64, TransportError> {
        let max = self.limits.max_frame_len.saturating_add(PREFIX_LEN as u64);
        if len > max {
            return Err(TransportError::Wire {
                peer: self.peer,
                source: WireError::FrameTooLarge {
                    len,
                    max: self.limits.max_frame_len,
                },
            });
        }
        Ok(max)
    }

    async fn take_segment(&self, rx: &mut Rx, len: u64) -> Result<Frame, TransportError> {
        let bad = |reason: String| self.malformed(reason);
        self.check_len(len)?;
        let Some((announced, fd)) = self.next_segment().await else {
            return Err(self.closed_before_body(len));
        };
        if announced != len || len < PREFIX_LEN as u64 {
            return Err(bad(format!(
                "segment of {announced} bytes where the ring announced {len}"
            )));
        }
        let bytes = mem::open_segment(fd, len as usize)
            .map_err(|e| bad(format!("shared-memory segment: {e}")))?;
        let (frame, used) =
            decode_frame_shared(&bytes, &self.limits).map_err(|source| TransportError::Wire {
                peer: self.peer,
                source,
            })?;
        if used as u64 != len {
            return Err(bad(format!(
                "a segment of {len} bytes holds a frame of {used}"
            )));
        }
        rx.consumer.segment_taken();
        rx.segments_done += 1;
        self.rx_ring
            .segments_done()
            .store(rx.segments_done, Ordering::Release);
        Ok(frame)
    }

    async fn recv_inner(&self, rx: &mut Rx) -> Result<Frame, TransportError> {
        loop {
            if let (true, Some(pending)) = (rx.consumer.segment_pending(), rx.pending) {
                // Boxed: rare (large frames), and their futures would make every receive's
                // future larger (see `wait`).
                let frame = match pending {
                    Pending::Segment(len) => Box::pin(self.take_segment(rx, len)).await,
                    Pending::Slab(record) => Box::pin(self.take_slab(rx, record)).await,
                };
                rx.pending = None;
                self.release(rx);
                return frame;
            }
            let pumped = self.pump(rx);
            self.release(rx);
            match pumped? {
                Pumped::Frame(frame) => return Ok(frame),
                Pumped::Pending(pending) => {
                    rx.pending = Some(pending);
                    continue;
                }
                Pumped::Empty => {}
            }
            let r = rx.consumer.position();
            let ended =
                || self.rx_ring.closed().load(Ordering::Acquire) != 0 || self.shared.is_dead();
            if ended() {
                // Whatever was published before the end is delivered first.
                if self.rx_ring.write_pos().load(Ordering::Acquire) == r {
                    return Err(self.eof_error(&rx.decoder));
                }
                continue;
            }
            self.wait(self.rx_ring.consumer_waiting(), &self.data_efd, || {
                self.rx_ring.write_pos().load(Ordering::Acquire) != r || ended()
            })
            .await?;
        }
    }

    /// Takes the frame of a SLAB record: maps the slab if it is new, checks the frame, and
    /// hands its bytes up without copying (the header excepted).
    async fn take_slab(&self, rx: &mut Rx, record: SlabRecord) -> Result<Frame, TransportError> {
        let SlabRecord {
            id,
            new,
            at,
            seq,
            len,
        } = record;
        let bad = |reason: String| self.malformed(reason);
        let max = self.check_len(len)?;
        if len < PREFIX_LEN as u64 {
            return Err(bad(format!(
                "a slab record announces a frame of {len} bytes"
            )));
        }
        if new {
            let Some((cap, fd)) = self.next_segment().await else {
                return Err(self.closed_before_body(len));
            };
            if cap < len + u64::from(at) || cap > max.saturating_add(SLAB_ALIGN as u64) {
                return Err(bad(format!(
                    "a slab of {cap} bytes for a frame of {len} (at most {max} allowed)"
                )));
            }
            // Our own budget binds what we map, whatever the sender's says.
            let mapped: u64 = rx
                .slabs
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != id as usize)
                .filter_map(|(_, s)| s.as_ref().map(|s| s.map.len() as u64))
                .sum();
            if mapped + cap > self.slab_bytes as u64 {
                return Err(bad(format!(
                    "a new slab of {cap} bytes would make the peer's slabs mapped here \
                     {} bytes, over this side's slab budget (slab_bytes) of {}",
                    mapped + cap,
                    self.slab_bytes
                )));
            }
            let map = mem::open_slab(&fd, cap as usize)
                .map_err(|e| bad(format!("shared-memory slab: {e}")))?;
            let listed = crate::private::Registered::new(&map, fd);
            rx.segments_done += 1;
            self.rx_ring
                .segments_done()
                .store(rx.segments_done, Ordering::Release);
            rx.slabs[id as usize] = Some(Arc::new(RecvSlab {
                _listed: listed,
                map,
                id,
                ring: Arc::clone(&self.rx_ring),
            }));
        }
        let Some(slab) = rx.slabs[id as usize].clone() else {
            return Err(bad(format!("a slab record names slab {id}, never sent")));
        };
        if len + u64::from(at) > slab.map.len() as u64 {
            return Err(bad(format!(
                "a frame of {len} bytes at {at} in slab {id} of {} bytes",
                slab.map.len()
            )));
        }
        let bytes = bytes::Bytes::from_owner(SlabView {
            slab,
            at: at as usize,
            len: len as usize,
            seq,
        });
        let (mut frame, used) =
            decode_frame_shared(&bytes, &self.limits).map_err(|source| TransportError::Wire {
                peer: self.peer,
                source,
            })?;
        if used as u64 != len {
            return Err(bad(format!(
                "a slab frame of {len} bytes holds a frame of {used}"
            )));
        }
        // The header is parsed by the layers above: ours, so that nothing can change it.
        frame.header = bytes::Bytes::copy_from_slice(&frame.header);
        rx.consumer.segment_taken();
        Ok(frame)
    }

    /// Frees what was read for the producer and wakes it if it sleeps for space; nothing when
    /// the read position has not moved since the last release (nothing freed, so nothing to
    /// tell: the fence and the flag's swap are skipped).
    fn release(&self, rx: &mut Rx) {
        let at = rx.consumer.position();
        if at == rx.released {
            return;
        }
        rx.released = at;
        rx.consumer.release(&self.rx_ring);
        wake(self.rx_ring.producer_waiting(), &self.peer_space_efd);
    }

    /// Waits until the peer has closed the socket.
    #[cfg(feature = "__testing")]
    pub(crate) async fn closed_by_peer(&self) {
        while self.next_segment().await.is_some() {}
    }
}

enum Pumped {
    Frame(Frame),
    Pending(Pending),
    Empty,
}

impl ShmConnection {
    /// [`Connection::recv`]: through the receive side's lock, while the reader has not taken
    /// it; after, an error.
    async fn recv_frame(&self) -> Result<Frame, TransportError> {
        let mut rx = self.rx.lock().await;
        let Some(rx) = rx.as_deref_mut() else {
            return Err(TransportError::read_by_frames(self.peer));
        };
        self.recv_from(rx).await
    }

    /// The next frame from the receive side `rx`.
    async fn recv_from(&self, rx: &mut Rx) -> Result<Frame, TransportError> {
        if let Some(e) = &rx.failed {
            return Err(e.clone());
        }
        match self.recv_inner(rx).await {
            Ok(frame) => Ok(frame),
            Err(e @ (TransportError::Wire { .. } | TransportError::Io { .. })) => {
                Err(self.fail(rx, e))
            }
            Err(e) => Err(e),
        }
    }
}

#[async_trait]
impl Connection for ShmConnection {
    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn transport(&self) -> &'static str {
        "shm"
    }

    fn check_peer_name(&self, _name: &str) -> Result<(), IdentityError> {
        // The cluster secret (and `SO_PEERCRED`) authenticate membership, not a name.
        Ok(())
    }

    fn peer_credentials(&self) -> tensorwire_core::identity::Credentials {
        tensorwire_core::identity::Credentials::Membership
    }

    fn cheap_sends(&self) -> bool {
        true
    }

    async fn send(&self, frame: Frame) -> Result<(), TransportError> {
        self.send_many(vec![frame]).await
    }

    async fn send_many(&self, frames: Vec<Frame>) -> Result<(), TransportError> {
        self.send_prepared(frames).await
    }

    fn try_send_now(&self, frames: &mut Vec<Frame>) -> Option<Result<(), TransportError>> {
        self.try_send_frames(frames)
    }

    async fn recv(&self) -> Result<Frame, TransportError> {
        self.recv_frame().await
    }

    fn into_frames(self: Arc<Self>) -> Box<dyn FrameReader> {
        // One receive future for all frames, not one box per frame. The reader takes the
        // receive side with it, so a frame costs no turn of its lock (a later `recv` fails);
        // while a `recv` holds it, the reader goes through the lock as `recv` does.
        let taken = self.rx.try_lock().ok().and_then(|mut rx| rx.take());
        match taken {
            Some(rx) => Box::new(EachFrame::new((self, rx), |(c, mut rx)| async move {
                let received = c.recv_from(&mut rx).await;
                (received, (c, rx))
            })),
            None => Box::new(EachFrame::new(self, |c| async move {
                let received = c.recv_frame().await;
                (received, c)
            })),
        }
    }

    async fn close(&self) -> Result<(), TransportError> {
        let mut loan = self.lend_tx().await?;
        // Frames a `try_send_now` held come before the end of the stream.
        self.flush_held(&mut loan).await?;
        self.tx_ring.closed().store(1, Ordering::Release);
        wake(self.tx_ring.consumer_waiting(), &self.peer_data_efd);
        Ok(())
    }
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        self.shared.shutdown();
        self.watcher.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use tensorwire_core::ports::transport::Connection;
    use tensorwire_core::wire::Frame;

    use crate::tests::listening;

    /// A reader made while a `recv` holds the receive side cannot take it: it reads through
    /// the lock, as `recv` does, the receive side stays with the connection, and a `recv`
    /// besides it still works (it gets the next frame, not an error).
    #[tokio::test]
    async fn a_reader_made_while_a_recv_holds_the_receive_side_reads_through_the_lock() {
        let (transport, listener) = listening().await;
        let client = Arc::new(transport.connect_shm(listener.local_addr()).await.unwrap());
        let server = listener.accept().await.unwrap();
        let held = client.rx.try_lock().unwrap();
        let mut frames = Arc::clone(&client).into_frames();
        drop(held);
        assert!(
            client.rx.try_lock().unwrap().is_some(),
            "the receive side stays"
        );
        for header in [&b"one"[..], b"two"] {
            server
                .send(Frame::message(Bytes::from(header), vec![]))
                .await
                .unwrap();
        }
        let first = std::future::poll_fn(|cx| frames.poll_recv(cx))
            .await
            .unwrap();
        assert_eq!(&first.header[..], b"one");
        assert_eq!(&client.recv().await.unwrap().header[..], b"two");
    }
}
