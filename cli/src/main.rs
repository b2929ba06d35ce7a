//! The `tensorwire` command-line tool.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;

/// tensorwire: distributed RPC for Rust.
#[derive(Debug, Parser)]
#[command(name = "tensorwire", version, about, propagate_version = true)]
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
    match cli.command {
        Command::Demo(args) => cli::demo::run(args),
        Command::Validate(args) => cli::validate::run(args),
        Command::Bench(args) => cli::bench::run(args),
        Command::Launch(args) => cli::launch::run(args),
        Command::Store(args) => cli::store::run(args),
    }
}
