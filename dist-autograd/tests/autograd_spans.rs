//! Every autograd context runs in an `autograd_context` span (worker, context): the calls made
//! in it, its backward pass and its release, and the other workers' parts of them. Its own test
//! binary: `tracing` caches per call site whether anyone listens, so a capturing subscriber must
//! not share a process with tests that log without one.

use std::time::Duration;

use tensorwire_autograd_candle::candle_core::{Device, Tensor as CTensor, Var};
use tensorwire_autograd_candle::CandleEngine;
use tensorwire_dist_autograd::{AutogradCall, DistAutograd};
use tensorwire_rpc::Shutdown;
use tensorwire_testkit::{CapturedLogs, TcpCluster};
use tracing_subscriber::fmt::format::FmtSpan;

// One thread: every agent task runs on it, so the thread's subscriber sees them all.
#[tokio::test(flavor = "current_thread")]
async fn a_context_s_calls_backward_and_release_run_in_its_span() {
    let logs = CapturedLogs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_span_events(FmtSpan::CLOSE)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    // Real loopback TCP; the agents listen on port 0 and meet through a file store.
    let cluster = TcpCluster::new();
    let agents = cluster
        .group(2, |_, o| {
            o.secret = Some(b"autograd span test secret".to_vec())
        })
        .await
        .unwrap();
    let dists: Vec<_> = agents
        .iter()
        .map(|a| DistAutograd::new(a, CandleEngine::new()).unwrap())
        .collect();
    dists[1]
        .register(
            "square",
            |_call: AutogradCall<CandleEngine>, (): (), ts: Vec<CTensor>| async move {
                Ok(((), vec![ts[0].sqr().map_err(|e| e.to_string())?]))
            },
        )
        .unwrap();

    let x = Var::from_tensor(&CTensor::from_vec(vec![1f32, 2.0, 3.0], 3, &Device::Cpu).unwrap())
        .unwrap()
        .as_tensor()
        .clone();
    let ctx = dists[0].context().unwrap();
    let id = ctx.id();
    let ((), out) = ctx
        .rpc_sync::<_, ()>("w1", "square", &(), std::slice::from_ref(&x), None)
        .await
        .unwrap();
    ctx.backward(&[(out[0].sum_all().unwrap(), None)], false)
        .await
        .unwrap();
    // d/dx sum(x^2) = 2x, computed across the two workers.
    let grad = ctx.gradient(&x).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(grad, vec![2.0, 4.0, 6.0]);
    ctx.release().await.unwrap();
    // A graceful shutdown waits for every member: all at once.
    let stopping: Vec<_> = agents
        .into_iter()
        .map(|a| {
            tokio::spawn(async move {
                a.shutdown(Shutdown::graceful(Duration::from_secs(10)))
                    .await
            })
        })
        .collect();
    for s in stopping {
        s.await.unwrap().unwrap();
    }

    let text = logs.text();
    let closed = |worker: &str| {
        text.lines()
            .filter(|l| {
                l.contains("autograd_context")
                    && l.contains(&format!("worker={worker}"))
                    && l.contains(&format!("context={id}"))
                    && l.contains("close")
            })
            .count()
    };
    // The trainer's context (its call and backward) and its release; the callee's call,
    // gradient request and release. (The gradient for x rides in the answer to w1's gradient
    // request, so w0 serves no request of its own.)
    assert!(closed("w0") >= 2, "w0's spans of {id}:\n{text}");
    assert!(closed("w1") >= 3, "w1's spans of {id}:\n{text}");
}
