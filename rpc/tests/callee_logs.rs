//! What a callee does with calls it cannot serve: exact argument decoding, and warnings in its
//! own log. Its own test binary: `tracing` caches per call site whether anyone listens, so a
//! capturing subscriber must not share a process with tests that log without one.

use std::time::Duration;

use tensorwire_rpc::{Agent, Functions, RemoteErrorKind};
use tensorwire_testkit::CapturedLogs;
use tensorwire_testkit::TcpCluster;

fn functions() -> Functions {
    let f = Functions::new();
    f.register(
        "add",
        |(a, b): (i64, i64)| async move { Ok::<_, String>(a + b) },
    )
    .unwrap();
    f.register("len", |n: usize| async move { Ok::<_, String>(n) })
        .unwrap();
    f.register("fail", |msg: String| async move {
        Err::<(), _>(format!("refused: {msg}"))
    })
    .unwrap();
    f.register("boom", |(): ()| async move {
        if true {
            panic!("kaboom");
        }
        Ok::<(), String>(())
    })
    .unwrap();
    f
}

/// Two agents over real loopback TCP (the cluster keeps their rendezvous folder).
async fn pair() -> (TcpCluster, Vec<Agent>) {
    let cluster = TcpCluster::new();
    let agents = cluster
        .group(2, |_, o| {
            o.secret = Some(b"callee log test secret".to_vec());
            o.functions = functions();
        })
        .await
        .unwrap();
    (cluster, agents)
}

// One thread: every agent task runs on it, so the thread's log subscriber sees them all.
#[tokio::test(flavor = "current_thread")]
async fn arguments_decode_exactly_and_the_callee_logs_failures() {
    let logs = CapturedLogs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let (_cluster, agents) = pair().await;
    let a = &agents[0];

    // One argument too many: the extra bytes are refused, naming the function.
    let e = a
        .rpc_sync::<_, i64>("w1", "add", &(2i64, 3i64, 4i64), None)
        .await
        .unwrap_err();
    assert_eq!(e.remote().unwrap().kind, RemoteErrorKind::Serialization);
    let text = e.to_string();
    assert!(
        text.contains("\"add\"") && text.contains("left over"),
        "{text}"
    );
    // A wider type than the function takes is refused too.
    let e = a
        .rpc_sync::<_, usize>("w1", "len", &u128::MAX, None)
        .await
        .unwrap_err();
    assert_eq!(e.remote().unwrap().kind, RemoteErrorKind::Serialization);
    // An exact call still works.
    let five: i64 = a.rpc_sync("w1", "add", &(2i64, 3i64), None).await.unwrap();
    assert_eq!(five, 5);

    // A failing, a panicking and an unknown function are logged on the callee, naming the
    // function and the caller.
    for (function, args) in [("fail", "x".to_string()), ("boom", String::new())] {
        if function == "boom" {
            let _ = a.rpc_sync::<_, ()>("w1", function, &(), None).await;
        } else {
            let _ = a.rpc_sync::<_, ()>("w1", function, &args, None).await;
        }
    }
    let e = a
        .rpc_sync::<_, ()>("w1", "nope", &(), None)
        .await
        .unwrap_err();
    assert_eq!(e.remote().unwrap().kind, RemoteErrorKind::UnknownFunction);
    // A graceful shutdown while this worker still holds a reference says so at info (PyTorch
    // says nothing: holding one at shutdown is common), listing it.
    let held: tensorwire_rpc::RRef<usize> = a.remote("w1", "len", &3usize, None).unwrap();
    held.created().await.unwrap();
    let limit = Duration::from_secs(20);
    let (r0, r1) = tokio::join!(
        agents[0].shutdown(tensorwire_rpc::Shutdown::graceful(limit)),
        agents[1].shutdown(tensorwire_rpc::Shutdown::graceful(limit))
    );
    r0.unwrap();
    r1.unwrap();
    drop(held);

    let text = logs.text();
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no log line with {needle:?} in:\n{text}"))
            .to_owned()
    };
    let said = line("graceful shutdown while this worker still holds remote references");
    assert!(
        said.contains("INFO")
            && said.contains("w0 (rank 0)")
            && said.contains("on rank 1 (1 handles)"),
        "{said}"
    );
    for (needle, function) in [
        ("refused: x", "fail"),
        ("kaboom", "boom"),
        ("not registered", "nope"),
        ("left over", "add"),
    ] {
        let l = line(needle);
        assert!(
            l.contains("WARN")
                && l.contains(&format!("function={function}"))
                && l.contains("caller=w0"),
            "{l}"
        );
    }
}
