//! `tensorwire validate PLAN.json [--json]`.

use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `tensorwire validate`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The cluster plan (JSON).
    plan: PathBuf,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(args: Args) -> ExitCode {
    let _ = args;
    ExitCode::from(2)
}
