//! A registered function that takes its reply (`tensorwire_rpc::Reply::take`) and sends it
//! from a thread of its own, as the Python layer's runners do: the caller gets the value (or
//! the error, when the reply is dropped unsent), once; the callee counts the request as
//! served until then, and not after.

use std::time::Duration;

use tensorwire_rpc::{Agent, Functions, RemoteErrorKind, Reply};
use tensorwire_testkit::{wait_until, TcpCluster};
use tokio::sync::Semaphore;

const T: Duration = Duration::from_secs(30);

/// `double(x)` answers from a thread of its own once the gate opens; `drop_it(())` drops its
/// reply on a thread of its own; `take_twice(())` answers whether a second take found nothing;
/// `remote_take(())` (a `remote()` constructor) answers whether it could take its reply.
fn functions(gate: &std::sync::Arc<Semaphore>) -> Functions {
    let f = Functions::new();
    let g = gate.clone();
    f.register("double", move |x: i64| {
        let g = g.clone();
        async move {
            let reply = Reply::take().ok_or("no reply to take")?;
            let runtime = tokio::runtime::Handle::current();
            let open = g.acquire_owned().await.map_err(|e| e.to_string())?;
            std::thread::spawn(move || {
                let _in = runtime.enter();
                reply.send(Ok::<_, String>(x * 2));
                drop(open);
            });
            // Ignored: the reply was taken.
            Ok::<i64, String>(-1)
        }
    })
    .unwrap();
    f.register("drop_it", |(): ()| async move {
        let reply = Reply::take().ok_or("no reply to take")?;
        let runtime = tokio::runtime::Handle::current();
        std::thread::spawn(move || {
            let _in = runtime.enter();
            drop(reply);
        });
        Ok::<(), String>(())
    })
    .unwrap();
    f.register("take_twice", |(): ()| async move {
        let first = Reply::take().ok_or("no reply to take")?;
        let second = Reply::take().is_none();
        first.send(Ok::<_, String>(second));
        Ok::<bool, String>(false)
    })
    .unwrap();
    f.register("remote_take", |(): ()| async move {
        Ok::<bool, String>(Reply::take().is_some())
    })
    .unwrap();
    f
}

async fn pair(gate: &std::sync::Arc<Semaphore>) -> (TcpCluster, Vec<Agent>) {
    let cluster = TcpCluster::new();
    let agents = cluster
        .group(2, |_, o| {
            o.secret = Some(b"reply elsewhere test secret".to_vec());
            o.functions = functions(gate);
        })
        .await
        .unwrap();
    (cluster, agents)
}

fn served(agent: &Agent) -> usize {
    agent
        .debug_info()
        .protocol
        .requests_being_served
        .values()
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_taken_by_its_function_is_sent_from_the_thread_that_holds_it() {
    let gate = std::sync::Arc::new(Semaphore::new(0));
    let (_cluster, agents) = pair(&gate).await;
    let (a, b) = (&agents[0], agents[1].clone());

    // The call waits for the gate, counted as served on the callee meanwhile.
    let call = a
        .rpc_async::<_, i64>("w1", "double", &21i64, Some(T))
        .unwrap();
    wait_until("the callee serves the call", T, || served(&b) == 1).await;
    gate.add_permits(1);
    assert_eq!(
        call.await.unwrap(),
        42,
        "the value sent, not the function's own"
    );
    wait_until("the callee served it", T, || served(&b) == 0).await;

    // Many at once, each answered once with its own value.
    gate.add_permits(64);
    let calls: Vec<_> = (0..32i64)
        .map(|i| a.rpc_async::<_, i64>("w1", "double", &i, Some(T)).unwrap())
        .collect();
    for (i, c) in calls.into_iter().enumerate() {
        assert_eq!(c.await.unwrap(), 2 * i as i64);
    }

    // Dropped unsent: the caller gets an error saying so, not a timeout.
    let e = a
        .rpc_sync::<_, ()>("w1", "drop_it", &(), Some(T))
        .await
        .unwrap_err();
    assert_eq!(e.remote().unwrap().kind, RemoteErrorKind::Failed);
    assert!(e.to_string().contains("dropped its reply unsent"), "{e}");

    // Taken once; a `remote()` constructor's reply is its kept value, never taken.
    assert!(a
        .rpc_sync::<_, bool>("w1", "take_twice", &(), Some(T))
        .await
        .unwrap());
    let r = a
        .remote::<_, bool>("w1", "remote_take", &(), Some(T))
        .unwrap();
    assert!(!r.to_here(Some(T)).await.unwrap());
    assert!(Reply::take().is_none(), "no reply outside a call");
    wait_until("the callee serves nothing", T, || served(&b) == 0).await;
    for a in agents {
        a.shutdown(tensorwire_rpc::Shutdown::Immediate)
            .await
            .unwrap();
    }
}
