//! Subcommands of the `tensorwire` tool, one module each.

pub(crate) mod bench;
pub(crate) mod bench_collectives;
pub(crate) mod bench_rpc;
pub(crate) mod demo;
pub(crate) mod launch;
pub(crate) mod store;
pub(crate) mod validate;
