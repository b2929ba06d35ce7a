//! Shared helpers for tensorwire's cross-crate and multi-process tests.
