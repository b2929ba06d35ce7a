//! A hostile peer: a worker that completes the real setup of a group (the transport's
//! handshake with the cluster secret or certificate, the static group's join, the agent's
//! init) and then sends, on the very connections the group set up and with the agent's own
//! message encoding, messages it has no right to send.
//!
//! [`HostileTransport`] wraps the transport of the hostile worker. Every connection the
//! other members dial to it is recorded under the rank its hello names, so a test gets the
//! link to a victim ([`HostilePeer::send`]) once the group is up. The hostile worker is a real
//! agent otherwise: it answers, owns values and holds forks, so a test can set up state (a
//! value it owns, a fork it was given) before it forges a message about it.
//! [`HostilePeer::withhold`] keeps chosen messages of its own agent from leaving (an
//! acknowledgement it never sends, say), to hold a victim in a state worth forging against.
//! [`HostilePeer::heard`] waits for a message the members sent it (to learn an id of theirs,
//! say, and forge a message naming it).
//!
//! [`hostile_group`] starts a static group whose highest rank is hostile: in a static group
//! the lower rank of each pair dials, so every member dials the hostile rank and greets it
//! first.
//!
//! ```
//! use std::sync::Arc;
//! use tensorwire_core::ports::transport::Transport;
//! use tensorwire_core::protocol::{Header, LostCause};
//! use tensorwire_transport_memory::MemoryNetwork;
//! use tensorwire_rpc::PeerEvent;
//! use tensorwire_testkit::hostile::hostile_group;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let net = MemoryNetwork::new();
//! let group = hostile_group(
//!     3,
//!     |_| Arc::new(net.transport()) as Arc<dyn Transport>,
//!     |_| tensorwire_testkit::base_options(),
//! )
//! .await
//! .unwrap();
//! let mut events = group.agents[0].peer_events();
//! // An acknowledgement of a control message rank 0 never sent: rank 0 drops rank 2.
//! group.hostile.send(0, &Header::Ack { id: u64::MAX / 2 }, None).await.unwrap();
//! match events.recv().await {
//!     Some(PeerEvent::Lost { worker: 2, cause: LostCause::Misbehaved(v) }) => {
//!         assert!(v.to_string().contains("acknowledgement"), "{v}")
//!     }
//!     other => panic!("{other:?}"),
//! }
//! # });
//! ```

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{
    Connection, IdentityError, Listener, Transport, TransportError,
};
use tensorwire_core::protocol::mesh::Hello;
use tensorwire_core::protocol::{Header, MethodTarget};
use tensorwire_core::protocol::{LostCause, WorkerId};
use tensorwire_core::wire::{Frame, FrameKind};
use tensorwire_rpc::{start_agent, Agent, PeerEvent, PeerEvents, Rendezvous, RpcOptions};
use tensorwire_store::InMemoryStore;
use tokio::sync::Notify;

use crate::cluster::StartError;

/// Decides whether a message its agent sends is withheld (see [`HostilePeer::withhold`]).
type Filter = Box<dyn Fn(&Header) -> bool + Send + Sync>;

/// What the transport wrapper and the test's handle share.
#[derive(Default)]
struct Shared {
    /// The connection each member dialled to us, by the rank its hello named.
    links: Mutex<HashMap<u32, Arc<dyn Connection>>>,
    /// Woken when a link is recorded.
    linked: Notify,
    /// Messages of the hostile worker's own agent that are not sent.
    withhold: Mutex<Option<Filter>>,
    /// Messages the members send it that its agent never sees (answers to forged calls).
    swallow: Mutex<Option<Filter>>,
    /// The headers of the messages the members sent it, in the order they arrived.
    heard: Mutex<Vec<Header>>,
    /// Woken when one is recorded.
    heard_more: Notify,
    /// Set by [`HostilePeer::stop_reading`]: its agent reads nothing more.
    deaf: AtomicBool,
}

impl Shared {
    fn withheld(&self, frame: &Frame) -> bool {
        if frame.kind != FrameKind::Message {
            return false;
        }
        let guard = self.withhold.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(filter) = guard.as_ref() else {
            return false;
        };
        match tensorwire_rpc::fuzzing::decode_message(frame.clone(), 0) {
            Ok((header, _)) => filter(&header),
            Err(_) => false,
        }
    }
}

/// The test's handle on a hostile worker: its links to the other members, and what it sends
/// on them.
#[derive(Clone)]
pub struct HostilePeer {
    shared: Arc<Shared>,
}

impl fmt::Debug for HostilePeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let links = self
            .shared
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut ranks: Vec<_> = links.keys().copied().collect();
        ranks.sort_unstable();
        f.debug_struct("HostilePeer")
            .field("links", &ranks)
            .finish_non_exhaustive()
    }
}

impl HostilePeer {
    /// The connection rank `rank` dialled to this worker, once its hello has arrived
    /// (waits for it; bound the wait with the test's own deadline).
    pub async fn link(&self, rank: u32) -> Arc<dyn Connection> {
        loop {
            let linked = self.shared.linked.notified();
            if let Some(conn) = self
                .shared
                .links
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&rank)
            {
                return Arc::clone(conn);
            }
            linked.await;
        }
    }

    /// Sends `header` to rank `to` as the agent encodes a message (the same envelope,
    /// announcing no tensors), with `body` as its payload, on the connection the group set up.
    pub async fn send(
        &self,
        to: u32,
        header: &Header,
        body: Option<Bytes>,
    ) -> Result<(), TransportError> {
        self.send_method(to, header, None, body).await
    }

    /// Like [`send`](Self::send), for a method call (or remote method) on `target`: the
    /// envelope names the reference and the fork the sender claims to hold.
    pub async fn send_method(
        &self,
        to: u32,
        header: &Header,
        target: Option<MethodTarget>,
        body: Option<Bytes>,
    ) -> Result<(), TransportError> {
        let header = tensorwire_rpc::fuzzing::encode_method_header(header, target, &[]);
        let frame = Frame {
            kind: FrameKind::Message,
            header: header.into(),
            payloads: body.into_iter().collect(),
        };
        self.send_frame(to, frame).await
    }

    /// Like [`send`](Self::send), with host tensors beside the body, announced in the
    /// envelope as the agent announces them (their bytes as payloads, landing on the host).
    /// In `body`, a tensor is written as its index among `tensors` (a `u32`), as the agent
    /// writes it.
    pub async fn send_with_tensors(
        &self,
        to: u32,
        header: &Header,
        body: Bytes,
        tensors: &[tensorwire_core::tensor::Tensor],
    ) -> Result<(), TransportError> {
        let metas: Vec<tensorwire_core::tensor::TensorMeta> = tensors
            .iter()
            .map(|t| tensorwire_core::tensor::TensorMeta {
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
                device: tensorwire_core::device::Device::Cpu,
                ipc: None,
            })
            .collect();
        let header = tensorwire_rpc::fuzzing::encode_method_header(header, None, &metas);
        let mut payloads = vec![body];
        payloads.extend(tensors.iter().map(|t| {
            t.host_bytes()
                .cloned()
                .expect("send_with_tensors takes host tensors")
        }));
        let frame = Frame {
            kind: FrameKind::Message,
            header: header.into(),
            payloads: payloads.into(),
        };
        self.send_frame(to, frame).await
    }

    /// Sends any frame to rank `to` on the connection the group set up (a header that does
    /// not parse, a control frame, ...).
    pub async fn send_frame(&self, to: u32, frame: Frame) -> Result<(), TransportError> {
        self.link(to).await.send(frame).await
    }

    /// Waits until the hostile worker has received a message whose header `pick` chooses
    /// (one received before the call counts), and returns that header (the first such). Bound
    /// the wait with the test's own deadline.
    pub async fn heard(&self, pick: impl Fn(&Header) -> bool) -> Header {
        loop {
            let more = self.shared.heard_more.notified();
            tokio::pin!(more);
            more.as_mut().enable();
            if let Some(h) = self
                .shared
                .heard
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .find(|h| pick(h))
            {
                return h.clone();
            }
            more.await;
        }
    }

    /// Whether the hostile worker has received, so far, a message whose header `pick` chooses
    /// (for checking that something never arrived, once the sender has dropped it).
    pub fn has_heard(&self, pick: impl Fn(&Header) -> bool) -> bool {
        self.shared
            .heard
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(pick)
    }

    /// From now on, messages of the hostile worker's own agent for which `filter` is true are
    /// not sent (it "forgets" to acknowledge, to reply, ...). Replaces an earlier filter.
    pub fn withhold(&self, filter: impl Fn(&Header) -> bool + Send + Sync + 'static) {
        *self
            .shared
            .withhold
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Box::new(filter));
    }

    /// From now on the hostile worker reads nothing the members send it (its agent's reads
    /// never return): what they send it piles up in their queues for it, as with a peer
    /// that never reads.
    pub fn stop_reading(&self) {
        self.shared.deaf.store(true, Ordering::Release);
    }

    /// From now on, messages the members send it for which `filter` is true are heard (see
    /// [`heard`](Self::heard)) but not handed to its own agent: the answer to a call the test
    /// forged would be a reply its agent never asked for. Replaces an earlier filter.
    pub fn swallow(&self, filter: impl Fn(&Header) -> bool + Send + Sync + 'static) {
        *self
            .shared
            .swallow
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Box::new(filter));
    }
}

/// A transport wrapper for the hostile worker: it records the connections other members
/// dial to it (under the rank their hello names) for its [`HostilePeer`], and drops what
/// [`HostilePeer::withhold`] picks of its agent's messages.
pub struct HostileTransport {
    inner: Arc<dyn Transport>,
    shared: Arc<Shared>,
}

impl fmt::Debug for HostileTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostileTransport")
            .field("inner", &self.inner.name())
            .finish_non_exhaustive()
    }
}

impl HostileTransport {
    /// Wraps `inner`; the [`HostilePeer`] is the test's handle.
    pub fn new(inner: Arc<dyn Transport>) -> (Self, HostilePeer) {
        let shared = Arc::new(Shared::default());
        (
            Self {
                inner,
                shared: Arc::clone(&shared),
            },
            HostilePeer { shared },
        )
    }
}

#[async_trait]
impl Transport for HostileTransport {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, TransportError> {
        Ok(Box::new(HostileListener {
            inner: self.inner.listen(addr).await?,
            shared: Arc::clone(&self.shared),
        }))
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Connection>, TransportError> {
        // The hostile worker dials nobody in a group where it has the highest rank; a link it
        // dials is not recorded (its hello names us, not the peer).
        Ok(Box::new(HostileConnection {
            inner: Arc::from(self.inner.connect(addr).await?),
            shared: Arc::clone(&self.shared),
            greeted: AtomicBool::new(true),
        }))
    }
    fn credentials(&self) -> tensorwire_core::identity::Credentials {
        self.inner.credentials()
    }
}

struct HostileListener {
    inner: Box<dyn Listener>,
    shared: Arc<Shared>,
}

#[async_trait]
impl Listener for HostileListener {
    fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }

    async fn accept(&self) -> Result<Box<dyn Connection>, TransportError> {
        Ok(Box::new(HostileConnection {
            inner: Arc::from(self.inner.accept().await?),
            shared: Arc::clone(&self.shared),
            greeted: AtomicBool::new(false),
        }))
    }
}

struct HostileConnection {
    inner: Arc<dyn Connection>,
    shared: Arc<Shared>,
    /// Whether the dialler's hello has been read (always, for a link we dialled).
    greeted: AtomicBool,
}

#[async_trait]
impl Connection for HostileConnection {
    fn peer_addr(&self) -> SocketAddr {
        self.inner.peer_addr()
    }

    fn transport(&self) -> &'static str {
        self.inner.transport()
    }

    fn check_peer_name(&self, name: &str) -> Result<(), IdentityError> {
        self.inner.check_peer_name(name)
    }

    fn peer_credentials(&self) -> tensorwire_core::identity::Credentials {
        self.inner.peer_credentials()
    }

    fn bill_to(&self, account: tensorwire_core::budget::Account) {
        self.inner.bill_to(account);
    }

    fn cheap_sends(&self) -> bool {
        self.inner.cheap_sends()
    }

    async fn send(&self, frame: Frame) -> Result<(), TransportError> {
        if self.shared.withheld(&frame) {
            return Ok(());
        }
        self.inner.send(frame).await
    }

    async fn send_many(&self, frames: Vec<Frame>) -> Result<(), TransportError> {
        let frames: Vec<Frame> = frames
            .into_iter()
            .filter(|f| !self.shared.withheld(f))
            .collect();
        if frames.is_empty() {
            return Ok(());
        }
        self.inner.send_many(frames).await
    }

    async fn recv(&self) -> Result<Frame, TransportError> {
        loop {
            if self.shared.deaf.load(Ordering::Acquire) {
                std::future::pending::<()>().await;
            }
            let frame = self.inner.recv().await?;
            if !self.swallowed(&frame) {
                return Ok(frame);
            }
        }
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}

impl HostileConnection {
    /// Records what `frame` says; true when the agent must not see it.
    fn swallowed(&self, frame: &Frame) -> bool {
        if !self.greeted.swap(true, Ordering::AcqRel) {
            if let Ok(hello) = Hello::from_frame(frame) {
                self.shared
                    .links
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(hello.rank, Arc::clone(&self.inner));
                self.shared.linked.notify_waiters();
            }
            return false;
        }
        if frame.kind != FrameKind::Message {
            return false;
        }
        let Ok((header, _)) = tensorwire_rpc::fuzzing::decode_message(frame.clone(), 0) else {
            return false;
        };
        let swallow = self
            .shared
            .swallow
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|f| f(&header));
        self.shared
            .heard
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(header);
        self.shared.heard_more.notify_waiters();
        swallow
    }
}

/// A static group of `world` agents (`w0`, `w1`, ...) meeting through an in-memory store,
/// whose highest rank is hostile: its transport is wrapped in a [`HostileTransport`].
pub struct HostileGroup {
    /// Every agent, by rank; the last one is the hostile worker's own agent.
    pub agents: Vec<Agent>,
    /// The test's handle on the hostile worker.
    pub hostile: HostilePeer,
}

impl fmt::Debug for HostileGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostileGroup")
            .field("world", &self.agents.len())
            .field("hostile", &self.hostile)
            .finish()
    }
}

impl HostileGroup {
    /// The hostile worker's rank (the highest).
    pub fn hostile_rank(&self) -> u32 {
        (self.agents.len() - 1) as u32
    }
}

/// Starts a static group of `world` agents (at least 2) with `start_agent`, each over the
/// transport `transport(rank)` with `options(rank)`; the highest rank's transport is wrapped
/// in a [`HostileTransport`]. Fails naming the first rank that did not start.
pub async fn hostile_group(
    world: usize,
    transport: impl Fn(usize) -> Arc<dyn Transport>,
    options: impl Fn(usize) -> RpcOptions,
) -> Result<HostileGroup, StartError> {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let hostile_rank = world.saturating_sub(1);
    let mut hostile = None;
    let mut tasks = Vec::new();
    for rank in 0..world {
        let mut t = transport(rank);
        if rank == hostile_rank {
            let (wrapped, peer) = HostileTransport::new(t);
            hostile = Some(peer);
            t = Arc::new(wrapped);
        }
        let rdv = Rendezvous::from_store(Arc::clone(&store), rank, world);
        let opts = options(rank);
        tasks.push(tokio::spawn(async move {
            start_agent(t, rdv, &format!("w{rank}"), rank, Some(world), opts).await
        }));
    }
    let mut agents = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        let started = task
            .await
            .unwrap_or_else(|e| Err(tensorwire_rpc::InitError::StartTask(e).into()));
        match started {
            Ok(agent) => agents.push(agent),
            Err(error) => return Err(StartError { rank, error }),
        }
    }
    let hostile = hostile.ok_or_else(|| StartError {
        rank: 0,
        // No rank at all: rank 0, the hostile one's, is not below the world size.
        error: tensorwire_rpc::RpcError::Start(
            tensorwire_core::protocol::start::StartError::RankOutOfRange {
                rank: 0,
                world_size: world,
            },
        ),
    })?;
    Ok(HostileGroup { agents, hostile })
}

/// Waits on a victim's `events` until a peer is lost, checks that it is `hostile` (no other
/// worker may be dropped), and returns why. Bound the wait with the test's own deadline.
///
/// # Panics
///
/// If another worker is lost first, or the events end.
pub async fn dropped(events: &mut PeerEvents, hostile: WorkerId) -> LostCause {
    loop {
        match events.recv().await {
            Some(PeerEvent::Lost { worker, cause }) => {
                assert_eq!(
                    worker, hostile,
                    "only the hostile peer is dropped ({cause})"
                );
                return cause;
            }
            Some(_) => {}
            None => panic!("the victim's peer events ended"),
        }
    }
}
