//! Subcommands of the `tensorwire` tool, one module each.

pub(crate) mod bench;
pub(crate) mod launch;
pub(crate) mod store;
pub(crate) mod validate;
