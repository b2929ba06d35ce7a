//! The ports: traits that adapters implement and the runtime drives.
//!
//! Each trait is small and object-safe (`Box<dyn ...>`/`Arc<dyn ...>`), async through
//! `async-trait`, and states its contract in its docs so every adapter can be checked against
//! the same conformance suite.
//!
//! - [`transport`]: [`Transport`](transport::Transport): listen, connect, send and receive
//!   [`Frame`](crate::wire::Frame)s.
//! - [`store`]: [`Store`](store::Store): the c10d-style key-value store.
//! - [`device`]: [`DeviceBackend`](device::DeviceBackend): copies between host and devices.
//! - [`autograd`]: [`AutogradEngine`](autograd::AutogradEngine): the local autodiff engine of
//!   distributed autograd.
//! - [`process_group`]: [`ProcessGroup`](process_group::ProcessGroup): collectives among ranks.
//! - [`runtime`]: [`Runtime`](runtime::Runtime): the clock, timers and task spawning the drivers
//!   use.

pub mod autograd;
pub mod device;
pub mod handshake;
pub mod process_group;
pub mod runtime;
pub mod store;
pub mod transport;
