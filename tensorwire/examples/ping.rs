//! Two workers ping each other and measure the round trip.
//!
//! ```sh
//! cargo build --release -p tensorwire-cli --example ping
//! cargo run --release -p tensorwire-cli -- launch --nproc 2 -- target/release/examples/ping
//! ```

use std::process::ExitCode;
use std::time::{Duration, Instant};

use tensorwire::process_group::DistEnv;
use tensorwire::rpc::{init_rpc, Function, Functions, RpcOptions, Shutdown};

/// `n + 1`: the descriptor both sides use, so the types cannot disagree.
const PING: Function<u64, u64> = Function::new("ping");

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ping: {e}\n(run me with `tensorwire launch --nproc 2 -- PATH/TO/ping`)");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let functions = Functions::new();
    functions.serve(&PING, |n| async move { Ok::<_, String>(n + 1) })?;

    // RANK and WORLD_SIZE (or Slurm's), as `tensorwire launch` sets them.
    let env = DistEnv::from_env()?;
    let (rank, world) = (env.rank, env.world_size);
    let agent = init_rpc(
        &format!("worker{rank}"),
        rank,
        Some(world),
        RpcOptions::new().with_functions(functions),
    )
    .await?;

    let peer = format!("worker{}", (rank + 1) % world);
    let mut times = Vec::new();
    for i in 0..1000u64 {
        let t0 = Instant::now();
        let back = agent.call(&PING, peer.as_str(), &i).await?;
        times.push(t0.elapsed());
        assert_eq!(back, i + 1);
    }
    times.sort();
    println!(
        "{} -> {peer}: 1000 pings, p50 {:?}, p99 {:?}",
        agent.worker_info().name,
        times[500],
        times[990]
    );

    agent
        .shutdown(Shutdown::graceful(Duration::from_secs(30)))
        .await?;
    Ok(())
}
