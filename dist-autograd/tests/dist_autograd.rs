//! Distributed autograd across agents of one process (the in-memory transport and store), with
//! the candle engine: gradients equal the same computation in one engine, for a chain, a
//! diamond, a nested chain that comes back (A→B→C→A), RRef method calls and a tensor used
//! twice; concurrent contexts; violations; release; a worker lost with contexts open;
//! gradients sent back by the reverse of the forward's device maps (simulated
//! devices); a backward pass begun on the caller's thread with an executor for the others. All in virtual time (tokio's paused clock): the engine runs on blocking threads,
//! which hold the clock while they compute.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_autograd_candle::candle_core::{Device, Tensor as CTensor, Var};
use tensorwire_autograd_candle::CandleEngine;
use tensorwire_core::autograd::optim::{
    Adagrad, Adam, AdamW, Optimizer, OptimizerState, RmsProp, Sgd,
};
use tensorwire_core::autograd::{AutogradError, RootProblem};
use tensorwire_dist_autograd::{
    AutogradCall, DistAutograd, DistAutogradError, DistributedOptimizer, LocalOptimizer, Parameter,
    TensorList,
};
use tensorwire_rpc::{Agent, RRef, RpcOptions};
use tensorwire_testkit::{MemoryCluster, RecordingDevices};
use tensorwire_transport_memory::MemoryTransport;

type Dist = DistAutograd<CandleEngine>;

fn param_values(rank: usize) -> Vec<f32> {
    let r = rank as f32 + 1.0;
    vec![0.1 * r, -0.2 + 0.05 * r, 0.3 / r]
}

fn param(rank: usize) -> CTensor {
    let t = CTensor::from_vec(param_values(rank), 3, &Device::Cpu).unwrap();
    Var::from_tensor(&t).unwrap().as_tensor().clone()
}

/// One hop of the model: tanh(h * p + p).
fn hop(h: &CTensor, p: &CTensor) -> CTensor {
    h.mul(p).unwrap().add(p).unwrap().tanh().unwrap()
}

/// Parameters kept in a remote reference on their owner.
struct Layer {
    weight: CTensor,
}

impl serde::Serialize for Layer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        values(&self.weight).serialize(s)
    }
}

struct Worker {
    agent: Agent,
    dist: Dist,
    param: CTensor,
    /// This worker's host on the in-memory network: its kill switch.
    host: MemoryTransport,
}

async fn cluster(n: usize) -> Vec<Worker> {
    cluster_with(n, |_, _| {}).await
}

/// `n` workers over one in-memory network and store; `tweak` adjusts each rank's options.
async fn cluster_with(n: usize, tweak: impl Fn(usize, &mut RpcOptions)) -> Vec<Worker> {
    let cluster = MemoryCluster::new();
    let agents = cluster.group(n, tweak).await.unwrap();
    let mut workers = Vec::new();
    for (rank, agent) in agents.into_iter().enumerate() {
        let host = cluster.host(rank).expect("started");
        let dist = Dist::new(&agent, CandleEngine::new()).unwrap();
        let p = param(rank);
        // hop(route): tanh(h * p + p) here, then on along `route`, doubled on the way back.
        let pp = p.clone();
        dist.register(
            "hop",
            move |call: AutogradCall<CandleEngine>, route: Vec<String>, ts: Vec<CTensor>| {
                let p = pp.clone();
                async move {
                    let mut z = hop(&ts[0], &p);
                    if let Some((next, rest)) = route.split_first() {
                        let ((), out) = call
                            .context()
                            .rpc_sync(next, "hop", &rest.to_vec(), &[z], None)
                            .await
                            .map_err(|e| e.to_string())?;
                        z = out[0].clone();
                    }
                    Ok(((), vec![(z * 2.0).unwrap()]))
                }
            },
        )
        .unwrap();
        dist.register_method(
            "forward",
            |_call: AutogradCall<CandleEngine>, layer: Arc<Layer>, (): (), ts: Vec<CTensor>| async move {
                Ok(((), vec![hop(&ts[0], &layer.weight)]))
            },
        ).unwrap();
        // A parameter server's parameter, with the values of this rank's, and its forward.
        agent
            .functions()
            .register("make_parameter", move |(): ()| async move {
                Ok::<_, String>(Parameter::new(&CandleEngine::new(), param(rank)))
            })
            .unwrap();
        dist.register_method(
            "param_forward",
            |_call: AutogradCall<CandleEngine>,
             p: Arc<Parameter<CandleEngine>>,
             (): (),
             ts: Vec<CTensor>| async move { Ok(((), vec![hop(&ts[0], p.tensor())])) },
        )
        .unwrap();
        agent
            .functions()
            .register_method(
                "param_values",
                |p: Arc<Parameter<CandleEngine>>, (): ()| async move {
                    Ok::<_, String>(values(p.tensor()))
                },
            )
            .unwrap();
        // A value made by `remote` in a context: it keeps a tensor computed from the caller's.
        let pp = p.clone();
        dist.register_remote(
            "make_hidden",
            move |_call: AutogradCall<CandleEngine>, (): (), ts: Vec<CTensor>| {
                let p = pp.clone();
                async move {
                    Ok(Layer {
                        weight: hop(&ts[0], &p),
                    })
                }
            },
        )
        .unwrap();
        // The first stage of PyTorch's usual model: its input needs no grad (it comes in the
        // arguments, no tracked tensor), its result does; then on along `route`.
        let pp = p.clone();
        dist.register(
            "stage",
            move |call: AutogradCall<CandleEngine>,
                  (x, route): (Vec<f32>, Vec<String>),
                  ts: Vec<CTensor>| {
                let p = pp.clone();
                async move {
                    assert!(ts.is_empty(), "no tracked tensor comes in");
                    let x = CTensor::from_vec(x, 3, &Device::Cpu).unwrap();
                    let mut z = hop(&x, &p);
                    if let Some((next, rest)) = route.split_first() {
                        let ((), out) = call
                            .context()
                            .rpc_sync(next, "hop", &rest.to_vec(), &[z], None)
                            .await
                            .map_err(|e| e.to_string())?;
                        z = out[0].clone();
                    }
                    Ok(((), vec![(z * 2.0).unwrap()]))
                }
            },
        )
        .unwrap();
        // Tensors kept on their owner, computed from the caller's: `rpc.remote(owner, f, ...)`.
        let pp = p.clone();
        dist.register_remote(
            "make_list",
            move |_call: AutogradCall<CandleEngine>, (): (), ts: Vec<CTensor>| {
                let p = pp.clone();
                async move { Ok(TensorList::new(&CandleEngine::new(), vec![hop(&ts[0], &p)])) }
            },
        )
        .unwrap();
        let pp = p.clone();
        agent
            .functions()
            .register("make_layer", move |(): ()| {
                let weight = pp.clone();
                async move { Ok::<_, String>(Layer { weight }) }
            })
            .unwrap();
        workers.push(Worker {
            agent,
            dist,
            param: p,
            host,
        });
    }
    // Every worker has set up distributed autograd before anyone sends in a context.
    let barriers: Vec<_> = workers
        .iter()
        .map(|w| {
            let a = w.agent.clone();
            tokio::spawn(async move { a.barrier("autograd-setup", Duration::from_secs(20)).await })
        })
        .collect();
    for b in barriers {
        b.await.unwrap().unwrap();
    }
    workers
}

async fn shutdown(workers: Vec<Worker>) {
    let mut tasks = Vec::new();
    for w in workers {
        tasks.push(tokio::spawn(async move {
            w.agent
                .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(20)))
                .await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

fn input() -> CTensor {
    CTensor::new(&[0.5f32, -1.0, 2.0], &Device::Cpu).unwrap()
}

fn values(t: &CTensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1e-3),
            "{what}: got {got:?}, want {want:?}"
        );
    }
}

/// The gradient of worker `rank`'s parameter in `ctx`, from that worker.
fn grad_on(workers: &[Worker], rank: usize, ctx: tensorwire_core::autograd::ContextId) -> Vec<f32> {
    let w = &workers[rank];
    let grads = w.dist.gradients(ctx).expect("the context is there");
    values(
        grads
            .get(&w.param.id())
            .expect("a gradient of the parameter"),
    )
}

/// The loss: sum of squares of what came back.
fn loss(t: &CTensor) -> CTensor {
    t.sqr().unwrap().sum_all().unwrap()
}

/// The same computation in one engine, with fresh parameters of the same values: the loss of a
/// route from worker 0 (`route[0]` first), and the gradient of every rank's parameter.
fn local_route(route: &[usize], n: usize) -> Vec<Option<Vec<f32>>> {
    let params: Vec<CTensor> = (0..n).map(param).collect();
    fn go(h: CTensor, route: &[usize], params: &[CTensor]) -> CTensor {
        let Some((first, rest)) = route.split_first() else {
            return h;
        };
        let z = hop(&h, &params[*first]);
        let z = go(z, rest, params);
        (z * 2.0).unwrap()
    }
    let x = hop(&input(), &params[0]);
    let out = go(x, route, &params);
    let grads = loss(&out).backward().unwrap();
    params.iter().map(|p| grads.get(p).map(values)).collect()
}

async fn route_case(workers: &[Worker], route: &[usize]) {
    let n = workers.len();
    let w0 = &workers[0];
    let ctx = w0.dist.context().unwrap();
    let x = hop(&input(), &w0.param);
    let names: Vec<String> = route.iter().map(|r| format!("w{r}")).collect();
    let ((), out) = ctx
        .rpc_sync(&names[0], "hop", &names[1..].to_vec(), &[x], None)
        .await
        .unwrap();
    ctx.backward(&[(loss(&out[0]), None)], false).await.unwrap();
    let want = local_route(route, n);
    for (rank, want) in want.iter().enumerate() {
        if let Some(want) = want {
            assert_close(
                &grad_on(workers, rank, ctx.id()),
                want,
                &format!("rank {rank}, route {route:?}"),
            );
        }
    }
    let id = ctx.id();
    ctx.release().await.unwrap();
    for w in workers {
        assert_eq!(
            w.dist.context_count(),
            0,
            "{id} left on {}",
            w.agent.worker_info().name
        );
    }
}

#[tokio::test(start_paused = true)]
async fn chains_and_a_nested_chain_that_comes_back_match_one_process() {
    let workers = cluster(3).await;
    // A chain w0 -> w1, a longer one w0 -> w1 -> w2, and w0 -> w1 -> w2 -> w0 (A→B→C→A).
    route_case(&workers, &[1]).await;
    route_case(&workers, &[1, 2]).await;
    route_case(&workers, &[1, 2, 0]).await;
    route_case(&workers, &[2, 0, 1, 0]).await;
    shutdown(workers).await;
}

#[tokio::test(start_paused = true)]
async fn a_diamond_a_tensor_used_twice_rref_methods_and_remote_match_one_process() {
    let workers = cluster(3).await;
    let w0 = &workers[0];
    // Diamond: x goes to w1 and w2 at once (the same tensor, sent twice), both results feed the
    // loss, and w1's result is used twice.
    let ctx = w0.dist.context().unwrap();
    let x = hop(&input(), &w0.param);
    let none: Vec<String> = Vec::new();
    let b = ctx
        .rpc_async::<_, ()>("w1", "hop", &none, std::slice::from_ref(&x), None)
        .unwrap();
    let c = ctx
        .rpc_async::<_, ()>("w2", "hop", &none, std::slice::from_ref(&x), None)
        .unwrap();
    let ((), b) = b.await.unwrap();
    let ((), c) = c.await.unwrap();
    let y = b[0].mul(&c[0]).unwrap().add(&b[0]).unwrap();
    ctx.backward(&[(loss(&y), None)], false).await.unwrap();
    {
        let p: Vec<CTensor> = (0..3).map(param).collect();
        let x = hop(&input(), &p[0]);
        let b = (hop(&x, &p[1]) * 2.0).unwrap();
        let c = (hop(&x, &p[2]) * 2.0).unwrap();
        let y = b.mul(&c).unwrap().add(&b).unwrap();
        let g = loss(&y).backward().unwrap();
        for (r, pr) in p.iter().enumerate() {
            assert_close(
                &grad_on(&workers, r, ctx.id()),
                &values(g.get(pr).unwrap()),
                &format!("diamond rank {r}"),
            );
        }
    }
    ctx.release().await.unwrap();

    // RRef method calls: the layer lives on w1, held in a remote reference.
    let layer: RRef<Layer> = w0.agent.remote("w1", "make_layer", &(), None).unwrap();
    let ctx = w0.dist.context().unwrap();
    let x = hop(&input(), &w0.param);
    let ((), out) = ctx
        .rref_rpc_sync(&layer, "forward", &(), &[x], None)
        .await
        .unwrap();
    // Called twice on its output: the layer's parameter is used twice.
    let ((), out2) = ctx
        .rref_rpc_sync(&layer, "forward", &(), &[out[0].clone()], None)
        .await
        .unwrap();
    ctx.backward(&[(loss(&out2[0]), None)], false)
        .await
        .unwrap();
    {
        let p: Vec<CTensor> = (0..2).map(param).collect();
        let x = hop(&input(), &p[0]);
        let y = hop(&hop(&x, &p[1]), &p[1]);
        let g = loss(&y).backward().unwrap();
        for (r, pr) in p.iter().enumerate() {
            assert_close(
                &grad_on(&workers, r, ctx.id()),
                &values(g.get(pr).unwrap()),
                &format!("rref rank {r}"),
            );
        }
    }
    ctx.release().await.unwrap();
    drop(layer);

    // `remote` in a context: w1 keeps hidden = hop(x, p1) in an RRef; a method call on it in
    // the same context uses it (forward: hop(y, hidden)); gradients reach p0 through it.
    let ctx = w0.dist.context().unwrap();
    let x = hop(&input(), &w0.param);
    let hidden: RRef<Layer> = ctx.remote("w1", "make_hidden", &(), &[x], None).unwrap();
    let y = input();
    let ((), out) = ctx
        .rref_rpc_sync(&hidden, "forward", &(), &[y], None)
        .await
        .unwrap();
    ctx.backward(&[(loss(&out[0]), None)], false).await.unwrap();
    {
        let p: Vec<CTensor> = (0..2).map(param).collect();
        let hidden = hop(&hop(&input(), &p[0]), &p[1]);
        let g = loss(&hop(&input(), &hidden)).backward().unwrap();
        for (r, pr) in p.iter().enumerate() {
            assert_close(
                &grad_on(&workers, r, ctx.id()),
                &values(g.get(pr).unwrap()),
                &format!("remote rank {r}"),
            );
        }
    }
    ctx.release().await.unwrap();
    drop(hidden);
    for w in &workers {
        assert_eq!(w.dist.context_count(), 0);
    }
    shutdown(workers).await;
}

#[tokio::test(start_paused = true)]
async fn concurrent_contexts_from_two_trainers_keep_their_gradients_apart() {
    let workers = cluster(3).await;
    // w0 and w1 train at once through w2; each context holds its own gradients on w2.
    let run = |rank: usize, scale: f32| {
        let w = &workers[rank];
        async move {
            let ctx = w.dist.context().unwrap();
            let x = (hop(&input(), &w.param) * scale as f64).unwrap();
            let ((), out) = ctx
                .rpc_sync("w2", "hop", &Vec::<String>::new(), &[x], None)
                .await
                .unwrap();
            ctx.backward(&[(loss(&out[0]), None)], false).await.unwrap();
            ctx
        }
    };
    let (c0, c1) = tokio::join!(run(0, 1.0), run(1, 3.0));
    assert_ne!(c0.id(), c1.id());
    for (rank, ctx, scale) in [(0usize, &c0, 1.0f64), (1, &c1, 3.0)] {
        let p = [param(rank), param(2)];
        let x = (hop(&input(), &p[0]) * scale).unwrap();
        let y = (hop(&x, &p[1]) * 2.0).unwrap();
        let g = loss(&y).backward().unwrap();
        assert_close(
            &grad_on(&workers, rank, ctx.id()),
            &values(g.get(&p[0]).unwrap()),
            "trainer",
        );
        assert_close(
            &grad_on(&workers, 2, ctx.id()),
            &values(g.get(&p[1]).unwrap()),
            "w2",
        );
    }
    assert_eq!(workers[2].dist.context_count(), 2);
    c0.release().await.unwrap();
    c1.release().await.unwrap();
    for w in &workers {
        assert_eq!(w.dist.context_count(), 0);
    }
    shutdown(workers).await;
}

/// A gradient w1 may not take, sent as the autograd layer would, by `from`.
async fn forge_gradient(
    from: &Worker,
    context: tensorwire_core::autograd::ContextId,
) -> tensorwire_rpc::RpcError {
    #[derive(serde::Serialize)]
    struct GradientRequest {
        context: tensorwire_core::autograd::ContextId,
        message: tensorwire_core::autograd::AutogradMessageId,
        grads: Vec<Option<tensorwire_core::tensor::Tensor>>,
    }
    let bogus = GradientRequest {
        context,
        message: tensorwire_core::autograd::AutogradMessageId::new(1, 0),
        grads: vec![None],
    };
    from.agent
        .rpc_sync::<_, Result<(), tensorwire_core::autograd::BackwardError>>(
            "w1",
            "__tw_autograd/grad",
            &bogus,
            None,
        )
        .await
        .unwrap_err()
}

/// w1's next lost peer, with its cause.
async fn next_lost(
    events: &mut tensorwire_rpc::PeerEvents,
) -> (u32, tensorwire_core::protocol::LostCause) {
    let lost = async {
        loop {
            match events.recv().await {
                Some(tensorwire_rpc::PeerEvent::Lost { worker, cause }) => return (worker, cause),
                Some(_) => {}
                None => panic!("w1's peer events ended"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), lost)
        .await
        .expect("w1 dropped no peer")
}

#[tokio::test(start_paused = true)]
async fn gradients_for_unknown_contexts_or_from_outsiders_are_violations_that_drop_the_sender() {
    use tensorwire_core::autograd::{ContextId, ProtocolViolation as AutogradViolation};
    use tensorwire_core::protocol::{LostCause, ProtocolViolation};
    let workers = cluster(4).await;
    let w0 = &workers[0];
    let ctx = w0.dist.context().unwrap();
    let x = hop(&input(), &w0.param);
    let ((), _out) = ctx
        .rpc_sync("w1", "hop", &Vec::<String>::new(), &[x], None)
        .await
        .unwrap();
    let mut events = workers[1].agent.peer_events();
    // w2 is outside the context: its gradient for w1's message is a violation; w1 drops it
    // before answering (as for a frame that breaks the RPC protocol).
    forge_gradient(&workers[2], ctx.id()).await;
    let (lost, cause) = next_lost(&mut events).await;
    assert_eq!(lost, 2);
    assert_eq!(
        cause,
        LostCause::Misbehaved(Box::new(ProtocolViolation::Autograd(
            AutogradViolation::NotInContext {
                from: 2,
                context: ctx.id()
            }
        )))
    );
    assert!(cause.to_string().contains("is not part of"), "{cause}");
    // Calls to it fail naming why.
    let e = workers[1]
        .agent
        .rpc_sync::<_, ()>("w2", "hop", &Vec::<String>::new(), None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("is not part of"), "{e}");
    // w3 sends a gradient for a context w1 never heard of: dropped too.
    let unknown = ContextId::new(0, 999);
    forge_gradient(&workers[3], unknown).await;
    let (lost, cause) = next_lost(&mut events).await;
    assert_eq!(lost, 3);
    assert_eq!(
        cause,
        LostCause::Misbehaved(Box::new(ProtocolViolation::Autograd(
            AutogradViolation::UnknownContext {
                from: 3,
                context: unknown
            }
        )))
    );
    assert!(
        cause
            .to_string()
            .contains("which this worker does not have"),
        "{cause}"
    );
    assert_eq!(workers[1].dist.violations(), 2);
    // w1 carries on: the context still works end to end.
    let ((), out) = ctx
        .rpc_sync(
            "w1",
            "hop",
            &Vec::<String>::new(),
            &[hop(&input(), &w0.param)],
            None,
        )
        .await
        .unwrap();
    ctx.backward(&[(loss(&out[0]), None)], false).await.unwrap();
    // A second backward without retain_graph is refused with a typed error.
    let e = ctx
        .backward(&[(loss(&out[0]), None)], false)
        .await
        .unwrap_err();
    assert!(matches!(e, DistAutogradError::State(_)), "{e}");
    ctx.release().await.unwrap();
    // A graceful shutdown fails once members were lost: every worker stops at once.
    for w in workers {
        w.agent
            .shutdown(tensorwire_rpc::Shutdown::Immediate)
            .await
            .unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn the_distributed_optimizer_trains_like_one_process() {
    let workers = cluster(3).await;
    let w0 = &workers[0];
    // A parameter that travels arrives as a plain tensor: a copy of its values.
    let copy: tensorwire_core::tensor::Tensor = w0
        .agent
        .rpc_sync("w1", "make_parameter", &(), None)
        .await
        .unwrap();
    assert_eq!(copy.to_f32_vec().unwrap(), param_values(1));
    // Parameters on w1 and w2 (parameter servers), in remote references held by w0.
    let p1: RRef<Parameter<CandleEngine>> =
        w0.agent.remote("w1", "make_parameter", &(), None).unwrap();
    let p2: RRef<Parameter<CandleEngine>> =
        w0.agent.remote("w2", "make_parameter", &(), None).unwrap();
    for optimizer in [
        Optimizer::from(Sgd::new(0.05).momentum(0.9)),
        Sgd::new(0.05)
            .momentum(0.9)
            .nesterov(true)
            .weight_decay(0.01)
            .into(),
        Adam::new(0.01).into(),
        AdamW::new(0.01).amsgrad(true).into(),
        RmsProp::new(0.01).momentum(0.5).centered(true).into(),
        Adagrad::new(0.1).lr_decay(0.01).into(),
    ] {
        // Fresh parameters for each optimizer.
        let p1: RRef<Parameter<CandleEngine>> =
            w0.agent.remote("w1", "make_parameter", &(), None).unwrap();
        let p2: RRef<Parameter<CandleEngine>> =
            w0.agent.remote("w2", "make_parameter", &(), None).unwrap();
        let opt =
            DistributedOptimizer::new(&w0.dist, vec![p1.clone(), p2.clone()], optimizer).unwrap();
        // The same model in one process.
        let local = [param(1), param(2)];
        let mut states = [OptimizerState::default(), OptimizerState::default()];
        let x = input();
        for step in 0..3 {
            let ctx = w0.dist.context().unwrap();
            let ((), h) = ctx
                .rref_rpc_sync(&p1, "param_forward", &(), std::slice::from_ref(&x), None)
                .await
                .unwrap();
            let ((), y) = ctx
                .rref_rpc_sync(&p2, "param_forward", &(), &h, None)
                .await
                .unwrap();
            let l = loss(&y[0]);
            ctx.backward(&[(l.clone(), None)], false).await.unwrap();
            assert_eq!(opt.step(ctx.id()).await.unwrap(), 2);
            ctx.release().await.unwrap();

            let ly = hop(&hop(&x, &local[0]), &local[1]);
            let ll = loss(&ly);
            assert_close(
                &[l.to_scalar::<f32>().unwrap()],
                &[ll.to_scalar::<f32>().unwrap()],
                &format!("loss at step {step} with {optimizer:?}"),
            );
            let g = ll.backward().unwrap();
            for (p, s) in local.iter().zip(states.iter_mut()) {
                let mut v = values(p);
                optimizer
                    .step(s, &mut v, &values(g.get(p).unwrap()))
                    .unwrap();
                Var::from_tensor(p)
                    .unwrap()
                    .set(&CTensor::from_vec(v, 3, &Device::Cpu).unwrap())
                    .unwrap();
            }
        }
        // The parameters on their owners match the local ones after the steps.
        let got1: Vec<f32> = p1.rpc_sync("param_values", &(), None).await.unwrap();
        let got2: Vec<f32> = p2.rpc_sync("param_values", &(), None).await.unwrap();
        assert_close(&got1, &values(&local[0]), "w1's parameter");
        assert_close(&got2, &values(&local[1]), "w2's parameter");
    }

    // Two optimizers (two trainers' steps) update one owner at once: the steps are serialized
    // and none is lost
    // (plain SGD: the result is p - lr * (g0 + g1) in either order).
    let sgd = Optimizer::from(Sgd::new(0.1));
    let ctxs = {
        let mut v = Vec::new();
        for scale in [1.0f64, -2.0] {
            let ctx = w0.dist.context().unwrap();
            let x = (input() * scale).unwrap();
            let ((), y) = ctx
                .rref_rpc_sync(&p1, "param_forward", &(), &[x], None)
                .await
                .unwrap();
            ctx.backward(&[(loss(&y[0]), None)], false).await.unwrap();
            v.push(ctx);
        }
        v
    };
    let opt_a = DistributedOptimizer::new(&w0.dist, vec![p1.clone()], sgd).unwrap();
    let opt_b = DistributedOptimizer::new(&w0.dist, vec![p1.clone()], sgd).unwrap();
    let (a, b) = tokio::join!(opt_a.step(ctxs[0].id()), opt_b.step(ctxs[1].id()));
    assert_eq!((a.unwrap(), b.unwrap()), (1, 1));
    let mut want = param_values(1);
    for scale in [1.0f64, -2.0] {
        let p = param(1);
        let g = loss(&hop(&(input() * scale).unwrap(), &p))
            .backward()
            .unwrap();
        for (w, g) in want.iter_mut().zip(values(g.get(&p).unwrap())) {
            *w -= 0.1 * g;
        }
    }
    let got: Vec<f32> = p1.rpc_sync("param_values", &(), None).await.unwrap();
    assert_close(&got, &want, "both steps applied");
    for c in ctxs {
        c.release().await.unwrap();
    }
    drop((p1, p2));
    shutdown(workers).await;
}

/// Waits, in virtual time, until `cond` holds; fails after `limit`.
async fn wait_until(limit: Duration, what: &str, cond: impl FnMut() -> bool) {
    tensorwire_testkit::wait_until(what, limit, cond).await;
}

/// w2 makes a context whose forward pass goes w2 → w1 → w0 and back, w0 makes one that
/// reaches w2 and one that reaches only w1; then w2's process dies, before any backward. Every
/// survivor drops each context w2 made or took part in, on its own, at once (virtual time: no
/// timeout is waited out), and keeps the other, which still trains and releases. Nothing more
/// goes to w2 in a context.
#[tokio::test(start_paused = true)]
async fn a_worker_lost_with_contexts_open_leaves_none_of_them_on_the_survivors() {
    let workers = cluster(3).await;
    let (w0, w1, w2) = (&workers[0], &workers[1], &workers[2]);
    let theirs = w2.dist.context().unwrap();
    let ((), _) = theirs
        .rpc_sync(
            "w1",
            "hop",
            &vec!["w0".to_owned()],
            &[hop(&input(), &w2.param)],
            None,
        )
        .await
        .unwrap();
    let via2 = w0.dist.context().unwrap();
    let ((), out2) = via2
        .rpc_sync(
            "w2",
            "hop",
            &Vec::<String>::new(),
            &[hop(&input(), &w0.param)],
            None,
        )
        .await
        .unwrap();
    let mine = w0.dist.context().unwrap();
    let ((), out) = mine
        .rpc_sync(
            "w1",
            "hop",
            &Vec::<String>::new(),
            &[hop(&input(), &w0.param)],
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        (w0.dist.context_count(), w1.dist.context_count()),
        (3, 2),
        "before the death"
    );

    let t0 = tokio::time::Instant::now();
    w2.host.kill();
    wait_until(
        Duration::from_secs(1),
        "survivors drop w2's contexts",
        || w0.dist.context_count() == 1 && w1.dist.context_count() == 1,
    )
    .await;
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(w0.dist.gradients(mine.id()).is_some());
    assert!(w0.dist.gradients(via2.id()).is_none());
    assert!(w1.dist.gradients(theirs.id()).is_none());

    // The context w2 never saw still trains, with the gradients of one process.
    mine.backward(&[(loss(&out[0]), None)], false)
        .await
        .unwrap();
    let want = local_route(&[1], 3);
    assert_close(
        &grad_on(&workers, 0, mine.id()),
        want[0].as_ref().unwrap(),
        "w0",
    );
    assert_close(
        &grad_on(&workers, 1, mine.id()),
        want[1].as_ref().unwrap(),
        "w1",
    );
    // The dropped one refuses a backward, saying why; releasing it is not an error.
    let e = via2
        .backward(&[(loss(&out2[0]), None)], false)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &e,
            DistAutogradError::State(tensorwire_core::autograd::AutogradError::Dropped {
                cause: tensorwire_core::autograd::BackwardError::PeerLost { worker: 2, .. },
                ..
            })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("worker 2 was lost"), "{e}");
    via2.release().await.unwrap();
    // No tracked tensor goes to a worker known to be lost.
    let next = w0.dist.context().unwrap();
    let e = next
        .rpc_sync::<_, ()>(
            "w2",
            "hop",
            &Vec::<String>::new(),
            &[hop(&input(), &w0.param)],
            None,
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("worker 2 was lost"), "{e}");
    next.release().await.unwrap();
    mine.release().await.unwrap();
    assert_eq!((w0.dist.context_count(), w1.dist.context_count()), (0, 0));
    drop(theirs);
    for w in workers {
        let _ = w.agent.shutdown(tensorwire_rpc::Shutdown::Immediate).await;
    }
}

/// A chain w0 → w1 → w2 over simulated devices, with device maps both ways: w0 sends to w1 by
/// {cpu: cuda:1}, w1 to w2 by {cpu: cuda:0}, and (to tell the reverse map from a plain
/// request's) w1 to w0 by {cpu: cuda:0} and w2 to w1 by {cpu: cuda:1}. The forward's tensors
/// land on w1's cuda:1 and w2's cuda:0; each gradient is put on the device its tensor landed
/// on and goes back by the reverse of the forward's map: w2's reaches w1 on the host, w1's
/// reaches w0 on the host (where w0's tensor was), never by the senders' own maps (which would
/// put them on w1's cuda:1 and w0's cuda:0). The gradients equal one process's.
#[tokio::test(start_paused = true)]
async fn gradients_go_back_by_the_reverse_of_the_forward_device_maps() {
    let backends: Vec<Arc<RecordingDevices>> =
        (0..3).map(|_| RecordingDevices::simulated(2)).collect();
    let maps: [&[(&str, &str)]; 3] = [
        &[("w1", "cuda:1")],
        &[("w2", "cuda:0"), ("w0", "cuda:0")],
        &[("w1", "cuda:1")],
    ];
    let b = backends.clone();
    let workers = cluster_with(3, move |rank, o| {
        o.device_backend = b[rank].clone();
        for (to, target) in maps[rank] {
            o.set_device_map(to, &[("cpu", target)]).unwrap();
        }
    })
    .await;
    let w0 = &workers[0];
    let ctx = w0.dist.context().unwrap();
    let ((), out) = ctx
        .rpc_sync(
            "w1",
            "hop",
            &vec!["w2".to_owned()],
            &[hop(&input(), &w0.param)],
            None,
        )
        .await
        .unwrap();
    // The forward: w1 got w0's tensor on cuda:1, w2 got w1's on cuda:0; the results came back
    // on the host (the callees' reverse maps have no entry for it).
    assert_eq!(backends[1].take(), ["cuda:1"]);
    assert_eq!(backends[2].take(), ["cuda:0"]);
    assert!(backends[0].take().is_empty());

    ctx.backward(&[(loss(&out[0]), None)], false).await.unwrap();
    // w0's gradient of w1's result goes by w0's map (the reverse of w1's reverse map) and lands
    // on cuda:1; w1's gradient of w0's tensor is put on cuda:1, where that tensor landed.
    assert_eq!(backends[1].take(), ["cuda:1", "cuda:1"]);
    // w1's gradient of w2's result lands on cuda:0; w2's gradient of w1's tensor is put there.
    assert_eq!(backends[2].take(), ["cuda:0", "cuda:0"]);
    // Nothing reached w0 on a device: its tensor's gradient came back to the host.
    assert!(backends[0].take().is_empty());
    let want = local_route(&[1, 2], 3);
    for (rank, want) in want.iter().enumerate() {
        assert_close(
            &grad_on(&workers, rank, ctx.id()),
            want.as_ref().unwrap(),
            &format!("rank {rank}"),
        );
    }
    ctx.release().await.unwrap();
    shutdown(workers).await;
}

/// PyTorch's usual model: the input needs no grad, the first stage returns a tensor that does.
/// A call whose arguments hold no tracked tensor returns tracked ones (and sends them on, here
/// w1 → w2), and the backward reaches both stages' parameters with one process's gradients
/// (`record_send` used to fail: the callee held no context).
#[tokio::test(start_paused = true)]
async fn a_call_without_tracked_arguments_may_return_and_send_tracked_tensors() {
    let workers = cluster(3).await;
    let w0 = &workers[0];
    for route in [vec![], vec!["w2".to_owned()]] {
        let ctx = w0.dist.context().unwrap();
        let ((), out) = ctx
            .rpc_sync::<_, ()>("w1", "stage", &(values(&input()), route.clone()), &[], None)
            .await
            .unwrap();
        ctx.backward(&[(loss(&out[0]), None)], false).await.unwrap();
        let p: Vec<CTensor> = (0..3).map(param).collect();
        let mut z = hop(&input(), &p[1]);
        if !route.is_empty() {
            z = (hop(&z, &p[2]) * 2.0).unwrap();
        }
        let g = loss(&(z * 2.0).unwrap()).backward().unwrap();
        for (r, pr) in p.iter().enumerate().skip(1).take(route.len() + 1) {
            assert_close(
                &grad_on(&workers, r, ctx.id()),
                &values(g.get(pr).unwrap()),
                &format!("rank {r}, route {route:?}"),
            );
        }
        ctx.release().await.unwrap();
        for w in &workers {
            assert_eq!(w.dist.context_count(), 0, "route {route:?}");
        }
    }
    shutdown(workers).await;
}

/// Empty roots, a non-scalar root without a seed, a root that does not require grad, a seed
/// of the wrong shape and a leaf root (a parameter: it requires grad but has no gradient
/// function) are refused at once with a typed error and change nothing: no gradient
/// accumulates, the graph is not marked freed, and the real backward afterwards (without
/// retain_graph) gives one process's gradients. (A leaf root was taken, and its backward freed
/// the graph, so the real backward was refused.) A tensor received in a context is no leaf:
/// its recv function sends its gradient back.
#[tokio::test(start_paused = true)]
async fn backward_roots_are_checked_before_anything_runs() {
    let workers = cluster(2).await;
    let w0 = &workers[0];
    let ctx = w0.dist.context().unwrap();
    let x = hop(&input(), &w0.param);
    let ((), out) = ctx
        .rpc_sync("w1", "hop", &Vec::<String>::new(), &[x], None)
        .await
        .unwrap();
    let wrong_seed = CTensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
    let scalar_leaf = CandleEngine::new().parameter(&[], &[1.5]).unwrap();
    for (roots, want) in [
        (vec![], RootProblem::Empty),
        (
            vec![(out[0].clone(), None)],
            RootProblem::NotScalar {
                index: 0,
                shape: vec![3],
            },
        ),
        (
            vec![(loss(&out[0]), None), (loss(&input()), None)],
            RootProblem::NoGrad { index: 1 },
        ),
        (
            vec![(out[0].clone(), Some(wrong_seed))],
            RootProblem::SeedShape {
                index: 0,
                root: vec![3],
                seed: vec![2],
            },
        ),
        (
            vec![(loss(&out[0]), None), (scalar_leaf.clone(), None)],
            RootProblem::NoGradFn { index: 1 },
        ),
    ] {
        match ctx.backward(&roots, false).await {
            Err(DistAutogradError::State(AutogradError::InvalidRoots { problem, .. })) => {
                assert_eq!(problem, want)
            }
            other => panic!("{want:?}: {other:?}"),
        }
        assert!(ctx.gradients().is_empty(), "{want:?} accumulated gradients");
        assert!(workers[1].dist.gradients(ctx.id()).unwrap().is_empty());
    }
    ctx.backward(&[(loss(&out[0]), None)], false).await.unwrap();
    let want = local_route(&[1], 2);
    for (rank, want) in want.iter().enumerate() {
        assert_close(
            &grad_on(&workers, rank, ctx.id()),
            want.as_ref().unwrap(),
            &format!("rank {rank}"),
        );
    }
    ctx.release().await.unwrap();

    // A received tensor as the root (seeded) is taken: gradients reach w1 and w0.
    let ctx = w0.dist.context().unwrap();
    let x = hop(&input(), &w0.param);
    let ((), out) = ctx
        .rpc_sync("w1", "hop", &Vec::<String>::new(), &[x], None)
        .await
        .unwrap();
    let ones = CTensor::ones(
        3,
        tensorwire_autograd_candle::candle_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    ctx.backward(&[(out[0].clone(), Some(ones))], false)
        .await
        .unwrap();
    assert!(!grad_on(&workers, 0, ctx.id()).is_empty());
    assert!(!grad_on(&workers, 1, ctx.id()).is_empty());
    ctx.release().await.unwrap();
    shutdown(workers).await;
}

/// `to_here` inside a context is tracked both ways (PyTorch's `test_backward_rref*`): a
/// parameter fetched from its owner gets its gradient there, and a DistributedOptimizer steps
/// it; tensors w1 computed (by `remote` in the context) from w0's pass gradients back through
/// w1's graph to w0's parameter. Fetching on the owner gives the value's own tensors.
#[tokio::test(start_paused = true)]
async fn to_here_in_a_context_is_tracked() {
    let workers = cluster(2).await;
    let w0 = &workers[0];
    // A parameter on w1, fetched into w0's context.
    let p1: RRef<Parameter<CandleEngine>> =
        w0.agent.remote("w1", "make_parameter", &(), None).unwrap();
    let ctx = w0.dist.context().unwrap();
    let fetched = ctx.to_here(&p1, None).await.unwrap();
    assert_eq!(values(&fetched[0]), param_values(1));
    let y = hop(&hop(&input(), &w0.param), &fetched[0]);
    ctx.backward(&[(loss(&y), None)], false).await.unwrap();
    let p: Vec<CTensor> = (0..2).map(param).collect();
    let g = loss(&hop(&hop(&input(), &p[0]), &p[1])).backward().unwrap();
    assert_close(
        &grad_on(&workers, 0, ctx.id()),
        &values(g.get(&p[0]).unwrap()),
        "w0",
    );
    let on_owner = workers[1]
        .dist
        .gradients(ctx.id())
        .expect("w1 holds the context");
    assert_eq!(on_owner.len(), 1, "only the parameter's gradient");
    let got = values(on_owner.values().next().unwrap());
    assert_close(&got, &values(g.get(&p[1]).unwrap()), "w1's parameter");
    let opt = DistributedOptimizer::new(&w0.dist, vec![p1.clone()], Optimizer::from(Sgd::new(0.5)))
        .unwrap();
    assert_eq!(opt.step(ctx.id()).await.unwrap(), 1);
    let stepped: Vec<f32> = p1.rpc_sync("param_values", &(), None).await.unwrap();
    let want: Vec<f32> = param_values(1)
        .iter()
        .zip(&got)
        .map(|(p, g)| p - 0.5 * g)
        .collect();
    assert_close(&stepped, &want, "stepped");
    ctx.release().await.unwrap();

    // Tensors kept on w1, made from w0's tracked tensor in the same context, fetched back.
    let ctx = w0.dist.context().unwrap();
    let x = hop(&input(), &w0.param);
    let list: RRef<TensorList<CandleEngine>> =
        ctx.remote("w1", "make_list", &(), &[x], None).unwrap();
    let h = ctx.to_here(&list, None).await.unwrap();
    ctx.backward(&[(loss(&h[0]), None)], false).await.unwrap();
    let g = loss(&hop(&hop(&input(), &p[0]), &p[1])).backward().unwrap();
    for (r, pr) in p.iter().enumerate() {
        assert_close(
            &grad_on(&workers, r, ctx.id()),
            &values(g.get(pr).unwrap()),
            &format!("list rank {r}"),
        );
    }
    ctx.release().await.unwrap();
    // On the owner, to_here gives the value's own tensors (the local graph tracks them).
    let mine = w0
        .agent
        .local_rref(TensorList::new(
            &CandleEngine::new(),
            vec![w0.param.clone()],
        ))
        .unwrap();
    let ctx = w0.dist.context().unwrap();
    let own = ctx.to_here(&mine, None).await.unwrap();
    assert_eq!(own[0].id(), w0.param.id());
    ctx.release().await.unwrap();
    drop((p1, list, mine));
    for w in &workers {
        assert_eq!(w.dist.context_count(), 0);
    }
    shutdown(workers).await;
}

/// A user brings their own optimizer: registered on the owners, run by a DistributedOptimizer
/// on f32 and f64 parameters alike; one not registered on an owner fails the step naming it;
/// invalid built-in hyper-parameters are refused when the optimizer is made.
#[tokio::test(start_paused = true)]
async fn a_user_optimizer_and_f64_parameters() {
    #[derive(serde::Serialize, serde::Deserialize)]
    struct SignSgd {
        lr: f64,
    }
    impl LocalOptimizer for SignSgd {
        const NAME: &'static str = "sign-sgd";
        type State = u32;
        type Error = String;
        fn step(
            &self,
            steps: &mut u32,
            param: &tensorwire_core::tensor::Tensor,
            grad: &tensorwire_core::tensor::Tensor,
        ) -> Result<tensorwire_core::tensor::Tensor, String> {
            *steps += 1;
            let (p, g) = (param.to_f64_vec().unwrap(), grad.to_f64_vec().unwrap());
            let new: Vec<f64> = p
                .iter()
                .zip(&g)
                .map(|(p, g)| p - self.lr * g.signum() / f64::from(*steps))
                .collect();
            tensorwire_core::tensor::Tensor::from_f64(param.shape().to_vec(), &new)
                .map_err(|e| e.to_string())
        }
    }
    let workers = cluster(2).await;
    workers[1].dist.register_optimizer::<SignSgd>().unwrap();
    let w0 = &workers[0];
    let values64 = [0.5f64, -0.25, 2.0];
    let make = |w: &Worker| {
        let t = CTensor::new(&values64, &Device::Cpu).unwrap();
        let v = Var::from_tensor(&t).unwrap().as_tensor().clone();
        w.agent
            .local_rref(Parameter::new(&CandleEngine::new(), v))
            .unwrap()
    };
    let p1 = make(&workers[1]);
    // w1 hands its parameter to w0 (an RRef travels in a call's result).
    let p1: RRef<Parameter<CandleEngine>> = {
        let a = workers[1].agent.clone();
        let keep = p1.clone();
        a.functions()
            .register("give_p64", move |(): ()| {
                let r = keep.clone();
                async move { Ok::<_, String>(r) }
            })
            .unwrap();
        w0.agent
            .rpc_sync("w1", "give_p64", &(), None)
            .await
            .unwrap()
    };
    let x = CTensor::new(&[1.0f64, 2.0, -1.0], &Device::Cpu).unwrap();
    async fn run(
        ctx: &tensorwire_dist_autograd::AutogradContext<CandleEngine>,
        p: &RRef<Parameter<CandleEngine>>,
        x: &CTensor,
    ) {
        let w = ctx.to_here(p, None).await.unwrap();
        let l = w[0].mul(x).unwrap().sum_all().unwrap();
        ctx.backward(&[(l, None)], false).await.unwrap();
    }
    // The gradient of sum(w * x) is x: sign-SGD moves each value by lr * sign(x) / step.
    let own = DistributedOptimizer::new(&w0.dist, vec![p1.clone()], SignSgd { lr: 0.1 }).unwrap();
    let mut want = values64.to_vec();
    for step in 1..=2 {
        let ctx = w0.dist.context().unwrap();
        run(&ctx, &p1, &x).await;
        assert_eq!(own.step(ctx.id()).await.unwrap(), 1);
        for (w, x) in want.iter_mut().zip([1.0f64, 2.0, -1.0]) {
            *w -= 0.1 * x.signum() / f64::from(step);
        }
        ctx.release().await.unwrap();
    }
    // The built-in optimizers step f64 parameters too (Adam: the first step is lr * sign(g)).
    let adam =
        DistributedOptimizer::new(&w0.dist, vec![p1.clone()], Optimizer::from(Adam::new(0.01)))
            .unwrap();
    let ctx = w0.dist.context().unwrap();
    run(&ctx, &p1, &x).await;
    assert_eq!(adam.step(ctx.id()).await.unwrap(), 1);
    for (w, x) in want.iter_mut().zip([1.0f64, 2.0, -1.0]) {
        *w -= 0.01 * x.signum();
    }
    workers[1]
        .agent
        .functions()
        .register_method(
            "param_values64",
            |p: Arc<Parameter<CandleEngine>>, (): ()| async move {
                Ok::<_, String>(p.tensor().to_vec1::<f64>().unwrap())
            },
        )
        .unwrap();
    let on_owner: Vec<f64> = p1.rpc_sync("param_values64", &(), None).await.unwrap();
    for (g, w) in on_owner.iter().zip(&want) {
        assert!((g - w).abs() < 1e-9, "got {on_owner:?}, want {want:?}");
    }
    ctx.release().await.unwrap();
    // Not registered on w0's side for w0-owned parameters: the step fails naming the function.
    let p0 = make(w0);
    let ctx = w0.dist.context().unwrap();
    let w = ctx.to_here(&p0, None).await.unwrap();
    let l = w[0].mul(&x).unwrap().sum_all().unwrap();
    ctx.backward(&[(l, None)], false).await.unwrap();
    let unregistered =
        DistributedOptimizer::new(&w0.dist, vec![p0.clone()], SignSgd { lr: 0.1 }).unwrap();
    let e = unregistered.step(ctx.id()).await.unwrap_err();
    assert!(e.to_string().contains("sign-sgd"), "{e}");
    ctx.release().await.unwrap();
    // Invalid hyper-parameters are refused at once, naming the one that is wrong.
    let e = DistributedOptimizer::new(
        &w0.dist,
        vec![p0.clone()],
        Optimizer::from(Sgd::new(0.1).nesterov(true)),
    )
    .unwrap_err();
    assert!(matches!(e, DistAutogradError::Optimizer { .. }), "{e}");
    assert!(e.to_string().contains("Nesterov"), "{e}");
    drop((p0, p1));
    shutdown(workers).await;
}

#[tokio::test(start_paused = true)]
async fn contexts_a_peer_makes_a_worker_hold_are_bounded_and_freed_by_release() {
    let workers = cluster(3).await;
    let (w0, w2) = (&workers[0], &workers[2]);
    w0.dist.set_contexts_per_peer(2);
    let none = Vec::<String>::new();
    let call = |ctx: &tensorwire_dist_autograd::AutogradContext<CandleEngine>| {
        ctx.rpc_async::<_, ()>("w0", "hop", &none, &[hop(&input(), &w2.param)], None)
            .unwrap()
    };
    // w2 makes w0 hold two of its contexts; a second call in one of them is no new context.
    let c1 = w2.dist.context().unwrap();
    let c2 = w2.dist.context().unwrap();
    call(&c1).await.unwrap();
    call(&c2).await.unwrap();
    call(&c1).await.unwrap();
    assert_eq!(w0.dist.context_count(), 2);
    // A third is refused, naming the bound; nothing is made and w2 is not dropped.
    let c3 = w2.dist.context().unwrap();
    let e = call(&c3).await.unwrap_err();
    assert!(e.to_string().contains("contexts_per_peer"), "{e}");
    assert!(
        e.to_string().contains("already made this worker hold 2"),
        "{e}"
    );
    assert_eq!(w0.dist.context_count(), 2);
    assert_eq!(w0.dist.violations(), 0);
    // Another peer has a share of its own, and w0's own contexts do not count.
    let c4 = workers[1].dist.context().unwrap();
    c4.rpc_sync::<_, ()>(
        "w0",
        "hop",
        &none,
        &[hop(&input(), &workers[1].param)],
        None,
    )
    .await
    .unwrap();
    let own = w0.dist.context().unwrap();
    own.rpc_sync::<_, ()>("w2", "hop", &none, &[hop(&input(), &w0.param)], None)
        .await
        .unwrap();
    // A release frees a place: w2's refused context is made now, and its backward runs.
    c1.release().await.unwrap();
    let ((), out) = c3
        .rpc_sync::<_, ()>("w0", "hop", &none, &[hop(&input(), &w2.param)], None)
        .await
        .unwrap();
    c3.backward(&[(loss(&out[0]), None)], false).await.unwrap();
    assert!(c3.gradient(&w2.param).is_some());
    for c in [c2, c3, c4, own] {
        c.release().await.unwrap();
    }
    for w in &workers {
        assert_eq!(w.dist.context_count(), 0);
    }
    shutdown(workers).await;
}

/// Only tensors that required grad on the sender get a recv function (PyTorch's
/// `addRecvRpcBackward`): no gradient is sent back for a plain input, whose sender has nowhere
/// to put it, while a parameter sent as an argument still gets its gradient, as in one process
/// (in the answer to the gradient request that reached w1: no request of its own).
#[tokio::test(start_paused = true)]
async fn only_tensors_that_required_grad_on_the_sender_get_a_gradient_back() {
    let workers = cluster(2).await;
    let w0 = &workers[0];
    let p: Vec<CTensor> = (0..2).map(param).collect();
    for (x, sent_back) in [(input(), 0), (w0.param.clone(), 1)] {
        let ctx = w0.dist.context().unwrap();
        let ((), out) = ctx
            .rpc_sync::<_, ()>(
                "w1",
                "hop",
                &Vec::<String>::new(),
                std::slice::from_ref(&x),
                None,
            )
            .await
            .unwrap();
        let served = || w0.agent.metrics().per_peer["w1"].calls_received;
        let before = served();
        ctx.backward(&[(loss(&out[0]), None)], false).await.unwrap();
        // No gradient request reaches w0 either way: a parameter's gradient rides in the
        // answer to w0's request (it came in w0's request, to the host).
        assert_eq!(
            served() - before,
            0,
            "gradient requests from w1 to w0 (input requires grad: {})",
            x.is_variable()
        );
        assert_eq!(
            w0.dist.gradients(ctx.id()).map_or(0, |g| g.len()),
            sent_back,
            "gradients w0 holds (input requires grad: {})",
            x.is_variable()
        );
        let local_x = if x.is_variable() { p[0].clone() } else { x };
        let g = loss(&(hop(&local_x, &p[1]) * 2.0).unwrap())
            .backward()
            .unwrap();
        assert_close(
            &grad_on(&workers, 1, ctx.id()),
            &values(g.get(&p[1]).unwrap()),
            "w1's parameter",
        );
        if sent_back == 1 {
            assert_close(
                &grad_on(&workers, 0, ctx.id()),
                &values(g.get(&p[0]).unwrap()),
                "w0's parameter, sent as an argument",
            );
        }
        ctx.release().await.unwrap();
    }
    shutdown(workers).await;
}

/// Backward tasks run inline on the RPC thread while the engine's runs are short, and on a
/// blocking thread otherwise: both give one process's gradients, for chains that come back
/// too, pass after pass.
#[tokio::test(start_paused = true)]
async fn backward_tasks_inline_or_on_a_blocking_thread_match_one_process() {
    for (bound, inline) in [(Duration::from_secs(1), true), (Duration::ZERO, false)] {
        let workers = cluster(3).await;
        for w in &workers {
            w.dist.set_inline_bound(bound);
        }
        for _ in 0..4 {
            route_case(&workers, &[1, 2]).await;
            route_case(&workers, &[1, 2, 0]).await;
        }
        let (ran_inline, ran_blocking): (u64, u64) = workers
            .iter()
            .map(|w| w.dist.engine_runs())
            .fold((0, 0), |(a, b), (i, k)| (a + i, b + k));
        if inline {
            // Each worker sends its first RECENT runs to a blocking thread (their times are
            // not known yet), then goes inline.
            assert_eq!(
                (ran_inline > 0, ran_blocking),
                (true, 3 * tensorwire_core::autograd::inline::RECENT as u64),
                "bound {bound:?}: {ran_inline} inline, {ran_blocking} blocking"
            );
        } else {
            assert_eq!(ran_inline, 0, "bound zero: never inline");
            assert!(ran_blocking > 0);
        }
        shutdown(workers).await;
    }
}

/// `release_in_background` (what Python's context manager uses, as PyTorch's does) drops the
/// context here before it returns, without waiting for any answer, and every worker the context
/// reached, directly or through another one, drops it once the release reaches it.
#[tokio::test(start_paused = true)]
async fn a_release_in_the_background_drops_the_context_here_at_once_and_everywhere_soon() {
    let workers = cluster(3).await;
    let w0 = &workers[0];
    let ctx = w0.dist.context().unwrap();
    let id = ctx.id();
    let x = hop(&input(), &w0.param);
    // w0 -> w1 -> w2: w0 does not know w2; w1's fan-out tells it.
    let ((), out) = ctx
        .rpc_sync("w1", "hop", &vec!["w2".to_owned()], &[x], None)
        .await
        .unwrap();
    ctx.backward(&[(loss(&out[0]), None)], false).await.unwrap();
    for w in &workers {
        assert_eq!(w.dist.context_count(), 1);
    }
    ctx.release_in_background().unwrap();
    // Nothing was awaited: the context is gone here already, with its gradients.
    assert_eq!(w0.dist.context_count(), 0);
    assert!(w0.dist.gradients(id).is_none());
    wait_until(
        Duration::from_secs(5),
        "every worker dropped the context",
        || workers.iter().all(|w| w.dist.context_count() == 0),
    )
    .await;
    shutdown(workers).await;
}

/// `backward_here` (the first local pass on the calling thread; Python's `backward` uses it)
/// with an executor that runs every other pass and sends what it made from its own thread
/// (Python's GIL runners): the gradients of one process, for chains that come back to the
/// caller too, pass after pass, and every context released everywhere.
#[tokio::test(start_paused = true)]
async fn backward_here_with_an_executor_matches_one_process() {
    let workers = cluster(3).await;
    let jobs: Vec<Arc<std::sync::atomic::AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
    for (w, count) in workers.iter().zip(&jobs) {
        w.dist.set_inline_bound(Duration::ZERO);
        let count = count.clone();
        w.dist.set_executor(Arc::new(
            move |job: tensorwire_dist_autograd::BlockingJob| {
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Box::pin(async move {
                    let _ = tokio::task::spawn_blocking(job).await;
                })
            },
        ));
    }
    for route in [&[1usize, 2][..], &[1, 2, 0], &[2, 0, 1, 0]] {
        for _ in 0..2 {
            let w0 = &workers[0];
            let ctx = w0.dist.context().unwrap();
            let x = hop(&input(), &w0.param);
            let names: Vec<String> = route.iter().map(|r| format!("w{r}")).collect();
            let ((), out) = ctx
                .rpc_sync(&names[0], "hop", &names[1..].to_vec(), &[x], None)
                .await
                .unwrap();
            let rest = ctx.backward_here(&[(loss(&out[0]), None)], false).unwrap();
            rest.await.unwrap();
            for (rank, want) in local_route(route, 3).iter().enumerate() {
                if let Some(want) = want {
                    assert_close(
                        &grad_on(&workers, rank, ctx.id()),
                        want,
                        &format!("rank {rank}, route {route:?}"),
                    );
                }
            }
            ctx.release().await.unwrap();
            for w in &workers {
                assert_eq!(w.dist.context_count(), 0);
            }
        }
    }
    // The other workers' passes went through their executors.
    for rank in [1, 2] {
        assert!(
            jobs[rank].load(std::sync::atomic::Ordering::Relaxed) > 0,
            "rank {rank}"
        );
    }
    // A root that does not require grad is refused before anything runs.
    let ctx = workers[0].dist.context().unwrap();
    assert!(ctx.backward_here(&[(input(), None)], false).is_err());
    ctx.release().await.unwrap();
    shutdown(workers).await;
}
