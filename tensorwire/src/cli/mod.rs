//! Subcommands of the `tensorwire` tool, one module each.

pub(crate) mod bench;
pub(crate) mod validate;
