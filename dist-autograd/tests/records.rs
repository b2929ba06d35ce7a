//! What a context holds, as PyTorch's `DistAutogradContext` internals show it: the workers it
//! reached (a call without tracked tensors counts), its send and recv functions (only
//! messages that carried tracked tensors), on the caller and the callees; and how many
//! contexts have backward work running on a worker, counted from inside a run of its engine.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensorwire_autograd_candle::candle_core::{Device, Tensor as CTensor, Var};
use tensorwire_autograd_candle::CandleEngine;
use tensorwire_dist_autograd::{AutogradCall, BlockingJob, DistAutograd};
use tensorwire_testkit::MemoryCluster;

type Dist = DistAutograd<CandleEngine>;

fn leaf(values: &[f32]) -> CTensor {
    let t = CTensor::from_vec(values.to_vec(), values.len(), &Device::Cpu).unwrap();
    Var::from_tensor(&t).unwrap().as_tensor().clone()
}

fn values(t: &CTensor) -> Vec<f32> {
    t.to_vec1::<f32>().unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_context_shows_its_known_workers_send_and_recv_functions_and_running_passes() {
    let cluster = MemoryCluster::new();
    let agents = cluster.group(3, |_, _| {}).await.unwrap();
    let dists: Vec<Dist> = agents
        .iter()
        .map(|a| Dist::new(a, CandleEngine::new()).unwrap())
        .collect();
    for d in &dists {
        // double(x) = 2x: the result carries tracked tensors back when x does.
        d.register(
            "double",
            |_call: AutogradCall<CandleEngine>, (): (), ts: Vec<CTensor>| async move {
                let out = ts.iter().map(|t| (t * 2.0).unwrap()).collect();
                Ok(((), out))
            },
        )
        .unwrap();
    }
    // w1 runs its engine's passes through an executor that first counts the contexts with
    // backward work running on w1.
    let seen: Arc<Mutex<Vec<usize>>> = Arc::default();
    {
        let (d1, seen) = (dists[1].clone(), seen.clone());
        dists[1].set_inline_bound(Duration::ZERO);
        dists[1].set_executor(Arc::new(move |job: BlockingJob| {
            seen.lock().unwrap().push(d1.backward_passes());
            Box::pin(async move {
                let _ = tokio::task::spawn_blocking(job).await;
            })
        }));
    }

    let ctx = dists[0].context().unwrap();
    let x = leaf(&[1.0, -2.0, 0.5]);
    let ((), out) = ctx
        .rpc_sync::<_, ()>("w1", "double", &(), std::slice::from_ref(&x), None)
        .await
        .unwrap();
    // A call without tracked tensors: w2 holds the context, but no function is recorded.
    let ((), none) = ctx
        .rpc_sync::<_, ()>("w2", "double", &(), &[], None)
        .await
        .unwrap();
    assert!(none.is_empty());

    assert_eq!(ctx.known_workers(), vec![1, 2]);
    let sends = ctx.send_functions();
    assert_eq!(sends.len(), 1, "one send function: {sends:?}");
    assert_eq!(sends[0].peer, 1);
    assert_eq!(values(&sends[0].tensors[0]), values(&x));
    let recvs = ctx.recv_functions();
    assert_eq!(recvs.len(), 1, "one recv function: {recvs:?}");
    assert_eq!(recvs[0].peer, 1);
    assert_eq!(values(&recvs[0].tensors[0]), vec![2.0, -4.0, 1.0]);

    // On w1: the recv of x from w0 and the send of its result back.
    let on1 = dists[1].retrieve(ctx.id()).unwrap();
    assert_eq!(on1.known_workers(), vec![0]);
    let (sends1, recvs1) = (on1.send_functions(), on1.recv_functions());
    assert_eq!((sends1.len(), recvs1.len()), (1, 1));
    assert_eq!((sends1[0].peer, recvs1[0].peer), (0, 0));
    assert_eq!(recvs1[0].message, sends[0].message, "w0's message id");
    assert_eq!(sends1[0].message, recvs[0].message, "w1's message id");
    // On w2: the context, with no function.
    let on2 = dists[2].retrieve(ctx.id()).unwrap();
    assert_eq!(on2.known_workers(), vec![0]);
    assert!(on2.send_functions().is_empty() && on2.recv_functions().is_empty());

    assert!(dists.iter().all(|d| d.backward_passes() == 0));
    let y = out[0].sqr().unwrap().sum_all().unwrap();
    ctx.backward(&[(y, None)], false).await.unwrap();
    // w1's pass ran while its part of the backward was running there: one pass.
    assert_eq!(*seen.lock().unwrap(), vec![1]);
    assert!(dists.iter().all(|d| d.backward_passes() == 0));

    // Released: gone on w0 and, by the release's fan-out, on w1 (its records read empty).
    ctx.release().await.unwrap();
    assert_eq!(dists[0].context_count(), 0);
    assert!(on1.known_workers().is_empty() && on1.send_functions().is_empty());
    // Every member shuts down at once (a graceful shutdown waits for the others).
    let shutdowns = agents.into_iter().map(|a| {
        tokio::spawn(async move {
            a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(20)))
                .await
        })
    });
    for t in shutdowns.collect::<Vec<_>>() {
        t.await.unwrap().unwrap();
    }
}
