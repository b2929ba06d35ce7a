//! The agent's counters and spans, read from the agent and through the `metrics` facade (a
//! recorder installed by the test, as an application installs its Prometheus exporter).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tensorwire_rpc::{Agent, Function, Functions};
use tensorwire_testkit::TcpCluster;

const ADD: Function<(i64, i64), i64> = Function::new("add");
const FAIL: Function<(), ()> = Function::new("fail");

/// Counters by `name{worker,peer}`; gauges are stored as their value's bits.
#[derive(Default)]
struct TestRecorder {
    values: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
}

struct Value(Arc<AtomicU64>);

impl metrics::CounterFn for Value {
    fn increment(&self, v: u64) {
        self.0.fetch_add(v, Ordering::Relaxed);
    }
    fn absolute(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
}

impl metrics::GaugeFn for Value {
    fn increment(&self, v: f64) {
        self.0.fetch_add(v as u64, Ordering::Relaxed);
    }
    fn decrement(&self, v: f64) {
        self.0.fetch_sub(v as u64, Ordering::Relaxed);
    }
    fn set(&self, v: f64) {
        self.0.store(v as u64, Ordering::Relaxed);
    }
}

impl TestRecorder {
    fn slot(&self, key: &Key) -> Arc<AtomicU64> {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        Arc::clone(self.values.lock().unwrap().entry(name).or_default())
    }

    fn get(&self, name: &str) -> u64 {
        self.values
            .lock()
            .unwrap()
            .get(name)
            .map_or(0, |v| v.load(Ordering::Relaxed))
    }
}

struct Shared(Arc<TestRecorder>);

impl Recorder for Shared {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(Arc::new(Value(self.0.slot(key))))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(Arc::new(Value(self.0.slot(key))))
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// Two agents over real loopback TCP (the cluster keeps their rendezvous folder).
async fn pair() -> (TcpCluster, Agent, Agent) {
    let cluster = TcpCluster::new();
    let mut agents = cluster
        .group(2, |_, o| {
            let functions = Functions::new();
            functions
                .serve(&ADD, |(a, b)| async move { Ok::<_, String>(a + b) })
                .unwrap();
            functions
                .serve(&FAIL, |()| async move { Err::<(), _>("asked to fail") })
                .unwrap();
            o.functions = functions;
            o.secret = Some(b"metrics test secret".to_vec());
        })
        .await
        .unwrap();
    let b = agents.pop().unwrap();
    (cluster, agents.pop().unwrap(), b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_per_peer_from_the_agent_and_the_facade() {
    let recorder = Arc::new(TestRecorder::default());
    metrics::set_global_recorder(Shared(Arc::clone(&recorder))).unwrap();
    let (_cluster, w0, w1) = pair().await;

    for i in 0..3 {
        assert_eq!(w0.call(&ADD, "w1", &(i, 1)).await.unwrap(), i + 1);
    }
    assert!(w0.call(&FAIL, "w1", &()).await.is_err());
    // A call made and not yet answered is in flight; once answered it is not.
    let pending = w0.call(&ADD, "w1", &(1, 1)).send().unwrap();
    assert_eq!(pending.await.unwrap(), 2);

    let m0 = w0.metrics();
    let to_w1 = m0.per_peer["w1"];
    assert_eq!(to_w1.calls_sent, 5, "{m0:?}");
    assert_eq!(to_w1.errors, 1, "{m0:?}");
    assert_eq!(to_w1.in_flight, 0, "{m0:?}");
    assert!(to_w1.bytes_sent >= 4 * 16, "{m0:?}");
    assert_eq!(m0.total, to_w1);

    let m1 = w1.metrics();
    let from_w0 = m1.per_peer["w0"];
    assert_eq!(from_w0.calls_received, 5, "{m1:?}");
    assert_eq!(
        from_w0.errors, 1,
        "the failed function counts on the callee too: {m1:?}"
    );
    assert_eq!(from_w0.bytes_received, to_w1.bytes_sent, "{m1:?}");

    // The same numbers through the facade.
    assert_eq!(
        recorder.get("tensorwire_rpc_calls_sent_total{worker=w0,peer=w1}"),
        5
    );
    assert_eq!(
        recorder.get("tensorwire_rpc_calls_received_total{worker=w1,peer=w0}"),
        5
    );
    assert_eq!(
        recorder.get("tensorwire_rpc_errors_total{worker=w0,peer=w1}"),
        1
    );
    assert_eq!(
        recorder.get("tensorwire_rpc_bytes_sent_total{worker=w0,peer=w1}"),
        to_w1.bytes_sent
    );
    assert_eq!(
        recorder.get("tensorwire_rpc_calls_in_flight{worker=w0,peer=w1}"),
        0
    );

    let (a, b) = (w0.clone(), w1.clone());
    let t0 = tokio::spawn(async move {
        a.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(20)))
            .await
    });
    let t1 = tokio::spawn(async move {
        b.shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(20)))
            .await
    });
    t0.await.unwrap().unwrap();
    t1.await.unwrap().unwrap();
}
