//! Subcommands of the `tensorwire` tool, one module each.

pub(crate) mod bench;
#[cfg(feature = "autograd-candle")]
pub(crate) mod bench_autograd;
pub(crate) mod bench_collectives;
pub(crate) mod bench_common;
pub(crate) mod bench_curves;
#[cfg(feature = "tcp")]
pub(crate) mod bench_fairness;
pub(crate) mod bench_gloo;
mod bench_mpi;
pub(crate) mod bench_raw_barrier;
pub(crate) mod bench_raw_shm;
pub(crate) mod bench_raw_tcp;
pub(crate) mod bench_rpc;
pub(crate) mod bench_store;
pub(crate) mod demo;
pub(crate) mod launch;
pub(crate) mod store;
pub(crate) mod validate;

/// A usage error: the arguments were wrong (or ask for what this build lacks), not the run.
/// Commands exit 2 for it, as clap does for what it parses, and 1 for any other failure.
#[derive(Debug)]
pub(crate) struct Usage(pub(crate) String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// The exit code for a command's error: 2 for a [`Usage`] error, 1 for any other.
pub(crate) fn exit_code(e: &anyhow::Error) -> std::process::ExitCode {
    if e.downcast_ref::<Usage>().is_some() {
        std::process::ExitCode::from(2)
    } else {
        std::process::ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_errors_exit_2_and_others_1() {
        let code = |e: anyhow::Error| format!("{:?}", exit_code(&e));
        let two = format!("{:?}", std::process::ExitCode::from(2));
        let one = format!("{:?}", std::process::ExitCode::FAILURE);
        assert_eq!(code(Usage("--world 1".into()).into()), two);
        // Context added on the way up keeps it a usage error.
        assert_eq!(
            code(anyhow::Error::from(Usage("x".into())).context("bench")),
            two
        );
        assert_eq!(code(anyhow::anyhow!("the callee process failed")), one);
    }
}
