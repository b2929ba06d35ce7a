use super::sim::{self, SimConfig};
use super::*;

/// The capability of `c` as its creator derives it with the default key (no test sets one).
fn cap(c: ContextId) -> Capability {
    derive(
        &crate::capability::default_key(c.worker()),
        b"tensorwire autograd context",
        &[c.0],
    )
}

fn drain(s: &mut DistAutograd) -> Vec<Output> {
    std::iter::from_fn(|| s.poll()).collect()
}

fn task_of(outputs: &[Output]) -> TaskId {
    outputs
        .iter()
        .find_map(|o| match o {
            Output::RunLocal { task, .. } => Some(*task),
            _ => None,
        })
        .expect("a local run")
}

/// A forward pass a -> b (message m1) and b -> a (result, message m2), as `rpc_sync` makes.
fn chain() -> (
    DistAutograd,
    DistAutograd,
    ContextId,
    AutogradMessageId,
    AutogradMessageId,
) {
    let mut a = DistAutograd::new(0);
    let mut b = DistAutograd::new(1);
    let c = a.new_context().unwrap();
    let m1 = a.record_send(c, 1, 1).unwrap();
    b.handle_recv(0, c, cap(c), m1).unwrap();
    let m2 = b.record_send(c, 0, 1).unwrap();
    a.handle_recv(1, c, cap(c), m2).unwrap();
    (a, b, c, m1, m2)
}

#[test]
fn ids_carry_the_worker_in_the_high_bits() {
    let mut s = DistAutograd::new(5);
    let c0 = s.new_context().unwrap();
    let c1 = s.new_context().unwrap();
    assert_eq!((c0.worker(), c0.counter(), c1.counter()), (5, 0, 1));
    assert_eq!(c0.0, 5 << 32);
    let m = s.record_send(c0, 2, 1).unwrap();
    assert_eq!(m.worker(), 5);
    assert_eq!(s.known_workers(c0), Some(vec![2]));
    assert_eq!(s.send_records(c0), vec![(m, 2)]);
    assert_eq!(c1.to_string(), "context 5:1");
}

#[test]
fn a_chain_completes_only_after_the_callee_answers() {
    let (mut a, mut b, c, m1, m2) = chain();
    a.backward(c, false, &[Root::scalar()]).unwrap();
    let out = drain(&mut a);
    assert_eq!(out[0], Output::Prepare { context: c });
    let t = task_of(&out);
    a.local_done(t, &[m2]);
    let out = drain(&mut a);
    let Output::SendGradient {
        gradient,
        to,
        message,
        ..
    } = out[0].clone()
    else {
        panic!("{out:?}")
    };
    assert_eq!((to, message), (1, m2));
    // b runs the send function of m2, which reaches the recv of m1 (a's send).
    let tb = b.handle_gradient(0, c, m2, 1, 77).unwrap().unwrap();
    let out_b = drain(&mut b);
    assert!(out_b.contains(&Output::Prepare { context: c }));
    assert!(out_b.contains(&Output::RunLocal {
        task: tb,
        context: c,
        entry: Entry::Send(m2)
    }));
    b.local_done(tb, &[m1]);
    let out_b = drain(&mut b);
    let Output::SendGradient { gradient: gb, .. } = out_b[0].clone() else {
        panic!("{out_b:?}")
    };
    // a runs its send function of m1 (a new task in the same context, while the root waits).
    let ta = a.handle_gradient(1, c, m1, 1, 5).unwrap().unwrap();
    drain(&mut a);
    a.local_done(ta, &[]);
    assert_eq!(
        drain(&mut a),
        vec![Output::Reply {
            to: 1,
            request: 5,
            result: Ok(())
        }]
    );
    // b may answer only now: its send function's work includes a's.
    assert!(b.is_busy(c));
    b.handle_gradient_reply(gb, Ok(()));
    assert_eq!(
        drain(&mut b),
        vec![Output::Reply {
            to: 0,
            request: 77,
            result: Ok(())
        }]
    );
    assert!(a.is_busy(c));
    a.handle_gradient_reply(gradient, Ok(()));
    assert_eq!(
        drain(&mut a),
        vec![Output::BackwardDone {
            context: c,
            result: Ok(())
        }]
    );
    assert!(a.is_idle() && b.is_idle());
    // Without retain_graph the graph is gone.
    assert_eq!(
        a.backward(c, false, &[Root::scalar()]),
        Err(AutogradError::GraphFreed(c))
    );
}

#[test]
fn release_fans_out_to_known_workers_and_stops() {
    let (mut a, mut b, c, _, _) = chain();
    a.release(c).unwrap();
    let out = drain(&mut a);
    assert_eq!(
        out,
        vec![
            Output::Release {
                to: 1,
                context: c,
                cause: None
            },
            Output::Dropped { context: c }
        ]
    );
    b.handle_release(0, c, None).unwrap();
    // b's only known worker is a, which released: nothing more to tell.
    assert_eq!(drain(&mut b), vec![Output::Dropped { context: c }]);
    assert_eq!((a.context_count(), b.context_count()), (0, 0));
    // A late or crossing release is harmless.
    b.handle_release(0, c, None).unwrap();
    assert!(drain(&mut b).is_empty());
    assert_eq!(a.release(c), Err(AutogradError::UnknownContext(c)));
}

/// DESIGN: a late gradient for a released context is logged and dropped. It crossed the
/// release on the wire: nothing runs, the request is answered with why the context went, it is
/// counted for the driver to log, and it is no violation. A context never held stays one.
#[test]
fn a_late_gradient_for_a_released_context_is_dropped_and_answered() {
    let (mut a, mut b, c, _, m2) = chain();
    a.backward(c, false, &[Root::scalar()]).unwrap();
    let t = task_of(&drain(&mut a));
    a.local_done(t, &[m2]);
    let Output::SendGradient { gradient, .. } = drain(&mut a)[0].clone() else {
        panic!("a gradient to b")
    };
    // a releases while its gradient to b is on the wire; the release reaches b first.
    a.release(c).unwrap();
    drain(&mut a);
    b.handle_release(0, c, None).unwrap();
    assert_eq!(drain(&mut b), vec![Output::Dropped { context: c }]);
    let released = BackwardError::Released {
        worker: 0,
        context: c,
    };
    assert_eq!(b.handle_gradient(0, c, m2, 1, 7), Ok(None));
    assert_eq!(
        drain(&mut b),
        vec![Output::Reply {
            to: 0,
            request: 7,
            result: Err(released.clone())
        }]
    );
    assert_eq!(b.late_gradients(), 1);
    assert!(b.is_idle() && !b.has_context(c) && b.running_tasks() == 0);
    // The answer reaches a, whose work in the context is already over: ignored.
    a.handle_gradient_reply(gradient, Err(released));
    assert!(drain(&mut a).is_empty() && a.is_idle());
    // A context b never had is still a violation, and not counted as late.
    let never = ContextId::new(0, 99);
    assert_eq!(
        b.handle_gradient(0, never, m2, 1, 8),
        Err(ProtocolViolation::UnknownContext {
            from: 0,
            context: never
        })
    );
    assert_eq!(b.late_gradients(), 1);
    assert!(drain(&mut b).is_empty());
}

/// Contexts dropped by a loss are remembered too, at most [`GONE_KEPT`] of them, oldest
/// forgotten first.
#[test]
fn the_record_of_dropped_contexts_is_bounded() {
    let mut b = DistAutograd::new(1);
    let mut first = None;
    let mut last = (ContextId(0), AutogradMessageId(0));
    for i in 0..=GONE_KEPT as u64 {
        let c = ContextId::new(0, i);
        let m = AutogradMessageId::new(1, i);
        b.handle_recv(0, c, cap(c), AutogradMessageId::new(0, i))
            .unwrap();
        // b sent m to a in c (a result), so a may send its gradient.
        let sent = b.record_send(c, 0, 1).unwrap();
        assert_eq!(sent, m);
        first.get_or_insert((c, m));
        last = (c, m);
    }
    b.handle_peer_lost(0);
    drain(&mut b);
    assert_eq!(b.context_count(), 0);
    let (c, m) = last;
    assert_eq!(b.handle_gradient(0, c, m, 1, 1), Ok(None));
    let (c, m) = first.unwrap();
    assert_eq!(
        b.handle_gradient(0, c, m, 1, 2),
        Err(ProtocolViolation::UnknownContext {
            from: 0,
            context: c
        })
    );
    assert_eq!(b.late_gradients(), 1);
}

#[test]
fn a_lost_peer_fails_the_backward_naming_it_and_drops_the_context() {
    // a -> b -> c; the backward waits on b when c dies; b learns it first.
    let mut a = DistAutograd::new(0);
    let mut b = DistAutograd::new(1);
    let ctx = a.new_context().unwrap();
    let m1 = a.record_send(ctx, 1, 1).unwrap();
    b.handle_recv(0, ctx, cap(ctx), m1).unwrap();
    let m2 = b.record_send(ctx, 2, 1).unwrap();
    let m3 = b.record_send(ctx, 0, 1).unwrap();
    a.handle_recv(1, ctx, cap(ctx), m3).unwrap();
    a.backward(ctx, false, &[Root::scalar()]).unwrap();
    let t = task_of(&drain(&mut a));
    a.local_done(t, &[m3]);
    drain(&mut a);
    let tb = b.handle_gradient(0, ctx, m3, 1, 9).unwrap().unwrap();
    drain(&mut b);
    // b's send function of m3 reaches a recv from c? No: b forwarded to c; model the wait on c
    // as b's run reaching nothing but b still waiting on a gradient to c for m2's pair.
    let _ = m2;
    b.handle_peer_lost(2);
    let out = drain(&mut b);
    let lost = BackwardError::PeerLost {
        worker: 2,
        context: ctx,
    };
    assert_eq!(
        out,
        vec![
            Output::Reply {
                to: 0,
                request: 9,
                result: Err(lost.clone())
            },
            Output::Release {
                to: 0,
                context: ctx,
                cause: Some(lost.clone())
            },
            Output::Dropped { context: ctx }
        ]
    );
    let _ = tb;
    // a gets the failed reply: the root fails naming worker 2 and releases everywhere.
    let gradient = GradientId(0);
    a.handle_gradient_reply(gradient, Err(lost.clone()));
    let out = drain(&mut a);
    assert!(out.contains(&Output::BackwardDone {
        context: ctx,
        result: Err(lost.clone())
    }));
    assert!(out.contains(&Output::Dropped { context: ctx }));
    assert_eq!(a.context_count(), 0);
    assert!(lost.to_string().contains("worker 2 was lost"));
    // b's release arriving later finds nothing.
    a.handle_release(1, ctx, Some(lost)).unwrap();
    assert!(drain(&mut a).is_empty());
}

/// Found by the `autograd` fuzz target: a recv from a peer in a context that this worker had
/// made and released made the context again (empty, with the peer as its only known worker),
/// which nobody would release any more; and one in a context of this worker's id that it never
/// made planted a context that a later `new_context` would silently replace.
#[test]
fn a_recv_cannot_make_again_or_forge_a_context_of_this_workers() {
    let mut a = DistAutograd::new(0);
    let c = a.new_context().unwrap();
    a.record_send(c, 1, 1).unwrap();
    a.handle_recv(1, c, cap(c), AutogradMessageId::new(1, 0))
        .unwrap();
    a.release(c).unwrap();
    drain(&mut a);
    assert_eq!(
        a.handle_recv(1, c, cap(c), AutogradMessageId::new(1, 1)),
        Err(RecvError::ContextGone {
            from: 1,
            context: c
        })
    );
    assert!(!a.has_context(c));
    let never = ContextId::new(0, 7);
    assert_eq!(
        a.handle_recv(1, never, cap(never), AutogradMessageId::new(1, 2)),
        Err(RecvError::NeverMade {
            from: 1,
            context: never
        })
    );
    assert!(!a.has_context(never));
    assert!(drain(&mut a).is_empty());
    // A context of this worker's that it still has takes recvs (a cycle back to its maker),
    // and another worker's context is made on its first message.
    let d = a.new_context().unwrap();
    a.handle_recv(1, d, cap(d), AutogradMessageId::new(1, 3))
        .unwrap();
    let theirs = ContextId::new(1, 0);
    a.handle_recv(1, theirs, cap(theirs), AutogradMessageId::new(1, 4))
        .unwrap();
    assert!(a.has_context(d) && a.has_context(theirs));
}

#[test]
fn violations_are_typed_and_change_nothing() {
    let (mut a, mut b, c, m1, m2) = chain();
    let unknown = ContextId::new(9, 9);
    assert_eq!(
        b.handle_gradient(0, unknown, m1, 1, 0),
        Err(ProtocolViolation::UnknownContext {
            from: 0,
            context: unknown
        })
    );
    // Worker 3 never exchanged anything in c.
    assert_eq!(
        a.handle_gradient(3, c, m1, 1, 0),
        Err(ProtocolViolation::NotInContext {
            from: 3,
            context: c
        })
    );
    // b never sent m1 (a did).
    assert_eq!(
        b.handle_gradient(0, c, m1, 1, 0),
        Err(ProtocolViolation::UnknownMessage {
            from: 0,
            context: c,
            message: m1
        })
    );
    // A recv whose id is not the sender's, or a repeated one.
    assert!(matches!(
        a.handle_recv(1, c, cap(c), m1),
        Err(RecvError::Violation(ProtocolViolation::BadMessageId { .. }))
    ));
    assert!(matches!(
        a.handle_recv(1, c, cap(c), m2),
        Err(RecvError::Violation(ProtocolViolation::BadMessageId { .. }))
    ));
    assert_eq!(
        a.handle_release(3, c, None),
        Err(ProtocolViolation::NotInContext {
            from: 3,
            context: c
        })
    );
    assert!(drain(&mut a).is_empty() && drain(&mut b).is_empty());
    assert_eq!((a.context_count(), b.context_count()), (1, 1));
    assert!(a.is_idle() && b.is_idle());
    assert!(ProtocolViolation::UnknownContext {
        from: 0,
        context: unknown
    }
    .to_string()
    .contains("which this worker does not have"));
}

/// A gradient request for a message carries one gradient (present or not) per tensor the
/// message carried: another count is the sender's violation, named, and changes nothing; the
/// right count for the same message then runs.
#[test]
fn a_gradient_request_with_another_count_than_the_message_had_is_a_violation() {
    let mut a = DistAutograd::new(0);
    let mut b = DistAutograd::new(1);
    let c = a.new_context().unwrap();
    let m1 = a.record_send(c, 1, 3).unwrap();
    b.handle_recv(0, c, cap(c), m1).unwrap();
    let m2 = b.record_send(c, 0, 2).unwrap();
    a.handle_recv(1, c, cap(c), m2).unwrap();
    assert_eq!(a.sent(c, m1), Some((1, 3)));
    assert_eq!((a.sent(c, m2), b.sent(c, m1)), (None, None));
    for grads in [0, 2, 4] {
        assert_eq!(
            a.handle_gradient(1, c, m1, grads, 0),
            Err(ProtocolViolation::MismatchedGradients {
                from: 1,
                context: c,
                message: m1,
                detail: format!("{grads} gradients for 3 tensors"),
            })
        );
    }
    assert_eq!(
        b.handle_gradient(0, c, m2, 1, 0),
        Err(ProtocolViolation::MismatchedGradients {
            from: 0,
            context: c,
            message: m2,
            detail: "1 gradients for 2 tensors".into(),
        })
    );
    assert!(drain(&mut a).is_empty() && drain(&mut b).is_empty());
    assert!(a.is_idle() && b.is_idle());
    // Worker 3 never exchanged anything in c: that comes first, whatever the count.
    assert_eq!(
        a.handle_gradient(3, c, m1, 1, 0),
        Err(ProtocolViolation::NotInContext {
            from: 3,
            context: c
        })
    );
    let t = a.handle_gradient(1, c, m1, 3, 5).unwrap().unwrap();
    assert_eq!(task_of(&drain(&mut a)), t);
}

#[test]
fn an_engine_failure_fails_the_backward() {
    let (mut a, _b, c, _, m2) = chain();
    a.backward(c, true, &[Root::scalar()]).unwrap();
    let t = task_of(&drain(&mut a));
    // The engine reports a recv that does not exist: the task fails.
    a.local_done(t, &[AutogradMessageId::new(1, 99)]);
    let out = drain(&mut a);
    assert!(
        matches!(
            &out[..],
            [
                ..,
                Output::BackwardDone {
                    result: Err(BackwardError::Engine { worker: 0, .. }),
                    ..
                }
            ]
        ),
        "{out:?}"
    );
    // The context stays (PyTorch's too): only a lost peer drops one.
    assert_eq!(a.context_count(), 1);
    assert!(!out.iter().any(|o| matches!(o, Output::Release { .. })));
    a.backward(c, true, &[Root::scalar()]).unwrap();
    let t = task_of(&drain(&mut a));
    a.local_done(t, &[m2]);
    assert!(matches!(
        drain(&mut a)[..],
        [Output::SendGradient { message, .. }] if message == m2
    ));
}

/// A → B and A → C; B's engine fails. A's backward reports it only once C has answered too,
/// both contexts stay, nothing is released, and the next backward succeeds
/// (`test_multiple_backward_with_errors`).
#[test]
fn a_backward_failing_on_a_remote_worker_leaves_the_context_usable() {
    let mut a = DistAutograd::new(0);
    let mut b = DistAutograd::new(1);
    let mut c3 = DistAutograd::new(2);
    let c = a.new_context().unwrap();
    let (ab, ac) = (
        a.record_send(c, 1, 1).unwrap(),
        a.record_send(c, 2, 1).unwrap(),
    );
    b.handle_recv(0, c, cap(c), ab).unwrap();
    c3.handle_recv(0, c, cap(c), ac).unwrap();
    let (ba, ca) = (
        b.record_send(c, 0, 1).unwrap(),
        c3.record_send(c, 0, 1).unwrap(),
    );
    a.handle_recv(1, c, cap(c), ba).unwrap();
    a.handle_recv(2, c, cap(c), ca).unwrap();
    for round in 0..2 {
        a.backward(c, round == 1, &[Root::scalar()]).unwrap();
        let t = task_of(&drain(&mut a));
        a.local_done(t, &[ba, ca]);
        let sends = drain(&mut a);
        let gradient_to = |w: WorkerId| {
            sends
                .iter()
                .find_map(|o| match o {
                    Output::SendGradient { gradient, to, .. } if *to == w => Some(*gradient),
                    _ => None,
                })
                .unwrap()
        };
        let (gb, gc) = (gradient_to(1), gradient_to(2));
        let tb = b.handle_gradient(0, c, ba, 1, 10).unwrap().unwrap();
        drain(&mut b);
        let tc = c3.handle_gradient(0, c, ca, 1, 20).unwrap().unwrap();
        drain(&mut c3);
        if round == 0 {
            b.local_failed(tb, "simulated error on the backward pass");
        } else {
            b.local_done(tb, &[]);
        }
        let [Output::Reply { result, .. }] = &drain(&mut b)[..] else {
            panic!()
        };
        a.handle_gradient_reply(gb, result.clone());
        if round == 0 {
            // C is still working: A waits for it before reporting.
            assert!(drain(&mut a).is_empty());
            assert!(a.is_busy(c));
        }
        c3.local_done(tc, &[]);
        let [Output::Reply { result, .. }] = &drain(&mut c3)[..] else {
            panic!()
        };
        a.handle_gradient_reply(gc, result.clone());
        let out = drain(&mut a);
        match round {
            0 => assert!(
                matches!(
                    &out[..],
                    [Output::BackwardDone {
                        result: Err(BackwardError::Engine { worker: 1, reason, .. }),
                        ..
                    }] if reason.contains("simulated error")
                ),
                "{out:?}"
            ),
            _ => assert_eq!(
                out,
                vec![Output::BackwardDone {
                    context: c,
                    result: Ok(())
                }]
            ),
        }
        for s in [&a, &b, &c3] {
            assert!(s.has_context(c) && s.is_idle());
        }
    }
}

/// Empty roots, a root that does not require grad, a non-scalar root without a seed, a seed
/// of the wrong shape and a leaf root (it requires grad, but no operation computed it: no
/// gradient function) are refused before anything runs, in PyTorch's order, and change
/// nothing: the real backward afterwards runs (even without retain_graph). (A leaf root was
/// taken: its backward ran and freed the graph, so the real one was refused.)
#[test]
fn roots_are_checked_before_anything_runs() {
    let (mut a, _b, c, _, _) = chain();
    let vector = |seed: Option<Vec<usize>>| Root {
        shape: vec![3],
        requires_grad: true,
        has_grad_fn: true,
        seed,
    };
    let leaf = Root {
        has_grad_fn: false,
        ..Root::scalar()
    };
    for (roots, problem) in [
        (vec![], RootProblem::Empty),
        (
            vec![
                Root::scalar(),
                Root {
                    requires_grad: false,
                    ..Root::scalar()
                },
            ],
            RootProblem::NoGrad { index: 1 },
        ),
        (
            vec![vector(None)],
            RootProblem::NotScalar {
                index: 0,
                shape: vec![3],
            },
        ),
        (
            vec![vector(Some(vec![2]))],
            RootProblem::SeedShape {
                index: 0,
                root: vec![3],
                seed: vec![2],
            },
        ),
        (
            vec![Root::scalar(), leaf.clone()],
            RootProblem::NoGradFn { index: 1 },
        ),
        (
            // A leaf that is no scalar either: the shape is checked first.
            vec![Root {
                shape: vec![3],
                ..leaf.clone()
            }],
            RootProblem::NotScalar {
                index: 0,
                shape: vec![3],
            },
        ),
    ] {
        assert_eq!(
            a.backward(c, false, &roots),
            Err(AutogradError::InvalidRoots {
                context: c,
                problem
            })
        );
        assert!(drain(&mut a).is_empty() && a.is_idle());
    }
    // A scalar of shape [1, 1] and a seeded vector are fine.
    let ok = [
        Root {
            shape: vec![1, 1],
            ..Root::scalar()
        },
        vector(Some(vec![3])),
    ];
    a.backward(c, false, &ok).unwrap();
    assert!(matches!(
        drain(&mut a)[..],
        [Output::Prepare { .. }, Output::RunLocal { .. }]
    ));
}

#[test]
fn a_second_backward_while_one_runs_is_refused() {
    let (mut a, _b, c, _, _) = chain();
    a.backward(c, true, &[Root::scalar()]).unwrap();
    assert_eq!(
        a.backward(c, true, &[Root::scalar()]),
        Err(AutogradError::BackwardRunning(c))
    );
}

fn seeds() -> Vec<u64> {
    crate::sim::seeds(0..300)
}

#[test]
fn simulation_gradients_and_completion() {
    let mut cycles = 0;
    let mut grads = 0;
    let mut carried = 0;
    for seed in seeds() {
        let r = sim::run(
            seed,
            &SimConfig {
                workers: 2 + (seed % 4) as usize,
                contexts: 1 + (seed % 3) as usize,
                max_depth: 3,
                kill: false,
                idle_contexts: (seed % 2) as usize,
                faulty_engine: false,
            },
        );
        assert_eq!(r.failed, 0);
        cycles += r.cycles;
        grads += r.gradients;
        carried += r.carried;
    }
    if !crate::sim::replaying() {
        // The workload does produce cycles (A→B→C→A) and real traffic, and gradients that
        // ride in answers as well as gradients in requests of their own.
        assert!(
            cycles > 50 && grads > 1000 && carried > 100,
            "{cycles} cycles, {grads} gradients, {carried} in answers"
        );
    }
}

#[test]
fn simulation_with_a_worker_killed_mid_backward() {
    let (mut failed, mut idle_of_dead, mut late) = (0, 0, 0);
    for seed in seeds() {
        let r = sim::run(
            seed,
            &SimConfig {
                workers: 3 + (seed % 3) as usize,
                contexts: 1 + (seed % 3) as usize,
                max_depth: 3,
                kill: true,
                idle_contexts: 1 + (seed % 3) as usize,
                faulty_engine: false,
            },
        );
        failed += r.failed;
        idle_of_dead += r.idle_of_dead;
        late += r.late_gradients;
    }
    if !crate::sim::replaying() {
        assert!(failed > 20, "only {failed} backward passes failed");
        // Gradients did cross the drops of their contexts (each answered, none a violation).
        assert!(late > 0, "no gradient arrived late");
        // Dead workers did leave idle contexts behind, which no survivor kept (checked in
        // each run).
        assert!(
            idle_of_dead > 20,
            "only {idle_of_dead} idle contexts of dead workers"
        );
    }
}

/// One worker's engine fails every local run of each context's first backward (with and
/// without a death on top): each such backward fails naming that worker only once no work of
/// it is left, every worker keeps the context, and the same backward run again succeeds with
/// the exact gradients added to what the failed pass left (checked in each run).
#[test]
fn simulation_with_a_faulty_engine() {
    let (mut retried, mut failed) = (0, 0);
    for seed in seeds() {
        for kill in [false, true] {
            let r = sim::run(
                seed,
                &SimConfig {
                    workers: 2 + usize::from(kill) + (seed % 3) as usize,
                    contexts: 1 + (seed % 3) as usize,
                    max_depth: 3,
                    kill,
                    idle_contexts: (seed % 2) as usize,
                    faulty_engine: true,
                },
            );
            if !kill {
                assert_eq!(r.failed, 0, "seed {seed}");
            }
            retried += r.retried;
            failed += r.failed;
        }
    }
    if !crate::sim::replaying() {
        assert!(
            retried > 100,
            "only {retried} backward passes failed on the engine"
        );
        assert!(
            failed > 10,
            "only {failed} backward passes failed on a death"
        );
    }
}

/// A forward pass c -> b -> a with no backward: when c dies, every survivor drops the context,
/// each on its own notice (a never exchanged anything with c: the context's id names c as its
/// maker), and b's release to a finds nothing left. Nothing of c's is recorded afterwards, and
/// no tracked tensor goes to it, until a worker joins under its id again.
#[test]
fn a_lost_peer_drops_its_contexts_on_every_survivor_without_a_backward() {
    let mut a = DistAutograd::new(0);
    let mut b = DistAutograd::new(1);
    let mut c = DistAutograd::new(2);
    let ctx = c.new_context().unwrap();
    let m1 = c.record_send(ctx, 1, 1).unwrap();
    b.handle_recv(2, ctx, cap(ctx), m1).unwrap();
    let m2 = b.record_send(ctx, 0, 1).unwrap();
    a.handle_recv(1, ctx, cap(ctx), m2).unwrap();
    // A context of a's own that reached only b survives c's death.
    let mine = a.new_context().unwrap();
    let m3 = a.record_send(mine, 1, 1).unwrap();
    b.handle_recv(0, mine, cap(mine), m3).unwrap();
    assert_eq!(a.known_workers(ctx), Some(vec![1]));

    a.handle_peer_lost(2);
    assert_eq!(
        drain(&mut a),
        vec![
            Output::Release {
                to: 1,
                context: ctx,
                cause: Some(BackwardError::PeerLost {
                    worker: 2,
                    context: ctx
                })
            },
            Output::Dropped { context: ctx }
        ]
    );
    b.handle_peer_lost(2);
    b.handle_peer_lost(2);
    let out = drain(&mut b);
    assert!(out.contains(&Output::Dropped { context: ctx }), "{out:?}");
    assert!(
        !out.iter()
            .any(|o| matches!(o, Output::Release { to: 2, .. })),
        "{out:?}"
    );
    assert_eq!((a.context_count(), b.context_count()), (1, 1));
    assert!(a.has_context(mine) && b.has_context(mine));
    // b's release reaches a after a dropped the context on its own: nothing happens.
    a.handle_release(1, ctx, None).unwrap();
    assert!(drain(&mut a).is_empty());

    // A message from c that raced the news is refused, not recorded.
    let late = AutogradMessageId::new(2, 7);
    let theirs = ContextId::new(2, 1);
    assert_eq!(
        b.handle_recv(2, theirs, cap(theirs), late),
        Err(RecvError::PeerLost {
            from: 2,
            context: theirs
        })
    );
    assert_eq!(
        a.record_send(mine, 2, 1),
        Err(AutogradError::PeerLost {
            worker: 2,
            context: mine
        })
    );
    assert_eq!(b.context_count(), 1);
    // A context of a's own that reached c is dropped too; using it says why, until a lets go.
    let mut a2 = DistAutograd::new(0);
    let theirs2 = a2.new_context().unwrap();
    a2.record_send(theirs2, 2, 1).unwrap();
    a2.handle_peer_lost(2);
    drain(&mut a2);
    let cause = BackwardError::PeerLost {
        worker: 2,
        context: theirs2,
    };
    let dropped = AutogradError::Dropped {
        context: theirs2,
        cause: cause.clone(),
    };
    assert_eq!(
        a2.backward(theirs2, false, &[Root::scalar()]),
        Err(dropped.clone())
    );
    assert_eq!(a2.record_send(theirs2, 1, 1), Err(dropped.clone()));
    assert!(
        dropped.to_string().contains("worker 2 was lost"),
        "{dropped}"
    );
    assert_eq!(a2.dropped_cause(theirs2), Some(&cause));
    a2.forget(theirs2);
    assert_eq!(
        a2.backward(theirs2, false, &[Root::scalar()]),
        Err(AutogradError::UnknownContext(theirs2))
    );
    // A worker that joins under c's id is a new worker.
    b.handle_peer_joined(2);
    assert!(!b.is_lost(2));
    b.handle_recv(2, theirs, cap(theirs), late).unwrap();
    assert!(b.has_context(theirs));
}

/// A gradient request being served when its requester releases the context (or dies) is
/// answered with the error all the same: the driver stops serving it at once instead of
/// waiting for an answer that never comes.
#[test]
fn work_for_a_requester_that_releases_or_dies_is_answered_not_abandoned() {
    for lost in [false, true] {
        let (mut a, mut b, c, _m1, m2) = chain();
        b.handle_gradient(0, c, m2, 1, 9).unwrap();
        drain(&mut b);
        let error = if lost {
            b.handle_peer_lost(0);
            BackwardError::PeerLost {
                worker: 0,
                context: c,
            }
        } else {
            b.handle_release(0, c, None).unwrap();
            BackwardError::Released {
                worker: 0,
                context: c,
            }
        };
        let out = drain(&mut b);
        assert_eq!(
            out,
            vec![
                Output::Reply {
                    to: 0,
                    request: 9,
                    result: Err(error)
                },
                Output::Dropped { context: c }
            ],
            "lost: {lost}"
        );
        assert!(b.is_idle());
        let _ = a.release(c);
    }
}

#[test]
fn contexts_a_peer_can_make_this_worker_hold_are_bounded() {
    let mut a = DistAutograd::new(0);
    assert_eq!(a.contexts_per_peer(), DEFAULT_CONTEXTS_PER_PEER);
    a.set_contexts_per_peer(2);
    // Worker 2 makes worker 0 hold two contexts (one of worker 1's, forged or not, counts
    // toward the peer that sent it).
    let c1 = ContextId::new(2, 0);
    let c2 = ContextId::new(1, 5);
    a.handle_recv(2, c1, cap(c1), AutogradMessageId::new(2, 0))
        .unwrap();
    a.handle_recv(2, c2, cap(c2), AutogradMessageId::new(2, 1))
        .unwrap();
    assert_eq!(a.contexts_made_by(2), 2);
    // More messages in contexts already held are not counted.
    a.handle_recv(2, c1, cap(c1), AutogradMessageId::new(2, 2))
        .unwrap();
    // A third context is refused, naming the bound, and nothing is recorded.
    let c3 = ContextId::new(2, 1);
    let e = a
        .handle_recv(2, c3, cap(c3), AutogradMessageId::new(2, 3))
        .unwrap_err();
    assert_eq!(
        e,
        RecvError::TooManyContexts {
            from: 2,
            context: c3,
            limit: 2
        }
    );
    assert!(e.violation().is_none(), "a bound reached is no violation");
    assert!(e.to_string().contains("contexts_per_peer"), "{e}");
    assert!(e.to_string().contains("2 autograd contexts"), "{e}");
    assert!(!a.has_context(c3));
    assert_eq!(a.context_count(), 2);
    assert!(drain(&mut a).is_empty());
    // Another peer has a bound of its own.
    a.handle_recv(
        3,
        ContextId::new(3, 0),
        cap(ContextId::new(3, 0)),
        AutogradMessageId::new(3, 0),
    )
    .unwrap();
    // Worker 2 joining worker 0's own contexts is not bounded by it.
    let own = a.new_context().unwrap();
    a.handle_recv(2, own, cap(own), AutogradMessageId::new(2, 4))
        .unwrap();
    // A release frees a place: the refused context can be made now.
    a.handle_release(2, c1, None).unwrap();
    assert_eq!(a.contexts_made_by(2), 1);
    a.handle_recv(2, c3, cap(c3), AutogradMessageId::new(2, 5))
        .unwrap();
    assert_eq!(a.contexts_made_by(2), 2);
    // A loss frees them all (the counts go with the contexts).
    a.handle_peer_lost(2);
    assert_eq!(a.contexts_made_by(2), 0);
    assert_eq!(a.contexts_made_by(3), 1);
}

/// A worker that guesses a context's id (ids are the creator's next number) cannot join it
/// where it is held, on its creator or on a worker it reached: without the capability its
/// message is refused, it stays outside the context, and so its release of the context is
/// still a violation that changes nothing. (Before, a recv with the id alone joined the
/// context, and the joiner's release then dropped it on its members, down to its creator.)
/// The refusal drops nobody: the sender may be an honest worker passing on a forged context.
#[test]
fn a_guessed_context_id_without_its_capability_joins_nothing() {
    let (mut a, mut b, c, _, _) = chain();
    let guess = cap(c) ^ 1;
    for (w, at) in [(0, &mut a), (1, &mut b)] {
        let refused = at.handle_recv(2, c, guess, AutogradMessageId::new(2, 0));
        assert_eq!(
            refused,
            Err(RecvError::WrongCapability {
                from: 2,
                context: c
            }),
            "on {w}"
        );
        assert!(refused.unwrap_err().violation().is_none());
        assert!(!at.known_workers(c).unwrap().contains(&2), "on {w}");
        assert_eq!(
            at.handle_release(2, c, None),
            Err(ProtocolViolation::NotInContext {
                from: 2,
                context: c
            })
        );
        assert!(at.has_context(c), "on {w}");
        assert!(drain(at).is_empty(), "on {w}");
    }
    // With the capability (a worker the context was passed to) a message is recorded.
    b.handle_recv(2, c, cap(c), AutogradMessageId::new(2, 1))
        .unwrap();
    assert!(b.known_workers(c).unwrap().contains(&2));
}

/// A message in a context of this worker's that it never made is refused without a
/// violation: an honest worker called in a forged context passes the context on to whoever it
/// calls, and must not be dropped for it.
#[test]
fn a_context_of_ours_never_made_is_refused_without_blaming_the_sender() {
    let mut a = DistAutograd::new(0);
    let never = ContextId::new(0, 9);
    let refused = a.handle_recv(1, never, cap(never), AutogradMessageId::new(1, 0));
    assert_eq!(
        refused,
        Err(RecvError::NeverMade {
            from: 1,
            context: never
        })
    );
    assert!(refused.unwrap_err().violation().is_none());
    assert!(!a.has_context(never));
    assert!(drain(&mut a).is_empty());
}
/// A guess that reaches a worker before the context's first honest message there holds the
/// context there with its own capability. When the honest message comes from the creator
/// (the authority on its capability), the guesser's copy is discarded without telling its
/// members and the context is made again from the creator's message. When it comes from a
/// relay (a worker the creator passed the context to), the worker asks the creator, whose
/// answer discards the guesser's copy alike: the relay's message is recorded. (Before, the
/// relay's message was refused there.) Either way the guesser cannot release the honest
/// context anywhere else.
#[test]
fn a_guess_that_arrives_first_gives_way_to_the_creator_and_to_a_relay_it_vouches_for() {
    let mut a = DistAutograd::new(0);
    let mut b = DistAutograd::new(1);
    let c = a.new_context().unwrap();
    let honest = a.capability(c).unwrap();
    // Worker 2 guesses c and reaches b first; b's copy works for it (it sends there too).
    b.handle_recv(2, c, 7, AutogradMessageId::new(2, 0))
        .unwrap();
    b.record_send(c, 4, 1).unwrap();
    drain(&mut b);
    // A relay (worker 3, given c by a) is not refused: b cannot tell which copy is honest,
    // records nothing yet and asks the creator.
    let relayed = AutogradMessageId::new(3, 0);
    assert_eq!(b.handle_recv(3, c, honest, relayed), Ok(Recv::AskCreator));
    assert!(drain(&mut b).is_empty(), "asking changes nothing");
    assert_eq!(b.known_workers(c), Some(vec![2, 4]));
    // The creator vouches for the relay's capability, not for the guess.
    assert!(a.vouches(c, honest));
    assert!(!a.vouches(c, 7));
    // Its answer discards the guesser's copy, telling none of its members, and records the
    // relay's message in a copy made from it.
    assert_eq!(
        b.handle_vouch(3, c, honest, relayed, true),
        Ok(Recv::ReplacedForgery)
    );
    assert!(
        drain(&mut b).is_empty(),
        "nothing told, nothing freed after the new copy"
    );
    assert_eq!(b.known_workers(c), Some(vec![3]));
    assert_eq!(b.capability(c), Some(honest));
    // The guesser is nobody in c anywhere; its guess is now refused without asking.
    for (w, at) in [(0, &mut a), (1, &mut b)] {
        assert_eq!(
            at.handle_release(2, c, None),
            Err(ProtocolViolation::NotInContext {
                from: 2,
                context: c
            }),
            "on {w}"
        );
        assert!(at.has_context(c), "on {w}");
    }
    assert_eq!(
        b.handle_recv(2, c, 7, AutogradMessageId::new(2, 1)),
        Err(RecvError::WrongCapability {
            from: 2,
            context: c
        })
    );
    // The creator's own call joins the vouched copy; the creator contradicting it is refused.
    let m = a.record_send(c, 1, 1).unwrap();
    assert_eq!(b.handle_recv(0, c, honest, m), Ok(Recv::Recorded));
    assert_eq!(b.known_workers(c), Some(vec![0, 3]));
    assert_eq!(
        b.handle_recv(0, c, 9, AutogradMessageId::new(0, 99)),
        Err(RecvError::WrongCapability {
            from: 0,
            context: c
        })
    );
}

/// The other order: the relay's honest message made the copy, the guess comes second. Asked,
/// the creator does not vouch for the guess, which is refused (nobody dropped: its sender may
/// be an honest worker passing a forged context on); the honest copy and its records stay.
/// Once the creator has vouched for the copy, a later guess is refused without asking.
#[test]
fn a_guess_after_a_relay_is_refused_once_the_creator_disowns_it() {
    let mut a = DistAutograd::new(0);
    let mut b = DistAutograd::new(1);
    let c = a.new_context().unwrap();
    let honest = a.capability(c).unwrap();
    b.handle_recv(3, c, honest, AutogradMessageId::new(3, 0))
        .unwrap();
    let guess = AutogradMessageId::new(2, 0);
    assert_eq!(b.handle_recv(2, c, 7, guess), Ok(Recv::AskCreator));
    let refused = b.handle_vouch(2, c, 7, guess, a.vouches(c, 7));
    assert_eq!(
        refused,
        Err(RecvError::WrongCapability {
            from: 2,
            context: c
        })
    );
    assert!(refused.unwrap_err().violation().is_none());
    assert_eq!(b.known_workers(c), Some(vec![3]));
    assert_eq!(b.capability(c), Some(honest));
    assert!(drain(&mut b).is_empty());
    // Not vouched for, a message is never recorded in a copy made from it, even when the
    // copy it contradicted is gone by the time the answer comes.
    b.handle_release(3, c, None).unwrap();
    drain(&mut b);
    assert_eq!(
        b.handle_vouch(2, c, 7, AutogradMessageId::new(2, 1), false),
        Err(RecvError::WrongCapability {
            from: 2,
            context: c
        })
    );
    assert!(!b.has_context(c));
    // A copy the creator vouched for (here: its own message joined it) refuses without asking.
    b.handle_recv(3, c, honest, AutogradMessageId::new(3, 1))
        .unwrap();
    let m = a.record_send(c, 1, 1).unwrap();
    b.handle_recv(0, c, honest, m).unwrap();
    assert_eq!(
        b.handle_recv(2, c, 7, AutogradMessageId::new(2, 2)),
        Err(RecvError::WrongCapability {
            from: 2,
            context: c
        })
    );
    // The creator vouches only for its own contexts, made already.
    assert!(!b.vouches(c, honest), "b made no context of a's");
    assert!(!a.vouches(ContextId::new(0, 1), cap(ContextId::new(0, 1))));
}

/// a → b (m1, a request's arguments that landed on the host), b → a (m2, its result). The
/// backward from a sends m2's gradient to b, whose run reaches only m1's recv: its gradient
/// rides in the answer, and a runs m1's send function as part of its root's work. Two
/// messages instead of four, and the backward completes once that run is done.
#[test]
fn a_gradient_for_the_requester_rides_in_the_answer_and_the_work_completes_after_it() {
    let (mut a, mut b, c, m1, m2) = chain();
    b.recv_came_in_request(c, m1);
    a.backward(c, false, &[Root::scalar()]).unwrap();
    let t = task_of(&drain(&mut a));
    a.local_done(t, &[m2]);
    let [Output::SendGradient { gradient, .. }] = drain(&mut a)[..] else {
        panic!()
    };
    let tb = b.handle_gradient(0, c, m2, 1, 77).unwrap().unwrap();
    drain(&mut b);
    b.local_done(tb, &[m1]);
    assert_eq!(
        drain(&mut b),
        vec![Output::ReplyWithGradients {
            to: 0,
            request: 77,
            task: tb,
            context: c,
            messages: vec![m1],
        }]
    );
    // b's part is over: nothing of it waits for a.
    assert!(!b.is_busy(c) && b.is_idle());
    // A message a never sent to b, or one twice, is a violation that changes nothing.
    for bad in [vec![m2], vec![m1, m1], vec![AutogradMessageId::new(0, 99)]] {
        assert!(matches!(
            a.handle_gradient_reply_with(gradient, &bad),
            Err(ProtocolViolation::UnknownMessage { from: 1, .. })
        ));
        assert!(drain(&mut a).is_empty());
    }
    let [ta] = a.handle_gradient_reply_with(gradient, &[m1]).unwrap()[..] else {
        panic!()
    };
    assert_eq!(
        drain(&mut a),
        vec![Output::RunLocal {
            task: ta,
            context: c,
            entry: Entry::Send(m1)
        }]
    );
    // The root's work waits for the run the answer started.
    assert!(a.is_busy(c));
    a.local_done(ta, &[]);
    assert_eq!(
        drain(&mut a),
        vec![Output::BackwardDone {
            context: c,
            result: Ok(())
        }]
    );
    assert!(a.is_idle());
}

/// An answer's gradients go in requests of their own when the run also reached a recv of
/// another sender's, when a recv's tensors did not come in a request (or not to the host), or
/// with the setting off; and a run the answer started that fails fails the work that sent the
/// request, once it is over.
#[test]
fn gradients_ride_in_answers_only_when_all_go_to_the_requester_and_failures_still_count() {
    // Not marked as a request's: a request of its own, as before.
    let (mut a, mut b, c, m1, m2) = chain();
    a.backward(c, false, &[Root::scalar()]).unwrap();
    let t = task_of(&drain(&mut a));
    a.local_done(t, &[m2]);
    drain(&mut a);
    let tb = b.handle_gradient(0, c, m2, 1, 1).unwrap().unwrap();
    drain(&mut b);
    b.local_done(tb, &[m1]);
    assert!(matches!(drain(&mut b)[..], [Output::SendGradient { .. }]));
    // The setting off: the same.
    let (mut a, mut b, c, m1, m2) = chain();
    b.recv_came_in_request(c, m1);
    b.set_gradients_in_replies(false);
    a.backward(c, false, &[Root::scalar()]).unwrap();
    let t = task_of(&drain(&mut a));
    a.local_done(t, &[m2]);
    drain(&mut a);
    let tb = b.handle_gradient(0, c, m2, 1, 1).unwrap().unwrap();
    drain(&mut b);
    b.local_done(tb, &[m1]);
    assert!(matches!(drain(&mut b)[..], [Output::SendGradient { .. }]));
    // A run that reached a recv of a third worker's too: requests for all.
    let (mut a, mut b, c, m1, m2) = chain();
    b.recv_came_in_request(c, m1);
    let m3 = AutogradMessageId::new(2, 0);
    b.handle_recv(2, c, cap(c), m3).unwrap();
    b.recv_came_in_request(c, m3);
    a.backward(c, false, &[Root::scalar()]).unwrap();
    let t = task_of(&drain(&mut a));
    a.local_done(t, &[m2]);
    let [Output::SendGradient { gradient, .. }] = drain(&mut a)[..] else {
        panic!()
    };
    let tb = b.handle_gradient(0, c, m2, 1, 1).unwrap().unwrap();
    drain(&mut b);
    b.local_done(tb, &[m1, m3]);
    let out = drain(&mut b);
    assert_eq!(out.len(), 2, "{out:?}");
    assert!(out.iter().all(|o| matches!(o, Output::SendGradient { .. })));
    // The run an answer started fails: the root reports it once that run is over.
    let ta = a.handle_gradient_reply_with(gradient, &[m1]).unwrap()[0];
    drain(&mut a);
    a.local_failed(ta, "boom");
    let out = drain(&mut a);
    let [Output::BackwardDone {
        result: Err(BackwardError::Engine { worker: 0, .. }),
        ..
    }] = out[..]
    else {
        panic!("{out:?}")
    };
    // The context stays usable (an engine failure does not drop it).
    assert!(a.has_context(c) && a.is_idle());
}
