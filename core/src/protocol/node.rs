//! The node: one sans-IO value that owns an agent's protocol parts — the [`Endpoint`], the
//! gathers this worker leads ([`GatherLeader`]), the same-host device memory sharing
//! ([`IpcState`]) and, in a dynamic group, the [`DynamicMembership`] — with one way in for a
//! received frame ([`handle_frame`](Node::handle_frame)) and one for each other kind of input
//! (`handle_*`), one queue of frames out ([`poll_transmit`](Node::poll_transmit)), one timer
//! ([`poll_timeout`](Node::poll_timeout), the earliest deadline of every part) and one queue of
//! events ([`poll_event`](Node::poll_event)), as quinn-proto's `Connection` owns its streams,
//! its congestion control and its timers. A driver holds it under one lock.
//!
//! What one part tells another is applied here, not by the driver: a member admitted, added or
//! removed by the membership is handed to the endpoint (its ids, a joined peer, a peer that
//! left) and to the [`Directory`] (the members' names and device plans, which callers name
//! workers by), a lost peer reaches the membership, and every loss the endpoint reports
//! (however it was found) reaches the gathers.
//!
//! A peer's requests are held back while its budget says so (its replies wait unread, or as
//! many of its requests run as one peer's may): they come out of `poll_event` once it reads
//! again ([`handle_reading_again`](Node::handle_reading_again)) or one of its requests ends
//! ([`handle_request_finished`](Node::handle_request_finished)), in order, and are dropped
//! with the peer.
//!
//! In a dynamic group the membership's events come out as what the driver must do
//! ([`MemberAction`]: dial, name or forget a member, complete a join or leave, publish the
//! coordinator's record), a worker introducing itself gets its answer from
//! [`handle_introduced`](Node::handle_introduced), and the membership's frames for a peer whose
//! connection is being set up wait in the node until it is attached (see [`members`]).
//!
//! Frames are told apart by their kind in one place, [`route`]: a message frame is the
//! endpoint's (its [`Envelope`], whose announced IPC descriptors the IPC state checks first),
//! a control frame is a same-host IPC message (its tag, [`crate::ipc::FRAME_TAG`]) or else a
//! membership message, and any other kind is no frame of an agent's
//! ([`MalformedMessage::UnexpectedKind`]). [`handle_frame`](Node::handle_frame) hands each to
//! its part. The IPC state has no timers; the buffers it lets go of (released by the peer, or
//! held for a lost one) are handed to the driver to drop outside its lock
//! ([`take_released`](Node::take_released)).

use std::collections::VecDeque;
use std::time::Instant;

mod held;
pub mod members;
pub use members::{
    joiner_hello, read_introduction, welcome_wait, Introduced, IntroductionError, MemberAction,
    COORDINATOR_KEY, DIAL_WITHOUT_DEADLINE, HELLO_WAIT, RPC_GROUP,
};

use super::by_id::{Waiter, Waiters};
use super::envelope::{Envelope, FrameBody};
use super::gather::{
    Contribution, GatherConfig, GatherError, GatherLeader, GatherOutcome, GatherToken,
};
use super::membership::{Directory, DynMessage, DynamicMembership};
use super::mesh::GroupFrame;
use super::{
    Endpoint, Event, Header, LostCause, MalformedMessage, MessageId, Payload, ProtocolViolation,
    RRefHandle, RemoteError, RequestToken, Transmit, WorkerId,
};
use crate::ipc::{encode_message, IpcMessage, IpcState};
use crate::wire::{Frame, FrameKind, Payloads};

/// What a handle of the application's leaves to do when it is dropped: done by
/// [`Node::let_go`] under the driver's lock, at once or, when that lock was busy at the drop
/// (a drop may run anywhere, even under it), on the driver's next pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// A call's outcome dropped unread: its waiter is taken out.
    Waiter(MessageId),
    /// A reference's local handle dropped, at that time: the endpoint decides what that
    /// means ([`Endpoint::drop_handle`]).
    Reference(RRefHandle, Instant),
}

/// What the driver does about a peer it dropped ([`Node::handle_dropped`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dropped {
    /// The peer is this worker: nothing changed.
    Itself,
    /// The peer is lost: close its connection, after sending `tell` if there is one (bounded
    /// as the mesh bounds its own aborts).
    Close {
        /// What tells the peer why (a static group's abort), sent before the close.
        tell: Option<Frame>,
    },
}

/// A frame received on an agent's connection, told apart by its kind ([`route`]).
#[derive(Debug)]
pub enum Inbound {
    /// A message frame: its envelope, and its payloads (attached after the driver checked the
    /// tensors it announces: [`Envelope::attach`]).
    Message {
        /// The decoded envelope.
        envelope: Envelope,
        /// The frame's payloads: the encoded value, then one per announced tensor.
        payloads: Payloads,
    },
    /// A same-host IPC message (a control frame with the IPC tag).
    Ipc(IpcMessage),
    /// A dynamic group's membership message (any other control frame).
    Membership(DynMessage),
}

/// Tells a received frame's kind and decodes it as that kind's message: the one place where
/// an agent's frames are told apart.
///
/// # Errors
/// A frame that is no message of its kind ([`ProtocolViolation::Malformed`], or
/// [`ProtocolViolation::Ipc`] for an IPC message that does not parse), or of a kind that never
/// reaches an agent ([`MalformedMessage::UnexpectedKind`]: a process group's frames are taken
/// by the group before the agent sees them).
// Inlined into `Node::handle_frame`: the `Inbound` it makes is then taken apart in place,
// not moved (with its envelope) through a returned `Result`.
#[inline]
pub fn route(frame: Frame) -> Result<Inbound, ProtocolViolation> {
    match frame.kind {
        FrameKind::Message => Ok(Inbound::Message {
            envelope: Envelope::decode(&frame.header)?,
            payloads: frame.payloads,
        }),
        FrameKind::Control => match crate::ipc::decode_message(&frame.header) {
            Some(msg) => msg.map(Inbound::Ipc).map_err(ProtocolViolation::Ipc),
            None => DynMessage::decode(&frame.header)
                .map(Inbound::Membership)
                .map_err(|e| ProtocolViolation::Malformed(MalformedMessage::Undecodable(e))),
        },
        kind @ FrameKind::Collective => Err(ProtocolViolation::Malformed(
            MalformedMessage::UnexpectedKind { kind },
        )),
    }
}

/// What the node has for a peer ([`Node::poll_transmit`]).
#[derive(Debug)]
pub enum Outgoing<B> {
    /// An endpoint message (the driver encodes its envelope and body).
    Message(Transmit<B>),
    /// A control frame, already encoded (a membership message).
    Control {
        /// The destination.
        to: WorkerId,
        /// The frame.
        frame: Frame,
    },
}

/// What the driver must do or learn ([`Node::poll_event`]). Exhaustive, as each part's events
/// are.
#[derive(Debug)]
pub enum NodeEvent<B> {
    /// The endpoint's.
    Endpoint(Event<B>),
    /// What the driver must do for the membership (after the node applied to the endpoint
    /// what concerns it).
    Member(MemberAction),
    /// A peer passed its budget with its requests held back: the driver drops it as lost
    /// ([`LostCause::OverBudget`]) and closes its connection, as for a queue past the budget.
    OverBudget {
        /// The peer.
        peer: WorkerId,
        /// What it held, and what it asked for.
        over: crate::budget::OverBudget,
    },
    /// The answer to a gather contribution ([`Node::handle_contribution`]).
    Gathered {
        /// The token the contribution got.
        token: GatherToken,
        /// The round's outcome for that caller.
        outcome: GatherOutcome,
    },
}

/// Why a call of the gather function was refused ([`Node::handle_gather_call`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct GatherCallRefused {
    /// What was wrong with it.
    pub error: GatherCallError,
    /// The violation to drop the caller for (`None`: the caller is this worker).
    pub violation: Option<ProtocolViolation>,
}

/// What was wrong with a call of the gather function ([`GatherCallRefused`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GatherCallError {
    /// Its arguments are no contribution.
    #[error(transparent)]
    Undecodable(crate::codec::Undecodable),
    /// Its contribution is one no honest member sends.
    #[error(transparent)]
    Forged(GatherError),
}

/// Whether a request of `function` from `from` to worker `me` counts as one of its sender's
/// running requests (its end is told with [`Node::respond`] or
/// [`Node::handle_request_finished`]): a peer's, except a gather's contribution. A pure
/// decision, asked without the node (and its lock) as a request is dispatched.
pub fn counts_as_running(me: WorkerId, from: WorkerId, function: &str) -> bool {
    held::counts(me, from, function)
}

/// An agent's protocol state: the endpoint, the gathers it leads, its IPC state and the
/// dynamic group's membership, driven as one. `B` is the body of the endpoint's messages, `H`
/// what keeps one IPC export valid (the device backend's value, held until the peer releases
/// it).
pub struct Node<B, H = ()> {
    ep: Endpoint<B>,
    /// Whether workers join and leave (a dynamic group): calls and replies only from members.
    dynamic: bool,
    membership: Option<DynamicMembership>,
    /// Who is in the group (names, ranks, device plans) as this worker sees it: fixed in a
    /// static group, changed with the membership's events in a dynamic one.
    directory: Directory,
    /// The dynamic group's gathers this worker leads (idle until a member contributes).
    gathers: GatherLeader,
    /// Same-host device memory sharing with the peers (its messages are control frames).
    ipc: IpcState<H>,
    /// The exports the IPC state let go of, for the driver to drop outside its lock.
    released: Vec<H>,
    /// Peers' requests held back while their budget says so.
    held: held::Held<B>,
    /// The membership's messages, encoded, and what the driver must do for it.
    control: VecDeque<(WorkerId, Frame)>,
    events: VecDeque<MemberAction>,
    /// The membership's messages for peers whose connection is being set up.
    connecting: members::Connecting,
    /// The deadline the driver's timer sleeps until ([`arm_timer`](Self::arm_timer)).
    armed: Option<Instant>,
}

impl<B: Payload, H> Node<B, H> {
    /// A node over `ep`, `ipc` and the members `directory` knows at the start; `dynamic` for
    /// a group whose workers join and leave (its membership is set once this worker founds or
    /// joins it: [`set_membership`](Self::set_membership)).
    pub fn new(ep: Endpoint<B>, dynamic: bool, ipc: IpcState<H>, directory: Directory) -> Self {
        let gathers = GatherLeader::new(ep.id(), GatherConfig::default());
        Self {
            ep,
            dynamic,
            membership: None,
            directory,
            gathers,
            ipc,
            released: Vec::new(),
            held: held::Held::default(),
            control: VecDeque::new(),
            events: VecDeque::new(),
            connecting: members::Connecting::default(),
            armed: None,
        }
    }

    /// The endpoint, to read.
    pub fn ep(&self) -> &Endpoint<B> {
        &self.ep
    }

    /// The endpoint, to change (its commands: calls, replies, references, shutdown). What it
    /// produces comes out of the node's `poll_*`.
    pub fn ep_mut(&mut self) -> &mut Endpoint<B> {
        &mut self.ep
    }

    /// Does what a dropped handle left to do (`item`), with the driver's `waiters`: a waiter
    /// taken out is returned, for the driver to drop after its lock (its body may hold what
    /// takes that lock).
    pub fn let_go<T>(&mut self, waiters: &mut Waiters<T>, item: Abandoned) -> Option<Waiter<T>> {
        match item {
            Abandoned::Waiter(id) => waiters.remove(id),
            Abandoned::Reference(handle, at) => {
                self.ep.drop_handle(handle, at);
                None
            }
        }
    }

    /// Who is in the group as this worker sees it now (names, ranks, device plans): the
    /// membership's additions and removals are applied to it as they are to the endpoint.
    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// The IPC state, to read (the paths each peer's tensors took).
    pub fn ipc(&self) -> &IpcState<H> {
        &self.ipc
    }

    /// The IPC state, to change (its commands: route a tensor, report an export or import).
    /// The messages it queues come out of [`poll_transmit`](Self::poll_transmit).
    pub fn ipc_mut(&mut self) -> &mut IpcState<H> {
        &mut self.ipc
    }

    /// The exports the IPC state let go of since the last call (released by their peer, or
    /// held for a peer lost): drop them outside any lock.
    pub fn take_released(&mut self) -> Vec<H> {
        std::mem::take(&mut self.released)
    }

    /// Whether a request of `function` from `from` counts as one of its sender's running
    /// requests (its end is told with [`handle_request_finished`](Self::handle_request_finished)):
    /// a peer's, except a gather's contribution. [`counts_as_running`] without the node.
    pub fn counts_as_running(&self, from: WorkerId, function: &str) -> bool {
        held::counts(self.ep.id(), from, function)
    }

    /// Answers request `token` with `outcome` ([`Endpoint::respond`]: true if it was expected)
    /// and, when it `counted` as one of its sender's running requests ([`counts_as_running`]),
    /// tells its end as [`handle_request_finished`](Self::handle_request_finished) does, in the
    /// same turn: its sender's held requests that may run now come out of
    /// [`poll_event`](Self::poll_event).
    pub fn respond(
        &mut self,
        token: RequestToken,
        outcome: Result<B, RemoteError>,
        counted: bool,
    ) -> bool {
        let expected = self.ep.respond(token, outcome);
        if counted {
            self.handle_request_finished(token.from());
        }
        expected
    }

    /// `peer` reads again (its queue came down to half the hold mark): its held requests come
    /// out of [`poll_event`](Self::poll_event) while its budget lets them. True if some do.
    pub fn handle_reading_again(&mut self, peer: WorkerId) -> bool {
        self.held.resume(&self.ep, peer)
    }

    /// A request of `peer` that counted as running is answered: its held requests come out of
    /// [`poll_event`](Self::poll_event) if its budget lets them now. True if some do.
    pub fn handle_request_finished(&mut self, peer: WorkerId) -> bool {
        let account = self.ep.budget().account(peer);
        account.finish_request() && self.held.holds(peer) && self.held.resume(&self.ep, peer)
    }

    /// Whether this is a dynamic group's node.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic
    }

    /// The membership, once this worker founded or is joining a dynamic group.
    pub fn membership(&self) -> Option<&DynamicMembership> {
        self.membership.as_ref()
    }

    /// Starts (or restarts, for a join tried again) the membership with `membership`.
    pub fn set_membership(&mut self, membership: DynamicMembership, now: Instant) {
        self.membership = Some(membership);
        self.absorb(now);
    }

    /// Runs `f` on the membership (`None` if there is none), then takes what it produced.
    pub fn with_membership<T>(
        &mut self,
        now: Instant,
        f: impl FnOnce(&mut DynamicMembership) -> T,
    ) -> Option<T> {
        let out = self.membership.as_mut().map(f);
        self.absorb(now);
        out
    }

    /// The gathers this worker leads, to read (their rounds, held bytes, waiting callers).
    pub fn gathers(&self) -> &GatherLeader {
        &self.gathers
    }

    /// `from`'s contribution to a gather this worker leads arrived at `now`: its answer comes
    /// out of [`poll_event`](Self::poll_event) as [`NodeEvent::Gathered`] under the token
    /// returned (at once when it is refused, else when its round ends: complete, past its
    /// deadline, or short of a lost member).
    pub fn handle_contribution(
        &mut self,
        now: Instant,
        from: WorkerId,
        contribution: Contribution,
    ) -> GatherToken {
        self.gathers.handle_contribution(now, from, contribution)
    }

    /// `from`'s call of the gather function at `now`, with `args`: its [`Contribution`],
    /// encoded, read here by the one decoder the fuzz targets drive, then handed in as
    /// [`handle_contribution`](Self::handle_contribution) does (the answer comes under the
    /// token returned).
    ///
    /// # Errors
    /// [`GatherCallRefused`]: bytes that are no contribution; and from another worker, a
    /// contribution no honest member sends ([`GatherError::is_forgery`]), with the violation
    /// the driver drops that worker for. (This worker's own refused contribution is answered
    /// as any refusal.)
    pub fn handle_gather_call(
        &mut self,
        now: Instant,
        from: WorkerId,
        args: &[u8],
    ) -> Result<GatherToken, Box<GatherCallRefused>> {
        let by_peer = from != self.ep.id();
        let c = Contribution::decode(args).map_err(|e| {
            Box::new(GatherCallRefused {
                violation: by_peer.then(|| {
                    ProtocolViolation::Malformed(MalformedMessage::Undecodable(e.clone()))
                }),
                error: GatherCallError::Undecodable(e),
            })
        })?;
        let token = self.gathers.handle_contribution(now, from, c);
        match self.gathers.refusal(token) {
            Some(e) if by_peer && e.is_forgery() => Err(Box::new(GatherCallRefused {
                violation: Some(ProtocolViolation::Gather(e.clone())),
                error: GatherCallError::Forged(e.clone()),
            })),
            _ => Ok(token),
        }
    }

    /// The caller behind `token` no longer waits (its handler ended): the gathers forget it.
    pub fn handle_gather_abandoned(&mut self, token: GatherToken) {
        self.gathers.handle_abandoned(token);
    }

    /// Whether `from` may send calls and replies: in a dynamic group, a member only.
    pub fn may_call(&self, from: WorkerId) -> bool {
        !self.dynamic || self.membership.as_ref().is_some_and(|m| m.may_call(from))
    }

    /// A message from `from` (its header and body, attached: [`Envelope::attach`]).
    ///
    /// # Errors
    /// [`ProtocolViolation::NotAMember`] from a worker that is not a member of a dynamic
    /// group; else the endpoint's violations. The node is unchanged by either.
    pub fn handle_message(
        &mut self,
        from: WorkerId,
        header: Header,
        body: Option<B>,
        now: Instant,
    ) -> Result<(), ProtocolViolation> {
        if !self.may_call(from) {
            return Err(ProtocolViolation::NotAMember);
        }
        self.ep.handle_message(from, header, body, now)
    }

    /// A frame received from `from` at `now`, told apart by its kind ([`route`]) and handed
    /// to its part: a message to the endpoint (after the IPC state checked the descriptors it
    /// announces), an IPC message to the IPC state, any other control frame to the membership.
    ///
    /// # Errors
    /// The frame's violation: [`route`]'s, [`ProtocolViolation::Ipc`] for a descriptor from a
    /// peer that never agreed to IPC or a message the IPC state refuses, and those of
    /// [`handle_message`](Self::handle_message) and
    /// [`handle_membership`](Self::handle_membership). The node is unchanged by any.
    pub fn handle_frame(
        &mut self,
        now: Instant,
        from: WorkerId,
        frame: Frame,
    ) -> Result<(), ProtocolViolation>
    where
        B: From<FrameBody>,
    {
        match route(frame)? {
            Inbound::Message { envelope, payloads } => {
                if envelope.tensors.iter().any(|m| m.ipc.is_some()) {
                    self.ipc
                        .check_import(from)
                        .map_err(ProtocolViolation::Ipc)?;
                }
                let (header, body) = envelope.attach(payloads)?;
                self.handle_message(from, header, body.map(B::from), now)
            }
            Inbound::Ipc(msg) => self.handle_ipc(from, msg),
            Inbound::Membership(msg) => self.handle_membership(from, msg, now),
        }
    }

    /// A same-host IPC message from `from`: the exports it releases are handed to the driver
    /// ([`take_released`](Self::take_released)), its answers go out of
    /// [`poll_transmit`](Self::poll_transmit).
    ///
    /// # Errors
    /// [`ProtocolViolation::Ipc`] for a message no honest peer sends; nothing changed.
    pub fn handle_ipc(&mut self, from: WorkerId, msg: IpcMessage) -> Result<(), ProtocolViolation> {
        let released = self
            .ipc
            .handle_message(from, msg)
            .map_err(ProtocolViolation::Ipc)?;
        self.released.extend(released);
        Ok(())
    }

    /// A membership message from `from`.
    ///
    /// # Errors
    /// [`ProtocolViolation::Membership`] for one the protocol refuses,
    /// [`ProtocolViolation::MembershipInStaticGroup`] where there is no membership.
    pub fn handle_membership(
        &mut self,
        from: WorkerId,
        msg: DynMessage,
        now: Instant,
    ) -> Result<(), ProtocolViolation> {
        match self.with_membership(now, |m| m.handle_message(from, msg, now)) {
            Some(handled) => handled.map_err(ProtocolViolation::Membership),
            None => Err(ProtocolViolation::MembershipInStaticGroup),
        }
    }

    /// The connection to `peer` is gone for `cause`: the endpoint records it (the first cause
    /// stays), the membership drops the member (handing coordination on if it had it), its
    /// held requests are dropped and the IPC state lets go of what it held for it.
    pub fn handle_peer_lost(&mut self, peer: WorkerId, cause: LostCause, now: Instant) {
        self.released.extend(self.ipc.peer_lost(peer));
        self.held.drop_peer(&mut self.ep, peer, now);
        self.ep.handle_peer_lost(peer, cause, now);
        self.with_membership(now, |m| m.handle_lost(peer, now));
    }

    /// The driver drops `peer` at `now` for `cause`, found above the endpoint (a layer's
    /// check: a violation of distributed autograd's state, a budget passed by what the driver
    /// holds for it). Never this worker ([`Dropped::Itself`]: its own messages' violations are
    /// not applied); otherwise the peer is lost as [`handle_peer_lost`](Self::handle_peer_lost)
    /// loses it (a peer lost already keeps its first cause), and its connection is to close,
    /// after `tell` where the peer can hear why: a static group's connection is the group
    /// mesh's, whose reader at the peer takes an abort in this worker's name, so that the
    /// peer's errors name the cause rather than a connection closed; a dynamic group's peer
    /// reads no group frames.
    pub fn handle_dropped(&mut self, peer: WorkerId, cause: LostCause, now: Instant) -> Dropped {
        let me = self.ep.id();
        if peer == me {
            return Dropped::Itself;
        }
        let tell = (!self.dynamic).then(|| {
            GroupFrame::Abort {
                rank: me,
                reason: format!("it dropped rank {peer}: {cause}"),
            }
            .frame(Vec::new())
        });
        self.handle_peer_lost(peer, cause, now);
        Dropped::Close { tell }
    }

    /// Runs every part's timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.ep.handle_timeout(now);
        self.gathers.handle_timeout(now);
        self.with_membership(now, |m| m.handle_timeout(now));
    }

    /// When [`handle_timeout`](Self::handle_timeout) must be called next: the earliest
    /// deadline of every part.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let membership = self
            .membership
            .as_ref()
            .and_then(DynamicMembership::poll_timeout);
        [
            self.ep.poll_timeout(),
            membership,
            self.gathers.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The driver's timer sleeps until the next deadline ([`poll_timeout`](Self::poll_timeout)),
    /// which is returned and remembered: [`timer_moved_earlier`](Self::timer_moved_earlier)
    /// then tells whether a change needs the timer woken.
    pub fn arm_timer(&mut self) -> Option<Instant> {
        self.armed = self.poll_timeout();
        self.armed
    }

    /// Whether the next deadline is now earlier than the one the driver's timer sleeps until
    /// (or it sleeps on none): then the driver is to be woken to sleep on the new one. A
    /// deadline as late or later waits for the timer as it is.
    pub fn timer_moved_earlier(&self) -> bool {
        match (self.poll_timeout(), self.armed) {
            (Some(next), Some(armed)) => next < armed,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// The next frame for a peer: the membership's first (few, and rarely), then the IPC
    /// state's (a hello before the message whose tensor made it), then the endpoint's in order.
    pub fn poll_transmit(&mut self) -> Option<Outgoing<B>> {
        if let Some((to, frame)) = self.control.pop_front() {
            return Some(Outgoing::Control { to, frame });
        }
        if let Some((to, msg)) = self.ipc.poll_transmit() {
            let frame = Frame::control(encode_message(&msg), vec![]);
            return Some(Outgoing::Control { to, frame });
        }
        self.ep.poll_transmit().map(Outgoing::Message)
    }

    /// The next event: the membership's first (a member added before the calls it enables),
    /// then the held requests that may run now, then the endpoint's (a peer's request its
    /// budget holds back kept), then the gathers' answers. A loss the endpoint reports (however it
    /// was found: a member that left, a forgery found after its message) reaches the gathers
    /// and the IPC state as it goes out (the gathers' answers to the rounds it ends follow).
    pub fn poll_event(&mut self) -> Option<NodeEvent<B>> {
        if let Some(ev) = self.events.pop_front() {
            return Some(NodeEvent::Member(ev));
        }
        if let Some(ev) = self.held.take_ready() {
            return Some(NodeEvent::Endpoint(ev));
        }
        if let Some((peer, over)) = self.held.take_over() {
            return Some(NodeEvent::OverBudget { peer, over });
        }
        while let Some(ev) = self.ep.poll_event() {
            if let Event::PeerLost { peer, .. } = &ev {
                self.gathers.handle_peer_lost(*peer);
                self.released.extend(self.ipc.peer_lost(*peer));
            }
            // A peer's request its budget holds back is kept (or drops the peer).
            match self.held.admit(&self.ep, ev) {
                Some(ev) => return Some(NodeEvent::Endpoint(ev)),
                None => {
                    if let Some((peer, over)) = self.held.take_over() {
                        return Some(NodeEvent::OverBudget { peer, over });
                    }
                }
            }
        }
        self.gathers
            .poll_answer()
            .map(|(token, outcome)| NodeEvent::Gathered { token, outcome })
    }

    /// Takes the membership's messages (held for a peer being connected) and events,
    /// applying to the endpoint what concerns it.
    fn absorb(&mut self, now: Instant) {
        let Some(m) = self.membership.as_mut() else {
            return;
        };
        let mut events = Vec::new();
        while let Some(ev) = m.poll_event() {
            events.push(ev);
        }
        while let Some((to, msg)) = m.poll_transmit() {
            let frame = Frame::control(msg.encode(), vec![]);
            if let Some(frame) = self.connecting.hold(to, frame) {
                self.control.push_back((to, frame));
            }
        }
        for ev in events {
            self.apply_membership_event(ev, now);
        }
    }
}

#[cfg(test)]
mod tests;
