//! A worker process for the multi-process distributed autograd tests:
//! `tw-autograd-worker SCENARIO`, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
//! TENSORWIRE_SECRET in the environment, and the candle engine.
//!
//! Scenarios (3 workers, `w0`, `w1`, `w2`; `w0` drives):
//! - `gradients`: a chain, a longer chain, A→B→C→A, a diamond with a tensor sent twice, RRef
//!   method calls; every worker checks its own gradients against the same model computed in one
//!   engine (relative 1e-5);
//! - `concurrent`: `w0` and `w1` train through `w2` at once;
//! - `kill`: `w0` runs a backward through `w1` to `w2`; `w2` prints `IN_BACKWARD` inside its
//!   backward (the test SIGKILLs it then); `w0` checks the backward fails naming `w2` and that
//!   the survivors hold no context;
//! - `violation`: `w2` sends `w1` a gradient for a context it is not part of; `w1` drops `w2`
//!   for it (`LostCause::Misbehaved` naming the autograd violation) and keeps working with
//!   `w0`; every worker stops at once (a graceful shutdown fails once a member was lost);
//! - `lost`: `w2` opens a context (forward w2→w1→w0 and back, no backward), `w0` opens one
//!   through `w2` and one through `w1` only; `w0` checks the counts and prints `CONTEXTS_OPEN`
//!   (the test SIGKILLs `w2` then); `w0` waits (bounded) until it and `w1` hold only the context `w2` never saw, prints
//!   `OK lost-counts w0=1 w1=1`, trains that context and releases it;
//! - `devices`: device maps w0→w1 `{cpu: cuda:H}`, w1→w2 `{cpu: cuda:0}`, and (to tell the
//!   reverse maps from the senders' own) w1→w0 `{cpu: cuda:0}`, w2→w1 `{cpu: cuda:H}`
//!   (`H` = 1 with two devices, else 0), on the device backend `TW_DEVICES` names (`simulated`,
//!   the default, or `cuda`); `w0` runs a chain and A→B→C→A, every worker checks its gradients,
//!   and each reports the devices gradients were copied to in the backward: none on `w0` (its
//!   tensors' gradients come back to the host, by the reverse maps), only `cuda:H` on `w1` and
//!   only `cuda:0` on `w2` (where the forward's tensors landed there).
//!
//! - `pytorch`: flows ported from PyTorch's `dist_autograd_test.py` and
//!   `dist_optimizer_test.py`: the usual model (the input needs no grad, the first stage on
//!   `w1` returns a tensor that does, and sends one on to `w2`); a backward failing on `w2`
//!   again and again (`test_multiple_backward_with_errors`: each fails naming `w2`, the context
//!   stays on every worker, and once `w2` recovers a backward succeeds with the right
//!   gradients); roots refused before anything runs (none, a non-scalar) with the real backward
//!   working afterwards; `to_here` inside a context (`test_backward_rref*`): a parameter on `w1`
//!   fetched tracked gets its gradient there and a `DistributedOptimizer` steps it, and tensors
//!   `w1` computed by `remote` from `w0`'s pass carry gradients back to `w0`.
//!
//! - `relay` (4 workers): `w3` guesses `w1`'s first context id and reaches `w0` with it first;
//!   `w1`'s pass in that context through `w2` to `w0` still goes through (`w0` asks `w1`, which
//!   vouches for the relay's capability) and its gradient is one engine's; nobody is dropped.
//!
//! With `MASTER_PORT=0`, rank 0's store listens on a port of the system's choosing and rank 0
//! prints where (see `tensorwire_tests::announce_store_addr`).
//!
//! Each prints `OK <scenario> rank R` when everything it checked held, and exits 0.

mod relay;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tensorwire_autograd_candle::candle_core::{Device, Tensor as CTensor, Var};
use tensorwire_autograd_candle::CandleEngine;
use tensorwire_core::autograd::{AutogradMessageId, BackwardError, ContextId};
use tensorwire_core::ports::autograd::{AutogradEngine, EngineError, LeafGradients};
use tensorwire_core::ports::device::DeviceBackend;
use tensorwire_core::tensor::Tensor;
use tensorwire_dist_autograd::{
    AutogradCall, DistAutograd, DistributedOptimizer, Optimizer, Parameter, Sgd, TensorList,
};
use tensorwire_rpc::{init_rpc, Agent, Functions, RRef, RpcOptions};
use tensorwire_testkit::RecordingDevices;

/// The candle engine, which on `w2` in the `kill` scenario announces its backward pass and
/// then hangs in it (so the test can kill the process mid-backward), and fails its backward
/// while `fail` is set (the `pytorch` scenario, which sets it through `fail_backward`).
#[derive(Clone)]
struct Engine {
    inner: CandleEngine,
    hang: bool,
    fail: Arc<AtomicBool>,
}

impl AutogradEngine for Engine {
    type Tensor = CTensor;
    type LeafId = <CandleEngine as AutogradEngine>::LeafId;
    fn leaf_id(&self, t: &CTensor) -> Self::LeafId {
        self.inner.leaf_id(t)
    }
    fn requires_grad(&self, t: &CTensor) -> bool {
        self.inner.requires_grad(t)
    }
    fn has_grad_fn(&self, t: &CTensor) -> bool {
        self.inner.has_grad_fn(t)
    }
    fn shape(&self, t: &CTensor) -> Vec<usize> {
        self.inner.shape(t)
    }
    fn dtype(&self, t: &CTensor) -> Option<tensorwire_core::tensor::DType> {
        self.inner.dtype(t)
    }
    fn import(&self, t: &Tensor, requires_grad: bool) -> Result<CTensor, EngineError> {
        self.inner.import(t, requires_grad)
    }
    fn export(&self, t: &CTensor) -> Result<Tensor, EngineError> {
        self.inner.export(t)
    }
    fn backward(
        &self,
        roots: &[(CTensor, Option<CTensor>)],
    ) -> Result<LeafGradients<Self>, EngineError> {
        if self.hang {
            println!("IN_BACKWARD");
            // Killed here by the test (or ended with it: its stdin closes).
            tensorwire_tests::hold_until_stdin_closes();
        }
        if self.fail.load(Ordering::SeqCst) {
            return Err(EngineError("simulated error on the backward pass".into()));
        }
        self.inner.backward(roots)
    }
    fn assign(&self, leaf: &CTensor, values: &Tensor) -> Result<(), EngineError> {
        self.inner.assign(leaf, values)
    }
    fn accumulate(&self, a: &CTensor, b: &CTensor) -> Result<CTensor, EngineError> {
        self.inner.accumulate(a, b)
    }
}

type Dist = DistAutograd<Engine>;

/// The backend `TW_DEVICES` names (`simulated`: two simulated CUDA devices; `cuda`), or why
/// it cannot be used here.
fn choose_devices() -> Result<Arc<dyn DeviceBackend>, String> {
    match std::env::var("TW_DEVICES").as_deref() {
        Err(_) | Ok("simulated") => Ok(Arc::new(
            tensorwire_core::devices_sim::SimulatedDevices::new(2),
        )),
        Ok("cuda") => {
            let cuda = tensorwire_devices_cuda::CudaDevices::new();
            match cuda.unavailable() {
                None => Ok(Arc::new(cuda)),
                Some(why) => Err(format!("no CUDA device for TW_DEVICES=cuda: {why}")),
            }
        }
        Ok(other) => Err(format!(
            "unknown TW_DEVICES={other:?}; use simulated or cuda"
        )),
    }
}

fn env(name: &str) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} must be set"))
}

fn param(rank: usize) -> CTensor {
    let r = rank as f32 + 1.0;
    let t = CTensor::from_vec(vec![0.1 * r, -0.2 + 0.05 * r, 0.3 / r], 3, &Device::Cpu).unwrap();
    Var::from_tensor(&t).unwrap().as_tensor().clone()
}

fn hop(h: &CTensor, p: &CTensor) -> CTensor {
    h.mul(p).unwrap().add(p).unwrap().tanh().unwrap()
}

fn input() -> CTensor {
    CTensor::new(&[0.5f32, -1.0, 2.0], &Device::Cpu).unwrap()
}

fn loss(t: &CTensor) -> CTensor {
    t.sqr().unwrap().sum_all().unwrap()
}

/// The cases `w0` runs; `local(case)` computes each in one engine.
const CASES: [&str; 6] = ["chain", "chain2", "cycle", "cycle2", "diamond", "rref"];

fn route(case: &str) -> &'static [usize] {
    match case {
        "chain" => &[1],
        "chain2" => &[1, 2],
        "cycle" => &[1, 2, 0],
        "cycle2" => &[2, 0, 1, 0],
        _ => &[],
    }
}

fn go(h: CTensor, route: &[usize], params: &[CTensor]) -> CTensor {
    let Some((first, rest)) = route.split_first() else {
        return h;
    };
    let z = go(hop(&h, &params[*first]), rest, params);
    (z * 2.0).unwrap()
}

/// The loss of `case` in one engine, and the gradient of every rank's parameter.
fn local(case: &str, scale: f64) -> (f32, Vec<Option<Vec<f32>>>) {
    let p: Vec<CTensor> = (0..3).map(param).collect();
    let x = (hop(&input(), &p[0]) * scale).unwrap();
    let y = match case {
        "diamond" => {
            let b = (hop(&x, &p[1]) * 2.0).unwrap();
            let c = (hop(&x, &p[2]) * 2.0).unwrap();
            b.mul(&c).unwrap().add(&b).unwrap()
        }
        "rref" => hop(&hop(&x, &p[1]), &p[1]),
        "list" => hop(&x, &p[1]),
        // The input needs no grad; w1's stage, then w2's hop (doubled), doubled on w1.
        "stage" => ((hop(&hop(&input(), &p[1]), &p[2]) * 2.0).unwrap() * 2.0).unwrap(),
        "via2" => (hop(&x, &p[2]) * 2.0).unwrap(),
        other => go(x, route(other), &p),
    };
    let l = loss(&y);
    let g = l.backward().unwrap();
    let grads = p
        .iter()
        .map(|p| g.get(p).map(|t| t.to_vec1::<f32>().unwrap()))
        .collect();
    (l.to_scalar::<f32>().unwrap(), grads)
}

struct Layer(CTensor);

impl serde::Serialize for Layer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.to_vec1::<f32>().unwrap().serialize(s)
    }
}

async fn start(scenario: &str) -> Result<(Agent, Dist, CTensor, usize), String> {
    let rank = env("RANK");
    let world = env("WORLD_SIZE");
    let mut options = RpcOptions {
        functions: Functions::new(),
        init_timeout: Duration::from_secs(60),
        rpc_timeout: Duration::from_secs(20),
        ..RpcOptions::default()
    };
    let recording = if scenario == "devices" {
        // Records where tensors land (the `devices` scenario).
        let backend = RecordingDevices::new(choose_devices()?);
        let hi = format!("cuda:{}", backend.device_count().min(2).saturating_sub(1));
        let maps: [Vec<(&str, &str)>; 3] = [
            vec![("w1", hi.as_str())],
            vec![("w2", "cuda:0"), ("w0", "cuda:0")],
            vec![("w1", hi.as_str())],
        ];
        for (to, target) in &maps[rank] {
            options
                .set_device_map(to, &[("cpu", target)])
                .map_err(|e| e.to_string())?;
        }
        options.device_backend = backend.clone();
        Some(backend)
    } else {
        None
    };
    let agent = init_rpc(&format!("w{rank}"), rank, Some(world), options)
        .await
        .map_err(|e| e.to_string())?;
    let fail = Arc::new(AtomicBool::new(false));
    let engine = Engine {
        inner: CandleEngine::new(),
        hang: scenario == "kill" && rank == 2,
        fail: fail.clone(),
    };
    let dist = Dist::new(&agent, engine).map_err(|e| e.to_string())?;
    let p = param(rank);
    let pp = p.clone();
    dist.register(
        "hop",
        move |call: AutogradCall<Engine>, route: Vec<String>, ts: Vec<CTensor>| {
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
    .expect("registered once");
    // The first stage of PyTorch's usual model: the input comes in the arguments (it needs no
    // grad), the result is tracked; then on along `route`.
    let pp = p.clone();
    dist.register(
        "stage",
        move |call: AutogradCall<Engine>, (x, route): (Vec<f32>, Vec<String>), ts: Vec<CTensor>| {
            let p = pp.clone();
            async move {
                if !ts.is_empty() {
                    return Err("the stage takes no tracked tensor".to_owned());
                }
                let x = CTensor::from_vec(x, 3, &Device::Cpu).map_err(|e| e.to_string())?;
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
    .expect("registered once");
    let (pp, engine) = (p.clone(), dist.engine().clone());
    dist.register_remote(
        "make_list",
        move |_call: AutogradCall<Engine>, (): (), ts: Vec<CTensor>| {
            let (p, engine) = (pp.clone(), engine.clone());
            async move { Ok(TensorList::new(&engine, vec![hop(&ts[0], &p)])) }
        },
    )
    .expect("registered once");
    let engine = dist.engine().clone();
    agent
        .functions()
        .register("make_parameter", move |(): ()| {
            let engine = engine.clone();
            async move { Ok::<_, String>(Parameter::new(&engine, param(rank))) }
        })
        .expect("registered once");
    agent
        .functions()
        .register_method(
            "param_values",
            |p: Arc<Parameter<Engine>>, (): ()| async move {
                p.tensor().to_vec1::<f32>().map_err(|e| e.to_string())
            },
        )
        .expect("registered once");
    agent
        .functions()
        .register("fail_backward", move |on: bool| {
            fail.store(on, Ordering::SeqCst);
            async move { Ok::<_, String>(()) }
        })
        .expect("registered once");
    dist.register_method(
        "forward",
        |_call: AutogradCall<Engine>, layer: Arc<Layer>, (): (), ts: Vec<CTensor>| async move {
            Ok(((), vec![hop(&ts[0], &layer.0)]))
        },
    )
    .expect("registered once");
    let pp = p.clone();
    agent
        .functions()
        .register("make_layer", move |(): ()| {
            let p = pp.clone();
            async move { Ok::<_, String>(Layer(p)) }
        })
        .expect("registered once");
    // Checks this worker's gradient in a context against the one-engine computation.
    let (d, pp, me) = (dist.clone(), p.clone(), rank);
    agent
        .functions()
        .register(
            "check",
            move |(context, case, scale): (ContextId, String, f64)| {
                let (d, p) = (d.clone(), pp.clone());
                async move {
                    let (_, want) = local(&case, scale);
                    // A worker the case never reached holds no context and expects no gradient.
                    let got = match d.gradients(context) {
                        Some(g) => g.get(&p.id()).map(|t| t.to_vec1::<f32>().unwrap()),
                        None if want[me].is_none() => None,
                        None => return Err(format!("w{me} does not hold {context}")),
                    };
                    match (&got, &want[me]) {
                        (Some(g), Some(w)) if close(g, w) => Ok(()),
                        (None, None) => Ok(()),
                        _ => Err(format!(
                            "w{me} {case}: gradient {got:?}, expected {:?}",
                            want[me]
                        )),
                    }
                }
            },
        )
        .expect("registered once");
    agent
        .functions()
        .register("devices_seen", move |(): ()| {
            let seen = recording.as_ref().map(|r| r.take()).unwrap_or_default();
            async move { Ok::<_, String>(seen) }
        })
        .expect("registered once");
    let d = dist.clone();
    agent
        .functions()
        .register("context_count", move |(): ()| {
            let d = d.clone();
            async move { Ok::<_, String>(d.context_count()) }
        })
        .expect("registered once");
    agent
        .barrier("autograd-setup", Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    Ok((agent, dist, p, rank))
}

fn close(got: &[f32], want: &[f32]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| (g - w).abs() <= 1e-5 * w.abs().max(1e-3))
}

async fn check_everywhere(
    agent: &Agent,
    context: ContextId,
    case: &str,
    scale: f64,
) -> Result<(), String> {
    for r in 0..3 {
        agent
            .rpc_sync::<_, ()>(
                format!("w{r}").as_str(),
                "check",
                &(context, case.to_owned(), scale),
                None,
            )
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

async fn finish(agent: Agent, graceful: bool) -> Result<(), String> {
    agent
        .shutdown(if graceful {
            tensorwire_rpc::Shutdown::graceful(Duration::from_secs(30))
        } else {
            tensorwire_rpc::Shutdown::Immediate
        })
        .await
        .map_err(|e| e.to_string())
}

async fn gradients() -> Result<(), String> {
    let (agent, dist, p, rank) = start("gradients").await?;
    if rank == 0 {
        for case in CASES {
            let ctx = dist.context().map_err(|e| e.to_string())?;
            let x = hop(&input(), &p);
            let y = match case {
                "diamond" => {
                    // The same tensor sent to w1 and w2 at once; w1's result used twice.
                    let none = Vec::<String>::new();
                    let b = ctx
                        .rpc_async::<_, ()>("w1", "hop", &none, std::slice::from_ref(&x), None)
                        .map_err(|e| e.to_string())?;
                    let c = ctx
                        .rpc_async::<_, ()>("w2", "hop", &none, std::slice::from_ref(&x), None)
                        .map_err(|e| e.to_string())?;
                    let ((), b) = b.await.map_err(|e| e.to_string())?;
                    let ((), c) = c.await.map_err(|e| e.to_string())?;
                    b[0].mul(&c[0]).unwrap().add(&b[0]).unwrap()
                }
                "rref" => {
                    let layer: RRef<Layer> = agent
                        .remote("w1", "make_layer", &(), None)
                        .map_err(|e| e.to_string())?;
                    let ((), h) = ctx
                        .rref_rpc_sync(&layer, "forward", &(), &[x], None)
                        .await
                        .map_err(|e| e.to_string())?;
                    let ((), y) = ctx
                        .rref_rpc_sync(&layer, "forward", &(), &h, None)
                        .await
                        .map_err(|e| e.to_string())?;
                    y[0].clone()
                }
                other => {
                    let names: Vec<String> = route(other).iter().map(|r| format!("w{r}")).collect();
                    let ((), out) = ctx
                        .rpc_sync(&names[0], "hop", &names[1..].to_vec(), &[x], None)
                        .await
                        .map_err(|e| e.to_string())?;
                    out[0].clone()
                }
            };
            ctx.backward(&[(loss(&y), None)], false)
                .await
                .map_err(|e| e.to_string())?;
            check_everywhere(&agent, ctx.id(), case, 1.0).await?;
            ctx.release().await.map_err(|e| e.to_string())?;
            println!("OK case {case}");
        }
        for r in 0..3 {
            let n: usize = agent
                .rpc_sync(format!("w{r}").as_str(), "context_count", &(), None)
                .await
                .map_err(|e| e.to_string())?;
            if n != 0 {
                return Err(format!("w{r} still holds {n} contexts"));
            }
        }
    }
    finish(agent, true).await?;
    println!("OK gradients rank {rank}");
    Ok(())
}

async fn concurrent() -> Result<(), String> {
    let (agent, dist, p, rank) = start("concurrent").await?;
    if rank < 2 {
        // w0 and w1 each train through w2, at the same time, several times.
        for _ in 0..5 {
            let ctx = dist.context().map_err(|e| e.to_string())?;
            let scale = if rank == 0 { 1.0 } else { 3.0 };
            // w1 plays w0's part with its own parameter: compare against rank 0's model with
            // w1's parameter standing in, computed here.
            let x = (hop(&input(), &p) * scale).unwrap();
            let ((), y) = ctx
                .rpc_sync("w2", "hop", &Vec::<String>::new(), &[x], None)
                .await
                .map_err(|e| e.to_string())?;
            ctx.backward(&[(loss(&y[0]), None)], false)
                .await
                .map_err(|e| e.to_string())?;
            let mine = ctx.gradient(&p).map(|t| t.to_vec1::<f32>().unwrap());
            let want = {
                let ps = [param(rank), param(2)];
                let x = (hop(&input(), &ps[0]) * scale).unwrap();
                let g = loss(&(hop(&x, &ps[1]) * 2.0).unwrap()).backward().unwrap();
                g.get(&ps[0]).map(|t| t.to_vec1::<f32>().unwrap())
            };
            match (&mine, &want) {
                (Some(a), Some(b)) if close(a, b) => {}
                _ => return Err(format!("w{rank}: gradient {mine:?}, expected {want:?}")),
            }
            ctx.release().await.map_err(|e| e.to_string())?;
        }
        println!("OK trained rank {rank}");
    }
    agent
        .barrier("trained", Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    if dist.context_count() != 0 {
        return Err(format!(
            "w{rank} still holds {} contexts",
            dist.context_count()
        ));
    }
    finish(agent, true).await?;
    println!("OK concurrent rank {rank}");
    Ok(())
}

async fn kill() -> Result<(), String> {
    let (agent, dist, p, rank) = start("kill").await?;
    dist.set_timeout(Duration::from_secs(20));
    if rank == 0 {
        let ctx = dist.context().map_err(|e| e.to_string())?;
        let x = hop(&input(), &p);
        let route = vec!["w2".to_owned()];
        let ((), out) = ctx
            .rpc_sync("w1", "hop", &route, &[x], None)
            .await
            .map_err(|e| e.to_string())?;
        let t0 = std::time::Instant::now();
        let e = match ctx.backward(&[(loss(&out[0]), None)], false).await {
            Ok(()) => return Err("the backward succeeded with w2 killed".into()),
            Err(e) => e.to_string(),
        };
        println!(
            "OK backward-error after_ms={} {e}",
            t0.elapsed().as_millis()
        );
        if !e.contains("w2") {
            return Err(format!("the error does not name w2: {e}"));
        }
        ctx.release().await.map_err(|e| e.to_string())?;
        let n1: usize = agent
            .rpc_sync("w1", "context_count", &(), None)
            .await
            .map_err(|e| e.to_string())?;
        let n0 = dist.context_count();
        println!("OK context-counts w0={n0} w1={n1}");
        if (n0, n1) != (0, 0) {
            return Err(format!("contexts left: w0 {n0}, w1 {n1}"));
        }
        release_w1(&agent).await;
    }
    if rank == 1 {
        wait_done(&agent).await;
    }
    if rank == 2 {
        // Waits to be killed inside its backward.
        tensorwire_tests::hold_until_stdin_closes_async().await;
    }
    // w2 is dead: no graceful shutdown.
    finish(agent, false).await?;
    println!("OK kill rank {rank}");
    Ok(())
}

/// Tells w1 (waiting in [`wait_done`]) that it may leave; its answer may be cut off.
async fn release_w1(agent: &Agent) {
    if let Err(e) = agent.rpc_sync::<_, ()>("w1", "done", &(), None).await {
        println!("w1 left: {e}");
    }
}

/// Waits (bounded) until w0 says it may leave.
async fn wait_done(agent: &Agent) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let tx = std::sync::Mutex::new(Some(tx));
    agent
        .functions()
        .register("done", move |(): ()| {
            let tx = tx.lock().unwrap().take();
            async move {
                if let Some(tx) = tx {
                    let _ = tx.send(());
                }
                Ok::<_, String>(())
            }
        })
        .expect("registered once");
    let _ = tokio::time::timeout(Duration::from_secs(90), rx).await;
}

async fn lost() -> Result<(), String> {
    let (agent, dist, p, rank) = start("lost").await?;
    let none = Vec::<String>::new();
    if rank == 2 {
        // Opens a context on w0's request (w2 -> w1 -> w0 and back), keeps it, and waits to
        // be killed.
        let (d, pp) = (dist.clone(), p.clone());
        let kept = Arc::new(std::sync::Mutex::new(Vec::new()));
        agent
            .functions()
            .register("open_context", move |(): ()| {
                let (d, p, kept) = (d.clone(), pp.clone(), kept.clone());
                async move {
                    let ctx = d.context().map_err(|e| e.to_string())?;
                    let route = vec!["w0".to_owned()];
                    ctx.rpc_sync::<_, ()>("w1", "hop", &route, &[hop(&input(), &p)], None)
                        .await
                        .map_err(|e| e.to_string())?;
                    kept.lock().unwrap().push(ctx);
                    Ok::<_, String>(())
                }
            })
            .expect("registered once");
    }
    agent
        .barrier("lost-ready", Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    if rank == 1 {
        wait_done(&agent).await;
    }
    if rank == 0 {
        let via2 = dist.context().map_err(|e| e.to_string())?;
        via2.rpc_sync::<_, ()>("w2", "hop", &none, &[hop(&input(), &p)], None)
            .await
            .map_err(|e| e.to_string())?;
        let mine = dist.context().map_err(|e| e.to_string())?;
        let ((), out) = mine
            .rpc_sync("w1", "hop", &none, &[hop(&input(), &p)], None)
            .await
            .map_err(|e| e.to_string())?;
        agent
            .rpc_sync::<_, ()>("w2", "open_context", &(), None)
            .await
            .map_err(|e| e.to_string())?;
        let counts = |agent: Agent, dist: Dist| async move {
            let n1: usize = agent
                .rpc_sync("w1", "context_count", &(), None)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((dist.context_count(), n1))
        };
        let before = counts(agent.clone(), dist.clone()).await?;
        if before != (3, 2) {
            return Err(format!("before the death: contexts (w0, w1) = {before:?}"));
        }
        // The test kills w2 now; survivors must drop its contexts on their own (no backward
        // runs).
        println!("CONTEXTS_OPEN");
        let t0 = std::time::Instant::now();
        let limit = Duration::from_secs(30);
        loop {
            let now = counts(agent.clone(), dist.clone()).await?;
            if now == (1, 1) {
                break;
            }
            if t0.elapsed() > limit {
                return Err(format!("contexts (w0, w1) = {now:?} after {limit:?}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "OK lost-counts w0=1 w1=1 after_ms={}",
            t0.elapsed().as_millis()
        );
        mine.backward(&[(loss(&out[0]), None)], false)
            .await
            .map_err(|e| e.to_string())?;
        let (_, want) = local("chain", 1.0);
        let got = mine.gradient(&p).map(|t| t.to_vec1::<f32>().unwrap());
        match (&got, &want[0]) {
            (Some(g), Some(w)) if close(g, w) => {}
            _ => return Err(format!("w0: gradient {got:?}, expected {:?}", want[0])),
        }
        mine.release().await.map_err(|e| e.to_string())?;
        via2.release().await.map_err(|e| e.to_string())?;
        let after = counts(agent.clone(), dist.clone()).await?;
        if after != (0, 0) {
            return Err(format!("after the release: contexts (w0, w1) = {after:?}"));
        }
        println!("OK lost-released");
        release_w1(&agent).await;
    }
    if rank == 2 {
        tensorwire_tests::hold_until_stdin_closes_async().await;
    }
    finish(agent, false).await?;
    println!("OK lost rank {rank}");
    Ok(())
}

async fn devices() -> Result<(), String> {
    let (agent, dist, p, rank) = start("devices").await?;
    if rank == 0 {
        let hi = format!(
            "cuda:{}",
            choose_devices()?.device_count().min(2).saturating_sub(1)
        );
        for case in ["chain2", "cycle"] {
            let ctx = dist.context().map_err(|e| e.to_string())?;
            let names: Vec<String> = route(case).iter().map(|r| format!("w{r}")).collect();
            let ((), out) = ctx
                .rpc_sync(
                    &names[0],
                    "hop",
                    &names[1..].to_vec(),
                    &[hop(&input(), &p)],
                    None,
                )
                .await
                .map_err(|e| e.to_string())?;
            let mut seen = Vec::new();
            for r in 0..3 {
                let s: Vec<String> = agent
                    .rpc_sync(format!("w{r}").as_str(), "devices_seen", &(), None)
                    .await
                    .map_err(|e| e.to_string())?;
                seen.push(s);
            }
            println!("forward {case}: copies to devices {seen:?}");
            ctx.backward(&[(loss(&out[0]), None)], false)
                .await
                .map_err(|e| e.to_string())?;
            let mut seen = Vec::new();
            for r in 0..3 {
                let s: Vec<String> = agent
                    .rpc_sync(format!("w{r}").as_str(), "devices_seen", &(), None)
                    .await
                    .map_err(|e| e.to_string())?;
                seen.push(s);
            }
            println!("backward {case}: copies to devices {seen:?}");
            let only = |s: &[String], d: &str| !s.is_empty() && s.iter().all(|x| x == d);
            if !seen[0].is_empty() || !only(&seen[1], &hi) || !only(&seen[2], "cuda:0") {
                return Err(format!(
                    "{case}: gradients were copied to {seen:?}; expected none on w0, only {hi} on w1, only cuda:0 on w2"
                ));
            }
            check_everywhere(&agent, ctx.id(), case, 1.0).await?;
            ctx.release().await.map_err(|e| e.to_string())?;
            println!("OK case {case}");
        }
    }
    finish(agent, true).await?;
    println!("OK devices rank {rank}");
    Ok(())
}

async fn violation() -> Result<(), String> {
    let (agent, dist, p, rank) = start("violation").await?;
    #[derive(serde::Serialize)]
    struct GradientRequest {
        context: ContextId,
        message: AutogradMessageId,
        grads: Vec<Option<Tensor>>,
    }
    // w1 follows its peers from the start: the drop is not missed.
    let mut events = agent.peer_events();
    if rank == 2 {
        let a = agent.clone();
        agent
            .functions()
            .register("attack", move |context: ContextId| {
                let a = a.clone();
                async move {
                    let outsider = GradientRequest {
                        context,
                        message: AutogradMessageId::new(1, 0),
                        grads: vec![None],
                    };
                    // w1 drops this worker before it answers: the call fails.
                    match a
                        .rpc_sync::<_, Result<(), BackwardError>>(
                            "w1",
                            "__tw_autograd/grad",
                            &outsider,
                            None,
                        )
                        .await
                    {
                        Ok(_) => Err("outsider: accepted".to_owned()),
                        Err(e) => {
                            println!("OK refused outsider: {e}");
                            Ok::<_, String>(())
                        }
                    }
                }
            })
            .expect("registered once");
    }
    // w2's function is registered before anyone calls it.
    agent
        .barrier("armed", Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    if rank == 0 {
        // A context with w1 only; its id goes to w2, which is outside it.
        let ctx = dist.context().map_err(|e| e.to_string())?;
        let ((), out) = ctx
            .rpc_sync(
                "w1",
                "hop",
                &Vec::<String>::new(),
                &[hop(&input(), &p)],
                None,
            )
            .await
            .map_err(|e| e.to_string())?;
        agent
            .rpc_sync::<_, ()>("w2", "attack", &ctx.id(), None)
            .await
            .map_err(|e| e.to_string())?;
        // w1 carries on: the backward through it still works.
        ctx.backward(&[(loss(&out[0]), None)], false)
            .await
            .map_err(|e| e.to_string())?;
        check_everywhere(&agent, ctx.id(), "chain", 1.0).await?;
        ctx.release().await.map_err(|e| e.to_string())?;
    }
    if rank == 1 {
        let lost = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                match events.recv().await {
                    Some(tensorwire_rpc::PeerEvent::Lost { worker, cause }) => {
                        return Some((worker, cause))
                    }
                    Some(_) => {}
                    None => return None,
                }
            }
        })
        .await
        .map_err(|_| "w1 dropped no peer within 60 s".to_owned())?;
        match lost {
            Some((2, cause @ tensorwire_core::protocol::LostCause::Misbehaved(_)))
                if cause.to_string().contains("is not part of") =>
            {
                println!("OK dropped w2: {cause}")
            }
            other => {
                return Err(format!(
                    "w1 expected to drop w2 as misbehaved, got {other:?}"
                ))
            }
        }
    }
    if rank == 1 && dist.violations() != 1 {
        return Err(format!(
            "w1 counted {} violations, expected 1",
            dist.violations()
        ));
    }
    // The world group's mesh broke with the dropped connection (its barriers fail): w1 and
    // w2 stay until w0, which drives, is done and gone.
    if rank != 0 {
        tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                match events.recv().await {
                    Some(tensorwire_rpc::PeerEvent::Lost { worker: 0, .. }) | None => return,
                    Some(_) => {}
                }
            }
        })
        .await
        .map_err(|_| format!("rank {rank}: w0 did not stop within 60 s"))?;
    }
    // A graceful shutdown fails once a member was lost: every worker stops at once.
    finish(agent, false).await?;
    println!("OK violation rank {rank}");
    Ok(())
}

async fn pytorch() -> Result<(), String> {
    let (agent, dist, p, rank) = start("pytorch").await?;
    let fail = |on: bool| {
        let agent = agent.clone();
        async move {
            agent
                .rpc_sync::<_, ()>("w2", "fail_backward", &on, None)
                .await
                .map_err(|e| e.to_string())
        }
    };
    let counts = || async {
        let mut n = Vec::new();
        for r in 0..3 {
            let c: usize = agent
                .rpc_sync(format!("w{r}").as_str(), "context_count", &(), None)
                .await
                .map_err(|e| e.to_string())?;
            n.push(c);
        }
        Ok::<_, String>(n)
    };
    if rank == 0 {
        // The usual model: the input needs no grad; w1's stage returns a tracked tensor and
        // sends one on to w2.
        let ctx = dist.context().map_err(|e| e.to_string())?;
        let ((), y) = ctx
            .rpc_sync::<_, ()>(
                "w1",
                "stage",
                &(input().to_vec1::<f32>().unwrap(), vec!["w2".to_owned()]),
                &[],
                None,
            )
            .await
            .map_err(|e| e.to_string())?;
        ctx.backward(&[(loss(&y[0]), None)], false)
            .await
            .map_err(|e| e.to_string())?;
        check_everywhere(&agent, ctx.id(), "stage", 1.0).await?;
        ctx.release().await.map_err(|e| e.to_string())?;
        println!("OK case standard-model");

        // test_multiple_backward_with_errors: w2's backward fails, again and again; the
        // context stays everywhere; once w2 recovers a backward succeeds.
        let ctx = dist.context().map_err(|e| e.to_string())?;
        let ((), y) = ctx
            .rpc_sync(
                "w1",
                "hop",
                &vec!["w2".to_owned()],
                &[hop(&input(), &p)],
                None,
            )
            .await
            .map_err(|e| e.to_string())?;
        let l = loss(&y[0]);
        fail(true).await?;
        for _ in 0..3 {
            match ctx.backward(&[(l.clone(), None)], true).await {
                Ok(()) => return Err("a backward succeeded while w2 failed".into()),
                Err(e) => {
                    let e = e.to_string();
                    if !e.contains("w2") || !e.contains("simulated error") {
                        return Err(format!("the error does not name w2's failure: {e}"));
                    }
                }
            }
            if counts().await? != [1, 1, 1] {
                return Err(format!(
                    "contexts after a failed backward: {:?}",
                    counts().await?
                ));
            }
        }
        fail(false).await?;
        ctx.backward(&[(l, None)], false)
            .await
            .map_err(|e| e.to_string())?;
        check_everywhere(&agent, ctx.id(), "chain2", 1.0).await?;
        ctx.release().await.map_err(|e| e.to_string())?;
        println!("OK case backward-errors");

        // Roots: none, or a non-scalar without a seed, are refused at once and change nothing.
        let ctx = dist.context().map_err(|e| e.to_string())?;
        let ((), y) = ctx
            .rpc_sync(
                "w1",
                "hop",
                &Vec::<String>::new(),
                &[hop(&input(), &p)],
                None,
            )
            .await
            .map_err(|e| e.to_string())?;
        for roots in [vec![], vec![(y[0].clone(), None)]] {
            match ctx.backward(&roots, false).await {
                Err(tensorwire_dist_autograd::DistAutogradError::State(e)) => {
                    println!("refused: {e}")
                }
                other => return Err(format!("roots {} accepted: {other:?}", roots.len())),
            }
        }
        ctx.backward(&[(loss(&y[0]), None)], false)
            .await
            .map_err(|e| e.to_string())?;
        check_everywhere(&agent, ctx.id(), "chain", 1.0).await?;
        ctx.release().await.map_err(|e| e.to_string())?;
        println!("OK case roots");

        // to_here of a parameter on w1, tracked: its gradient reaches w1, where the
        // distributed optimizer steps it.
        let p1: RRef<Parameter<Engine>> = agent
            .remote("w1", "make_parameter", &(), None)
            .map_err(|e| e.to_string())?;
        let ctx = dist.context().map_err(|e| e.to_string())?;
        let w = ctx.to_here(&p1, None).await.map_err(|e| e.to_string())?;
        let l = loss(&hop(&hop(&input(), &p), &w[0]));
        ctx.backward(&[(l, None)], false)
            .await
            .map_err(|e| e.to_string())?;
        let opt =
            DistributedOptimizer::new(&dist, vec![p1.clone()], Optimizer::from(Sgd::new(0.5)))
                .map_err(|e| e.to_string())?;
        let stepped = opt.step(ctx.id()).await.map_err(|e| e.to_string())?;
        let got: Vec<f32> = p1
            .rpc_sync("param_values", &(), None)
            .await
            .map_err(|e| e.to_string())?;
        let (lp, g) = {
            let lp = [param(0), param(1)];
            let g = loss(&hop(&hop(&input(), &lp[0]), &lp[1]))
                .backward()
                .unwrap();
            (lp, g)
        };
        let want: Vec<f32> = lp[1]
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .zip(g.get(&lp[1]).unwrap().to_vec1::<f32>().unwrap())
            .map(|(p, g)| p - 0.5 * g)
            .collect();
        let mine = ctx.gradient(&p).map(|t| t.to_vec1::<f32>().unwrap());
        let want0 = g.get(&lp[0]).unwrap().to_vec1::<f32>().unwrap();
        if stepped != 1 || !close(&got, &want) || !mine.as_deref().is_some_and(|m| close(m, &want0))
        {
            return Err(format!(
                "to_here: stepped {stepped}, w1's parameter {got:?} (want {want:?}), w0's gradient {mine:?} (want {want0:?})"
            ));
        }
        ctx.release().await.map_err(|e| e.to_string())?;
        println!("OK case to-here-parameter");

        // Tensors w1 computed by `remote` from w0's pass, fetched back tracked.
        let ctx = dist.context().map_err(|e| e.to_string())?;
        let list: RRef<TensorList<Engine>> = ctx
            .remote("w1", "make_list", &(), &[hop(&input(), &p)], None)
            .map_err(|e| e.to_string())?;
        let h = ctx.to_here(&list, None).await.map_err(|e| e.to_string())?;
        ctx.backward(&[(loss(&h[0]), None)], false)
            .await
            .map_err(|e| e.to_string())?;
        check_everywhere(&agent, ctx.id(), "list", 1.0).await?;
        ctx.release().await.map_err(|e| e.to_string())?;
        drop((p1, list));
        if counts().await? != [0, 0, 0] {
            return Err(format!("contexts left: {:?}", counts().await?));
        }
        println!("OK case to-here-list");
    }
    finish(agent, true).await?;
    println!("OK pytorch rank {rank}");
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    tensorwire_tests::announce_store_addr();
    if scenario == "devices" {
        if let Err(why) = choose_devices() {
            // No such device here (say, `cuda` without a GPU): nothing to check.
            println!("SKIPPED: {why}");
            return ExitCode::SUCCESS;
        }
    }
    let result = match scenario.as_str() {
        "gradients" => gradients().await,
        "concurrent" => concurrent().await,
        "kill" => kill().await,
        "violation" => violation().await,
        "lost" => lost().await,
        "devices" => devices().await,
        "pytorch" => pytorch().await,
        "relay" => relay::relay().await,
        other => Err(format!("unknown scenario {other:?}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {}: {e}", std::env::var("RANK").unwrap_or_default());
            ExitCode::FAILURE
        }
    }
}
