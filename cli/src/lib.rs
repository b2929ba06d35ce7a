//! The library half of the `tensorwire` command-line tool: code shared by the tool and the
//! examples built in this package. The tool itself is the `tensorwire` binary.

/// The model of the `dist_autograd` example and `tensorwire demo autograd` (feature
/// `autograd-candle`, on by default).
#[cfg(feature = "autograd-candle")]
pub mod autograd_demo;
