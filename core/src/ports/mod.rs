//! The traits that adapters implement (ports of the ports-and-adapters design).

pub mod store;
