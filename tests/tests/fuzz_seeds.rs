//! Every fuzz target of `fuzz/` run over its seed corpus (`fuzz/corpus/TARGET/`) as an ordinary
//! test: the targets' own source files, compiled here with a `fuzz_target!` that makes each a
//! plain function, so that they build with the workspace and what they assert holds for every
//! seed. No coverage guidance and no sanitizer: the search for new inputs is `cargo xtask fuzz`
//! (cargo-fuzz, libFuzzer, AddressSanitizer), which CI does not run (its build alone took
//! longer than the rest of CI's fuzzing was worth).

// The targets say `use libfuzzer_sys::fuzz_target;`: that name is this crate here.
extern crate self as libfuzzer_sys;

use std::path::{Path, PathBuf};

/// The targets' `fuzz_target!(|data: &[u8]| { ... })`, as a function `run(data)` of the
/// target's module.
#[macro_export]
macro_rules! fuzz_target {
    (|$data:ident: &[u8]| $body:block) => {
        /// The target's body.
        pub(crate) fn run($data: &[u8]) $body
    };
}

macro_rules! targets {
    ($($name:ident: $path:literal),* $(,)?) => {
        $(
            // `#![no_main]` at the top of each file is for its own crate; `fuzz_target!` resolves to
            // the macro above (in scope textually), not through the file's import.
            #[allow(unused_attributes, unused_imports, dead_code)]
            #[path = $path]
            mod $name;
        )*

        /// Every target, with its function.
        const TARGETS: &[(&str, fn(&[u8]))] = &[$((stringify!($name), $name::run)),*];
    };
}

targets!(
    autograd: "../../fuzz/fuzz_targets/autograd.rs",
    file_store: "../../fuzz/fuzz_targets/file_store.rs",
    handshake: "../../fuzz/fuzz_targets/handshake.rs",
    membership: "../../fuzz/fuzz_targets/membership.rs",
    mesh_frames: "../../fuzz/fuzz_targets/mesh_frames.rs",
    protocol: "../../fuzz/fuzz_targets/protocol.rs",
    quic_prefix: "../../fuzz/fuzz_targets/quic_prefix.rs",
    rpc: "../../fuzz/fuzz_targets/rpc.rs",
    shm_records: "../../fuzz/fuzz_targets/shm_records.rs",
    slurm: "../../fuzz/fuzz_targets/slurm.rs",
    store: "../../fuzz/fuzz_targets/store.rs",
    store_auth: "../../fuzz/fuzz_targets/store_auth.rs",
    store_client: "../../fuzz/fuzz_targets/store_client.rs",
    wire: "../../fuzz/fuzz_targets/wire.rs",
);

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

#[test]
fn every_fuzz_target_holds_over_its_seed_corpus() {
    let mut ran = Vec::new();
    for (name, run) in TARGETS {
        let dir = fuzz_dir().join("corpus").join(name);
        let mut seeds: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("no seed corpus for {name} in {}: {e}", dir.display()))
            .map(|entry| entry.expect("a corpus entry").path())
            .collect();
        seeds.sort();
        assert!(!seeds.is_empty(), "the seed corpus of {name} is empty");
        for seed in &seeds {
            let data = std::fs::read(seed).expect("a readable seed");
            let outcome = std::panic::catch_unwind(|| run(&data));
            assert!(
                outcome.is_ok(),
                "fuzz target {name} failed on {} (under the sanitizer: `cargo fuzz run {name} FILE` in fuzz/)",
                seed.display()
            );
        }
        ran.push((*name, seeds.len()));
    }
    eprintln!("seeds run per target: {ran:?}");
}

#[test]
fn every_fuzz_target_of_the_fuzz_workspace_is_run_here() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    let mut declared: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.trim().strip_prefix("path = \"fuzz_targets/"))
        .filter_map(|l| l.strip_suffix(".rs\""))
        .collect();
    declared.sort_unstable();
    let mut here: Vec<&str> = TARGETS.iter().map(|(n, _)| *n).collect();
    here.sort_unstable();
    assert_eq!(declared, here, "fuzz/Cargo.toml's targets and this file's");
}
