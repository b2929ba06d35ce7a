//! `init_rpc` twice in one process, with a shutdown in between: shutdown lets go of what the
//! first agent held — the store (a `file://` store's file is gone, rank 0's store server is
//! closed and its port free) — when it returns, while the agents themselves live on.

use std::time::Duration;

use tensorwire_rpc::{init_rpc, Agent, Functions, RpcOptions};

const ROUNDS: usize = 50;
const WORLD: usize = 2;

fn functions() -> Functions {
    let f = Functions::new();
    f.register(
        "add",
        |(a, b): (i64, i64)| async move { Ok::<_, String>(a + b) },
    )
    .unwrap();
    f
}

/// A world of `WORLD` agents in this process, rendezvousing through `url(rank)`.
async fn world(url: impl Fn(usize) -> String) -> Vec<Agent> {
    let inits: Vec<_> = (0..WORLD)
        .map(|rank| {
            let options = RpcOptions {
                init_method: url(rank),
                init_timeout: Duration::from_secs(20),
                secret: Some(b"init twice".to_vec()),
                functions: functions(),
                ..RpcOptions::default()
            };
            tokio::spawn(
                async move { init_rpc(&format!("w{rank}"), rank, Some(WORLD), options).await },
            )
        })
        .collect();
    let mut agents = Vec::new();
    for init in inits {
        agents.push(init.await.unwrap().expect("init_rpc"));
    }
    agents
}

/// A call across, then every agent shuts down at once; the agents are returned, alive.
async fn use_and_shut_down(agents: &[Agent], graceful: bool) {
    let sum: i64 = agents[0]
        .rpc_sync("w1", "add", &(2i64, 3i64), None)
        .await
        .unwrap();
    assert_eq!(sum, 5);
    let shutdowns: Vec<_> = agents
        .iter()
        .cloned()
        .map(|a| {
            tokio::spawn(async move {
                a.shutdown(if graceful {
                    tensorwire_rpc::Shutdown::graceful(Duration::from_secs(20))
                } else {
                    tensorwire_rpc::Shutdown::Immediate
                })
                .await
            })
        })
        .collect();
    for s in shutdowns {
        s.await.unwrap().expect("shutdown");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_shutdown_init_with_a_file_store_50_times() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let url = |rank: usize| format!("file://{}?rank={rank}&world_size={WORLD}", path.display());
    for round in 0..ROUNDS {
        for graceful in [false, true] {
            let agents = world(url).await;
            use_and_shut_down(&agents, graceful).await;
            assert!(
                !path.exists(),
                "round {round} (graceful: {graceful}): the store's file outlived shutdown"
            );
            assert!(agents[0].store().is_err(), "the agent let go of the store");
            drop(agents);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_shutdown_init_with_a_tcp_store_on_one_port_50_times() {
    // One port for every round (init_rpc needs it up front on every rank): each init's rank 0
    // binds the port the previous one's store server had.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = |rank: usize| format!("tcp://127.0.0.1:{port}?rank={rank}&world_size={WORLD}");
    for round in 0..ROUNDS {
        for graceful in [false, true] {
            let agents = world(url).await;
            use_and_shut_down(&agents, graceful).await;
            // The store server is closed: the port is free again.
            let rebound = std::net::TcpListener::bind(("127.0.0.1", port));
            assert!(
                rebound.is_ok(),
                "round {round} (graceful: {graceful}): the store's port is still taken: {:?}",
                rebound.err()
            );
            drop(rebound);
            drop(agents);
        }
    }
}
