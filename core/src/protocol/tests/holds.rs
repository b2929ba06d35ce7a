//! A request holds the values owned here that it names, from its arrival until it is answered:
//! a caller's delete right behind its call cannot free the value first, and nothing is left
//! held once the request ends, whatever its outcome.

use std::time::Instant;

use super::T;
use crate::protocol::*;
use crate::protocol_sim::Body as Sb;

/// Worker 0 (a user) and worker 1 (the owner), with the messages between them moved by hand.
struct Pair {
    eps: [Endpoint<Sb>; 2],
    now: Instant,
    /// Events of each worker, in order, not yet looked at.
    events: [Vec<Event<Sb>>; 2],
}

impl Pair {
    fn new() -> Self {
        Self {
            eps: [
                Endpoint::new(0, EndpointConfig::default()),
                Endpoint::new(1, EndpointConfig::default()),
            ],
            now: Instant::now(),
            events: [Vec::new(), Vec::new()],
        }
    }

    fn ep(&mut self, w: WorkerId) -> &mut Endpoint<Sb> {
        &mut self.eps[w as usize]
    }

    /// Takes every event out of both endpoints (in order, per worker).
    fn collect(&mut self) {
        for w in 0..2 {
            while let Some(ev) = self.eps[w].poll_event() {
                self.events[w].push(ev);
            }
        }
    }

    /// Delivers every message `from` has sent so far, in order, one by one: the owner's
    /// application runs nothing meanwhile (it is late, as a runner thread may be).
    fn deliver_all(&mut self, from: WorkerId) {
        let to = 1 - from;
        let sent: Vec<Transmit<Sb>> =
            std::iter::from_fn(|| self.ep(from).poll_transmit()).collect();
        for t in sent {
            assert_eq!(t.to, to);
            let now = self.now;
            let result = self.ep(to).handle_message(from, t.header, t.body, now);
            assert_eq!(result, Ok(()), "a normal flow is no violation");
        }
        self.collect();
    }

    /// Moves messages both ways until neither has anything to send.
    fn settle(&mut self) {
        while {
            let busy = [0, 1].map(|w| {
                let had = self.eps[w as usize].poll_transmit();
                if let Some(t) = had {
                    let now = self.now;
                    let r = self.eps[1 - w as usize].handle_message(w, t.header, t.body, now);
                    assert_eq!(r, Ok(()));
                    true
                } else {
                    false
                }
            });
            busy.iter().any(|b| *b)
        } {}
        self.collect();
    }

    /// Worker 0 creates a value on worker 1 and learns it exists.
    fn created(&mut self) -> RRefHandle {
        let now = self.now;
        let (h, _) = self
            .ep(0)
            .remote(1, "make", Sb::default(), T, now)
            .expect("remote");
        self.deliver_all(0);
        let token = self.take_request(1);
        assert!(self.ep(1).respond(token, Ok(Sb::default())));
        self.settle();
        self.events[0].clear();
        h
    }

    /// The next request handed to `w`'s application (the events before it are dropped).
    fn take_request(&mut self, w: WorkerId) -> RequestToken {
        let events = std::mem::take(&mut self.events[w as usize]);
        let mut tokens = events.into_iter().filter_map(|ev| match ev {
            Event::Call { token, .. } | Event::Remote { token, .. } => Some(token),
            _ => None,
        });
        tokens.next().expect("a request for the application")
    }

    /// The values worker `w` released, taking its events.
    fn released(&mut self, w: WorkerId) -> Vec<RRefId> {
        std::mem::take(&mut self.events[w as usize])
            .into_iter()
            .filter_map(|ev| match ev {
                Event::ReleaseValue { rref } => Some(rref),
                _ => None,
            })
            .collect()
    }

    /// The requests worker `w`'s application was handed, with their bodies (kept in order).
    fn requests(&mut self, w: WorkerId) -> Vec<(RequestToken, Sb)> {
        let events = std::mem::take(&mut self.events[w as usize]);
        let mut out = Vec::new();
        for ev in events {
            match ev {
                Event::Call { token, body, .. } | Event::Remote { token, body, .. } => {
                    out.push((token, body));
                }
                other => self.events[w as usize].push(other),
            }
        }
        out
    }

    fn holds(&self, w: WorkerId, rref: RRefId) -> Option<u32> {
        self.eps[w as usize]
            .debug_info()
            .owned
            .iter()
            .find(|o| o.rref == rref)
            .map(|o| o.request_holds)
    }
}

/// How the caller hands its reference to the owner before dropping it at once.
#[derive(Debug, Clone, Copy)]
enum Pattern {
    /// `rpc_async(owner, f, args=(rref,))`.
    Argument,
    /// `rref.rpc_async().method()`.
    Target,
    /// `rref.remote().method()`: a new value made by a method of this one.
    RemoteTarget,
    /// `remote(owner, f, args=(rref,))`.
    RemoteArgument,
}

/// Worker 0 hands its reference to the owner in a request and drops it at once: the delete of
/// its fork follows the request on the same link. Returns the request's message id and the
/// fork data passed among the arguments, if any.
fn hand_over_and_drop(p: &mut Pair, h: RRefHandle, pattern: Pattern) -> Option<RRefForkData> {
    let now = p.now;
    let mut forks = Vec::new();
    let mut target = None;
    match pattern {
        Pattern::Argument | Pattern::RemoteArgument => {
            forks.push(p.ep(0).fork_for(h, 1).expect("fork for the owner"));
        }
        Pattern::Target | Pattern::RemoteTarget => target = Some(MethodTarget::from(h)),
    }
    let body = Sb {
        data: b"args".to_vec(),
        forks: forks.clone(),
        target,
    };
    match pattern {
        Pattern::Argument | Pattern::Target => {
            p.ep(0).call(1, "use", body, T, now).expect("call");
        }
        Pattern::RemoteArgument | Pattern::RemoteTarget => {
            p.ep(0).remote(1, "use", body, T, now).expect("remote");
        }
    }
    p.ep(0).drop_handle(h, now);
    forks.first().copied()
}

const PATTERNS: [Pattern; 4] = [
    Pattern::Argument,
    Pattern::Target,
    Pattern::RemoteTarget,
    Pattern::RemoteArgument,
];

/// The owner's application takes the request late (after the caller's delete arrived, as a
/// runner thread does): the value is still there, and the request is served on it; once
/// answered (and the application's own handle dropped), the value goes.
#[test]
fn a_reference_dropped_right_behind_its_request_lives_until_the_request_is_answered() {
    for pattern in PATTERNS {
        let mut p = Pair::new();
        let h = p.created();
        let data = hand_over_and_drop(&mut p, h, pattern);
        // The request and the delete behind it both arrive before the application runs.
        p.deliver_all(0);
        assert!(
            p.events[1]
                .iter()
                .all(|e| !matches!(e, Event::ReleaseValue { .. })),
            "{pattern:?}: the delete behind the request freed the value first"
        );
        assert!(p.ep(1).owns(h.rref), "{pattern:?}");
        assert_eq!(p.holds(1, h.rref), Some(1), "{pattern:?}");
        let (token, body) = p.requests(1).pop().expect("the request");
        assert_eq!(body.forks, data.into_iter().collect::<Vec<_>>());
        // The application decodes the arguments now: its handle on the reference.
        let now = p.now;
        let accepted = data.map(|d| p.ep(1).accept_fork(d, now));
        if let Some(a) = accepted {
            assert_eq!(a.rref, h.rref);
        }
        assert!(p.ep(1).respond(token, Ok(Sb::default())), "{pattern:?}");
        p.collect();
        if let Some(a) = accepted {
            assert!(
                p.released(1).is_empty(),
                "{pattern:?}: released under a handle"
            );
            assert_eq!(p.holds(1, h.rref), Some(0));
            p.ep(1).drop_handle(a, now);
            p.collect();
        }
        assert_eq!(p.released(1), vec![h.rref], "{pattern:?}");
        p.settle();
        // A remote method's new value stays (its creator holds it); nothing else is owned.
        let left: Vec<RRefId> = p.eps[1].debug_info().owned.iter().map(|o| o.rref).collect();
        match pattern {
            Pattern::RemoteArgument | Pattern::RemoteTarget => assert_eq!(left.len(), 1),
            _ => assert!(left.is_empty(), "{pattern:?}: {left:?}"),
        }
        assert!(!left.contains(&h.rref));
        assert!(p.eps[0].is_idle() && p.eps[1].is_idle(), "{pattern:?}");
    }
}

/// A request whose arguments never decode (the application answers with an error and accepts
/// no fork), or that is refused before it runs, leaves nothing held: the value goes with the
/// answer, and no owned record stays.
#[test]
fn a_request_whose_arguments_never_decode_leaves_nothing_held() {
    for pattern in [Pattern::Argument, Pattern::Target] {
        let mut p = Pair::new();
        let h = p.created();
        hand_over_and_drop(&mut p, h, pattern);
        p.deliver_all(0);
        let (token, _) = p.requests(1).pop().expect("the request");
        assert!(p.released(1).is_empty());
        let err = RemoteError {
            worker: 1,
            kind: RemoteErrorKind::Serialization,
            message: "bad arguments".into(),
        };
        assert!(p.ep(1).respond(token, Err(err)));
        p.collect();
        assert_eq!(p.released(1), vec![h.rref], "{pattern:?}");
        p.settle();
        assert!(p.eps[1].debug_info().owned.is_empty(), "{pattern:?}");
        assert!(p.eps[0].is_idle() && p.eps[1].is_idle());
    }
}

/// A request whose caller is lost before it is answered lets go of what it held: the value
/// goes with the caller's forks, although the application never answers.
#[test]
fn a_lost_callers_request_lets_go_of_what_it_held() {
    for pattern in PATTERNS {
        let mut p = Pair::new();
        let h = p.created();
        hand_over_and_drop(&mut p, h, pattern);
        p.deliver_all(0);
        let (token, _) = p.requests(1).pop().expect("the request");
        let now = p.now;
        p.ep(1)
            .handle_peer_lost(0, crate::protocol_sim::lost_link(), now);
        p.collect();
        assert!(p.released(1).contains(&h.rref), "{pattern:?}");
        assert!(p.eps[1].debug_info().owned.is_empty(), "{pattern:?}");
        // The late answer is ignored and holds nothing.
        assert!(!p.ep(1).respond(token, Ok(Sb::default())));
        assert!(p.eps[1].is_idle());
    }
}

/// A method call of the owner on its own value, whose handle it drops at once (the call's
/// handler runs later, in a task): the value stays until the call is answered.
#[test]
fn a_call_to_ourselves_holds_its_target_until_answered() {
    let mut owner = Endpoint::<Sb>::new(1, EndpointConfig::default());
    let now = Instant::now();
    let h = owner.local_rref().expect("local rref");
    let body = Sb {
        target: Some(MethodTarget::from(h)),
        ..Sb::default()
    };
    let id = owner.call(1, "use", body, T, now).expect("call");
    owner.drop_handle(h, now);
    let events: Vec<Event<Sb>> = std::iter::from_fn(|| owner.poll_event()).collect();
    let token = match events.as_slice() {
        [Event::Call { token, .. }] => *token,
        other => panic!("expected the call alone, got {other:?}"),
    };
    assert!(owner.owns(h.rref));
    assert!(owner.respond(token, Ok(Sb::default())));
    let events: Vec<Event<Sb>> = std::iter::from_fn(|| owner.poll_event()).collect();
    assert!(
        matches!(events.as_slice(), [Event::Completed { id: done, outcome: Ok(_) }, Event::ReleaseValue { rref }] if *done == id && *rref == h.rref),
        "{events:?}"
    );
    assert!(owner.debug_info().owned.is_empty());
}

/// A peer may hand its owner only references it holds: a call passing a fork of a value owned
/// here that it was never given (ids are easy to guess), or passing off a fork as made by
/// another worker, is a typed violation that changes nothing and holds nothing; the value
/// still goes once its real holder drops it.
#[test]
fn a_forged_reference_in_the_arguments_is_a_violation_and_holds_nothing() {
    let mut p = Pair::new();
    let h = p.created();
    let now = p.now;
    let data = |fork, parent| RRefForkData {
        rref: h.rref,
        fork,
        owner: 1,
        parent,
        secret: 0,
    };
    let made_up = GlobalId {
        created_on: 2,
        local: 9,
    };
    let what = "call with the reference in its arguments";
    for (id, (fork, parent)) in [(h.fork, 2), (made_up, 2), (h.fork, 0), (h.fork, 1)]
        .into_iter()
        .enumerate()
    {
        let id = id as MessageId + 1;
        let body = Sb {
            forks: vec![data(fork, parent)],
            ..Sb::default()
        };
        let call = Header::Call {
            id,
            function: "use".into(),
            timeout: T,
        };
        assert_eq!(
            p.ep(1).handle_message(2, call, Some(body.clone()), now),
            Err(ProtocolViolation::NotAHolder {
                what,
                rref: h.rref,
                fork,
                sender: 2,
            }),
            "fork {fork} parent {parent}"
        );
        let remote = Header::Remote {
            id: id + 100,
            function: "use".into(),
            rref: GlobalId {
                created_on: 2,
                local: id + 100,
            },
            fork: GlobalId {
                created_on: 2,
                local: id + 100,
            },
            secret: 0,
            timeout: T,
        };
        assert!(matches!(
            p.ep(1).handle_message(2, remote, Some(body), now),
            Err(ProtocolViolation::NotAHolder { what: w, .. }) if w == what
        ));
        assert!(p.ep(1).poll_event().is_none() && p.ep(1).poll_transmit().is_none());
        assert_eq!(p.holds(1, h.rref), Some(0));
        assert_eq!(p.eps[1].debug_info().owned.len(), 1);
    }
    // The holder drops it: the value goes, nothing stays.
    p.ep(0).drop_handle(h, now);
    p.settle();
    assert_eq!(p.released(1), vec![h.rref]);
    assert!(p.eps[1].debug_info().owned.is_empty());
}
