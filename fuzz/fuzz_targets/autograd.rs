//! Fuzzes distributed autograd's messages from a hostile peer, decoded as the RPC layer
//! decodes their bodies (postcard: a gradient request's `(context, message)`, a recv's
//! `(context, message, capability)`, a release's `(context, cause)`, a gradient reply's
//! `Result<(), BackwardError>` or the message ids of the gradients an answer carries) and applied to core's state machine (`DistAutograd`).
//!
//! Worker 0 (under test) shares a context with an honest worker 1 and the hostile worker 2
//! (messages sent and received both ways), and has a second context with worker 1 only. The
//! input mixes forged messages from worker 2 with the driver's own moves: local runs
//! finishing or failing, worker 1 answering gradients, backward passes, worker 2 being lost.
//!
//! Invariants checked after every step, not only "no panic":
//! - a message refused as a protocol violation leaves the state exactly as it was (contexts,
//!   their records and known workers, running tasks, late gradients) and makes no output;
//! - the send records of a context (what worker 0 sent) never change while it lives;
//! - worker 2 never joins the context it was not given (it does not know its capability; it
//!   knows the shared one's, and the input picks whether it presents that one or a guess);
//! - outputs are sane: a gradient goes to the worker that sent the message, a reply answers
//!   an accepted request that was not answered before, a release never goes to worker 0;
//! - in the end, once every local run is over and every gradient request of worker 0 is
//!   answered, every gradient request worker 2 made that was accepted has been answered
//!   exactly once, and worker 0 is idle.
#![no_main]

use std::collections::{BTreeMap, BTreeSet};

use libfuzzer_sys::fuzz_target;
use tensorwire_core::autograd::{
    AutogradMessageId, BackwardError, ContextId, DistAutograd, GradientId, Output, Recv, Root,
    TaskId,
};
use tensorwire_core::protocol::WorkerId;

const HOSTILE: WorkerId = 2;

type Snapshot = (
    Vec<(
        ContextId,
        Option<Vec<WorkerId>>,
        Vec<(AutogradMessageId, WorkerId)>,
        Vec<(AutogradMessageId, WorkerId)>,
    )>,
    usize,
    u64,
);

fn snapshot(a: &DistAutograd) -> Snapshot {
    let contexts = a
        .contexts()
        .map(|c| (c, a.known_workers(c), a.send_records(c), a.recv_records(c)))
        .collect();
    (contexts, a.running_tasks(), a.late_gradients())
}

struct Driver {
    a: DistAutograd,
    sends: BTreeMap<ContextId, Vec<(AutogradMessageId, WorkerId)>>,
    running: BTreeMap<TaskId, ContextId>,
    /// Gradient requests worker 0 sent, by receiver.
    outstanding: BTreeMap<WorkerId, Vec<GradientId>>,
    accepted: BTreeSet<u64>,
    replied: BTreeSet<u64>,
    next_token: u64,
}

impl Driver {
    fn drain(&mut self) {
        while let Some(out) = self.a.poll() {
            match out {
                Output::Prepare { .. } | Output::Dropped { .. } => {}
                Output::BackwardDone { .. } => {}
                Output::RunLocal { task, context, .. } => {
                    assert!(self.running.insert(task, context).is_none());
                }
                Output::SendGradient {
                    gradient,
                    to,
                    context,
                    message,
                    ..
                } => {
                    let recvs = self.a.recv_records(context);
                    assert!(
                        recvs.contains(&(message, to)),
                        "a gradient for {message} to worker {to}, who did not send it"
                    );
                    self.outstanding.entry(to).or_default().push(gradient);
                }
                Output::Reply { to, request, .. }
                | Output::ReplyWithGradients { to, request, .. } => {
                    assert_eq!(to, HOSTILE, "only worker 2 asked");
                    assert!(
                        self.accepted.contains(&request),
                        "reply to unknown {request}"
                    );
                    assert!(
                        self.replied.insert(request),
                        "request {request} answered twice"
                    );
                }
                Output::Release { to, .. } => assert_ne!(to, 0, "a release to itself"),
            }
        }
        // What worker 0 sent stays as sent while the context lives.
        for (c, sends) in &self.sends {
            if self.a.has_context(*c) {
                assert_eq!(
                    &self.a.send_records(*c),
                    sends,
                    "send records of {c} changed"
                );
            }
        }
    }

    /// Checks that a refused message changed nothing and made no output.
    fn refused(&mut self, before: &Snapshot, what: &str) {
        assert_eq!(
            &snapshot(&self.a),
            before,
            "refused {what} changed the state"
        );
        assert!(self.a.poll().is_none(), "refused {what} made output");
    }
}

fn chunk<'a>(rest: &mut &'a [u8]) -> &'a [u8] {
    let Some((&len, tail)) = rest.split_first() else {
        return &[];
    };
    let n = usize::from(len).min(tail.len());
    let (c, after) = tail.split_at(n);
    *rest = after;
    c
}

fuzz_target!(|data: &[u8]| {
    let mut a = DistAutograd::new(0);
    let shared = a.new_context().unwrap();
    a.record_send(shared, 1, 1).unwrap();
    a.record_send(shared, HOSTILE, 1).unwrap();
    let known = a.capability(shared).unwrap();
    a.handle_recv(1, shared, known, AutogradMessageId::new(1, 0))
        .unwrap();
    a.handle_recv(HOSTILE, shared, known, AutogradMessageId::new(HOSTILE, 0))
        .unwrap();
    let private = a.new_context().unwrap();
    a.record_send(private, 1, 1).unwrap();
    let secret = a.capability(private).unwrap();
    a.handle_recv(1, private, secret, AutogradMessageId::new(1, 1))
        .unwrap();
    let mut sends = BTreeMap::new();
    for c in [shared, private] {
        sends.insert(c, a.send_records(c));
    }
    let mut d = Driver {
        a,
        sends,
        running: BTreeMap::new(),
        outstanding: BTreeMap::new(),
        accepted: BTreeSet::new(),
        replied: BTreeSet::new(),
        next_token: 0,
    };
    d.drain();

    let mut rest = data;
    while let Some((&op, tail)) = rest.split_first() {
        rest = tail;
        let before = snapshot(&d.a);
        match op % 8 {
            0 => {
                let Ok((c, m, grads)) =
                    postcard::from_bytes::<(ContextId, AutogradMessageId, u8)>(chunk(&mut rest))
                else {
                    continue;
                };
                let token = d.next_token;
                d.next_token += 1;
                // Every send carried one tensor: another count is refused.
                match d
                    .a
                    .handle_gradient(HOSTILE, c, m, usize::from(grads), token)
                {
                    Ok(_) => {
                        d.accepted.insert(token);
                    }
                    Err(v) => {
                        assert!(!v.to_string().is_empty());
                        d.refused(&before, "gradient");
                    }
                }
            }
            1 => {
                let Ok((c, m, guess)) =
                    postcard::from_bytes::<(ContextId, AutogradMessageId, Option<u128>)>(chunk(
                        &mut rest,
                    ))
                else {
                    continue;
                };
                let capability = guess.unwrap_or(known);
                match d.a.handle_recv(HOSTILE, c, capability, m) {
                    // Nothing recorded until the creator answers; a creator that does not
                    // vouch (this one never made c) gets the message refused.
                    Ok(Recv::AskCreator) => {
                        d.refused(&before, "recv asking the creator");
                        assert!(d.a.handle_vouch(HOSTILE, c, capability, m, false).is_err());
                        d.refused(&before, "recv the creator did not vouch for");
                    }
                    Ok(_) => {
                        assert_eq!(m.worker(), HOSTILE, "a recv under another worker's id");
                        assert!(
                            c != private || capability == secret,
                            "worker 2 joined a context it was never given"
                        );
                        if !d.sends.contains_key(&c) {
                            d.sends.insert(c, d.a.send_records(c));
                        }
                    }
                    Err(e) => {
                        // A violation, a lost sender or a context of worker 0's that it
                        // dropped: refused alike, changing nothing.
                        assert!(!e.to_string().is_empty());
                        d.refused(&before, "recv");
                    }
                }
            }
            2 => {
                let Ok((c, cause)) =
                    postcard::from_bytes::<(ContextId, Option<BackwardError>)>(chunk(&mut rest))
                else {
                    continue;
                };
                if d.a.handle_release(HOSTILE, c, cause).is_err() {
                    d.refused(&before, "release");
                }
            }
            3 if op & 0x80 != 0 => {
                // An answer that carries gradients for worker 0's send functions.
                let Ok(messages) = postcard::from_bytes::<Vec<AutogradMessageId>>(chunk(&mut rest))
                else {
                    continue;
                };
                let list = d.outstanding.entry(HOSTILE).or_default();
                if !list.is_empty() {
                    let i = usize::from((op >> 3) & 0x0f) % list.len();
                    let g = list[i];
                    if d.a.handle_gradient_reply_with(g, &messages).is_err() {
                        d.refused(&before, "answer with gradients");
                    } else {
                        d.outstanding.entry(HOSTILE).or_default().remove(i);
                    }
                }
            }
            3 => {
                let Ok(result) =
                    postcard::from_bytes::<Result<(), BackwardError>>(chunk(&mut rest))
                else {
                    continue;
                };
                let list = d.outstanding.entry(HOSTILE).or_default();
                if !list.is_empty() {
                    let g = list.remove(usize::from(op >> 3) % list.len());
                    d.a.handle_gradient_reply(g, result);
                }
            }
            4 => {
                if let Some((&task, &c)) = d.running.iter().nth(usize::from(op >> 4)) {
                    d.running.remove(&task);
                    if op & 0x08 != 0 {
                        d.a.local_failed(task, "fuzz engine failure");
                    } else {
                        // The engine reached the recv functions of every message received.
                        let reached: Vec<AutogradMessageId> =
                            d.a.recv_records(c).into_iter().map(|(m, _)| m).collect();
                        d.a.local_done(task, &reached);
                    }
                }
            }
            5 => {
                for g in d.outstanding.remove(&1).unwrap_or_default() {
                    d.a.handle_gradient_reply(g, Ok(()));
                }
            }
            6 => {
                let c = if op & 0x08 != 0 { private } else { shared };
                let _ = d.a.backward(c, op & 0x10 != 0, &[Root::scalar()]);
            }
            _ => d.a.handle_peer_lost(HOSTILE),
        }
        d.drain();
    }

    // The end: every local run finishes, every request worker 0 sent is answered.
    for _ in 0..64 {
        let running: Vec<TaskId> = std::mem::take(&mut d.running).into_keys().collect();
        let outstanding = std::mem::take(&mut d.outstanding);
        if running.is_empty() && outstanding.values().all(Vec::is_empty) {
            break;
        }
        for t in running {
            d.a.local_done(t, &[]);
        }
        for (to, gs) in outstanding {
            for g in gs {
                d.a.handle_gradient_reply(
                    g,
                    Err(BackwardError::Request {
                        worker: to,
                        context: ContextId(0),
                        reason: "the end".into(),
                    }),
                );
            }
        }
        d.drain();
    }
    assert_eq!(
        d.replied, d.accepted,
        "accepted gradient requests left unanswered"
    );
    assert_eq!(d.a.running_tasks(), 0);
});
