//! The ports: traits that adapters implement and the runtime drives.
//!
//! - [`device`]: [`DeviceBackend`](device::DeviceBackend): copies between host and devices.

pub mod device;
