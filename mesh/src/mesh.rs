//! The mesh: one authenticated connection between every pair of ranks, with a reader task per
//! connection that sorts incoming messages by (peer, collective sequence number).
//!
//! # Setting up
//! Through [`crate::link`], as core's `StaticJoin` decides: the lower rank of each pair dials
//! the higher one and sends a [`Hello`](crate::link::Hello) (group name, its rank, the world
//! size) first. Every rank but 0 listens on an ephemeral port and publishes `ip:port` in the
//! store under `tensorwire/pg/<group>/addr/<rank>`, accepts exactly the ranks below it,
//! refusing connections with a wrong or duplicate hello (logged, without stopping the setup),
//! and then removes its key. Setup is bounded by the group's timeout; its timeout error names
//! the ranks that did not connect.
//!
//! # Groups over one mesh
//! The world group and its subgroups (process groups' `Group::new_group`) share
//! the connections: each group has an id (0 for the world) and files its collectives under a
//! key holding that id and its own sequence number (see `GroupMesh`), so messages of groups
//! used at once never mix, and a failure that breaks the mesh breaks every group.
//!
//! # Frames
//! The group's own frames are [`FrameKind::Collective`](tensorwire_core::wire::FrameKind)
//! frames whose header is a [`GroupFrame`], encoded and decoded in core
//! ([`tensorwire_core::protocol::mesh`]): a collective message (its sequence number and the
//! round's [`Signature`](tensorwire_core::collective::Signature), with at most one payload), a
//! clean goodbye, an abort in the sender's own name (what it saw, in its words: a rank may only
//! report its own abort, and an abort naming another rank is a violation of its sender), and a
//! disagreement notice that tells them which ranks ran what under one sequence number.
//!
//! Before a collective message is filed it is checked against core's
//! [`Admission`]: the sender must be a member
//! of the group, the sequence number within the window, and what the sender leaves unclaimed
//! within the bounds; anything else is a [`MeshViolation`] of the sender, which is dropped.
//!
//! Every other frame belongs to the layer that shares the connections (the RPC agent) and goes
//! to the [`FrameSink`] it set, on the reader task, without another hop; a group without one
//! takes such a frame as a broken peer.
//!
//! # Failures
//! A connection that ends without a goodbye means the peer died: the mesh is then *broken*,
//! every waiting and later collective fails with [`ProcessGroupError::PeerDied`] naming that
//! rank (or [`ProcessGroupError::Misbehaved`] for a peer dropped for a violation), and the
//! other peers are told (an abort in this rank's name) in case they cannot see it themselves. A
//! connection that ends after a goodbye only fails the collectives that still expect that
//! peer's messages.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tensorwire_core::collective::inbox::{self, Admission, Held, InboxLimits};
use tensorwire_core::collective::SIGNATURE_LEN;
use tensorwire_core::ports::process_group::{MeshViolation, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{Connection, Transport};
use tensorwire_core::protocol::membership::{JoinError, StaticJoin};
use tensorwire_core::protocol::mesh::GroupFrame;
use tensorwire_core::wire::{Frame, FrameKind};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::link;

/// How long a dying mesh tries to tell each other peer which rank died.
const ABORT_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// The store key under which `rank` of `group` publishes its address.
pub fn address_key(group: &str, rank: usize) -> String {
    format!("tensorwire/pg/{group}/addr/{rank}")
}

/// Where the frames on a group's connections that are not the group's own go: the RPC
/// agent's traffic, multiplexed over the same connection per pair of ranks.
///
/// Called on the connection's reader task, in the order the frames arrive.
pub trait FrameSink: Send + Sync {
    /// A frame (kind [`FrameKind::Message`] or [`FrameKind::Control`]) from world rank
    /// `peer`, on `conn`. An error means the peer broke the protocol above: its connection is
    /// dropped, which the group takes as that rank dying.
    fn on_frame(&self, peer: usize, conn: &Arc<dyn Connection>, frame: Frame)
        -> Result<(), String>;
    /// Rank `peer`'s connection delivers nothing more (`reason`: it said goodbye, broke, or
    /// broke the protocol).
    fn on_closed(&self, peer: usize, reason: &str);
}

/// One collective message as it arrived.
#[derive(Debug)]
pub struct Incoming {
    /// The encoded signature of the round the sender ran.
    pub signature: [u8; SIGNATURE_LEN],
    /// The message bytes.
    pub payload: Bytes,
}

/// Whether a peer's connection is still delivering.
#[derive(Debug, Clone)]
enum PeerStatus {
    Open,
    /// The peer said goodbye.
    Left,
    /// The connection broke.
    Dead,
}

/// Messages of one collective from one peer, and the executor waiting for them.
#[derive(Default)]
struct Slot {
    queue: VecDeque<Incoming>,
    waker: Option<Waker>,
}

struct InboxState {
    slots: HashMap<u64, Slot>,
    status: PeerStatus,
    /// What the slots hold: bounded by the mesh's [`InboxLimits`].
    held: Held,
}

/// Messages from one peer, sorted by sequence number.
struct Inbox {
    state: Mutex<InboxState>,
}

impl Inbox {
    fn new() -> Self {
        Inbox {
            state: Mutex::new(InboxState {
                slots: HashMap::new(),
                status: PeerStatus::Open,
                held: Held::default(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Files `message` under collective key `seq` if `admit` (given what the inbox holds and
    /// whether a collective waits for exactly this message) lets it in; a message from a peer
    /// that is no longer open is dropped.
    fn push(
        &self,
        seq: u64,
        message: Incoming,
        admit: impl FnOnce(Held, bool) -> Result<(), MeshViolation>,
    ) -> Result<(), MeshViolation> {
        let waker = {
            let mut state = self.lock();
            if !matches!(state.status, PeerStatus::Open) {
                return Ok(());
            }
            let waited_on = state
                .slots
                .get(&seq)
                .is_some_and(|s| s.waker.is_some() && s.queue.is_empty());
            admit(state.held, waited_on)?;
            state.held.bytes += message.payload.len();
            state.held.messages += 1;
            let slot = state.slots.entry(seq).or_default();
            slot.queue.push_back(message);
            slot.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// The next message of collective `seq`: `Ready(None)` once the peer's connection has
    /// ended and everything that arrived before has been taken.
    fn poll_recv(&self, seq: u64, cx: &mut Context<'_>) -> Poll<Option<Incoming>> {
        let mut state = self.lock();
        let open = matches!(state.status, PeerStatus::Open);
        let slot = state.slots.entry(seq).or_default();
        if let Some(m) = slot.queue.pop_front() {
            state.held.bytes -= m.payload.len();
            state.held.messages -= 1;
            return Poll::Ready(Some(m));
        }
        if !open {
            return Poll::Ready(None);
        }
        slot.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Whether a message of collective `seq` waits, without taking it: `Ready(true)` when one
    /// does, `Ready(false)` once the connection has ended with none left, else `Pending` (and
    /// the task is woken when one arrives).
    fn poll_arrived(&self, seq: u64, cx: &mut Context<'_>) -> Poll<bool> {
        let mut state = self.lock();
        let open = matches!(state.status, PeerStatus::Open);
        let slot = state.slots.entry(seq).or_default();
        if !slot.queue.is_empty() {
            return Poll::Ready(true);
        }
        if !open {
            return Poll::Ready(false);
        }
        slot.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    #[cfg(test)]
    fn held(&self) -> Held {
        self.lock().held
    }

    fn has_message(&self, seq: u64) -> bool {
        self.lock()
            .slots
            .get(&seq)
            .is_some_and(|s| !s.queue.is_empty())
    }

    fn release(&self, seq: u64) {
        let mut state = self.lock();
        if let Some(slot) = state.slots.remove(&seq) {
            state.held.bytes -= slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
            state.held.messages -= slot.queue.len();
        }
    }

    /// Forgets every message filed under a key `of` selects; whether there was one.
    fn purge(&self, of: impl Fn(u64) -> bool) -> bool {
        let mut state = self.lock();
        let keys: Vec<u64> = state.slots.keys().copied().filter(|k| of(*k)).collect();
        let mut any = false;
        for k in keys {
            if let Some(slot) = state.slots.remove(&k) {
                any |= !slot.queue.is_empty();
                state.held.bytes -= slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
                state.held.messages -= slot.queue.len();
            }
        }
        any
    }

    /// Ends delivery: receivers drain what arrived, then see the end. Once the peer is dead
    /// (the mesh is broken: no collective starts any more) only the messages `taken` says a
    /// collective already running may still take are kept; the rest are dropped at once.
    fn close(&self, status: PeerStatus, taken: impl Fn(u64) -> bool) {
        let wakers: Vec<Waker> = {
            let mut state = self.lock();
            if matches!(state.status, PeerStatus::Open) {
                state.status = status;
            }
            let dead = matches!(state.status, PeerStatus::Dead);
            let wakers = state
                .slots
                .values_mut()
                .filter_map(|s| s.waker.take())
                .collect();
            if dead {
                let state = &mut *state;
                let held = &mut state.held;
                state.slots.retain(|key, slot| {
                    let keep = taken(*key);
                    if !keep {
                        held.bytes -= slot.queue.iter().map(|m| m.payload.len()).sum::<usize>();
                        held.messages -= slot.queue.len();
                    }
                    keep
                });
            }
            wakers
        };
        for w in wakers {
            w.wake();
        }
    }

    fn status(&self) -> PeerStatus {
        self.lock().status.clone()
    }
}

struct PeerLink {
    conn: Arc<dyn Connection>,
    inbox: Inbox,
}

struct Shared {
    rank: usize,
    /// One entry per rank; `None` for this rank.
    peers: Vec<Option<PeerLink>>,
    /// Set once, to the first failure that broke the mesh.
    failure: std::sync::OnceLock<ProcessGroupError>,
    /// Where frames that are not the group's own go (see [`FrameSink`]).
    sink: std::sync::OnceLock<Arc<dyn FrameSink>>,
    /// The groups made here and how far this rank is in each: what every collective frame is
    /// checked against before it is filed.
    admission: Mutex<Admission>,
}

impl Shared {
    fn peer(&self, rank: usize) -> Option<&PeerLink> {
        self.peers.get(rank).and_then(Option::as_ref)
    }

    fn admission(&self) -> MutexGuard<'_, Admission> {
        self.admission.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a collective already running here may take a message filed under `key`: a
    /// point-to-point message, or one of a collective this rank has reached.
    fn may_be_taken(&self, key: u64) -> bool {
        split_key(key).is_none_or(|(group, seq)| self.admission().reached(group, seq))
    }

    /// This rank sends, awaits or takes a message under collective key `key`.
    fn touch(&self, key: u64) {
        if let Some((group, seq)) = split_key(key) {
            self.admission().touched(group, seq);
        }
    }

    /// Records the first failure and ends delivery from every peer, so that every waiting
    /// collective wakes and reports it; returns whether this call set it.
    fn fail(&self, error: ProcessGroupError) -> bool {
        let first = self.failure.set(error).is_ok();
        for link in self.peers.iter().flatten() {
            link.inbox
                .close(PeerStatus::Dead, |key| self.may_be_taken(key));
        }
        first
    }
}

/// A fully connected set of ranks.
pub struct Mesh {
    shared: Arc<Shared>,
    world: usize,
    readers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("rank", &self.shared.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        for reader in &self.readers {
            reader.abort();
        }
    }
}

/// What setting up a mesh needs.
pub struct MeshSetup<'a> {
    /// The store through which ranks publish where they listen.
    pub store: &'a dyn Store,
    /// The transport that dials and listens.
    pub transport: &'a dyn Transport,
    /// The group's name: it scopes the store keys and is checked in every hello.
    pub group: &'a str,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
    /// Where to listen (port 0 for an ephemeral port); its IP is what peers are told.
    pub listen: SocketAddr,
    /// How long the whole setup may take.
    pub timeout: Duration,
    /// What a peer may make this rank hold in its collective inboxes.
    pub limits: InboxLimits,
}

impl Mesh {
    /// Connects to every other rank: this rank dials the higher ranks and accepts the lower
    /// ones (as `core::protocol::membership::StaticJoin` decides), through [`crate::link`].
    /// A rank that accepts anyone listens and publishes its address under [`address_key`], and
    /// removes that key once every lower rank has connected (nobody needs it any more), so a
    /// set-up group leaves no key in the store.
    pub async fn connect(setup: MeshSetup<'_>) -> Result<Mesh, ProcessGroupError> {
        let MeshSetup {
            store,
            transport,
            group,
            rank,
            world,
            listen,
            timeout,
            limits,
        } = setup;
        let setup_err = |reason: String| ProcessGroupError::Setup { rank, reason };
        if rank >= world {
            return Err(setup_err(format!(
                "rank {rank} is out of range for a world of {world} ranks"
            )));
        }
        let (Ok(me), Ok(world32)) = (u32::try_from(rank), u32::try_from(world)) else {
            return Err(setup_err(format!("a world of {world} ranks is too large")));
        };
        let deadline = link::deadline_after(timeout);
        let join = Mutex::new(StaticJoin::new(me, world32, None));
        let lock_join = || join.lock().unwrap_or_else(|e| e.into_inner());
        let (dials, accepts) = {
            let j = lock_join();
            (j.dials(), j.accepts())
        };
        let timed_out = || {
            let missing = lock_join().missing();
            ProcessGroupError::SetupTimeout {
                rank,
                waiting_on: missing.into_iter().map(|r| r as usize).collect(),
                timeout,
            }
        };
        let listener = if accepts > 0 {
            let listener = transport
                .listen(listen)
                .await
                .map_err(|e| setup_err(format!("cannot listen on {listen}: {e}")))?;
            store
                .set(
                    &address_key(group, rank),
                    listener.local_addr().to_string().as_bytes(),
                )
                .await
                .map_err(|e| setup_err(format!("cannot publish this rank's address: {e}")))?;
            debug!(group, rank, world, local = %listener.local_addr(), "mesh listening");
            Some(listener)
        } else {
            None
        };

        let accept = async {
            let mut accepted: Vec<(usize, Arc<dyn Connection>)> = Vec::new();
            let Some(listener) = &listener else {
                return Ok(accepted);
            };
            // Hellos are read beside the accepting, so that a connection that says nothing
            // holds up nobody else's (dropping the set ends those still unread).
            let mut hellos = tokio::task::JoinSet::new();
            while accepted.len() < accepts {
                let (conn, hello) = tokio::select! {
                    conn = listener.accept() => {
                        let conn: Arc<dyn Connection> = Arc::from(conn.map_err(|e| {
                            setup_err(format!("listener on {} failed: {e}", listener.local_addr()))
                        })?);
                        hellos.spawn(async move {
                            let hello = link::read_hello(&*conn, deadline).await;
                            (conn, hello)
                        });
                        continue;
                    }
                    Some(Ok(read)) = hellos.join_next() => read,
                    () = tokio::time::sleep_until(deadline) => return Err(timed_out()),
                };
                let hello = match hello {
                    Ok(h) => h,
                    Err(e) => {
                        warn!(group, rank, "refused a mesh connection: {e}");
                        continue;
                    }
                };
                let from = hello.rank;
                let fits = hello.group == group && hello.world == Some(world32);
                let checked = if fits {
                    lock_join().handle_connected(from, false)
                } else {
                    Err(JoinError::Refused {
                        peer: from,
                        what: "a hello for another group or world size",
                    })
                };
                match checked {
                    Ok(()) => accepted.push((from as usize, conn)),
                    Err(e) => {
                        warn!(group, rank, peer = %conn.peer_addr(), ?hello, "refused a mesh connection: {e}");
                    }
                }
            }
            // Every rank that needed this address has connected.
            if let Err(e) = store.delete_key(&address_key(group, rank)).await {
                debug!(
                    group,
                    rank, "could not remove this rank's address from the store: {e}"
                );
            }
            Ok::<_, ProcessGroupError>(accepted)
        };

        let connect = async {
            let mut connected: Vec<(usize, Arc<dyn Connection>)> = Vec::new();
            if dials.is_empty() {
                return Ok(connected);
            }
            let keys: Vec<String> = dials
                .iter()
                .map(|r| address_key(group, *r as usize))
                .collect();
            let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let remaining = deadline.saturating_duration_since(Instant::now());
            if store.wait(&key_refs, remaining).await.is_err() {
                // Who has not published: those this rank still misses, as far as it knows.
                let mut unpublished = Vec::new();
                for (r, key) in dials.iter().zip(&key_refs) {
                    if !store.check(&[key]).await.unwrap_or(false) {
                        unpublished.push(*r as usize);
                    }
                }
                return Err(ProcessGroupError::SetupTimeout {
                    rank,
                    waiting_on: unpublished,
                    timeout,
                });
            }
            let values = store.multi_get(&key_refs).await.map_err(|e| {
                setup_err(format!("reading the addresses of the higher ranks: {e}"))
            })?;
            let hello = link::Hello {
                group: group.to_owned(),
                rank: me,
                world: Some(world32),
                introduction: Vec::new(),
            };
            for (&peer, value) in dials.iter().zip(&values) {
                let text = String::from_utf8_lossy(value);
                let addr: SocketAddr = text.parse().map_err(|e| {
                    setup_err(format!(
                        "rank {peer} published the address {text:?}, which is not ip:port ({e})"
                    ))
                })?;
                let conn = link::dial(transport, addr, &hello, deadline)
                    .await
                    .map_err(|e| setup_err(format!("rank {peer}: {e}")))?;
                lock_join()
                    .handle_connected(peer, true)
                    .map_err(|e| setup_err(e.to_string()))?;
                connected.push((peer as usize, Arc::from(conn)));
            }
            Ok(connected)
        };

        let (accepted, connected) = tokio::try_join!(accept, connect)?;
        drop(listener);
        let mut conns: Vec<Option<Arc<dyn Connection>>> = (0..world).map(|_| None).collect();
        for (peer, conn) in accepted.into_iter().chain(connected) {
            conns[peer] = Some(conn);
        }
        let failure = std::sync::OnceLock::new();
        let shared = Arc::new(Shared {
            rank,
            peers: conns
                .into_iter()
                .map(|c| {
                    c.map(|conn| PeerLink {
                        conn,
                        inbox: Inbox::new(),
                    })
                })
                .collect(),
            failure,
            sink: std::sync::OnceLock::new(),
            admission: Mutex::new(Admission::new(world, limits)),
        });
        let readers = (0..world)
            .filter(|peer| *peer != rank)
            .map(|peer| tokio::spawn(read_loop(shared.clone(), peer)))
            .collect();
        debug!(group, rank, world, "mesh connected");
        Ok(Mesh {
            shared,
            world,
            readers,
        })
    }

    /// Group `id` (a subgroup of `members`, world ranks) is made on this rank: from now on its
    /// frames are taken only from its members. A non-member whose frames for it arrived
    /// before (held while the group was unknown here) broke the protocol: its frames are
    /// dropped, its connection closed, and the mesh fails naming it.
    fn register_group(&self, id: u64, members: &[usize]) {
        self.shared.admission().register_group(id, members);
        for (rank, link) in self.shared.peers.iter().enumerate() {
            let Some(link) = link else { continue };
            if members.contains(&rank)
                || !link
                    .inbox
                    .purge(|key| split_key(key).is_some_and(|(g, _)| g == id))
            {
                continue;
            }
            let violation = MeshViolation::NotInGroup { group: id };
            warn!(rank = self.shared.rank, peer = rank, %violation, "dropping a peer");
            self.shared
                .fail(ProcessGroupError::Misbehaved { rank, violation });
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let conn = link.conn.clone();
                rt.spawn(async move {
                    let _ = conn.close().await;
                });
            }
        }
    }

    /// Sends the frames on these connections that are not the group's own (every kind but
    /// [`FrameKind::Collective`]) to `sink`; `false` if a sink was set already.
    pub fn route_frames(&self, sink: Arc<dyn FrameSink>) -> bool {
        self.shared.sink.set(sink).is_ok()
    }

    /// The connection to each other rank, by world rank.
    pub fn connections(&self) -> Vec<(usize, Arc<dyn Connection>)> {
        self.shared
            .peers
            .iter()
            .enumerate()
            .filter_map(|(r, l)| l.as_ref().map(|l| (r, Arc::clone(&l.conn))))
            .collect()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The failure that broke the mesh, if any.
    pub fn broken(&self) -> Option<ProcessGroupError> {
        self.shared.failure.get().cloned()
    }

    /// Breaks the mesh with `error` (kept only if it is the first failure).
    pub fn fail(&self, error: ProcessGroupError) {
        self.shared.fail(error);
    }

    /// Receives `peer`'s next message of collective `seq` (`None`: its connection ended).
    pub async fn recv(&self, peer: usize, seq: u64) -> Option<Incoming> {
        let link = self.shared.peer(peer)?;
        self.shared.touch(seq);
        std::future::poll_fn(|cx| link.inbox.poll_recv(seq, cx)).await
    }

    /// Polls whether a message of collective `seq` from `peer` waits, without taking it:
    /// `Ready(false)` once its connection has ended with none left (or there is none).
    pub fn poll_arrived(&self, peer: usize, seq: u64, cx: &mut Context<'_>) -> Poll<bool> {
        self.shared.touch(seq);
        match self.shared.peer(peer) {
            Some(link) => link.inbox.poll_arrived(seq, cx),
            None => Poll::Ready(false),
        }
    }

    /// Whether a message of collective `seq` from `peer` is waiting.
    pub fn has_message(&self, peer: usize, seq: u64) -> bool {
        self.shared
            .peer(peer)
            .is_some_and(|l| l.inbox.has_message(seq))
    }

    /// Forgets `peer`'s messages of collective `seq`.
    pub fn release(&self, peer: usize, seq: u64) {
        if let Some(link) = self.shared.peer(peer) {
            link.inbox.release(seq);
        }
    }

    /// The error for a receive from `peer` that found the channel closed.
    pub fn closed_error(
        &self,
        peer: usize,
        collective: &'static str,
        seq: u64,
    ) -> ProcessGroupError {
        if let Some(e) = self.broken() {
            return e;
        }
        match self.shared.peer(peer).map(|l| l.inbox.status()) {
            Some(PeerStatus::Left) => ProcessGroupError::PeerLeft {
                rank: peer,
                collective,
                seq,
            },
            _ => ProcessGroupError::PeerDied {
                rank: peer,
                reported_by: None,
                reason: "its connection closed".to_owned(),
            },
        }
    }

    /// Breaks the mesh with a disagreement this rank saw, and tells every other rank.
    pub async fn report_disagreement(&self, error: &ProcessGroupError) {
        let ProcessGroupError::Disagreement {
            seq,
            peer,
            theirs,
            ours,
            here: true,
            ..
        } = error
        else {
            return;
        };
        self.shared.fail(error.clone());
        let notice = GroupFrame::Disagreement {
            seq: *seq,
            peer: *peer as u32,
            theirs: *theirs,
            ours: *ours,
        }
        .frame(Vec::new());
        for link in self.shared.peers.iter().flatten() {
            if matches!(link.inbox.status(), PeerStatus::Left) {
                continue;
            }
            let _ = tokio::time::timeout(ABORT_SEND_TIMEOUT, link.conn.send(notice.clone())).await;
        }
    }

    /// Sends one collective message to `peer`.
    pub async fn send(
        &self,
        peer: usize,
        seq: u64,
        signature: &[u8; SIGNATURE_LEN],
        payload: Bytes,
    ) -> Result<(), ProcessGroupError> {
        let link = self.shared.peer(peer).ok_or(ProcessGroupError::Send {
            rank: peer,
            reason: "no connection to that rank".to_owned(),
        })?;
        self.shared.touch(seq);
        let header = GroupFrame::data_header(seq, signature);
        let payloads = if payload.is_empty() {
            Vec::new()
        } else {
            vec![payload]
        };
        link.conn
            .send(Frame::collective(header, payloads))
            .await
            .map_err(|e| {
                self.broken().unwrap_or_else(|| ProcessGroupError::Send {
                    rank: peer,
                    reason: e.to_string(),
                })
            })
    }

    /// Says goodbye to every peer and closes the connections; collectives fail afterwards.
    pub async fn shutdown(&self, timeout: Duration) {
        self.shared.fail(ProcessGroupError::ShutDown);
        let shared = &self.shared;
        let goodbyes = shared.peers.iter().flatten().map(|link| async move {
            let _ = tokio::time::timeout(timeout, async {
                let _ = link.conn.send(GroupFrame::Goodbye.frame(Vec::new())).await;
                let _ = link.conn.close().await;
            })
            .await;
        });
        for goodbye in goodbyes {
            goodbye.await;
        }
        for reader in &self.readers {
            reader.abort();
        }
    }
}

/// Bits of a collective key below a group's id: a group's collectives count up from zero
/// in the low 48 bits, and its id (0 for the world group) sits above them, so groups over one
/// mesh never file two messages under one key.
const GROUP_SHIFT: u32 = 48;
/// The bit that marks a point-to-point key (process groups' `send` and `recv`): such keys
/// belong to a pair of ranks, not to a group, and pass through a [`GroupMesh`] unchanged.
const P2P_BIT: u64 = 1 << 63;
/// The largest subgroup id: ids fill the 15 bits between the sequence numbers and
/// `P2P_BIT`.
pub const MAX_GROUP_ID: u64 = (1 << (63 - GROUP_SHIFT)) - 1;

/// One group's view of a shared [`Mesh`]: the world group, or a subgroup of some of its ranks
/// over the same connections.
///
/// Group ranks are translated to world ranks (`members[group rank]`) and a collective's
/// sequence number to a key holding the group's id, so every group numbers its collectives
/// from zero and the messages of groups used at once never mix. The failure state is the
/// mesh's: a dead peer, a timeout or a disagreement in any group breaks every group over
/// these connections (the ranks of one group no longer agree where its collectives stand,
/// and a rank that is out of step in one group cannot vouch for another).
pub struct GroupMesh {
    mesh: Arc<Mesh>,
    /// The group's id: 0 for the world group.
    id: u64,
    /// World rank of each group rank, ascending.
    members: Arc<[usize]>,
    /// This rank in the group.
    rank: usize,
    /// Set when this subgroup (not the mesh) was shut down.
    closed: std::sync::OnceLock<ProcessGroupError>,
}

impl std::fmt::Debug for GroupMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupMesh")
            .field("id", &self.id)
            .field("rank", &self.rank)
            .field("members", &self.members)
            .finish_non_exhaustive()
    }
}

impl GroupMesh {
    /// The world group over `mesh`.
    pub fn whole(mesh: Mesh) -> Self {
        let members: Arc<[usize]> = (0..mesh.world()).collect();
        GroupMesh {
            rank: mesh.rank(),
            mesh: Arc::new(mesh),
            id: 0,
            members,
            closed: std::sync::OnceLock::new(),
        }
    }

    /// Subgroup `id` of `members` (ascending world ranks, this rank among them) over the
    /// same mesh.
    pub fn subgroup(&self, id: u64, members: Arc<[usize]>) -> Option<Self> {
        debug_assert!(id > 0 && id <= MAX_GROUP_ID);
        let here = self.mesh.rank();
        self.mesh.register_group(id, &members);
        let rank = members.iter().position(|r| *r == here)?;
        Some(GroupMesh {
            mesh: self.mesh.clone(),
            id,
            members,
            rank,
            closed: std::sync::OnceLock::new(),
        })
    }

    /// See [`Mesh::route_frames`]; on the world group only (`false` on a subgroup).
    pub fn route_frames(&self, sink: Arc<dyn FrameSink>) -> bool {
        self.id == 0 && self.mesh.route_frames(sink)
    }

    /// The connections under the group, by world rank.
    pub fn connections(&self) -> Vec<(usize, Arc<dyn Connection>)> {
        self.mesh.connections()
    }

    /// The group's id (0: the world group).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// World rank of each group rank.
    pub fn members(&self) -> &Arc<[usize]> {
        &self.members
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The group's size.
    pub fn world(&self) -> usize {
        self.members.len()
    }

    fn peer(&self, peer: usize) -> usize {
        // Out of range maps to a rank with no link, which the mesh reports as such.
        self.members.get(peer).copied().unwrap_or(usize::MAX)
    }

    fn key(&self, seq: u64) -> u64 {
        if seq & P2P_BIT != 0 {
            return seq;
        }
        debug_assert!(seq < 1 << GROUP_SHIFT, "2^48 collectives in one group");
        self.id << GROUP_SHIFT | seq
    }

    /// The failure that broke the group, if any.
    pub fn broken(&self) -> Option<ProcessGroupError> {
        self.closed.get().cloned().or_else(|| self.mesh.broken())
    }

    /// Breaks the mesh, and so every group over it, with `error`.
    pub fn fail(&self, error: ProcessGroupError) {
        self.mesh.fail(error);
    }

    /// Receives group rank `peer`'s next message of collective `seq`.
    pub async fn recv(&self, peer: usize, seq: u64) -> Option<Incoming> {
        self.mesh.recv(self.peer(peer), self.key(seq)).await
    }

    /// Polls whether a message of collective `seq` from group rank `peer` waits, without
    /// taking it (see [`Mesh::poll_arrived`]).
    pub fn poll_arrived(&self, peer: usize, seq: u64, cx: &mut Context<'_>) -> Poll<bool> {
        self.mesh.poll_arrived(self.peer(peer), self.key(seq), cx)
    }

    /// Whether a message of collective `seq` from group rank `peer` is waiting.
    pub fn has_message(&self, peer: usize, seq: u64) -> bool {
        self.mesh.has_message(self.peer(peer), self.key(seq))
    }

    /// Forgets group rank `peer`'s messages of collective `seq`.
    pub fn release(&self, peer: usize, seq: u64) {
        self.mesh.release(self.peer(peer), self.key(seq));
    }

    /// The error for a receive from group rank `peer` that found the channel closed: a peer
    /// that left is named by its group rank, a dead one (which broke every group) by its
    /// world rank.
    pub fn closed_error(
        &self,
        peer: usize,
        collective: &'static str,
        seq: u64,
    ) -> ProcessGroupError {
        if let Some(e) = self.closed.get() {
            return e.clone();
        }
        match self.mesh.closed_error(self.peer(peer), collective, seq) {
            ProcessGroupError::PeerLeft { collective, .. } => ProcessGroupError::PeerLeft {
                rank: peer,
                collective,
                seq,
            },
            other => other,
        }
    }

    /// Breaks the mesh with a disagreement this rank saw (in group ranks), and tells every
    /// other rank (in world ranks).
    pub async fn report_disagreement(&self, error: &ProcessGroupError) {
        let ProcessGroupError::Disagreement {
            seq,
            peer,
            theirs,
            ours,
            here,
            ..
        } = error
        else {
            return;
        };
        let world = ProcessGroupError::Disagreement {
            seq: *seq,
            peer: self.peer(*peer),
            theirs: *theirs,
            rank: self.mesh.rank(),
            ours: *ours,
            here: *here,
        };
        self.mesh.report_disagreement(&world).await;
    }

    /// Sends one message of collective `seq` to group rank `peer`.
    pub async fn send(
        &self,
        peer: usize,
        seq: u64,
        signature: &[u8; SIGNATURE_LEN],
        payload: Bytes,
    ) -> Result<(), ProcessGroupError> {
        self.mesh
            .send(self.peer(peer), self.key(seq), signature, payload)
            .await
    }

    /// The world group says goodbye and closes the connections (every group over them then
    /// fails with [`ProcessGroupError::ShutDown`]); a subgroup only stops taking collectives.
    pub async fn shutdown(&self, timeout: Duration) {
        if self.id == 0 {
            self.mesh.shutdown(timeout).await;
        } else {
            let _ = self.closed.set(ProcessGroupError::ShutDown);
        }
    }
}

/// The (group id, sequence number) of a collective key; `None` for a point-to-point key.
fn split_key(key: u64) -> Option<(u64, u64)> {
    (key & P2P_BIT == 0).then_some((key >> GROUP_SHIFT, key & ((1 << GROUP_SHIFT) - 1)))
}

/// Why a peer's connection delivers nothing more.
enum End {
    /// It broke, or sent what no layer takes (the words say what).
    Broken(String),
    /// It sent a group frame it had no right to send.
    Violation(MeshViolation),
}

/// Joins a frame's payloads into one message (a sender sends at most one).
fn message_bytes(payloads: Vec<Bytes>) -> Bytes {
    match payloads.len() {
        0 => Bytes::new(),
        1 => payloads.into_iter().next().unwrap_or_default(),
        _ => {
            let mut all = BytesMut::with_capacity(payloads.iter().map(Bytes::len).sum());
            for p in payloads {
                all.extend_from_slice(&p);
            }
            all.freeze()
        }
    }
}

/// Reads `peer`'s connection until it ends: the group's own frames are filed by sequence
/// number or acted on; every other frame goes to the [`FrameSink`], on this task.
async fn read_loop(shared: Arc<Shared>, peer: usize) {
    let Some(link) = shared.peer(peer) else {
        return;
    };
    let rank = shared.rank;
    let end = 'read: loop {
        let frame = match link.conn.recv().await {
            Ok(frame) => frame,
            Err(e) => break End::Broken(e.to_string()),
        };
        if frame.kind != FrameKind::Collective {
            let Some(sink) = shared.sink.get() else {
                break End::Broken(format!(
                    "it sent a {:?} frame, which a process group does not take",
                    frame.kind
                ));
            };
            if let Err(reason) = sink.on_frame(peer, &link.conn, frame) {
                let _ = link.conn.close().await;
                break End::Broken(reason);
            }
            continue;
        }
        match GroupFrame::decode(&frame.header) {
            Ok(GroupFrame::Data { seq, signature }) => {
                let payload = message_bytes(frame.payloads);
                let len = payload.len();
                let filed =
                    link.inbox
                        .push(seq, Incoming { signature, payload }, |held, waited_on| {
                            shared
                                .admission()
                                .check(peer, split_key(seq), len, waited_on, held)
                        });
                if let Err(v) = filed {
                    break End::Violation(v);
                }
            }
            Ok(GroupFrame::Goodbye) => {
                debug!(rank, peer, "peer said goodbye");
                link.inbox.close(PeerStatus::Left, |_| true);
                if let Some(sink) = shared.sink.get() {
                    sink.on_closed(peer, "it shut its group down");
                }
                return;
            }
            Ok(GroupFrame::Abort {
                rank: named,
                reason,
            }) => {
                if let Err(v) = inbox::check_abort(peer, named as usize) {
                    break 'read End::Violation(v);
                }
                warn!(rank, peer, %reason, "peer aborted its group");
                // Breaking the mesh wakes every collective waiting on any rank.
                shared.fail(ProcessGroupError::PeerAborted { rank: peer, reason });
            }
            Ok(GroupFrame::Disagreement {
                seq,
                peer: other,
                theirs,
                ours,
            }) => {
                let error = ProcessGroupError::Disagreement {
                    seq,
                    peer: other as usize,
                    theirs,
                    rank: peer,
                    ours,
                    here: false,
                };
                warn!(rank, peer, %error, "peer reports a disagreement");
                shared.fail(error);
            }
            Err(e) => break End::Broken(format!("it sent a bad group frame: {e}")),
        }
    };
    let (reason, error) = match end {
        End::Broken(reason) => {
            let error = ProcessGroupError::PeerDied {
                rank: peer,
                reported_by: None,
                reason: reason.clone(),
            };
            (reason, error)
        }
        End::Violation(violation) => {
            // Dropped: nothing more is read from it.
            let _ = link.conn.close().await;
            (
                violation.to_string(),
                ProcessGroupError::Misbehaved {
                    rank: peer,
                    violation,
                },
            )
        }
    };
    if let Some(sink) = shared.sink.get() {
        sink.on_closed(peer, &reason);
    }
    if matches!(link.inbox.status(), PeerStatus::Left) {
        return;
    }
    warn!(rank, peer, %error, "dropping the peer");
    // The failure is recorded before any inbox closes (`fail` closes them all), so that a
    // collective woken by the close reports why, not just that the connection closed.
    let first = shared.fail(error.clone());
    if first {
        // Tell the others, in case they cannot see it (a half-open connection elsewhere):
        // this rank aborts, in its own name; the reason says what it saw.
        let abort = GroupFrame::Abort {
            rank: rank as u32,
            reason: error.to_string(),
        }
        .frame(Vec::new());
        for (other, link) in shared.peers.iter().enumerate() {
            let Some(link) = link else { continue };
            if other == peer || matches!(link.inbox.status(), PeerStatus::Left) {
                continue;
            }
            let _ = tokio::time::timeout(ABORT_SEND_TIMEOUT, link.conn.send(abort.clone())).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire_core::collective::Signature;

    #[test]
    fn inbox_delivers_then_reports_the_end() {
        let inbox = Inbox::new();
        let mut cx = Context::from_waker(Waker::noop());
        inbox
            .push(
                1,
                Incoming {
                    signature: Signature::Barrier.encode(),
                    payload: Bytes::from_static(b"a"),
                },
                |_, _| Ok(()),
            )
            .unwrap();
        assert_eq!(inbox.held().bytes, 1);
        assert!(inbox.has_message(1));
        assert!(!inbox.has_message(2));
        assert!(inbox.poll_recv(2, &mut cx).is_pending());
        inbox.close(PeerStatus::Left, |_| false);
        match inbox.poll_recv(1, &mut cx) {
            Poll::Ready(Some(m)) => assert_eq!(&m.payload[..], b"a"),
            other => panic!(
                "expected the queued message, got {:?}",
                other.map(|m| m.is_some())
            ),
        }
        assert!(matches!(inbox.poll_recv(1, &mut cx), Poll::Ready(None)));
        assert!(matches!(inbox.poll_recv(2, &mut cx), Poll::Ready(None)));
        // Slots made after the end are closed from the start.
        assert!(matches!(inbox.poll_recv(3, &mut cx), Poll::Ready(None)));
        assert!(matches!(inbox.status(), PeerStatus::Left));
        inbox.release(1);
        assert!(!inbox.has_message(1));
    }

    #[test]
    fn a_dead_peers_messages_are_dropped_but_those_a_running_collective_may_take() {
        let inbox = Inbox::new();
        let mut cx = Context::from_waker(Waker::noop());
        for (key, len) in [(1u64, 3usize), (5, 100), (P2P_BIT | 9, 7)] {
            inbox
                .push(
                    key,
                    Incoming {
                        signature: Signature::Barrier.encode(),
                        payload: Bytes::from(vec![0u8; len]),
                    },
                    |_, _| Ok(()),
                )
                .unwrap();
        }
        assert_eq!(
            inbox.held(),
            Held {
                bytes: 110,
                messages: 3
            }
        );
        // This rank has reached collective 1 only; collective 5 will never run.
        inbox.close(PeerStatus::Dead, |key| {
            split_key(key).is_none_or(|(_, s)| s <= 1)
        });
        assert_eq!(
            inbox.held(),
            Held {
                bytes: 10,
                messages: 2
            }
        );
        assert!(!inbox.has_message(5));
        assert!(matches!(inbox.poll_recv(1, &mut cx), Poll::Ready(Some(_))));
        assert!(matches!(inbox.poll_recv(1, &mut cx), Poll::Ready(None)));
        // Nothing is filed after the end.
        assert_eq!(
            inbox.push(
                2,
                Incoming {
                    signature: Signature::Barrier.encode(),
                    payload: Bytes::from_static(b"late"),
                },
                |_, _| Ok(()),
            ),
            Ok(())
        );
        assert!(!inbox.has_message(2));
    }
}
