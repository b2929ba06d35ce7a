//! Distributed autograd: a model split across 3 processes, trained with the distributed
//! optimizer, and compared with the same model in one process.
//!
//! - `ps` holds two layers' parameters as `Parameter`s in remote references;
//! - `trainer` holds its own layer, drives the forward pass, computes the loss and runs
//!   `backward` and `DistributedOptimizer::step` in one autograd context per step;
//! - `worker` sits in a chain: trainer -> worker -> ps -> worker -> trainer.
//!
//! The model is in `tensorwire_cli::autograd_demo` (shared with `tensorwire demo autograd`).
//!
//! ```sh
//! cargo run -p tensorwire-cli --example dist_autograd
//! ```
//!
//! Without `RANK` in the environment it starts the three processes itself (copies of this
//! program, on 127.0.0.1); under `tensorwire launch --nproc 3` each process is one worker.

use anyhow::Result;
use tensorwire_cli::autograd_demo;

const STEPS: usize = 8;

fn main() -> Result<()> {
    if std::env::var_os("RANK").is_some() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        if let Some(report) = rt.block_on(autograd_demo::worker(STEPS))? {
            println!("REPORT {}", serde_json::to_string(&report)?);
        }
        return Ok(());
    }
    let exe = std::env::current_exe()?.to_string_lossy().into_owned();
    let r = autograd_demo::run_local(&exe, &[])?;
    println!("trained {} steps across {} processes", r.steps, r.workers);
    println!("loss: {:.5} -> {:.5}", r.loss_first, r.loss_last);
    println!(
        "first-step gradients vs the same model in one process: max abs diff {:.3e}",
        r.max_abs_grad_diff_vs_local
    );
    println!(
        "losses vs one process, every step: max abs diff {:.3e}",
        r.max_abs_loss_diff_vs_local
    );
    println!(
        "backward: distributed {:.0} us, one process {:.0} us",
        r.dist_backward_us, r.local_backward_us
    );
    assert!(r.max_abs_grad_diff_vs_local < 1e-4 && r.loss_last < r.loss_first);
    Ok(())
}
