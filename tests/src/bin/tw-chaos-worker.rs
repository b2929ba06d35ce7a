//! A worker process for `cargo xtask chaos` and `cargo xtask soak`: `tw-chaos-worker MODE`,
//! with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (the RPC group's store), TW_PG_PORT (the
//! process group's store, also hosted by rank 0) and TENSORWIRE_SECRET in the environment.
//!
//! The driver (xtask) injects the faults: it freezes, kills and cuts off these processes and
//! delays or drops their packets. Workers talk to it in lines:
//! - `READY <step>` on stdout: this worker waits for a line on stdin before going on;
//! - `OK <what> ...`: something that had to work worked, with the values checked;
//! - `DETECT <what> after_ms=T: <error>`: a fault was noticed, how long after the operation
//!   began, and the error the caller got (the driver checks that it names the peer);
//! - `CALLING`: an operation that only a fault can end is in flight (the driver injects it
//!   then, and times detection itself);
//! - `SERVING`: the callee of such an operation is running it (its request has arrived);
//! - `KEYS t_ms=T rpc=N pg=M`, `PROGRESS ...` (soak).
//!
//! A check that fails exits 1 with the reason on stderr.
//!
//! Modes:
//! - `traffic`: calls to every peer, RRefs (created, forked to a third worker, methods, dropped),
//!   process-group collectives and store operations, `TW_ROUNDS` rounds, every result checked.
//! - `frozen`: the last rank is frozen twice by the driver; first resumed within the timeouts
//!   (everything must complete), then left frozen (a call and a collective must fail within
//!   their timeouts, naming it).
//! - `store-kill`: rank 0 hosts the store and is killed; rank 1's store calls and rank 2's
//!   rendezvous, begun after that, must fail within their timeouts with a clear error.
//! - `link-cut`: rank 0 holds a call with no timeout to rank 1 and a collective with a long
//!   one; the driver cuts rank 1's link; both must fail once the transport's liveness bound
//!   notices the dead connection.
//! - `quic-kill`: the same over the QUIC backend, rank 1 killed.
//! - `soak`: ranks 0-2 run mixed traffic for `TW_SOAK_SECS` in a dynamic group while rank 3
//!   joins and leaves it again and again; rank 0 prints both stores' key counts every second.
//! - `count`: rank 0 makes `TW_CALLS` calls, then `TW_RREFS` RRef create/drop cycles, on rank 1,
//!   printing progress (resident memory is sampled by the driver).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tensorwire_core::ports::process_group::Collectives;

use anyhow::{bail, ensure, Context, Result};
use tensorwire_core::collective::ReduceOp;
use tensorwire_core::ports::store::Store;
use tensorwire_process_group::{CollectivesExt, Group, GroupOptions};
use tensorwire_rendezvous::{advertise_ip, rendezvous, Rendezvous, RendezvousOptions};
use tensorwire_rpc::{init_rpc, Agent, Functions, RRef, RpcOptions};
use tensorwire_store::{ClientConfig, ClusterSecret, TcpStoreClient};
use tensorwire_transport_tcp::{TcpConfig, TcpTransport};

fn functions() -> Functions {
    let f = Functions::new();
    tensorwire_tests::workload::register(&f);
    // A call that only a fault can end: says `SERVING` once its request has arrived.
    f.register("hold_ms", |ms: u64| async move {
        say("SERVING");
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, String>(ms)
    })
    .expect("each name is registered once");
    f
}

fn env_num<T: std::str::FromStr>(name: &str) -> Result<T> {
    let v = std::env::var(name).with_context(|| format!("{name} must be set"))?;
    v.parse()
        .ok()
        .with_context(|| format!("{name}={v:?} is not a number"))
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn say(line: impl AsRef<str>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", line.as_ref());
    let _ = out.flush();
}

/// Prints `READY step` and waits for the driver's line on stdin.
async fn ready(step: &str) -> Result<String> {
    say(format!("READY {step}"));
    let line = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await?
    .context("reading stdin")?;
    Ok(line.trim().to_owned())
}

fn secret() -> Result<ClusterSecret> {
    let s = std::env::var("TENSORWIRE_SECRET").context("TENSORWIRE_SECRET must be set")?;
    Ok(ClusterSecret::new(s.into_bytes())?)
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// The RPC agent of a static group of `WORLD_SIZE` (or a dynamic one with `dynamic`).
async fn start_rpc(
    rank: usize,
    world: Option<usize>,
    tweak: impl FnOnce(&mut RpcOptions),
) -> Result<Agent> {
    let mut options = RpcOptions {
        functions: functions(),
        init_timeout: Duration::from_secs(60),
        ..RpcOptions::default()
    };
    tweak(&mut options);
    Ok(init_rpc(&format!("w{rank}"), rank, world, options).await?)
}

/// The process group's own store (rank 0 hosts it on `TW_PG_PORT`), bounded by `timeout`.
async fn pg_store(rank: usize, world: usize, timeout: Duration) -> Result<Rendezvous> {
    let addr: String = env_num("MASTER_ADDR")?;
    let port: u16 = env_num("TW_PG_PORT")?;
    let url = format!("tcp://{addr}:{port}?rank={rank}&world_size={world}");
    let options = RendezvousOptions {
        timeout,
        secret: Some(secret()?),
        wait_for_all: false,
        ..RendezvousOptions::default()
    };
    Ok(rendezvous(&url, options).await?)
}

/// A process group of `world` ranks over TCP, on the process group's store.
async fn group(
    store: Arc<dyn Store>,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<Group> {
    let transport = Arc::new(TcpTransport::new(TcpConfig::resolve(None, false)?)?);
    let listen = SocketAddr::new(advertise_ip(None)?, 0);
    let options = GroupOptions::new("chaos")
        .with_timeout(timeout)
        .with_listen(listen);
    Ok(Group::connect(store, transport, rank, world, options).await?)
}

/// Runs `f` and returns its outcome with how long it took.
async fn timed<T>(f: impl Future<Output = T>) -> (T, Duration) {
    let t0 = Instant::now();
    let out = f.await;
    (out, t0.elapsed())
}

/// One round of everything: calls, RRefs, collectives, the store; every result checked.
async fn round(
    agent: &Agent,
    pg: &Group,
    store: &dyn Store,
    rank: usize,
    world: usize,
    n: i64,
) -> Result<()> {
    for peer in 0..world {
        let sum: i64 = agent
            .rpc_sync(peer as u32, "add", &(rank as i64, n), None)
            .await?;
        ensure!(sum == rank as i64 + n, "add on w{peer} gave {sum}");
    }
    let next = ((rank + 1) % world) as u32;
    let third = ((rank + 2) % world) as u32;
    let v: RRef<Vec<i64>> = agent.remote(next, "make_vec", &(n + 3), None)?;
    let want: i64 = (0..n + 3).sum();
    let s: i64 = agent.rpc_sync(third, "sum_rref", &v, None).await?;
    ensure!(s == want, "a forked RRef summed to {s}, not {want}");
    ensure!(v.to_here(None).await?.len() == (n + 3) as usize, "to_here");
    let c: RRef<tensorwire_tests::workload::Counter> =
        agent.remote(next, "make_counter", &n, None)?;
    let got: i64 = c.rpc_sync("increment", &2i64, None).await?;
    ensure!(got == n + 2, "a method on the owner's value gave {got}");
    drop((v, c));
    let mut x = [rank as i64 + n];
    pg.all_reduce_typed(&mut x, ReduceOp::Sum).await?;
    let want = (world * (world - 1) / 2) as i64 + n * world as i64;
    ensure!(x[0] == want, "all_reduce gave {}, not {want}", x[0]);
    let all: Vec<(usize, i64)> = pg.all_gather_object(&(rank, n)).await?;
    ensure!(
        all == (0..world).map(|r| (r, n)).collect::<Vec<_>>(),
        "all_gather_object gave {all:?}"
    );
    let key = |r: usize| format!("chaos/{r}/{n}");
    store.set(&key(rank), n.to_string().as_bytes()).await?;
    let theirs = store.get(&key(next as usize)).await?;
    ensure!(
        theirs == n.to_string().as_bytes(),
        "store get of {}",
        key(next as usize)
    );
    store.add("chaos/adds", 1).await?;
    // Everyone has read the keys of the round before: delete ours (the store stays bounded).
    if n > 0 {
        store.delete_key(&format!("chaos/{rank}/{}", n - 1)).await?;
    }
    Ok(())
}

async fn traffic() -> Result<()> {
    let (rank, world): (usize, usize) = (env_num("RANK")?, env_num("WORLD_SIZE")?);
    let rounds: i64 = env_or("TW_ROUNDS", 10);
    let timeout = Duration::from_secs(60);
    let agent = start_rpc(rank, Some(world), |_| {}).await?;
    let rdv = pg_store(rank, world, timeout).await?;
    let pg = group(rdv.store.clone(), rank, world, timeout).await?;
    let t0 = Instant::now();
    for n in 0..rounds {
        round(&agent, &pg, rdv.store.as_ref(), rank, world, n)
            .await
            .with_context(|| format!("round {n}"))?;
    }
    let adds = rdv.store.add("chaos/adds", 0).await?;
    say(format!(
        "OK traffic rank {rank} rounds={rounds} ms={} adds_seen={adds}",
        ms(t0.elapsed())
    ));
    // Nobody uses the process group's store (on rank 0) after this barrier; the graceful
    // shutdown then waits for everyone, so no rank exits while another still needs it. (A
    // barrier after the shutdown would race: a rank that leaves it and exits can make a slower
    // rank's barrier fail with "rank N died".)
    pg.barrier().await?;
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(Duration::from_secs(60)))
        .await?;
    Ok(())
}

async fn frozen() -> Result<()> {
    let (rank, world): (usize, usize) = (env_num("RANK")?, env_num("WORLD_SIZE")?);
    let victim = world - 1;
    let coll = Duration::from_millis(env_or("TW_COLL_TIMEOUT_MS", 4000));
    let call = Duration::from_millis(env_or("TW_CALL_TIMEOUT_MS", 2000));
    let agent = start_rpc(rank, Some(world), |_| {}).await?;
    let rdv = pg_store(rank, world, Duration::from_secs(60)).await?;
    let pg = group(rdv.store.clone(), rank, world, coll).await?;
    // 1: the victim is frozen before GO and resumed within the timeouts.
    ready("resume").await?;
    let mut x = [1i64];
    if rank == victim {
        pg.all_reduce_typed(&mut x, ReduceOp::Sum).await?;
    } else {
        let ((r, reduced), took) = timed(async {
            tokio::join!(
                agent.rpc_sync::<_, String>(victim as u32, "whoami", &(), Some(coll * 2)),
                pg.all_reduce_typed(&mut x, ReduceOp::Sum)
            )
        })
        .await;
        ensure!(r? == victim.to_string(), "whoami of the resumed worker");
        reduced?;
        say(format!("OK resumed rank {rank} after_ms={}", ms(took)));
    }
    ensure!(
        x[0] == world as i64,
        "all_reduce across a resumed worker gave {}",
        x[0]
    );
    // 2: the victim is frozen for good.
    ready("stay-frozen").await?;
    if rank == victim {
        // Only reached if the driver let it go on: nothing to do.
        return Ok(());
    }
    let (r, took) =
        timed(agent.rpc_sync::<_, String>(victim as u32, "whoami", &(), Some(call))).await;
    match r {
        Ok(v) => bail!("a call to the frozen worker answered {v:?}"),
        Err(e) => say(format!(
            "DETECT call rank {rank} after_ms={}: {e}",
            ms(took)
        )),
    }
    let mut x = [1i64];
    let (r, took) = timed(pg.all_reduce_typed(&mut x, ReduceOp::Sum)).await;
    match r {
        Ok(()) => bail!("a collective with a frozen worker completed"),
        Err(e) => say(format!(
            "DETECT collective rank {rank} after_ms={}: {e}",
            ms(took)
        )),
    }
    // Stay until every survivor has reported (one leaving early would fail the others'
    // collective naming it instead); the driver then ends everyone.
    ready("done").await?;
    std::process::exit(0);
}

async fn store_kill() -> Result<()> {
    let rank: usize = env_num("RANK")?;
    let timeout = Duration::from_millis(env_or("TW_STORE_TIMEOUT_MS", 3000));
    if rank == 2 {
        // Rendezvous only after the store's host is gone.
        ready("go").await?;
        let (r, took) = timed(pg_store(rank, 3, timeout)).await;
        match r {
            Ok(_) => bail!("a rendezvous with a dead store succeeded"),
            Err(e) => say(format!(
                "DETECT rendezvous rank {rank} after_ms={}: {e}",
                ms(took)
            )),
        }
        return Ok(());
    }
    let rdv = pg_store(rank, 3, timeout).await?;
    rdv.store.set(&format!("alive/{rank}"), b"1").await?;
    ready("go").await?;
    if rank == 0 {
        // Killed by the driver.
        tokio::time::sleep(Duration::from_secs(600)).await;
        return Ok(());
    }
    let (r, took) = timed(async {
        // The first that fails ends it.
        rdv.store.set("after/kill", b"1").await?;
        rdv.store.get("never/set").await?;
        Ok::<_, anyhow::Error>(())
    })
    .await;
    match r {
        Ok(()) => bail!("store calls with a dead store succeeded"),
        Err(e) => say(format!(
            "DETECT store rank {rank} after_ms={}: {e:#}",
            ms(took)
        )),
    }
    // A second call fails too, and as fast.
    let (r, took) = timed(rdv.store.add("after/kill", 1)).await;
    match r {
        Ok(_) => bail!("a second store call with a dead store succeeded"),
        Err(e) => say(format!(
            "DETECT store-again rank {rank} after_ms={}: {e}",
            ms(took)
        )),
    }
    std::process::exit(0);
}

/// Rank 0 holds a call with no timeout and a collective with a 10-minute one to rank 1; only the
/// transport's liveness can end them once the driver cuts rank 1 off (`link-cut`) or kills it
/// (`quic-kill`, with `quic`).
async fn lost_peer(quic: bool) -> Result<()> {
    let (rank, world): (usize, usize) = (env_num("RANK")?, env_num("WORLD_SIZE")?);
    let agent = start_rpc(rank, Some(world), |o| {
        if quic {
            o.backend = "QUIC".into();
            o.tls_dir = std::env::var("TW_TLS_DIR").ok().map(Into::into);
        }
    })
    .await?;
    let long = Duration::from_secs(600);
    let pg = if quic {
        None
    } else {
        let rdv = pg_store(rank, world, Duration::from_secs(60)).await?;
        Some((group(rdv.store.clone(), rank, world, long).await?, rdv))
    };
    // Warm: the connections carry traffic before the fault.
    let peer = (1 - rank) as u32;
    let _: String = agent.rpc_sync(peer, "whoami", &(), None).await?;
    ready("go").await?;
    if rank == 1 {
        tokio::time::sleep(long).await;
        return Ok(());
    }
    let call = agent.rpc_async::<_, u64>(1u32, "hold_ms", &600_000u64, Some(Duration::ZERO))?;
    let coll = async {
        if let Some((pg, _)) = &pg {
            // Rank 1 never joins this one.
            let mut x = [1i64];
            let (r, took) = timed(pg.all_reduce_typed(&mut x, ReduceOp::Sum)).await;
            match r {
                Ok(()) => say("FAIL a collective with a lost peer completed"),
                Err(e) => say(format!("DETECT collective after_ms={}: {e}", ms(took))),
            }
        }
    };
    say("CALLING");
    let (r, took) = timed(async { tokio::join!(call, coll).0 }).await;
    match r {
        Ok(v) => bail!("a call to a lost peer answered {v}"),
        Err(e) => say(format!("DETECT call after_ms={}: {e}", ms(took))),
    }
    std::process::exit(0);
}

/// The store key counts of the RPC group's store and the process group's, through clients of
/// their own.
async fn key_counts() -> Result<(i64, i64)> {
    let addr: String = env_num("MASTER_ADDR")?;
    let rpc_port: u16 = env_num("MASTER_PORT")?;
    let pg_port: u16 = env_num("TW_PG_PORT")?;
    let config = ClientConfig {
        secret: Some(secret()?),
        connect_timeout: Duration::from_secs(10),
        timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    };
    let rpc = TcpStoreClient::connect(&format!("{addr}:{rpc_port}"), config.clone()).await?;
    let pg = TcpStoreClient::connect(&format!("{addr}:{pg_port}"), config).await?;
    Ok((rpc.num_keys().await?, pg.num_keys().await?))
}

async fn soak() -> Result<()> {
    let rank: usize = env_num("RANK")?;
    let secs: u64 = env_or("TW_SOAK_SECS", 60);
    let end = Instant::now() + Duration::from_secs(secs);
    const STABLE: usize = 3;
    let timeout = Duration::from_secs(120);
    if rank == STABLE {
        return churn(timeout).await;
    }
    let agent = start_rpc(rank, None, |_| {}).await?;
    let rdv = pg_store(rank, STABLE, timeout).await?;
    let store = rdv.store.clone();
    let pg = group(store.clone(), rank, STABLE, timeout).await?;
    // Every stable worker sees the other stable ones before calling them.
    let deadline = Instant::now() + timeout;
    while (0..STABLE).any(|r| agent.get_worker_info(&format!("w{r}")).is_err()) {
        ensure!(Instant::now() < deadline, "the stable workers join");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sampler = (rank == 0).then(|| {
        tokio::spawn(async move {
            let t0 = Instant::now();
            loop {
                match key_counts().await {
                    Ok((rpc, pg)) => {
                        say(format!("KEYS t_ms={} rpc={rpc} pg={pg}", ms(t0.elapsed())))
                    }
                    Err(e) => say(format!("KEYS-ERROR {e:#}")),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    });
    let mut n = 0i64;
    loop {
        // Everyone stops in the same round: rank 0's clock decides, through the collective.
        let mut stop = [i64::from(rank == 0 && Instant::now() >= end)];
        pg.all_reduce_typed(&mut stop, ReduceOp::Sum).await?;
        if stop[0] > 0 {
            break;
        }
        round(&agent, &pg, store.as_ref(), rank, STABLE, n)
            .await
            .with_context(|| format!("soak round {n}"))?;
        n += 1;
        if n % 100 == 0 {
            say(format!("PROGRESS rank {rank} rounds={n}"));
        }
    }
    say(format!("OK soak rank {rank} rounds={n}"));
    // The end goes through the store, not a collective (a rank that leaves a collective and
    // exits can fail a slower rank's same collective): the churner stops, then every stable
    // rank says it is done, then they leave from the highest rank down, so that rank 0, which
    // hosts both stores, goes last.
    if rank == 0 {
        store.set("soak/stop", b"1").await?;
    }
    store.wait(&["soak/churner-done"], timeout).await?;
    store.set(&format!("soak/done/{rank}"), b"1").await?;
    let done: Vec<String> = (0..STABLE).map(|r| format!("soak/done/{r}")).collect();
    let done: Vec<&str> = done.iter().map(String::as_str).collect();
    store.wait(&done, timeout).await?;
    let deadline = Instant::now() + timeout;
    while agent.worker_infos().len() > rank + 1 {
        ensure!(Instant::now() < deadline, "the higher ranks leave");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Some(s) = sampler {
        s.abort();
    }
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(timeout))
        .await?;
    drop(pg);
    Ok(())
}

/// Rank 3 of the soak: joins the dynamic group, calls and makes RRefs on the stable workers,
/// leaves; again until rank 0 sets `soak/stop` in the process group's store.
async fn churn(timeout: Duration) -> Result<()> {
    let rank = 3usize;
    // The process group's store, as a 4th client (the join counter says 4; nobody waits on it).
    let store = pg_store(rank, rank + 1, timeout).await?.store;
    let mut joins = 0i64;
    while !store.check(&["soak/stop"]).await? {
        let agent = start_rpc(rank, None, |_| {})
            .await
            .with_context(|| format!("join {}", joins + 1))?;
        joins += 1;
        let deadline = Instant::now() + timeout;
        while (0..3).any(|r| agent.get_worker_info(&format!("w{r}")).is_err()) {
            if Instant::now() >= deadline {
                let mut seen: Vec<String> =
                    agent.worker_infos().into_iter().map(|w| w.name).collect();
                seen.sort();
                bail!(
                    "join {joins}: {timeout:?} after init_rpc returned, the churner still does \
                     not see every stable worker; it sees {seen:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for i in 0..20i64 {
            let peer = (i % 3) as u32;
            let sum: i64 = agent.rpc_sync(peer, "add", &(i, 1i64), None).await?;
            ensure!(sum == i + 1, "the churner's add");
            let v: RRef<Vec<i64>> = agent.remote(peer, "make_vec", &4i64, None)?;
            ensure!(
                v.to_here(None).await? == vec![0, 1, 2, 3],
                "the churner's RRef"
            );
        }
        agent
            .shutdown(tensorwire_rpc::Shutdown::graceful(timeout))
            .await?;
        if joins % 10 == 0 {
            say(format!("PROGRESS rank {rank} joins={joins}"));
        }
    }
    say(format!("OK churn rank {rank} joins={joins}"));
    store.set("soak/churner-done", b"1").await?;
    Ok(())
}

/// `TW_CALLS` calls (`TW_INFLIGHT` in flight), then `TW_RREFS` RRef create/drop cycles, from
/// rank 0 to rank 1.
async fn count() -> Result<()> {
    let (rank, world): (usize, usize) = (env_num("RANK")?, env_num("WORLD_SIZE")?);
    let calls: u64 = env_or("TW_CALLS", 1_000_000);
    let rrefs: u64 = env_or("TW_RREFS", 100_000);
    let inflight: u64 = env_or("TW_INFLIGHT", 64);
    let agent = start_rpc(rank, Some(world), |_| {}).await?;
    if rank == 0 {
        let t0 = Instant::now();
        let step = (calls / 20).max(1);
        let mut done = 0u64;
        while done < calls {
            let batch = inflight.min(calls - done);
            let futs = (0..batch)
                .map(|i| agent.rpc_async::<_, i64>(1u32, "add", &((done + i) as i64, 1i64), None))
                .collect::<Result<Vec<_>, _>>()?;
            for (i, f) in futs.into_iter().enumerate() {
                ensure!(f.await? == (done + i as u64) as i64 + 1, "add result");
            }
            let before = done;
            done += batch;
            if done / step != before / step {
                say(format!("PROGRESS calls={done} ms={}", ms(t0.elapsed())));
            }
        }
        let t1 = Instant::now();
        let step = (rrefs / 20).max(1);
        let mut done = 0u64;
        while done < rrefs {
            let batch = inflight.min(rrefs - done);
            let made = (0..batch)
                .map(|i| {
                    agent.remote::<_, Vec<i64>>(1u32, "make_vec", &((done + i) as i64 % 8), None)
                })
                .collect::<Result<Vec<_>, _>>()?;
            for (i, r) in made.into_iter().enumerate() {
                let n = (done + i as u64) as i64 % 8;
                ensure!(r.to_here(None).await?.len() == n as usize, "to_here");
            }
            let before = done;
            done += batch;
            if done / step != before / step {
                say(format!("PROGRESS rrefs={done} ms={}", ms(t1.elapsed())));
            }
        }
        say(format!(
            "OK count calls={calls} in {} ms, rrefs={rrefs} in {} ms",
            ms(t1 - t0),
            ms(t1.elapsed())
        ));
    }
    // Rank 1 waits in the graceful shutdown until rank 0 is done: bound it by the work.
    let bound = Duration::from_secs(600 + calls / 1_000 + rrefs / 100);
    agent
        .shutdown(tensorwire_rpc::Shutdown::graceful(bound))
        .await?;
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let result = match mode.as_str() {
        "traffic" => traffic().await,
        "frozen" => frozen().await,
        "store-kill" => store_kill().await,
        "link-cut" => lost_peer(false).await,
        "quic-kill" => lost_peer(true).await,
        "soak" => soak().await,
        "count" => count().await,
        other => Err(anyhow::anyhow!("unknown mode {other:?}")),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "FAIL rank {}: {e:#}",
                std::env::var("RANK").unwrap_or_default()
            );
            std::process::ExitCode::FAILURE
        }
    }
}
