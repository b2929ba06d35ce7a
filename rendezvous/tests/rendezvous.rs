//! Rendezvous over real sockets, files and OS processes.

use std::process::{Command, Stdio};
use std::time::Duration;

use tensorwire_rendezvous::init_method::rendezvous_with_env;
use tensorwire_rendezvous::{rendezvous, RendezvousError, RendezvousOptions};
use tensorwire_store::ClusterSecret;

const LIMIT: Duration = Duration::from_secs(20);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn options() -> RendezvousOptions {
    RendezvousOptions {
        timeout: LIMIT,
        ..RendezvousOptions::default()
    }
}

fn env(rank: usize, world: usize, port: u16) -> impl Fn(&str) -> Option<String> {
    move |name| match name {
        "MASTER_ADDR" => Some("127.0.0.1".into()),
        "MASTER_PORT" => Some(port.to_string()),
        "RANK" => Some(rank.to_string()),
        "WORLD_SIZE" => Some(world.to_string()),
        _ => None,
    }
}

#[tokio::test]
async fn env_rendezvous_of_four_ranks_shares_one_store() {
    let port = free_port();
    let mut ranks = Vec::new();
    // Start the clients first: they retry until rank 0's server is up.
    for rank in (0..4).rev() {
        ranks.push(tokio::spawn(async move {
            let g = rendezvous_with_env("env://", options(), env(rank, 4, port)).await?;
            assert_eq!((g.rank, g.world_size), (rank, 4));
            assert_eq!(g.server_addr().is_some(), rank == 0);
            g.store
                .set(&format!("hello/{rank}"), rank.to_string().as_bytes())
                .await
                .unwrap();
            for other in 0..4 {
                let v = g.store.get(&format!("hello/{other}")).await.unwrap();
                assert_eq!(v, other.to_string().as_bytes());
            }
            // Rank 0 hosts the store: it stays until everyone has read everything.
            g.store.add("finished", 1).await.unwrap();
            if rank == 0 {
                while g.store.get("finished").await.unwrap() != b"4" {
                    g.store
                        .wait(&["never"], Duration::from_millis(5))
                        .await
                        .ok();
                }
            }
            Ok::<_, RendezvousError>(rank)
        }));
    }
    for r in ranks {
        tokio::time::timeout(LIMIT, r)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

#[tokio::test]
async fn tcp_join_timeout_says_how_many_arrived() {
    // A standalone server (as `tensorwire store serve`), so that every rank outlives its
    // deadline and reports it, rather than losing rank 0's store.
    let server = tensorwire_store::TcpStoreServer::bind(
        "127.0.0.1:0",
        tensorwire_store::ServerConfig::default(),
    )
    .await
    .unwrap();
    let port = server.local_addr().port();
    let opts = RendezvousOptions {
        timeout: Duration::from_millis(400),
        embed_server: false,
        ..RendezvousOptions::default()
    };
    let url = |rank| format!("tcp://127.0.0.1:{port}?rank={rank}&world_size=3");
    let r0 = tokio::spawn({
        let (url, opts) = (url(0), opts.clone());
        async move { rendezvous(&url, opts).await }
    });
    let r1 = rendezvous(&url(1), opts).await;
    let r0 = r0.await.unwrap();
    for result in [r0, r1] {
        let err = result.unwrap_err();
        assert_eq!(
            err.to_string(),
            "rendezvous timed out after 400ms: 2 of 3 ranks arrived"
        );
    }
}

#[tokio::test]
async fn tcp_rendezvous_with_a_secret() {
    let port = free_port();
    let opts = RendezvousOptions {
        secret: ClusterSecret::new("cluster").ok(),
        ..options()
    };
    let url = |rank| format!("tcp://127.0.0.1:{port}?rank={rank}&world_size=2");
    let r0 = tokio::spawn({
        let (url, opts) = (url(0), opts.clone());
        async move { rendezvous(&url, opts).await }
    });
    let g1 = rendezvous(&url(1), opts).await.unwrap();
    let g0 = r0.await.unwrap().unwrap();
    g1.store.set("x", b"1").await.unwrap();
    assert_eq!(g0.store.get("x").await.unwrap(), b"1");
}

/// Under torchrun, every rank (rank 0 too) is a client of the agent's store, PyTorch's
/// unauthenticated `TCPStore` (here a server without a secret stands in for it), although the
/// ranks hold a cluster secret; outside torchrun the same secret makes the rendezvous refuse
/// that server.
#[tokio::test]
async fn under_torchrun_every_rank_joins_the_agents_store_without_the_secret() {
    let agent = tensorwire_store::TcpStoreServer::bind(
        "127.0.0.1:0",
        tensorwire_store::ServerConfig::default(),
    )
    .await
    .unwrap();
    let port = agent.local_addr().port();
    let opts = RendezvousOptions {
        secret: ClusterSecret::new("cluster").ok(),
        ..options()
    };
    let torchrun = move |rank: usize| {
        let base = env(rank, 2, port);
        move |name: &str| match name {
            "TORCHELASTIC_USE_AGENT_STORE" => Some("True".into()),
            other => base(other),
        }
    };
    let r0 = tokio::spawn({
        let opts = opts.clone();
        async move { rendezvous_with_env("env://", opts, torchrun(0)).await }
    });
    let g1 = rendezvous_with_env("env://", opts.clone(), torchrun(1))
        .await
        .unwrap();
    let g0 = r0.await.unwrap().unwrap();
    assert_eq!(g0.server_addr(), None, "rank 0 started a store of its own");
    g0.store.set("x", b"1").await.unwrap();
    assert_eq!(g1.store.get("x").await.unwrap(), b"1");

    // Without the agent's variable, rank 1 insists on the secret, which that server lacks.
    let short = RendezvousOptions {
        timeout: Duration::from_secs(2),
        ..opts
    };
    let e = rendezvous_with_env("env://", short, env(1, 2, port))
        .await
        .unwrap_err();
    assert!(matches!(e, RendezvousError::Store { .. }), "{e}");
}

#[tokio::test]
async fn file_rendezvous_of_three_ranks() {
    let path = std::env::temp_dir().join(format!("tw-rdzv-file-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let mut ranks = Vec::new();
    for rank in 0..3 {
        let url = format!("file://{}?rank={rank}&world_size=3", path.display());
        ranks.push(tokio::spawn(async move {
            let g = rendezvous(&url, options()).await.unwrap();
            g.store.set(&format!("r{rank}"), b"here").await.unwrap();
            g.store.wait(&["r0", "r1", "r2"], LIMIT).await.unwrap();
            g.rank
        }));
    }
    let mut seen = Vec::new();
    for r in ranks {
        seen.push(tokio::time::timeout(LIMIT, r).await.unwrap().unwrap());
    }
    seen.sort();
    assert_eq!(seen, vec![0, 1, 2]);
    // The last of the three store handles removed the file, as PyTorch's FileStore does.
    assert!(!path.exists());
}

#[tokio::test]
async fn rank_zero_refuses_a_port_in_use() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err = rendezvous(
        &format!("tcp://127.0.0.1:{port}?rank=0&world_size=1"),
        options(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, RendezvousError::Bind { .. }), "{err}");
}

const CHILD_ENV: &str = "TW_RDZV_CHILD";

/// Not a test of its own: the body of each child process (returns at once otherwise).
#[test]
fn child_entry() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the real environment.
        let g = rendezvous("env://", options()).await.unwrap();
        let sum = g.store.add("ranksum", g.rank as i64).await.unwrap();
        assert!(sum >= g.rank as i64);
        g.store
            .set(&format!("child/{}", g.rank), b"ok")
            .await
            .unwrap();
    });
}

#[tokio::test]
async fn env_rendezvous_across_os_processes() {
    let port = free_port();
    // 8 processes by default; TW_RDZV_WORLD=32 measures a bigger group.
    let world: usize = std::env::var("TW_RDZV_WORLD")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(8);
    let started = std::time::Instant::now();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (1..world)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "child_entry", "--test-threads=1"])
                .env(CHILD_ENV, "1")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let g = rendezvous_with_env("env://", options(), env(0, world, port))
        .await
        .unwrap();
    let keys: Vec<String> = (1..world).map(|r| format!("child/{r}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    g.store.wait(&keys, LIMIT).await.unwrap();
    let expected: usize = (1..world).sum();
    assert_eq!(
        g.store.get("ranksum").await.unwrap(),
        expected.to_string().as_bytes()
    );
    eprintln!(
        "env:// rendezvous of {world} processes (spawn included): {:?}",
        started.elapsed()
    );
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
}
