//! A function registered with `register_responding` answers from a thread of its own (as the
//! Python layer's runners do): the result reaches the caller, the send of its tensors is
//! recorded, and the backward pass through it gives the exact gradients; on a current-thread
//! runtime (where the agent keeps the reply) the responder answers through the call's task.
//! A responder dropped unsent fails the call, saying so.

use std::time::Duration;

use tensorwire_autograd_candle::candle_core::{Device, Tensor as CTensor, Var};
use tensorwire_autograd_candle::CandleEngine;
use tensorwire_dist_autograd::{AutogradCall, DistAutograd, Responder};
use tensorwire_testkit::{wait_until, MemoryCluster};

type Dist = DistAutograd<CandleEngine>;

fn param(values: &[f32]) -> CTensor {
    let t = CTensor::from_vec(values.to_vec(), values.len(), &Device::Cpu).unwrap();
    Var::from_tensor(&t).unwrap().as_tensor().clone()
}

/// Two workers; w1's `scale(k)` computes `k * x * q` on a thread of its own and answers
/// `k + 1` with it; `drop_it` drops its responder there.
async fn run() {
    let cluster = MemoryCluster::new();
    let agents = cluster.group(2, |_, _| {}).await.unwrap();
    let (d0, d1) = (
        Dist::new(&agents[0], CandleEngine::new()).unwrap(),
        Dist::new(&agents[1], CandleEngine::new()).unwrap(),
    );
    let q = param(&[2.0, -1.0, 0.5]);
    let qq = q.clone();
    d1.register_responding(
        "scale",
        move |_call: AutogradCall<CandleEngine>,
              k: f32,
              ts: Vec<CTensor>,
              responder: Responder<CandleEngine, f32>| {
            let (q, runtime) = (qq.clone(), tokio::runtime::Handle::current());
            std::thread::spawn(move || {
                let _in = runtime.enter();
                let out = ts[0]
                    .mul(&q)
                    .and_then(|y| y.affine(f64::from(k), 0.0))
                    .map_err(|e| e.to_string());
                responder.send(out.map(|y| (k + 1.0, vec![y])));
            });
        },
    )
    .unwrap();
    d1.register_responding(
        "drop_it",
        |_call: AutogradCall<CandleEngine>,
         (): (),
         _ts: Vec<CTensor>,
         responder: Responder<CandleEngine, ()>| {
            let runtime = tokio::runtime::Handle::current();
            std::thread::spawn(move || {
                let _in = runtime.enter();
                drop(responder);
            });
        },
    )
    .unwrap();

    let p = param(&[0.5, 1.0, -2.0]);
    let ctx = d0.context().unwrap();
    let (k1, out) = ctx
        .rpc_sync::<_, f32>("w1", "scale", &3.0f32, std::slice::from_ref(&p), None)
        .await
        .unwrap();
    assert_eq!(k1, 4.0, "the result the responder sent");
    assert_eq!(out[0].to_vec1::<f32>().unwrap(), vec![3.0, -3.0, -3.0]);
    // d/dp of sum(3 * p * q) = 3q: the send of the result was recorded, the gradient came back.
    let loss = out[0].sum_all().unwrap();
    ctx.backward(&[(loss, None)], false).await.unwrap();
    let g = ctx.gradient(&p).expect("a gradient of p");
    assert_eq!(g.to_vec1::<f32>().unwrap(), vec![6.0, -3.0, 1.5]);
    ctx.release().await.unwrap();

    let ctx = d0.context().unwrap();
    let e = ctx
        .rpc_sync::<_, ()>("w1", "drop_it", &(), std::slice::from_ref(&p), None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("dropped its reply unsent"), "{e}");
    ctx.release().await.unwrap();
    drop(q);
    wait_until("w1 holds no context", Duration::from_secs(30), || {
        d1.context_count() == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responder_answers_from_its_own_thread() {
    run().await;
}

#[tokio::test(flavor = "current_thread")]
async fn on_a_current_thread_runtime_the_responder_answers_through_the_call() {
    run().await;
}
