//! A hostile peer (`tensorwire_testkit::hostile`) joins a static group for real and sends its
//! victim, in the agent's own envelope, a message it has no right to send: the distributed
//! autograd messages (a gradient or a release for a context it has no part in, a forward call
//! under a message id not its own, a forward call in a context it guessed followed by a
//! release of it), or an answer to the victim's gradient request carrying gradients it was
//! not asked for (`forged_answer`: for a message the victim never sent it, repeated, more
//! than the message's tensors, of another shape), or a gradient request for the victim's
//! own message whose gradients do not match its tensors (`forged_request`: fewer, more, of
//! another shape). (The RPC protocol's own messages are `rpc/tests/hostile_peer.rs`'s.) Over
//! TCP, shared memory and QUIC, each test checks that:
//!
//! - the victim drops the hostile peer as misbehaved, naming the violation, and its calls to it
//!   fail naming the cause;
//! - honest autograd in the same run (a context of the honest worker's that the victim holds
//!   through the attack, and a fresh one) runs its backward pass with the right gradients, and
//!   honest calls succeed with correct values;
//! - what the victim holds (autograd contexts, owned references and forks, requests being
//!   served, calls in flight, bytes queued) returns to its level before the attack.
//!
//! Rank 0 is the victim, rank 1 honest, rank 2 hostile.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use tensorwire_autograd_candle::candle_core::{Device, Tensor as CTensor, Var};
use tensorwire_autograd_candle::CandleEngine;
use tensorwire_core::autograd::{
    AutogradMessageId, BackwardError, ContextId, ProtocolViolation as AutogradViolation,
};
use tensorwire_core::protocol::{
    CallError, Header, LostCause, ProtocolViolation, RRefId, WorkerId,
};
use tensorwire_core::tensor::Tensor;
use tensorwire_dist_autograd::{AutogradCall, DistAutograd};
use tensorwire_rpc::{Agent, Functions, RpcError, Shutdown};
use tensorwire_testkit::hostile::{dropped, hostile_group, HostileGroup};
use tensorwire_testkit::nets::{transports, Net};
use tensorwire_testkit::{base_options, wait_until};
use tokio::sync::Semaphore;

type Dist = DistAutograd<CandleEngine>;

const TEST_BOUND: Duration = Duration::from_secs(60);
const T: Duration = Duration::from_secs(60);
const VICTIM: u32 = 0;
const HOSTILE: u32 = 2;
/// Ids the hostile worker's own agent never reaches.
const FORGED_ID: u64 = 1 << 40;

async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: took longer than {TEST_BOUND:?}"))
}

/// `add(a, b)`; `gate()` answers 1 once the test opens the gate.
fn functions(gate: &Arc<Semaphore>) -> Functions {
    let f = Functions::new();
    f.register(
        "add",
        |(a, b): (i64, i64)| async move { Ok::<_, String>(a + b) },
    )
    .unwrap();
    let g = Arc::clone(gate);
    f.register("gate", move |(): ()| {
        let g = Arc::clone(&g);
        async move {
            let _open = g.acquire().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(1u64)
        }
    })
    .unwrap();
    f
}

/// Worker `rank`'s parameter (a leaf that records gradients).
fn param_values(rank: usize) -> Vec<f32> {
    let r = rank as f32 + 1.0;
    vec![0.3 * r, -0.4 + 0.1 * r, 0.7 / r]
}

fn param(rank: usize) -> CTensor {
    let t = CTensor::from_vec(param_values(rank), 3, &Device::Cpu).unwrap();
    Var::from_tensor(&t).unwrap().as_tensor().clone()
}

/// Distributed autograd on an honest worker, with `hop(x) = tanh(x * p)` for its parameter
/// `p`.
fn autograd(agent: &Agent, rank: usize) -> (Dist, CTensor) {
    let dist = Dist::new(agent, CandleEngine::new()).unwrap();
    let p = param(rank);
    let pp = p.clone();
    dist.register(
        "hop",
        move |_call: AutogradCall<CandleEngine>, (): (), ts: Vec<CTensor>| {
            let p = pp.clone();
            async move {
                let x = ts.first().ok_or("hop takes one tensor")?;
                let y = x
                    .mul(&p)
                    .and_then(|y| y.tanh())
                    .map_err(|e| e.to_string())?;
                Ok(((), vec![y]))
            }
        },
    )
    .unwrap();
    (dist, p)
}

/// The gradient of `sum(tanh(p * q)^2)` with respect to `p`, computed here.
fn expected_grad(p: &[f32], q: &[f32]) -> Vec<f32> {
    p.iter()
        .zip(q)
        .map(|(p, q)| {
            let t = (p * q).tanh();
            2.0 * t * (1.0 - t * t) * q
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-5, "{what}: got {got:?}, want {want:?}");
    }
}

/// A forward pass from `dist` to `to` in a new context: `hop(p)` on `to`, returned.
async fn forward(
    dist: &Dist,
    p: &CTensor,
    to: &str,
) -> (
    tensorwire_dist_autograd::AutogradContext<CandleEngine>,
    CTensor,
) {
    let ctx = dist.context().unwrap();
    let ((), out) = ctx
        .rpc_sync::<_, ()>(to, "hop", &(), std::slice::from_ref(p), None)
        .await
        .unwrap();
    (ctx, out.into_iter().next().expect("one tensor"))
}

/// The backward pass of `sum(out^2)` in `ctx`, and the gradient it left on `p` (the caller's
/// parameter), checked against the callee's parameter values `q`.
async fn backward_checked(
    ctx: &tensorwire_dist_autograd::AutogradContext<CandleEngine>,
    out: &CTensor,
    p: &CTensor,
    q: &[f32],
    what: &str,
) {
    let loss = out.sqr().unwrap().sum_all().unwrap();
    ctx.backward(&[(loss, None)], false).await.unwrap();
    let g = ctx
        .gradient(p)
        .expect("a gradient of the caller's parameter");
    let p_values = p.to_vec1::<f32>().unwrap();
    assert_close(
        &g.to_vec1::<f32>().unwrap(),
        &expected_grad(&p_values, q),
        what,
    );
}

/// After a forged message: the victim goes on. The context w1 held through it (`kept`, with its
/// output) runs its backward, the victim makes and runs a fresh context of its own, it holds no
/// context afterwards; then the hostile worker is let go and every agent shuts down.
async fn the_victim_goes_on(
    vdist: &Dist,
    (kept, kept_out): (
        tensorwire_dist_autograd::AutogradContext<CandleEngine>,
        CTensor,
    ),
    p0: &CTensor,
    p1: &CTensor,
    gate: &Semaphore,
    agents: Vec<Agent>,
) {
    backward_checked(&kept, &kept_out, p1, &param_values(0), "w1 through w0").await;
    kept.release().await.unwrap();
    let (again, again_out) = forward(vdist, p0, "w1").await;
    backward_checked(&again, &again_out, p0, &param_values(1), "w0 again").await;
    again.release().await.unwrap();
    wait_until("the victim holds no context", T, || {
        vdist.context_count() == 0
    })
    .await;
    gate.add_permits(64);
    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}

/// What the victim holds that a peer can make it hold.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    contexts: usize,
    owned: Vec<(RRefId, usize, u32, bool)>,
    forks: Vec<(RRefId, bool, u32)>,
    requests_being_served: Vec<(WorkerId, usize)>,
    calls_in_flight: Vec<(WorkerId, usize)>,
    queued_bytes: usize,
}

impl Held {
    fn of(agent: &Agent, dist: &Dist) -> Self {
        let p = agent.debug_info().protocol;
        Self {
            contexts: dist.context_count(),
            owned: p
                .owned
                .iter()
                .map(|o| (o.rref, o.forks, o.local_handles, o.being_created))
                .collect(),
            forks: p
                .forks
                .iter()
                .map(|f| (f.rref, f.confirmed, f.handles))
                .collect(),
            requests_being_served: p.requests_being_served.into_iter().collect(),
            calls_in_flight: p.calls_in_flight.into_iter().collect(),
            queued_bytes: agent.queued_bytes(),
        }
    }
}

/// The autograd layer's messages, as it encodes them (postcard, field by field).
#[derive(Serialize)]
struct GradientRequest {
    context: ContextId,
    message: AutogradMessageId,
    grads: Vec<Option<Tensor>>,
}

#[derive(Serialize)]
struct ReleaseRequest {
    context: ContextId,
    cause: Option<BackwardError>,
}

#[derive(Serialize)]
struct ForwardRequest {
    context: ContextId,
    capability: u128,
    message: Option<AutogradMessageId>,
    tensors: Vec<Tensor>,
    requires_grad: Vec<bool>,
    args: (),
}

/// The messages the hostile peer sends, one kind per run.
#[derive(Debug, Clone, Copy)]
enum Attack {
    /// A forward call whose requires-grad flags do not match its tensors.
    MismatchedFlags,
    /// A gradient for the message of a context it has no part in (the honest worker's,
    /// which the victim holds).
    GradientOutsideItsContext,
    /// A gradient for a context the victim never had.
    GradientForUnknownContext,
    /// A release of the honest worker's context, which it has no part in.
    ReleaseOfAnothersContext,
    /// A forward call in a context forged under the victim's id (refused, the sender stays:
    /// an honest worker may pass a forged context on), then one in the honest worker's context
    /// that the victim holds, with a guessed capability (refused alike, and it does not join
    /// it), then a release of that context (the violation: it is not in it). Before
    /// capabilities, the second joined the context and the release dropped it on the victim
    /// and on the honest worker.
    JoinAHeldContextThenReleaseIt,
    /// A forward call whose autograd message id carries another worker's id.
    MessageIdOfAnotherWorker,
}

/// The send of a message the victim refuses may itself fail: the victim can drop the
/// connection as soon as it has read it. Only what the victim does is checked.
fn violating(sent: Result<(), tensorwire_core::ports::transport::TransportError>) {
    if let Err(e) = sent {
        eprintln!("the violating send failed (the victim closed first): {e}");
    }
}

fn body<T: Serialize>(value: &T) -> Option<Bytes> {
    Some(Bytes::from(postcard::to_allocvec(value).unwrap()))
}

fn call(function: &str) -> Header {
    call_as(FORGED_ID, function)
}

fn call_as(id: u64, function: &str) -> Header {
    Header::Call {
        id,
        function: function.into(),
        timeout: T,
    }
}

/// The hostile worker's call `id` is answered with an error whose text contains `names`.
async fn refused(hostile: &tensorwire_testkit::hostile::HostilePeer, id: u64, names: &str) {
    let reply = hostile
        .heard(|h| matches!(h, Header::Reply { id: r, .. } if *r == id))
        .await;
    match reply {
        Header::Reply {
            outcome: Err(e), ..
        } => assert!(e.message.contains(names), "{names:?} not in: {}", e.message),
        other => panic!("call {id} was answered with {other:?}, not refused"),
    }
}

/// One run: the group, honest autograd and calls, the attack, and the checks.
async fn attack(net: Net, attack: Attack) {
    bounded(&format!("{attack:?} over {net:?}"), run(net, attack)).await;
}

async fn run(net: Net, attack: Attack) {
    let gate = Arc::new(Semaphore::new(0));
    let HostileGroup { agents, hostile } = hostile_group(3, transports(net), |_| {
        base_options().with_functions(functions(&gate))
    })
    .await
    .expect("the group starts");
    let (victim, honest, hostile_agent) = (&agents[0], &agents[1], &agents[2]);
    let (vdist, p0) = autograd(victim, 0);
    let (hdist, p1) = autograd(honest, 1);

    // Honest autograd: a context of w1's that the victim holds through the attack, and a
    // backward of the victim's own through w1.
    let (kept, kept_out) = forward(&hdist, &p1, "w0").await;
    let (own, own_out) = forward(&vdist, &p0, "w1").await;
    backward_checked(&own, &own_out, &p0, &param_values(1), "w0 through w1").await;
    own.release().await.unwrap();
    // The hostile worker's own agent calls the victim (ids of its own that the victim's
    // acknowledgements may name without breaking its protocol).
    for i in 0..3i64 {
        let sum: i64 = hostile_agent
            .rpc_sync("w0", "add", &(i, 1i64), None)
            .await
            .unwrap();
        assert_eq!(sum, i + 1);
    }
    let victim_ref = victim.clone();
    wait_until("the victim's write queues are empty", T, || {
        victim_ref.queued_bytes() == 0
    })
    .await;
    let before = Held::of(victim, &vdist);
    assert_eq!(before.contexts, 1, "the victim holds w1's context");
    let mut events = victim.peer_events();

    let to = VICTIM;
    let expected: Box<dyn Fn(&ProtocolViolation) -> bool> = match attack {
        Attack::GradientOutsideItsContext => {
            let req = GradientRequest {
                context: kept.id(),
                message: AutogradMessageId::new(VICTIM, 0),
                grads: vec![None],
            };
            violating(
                hostile
                    .send(to, &call("__tw_autograd/grad"), body(&req))
                    .await,
            );
            let context = kept.id();
            Box::new(move |v| {
                *v == ProtocolViolation::Autograd(AutogradViolation::NotInContext {
                    from: HOSTILE,
                    context,
                })
            })
        }
        Attack::GradientForUnknownContext => {
            let context = ContextId::new(1, 1 << 20);
            let req = GradientRequest {
                context,
                message: AutogradMessageId::new(VICTIM, 0),
                grads: vec![None],
            };
            violating(
                hostile
                    .send(to, &call("__tw_autograd/grad"), body(&req))
                    .await,
            );
            Box::new(move |v| {
                *v == ProtocolViolation::Autograd(AutogradViolation::UnknownContext {
                    from: HOSTILE,
                    context,
                })
            })
        }
        Attack::ReleaseOfAnothersContext => {
            let req = ReleaseRequest {
                context: kept.id(),
                cause: None,
            };
            violating(
                hostile
                    .send(to, &call("__tw_autograd/release"), body(&req))
                    .await,
            );
            let context = kept.id();
            Box::new(move |v| {
                *v == ProtocolViolation::Autograd(AutogradViolation::NotInContext {
                    from: HOSTILE,
                    context,
                })
            })
        }
        Attack::MismatchedFlags => {
            let context = ContextId::new(HOSTILE, 0);
            let message = AutogradMessageId::new(HOSTILE, 0);
            let req = ForwardRequest {
                context,
                capability: 0,
                message: Some(message),
                tensors: Vec::new(),
                requires_grad: vec![true],
                args: (),
            };
            violating(
                hostile
                    .send(to, &call("__tw_autograd/fn/hop"), body(&req))
                    .await,
            );
            Box::new(move |v| {
                *v == ProtocolViolation::Autograd(AutogradViolation::MismatchedFlags {
                    from: HOSTILE,
                    message,
                    tensors: 0,
                    flags: 1,
                })
            })
        }
        Attack::JoinAHeldContextThenReleaseIt => {
            let forged = |context, capability, message| ForwardRequest {
                context,
                capability,
                message: Some(message),
                tensors: Vec::new(),
                requires_grad: Vec::new(),
                args: (),
            };
            let hop = "__tw_autograd/fn/hop";
            // The answers to the forged calls are the test's, not the hostile agent's.
            hostile.swallow(|h| matches!(h, Header::Reply { id, .. } if *id >= FORGED_ID));
            // The honest worker's next context, claimed on the victim before it exists: the
            // victim holds a copy with the guess's capability until the creator's own call,
            // which replaces it; the honest pass in it is exact.
            let next = ContextId::new(1, kept.id().counter() + 1);
            let guess = forged(next, 5, AutogradMessageId::new(HOSTILE, (1 << 20) + 2));
            hostile
                .send(to, &call_as(FORGED_ID + 3, hop), body(&guess))
                .await
                .unwrap();
            hostile
                .heard(|h| matches!(h, Header::Reply { id, .. } if *id == FORGED_ID + 3))
                .await;
            let (honest_next, honest_out) = forward(&hdist, &p1, "w0").await;
            assert_eq!(
                honest_next.id(),
                next,
                "the guess was the honest worker's next id"
            );
            backward_checked(
                &honest_next,
                &honest_out,
                &p1,
                &param_values(0),
                "w1 through w0 after a guess",
            )
            .await;
            honest_next.release().await.unwrap();
            let never = forged(
                ContextId::new(VICTIM, 1 << 20),
                0,
                AutogradMessageId::new(HOSTILE, 1 << 20),
            );
            hostile
                .send(to, &call_as(FORGED_ID, hop), body(&never))
                .await
                .unwrap();
            refused(&hostile, FORGED_ID, "never made").await;
            let join = forged(kept.id(), 7, AutogradMessageId::new(HOSTILE, (1 << 20) + 1));
            hostile
                .send(to, &call_as(FORGED_ID + 1, hop), body(&join))
                .await
                .unwrap();
            refused(&hostile, FORGED_ID + 1, "capability").await;
            let req = ReleaseRequest {
                context: kept.id(),
                cause: None,
            };
            violating(
                hostile
                    .send(
                        to,
                        &call_as(FORGED_ID + 2, "__tw_autograd/release"),
                        body(&req),
                    )
                    .await,
            );
            let context = kept.id();
            Box::new(move |v| {
                *v == ProtocolViolation::Autograd(AutogradViolation::NotInContext {
                    from: HOSTILE,
                    context,
                })
            })
        }
        Attack::MessageIdOfAnotherWorker => {
            let context = ContextId::new(HOSTILE, 0);
            let message = AutogradMessageId::new(1, 7);
            let req = ForwardRequest {
                context,
                capability: 0,
                message: Some(message),
                tensors: Vec::new(),
                requires_grad: Vec::new(),
                args: (),
            };
            violating(
                hostile
                    .send(to, &call("__tw_autograd/fn/hop"), body(&req))
                    .await,
            );
            Box::new(move |v| {
                *v == ProtocolViolation::Autograd(AutogradViolation::BadMessageId {
                    from: HOSTILE,
                    context,
                    message,
                })
            })
        }
    };

    // The victim drops the hostile peer, naming the violation.
    let cause = dropped(&mut events, HOSTILE).await;
    match &cause {
        LostCause::Misbehaved(v) => assert!(expected(v), "dropped for another violation: {v}"),
        other => panic!("the hostile peer was lost for {other}, not as a violation"),
    }
    // Calls to it fail naming why.
    match victim
        .rpc_sync::<_, i64>("w2", "add", &(1i64, 1i64), None)
        .await
    {
        Err(RpcError::Call {
            source: CallError::PeerLost { peer, cause: c },
            ..
        }) => {
            assert_eq!(peer, HOSTILE);
            assert_eq!(c, cause);
        }
        other => panic!("a call to the dropped peer gave {other:?}"),
    }

    // Honest autograd and calls go on, with correct values: w1's context held through the
    // attack runs its backward, and a fresh context of the victim's does too.
    backward_checked(&kept, &kept_out, &p1, &param_values(0), "w1 through w0").await;
    let (again, again_out) = forward(&vdist, &p0, "w1").await;
    backward_checked(&again, &again_out, &p0, &param_values(1), "w0 again").await;
    again.release().await.unwrap();
    let sum: i64 = honest
        .rpc_sync("w0", "add", &(20i64, 22i64), None)
        .await
        .unwrap();
    assert_eq!(sum, 42);
    gate.add_permits(64);

    // Whatever the hostile peer made the victim hold is freed: back to the level before.
    let (victim_ref, vdist_ref) = (victim.clone(), vdist.clone());
    wait_until(
        "the victim's state is back to its level before the attack",
        T,
        || Held::of(&victim_ref, &vdist_ref) == before,
    )
    .await;
    assert_eq!(Held::of(victim, &vdist), before);
    assert!(vdist.violations() <= 1, "{}", vdist.violations());
    kept.release().await.unwrap();
    assert_eq!(vdist.context_count(), 0);

    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}

macro_rules! table {
    ($($name:ident => $attack:ident),* $(,)?) => {
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::attack(super::Net::Tcp, super::Attack::$attack).await;
                }
            )*
        }
        mod shm {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::attack(super::Net::Shm, super::Attack::$attack).await;
                }
            )*
        }
        mod quic {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::attack(super::Net::Quic, super::Attack::$attack).await;
                }
            )*
        }
    };
}

table! {
    a_gradient_in_a_context_it_has_no_part_in_drops_it => GradientOutsideItsContext,
    a_gradient_for_a_context_never_made_drops_it => GradientForUnknownContext,
    a_release_of_another_workers_context_drops_it => ReleaseOfAnothersContext,
    a_forward_in_a_guessed_context_joins_nothing_and_its_release_drops_it => JoinAHeldContextThenReleaseIt,
    an_autograd_message_id_of_another_worker_drops_it => MessageIdOfAnotherWorker,
    requires_grad_flags_that_do_not_match_the_tensors_drop_it => MismatchedFlags,
}

/// The relay-first race, constructed exactly: a hostile worker (rank 3) guesses the creator's
/// (w1's) next context id and reaches the victim (w0) with it before the context's first
/// honest message there, which a relay (w2, called by w1 in the context) brings. The victim
/// holds a copy with the guess's capability, so the relay's capability contradicts it; it
/// asks the creator, which vouches for the relay's: the guess's copy is discarded and the
/// honest pass through the relay runs with exact gradients. Nobody is dropped (a guess is
/// refused, not blamed: its sender may pass a forged context on). Before, the victim refused
/// the relay's message and the honest call failed.
async fn relay_first(net: Net) {
    bounded(&format!("relay first over {net:?}"), run_relay_first(net)).await;
}

async fn run_relay_first(net: Net) {
    const GUESSER: u32 = 3;
    let gate = Arc::new(Semaphore::new(0));
    let HostileGroup { agents, hostile } = hostile_group(4, transports(net), |_| {
        base_options().with_functions(functions(&gate))
    })
    .await
    .expect("the group starts");
    let (victim, creator, relay) = (&agents[0], &agents[1], &agents[2]);
    let (vdist, _p0) = autograd(victim, 0);
    let (cdist, p1) = autograd(creator, 1);
    let (rdist, _p2) = autograd(relay, 2);
    // `relay(x)` on w2 passes x on to w0's `hop` in the same context and returns its result.
    rdist
        .register(
            "relay",
            |call: AutogradCall<CandleEngine>, (): (), ts: Vec<CTensor>| async move {
                call.context()
                    .rpc_sync::<_, ()>("w0", "hop", &(), &ts, None)
                    .await
                    .map_err(|e| e.to_string())
            },
        )
        .unwrap();
    let mut events = victim.peer_events();

    // An honest pass first, so the creator's next id is known.
    let (first, first_out) = forward(&cdist, &p1, "w0").await;
    backward_checked(&first, &first_out, &p1, &param_values(0), "w1 through w0").await;
    let next = ContextId::new(1, first.id().counter() + 1);
    first.release().await.unwrap();
    let victim_ref = vdist.clone();
    wait_until("the victim holds no context", T, || {
        victim_ref.context_count() == 0
    })
    .await;

    // The guess reaches the victim first: it holds a copy of `next` for the guesser.
    hostile.swallow(|h| matches!(h, Header::Reply { id, .. } if *id >= FORGED_ID));
    let guess = ForwardRequest {
        context: next,
        capability: 5,
        message: Some(AutogradMessageId::new(GUESSER, 1 << 20)),
        tensors: Vec::new(),
        requires_grad: Vec::new(),
        args: (),
    };
    hostile
        .send(
            VICTIM,
            &call_as(FORGED_ID, "__tw_autograd/fn/hop"),
            body(&guess),
        )
        .await
        .unwrap();
    hostile
        .heard(|h| matches!(h, Header::Reply { id, .. } if *id == FORGED_ID))
        .await;
    assert_eq!(
        vdist.context_count(),
        1,
        "the guess made a copy on the victim"
    );

    // The creator's pass through the relay to the victim: its first honest message there is
    // the relay's.
    let ctx = cdist.context().unwrap();
    assert_eq!(ctx.id(), next, "the guess was the creator's next id");
    let ((), out) = ctx
        .rpc_sync::<_, ()>("w2", "relay", &(), std::slice::from_ref(&p1), None)
        .await
        .expect("the relay's message is recorded on the victim");
    let out = out.into_iter().next().expect("one tensor");
    backward_checked(&ctx, &out, &p1, &param_values(0), "w1 through w2 to w0").await;
    assert!(vdist.gradients(next).is_some(), "the victim took part");
    ctx.release().await.unwrap();

    // Nothing is left of the guess's copy, and nobody was dropped.
    let victim_ref = vdist.clone();
    wait_until("the victim holds no context", T, || {
        victim_ref.context_count() == 0
    })
    .await;
    assert_eq!(vdist.violations(), 0);
    let event = events.try_recv();
    assert!(event.is_none(), "the victim saw {event:?}");
    let sum: i64 = agents[3]
        .rpc_sync("w0", "add", &(20i64, 22i64), None)
        .await
        .unwrap();
    assert_eq!(sum, 42, "the guesser's worker was not dropped");
    gate.add_permits(64);
    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}

mod relay_first {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tcp_a_relay_after_a_guess_is_recorded_once_the_creator_vouches_for_it() {
        super::relay_first(super::Net::Tcp).await;
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shm_a_relay_after_a_guess_is_recorded_once_the_creator_vouches_for_it() {
        super::relay_first(super::Net::Shm).await;
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quic_a_relay_after_a_guess_is_recorded_once_the_creator_vouches_for_it() {
        super::relay_first(super::Net::Quic).await;
    }
}

/// The answer to a gradient request, as the autograd layer encodes it: `Ok` with the
/// gradients that ride in it. A tensor is written as its index among the tensors beside the
/// message (a `u32`), as the agent writes it.
#[derive(Serialize)]
struct CarriedGradient {
    message: AutogradMessageId,
    grads: Vec<Option<u32>>,
}

/// What the hostile peer answers the victim's gradient request with, in place of its own
/// agent's answer.
#[derive(Debug, Clone, Copy)]
enum Answer {
    /// What an honest worker answers: the gradient for the victim's message to it, of the
    /// right shape (the control: the forgery's encoding and the message id are right).
    Honest,
    /// A gradient for a message the victim never sent (to anyone).
    NeverSent,
    /// The gradient for the victim's message to it, twice.
    Repeated,
    /// A gradient for a message the victim sent to the honest worker, not to it.
    SentToAnother,
    /// Two gradients for the message's one tensor.
    TooMany,
    /// A gradient of shape `[2]` for the message's tensor, of shape `[3]`.
    WrongShape,
    /// A gradient of the message's tensor's shape but of f64, for a tensor of f32 (an honest
    /// engine computes a leaf's gradient in the leaf's type).
    WrongDtype,
}

/// The victim (w0) calls `hop` on w2 in a context and on w1 in the same context, and runs the
/// backward pass of `sum(out2^2) + sum(out1^2)`. Its gradient request to w2 never reaches
/// w2's agent: the hostile peer answers it with `answer`. The victim holds a context of w1's
/// through it. Checks that:
///
/// - an honest answer is taken: the victim's parameter gets the exact gradient;
/// - a forged one fails the backward pass with an error naming w2 and what it sent, and the
///   victim drops w2 as misbehaved, naming the violation (`UnknownMessage`,
///   `MismatchedGradients`); nothing hangs;
/// - the victim goes on: w1's context held through it runs its backward with the right
///   gradients, a fresh context of its own too, and it holds no context afterwards.
async fn forged_answer(net: Net, answer: Answer) {
    bounded(
        &format!("{answer:?} over {net:?}"),
        run_forged_answer(net, answer),
    )
    .await;
}

async fn run_forged_answer(net: Net, answer: Answer) {
    let gate = Arc::new(Semaphore::new(0));
    let HostileGroup { agents, hostile } = hostile_group(3, transports(net), |_| {
        base_options().with_functions(functions(&gate))
    })
    .await
    .expect("the group starts");
    let (victim, honest, hostile_agent) = (&agents[0], &agents[1], &agents[2]);
    let (vdist, p0) = autograd(victim, 0);
    let (hdist, p1) = autograd(honest, 1);
    let (_wdist, _p2) = autograd(hostile_agent, 2);
    let mut events = victim.peer_events();

    // The victim's first autograd messages: (0, 0) to w2, (0, 1) to w1.
    let ctx = vdist.context().unwrap();
    let ((), out2) = ctx
        .rpc_sync::<_, ()>("w2", "hop", &(), std::slice::from_ref(&p0), None)
        .await
        .unwrap();
    let ((), out1) = ctx
        .rpc_sync::<_, ()>("w1", "hop", &(), std::slice::from_ref(&p0), None)
        .await
        .unwrap();
    let (out2, out1) = (&out2[0], &out1[0]);
    let to_w2 = AutogradMessageId::new(VICTIM, 0);
    let to_w1 = AutogradMessageId::new(VICTIM, 1);
    let (kept, kept_out) = forward(&hdist, &p1, "w0").await;

    // The victim's gradient request to w2 is the test's to answer.
    hostile.swallow(
        |h| matches!(h, Header::Call { function, .. } if function == "__tw_autograd/grad"),
    );
    let loss = out2
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&out1.sqr().unwrap().sum_all().unwrap())
        .unwrap();
    let roots = [(loss, None)];
    let forge =
        async {
            let id = match hostile
        .heard(|h| matches!(h, Header::Call { function, .. } if function == "__tw_autograd/grad"))
        .await
    {
        Header::Call { id, .. } => id,
        other => panic!("{other:?}"),
    };
            let right = Tensor::from_f32(vec![3], &[0.5, -1.0, 2.0]).unwrap();
            let (carried, tensors) = match answer {
                Answer::Honest => (
                    vec![CarriedGradient {
                        message: to_w2,
                        grads: vec![Some(0)],
                    }],
                    vec![right],
                ),
                Answer::NeverSent => (
                    vec![CarriedGradient {
                        message: AutogradMessageId::new(VICTIM, 1 << 20),
                        grads: vec![None],
                    }],
                    Vec::new(),
                ),
                Answer::Repeated => (
                    vec![
                        CarriedGradient {
                            message: to_w2,
                            grads: vec![Some(0)],
                        },
                        CarriedGradient {
                            message: to_w2,
                            grads: vec![Some(1)],
                        },
                    ],
                    vec![right.clone(), right],
                ),
                Answer::SentToAnother => (
                    vec![CarriedGradient {
                        message: to_w1,
                        grads: vec![Some(0)],
                    }],
                    vec![right],
                ),
                Answer::TooMany => (
                    vec![CarriedGradient {
                        message: to_w2,
                        grads: vec![Some(0), None],
                    }],
                    vec![right],
                ),
                Answer::WrongShape => (
                    vec![CarriedGradient {
                        message: to_w2,
                        grads: vec![Some(0)],
                    }],
                    vec![Tensor::from_f32(vec![2], &[1.0, 1.0]).unwrap()],
                ),
                Answer::WrongDtype => (
                    vec![CarriedGradient {
                        message: to_w2,
                        grads: vec![Some(0)],
                    }],
                    vec![Tensor::from_f64(vec![3], &[0.5, -1.0, 2.0]).unwrap()],
                ),
            };
            let reply = Header::Reply {
                id,
                outcome: Ok(()),
                forks: Vec::new(),
            };
            let answer_body: Result<Vec<CarriedGradient>, BackwardError> = Ok(carried);
            violating(
                hostile
                    .send_with_tensors(VICTIM, &reply, body(&answer_body).unwrap(), &tensors)
                    .await,
            );
        };
    let (result, ()) = tokio::join!(ctx.backward(&roots, false), forge);

    let context = ctx.id();
    let expected: Option<AutogradViolation> = match answer {
        Answer::Honest => None,
        Answer::NeverSent => Some(AutogradViolation::UnknownMessage {
            from: HOSTILE,
            context,
            message: AutogradMessageId::new(VICTIM, 1 << 20),
        }),
        Answer::Repeated => Some(AutogradViolation::UnknownMessage {
            from: HOSTILE,
            context,
            message: to_w2,
        }),
        Answer::SentToAnother => Some(AutogradViolation::UnknownMessage {
            from: HOSTILE,
            context,
            message: to_w1,
        }),
        Answer::TooMany => Some(AutogradViolation::MismatchedGradients {
            from: HOSTILE,
            context,
            message: to_w2,
            detail: "2 gradients for 1 tensors".into(),
        }),
        Answer::WrongShape => Some(AutogradViolation::MismatchedGradients {
            from: HOSTILE,
            context,
            message: to_w2,
            detail: "a gradient of shape [2] for tensor 0, of shape [3]".into(),
        }),
        Answer::WrongDtype => Some(AutogradViolation::MismatchedGradients {
            from: HOSTILE,
            context,
            message: to_w2,
            detail: "a gradient of F64 for tensor 0, of F32".into(),
        }),
    };
    match expected {
        None => {
            result.expect("the honest answer is taken");
            // d/dp0 of sum(tanh(p0 q1)^2) from w1, plus the seed the answer carried for p0.
            let g = ctx.gradient(&p0).expect("a gradient of p0");
            let from_w1 = expected_grad(&param_values(0), &param_values(1));
            let want: Vec<f32> = from_w1
                .iter()
                .zip([0.5, -1.0, 2.0])
                .map(|(a, b)| a + b)
                .collect();
            assert_close(&g.to_vec1::<f32>().unwrap(), &want, "the honest answer");
            assert!(events.try_recv().is_none(), "nobody was dropped");
        }
        Some(v) => {
            let e = result.expect_err("a forged answer fails the backward pass");
            let text = e.to_string();
            // The pass fails either with the refused answer (which names the violation) or,
            // when dropping w2 reaches the context first, as lost with w2: both name w2.
            assert!(
                text.contains("w2 (rank 2)")
                    && (text.contains(&v.to_string()) || text.contains("worker 2 was lost")),
                "the error names w2 and what became of it: {text}"
            );
            match dropped(&mut events, HOSTILE).await {
                LostCause::Misbehaved(got) => {
                    assert_eq!(*got, ProtocolViolation::Autograd(v), "the violation")
                }
                other => panic!("w2 was lost for {other}, not as a violation"),
            }
            assert_eq!(vdist.violations(), 1);
        }
    }
    ctx.release().await.unwrap();

    the_victim_goes_on(&vdist, (kept, kept_out), &p0, &p1, &gate, agents).await;
}

/// One test per case and transport: `forged!(module, runner, Case; test => variant, ...)` makes
/// `module::{tcp,shm,quic}::test`, each running `runner(Net::.., Case::variant)`.
macro_rules! forged {
    ($module:ident, $run:ident, $case:ident; $($name:ident => $variant:ident),* $(,)?) => {
        mod $module {
            mod tcp {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        super::super::$run(super::super::Net::Tcp, super::super::$case::$variant).await;
                    }
                )*
            }
            mod shm {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        super::super::$run(super::super::Net::Shm, super::super::$case::$variant).await;
                    }
                )*
            }
            mod quic {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        super::super::$run(super::super::Net::Quic, super::super::$case::$variant).await;
                    }
                )*
            }
        }
    };
}

forged! {
    forged_answer, forged_answer, Answer;
    an_honest_answer_is_taken => Honest,
    gradients_for_a_message_never_sent_drop_it => NeverSent,
    a_gradient_repeated_in_one_answer_drops_it => Repeated,
    gradients_for_a_message_sent_to_another_worker_drop_it => SentToAnother,
    more_gradients_than_tensors_drop_it => TooMany,
    a_gradient_of_another_shape_drops_it => WrongShape,
    a_gradient_of_another_dtype_drops_it => WrongDtype,
}

/// A gradient request as the hostile peer forges it: the autograd layer's encoding, with each
/// gradient written as its index among the tensors beside the message (a `u32`).
#[derive(Serialize)]
struct ForgedGradientRequest {
    context: ContextId,
    message: AutogradMessageId,
    grads: Vec<Option<u32>>,
}

/// The gradient request the hostile peer sends the victim for the victim's own message to
/// it (one tensor of shape `[3]`: the victim's parameter).
#[derive(Debug, Clone, Copy)]
enum Request {
    /// What an honest worker sends: one gradient of the tensor's shape (the control: the
    /// forgery's encoding and the message id are right).
    Honest,
    /// No gradient for the message's one tensor.
    TooFew,
    /// Two gradients for the message's one tensor.
    TooMany,
    /// A gradient of shape `[2]` for the message's tensor, of shape `[3]`.
    WrongShape,
    /// A gradient of the tensor's shape but of f64, for the message's tensor of f32.
    WrongDtype,
}

/// The victim (w0) calls `hop` on w2 in a context, with its parameter, and holds a context of
/// w1's. The hostile peer (w2) sends the victim a gradient request for the victim's message
/// to it, with the gradients `request` says. Checks that:
///
/// - an honest request runs the victim's send function: its parameter gets the gradient sent,
///   exactly, and the request is answered;
/// - a forged one (another count, shape or dtype) is refused as w2's violation, naming it
///   (`MismatchedGradients`): the victim drops w2, nothing runs, no gradient lands; nothing
///   hangs or panics;
/// - the victim goes on: w1's context held through it runs its backward with the right
///   gradients, a fresh context of its own too, and it holds no context afterwards.
async fn forged_request(net: Net, request: Request) {
    bounded(
        &format!("{request:?} over {net:?}"),
        run_forged_request(net, request),
    )
    .await;
}

async fn run_forged_request(net: Net, request: Request) {
    let gate = Arc::new(Semaphore::new(0));
    let HostileGroup { agents, hostile } = hostile_group(3, transports(net), |_| {
        base_options().with_functions(functions(&gate))
    })
    .await
    .expect("the group starts");
    let (victim, honest, hostile_agent) = (&agents[0], &agents[1], &agents[2]);
    let (vdist, p0) = autograd(victim, 0);
    let (hdist, p1) = autograd(honest, 1);
    let (_wdist, _p2) = autograd(hostile_agent, 2);
    let mut events = victim.peer_events();

    // The victim's first autograd message, (0, 0), carries p0 to w2.
    let ctx = vdist.context().unwrap();
    ctx.rpc_sync::<_, ()>("w2", "hop", &(), std::slice::from_ref(&p0), None)
        .await
        .unwrap();
    let to_w2 = AutogradMessageId::new(VICTIM, 0);
    let (kept, kept_out) = forward(&hdist, &p1, "w0").await;

    let seed = [0.5f32, -1.0, 2.0];
    let right = Tensor::from_f32(vec![3], &seed).unwrap();
    let (grads, tensors) = match request {
        Request::Honest => (vec![Some(0)], vec![right]),
        Request::TooFew => (Vec::new(), Vec::new()),
        Request::TooMany => (vec![Some(0), None], vec![right]),
        Request::WrongShape => (
            vec![Some(0)],
            vec![Tensor::from_f32(vec![2], &[1.0, 1.0]).unwrap()],
        ),
        Request::WrongDtype => (
            vec![Some(0)],
            vec![Tensor::from_f64(vec![3], &[0.5, -1.0, 2.0]).unwrap()],
        ),
    };
    let forged = ForgedGradientRequest {
        context: ctx.id(),
        message: to_w2,
        grads,
    };
    // The answer is the test's, not the hostile agent's.
    hostile.swallow(|h| matches!(h, Header::Reply { id, .. } if *id >= FORGED_ID));
    violating(
        hostile
            .send_with_tensors(
                VICTIM,
                &call("__tw_autograd/grad"),
                body(&forged).unwrap(),
                &tensors,
            )
            .await,
    );

    let context = ctx.id();
    let mismatched = |detail: &str| AutogradViolation::MismatchedGradients {
        from: HOSTILE,
        context,
        message: to_w2,
        detail: detail.into(),
    };
    let expected = match request {
        Request::Honest => None,
        Request::TooFew => Some(mismatched("0 gradients for 1 tensors")),
        Request::TooMany => Some(mismatched("2 gradients for 1 tensors")),
        Request::WrongShape => Some(mismatched(
            "a gradient of shape [2] for tensor 0, of shape [3]",
        )),
        Request::WrongDtype => Some(mismatched("a gradient of F64 for tensor 0, of F32")),
    };
    match expected {
        None => {
            match hostile
                .heard(|h| matches!(h, Header::Reply { id, .. } if *id == FORGED_ID))
                .await
            {
                Header::Reply { outcome, .. } => outcome.expect("the honest request is answered"),
                other => panic!("{other:?}"),
            }
            // The send function of p0 ran from the gradient sent: d/dp0 of sum(p0 * seed).
            let g = ctx.gradient(&p0).expect("a gradient of p0");
            assert_close(&g.to_vec1::<f32>().unwrap(), &seed, "the honest request");
            assert!(events.try_recv().is_none(), "nobody was dropped");
            assert_eq!(vdist.violations(), 0);
        }
        Some(v) => {
            match dropped(&mut events, HOSTILE).await {
                LostCause::Misbehaved(got) => {
                    assert_eq!(*got, ProtocolViolation::Autograd(v), "the violation")
                }
                other => panic!("w2 was lost for {other}, not as a violation"),
            }
            assert_eq!(vdist.violations(), 1);
            assert!(
                ctx.gradient(&p0).is_none(),
                "no gradient landed from the forged request"
            );
        }
    }
    ctx.release().await.unwrap();

    the_victim_goes_on(&vdist, (kept, kept_out), &p0, &p1, &gate, agents).await;
}

forged! {
    forged_request, forged_request, Request;
    an_honest_request_runs_the_send_function => Honest,
    fewer_gradients_than_tensors_drop_it => TooFew,
    more_gradients_than_tensors_drop_it => TooMany,
    a_gradient_of_another_shape_drops_it => WrongShape,
    a_gradient_of_another_dtype_drops_it => WrongDtype,
}
