//! Deterministic tests of the node: frames told apart by kind, and nodes driven over FIFO
//! links of real frames with a virtual clock (the sim kit's).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::ipc::encode_message;
use crate::protocol::gather::{Contribution, GatherOutcome, GatherToken};
use crate::protocol::membership::{Accepted, MemberRecord, MembershipError};
use crate::protocol::mesh::HelloReply;
use crate::protocol::{CallError, EndpointConfig};
use crate::sim::{Clock, Links};
use crate::validate::WorkerDeviceInfo;

type Body = Vec<u8>;

impl From<FrameBody> for Vec<u8> {
    fn from(body: FrameBody) -> Self {
        body.data.to_vec()
    }
}

fn node(id: WorkerId, dynamic: bool) -> Node<Body> {
    Node::new(
        Endpoint::new(id, EndpointConfig::default()),
        dynamic,
        IpcState::new(None, crate::ipc::IpcConfig::default()),
        directory(id),
    )
}

/// The directory of worker `id` that knows only itself.
fn directory(id: WorkerId) -> Directory {
    Directory::new(
        &format!("w{id}"),
        &[],
        &crate::device::DeviceMaps::new(),
        &[record(id)],
    )
}

fn record(rank: WorkerId) -> MemberRecord {
    MemberRecord {
        rank,
        addr: SocketAddr::from(([127, 0, 0, 1], 1000 + rank as u16)),
        devices: WorkerDeviceInfo {
            name: format!("w{rank}"),
            ..WorkerDeviceInfo::default()
        },
    }
}

const OP: Duration = Duration::from_secs(30);

/// An endpoint message as the agent's links frame it: the envelope, then the body's bytes.
fn message_frame(t: Transmit<Body>) -> Frame {
    let envelope = Envelope {
        header: t.header,
        target: None,
        forks: Vec::new(),
        tensors: Vec::new(),
    };
    let payloads = t.body.map(|b| vec![Bytes::from(b)]).unwrap_or_default();
    Frame::message(envelope.encode().expect("an envelope encodes"), payloads)
}

#[test]
fn each_kind_of_frame_goes_to_its_part() {
    let call = Transmit {
        to: 1,
        header: Header::Call {
            id: 3,
            function: "echo".into(),
            timeout: Duration::from_secs(1),
        },
        body: Some(b"hi".to_vec()),
    };
    match route(message_frame(call)) {
        Ok(Inbound::Message { envelope, payloads }) => {
            assert!(matches!(envelope.header, Header::Call { id: 3, .. }));
            assert_eq!(payloads, vec![Bytes::from_static(b"hi")]);
        }
        other => panic!("a message frame went elsewhere: {other:?}"),
    }
    let ipc = IpcMessage::Release(vec![4, 5]);
    match route(Frame::control(encode_message(&ipc), vec![])) {
        Ok(Inbound::Ipc(msg)) => assert_eq!(msg, ipc),
        other => panic!("an IPC frame went elsewhere: {other:?}"),
    }
    let dyn_msg = DynMessage::Left { rank: 2 };
    match route(Frame::control(dyn_msg.encode(), vec![])) {
        Ok(Inbound::Membership(msg)) => assert_eq!(msg, dyn_msg),
        other => panic!("a membership frame went elsewhere: {other:?}"),
    }
}

#[test]
fn a_frame_of_no_agents_kind_or_that_does_not_parse_is_a_typed_violation() {
    assert_eq!(
        route(Frame::collective(&b"whatever"[..], vec![])).unwrap_err(),
        ProtocolViolation::Malformed(MalformedMessage::UnexpectedKind {
            kind: FrameKind::Collective
        })
    );
    // Garbage in each kind: the kind's own violation, never a panic.
    let garbage = &[0xff_u8; 9][..];
    assert!(matches!(
        route(Frame::message(garbage, vec![])),
        Err(ProtocolViolation::Malformed(MalformedMessage::Undecodable(
            _
        )))
    ));
    assert!(matches!(
        route(Frame::control(garbage, vec![])),
        Err(ProtocolViolation::Malformed(MalformedMessage::Undecodable(
            _
        )))
    ));
    let mut ipc = crate::ipc::FRAME_TAG.to_vec();
    ipc.extend_from_slice(garbage);
    assert!(matches!(
        route(Frame::control(ipc, vec![])),
        Err(ProtocolViolation::Ipc(_))
    ));
}

/// A sharing worker's identity: process `pid` on one host with one GPU.
fn sharing(pid: u32) -> crate::ipc::IpcIdentity {
    crate::ipc::IpcIdentity {
        host: crate::ipc::HostIdentity {
            boot_id: "host".into(),
            ipc_namespace: 1,
            pid_namespace: 2,
            pid,
        },
        gpus: vec![crate::ipc::GpuIdentity {
            uuid: [7; 16],
            mig: false,
        }],
    }
}

/// A node that can share device memory, holding its exports as numbers.
fn sharing_node(id: WorkerId) -> Node<Body, u32> {
    Node::new(
        Endpoint::new(id, EndpointConfig::default()),
        false,
        IpcState::new(Some(sharing(100 + id)), crate::ipc::IpcConfig::default()),
        directory(id),
    )
}

fn control_frames<H>(node: &mut Node<Body, H>) -> Vec<(WorkerId, Frame)> {
    std::iter::from_fn(|| node.poll_transmit())
        .map(|out| match out {
            Outgoing::Control { to, frame } => (to, frame),
            Outgoing::Message(t) => panic!("no message was sent: {t:?}"),
        })
        .collect()
}

#[test]
fn handle_frame_hands_each_kind_to_its_part() {
    let clock = Clock::new();
    let now = clock.now();
    // A message reaches the endpoint: a call becomes its event.
    let mut n = sharing_node(0);
    let call = Transmit {
        to: 0,
        header: Header::Call {
            id: 3,
            function: "echo".into(),
            timeout: Duration::from_secs(1),
        },
        body: Some(b"hi".to_vec()),
    };
    n.handle_frame(now, 1, message_frame(call)).unwrap();
    match n.poll_event() {
        Some(NodeEvent::Endpoint(Event::Call { function, body, .. })) => {
            assert_eq!(function, "echo");
            assert_eq!(body, b"hi".to_vec());
        }
        other => panic!("the call did not reach the endpoint: {other:?}"),
    }
    // An IPC hello reaches the IPC state, which answers with its own (a control frame out
    // of the node) and now knows the peer.
    let hello = IpcMessage::Hello(Some(sharing(101)));
    n.handle_frame(now, 1, Frame::control(encode_message(&hello), vec![]))
        .unwrap();
    let out = control_frames(&mut n);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, 1);
    assert_eq!(
        crate::ipc::decode_message(&out[0].1.header),
        Some(Ok(IpcMessage::Hello(Some(sharing(100)))))
    );
    let paths = n.ipc().report();
    assert_eq!(paths.len(), 1);
    assert!(paths[0].ipc_now, "{paths:?}");
    // A membership message reaches the membership: in a static group there is none.
    assert_eq!(
        n.handle_frame(
            now,
            1,
            Frame::control(DynMessage::Left { rank: 1 }.encode(), vec![])
        ),
        Err(ProtocolViolation::MembershipInStaticGroup)
    );
    // A kind no agent receives is a typed violation, and changes nothing.
    assert_eq!(
        n.handle_frame(now, 1, Frame::collective(&b"whatever"[..], vec![])),
        Err(ProtocolViolation::Malformed(
            MalformedMessage::UnexpectedKind {
                kind: FrameKind::Collective
            }
        ))
    );
    assert!(n.poll_event().is_none());
    assert!(n.poll_transmit().is_none());
}

#[test]
fn the_node_checks_ipc_descriptors_and_hands_back_released_exports() {
    let clock = Clock::new();
    let now = clock.now();
    let mut n = sharing_node(0);
    // A message announcing a descriptor from a peer this worker never introduced itself to:
    // refused before the endpoint sees it.
    let envelope = Envelope {
        header: Header::Call {
            id: 1,
            function: "f".into(),
            timeout: Duration::from_secs(1),
        },
        target: None,
        forks: Vec::new(),
        tensors: vec![crate::tensor::TensorMeta {
            dtype: crate::tensor::DType::U8,
            shape: vec![1],
            device: crate::device::Device::Cuda(0),
            ipc: Some(0),
        }],
    };
    let frame = Frame::message(
        envelope.encode().unwrap(),
        vec![Bytes::from_static(b"args"), Bytes::from_static(b"d")],
    );
    assert_eq!(
        n.handle_frame(now, 1, frame),
        Err(ProtocolViolation::Ipc(
            crate::ipc::IpcViolation::Unannounced(crate::ipc::StagedReason::PeerUnknown)
        ))
    );
    assert!(n.poll_event().is_none());
    // Peer 1 introduces itself; two exports to it go out.
    let hello = IpcMessage::Hello(Some(sharing(101)));
    n.handle_frame(now, 1, Frame::control(encode_message(&hello), vec![]))
        .unwrap();
    control_frames(&mut n);
    let c0 = crate::device::Device::Cuda(0);
    for held in [10, 11] {
        let crate::ipc::Route::Ipc(id) = n.ipc_mut().route(1, c0, c0, 8) else {
            panic!("two processes of one host share the GPU")
        };
        n.ipc_mut().exported(1, id, held);
    }
    // A release of an export never made is the peer's violation; nothing is released.
    let bad = IpcMessage::Release(vec![9]);
    assert!(matches!(
        n.handle_frame(now, 1, Frame::control(encode_message(&bad), vec![])),
        Err(ProtocolViolation::Ipc(
            crate::ipc::IpcViolation::UnknownExport { id: 9 }
        ))
    ));
    assert!(n.take_released().is_empty());
    // The first released comes back to the driver; the second, with the peer lost.
    let release = IpcMessage::Release(vec![0]);
    n.handle_frame(now, 1, Frame::control(encode_message(&release), vec![]))
        .unwrap();
    assert_eq!(n.take_released(), vec![10]);
    n.handle_peer_lost(1, LostCause::Shutdown, now);
    assert_eq!(n.take_released(), vec![11]);
    assert!(n.ipc().report().is_empty());
}

/// Nodes over per-pair FIFO links carrying real frames, a virtual clock, and what each node
/// told its driver.
struct Net {
    clock: Clock,
    nodes: Vec<Node<Body>>,
    links: Links<(WorkerId, WorkerId), Frame>,
    events: Vec<Vec<NodeEvent<Body>>>,
}

impl Net {
    fn new(n: u32, dynamic: bool) -> Self {
        Self {
            clock: Clock::new(),
            nodes: (0..n).map(|i| node(i, dynamic)).collect(),
            links: Links::new(),
            events: (0..n).map(|_| Vec::new()).collect(),
        }
    }

    fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Moves every node's frames onto the links and its events into `events`.
    fn pump(&mut self) {
        for (w, node) in self.nodes.iter_mut().enumerate() {
            let w = w as WorkerId;
            while let Some(out) = node.poll_transmit() {
                let (to, frame) = match out {
                    Outgoing::Message(t) => (t.to, message_frame(t)),
                    Outgoing::Control { to, frame } => (to, frame),
                };
                self.links.send((w, to), frame);
            }
            while let Some(ev) = node.poll_event() {
                self.events[w as usize].push(ev);
            }
        }
    }

    /// Delivers every frame in flight (routing each as a driver does), until none is left.
    fn settle(&mut self) -> Result<(), (WorkerId, WorkerId, ProtocolViolation)> {
        self.pump();
        while let Some(&(from, to)) = self.links.ready().first() {
            let frame = self
                .links
                .pop((from, to))
                .expect("a ready link has a frame");
            let now = self.now();
            let node = &mut self.nodes[to as usize];
            let handled = node.handle_frame(now, from, frame);
            handled.map_err(|e| (from, to, e))?;
            self.pump();
        }
        Ok(())
    }

    fn membership_events(&self, w: WorkerId) -> Vec<&MemberAction> {
        self.events[w as usize]
            .iter()
            .filter_map(|e| match e {
                NodeEvent::Member(m) => Some(m),
                NodeEvent::Endpoint(_)
                | NodeEvent::Gathered { .. }
                | NodeEvent::OverBudget { .. } => None,
            })
            .collect()
    }

    fn lost(&self, w: WorkerId) -> Vec<(WorkerId, &LostCause)> {
        self.events[w as usize]
            .iter()
            .filter_map(|e| match e {
                NodeEvent::Endpoint(Event::PeerLost { peer, cause }) => Some((*peer, cause)),
                _ => None,
            })
            .collect()
    }

    /// Rank 0 founds a dynamic group and rank 1 joins it through the nodes.
    fn join(&mut self) {
        let now = self.now();
        self.nodes[0].set_membership(DynamicMembership::found(record(0), OP), now);
        let deadline = Some(now + Duration::from_secs(60));
        self.nodes[1].set_membership(DynamicMembership::join(record(1), 0, OP, deadline), now);
        let r1 = record(1);
        assert_eq!(
            self.nodes[0].with_membership(now, |m| m.handle_connected(1, Some(&r1))),
            Some(Ok(Accepted::Applicant))
        );
        assert_eq!(
            self.nodes[1].with_membership(now, |m| m.handle_connected(0, None)),
            Some(Ok(Accepted::Dialled))
        );
        self.settle().expect("an honest join breaks no protocol");
    }
}

/// A call between two nodes of a static group: the endpoint's messages go out of the node as
/// frames, come back in routed by kind, and the reply completes the call.
#[test]
fn a_call_between_static_nodes_completes() {
    let mut net = Net::new(2, false);
    let now = net.now();
    let id = net.nodes[0]
        .ep_mut()
        .call(1, "echo", b"ping".to_vec(), Duration::from_secs(5), now)
        .unwrap();
    net.settle().unwrap();
    let token = net.events[1]
        .iter()
        .find_map(|e| match e {
            NodeEvent::Endpoint(Event::Call {
                token,
                function,
                body,
                ..
            }) if function == "echo" && body == b"ping" => Some(*token),
            _ => None,
        })
        .expect("the callee's node hands the call to its driver");
    net.nodes[1].ep_mut().respond(token, Ok(b"pong".to_vec()));
    net.settle().unwrap();
    assert!(net.events[0].iter().any(|e| matches!(
        e,
        NodeEvent::Endpoint(Event::Completed { id: i, outcome: Ok(b) }) if *i == id && b == b"pong"
    )));
    // A static group has no membership: a membership message is the sender's violation.
    assert_eq!(
        net.nodes[0].handle_membership(1, DynMessage::Left { rank: 1 }, now),
        Err(ProtocolViolation::MembershipInStaticGroup)
    );
}

/// In a dynamic group only members may call: a joiner's call before it is a member is
/// refused, one after it joined runs; the join's admission starts the joiner's endpoint at
/// its incarnation and the member added is known to the coordinator's endpoint.
#[test]
fn a_dynamic_node_takes_calls_from_members_only_and_applies_the_join() {
    let mut net = Net::new(2, true);
    let now = net.now();
    let call = Header::Call {
        id: 1,
        function: "echo".into(),
        timeout: Duration::from_secs(1),
    };
    // Before any membership: nobody may call.
    assert_eq!(
        net.nodes[0].handle_message(1, call.clone(), Some(vec![]), now),
        Err(ProtocolViolation::NotAMember)
    );
    net.join();
    assert!(net
        .membership_events(1)
        .contains(&&MemberAction::JoinDone(Ok(()))));
    assert!(net
        .membership_events(0)
        .iter()
        .any(|e| matches!(e, MemberAction::Add(r) if r.rank == 1)));
    // The directories name the new member (and the founder, to the joiner): the node applied
    // the additions, as it did to the endpoints.
    assert_eq!(net.nodes[0].directory().resolve(&"w1".into()), Ok(1));
    assert_eq!(net.nodes[1].directory().resolve(&"w0".into()), Ok(0));
    let seq = net.nodes[1]
        .membership()
        .and_then(DynamicMembership::seq)
        .expect("the joiner is admitted");
    assert!(net.nodes[0].may_call(1) && net.nodes[1].may_call(0));
    // The joiner's ids start at its incarnation: the node applied the admission.
    let id = net.nodes[1]
        .ep_mut()
        .call(0, "echo", b"x".to_vec(), Duration::from_secs(5), now)
        .unwrap();
    assert!(seq > 0, "the first joiner comes after the founder");
    assert!(id > seq << 40, "id {id} at incarnation {seq}");
    net.settle().unwrap();
    assert!(net.events[0]
        .iter()
        .any(|e| matches!(e, NodeEvent::Endpoint(Event::Call { token, .. }) if token.from() == 1)));
}

/// A lost member reaches both parts: the endpoint reports the loss once and the membership
/// removes the member, after which it may no longer call.
#[test]
fn a_lost_peer_reaches_the_endpoint_and_the_membership() {
    let mut net = Net::new(2, true);
    net.join();
    let now = net.now();
    net.nodes[0].handle_peer_lost(1, crate::protocol_sim::lost_link(), now);
    net.pump();
    assert_eq!(net.lost(0), vec![(1, &crate::protocol_sim::lost_link())]);
    assert!(net.membership_events(0).contains(&&MemberAction::Remove {
        rank: 1,
        close: false
    }));
    assert!(!net.nodes[0].may_call(1));
    // Its name is forgotten with it (one lock, one change: the node's directory).
    assert!(net.nodes[0].directory().resolve(&"w1".into()).is_err());
    assert_eq!(net.nodes[0].directory().len(), 1);
}

/// A member that leaves is handed to the endpoint as gone for `Left`, by the node: its calls
/// fail naming the leave.
#[test]
fn a_member_that_leaves_is_lost_as_left_in_the_endpoint() {
    let mut net = Net::new(2, true);
    net.join();
    let now = net.now();
    let id = net.nodes[0]
        .ep_mut()
        .call(1, "slow", b"x".to_vec(), Duration::from_secs(50), now)
        .unwrap();
    // Rank 1 leaves before it reads the call.
    net.pump();
    net.links.clear((0, 1));
    net.nodes[1].with_membership(now, |m| m.begin_leave(now, Some(now + OP)));
    net.settle().unwrap();
    assert!(net
        .membership_events(1)
        .iter()
        .any(|e| matches!(e, MemberAction::LeaveDone(Ok(_)))));
    assert_eq!(net.lost(0), vec![(1, &LostCause::Left)]);
    assert!(net.events[0].iter().any(|e| matches!(
        e,
        NodeEvent::Endpoint(Event::Completed { id: i, outcome: Err(CallError::PeerLost { peer: 1, cause: LostCause::Left }) }) if *i == id
    )));
}

/// One timer table: the node's next timeout is the earliest of its parts', and a join that
/// is not answered fails when the node's timer runs at that deadline.
#[test]
fn the_node_times_out_at_the_earliest_deadline_of_its_parts() {
    let mut net = Net::new(2, true);
    let now = net.now();
    let deadline = now + Duration::from_secs(7);
    net.nodes[1].set_membership(
        DynamicMembership::join(record(1), 0, OP, Some(deadline)),
        now,
    );
    assert_eq!(net.nodes[1].poll_timeout(), Some(deadline));
    // A call's deadline, earlier, comes first; the join's after it.
    net.nodes[1]
        .ep_mut()
        .call(0, "echo", vec![], Duration::from_secs(2), now)
        .unwrap();
    let first = net.nodes[1].poll_timeout().expect("a call's deadline");
    assert!(first <= now + Duration::from_secs(2));
    net.clock.advance_to(first);
    net.nodes[1].handle_timeout(first);
    assert_eq!(net.nodes[1].poll_timeout(), Some(deadline));
    net.clock.advance_to(deadline);
    net.nodes[1].handle_timeout(deadline);
    net.pump();
    assert!(net.membership_events(1).iter().any(|e| matches!(
        e,
        MemberAction::JoinDone(Err(MembershipError::Timeout { .. }))
    )));
    assert!(net.events[1].iter().any(|e| matches!(
        e,
        NodeEvent::Endpoint(Event::Completed {
            outcome: Err(CallError::Timeout { .. }),
            ..
        })
    )));
}

fn contribution(expected: &[WorkerId], wait: Duration, value: &[u8]) -> Contribution {
    Contribution {
        name: "barrier".into(),
        expected: expected.to_vec(),
        wait,
        value: value.to_vec(),
    }
}

fn gathered(net: &Net, w: WorkerId) -> Vec<(GatherToken, &GatherOutcome)> {
    net.events[w as usize]
        .iter()
        .filter_map(|e| match e {
            NodeEvent::Gathered { token, outcome } => Some((*token, outcome)),
            _ => None,
        })
        .collect()
}

/// The gathers are the node's: a round answers every caller once all sent, its deadline is
/// the node's timer, and a loss the endpoint reports ends a round that waits for the lost
/// member (the driver tells nobody but the node).
#[test]
fn the_node_leads_gathers_on_its_timer_and_its_losses() {
    let mut net = Net::new(3, true);
    let now = net.now();
    let wait = Duration::from_secs(4);
    let a = net.nodes[0].handle_contribution(now, 0, contribution(&[0, 1], wait, b"zero"));
    assert_eq!(net.nodes[0].poll_timeout(), Some(now + wait));
    let b = net.nodes[0].handle_contribution(now, 1, contribution(&[0, 1], wait, b"one"));
    net.pump();
    let done = GatherOutcome::Done(vec![(0, b"zero".to_vec()), (1, b"one".to_vec())]);
    assert_eq!(gathered(&net, 0), vec![(a, &done), (b, &done)]);
    assert_eq!(net.nodes[0].poll_timeout(), None, "nothing waits: no timer");

    // A round waiting for member 2, which is lost: ended by the loss, not by its deadline.
    let c = net.nodes[0].handle_contribution(now, 1, contribution(&[0, 1, 2], wait, b"x"));
    net.nodes[0].handle_peer_lost(2, crate::protocol_sim::lost_link(), now);
    net.pump();
    let ended = gathered(&net, 0)
        .into_iter()
        .find(|(t, _)| *t == c)
        .expect("the loss ends the round waiting for the lost member");
    assert!(!matches!(ended.1, GatherOutcome::Done(_)), "{:?}", ended.1);

    // A round nobody completes ends at its deadline, by the node's one timer.
    let d = net.nodes[0].handle_contribution(now, 1, contribution(&[0, 1], wait, b"y"));
    let at = net.nodes[0].poll_timeout().expect("the round's deadline");
    net.clock.advance_to(at);
    net.nodes[0].handle_timeout(at);
    net.pump();
    assert!(gathered(&net, 0)
        .iter()
        .any(|(t, o)| *t == d && **o == GatherOutcome::Missing(vec![0])));
    assert!(net.nodes[0].gathers().is_idle());
}

/// A call of the gather function is decoded by the node, and what no honest member sends
/// (bytes that are no contribution, a member list that does not name the sender) is the
/// sending peer's violation; this worker's own is refused without one, or answered.
#[test]
fn the_node_decides_which_gather_calls_are_a_peers_violation() {
    let mut net = Net::new(3, true);
    let now = net.now();
    let wait = Duration::from_secs(4);
    let n = &mut net.nodes[0];
    let refused = n.handle_gather_call(now, 1, b"\xff").unwrap_err();
    assert!(matches!(refused.error, GatherCallError::Undecodable(_)));
    assert!(matches!(
        refused.violation,
        Some(ProtocolViolation::Malformed(MalformedMessage::Undecodable(
            _
        )))
    ));
    let own = n.handle_gather_call(now, 0, b"\xff").unwrap_err();
    assert_eq!(
        own.violation, None,
        "this worker's own call is no violation"
    );

    // Member 1 sends a list without itself: a forgery, its violation.
    let forged = contribution(&[0, 2], wait, b"x").encode();
    let refused = n.handle_gather_call(now, 1, &forged).unwrap_err();
    assert!(matches!(refused.error, GatherCallError::Forged(ref e) if e.is_forgery()));
    assert!(matches!(
        refused.violation,
        Some(ProtocolViolation::Gather(ref e)) if e.is_forgery()
    ));
    // The same from this worker is answered as a refusal.
    let own = contribution(&[1, 2], wait, b"x").encode();
    assert!(n.handle_gather_call(now, 0, &own).is_ok());

    // An honest one is filed and answered as any contribution.
    let a = n
        .handle_gather_call(now, 0, &contribution(&[0, 1], wait, b"zero").encode())
        .unwrap();
    let b = n
        .handle_gather_call(now, 1, &contribution(&[0, 1], wait, b"one").encode())
        .unwrap();
    net.pump();
    let done = GatherOutcome::Done(vec![(0, b"zero".to_vec()), (1, b"one".to_vec())]);
    let answers = gathered(&net, 0);
    assert!(
        answers.contains(&(a, &done)) && answers.contains(&(b, &done)),
        "{answers:?}"
    );
}

/// A call of `function` from peer 1 with id `id`, as a frame.
fn call_from_peer(id: u64, function: &str, body: &[u8]) -> Frame {
    message_frame(Transmit {
        to: 0,
        header: Header::Call {
            id,
            function: function.into(),
            timeout: Duration::from_secs(10),
        },
        body: Some(body.to_vec()),
    })
}

fn calls_out(n: &mut Node<Body>) -> Vec<String> {
    std::iter::from_fn(|| n.poll_event())
        .filter_map(|e| match e {
            NodeEvent::Endpoint(Event::Call { function, .. }) => Some(function),
            _ => None,
        })
        .collect()
}

/// Node 0 with a running cap of one, after peer 1's calls to `functions` (ids from 1) arrived:
/// the first runs, the rest are held.
fn capped_with_calls(now: Instant, functions: &[&str]) -> Node<Body> {
    let mut n = node(0, false);
    n.ep().budget().set_running_cap(1);
    for (id, f) in (1..).zip(functions) {
        n.handle_frame(now, 1, call_from_peer(id, f, b"xyz"))
            .unwrap();
    }
    n
}

#[test]
fn a_peers_requests_past_its_running_cap_are_held_in_order_and_run_as_its_requests_end() {
    let now = Clock::new().now();
    let mut n = capped_with_calls(now, &["a", "b", "c"]);
    // One runs; the others wait, counted in the peer's budget.
    assert_eq!(calls_out(&mut n), vec!["a"]);
    assert_eq!(n.ep().budget().held(1).requests, 6);
    assert!(n.counts_as_running(1, "a"));
    assert!(n.handle_request_finished(1));
    assert_eq!(calls_out(&mut n), vec!["b"]);
    assert_eq!(n.ep().budget().held(1).requests, 3);
    // A gather's contribution waits behind the held ones, and does not count as running.
    n.handle_frame(
        now,
        1,
        call_from_peer(4, crate::protocol::gather::GATHER_FUNCTION, b"g"),
    )
    .unwrap();
    assert!(!n.counts_as_running(1, crate::protocol::gather::GATHER_FUNCTION));
    assert!(calls_out(&mut n).is_empty());
    assert!(n.handle_request_finished(1));
    assert_eq!(calls_out(&mut n), vec!["c"]);
    // "c" runs now (the cap), the gather still waits; once "c" ends it comes out, and being
    // no running request, nothing is held any more.
    assert!(n.handle_request_finished(1));
    assert_eq!(
        calls_out(&mut n),
        vec![crate::protocol::gather::GATHER_FUNCTION.to_owned()]
    );
    assert_eq!(n.ep().budget().held(1).requests, 0);
    assert!(!n.ep().budget().holds_requests(1));
    // This worker's own requests are never held.
    assert!(!n.counts_as_running(0, "a"));
}

/// A peer's request answered through the node with `counted` ends its running share in the
/// same turn: the held one behind it comes out, and its reply goes out; one answered without
/// (not counted as running) leaves the share as it was.
#[test]
fn a_request_answered_through_the_node_lets_the_held_one_behind_it_run() {
    let now = Clock::new().now();
    let mut n = capped_with_calls(now, &["a", "b"]);
    let mut calls = std::iter::from_fn(|| n.poll_event())
        .filter_map(|e| match e {
            NodeEvent::Endpoint(Event::Call {
                token, function, ..
            }) => Some((token, function)),
            _ => None,
        })
        .collect::<Vec<_>>();
    assert_eq!(calls.len(), 1);
    let (token, function) = calls.remove(0);
    assert_eq!(function, "a");
    assert!(counts_as_running(0, token.from(), &function));
    assert!(!counts_as_running(0, 0, &function));
    assert!(!counts_as_running(
        0,
        1,
        crate::protocol::gather::GATHER_FUNCTION
    ));
    // Answered without counting: "b" stays held.
    let mut uncounted = capped_with_calls(now, &["a", "b"]);
    let first = std::iter::from_fn(|| uncounted.poll_event())
        .find_map(|e| match e {
            NodeEvent::Endpoint(Event::Call { token, .. }) => Some(token),
            _ => None,
        })
        .unwrap();
    assert!(uncounted.respond(first, Ok(b"r".to_vec()), false));
    assert!(calls_out(&mut uncounted).is_empty());
    // Counted: "b" comes out, and the reply to "a" is sent.
    assert!(n.respond(token, Ok(b"r".to_vec()), true));
    assert_eq!(calls_out(&mut n), vec!["b"]);
    let replies: Vec<u64> = std::iter::from_fn(|| n.poll_transmit())
        .filter_map(|o| match o {
            Outgoing::Message(Transmit {
                header: Header::Reply { id, .. },
                ..
            }) => Some(id),
            _ => None,
        })
        .collect();
    assert_eq!(replies, vec![1]);
    // A second answer to the same request is not expected.
    assert!(!n.respond(token, Ok(b"r".to_vec()), false));
}

#[test]
fn a_lost_peers_held_requests_are_dropped_and_one_past_its_budget_drops_it() {
    let now = Clock::new().now();
    let mut n = capped_with_calls(now, &["a", "b"]);
    assert_eq!(calls_out(&mut n), vec!["a"]);
    assert_eq!(n.ep().budget().held(1).requests, 3);
    n.handle_peer_lost(1, LostCause::Shutdown, now);
    assert_eq!(n.ep().budget().held(1).requests, 0);
    assert!(!n.handle_request_finished(1), "nothing is held any more");
    assert!(calls_out(&mut n).is_empty());

    // A request the node had not handed out yet when its peer was lost, and one that arrives
    // after the loss, are forgotten: neither is held (nothing would ever drop it) nor runs.
    let mut n = node(0, false);
    n.ep().budget().set_running_cap(1);
    n.handle_frame(now, 1, call_from_peer(1, "a", b"xyz"))
        .unwrap();
    assert_eq!(calls_out(&mut n), vec!["a"]);
    n.handle_frame(now, 1, call_from_peer(2, "b", b"xyz"))
        .unwrap();
    n.handle_peer_lost(1, LostCause::Shutdown, now);
    n.handle_frame(now, 1, call_from_peer(3, "c", b"xyz"))
        .unwrap();
    assert!(calls_out(&mut n).is_empty());
    assert_eq!(n.ep().budget().held(1), crate::budget::Held::default());

    // A request past the budget while its peer's requests are held: the driver is told to
    // drop the peer.
    let mut ep = Endpoint::new(0, EndpointConfig::default());
    ep.set_budget(crate::budget::Budget::new(1000));
    let mut n: Node<Body> = Node::new(
        ep,
        false,
        IpcState::new(None, crate::ipc::IpcConfig::default()),
        directory(0),
    );
    n.ep().budget().set_running_cap(1);
    n.handle_frame(now, 1, call_from_peer(1, "a", b"x"))
        .unwrap();
    n.handle_frame(now, 1, call_from_peer(2, "b", b"x"))
        .unwrap();
    n.handle_frame(now, 1, call_from_peer(3, "c", &[0; 2000]))
        .unwrap();
    let events: Vec<_> = std::iter::from_fn(|| n.poll_event()).collect();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, NodeEvent::OverBudget { peer: 1, .. })),
        "{events:?}"
    );
}

impl Net {
    /// Rank `k` joins the group of rank 0 (the coordinator) as a driver does it: its request
    /// waits for the connection to the coordinator, which welcomes it as an applicant; then
    /// it dials every member the node tells it to, each welcoming it. Returns the dials the
    /// joiner's node asked for.
    fn join_as_driver(&mut self, k: WorkerId, deadline: Instant) -> Vec<MemberAction> {
        let now = self.now();
        let before = self.events[k as usize].len();
        self.nodes[k as usize].begin_connecting(0);
        let mut m = DynamicMembership::join(record(k), 0, OP, Some(deadline));
        assert_eq!(m.handle_connected(0, None), Ok(Accepted::Dialled));
        self.nodes[k as usize].set_membership(m, now);
        // The request waits for the connection to the coordinator.
        assert!(self.nodes[k as usize].poll_transmit().is_none());
        assert_eq!(
            self.nodes[0].handle_introduced(now, &record(k)),
            Introduced::Welcome
        );
        self.nodes[0].handle_link_up(k);
        self.nodes[k as usize].handle_link_up(0);
        self.settle().expect("an honest join breaks no protocol");
        let dials: Vec<MemberAction> = self.events[k as usize][before..]
            .iter()
            .filter_map(|e| match e {
                NodeEvent::Member(a @ MemberAction::Dial { .. }) => Some(a.clone()),
                _ => None,
            })
            .collect();
        for dial in &dials {
            let MemberAction::Dial { record: member, .. } = dial else {
                unreachable!()
            };
            let m = member.rank as usize;
            assert_eq!(
                self.nodes[m].handle_introduced(now, &record(k)),
                Introduced::Welcome
            );
            self.nodes[m].handle_link_up(k);
            assert_eq!(
                self.nodes[k as usize].handle_dialled(now, member.rank, true),
                Ok(())
            );
            self.settle().expect("an honest join breaks no protocol");
        }
        dials
    }
}

/// The node tells a joiner whom to dial (the member, its own introduction, what is left of
/// its join), and the members it dials welcome it: every member names it, its join is done.
#[test]
fn a_joiner_is_told_whom_to_dial_and_the_members_welcome_it() {
    let mut net = Net::new(3, true);
    let now = net.now();
    let deadline = now + Duration::from_secs(60);
    net.nodes[0].set_membership(DynamicMembership::found(record(0), OP), now);
    assert!(net.join_as_driver(1, deadline).is_empty());
    net.clock.advance(Duration::from_secs(1));
    let dials = net.join_as_driver(2, deadline);
    assert_eq!(
        dials,
        vec![MemberAction::Dial {
            record: record(1),
            introduction: record(2).encode(),
            limit: Duration::from_secs(59),
        }]
    );
    assert!(net
        .membership_events(2)
        .contains(&&MemberAction::JoinDone(Ok(()))));
    for m in [0, 1] {
        assert!(
            net.membership_events(m)
                .contains(&&MemberAction::Add(record(2))),
            "rank {m} names the joiner"
        );
        assert!(net.nodes[m as usize].may_call(2));
    }
    assert_eq!(net.nodes[2].own_record(), Some(&record(2)));
}

/// A dial that failed is asked for again after a while, with what is left of the join.
#[test]
fn a_failed_dial_is_asked_for_again_with_what_is_left_of_the_join() {
    let mut net = Net::new(3, true);
    let now = net.now();
    let deadline = now + Duration::from_secs(60);
    net.nodes[0].set_membership(DynamicMembership::found(record(0), OP), now);
    net.join_as_driver(1, deadline);
    // Rank 2 joins, but stops at the dials (done by hand here).
    net.nodes[2].begin_connecting(0);
    let mut m = DynamicMembership::join(record(2), 0, OP, Some(deadline));
    let _ = m.handle_connected(0, None);
    net.nodes[2].set_membership(m, now);
    net.nodes[0].handle_introduced(now, &record(2));
    net.nodes[0].handle_link_up(2);
    net.nodes[2].handle_link_up(0);
    net.settle().unwrap();
    let dials = |net: &Net| {
        net.membership_events(2)
            .iter()
            .filter(|a| matches!(a, MemberAction::Dial { .. }))
            .count()
    };
    assert_eq!(dials(&net), 1);
    assert_eq!(net.nodes[2].handle_dialled(now, 1, false), Ok(()));
    let again = net.nodes[2].poll_timeout().expect("a redial is due");
    assert!(again <= now + REDIAL_MAX_FOR_TEST, "{again:?}");
    net.clock.advance_to(again);
    net.nodes[2].handle_timeout(again);
    net.pump();
    assert_eq!(dials(&net), 2);
    assert!(net.membership_events(2).iter().any(|a| matches!(
        a,
        MemberAction::Dial { record: r, limit, .. } if r.rank == 1 && *limit == deadline - again
    )));
    // A connection the join never asked for is refused, typed.
    assert!(matches!(
        net.nodes[2].handle_dialled(again, 7, true),
        Err(MembershipError::Violation { peer: 7, .. })
    ));
}

const REDIAL_MAX_FOR_TEST: Duration = crate::protocol::membership::dynamic::REDIAL_MAX;

/// The answer to a worker introducing itself: a name in use is refused (told why), one nobody
/// expects is dropped, and an introduction that is no record of the hello's rank is a typed
/// error. Nothing is held for a worker that is not welcomed.
#[test]
fn an_introduction_is_welcomed_refused_or_dropped_by_the_node() {
    let mut net = Net::new(3, true);
    let now = net.now();
    net.nodes[0].set_membership(DynamicMembership::found(record(0), OP), now);
    // Rank 5 under the founder's name: refused, not to be retried.
    let mut impostor = record(5);
    impostor.devices.name = "w0".into();
    match net.nodes[0].handle_introduced(now, &impostor) {
        Introduced::Refuse(HelloReply::Refused { reason, retry }) => {
            assert!(reason.contains("w0"), "{reason}");
            assert!(!retry);
        }
        other => panic!("a name in use was not refused: {other:?}"),
    }
    // No membership yet: nobody is expected.
    assert_eq!(
        net.nodes[1].handle_introduced(now, &record(2)),
        Introduced::Drop(None)
    );
    // A joiner takes no introduction: it dials.
    net.nodes[2].set_membership(
        DynamicMembership::join(record(2), 0, OP, Some(now + OP)),
        now,
    );
    assert!(matches!(
        net.nodes[2].handle_introduced(now, &record(1)),
        Introduced::Drop(Some(MembershipError::Violation { peer: 1, .. }))
    ));
    // Nothing was held for the refused: a frame for rank 5 goes straight out.
    net.nodes[0].handle_link_up(5);
    assert!(net.nodes[0].poll_transmit().is_none());
    assert_eq!(read_introduction(2, &record(2).encode()), Ok(record(2)));
    assert_eq!(
        read_introduction(4, &record(3).encode()),
        Err(IntroductionError::OtherRank { rank: 4, record: 3 })
    );
    assert!(matches!(
        read_introduction(4, &[0xff; 7]),
        Err(IntroductionError::Undecodable(_))
    ));
}

/// A hello is read and its credentials checked by the node: a hello for another group, or an
/// introduction that is no record of the hello's rank, is dropped with its error, a worker
/// whose credentials do not name it is refused (told why), and the rest goes to the
/// membership.
#[test]
fn a_hello_is_read_and_certified_by_the_node() {
    use crate::ports::transport::IdentityError;
    let mut net = Net::new(3, true);
    let now = net.now();
    let n = &mut net.nodes[0];
    n.set_membership(DynamicMembership::found(record(0), OP), now);
    let unread = |_: &str| -> Result<(), IdentityError> { panic!("no record, no check") };
    let hello = |rank, introduction: Vec<u8>| joiner_hello(rank, introduction);
    assert_eq!(
        n.handle_hello(now, &hello(4, record(3).encode()), unread),
        Introduced::Unreadable(IntroductionError::OtherRank { rank: 4, record: 3 })
    );
    assert!(matches!(
        n.handle_hello(now, &hello(4, vec![0xff; 7]), unread),
        Introduced::Unreadable(IntroductionError::Undecodable(_))
    ));
    // A process group's hello (another name, or a world size) is no joiner's, whatever it
    // carries.
    let mut of_a_group = hello(1, record(1).encode());
    of_a_group.group = "trainers".into();
    assert_eq!(
        n.handle_hello(now, &of_a_group, unread),
        Introduced::Unreadable(IntroductionError::OtherGroup {
            group: "trainers".into(),
            world: None
        })
    );
    let mut sized = hello(1, record(1).encode());
    sized.world = Some(4);
    assert!(matches!(
        n.handle_hello(now, &sized, unread),
        Introduced::Unreadable(IntroductionError::OtherGroup { world: Some(4), .. })
    ));
    let impostor = |name: &str| {
        Err(IdentityError {
            peer: SocketAddr::from(([127, 0, 0, 1], 9)),
            name: name.to_owned(),
            reason: "issued for w7".into(),
        })
    };
    match n.handle_hello(now, &hello(1, record(1).encode()), impostor) {
        Introduced::Refuse(HelloReply::Refused { reason, retry }) => {
            assert!(reason.contains("credentials do not name it"), "{reason}");
            assert!(reason.contains("issued for w7"), "{reason}");
            assert!(!retry);
        }
        other => panic!("an uncertified worker was not refused: {other:?}"),
    }
    // Certified, it is the membership's to decide: an applicant to the coordinator.
    let named = |name: &str| {
        assert_eq!(name, "w1");
        Ok(())
    };
    assert_eq!(
        n.handle_hello(now, &hello(1, record(1).encode()), named),
        Introduced::Welcome
    );
}

/// The frames held for a peer whose setup ended without a connection are dropped, and the
/// membership counts a joiner whose welcome could not be sent as lost.
#[test]
fn frames_held_for_a_peer_whose_setup_ended_are_dropped() {
    let mut net = Net::new(2, true);
    let now = net.now();
    net.nodes[1].begin_connecting(0);
    net.nodes[1].set_membership(
        DynamicMembership::join(record(1), 0, OP, Some(now + OP)),
        now,
    );
    net.nodes[1].handle_connecting_ended(0);
    net.nodes[1].handle_link_up(0);
    assert!(net.nodes[1].poll_transmit().is_none());
    net.nodes[0].set_membership(DynamicMembership::found(record(0), OP), now);
    assert_eq!(
        net.nodes[0].handle_introduced(now, &record(1)),
        Introduced::Welcome
    );
    net.nodes[0].handle_welcome_failed(1, now);
    // An applicant that is lost is no applicant: its request is a violation now.
    let request = DynMessage::JoinRequest { record: record(1) };
    assert!(net.nodes[0].handle_membership(1, request, now).is_err());
}

/// When the coordinator leaves, the next member is told to publish its own record under the
/// coordinator's key, and to close the connection of the member that left.
#[test]
fn the_next_coordinator_publishes_its_record_and_closes_the_leavers_connection() {
    let mut net = Net::new(2, true);
    let now = net.now();
    net.nodes[0].set_membership(DynamicMembership::found(record(0), OP), now);
    net.join_as_driver(1, now + OP);
    net.nodes[0].with_membership(now, |m| m.begin_leave(now, Some(now + OP)));
    net.settle().unwrap();
    assert!(net
        .membership_events(0)
        .contains(&&MemberAction::LeaveDone(Ok(false))));
    let events = net.membership_events(1);
    assert!(events.contains(&&MemberAction::Remove {
        rank: 0,
        close: true
    }));
    assert!(events.contains(&&MemberAction::Publish {
        key: COORDINATOR_KEY,
        record: record(1).encode(),
    }));
}

/// An impostor's introduction under the rank of a peer being connected takes nothing from
/// that peer: what is held for it still goes out once its connection is attached.
#[test]
fn an_impostors_introduction_leaves_what_is_held_for_the_rank_it_claims() {
    let mut net = Net::new(2, true);
    let now = net.now();
    assert!(net.nodes[1].begin_connecting(0));
    net.nodes[1].set_membership(
        DynamicMembership::join(record(1), 0, OP, Some(now + OP)),
        now,
    );
    assert!(matches!(
        net.nodes[1].handle_introduced(now, &record(0)),
        Introduced::Drop(Some(MembershipError::Violation { peer: 0, .. }))
    ));
    assert!(net.nodes[1].poll_transmit().is_none());
    net.nodes[1].handle_link_up(0);
    match net.nodes[1].poll_transmit() {
        Some(Outgoing::Control { to: 0, frame }) => assert!(matches!(
            DynMessage::decode(&frame.header),
            Ok(DynMessage::JoinRequest { .. })
        )),
        other => panic!("the join request was lost: {other:?}"),
    }
}

/// A joiner waits for the answer to its hello as long as its dial may take, but never under a
/// second: an answer needs a round trip even when the dial's limit is nearly spent.
#[test]
fn a_joiner_waits_for_its_welcome_at_least_a_second() {
    assert_eq!(welcome_wait(Duration::ZERO), Duration::from_secs(1));
    assert_eq!(
        welcome_wait(Duration::from_millis(999)),
        Duration::from_secs(1)
    );
    assert_eq!(welcome_wait(Duration::from_secs(7)), Duration::from_secs(7));
    let hello = joiner_hello(3, vec![1, 2]);
    assert_eq!(
        (hello.group.as_str(), hello.rank, hello.world),
        (RPC_GROUP, 3, None)
    );
}

/// A peer the driver drops (a layer's violation) is lost as a lost connection is: its calls
/// fail naming the cause, once; in a static group it is told why by an abort in this worker's
/// name before its connection closes, in a dynamic one it is not (it reads no group frames).
/// The node never drops its own worker.
#[test]
fn a_dropped_peer_is_lost_and_a_static_one_is_told_why() {
    for dynamic in [false, true] {
        let mut net = Net::new(2, dynamic);
        if dynamic {
            net.join();
        }
        let now = net.now();
        let id = net.nodes[0]
            .ep_mut()
            .call(1, "slow", b"x".to_vec(), Duration::from_secs(5), now)
            .unwrap();
        net.settle().unwrap();
        let violation = ProtocolViolation::MembershipInStaticGroup;
        let cause = || LostCause::Misbehaved(Box::new(violation.clone()));
        assert_eq!(
            net.nodes[0].handle_dropped(0, cause(), now),
            Dropped::Itself
        );
        assert!(
            net.lost(0).is_empty(),
            "this worker is never lost to itself"
        );
        let Dropped::Close { tell } = net.nodes[0].handle_dropped(1, cause(), now) else {
            panic!("a peer is dropped");
        };
        match (dynamic, tell) {
            (true, None) => {}
            (false, Some(frame)) => match GroupFrame::decode(&frame.header).unwrap() {
                GroupFrame::Abort { rank, reason } => {
                    assert_eq!(rank, 0, "the abort is in this worker's name");
                    assert!(reason.starts_with("it dropped rank 1: "), "{reason}");
                }
                other => panic!("a static peer is told by an abort, not {other:?}"),
            },
            (dynamic, tell) => panic!("dynamic {dynamic}: told {tell:?}"),
        }
        // Dropped again (a second violation found meanwhile), it stays lost once.
        let _ = net.nodes[0].handle_dropped(1, LostCause::Left, now);
        net.pump();
        assert_eq!(net.lost(0), vec![(1, &cause())]);
        assert!(net.events[0].iter().any(|e| matches!(
            e,
            NodeEvent::Endpoint(Event::Completed {
                id: i,
                outcome: Err(CallError::PeerLost { peer: 1, .. })
            }) if *i == id
        )));
    }
}

#[test]
fn the_driver_is_woken_only_for_a_deadline_earlier_than_its_timer() {
    let now = Clock::new().now();
    let mut n = node(0, false);
    assert_eq!(n.arm_timer(), None);
    assert!(!n.timer_moved_earlier(), "no deadline: nothing to wake for");
    n.ep_mut().call(1, "f", Vec::new(), OP, now).unwrap();
    assert!(
        n.timer_moved_earlier(),
        "a first deadline wakes a timer that sleeps on none"
    );
    assert_eq!(n.arm_timer(), Some(now + OP));
    assert!(!n.timer_moved_earlier(), "armed on it");
    n.ep_mut().call(1, "f", Vec::new(), 2 * OP, now).unwrap();
    assert!(
        !n.timer_moved_earlier(),
        "a later deadline waits for the timer"
    );
    n.ep_mut().call(1, "f", Vec::new(), OP / 2, now).unwrap();
    assert!(n.timer_moved_earlier(), "an earlier one wakes it");
    assert_eq!(n.arm_timer(), Some(now + OP / 2));
    assert!(!n.timer_moved_earlier());
}

/// What a dropped handle leaves to do is done whenever the driver gets to it: a call's
/// waiter is taken out (and handed back, its outcome with it); an owner's last reference
/// releases its value, at the time of the drop the item keeps.
#[test]
fn a_dropped_handle_is_let_go_of_whenever_the_driver_gets_to_it() {
    let now = Clock::new().now();
    let mut n = node(0, false);
    let mut waiters: Waiters<u8> = Waiters::default();
    waiters.wait(5, None);
    waiters.end(5, 9);
    match n.let_go(&mut waiters, Abandoned::Waiter(5)) {
        Some(Waiter::Done(9)) => {}
        other => panic!("the waiter was not handed back: {other:?}"),
    }
    assert!(waiters.is_empty());
    assert!(n.let_go(&mut waiters, Abandoned::Waiter(5)).is_none());

    let handle = n.ep_mut().local_rref().unwrap();
    assert!(n.poll_event().is_none());
    assert!(n
        .let_go(&mut waiters, Abandoned::Reference(handle, now))
        .is_none());
    match n.poll_event() {
        Some(NodeEvent::Endpoint(Event::ReleaseValue { rref })) => assert_eq!(rref, handle.rref),
        other => panic!("the value was not released: {other:?}"),
    }
    assert!(n.ep().debug_info().owned.is_empty());
}
