//! Fault injection for tests: PyTorch's faulty agent (`FaultyTensorPipeAgent`, which drops or
//! delays chosen message types) as a [`Transport`] wrapper.
//!
//! [`FaultyTransport`] wraps any transport and, for each [`Fault`], drops or delays the first
//! `count` agent messages of one [`MessageKind`] that this worker *sends*. [`FaultyBackend`]
//! is an RPC backend (register it with [`register_backend`](tensorwire_rpc::register_backend))
//! that runs the agent over TCP wrapped this way (or, with [`FaultyBackend::start`], over any
//! transport such as the in-memory one), with faults chosen per rank, so that flows such as a
//! creation that times out can be tested deterministically.
//!
//! (It was `tensorwire_rpc::faults`; the facade keeps `tensorwire::rpc::faults` under its
//! `faults` feature.)
//!
//! ```
//! use std::time::Duration;
//! use tensorwire_testkit::faults::{Fault, FaultAction, FaultyBackend, MessageKind};
//!
//! // Rank 1 drops the first reply it sends; rank 0 delays its first `remote` by 2 s.
//! let backend = FaultyBackend::new()
//!     .with_fault(1, Fault::new(MessageKind::Reply, FaultAction::Drop, 1))
//!     .with_fault(0, Fault::new(MessageKind::Remote, FaultAction::Delay(Duration::from_secs(2)), 1));
//! assert_eq!(backend.injected(1), 0);
//! ```
//!
//! A delayed message holds back the messages sent after it on the same connection, as a slow
//! link would: connections keep their order (PyTorch's faulty agent lets later messages
//! overtake a delayed one, which TCP never does, and which can reorder a delete ahead of the
//! creation it deletes). Only agent messages are affected; the first frame of a connection
//! (who is speaking) always goes through.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tensorwire_core::ports::transport::{
    Connection, IdentityError, Listener, Transport, TransportError,
};
use tensorwire_core::protocol::Header;
use tensorwire_core::registry::RpcBackend;
use tensorwire_core::wire::{Frame, FrameKind};
use tensorwire_rendezvous::Rendezvous;

use tensorwire_core::protocol::envelope::Envelope;
use tensorwire_rpc::{start_agent, Agent, RpcError, RpcOptions, TcpBackend};

/// The kinds of agent message a [`Fault`] can pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MessageKind {
    /// A call (`rpc_sync`, `rpc_async`, methods).
    Call,
    /// A `remote()` creation.
    Remote,
    /// A `to_here()` fetch.
    Fetch,
    /// The reply to a call, remote or fetch.
    Reply,
    /// A fork request (child to owner).
    ForkRequest,
    /// A child accept (child to parent).
    ChildAccept,
    /// A user delete (user to owner).
    UserDelete,
    /// An acknowledgement of a control message.
    Ack,
    /// A creation abandoned before it was sent.
    Abandoned,
}

impl MessageKind {
    fn of(header: &Header) -> Option<Self> {
        Some(match header {
            Header::Call { .. } => Self::Call,
            Header::Remote { .. } => Self::Remote,
            Header::Fetch { .. } => Self::Fetch,
            Header::Reply { .. } => Self::Reply,
            Header::ForkRequest { .. } => Self::ForkRequest,
            Header::ChildAccept { .. } => Self::ChildAccept,
            Header::UserDelete { .. } => Self::UserDelete,
            Header::Ack { .. } => Self::Ack,
            Header::Abandoned { .. } => Self::Abandoned,
            _ => return None,
        })
    }
}

/// What happens to a message a [`Fault`] picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// It is never sent.
    Drop,
    /// It is sent after this long.
    Delay(Duration),
    /// It is sent with its envelope's forks taken out, the references staying in its bytes:
    /// a sender that hides from the receiver's checks the references it passes. Picks only
    /// requests that pass references.
    HideForks,
}

/// Drop or delay the first `count` messages of one kind that a worker sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The kind of message.
    pub kind: MessageKind,
    /// What happens to it.
    pub action: FaultAction,
    /// How many messages of that kind it affects (the first ones sent).
    pub count: usize,
}

impl Fault {
    /// A fault on the first `count` messages of `kind`.
    pub fn new(kind: MessageKind, action: FaultAction, count: usize) -> Self {
        Self {
            kind,
            action,
            count,
        }
    }
}

/// The faults of one worker, shared by its connections, with how many were injected.
#[derive(Debug, Default)]
struct Faults {
    /// Each fault with how many messages it still affects.
    left: Mutex<Vec<Fault>>,
    injected: AtomicUsize,
}

impl Faults {
    fn new(faults: Vec<Fault>) -> Self {
        Self {
            left: Mutex::new(faults),
            injected: AtomicUsize::new(0),
        }
    }

    /// The action for `frame`, if a fault picks it (and counts it).
    fn pick(&self, frame: &Frame) -> Option<FaultAction> {
        if frame.kind != FrameKind::Message {
            return None;
        }
        let envelope = Envelope::decode(&frame.header).ok()?;
        let kind = MessageKind::of(&envelope.header)?;
        let mut left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        let fault = left.iter_mut().find(|f| {
            f.kind == kind
                && f.count > 0
                && (f.action != FaultAction::HideForks || !envelope.forks.is_empty())
        })?;
        fault.count -= 1;
        self.injected.fetch_add(1, Ordering::Relaxed);
        Some(fault.action)
    }
}

/// `frame` with its envelope announcing no forks (see [`FaultAction::HideForks`]).
fn hide_forks(mut frame: Frame) -> Frame {
    if let Ok(mut envelope) = Envelope::decode(&frame.header) {
        envelope.forks.clear();
        if let Ok(header) = envelope.encode() {
            frame.header = header.into();
        }
    }
    frame
}

/// A transport that drops or delays chosen messages this worker sends (see the module docs).
pub struct FaultyTransport {
    inner: Arc<dyn Transport>,
    faults: Arc<Faults>,
}

impl fmt::Debug for FaultyTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyTransport")
            .field("inner", &self.inner.name())
            .field("faults", &self.faults)
            .finish()
    }
}

impl FaultyTransport {
    /// `inner`, with `faults` applied to what it sends.
    pub fn new(inner: Arc<dyn Transport>, faults: Vec<Fault>) -> Self {
        Self {
            inner,
            faults: Arc::new(Faults::new(faults)),
        }
    }

    /// How many messages were dropped or delayed so far.
    pub fn injected(&self) -> usize {
        self.faults.injected.load(Ordering::Relaxed)
    }

    fn wrap(&self, conn: Box<dyn Connection>) -> Box<dyn Connection> {
        Box::new(FaultyConnection {
            inner: Arc::from(conn),
            faults: Arc::clone(&self.faults),
        })
    }
}

#[async_trait]
impl Transport for FaultyTransport {
    fn name(&self) -> &'static str {
        "faulty"
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Box<dyn Listener>, TransportError> {
        Ok(Box::new(FaultyListener {
            inner: self.inner.listen(addr).await?,
            faults: Arc::clone(&self.faults),
        }))
    }

    async fn connect(&self, addr: SocketAddr) -> Result<Box<dyn Connection>, TransportError> {
        Ok(self.wrap(self.inner.connect(addr).await?))
    }
    fn credentials(&self) -> tensorwire_core::identity::Credentials {
        self.inner.credentials()
    }
}

struct FaultyListener {
    inner: Box<dyn Listener>,
    faults: Arc<Faults>,
}

#[async_trait]
impl Listener for FaultyListener {
    fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }

    async fn accept(&self) -> Result<Box<dyn Connection>, TransportError> {
        let conn = self.inner.accept().await?;
        Ok(Box::new(FaultyConnection {
            inner: Arc::from(conn),
            faults: Arc::clone(&self.faults),
        }))
    }
}

struct FaultyConnection {
    inner: Arc<dyn Connection>,
    faults: Arc<Faults>,
}

#[async_trait]
impl Connection for FaultyConnection {
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
        self.send_many(vec![frame]).await
    }

    async fn send_many(&self, frames: Vec<Frame>) -> Result<(), TransportError> {
        let mut ready = Vec::with_capacity(frames.len());
        for frame in frames {
            match self.faults.pick(&frame) {
                None => ready.push(frame),
                Some(FaultAction::Drop) => {}
                Some(FaultAction::HideForks) => ready.push(hide_forks(frame)),
                Some(FaultAction::Delay(d)) => {
                    // What came before goes now; this frame and the rest wait.
                    if !ready.is_empty() {
                        self.inner.send_many(std::mem::take(&mut ready)).await?;
                    }
                    tokio::time::sleep(d).await;
                    ready.push(frame);
                }
            }
        }
        if ready.is_empty() {
            return Ok(());
        }
        self.inner.send_many(ready).await
    }

    async fn recv(&self) -> Result<Frame, TransportError> {
        self.inner.recv().await
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.inner.close().await
    }
}

/// An RPC backend for tests: the agent over TCP (as the `TCP` backend), with faults chosen per
/// rank (see the module docs).
#[derive(Debug, Default)]
pub struct FaultyBackend {
    faults: HashMap<usize, Vec<Fault>>,
    injected: Mutex<HashMap<usize, Arc<Faults>>>,
}

impl FaultyBackend {
    /// No faults yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `fault` to what rank `rank` sends.
    pub fn with_fault(mut self, rank: usize, fault: Fault) -> Self {
        self.faults.entry(rank).or_default().push(fault);
        self
    }

    /// Starts the agent of rank `rank` (as [`start_agent`]) over `transport` wrapped with that
    /// rank's faults: any transport, the in-memory one of tests in virtual time included.
    pub async fn start(
        &self,
        transport: Arc<dyn Transport>,
        rdv: Rendezvous,
        name: &str,
        rank: usize,
        world_size: Option<usize>,
        options: RpcOptions,
    ) -> Result<Agent, RpcError> {
        let faulty = FaultyTransport::new(
            transport,
            self.faults.get(&rank).cloned().unwrap_or_default(),
        );
        self.injected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(rank, Arc::clone(&faulty.faults));
        start_agent(Arc::new(faulty), rdv, name, rank, world_size, options).await
    }

    /// How many messages rank `rank`'s agent dropped or delayed so far.
    pub fn injected(&self, rank: usize) -> usize {
        self.injected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&rank)
            .map_or(0, |f| f.injected.load(Ordering::Relaxed))
    }
}

#[async_trait]
impl RpcBackend for FaultyBackend {
    type Options = RpcOptions;
    type Store = Rendezvous;
    type Agent = Agent;
    type Error = RpcError;

    fn construct_options(
        &self,
        rpc_timeout: Duration,
        init_method: &str,
    ) -> Result<RpcOptions, RpcError> {
        // The agent runs over TCP, with the TCP backend's options.
        TcpBackend.construct_options(rpc_timeout, init_method)
    }

    async fn init_backend(
        &self,
        store: Rendezvous,
        name: &str,
        rank: usize,
        world_size: Option<usize>,
        options: RpcOptions,
    ) -> Result<Agent, RpcError> {
        let tcp: Arc<dyn Transport> = Arc::new(TcpBackend::transport(&options)?);
        self.start(tcp, store, name, rank, world_size, options)
            .await
    }
}
