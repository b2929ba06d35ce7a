//! A parameter server and trainers: the server's state lives behind a remote reference, trainers
//! call methods on it.
//!
//! ```sh
//! cargo build --release -p tensorwire-cli --example parameter_server
//! cargo run --release -p tensorwire-cli -- launch --nproc 3 -- target/release/examples/parameter_server
//! ```

use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensorwire::process_group::DistEnv;
use tensorwire::rpc::{
    init_rpc, Function, Functions, Method, RRef, RpcError, RpcOptions, Shutdown,
};

/// The server's state: a weight vector and how often it was updated.
#[derive(serde::Serialize)]
struct Server {
    weights: Mutex<Vec<f64>>,
}

/// Creates a server with `dim` weights (kept on the callee behind a remote reference).
const NEW_SERVER: Function<usize, Server> = Function::new("new_server");
/// The server's weights.
const WEIGHTS: Method<Server, (), Vec<f64>> = Method::new("weights");
/// Applies a gradient.
const UPDATE: Method<Server, Vec<f64>, ()> = Method::new("update");
/// Trains against a server for some steps; returns the final loss.
const TRAIN: Function<(RRef<Server>, u32), f64> = Function::new("train");

fn functions() -> Result<Functions, RpcError> {
    let f = Functions::new();
    f.serve(&NEW_SERVER, |dim| async move {
        Ok::<_, String>(Server {
            weights: Mutex::new(vec![0.0; dim]),
        })
    })?;
    f.serve_method(&WEIGHTS, |s: Arc<Server>, ()| async move {
        Ok::<_, String>(s.weights.lock().map_err(|e| e.to_string())?.clone())
    })?;
    f.serve_method(&UPDATE, |s: Arc<Server>, grad| async move {
        let mut w = s.weights.lock().map_err(|e| e.to_string())?;
        for (w, g) in w.iter_mut().zip(&grad) {
            *w -= 0.1 * g;
        }
        Ok::<_, String>(())
    })?;
    // A trainer pulls the weights, computes a gradient towards 1.0 and pushes it, `steps` times.
    f.serve(&TRAIN, |(server, steps)| async move {
        let mut loss = 0.0;
        for _ in 0..steps {
            let w = server
                .call(&WEIGHTS, &())
                .await
                .map_err(|e| e.to_string())?;
            let grad: Vec<f64> = w.iter().map(|w| w - 1.0).collect();
            loss = grad.iter().map(|g| g * g).sum::<f64>() / grad.len() as f64;
            server
                .call(&UPDATE, &grad)
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(loss)
    })?;
    Ok(f)
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("parameter_server: {e}\n(run me with `tensorwire launch --nproc 3 -- PATH/TO/parameter_server`)");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    // RANK and WORLD_SIZE (or Slurm's), as `tensorwire launch` sets them.
    let env = DistEnv::from_env()?;
    let (rank, world) = (env.rank, env.world_size);
    let name = if rank == 0 {
        "ps".to_owned()
    } else {
        format!("trainer{rank}")
    };
    let agent = init_rpc(
        &name,
        rank,
        Some(world),
        RpcOptions::new().with_functions(functions()?),
    )
    .await?;
    if rank == 0 {
        let server = agent.call(&NEW_SERVER, "ps", &4).remote()?;
        let runs: Vec<_> = (1..world as u32)
            .map(|t| agent.call(&TRAIN, t, &(server.clone(), 20)).send())
            .collect::<Result<_, _>>()?;
        for (t, run) in runs.into_iter().enumerate() {
            println!("trainer{}: final loss {:.6}", t + 1, run.await?);
        }
        let w = server.call(&WEIGHTS, &()).await?;
        println!("weights after training: {w:?}");
    }
    agent
        .shutdown(Shutdown::graceful(Duration::from_secs(30)))
        .await?;
    Ok(())
}
