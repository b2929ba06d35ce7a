//! The `tensorwire` command-line tool.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

/// What `--help` says about exit codes, for every command.
const EXIT_CODES: &str = "\
Exit codes: 0 success; 1 a failure while running (a worker, the store or the network failed, a
check did not pass: an invalid plan for `validate`, `not ready` for `store check`); 2 a usage
error (bad or missing arguments, an input file that cannot be read). `launch` exits with the code
of the worker that failed first.

Logging: RUST_LOG (e.g. RUST_LOG=info, RUST_LOG=tensorwire_rpc=debug) sets what goes to standard
error; warnings by default.";

/// tensorwire: distributed RPC for Rust.
#[derive(Debug, Parser)]
#[command(
    name = "tensorwire",
    version,
    about,
    propagate_version = true,
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a parameter server and trainers on this machine and show what happens.
    Demo(cli::demo::Args),
    /// Check a cluster plan's device maps before launch.
    Validate(cli::validate::Args),
    /// Measure tensorwire against a raw baseline (`bench transport`).
    Bench(cli::bench::Args),
    /// Start N local worker processes with rendezvous variables set (torchrun-style).
    Launch(cli::launch::Args),
    /// Run or query a c10d-compatible key-value store.
    Store(cli::store::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match cli.command {
        Command::Demo(args) => cli::demo::run(args),
        Command::Validate(args) => cli::validate::run(args),
        Command::Bench(args) => cli::bench::run(args),
        Command::Launch(args) => cli::launch::run(args),
        Command::Store(args) => cli::store::run(args),
    }
}

/// Logs of every command (and of the worker processes `demo` starts) to standard error, as
/// RUST_LOG says; warnings when it is unset or unreadable.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
