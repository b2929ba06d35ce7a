//! Typed functions between agents over real loopback TCP: a call through the descriptor, a
//! callee whose types differ (another binary's idea of "add"), and an untyped call of a typed
//! function, each refused with an error naming the function and the types.

use std::sync::Arc;
use std::time::Duration;

use tensorwire_rpc::{Agent, Function, Functions, Method, RemoteErrorKind};
use tensorwire_testkit::TcpCluster;

const ADD: Function<(i64, i64), i64> = Function::new("add");
/// What a binary built from other sources might call "add".
const OTHER_ADD: Function<(String,), i64> = Function::new("add");
const NEW_LIST: Function<usize, Vec<u32>> = Function::new("new_list");
const LEN: Method<Vec<u32>, (), usize> = Method::new("len");

/// Rank 0 serves `ADD` and the list functions; rank 1 serves `OTHER_ADD`.
async fn pair() -> (TcpCluster, Agent, Agent) {
    let cluster = TcpCluster::new();
    let mut agents = cluster
        .group(2, |rank, o| {
            let functions = Functions::new();
            if rank == 0 {
                functions
                    .serve(&ADD, |(a, b)| async move { Ok::<_, String>(a + b) })
                    .unwrap();
                functions
                    .serve(&NEW_LIST, |n| async move {
                        Ok::<_, String>((0..n as u32).collect())
                    })
                    .unwrap();
                functions
                    .serve_method(&LEN, |v: Arc<Vec<u32>>, ()| async move {
                        Ok::<_, String>(v.len())
                    })
                    .unwrap();
            } else {
                functions
                    .serve(
                        &OTHER_ADD,
                        |(s,)| async move { Ok::<_, String>(s.len() as i64) },
                    )
                    .unwrap();
            }
            o.functions = functions;
            o.secret = Some(b"typed test secret".to_vec());
        })
        .await
        .unwrap();
    let b = agents.pop().unwrap();
    (cluster, agents.pop().unwrap(), b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_calls_check_their_types_across_workers() {
    let (_cluster, w0, w1) = pair().await;

    // The same descriptor on both sides: the result is typed, no turbofish.
    let sum = w1.call(&ADD, "w0", &(2, 3)).await.unwrap();
    assert_eq!(sum, 5);
    let later = w1
        .call(&ADD, 0u32, &(4, 5))
        .timeout(Duration::from_secs(10))
        .send()
        .unwrap();
    assert_eq!(later.await.unwrap(), 9);

    // w1 serves "add" with other types: refused before decoding, naming both signatures.
    let e = w0.call(&ADD, "w1", &(2, 3)).await.unwrap_err();
    let remote = e.remote().expect("a remote error");
    assert_eq!(remote.kind, RemoteErrorKind::Serialization, "{e}");
    let text = e.to_string();
    assert!(text.contains("\"add\""), "{text}");
    assert!(text.contains("`(i64, i64) -> i64`"), "{text}");
    assert!(text.contains("`(alloc::string::String,) -> i64`"), "{text}");
    assert!(text.contains("fingerprint"), "{text}");

    // The dynamic form cannot reach a typed function without its fingerprint.
    let e = w1
        .rpc_sync::<_, i64>("w0", "add", &(2i64, 3i64), None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("carries no type fingerprint"), "{e}");

    // Typed remote values and methods.
    let list = w1.call(&NEW_LIST, "w0", &7).remote().unwrap();
    assert_eq!(list.call(&LEN, &()).await.unwrap(), 7);
    let len_ref = list.call(&LEN, &()).remote().unwrap();
    assert_eq!(len_ref.to_here(None).await.unwrap(), 7);
    drop((list, len_ref));

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
