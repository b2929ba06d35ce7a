//! One authenticated TCP connection: framed sends and receives.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::BytesMut;
use tensorwire_core::budget::{Account, OverBudget, Use};
use tensorwire_core::ports::transport::{
    Connection, EachFrame, FrameReader, IdentityError, TransportError,
};
use tensorwire_core::spin::{requeue, SpinPolicy, SpinStep, SpinWait, Turn};
use tensorwire_core::wire::{Frame, FrameDecoder, OutgoingFrame, Preamble, WireError, WireLimits};
use tokio::io::AsyncReadExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use crate::config::TcpConfig;

/// Segments with at least this many bytes still missing are read straight into their final
/// buffer; smaller reads go through the read buffer (one read syscall for many small frames).
const DIRECT_READ_MIN: usize = 64 << 10;
/// Size of the read buffer.
const READ_BUF: usize = 64 << 10;
/// A direct send of one frame with at most this many payloads writes it straight from the
/// frame (its preamble on the stack), with no [`OutgoingFrame`] made.
const WHOLE_PAYLOADS: usize = 2;
/// At most this many slices per vectored write (Linux's IOV_MAX is 1024).
const MAX_IOV: usize = 64;
/// The writer keeps the room of its list of outgoing frames between direct sends up to this
/// many frames (a larger batch's room is let go of).
const KEPT_OUTGOING: usize = 64;

/// Sets the socket options every connection uses: `TCP_NODELAY`, and the liveness settings of
/// `config` (keepalive probes and `TCP_USER_TIMEOUT`).
pub(crate) fn prepare(
    stream: TcpStream,
    peer: SocketAddr,
    config: &TcpConfig,
) -> Result<TcpStream, TransportError> {
    stream
        .set_nodelay(true)
        .map_err(|e| TransportError::io(peer, "setting TCP_NODELAY", &e))?;
    let socket = socket2::SockRef::from(&stream);
    if let Some(every) = config.keepalive {
        let probes = socket2::TcpKeepalive::new()
            .with_time(every)
            .with_interval(every);
        socket
            .set_tcp_keepalive(&probes)
            .map_err(|e| TransportError::io(peer, "setting TCP keepalive", &e))?;
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Some(dead) = config.dead_peer_timeout {
        socket
            .set_tcp_user_timeout(Some(dead))
            .map_err(|e| TransportError::io(peer, "setting TCP_USER_TIMEOUT", &e))?;
    }
    Ok(stream)
}

struct Reader {
    half: OwnedReadHalf,
    decoder: FrameDecoder,
    buf: BytesMut,
    /// When the frame being received must be complete (set when its first byte arrives).
    frame_deadline: Option<tokio::time::Instant>,
    /// The peer's memory budget, once the layer above says who the peer is
    /// (`Connection::bill_to`), and the bytes of the frame being received charged to it.
    account: Option<Account>,
    charged: usize,
}

impl Reader {
    /// Nothing more will be read: frees the frame being received and the pooled buffers.
    fn release(&mut self) {
        self.decoder.release();
        self.buf = BytesMut::new();
        self.frame_deadline = None;
        self.recharge(0).ok();
    }

    /// Brings the charge for the frame being received to `bytes` (0: none is).
    fn recharge(&mut self, bytes: usize) -> Result<(), OverBudget> {
        let Some(account) = &self.account else {
            return Ok(());
        };
        let charged = self.charged;
        if bytes == charged {
            // `resize` to the same size moves nothing and cannot fail: skip its lock.
            return Ok(());
        }
        account.resize(Use::Frame, charged, bytes)?;
        self.charged = bytes;
        Ok(())
    }
}

/// The sending side: the socket's write half, and what a [`Connection::try_send_now`] that
/// could not finish left to write (the rest of a frame it started, and the frames after it),
/// which the next `send_many` writes first.
struct Writer {
    half: OwnedWriteHalf,
    held: Vec<OutgoingFrame>,
    /// A `send_many` is under way (it holds the senders' turn and may have frames in its own
    /// list, part written): a `try_send_now` then takes nothing.
    busy: bool,
}

/// An authenticated TCP connection.
pub(crate) struct TcpConnection {
    peer: SocketAddr,
    limits: WireLimits,
    /// See [`TcpConfig::frame_timeout`].
    frame_timeout: Option<std::time::Duration>,
    /// The receiving side: locked by each [`Connection::recv`], and once, for its whole life,
    /// by the reader [`Connection::into_frames`] makes (no lock a frame).
    reader: Arc<Mutex<Reader>>,
    /// Set by [`Connection::into_frames`]: the frames go to its reader, and a `recv` fails at
    /// once (it would wait for the receiving side the reader holds).
    framed: AtomicBool,
    /// An account handed in by `bill_to`, taken by the reader at its next read.
    bill_to: std::sync::Mutex<Option<Account>>,
    /// Set by `bill_to` once `bill_to` holds its account: the reader locks `bill_to` only then.
    bill_to_set: AtomicBool,
    /// Taken within one poll at a time (a `try_send_now`, a step of a `send_many`), never
    /// across an await: a plain lock, whose uncontended round trip costs a fraction of an
    /// async one's.
    writer: std::sync::Mutex<Writer>,
    /// The turn of the sends that wait (`send_many`, `close`), held across their awaits; a
    /// `try_send_now` never waits for it (it finds [`Writer::busy`]).
    turn: Mutex<()>,
    /// Set when a send was abandoned half-way (its future dropped) or failed: the byte stream
    /// may hold part of a frame, so nothing more can be sent.
    write_broken: AtomicBool,
    /// How a receive polls after a send ([`TcpConfig::spin`]); `None` when it never does.
    spin: Option<SpinPolicy>,
    /// What the last poll learnt: whether polling pays (see [`tensorwire_core::spin`]).
    spin_paid: AtomicBool,
    /// When the last send finished, in nanoseconds after `epoch` (0: never).
    last_send: AtomicU64,
    epoch: Instant,
    /// Non-blocking `recv`s made while polling, and those that found bytes (for tests).
    polls: AtomicU64,
    polls_found: AtomicU64,
    /// Whether the frame `recv` returned last left nothing in the read buffer
    /// (`Connection::received_all`).
    received_all: AtomicBool,
}

impl std::fmt::Debug for TcpConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpConnection")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl TcpConnection {
    pub(crate) fn new(stream: TcpStream, peer: SocketAddr, config: &TcpConfig) -> Self {
        let (read, write) = stream.into_split();
        let limits = config.limits;
        TcpConnection {
            peer,
            limits,
            frame_timeout: config.frame_timeout,
            reader: Arc::new(Mutex::new(Reader {
                half: read,
                decoder: FrameDecoder::new(limits).with_buffer_reuse(config.buffer_reuse),
                buf: BytesMut::with_capacity(READ_BUF),
                frame_deadline: None,
                account: None,
                charged: 0,
            })),
            bill_to: std::sync::Mutex::new(None),
            bill_to_set: AtomicBool::new(false),
            writer: std::sync::Mutex::new(Writer {
                half: write,
                held: Vec::new(),
                busy: false,
            }),
            turn: Mutex::new(()),
            write_broken: AtomicBool::new(false),
            spin: (!config.spin.is_zero()).then(|| {
                SpinPolicy::new(
                    config.spin,
                    std::thread::available_parallelism().map_or(true, |n| n.get() == 1),
                )
            }),
            spin_paid: AtomicBool::new(true),
            last_send: AtomicU64::new(0),
            epoch: Instant::now(),
            polls: AtomicU64::new(0),
            polls_found: AtomicU64::new(0),
            received_all: AtomicBool::new(false),
            framed: AtomicBool::new(false),
        }
    }

    /// Non-blocking `recv`s made while polling after a send, and how many found bytes.
    #[cfg(test)]
    pub(crate) fn polls(&self) -> (u64, u64) {
        (
            self.polls.load(Ordering::Relaxed),
            self.polls_found.load(Ordering::Relaxed),
        )
    }

    /// When the last send finished, if one did within the spin budget of `now`: a receive
    /// then polls for the answer until the budget from that send is spent.
    fn recent_send(&self) -> Option<Instant> {
        let nanos = self.last_send.load(Ordering::Acquire);
        (nanos != 0).then(|| self.epoch + Duration::from_nanos(nanos))
    }

    /// One non-blocking `recv` into the read buffer, bypassing the runtime's readiness (which
    /// only an `epoll_wait` sets). The runtime's readiness is left as it was, so a later wait
    /// through it may pay one read that finds nothing, never miss data.
    fn try_recv(&self, r: &mut Reader) -> std::io::Result<Polled> {
        self.polls.fetch_add(1, Ordering::Relaxed);
        r.buf.reserve(READ_BUF);
        let spare = r.buf.spare_capacity_mut();
        match socket2::SockRef::from(r.half.as_ref()).recv(spare) {
            Ok(0) => Ok(Polled::End),
            Ok(n) => {
                // SAFETY: `recv` initialised the first `n` bytes of the spare capacity.
                unsafe { r.buf.set_len(r.buf.len() + n) };
                self.polls_found.fetch_add(1, Ordering::Relaxed);
                Ok(Polled::Bytes)
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                Ok(Polled::Nothing)
            }
            Err(e) => Err(e),
        }
    }

    /// Polls for the answer to a recent send (see [`TcpConfig::spin`]): what the last poll
    /// found; [`Polled::Nothing`] when the budget ran out (or there was no recent send) and
    /// the caller should wait in the runtime.
    async fn poll_for_answer(&self, r: &mut Reader) -> std::io::Result<Polled> {
        let (Some(policy), Some(sent)) = (self.spin, self.recent_send()) else {
            return Ok(Polled::Nothing);
        };
        let mut wait = policy.begin(self.spin_paid.load(Ordering::Relaxed), sent);
        let learn = |wait: &SpinWait| {
            if let Some(paid) = wait.found() {
                self.spin_paid.store(paid, Ordering::Relaxed);
            }
        };
        loop {
            match wait.step(Instant::now()) {
                SpinStep::Poll => {
                    let polled = self.try_recv(r)?;
                    if polled != Polled::Nothing {
                        learn(&wait);
                        return Ok(polled);
                    }
                    give_turn(&mut wait).await;
                }
                SpinStep::Yield => {
                    give_turn(&mut wait).await;
                    let polled = self.try_recv(r)?;
                    if polled != Polled::Nothing {
                        learn(&wait);
                        return Ok(polled);
                    }
                    let before = Instant::now();
                    std::thread::yield_now();
                    wait.yielded(before.elapsed());
                }
                SpinStep::Sleep => {
                    self.spin_paid.store(wait.slept(), Ordering::Relaxed);
                    return Ok(Polled::Nothing);
                }
            }
            if let Some(again) = self.recent_send() {
                wait.sent(again);
            }
        }
    }

    /// `frames` checked against the limits and ready to write.
    fn outgoing(&self, frames: Vec<Frame>) -> Result<Vec<OutgoingFrame>, TransportError> {
        frames
            .into_iter()
            .map(|frame| self.outgoing_frame(frame))
            .collect()
    }

    /// `frame` checked against the limits and ready to write.
    fn outgoing_frame(&self, frame: Frame) -> Result<OutgoingFrame, TransportError> {
        OutgoingFrame::new(frame, &self.limits).map_err(|source| TransportError::Wire {
            peer: self.peer,
            source,
        })
    }

    /// Writes `frame` (with at most [`WHOLE_PAYLOADS`] payloads) in one vectored write straight
    /// from its parts, its preamble on the stack: no [`OutgoingFrame`] made, moved and walked.
    fn try_write_whole(&self, half: &OwnedWriteHalf, frame: &Frame) -> Whole {
        if frame.payloads.len() > WHOLE_PAYLOADS {
            return Whole::NotInPlace;
        }
        let preamble = match Preamble::new(frame, &self.limits) {
            Ok(Some(preamble)) => preamble,
            Ok(None) => return Whole::NotInPlace,
            Err(source) => {
                return Whole::Failed(TransportError::Wire {
                    peer: self.peer,
                    source,
                })
            }
        };
        let mut slices = [IoSlice::new(&[]); 2 + WHOLE_PAYLOADS];
        slices[0] = IoSlice::new(preamble.as_bytes());
        slices[1] = IoSlice::new(&frame.header);
        for (slice, payload) in slices[2..].iter_mut().zip(frame.payloads.iter()) {
            *slice = IoSlice::new(payload);
        }
        let n = 2 + frame.payloads.len();
        match half.try_write_vectored(&slices[..n]) {
            Ok(written) if written as u64 == preamble.frame_len() => Whole::Written,
            Ok(0) => {
                self.write_broken.store(true, Ordering::Release);
                Whole::Failed(self.write_zero())
            }
            Ok(written) => Whole::Short(preamble, written),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Whole::Short(preamble, 0),
            Err(e) => {
                self.write_broken.store(true, Ordering::Release);
                Whole::Failed(TransportError::io(self.peer, "sending", &e))
            }
        }
    }

    /// A send finished: a receive may poll for its answer (see [`TcpConfig::spin`]).
    fn sent(&self) {
        if self.spin.is_some() {
            let nanos = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.last_send.store(nanos.max(1), Ordering::Release);
        }
    }

    /// The sending side, for one poll (a poisoned lock's state is still whole: nothing
    /// under it panics half-way through a change).
    fn writer(&self) -> std::sync::MutexGuard<'_, Writer> {
        self.writer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn broken_error(&self) -> TransportError {
        TransportError::Io {
            addr: self.peer,
            op: "sending",
            kind: std::io::ErrorKind::BrokenPipe,
            message: "an earlier send failed or was cancelled half-way; the connection cannot \
                      send any more"
                .to_owned(),
        }
    }

    fn write_zero(&self) -> TransportError {
        TransportError::Io {
            addr: self.peer,
            op: "sending",
            kind: std::io::ErrorKind::WriteZero,
            message: "the socket accepted no bytes".to_owned(),
        }
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

    fn read_error(&self, decoder: &FrameDecoder, e: &std::io::Error) -> TransportError {
        use std::io::ErrorKind::*;
        match e.kind() {
            ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => {
                self.eof_error(decoder)
            }
            _ => TransportError::io(self.peer, "receiving", e),
        }
    }
}

/// What one non-blocking `recv` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Polled {
    /// Bytes, now in the read buffer.
    Bytes,
    /// The end of the stream.
    End,
    /// Nothing yet.
    Nothing,
}

/// Lets the runtime's other tasks run between two polls (see
/// [`tensorwire_core::spin::Turn`]), as the shared-memory transport does: every other turn
/// also lets a current-thread runtime's `block_on` future run. A wait that *is* the `block_on`
/// future (no task id) only requeues.
async fn give_turn(wait: &mut SpinWait) {
    match wait.turn() {
        Turn::Runtime if tokio::task::try_id().is_some() => tokio::task::yield_now().await,
        Turn::Runtime | Turn::Requeue => requeue().await,
    }
}

/// Marks the write side broken when dropped armed: covers errors and send futures dropped
/// half-way through a frame.
struct BrokenOnDrop<'a>(&'a AtomicBool, bool);

/// Clears [`Writer::busy`] when the `send_many` that set it ends, however it ends.
struct BusyUntilDrop<'a>(&'a TcpConnection);

impl Drop for BusyUntilDrop<'_> {
    fn drop(&mut self) {
        self.0.writer().busy = false;
    }
}

impl Drop for BrokenOnDrop<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0.store(true, Ordering::Release);
        }
    }
}

/// What [`TcpConnection::try_write_whole`] did.
enum Whole {
    /// The frame's preamble does not fit in place, or it has too many payloads: nothing written.
    NotInPlace,
    /// All of it is written.
    Written,
    /// This many bytes of it (fewer than all, possibly none) are written: the socket is full.
    Short(Preamble, usize),
    /// The frame breaks the limits (nothing written), or the write failed (the connection is
    /// marked broken).
    Failed(TransportError),
}

/// Fills `slices` with as many whole frames of `outs` as fit in one vectored write, then part
/// of the next; returns how many slices it filled.
fn fill_slices<'a>(outs: &'a [OutgoingFrame], slices: &mut [IoSlice<'a>]) -> usize {
    let mut n = 0;
    for out in outs {
        let start = n;
        n += out.io_slices(&mut slices[n..]);
        let covered: u64 = slices[start..n].iter().map(|s| s.len() as u64).sum();
        if covered < out.remaining() || n == slices.len() {
            break;
        }
    }
    n
}

/// Marks `written` bytes of `outs` as written; returns how many frames that finished.
fn advance(outs: &mut [OutgoingFrame], written: usize) -> usize {
    let (mut left, mut done) = (written, 0);
    while left > 0 && done < outs.len() {
        let step = usize::try_from(outs[done].remaining())
            .unwrap_or(usize::MAX)
            .min(left);
        outs[done].advance(step);
        left -= step;
        if outs[done].is_done() {
            done += 1;
        }
    }
    done
}

impl TcpConnection {
    /// [`Connection::recv`], unboxed: the receiving side locked for this one frame; once a
    /// frame reader was made, an error at once.
    async fn recv_frame(&self) -> Result<Frame, TransportError> {
        if self.framed.load(Ordering::Acquire) {
            return Err(TransportError::read_by_frames(self.peer));
        }
        let mut guard = self.reader.lock().await;
        self.recv_from(&mut guard).await
    }

    /// The next frame from `r`, the receiving side, held by the caller: locked for one frame
    /// ([`recv_frame`](Self::recv_frame)) or for the life of [`Connection::into_frames`]'s
    /// reader.
    async fn recv_from(&self, r: &mut Reader) -> Result<Frame, TransportError> {
        // Close both directions at once: the peer sees the connection go away and we do not
        // need the writer's lock (a sender may hold it).
        let shut = |r: &Reader| {
            let _ = socket2::SockRef::from(r.half.as_ref()).shutdown(std::net::Shutdown::Both);
        };
        loop {
            // A hand-over is seen at the first pass after `bill_to` set the flag, before the
            // next charge; the lock is taken only then.
            if self.bill_to_set.load(Ordering::Relaxed)
                && self.bill_to_set.swap(false, Ordering::Acquire)
            {
                if let Some(account) = self
                    .bill_to
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take()
                {
                    let charged = r.charged;
                    r.recharge(0).ok();
                    r.account = Some(account);
                    r.recharge(charged).ok();
                }
            }
            // Between frames with nothing buffered (the usual first pass of a receive) the
            // decoder has nothing to look at; a failed decoder counts as mid-frame and repeats
            // its error here.
            let mid_frame = r.decoder.is_mid_frame();
            if !mid_frame && r.buf.is_empty() {
                // Nothing is held between frames: a completed frame's charge was dropped.
                debug_assert_eq!(r.charged, 0);
            } else {
                match r.decoder.decode(&mut r.buf) {
                    Ok(Some(frame)) => {
                        r.frame_deadline = None;
                        // Complete: its holder counts it now.
                        r.recharge(0).ok();
                        self.received_all.store(r.buf.is_empty(), Ordering::Relaxed);
                        return Ok(frame);
                    }
                    Ok(None) => {}
                    Err(source) => {
                        shut(r);
                        r.release();
                        tracing::warn!(peer = %self.peer, error = %source, "closing connection: bad frame");
                        return Err(TransportError::Wire {
                            peer: self.peer,
                            source,
                        });
                    }
                }
                // What the frame being received holds so far (what arrived, or its buffer if
                // larger) is the peer's, within its budget.
                let holding = usize::try_from(r.decoder.received())
                    .unwrap_or(usize::MAX)
                    .max(r.decoder.reserved());
                if let Err(source) = r.recharge(holding) {
                    shut(r);
                    r.release();
                    tracing::warn!(peer = %self.peer, error = %source, "closing connection: over the peer's budget");
                    return Err(TransportError::OverBudget {
                        peer: self.peer,
                        source,
                    });
                }
                if r.decoder.is_mid_frame() && r.frame_deadline.is_none() {
                    r.frame_deadline = self.frame_timeout.map(|t| tokio::time::Instant::now() + t);
                }
            }
            // The decoder consumed everything buffered; read more. Between frames, the answer
            // to a recent send is polled for first (see `TcpConfig::spin`).
            if !r.decoder.is_mid_frame() {
                match self.poll_for_answer(r).await {
                    Ok(Polled::Bytes) => continue,
                    Ok(Polled::End) => {
                        let e = self.eof_error(&r.decoder);
                        r.release();
                        return Err(e);
                    }
                    Ok(Polled::Nothing) => {}
                    Err(e) => {
                        let e = self.read_error(&r.decoder, &e);
                        r.release();
                        return Err(e);
                    }
                }
            }
            let deadline = r.frame_deadline;
            let reader = &mut *r;
            let read = async {
                if let Some(mut direct) = reader.decoder.direct_read_buf(DIRECT_READ_MIN) {
                    reader.half.read_buf(&mut direct).await
                } else {
                    reader.buf.reserve(READ_BUF);
                    reader.half.read_buf(&mut reader.buf).await
                }
            };
            let read = match deadline {
                Some(at) => match tokio::time::timeout_at(at, read).await {
                    Ok(read) => read,
                    Err(_) => {
                        let received = r.decoder.received();
                        shut(r);
                        r.release();
                        let after = self.frame_timeout.unwrap_or_default();
                        tracing::warn!(peer = %self.peer, ?after, received, "closing connection: a frame stalled");
                        return Err(TransportError::FrameTimeout {
                            peer: self.peer,
                            after,
                            received,
                        });
                    }
                },
                None => read.await,
            };
            match read {
                Ok(0) => {
                    let e = self.eof_error(&r.decoder);
                    r.release();
                    return Err(e);
                }
                Ok(_) => {}
                Err(e) => {
                    let e = self.read_error(&r.decoder, &e);
                    r.release();
                    return Err(e);
                }
            }
        }
    }
}

/// What [`Connection::into_frames`]' reader keeps between frames: its connection, and the
/// receiving side once its first receive has locked it.
type Held = (
    Arc<TcpConnection>,
    Option<tokio::sync::OwnedMutexGuard<Reader>>,
);

#[async_trait]
impl Connection for TcpConnection {
    fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    fn transport(&self) -> &'static str {
        "tcp"
    }

    fn received_all(&self) -> bool {
        self.received_all.load(Ordering::Relaxed)
    }

    fn check_peer_name(&self, _name: &str) -> Result<(), IdentityError> {
        // The cluster secret authenticates membership, not a name.
        Ok(())
    }

    fn peer_credentials(&self) -> tensorwire_core::identity::Credentials {
        tensorwire_core::identity::Credentials::Membership
    }

    async fn send(&self, frame: Frame) -> Result<(), TransportError> {
        self.send_many(vec![frame]).await
    }

    async fn send_many(&self, frames: Vec<Frame>) -> Result<(), TransportError> {
        let mut outs = self.outgoing(frames)?;
        let _turn = self.turn.lock().await;
        let held = {
            let mut writer = self.writer();
            if self.write_broken.load(Ordering::Acquire) {
                return Err(self.broken_error());
            }
            // What a `try_send_now` left goes first: the stream may be in the middle of its
            // frame.
            let held = !writer.held.is_empty();
            if held {
                let mut all = std::mem::take(&mut writer.held);
                all.append(&mut outs);
                outs = all;
            }
            writer.busy = true;
            held
        };
        let _busy = BusyUntilDrop(self);
        // Armed while frames remain: a drop or failure then leaves the stream mid-frame (or,
        // conservatively, between frames of the batch).
        let mut guard = BrokenOnDrop(&self.write_broken, held);
        let mut first = 0;
        while first < outs.len() {
            let written = {
                // The slices are made in each poll, on its stack: held across the await they
                // would add 1 KiB to this future, which `async_trait` boxes on every send
                // (past the allocator's small-size caches: ~600 instructions a send).
                let pending = &outs[first..];
                let wrote = std::future::poll_fn(|cx| {
                    let mut slices = [IoSlice::new(&[]); MAX_IOV];
                    let n = fill_slices(pending, &mut slices);
                    tokio::io::AsyncWrite::poll_write_vectored(
                        std::pin::Pin::new(&mut self.writer().half),
                        cx,
                        &slices[..n],
                    )
                });
                match wrote.await {
                    Ok(0) => {
                        guard.1 = true;
                        return Err(self.write_zero());
                    }
                    Ok(written) => written,
                    Err(e) => {
                        guard.1 = true;
                        return Err(TransportError::io(self.peer, "sending", &e));
                    }
                }
            };
            first += advance(&mut outs[first..], written);
            guard.1 = first < outs.len();
        }
        self.sent();
        Ok(())
    }

    fn try_send_now(&self, frames: &mut Vec<Frame>) -> Option<Result<(), TransportError>> {
        let mut writer = match self.writer.try_lock() {
            Ok(writer) => writer,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        if writer.busy || !writer.held.is_empty() {
            // A `send_many` under way, or the next one writes what was held first.
            return None;
        }
        if self.write_broken.load(Ordering::Acquire) {
            return Some(Err(self.broken_error()));
        }
        // The frames move into the writer's own list (empty here, with the room earlier
        // writes left): neither list is allocated or freed per send.
        let mut outs = std::mem::take(&mut writer.held);
        if let [frame] = &frames[..] {
            // The usual single message: written straight from the frame.
            match self.try_write_whole(&writer.half, frame) {
                Whole::NotInPlace => {}
                Whole::Failed(e) => {
                    writer.held = outs;
                    return Some(Err(e));
                }
                Whole::Written => {
                    frames.clear();
                    writer.held = outs;
                    self.sent();
                    return Some(Ok(()));
                }
                Whole::Short(preamble, written) => {
                    // The rest goes on as any frame's below (or with the next `send_many`).
                    let mut out = OutgoingFrame::with_preamble(preamble, frames.remove(0));
                    out.advance(written);
                    outs.push(out);
                }
            }
        }
        for frame in frames.drain(..) {
            match self.outgoing_frame(frame) {
                Ok(out) => outs.push(out),
                Err(e) => return Some(Err(e)),
            }
        }
        let mut guard = BrokenOnDrop(&self.write_broken, true);
        let mut first = 0;
        while first < outs.len() {
            let mut slices = [IoSlice::new(&[]); MAX_IOV];
            let n = fill_slices(&outs[first..], &mut slices);
            let written = match writer.half.try_write_vectored(&slices[..n]) {
                Ok(0) => return Some(Err(self.write_zero())),
                Ok(written) => written,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // The socket is full: the rest goes with the next `send_many`.
                    outs.drain(..first);
                    writer.held = outs;
                    guard.1 = false;
                    return None;
                }
                Err(e) => return Some(Err(TransportError::io(self.peer, "sending", &e))),
            };
            first += advance(&mut outs[first..], written);
        }
        guard.1 = false;
        self.sent();
        // Written: the list's room serves the next send (a large batch's goes).
        outs.clear();
        if outs.capacity() <= KEPT_OUTGOING {
            writer.held = outs;
        }
        Some(Ok(()))
    }

    async fn recv(&self) -> Result<Frame, TransportError> {
        self.recv_frame().await
    }

    fn into_frames(self: Arc<Self>) -> Box<dyn FrameReader> {
        // One receive future for all frames, not one box per frame; the receiving side is
        // locked at the first receive and held until the reader is dropped, not locked and
        // let go of for every frame. A `recv` from now on (which the port forbids) fails at
        // once, as shared memory's does, instead of waiting for the reader's drop.
        self.framed.store(true, Ordering::Release);
        Box::new(EachFrame::new((self, None), |(c, held): Held| async move {
            let mut r = match held {
                Some(r) => r,
                None => Arc::clone(&c.reader).lock_owned().await,
            };
            let received = c.recv_from(&mut r).await;
            (received, (c, Some(r)))
        }))
    }

    fn bill_to(&self, account: Account) {
        *self
            .bill_to
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(account);
        // After the account is in place: the reader that sees the flag finds it.
        self.bill_to_set.store(true, Ordering::Release);
    }

    async fn close(&self) -> Result<(), TransportError> {
        let _turn = self.turn.lock().await;
        std::future::poll_fn(|cx| {
            tokio::io::AsyncWrite::poll_shutdown(std::pin::Pin::new(&mut self.writer().half), cx)
        })
        .await
        .map_err(|e| TransportError::io(self.peer, "closing", &e))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn prepare_sets_the_liveness_options_of_the_config() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, _server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let config = TcpConfig::insecure().with_liveness(
            Some(Duration::from_secs(3)),
            Some(Duration::from_millis(7_500)),
        );
        let stream = prepare(client.unwrap(), addr, &config).unwrap();
        let socket = socket2::SockRef::from(&stream);
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.keepalive_time().unwrap(), Duration::from_secs(3));
        assert_eq!(socket.keepalive_interval().unwrap(), Duration::from_secs(3));
        #[cfg(target_os = "linux")]
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(Duration::from_millis(7_500))
        );
        // Off means the kernel's defaults: no probes.
        let (client, _server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let stream = prepare(
            client.unwrap(),
            addr,
            &TcpConfig::insecure().with_liveness(None, None),
        )
        .unwrap();
        assert!(!socket2::SockRef::from(&stream).keepalive().unwrap());
    }

    /// Two connected [`TcpConnection`]s (no handshake), each with `spin`.
    async fn pair(spin: Duration) -> (TcpConnection, TcpConnection) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let config = TcpConfig::insecure().with_spin(spin);
        let client = prepare(client.unwrap(), addr, &config).unwrap();
        let (server, peer) = server.unwrap();
        let server = prepare(server, peer, &config).unwrap();
        (
            TcpConnection::new(client, addr, &config),
            TcpConnection::new(server, peer, &config),
        )
    }

    fn frame(text: &'static [u8]) -> Frame {
        Frame::message(bytes::Bytes::from_static(text), vec![])
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_answer_to_a_send_is_read_by_polling_not_through_epoll() {
        // A budget far above any scheduling delay: the answer must come while polling.
        let (client, server) = pair(Duration::from_secs(5)).await;
        let server = std::sync::Arc::new(server);
        let echo = tokio::spawn({
            let server = server.clone();
            async move {
                let got = server.recv().await.unwrap();
                server.send(frame(b"answer")).await.unwrap();
                got
            }
        });
        client.send(frame(b"question")).await.unwrap();
        let answer = client.recv().await.unwrap();
        assert_eq!(&answer.header[..], b"answer");
        assert_eq!(&echo.await.unwrap().header[..], b"question");
        let (polls, found) = client.polls();
        assert_eq!(found, 1, "the answer arrived while polling");
        assert!(polls >= 1);
        // The server had sent nothing before the question: it waited without polling.
        assert_eq!(server.polls(), (0, 0));
    }

    #[tokio::test]
    async fn the_frame_reader_holds_the_receiving_side_and_a_recv_besides_it_fails() {
        let (client, server) = pair(Duration::ZERO).await;
        let server = Arc::new(server);
        for text in [&b"one"[..], b"two", b"three"] {
            client
                .send(Frame::message(bytes::Bytes::from_static(text), vec![]))
                .await
                .unwrap();
        }
        let mut frames = Arc::clone(&server).into_frames();
        async fn next(frames: &mut Box<dyn FrameReader>) -> bytes::Bytes {
            let frame = std::future::poll_fn(|cx| frames.poll_recv(cx)).await;
            frame.unwrap().header
        }
        assert_eq!(&next(&mut frames).await[..], b"one");
        // Held between frames: not let go of after each.
        assert!(server.reader.try_lock().is_err());
        assert_eq!(&next(&mut frames).await[..], b"two");
        assert!(server.reader.try_lock().is_err());
        // A `recv` besides the reader fails at once (typed, as shared memory's), where it
        // waited for the reader's drop, and takes no frame from it.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let recv_fails_at_once = |c: &TcpConnection, cx: &mut std::task::Context<'_>| {
            let got = std::future::Future::poll(c.recv().as_mut(), cx);
            let std::task::Poll::Ready(Err(e)) = got else {
                panic!("a recv besides the frame reader did not fail at once: {got:?}");
            };
            assert!(
                matches!(
                    e,
                    TransportError::Io {
                        op: "receiving",
                        ..
                    }
                ),
                "{e:?}"
            );
        };
        recv_fails_at_once(&server, &mut cx);
        assert_eq!(&next(&mut frames).await[..], b"three");
        drop(frames);
        // Let go of with the reader; the frames stay its (a `recv` still fails).
        assert!(server.reader.try_lock().is_ok());
        recv_fails_at_once(&server, &mut cx);
    }

    #[tokio::test]
    async fn try_send_now_takes_nothing_while_a_send_many_is_under_way() {
        let (client, server) = pair(Duration::ZERO).await;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Nobody reads yet: 32 MiB cannot all fit in the socket buffers, so the send is
        // under way (part written, the rest in its own list) after its first poll.
        let big = || Frame::message(&b"big"[..], vec![bytes::Bytes::from(vec![7u8; 32 << 20])]);
        let mut send = client.send_many(vec![big()]);
        assert!(std::future::Future::poll(send.as_mut(), &mut cx).is_pending());
        let mut small = vec![frame(b"small")];
        assert!(client.try_send_now(&mut small).is_none());
        assert_eq!(small.len(), 1, "nothing taken while a send is under way");
        let (sent, got) = tokio::join!(send, server.recv());
        sent.unwrap();
        assert_eq!(&got.unwrap().header[..], b"big");
        // The send ended: the next is written at once, after it.
        assert!(matches!(client.try_send_now(&mut small), Some(Ok(()))));
        assert_eq!(&server.recv().await.unwrap().header[..], b"small");
        // A send dropped half-way lets go of the sending side too (which it left broken).
        let mut send = client.send_many(vec![big()]);
        assert!(std::future::Future::poll(send.as_mut(), &mut cx).is_pending());
        drop(send);
        let mut after = vec![frame(b"after")];
        assert!(matches!(client.try_send_now(&mut after), Some(Err(_))));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_polling_when_turned_off_or_after_the_budget() {
        let (client, server) = pair(Duration::ZERO).await;
        client.send(frame(b"question")).await.unwrap();
        server.recv().await.unwrap();
        server.send(frame(b"answer")).await.unwrap();
        assert_eq!(&client.recv().await.unwrap().header[..], b"answer");
        assert_eq!(client.polls(), (0, 0));

        // A 1 µs budget from the client's send is spent before its receive starts (the server
        // has received and answered meanwhile): it reads through the runtime without polling.
        let (client, server) = pair(Duration::from_micros(1)).await;
        client.send(frame(b"question")).await.unwrap();
        server.recv().await.unwrap();
        server.send(frame(b"answer")).await.unwrap();
        assert_eq!(&client.recv().await.unwrap().header[..], b"answer");
        assert_eq!(client.polls(), (0, 0), "the budget from the send was spent");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_closes_while_polled_ends_the_stream() {
        let (client, server) = pair(Duration::from_secs(5)).await;
        let closer = tokio::spawn(async move {
            server.recv().await.unwrap();
            drop(server);
        });
        client.send(frame(b"question")).await.unwrap();
        let err = client.recv().await.unwrap_err();
        assert!(matches!(err, TransportError::Closed { .. }), "{err}");
        closer.await.unwrap();
        assert_eq!(client.polls().1, 0, "the end of the stream is no bytes");
    }
}
