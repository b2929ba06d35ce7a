//! Fuzzes the RPC protocol state machine: a 3-worker cluster runs a short normal workload,
//! then the input is read as forged protocol headers from worker 0, mixed with deliveries and
//! timers (`protocol_sim::Cluster::fuzz`). No endpoint may panic; forged messages that break
//! the protocol are reported as violations, not acted on.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorwire_core::protocol_sim::Cluster;

fuzz_target!(|data: &[u8]| {
    let Some((seed, input)) = data.split_first_chunk::<8>() else {
        return;
    };
    let _ = Cluster::fuzz(u64::from_le_bytes(*seed), input);
});
