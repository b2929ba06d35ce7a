//! Where each tensor of a message lands: device maps applied to a message's tensors.
//!
//! A request's tensors move by the caller's device map for the destination; a response's by
//! the callee's reverse map for the caller. A tensor on a device the map has an entry for lands
//! on that entry's device. A CPU tensor with no entry stays on the CPU. A CUDA tensor with no
//! entry cannot be sent: the error names the destination and the device, so the user knows
//! which map to fix (PyTorch's TensorPipe agent refuses such a tensor in the same way).

use crate::device::{Device, DeviceMap};

/// Which way a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// A request, moved by the caller's map.
    Request,
    /// A response, moved by the callee's reverse map.
    Response,
}

/// A tensor cannot be sent where it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// A CUDA tensor has no map entry for its device.
    #[error(
        "cannot send a tensor on {device} to worker {to}: {}",
        match (.direction, .map) {
            (Direction::Request, None) => format!("there is no device map for {to}, so only CPU tensors can be sent there; set one with set_device_map(\"{to}\", ...) or move the tensor to cpu"),
            (Direction::Request, Some(m)) => format!("the device map for {to} ({m}) has no entry for {device}; add one with set_device_map or move the tensor to cpu"),
            (Direction::Response, None) => format!("{to} has no device map to this worker, so a response to it can only carry CPU tensors; move the result to cpu or have {to} map a device to this worker"),
            (Direction::Response, Some(m)) => format!("the reverse device map for {to} ({m}) has no entry for {device}; move the result to cpu or extend {to}'s device map"),
        }
    )]
    NoMapEntry {
        /// The destination worker.
        to: String,
        /// The tensor's device.
        device: Device,
        /// The map consulted, if there is one.
        map: Option<DeviceMap>,
        /// Request or response.
        direction: Direction,
    },
}

/// The device each tensor lands on at `to`, given the map for `to` (if any).
///
/// ```
/// use tensorwire_core::device::{Device, DeviceMap};
/// use tensorwire_core::placement::{placements, Direction};
/// let map: DeviceMap = [(Device::Cuda(0), Device::Cuda(1))].into_iter().collect();
/// let out = placements("ps", Some(&map), [Device::Cuda(0), Device::Cpu], Direction::Request).unwrap();
/// assert_eq!(out, [Device::Cuda(1), Device::Cpu]);
/// let err = placements("ps", None, [Device::Cuda(0)], Direction::Request).unwrap_err();
/// assert!(err.to_string().starts_with("cannot send a tensor on cuda:0 to worker ps"));
/// ```
pub fn placements(
    to: &str,
    map: Option<&DeviceMap>,
    devices: impl IntoIterator<Item = Device>,
    direction: Direction,
) -> Result<Vec<Device>, PlacementError> {
    devices
        .into_iter()
        .map(|d| match map.and_then(|m| m.get(d)) {
            Some(target) => Ok(target),
            None if d.is_cpu() => Ok(Device::Cpu),
            None => Err(PlacementError::NoMapEntry {
                to: to.to_owned(),
                device: d,
                map: map.cloned(),
                direction,
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_moves_only_with_an_entry() {
        let map: DeviceMap = [(Device::Cpu, Device::Cuda(0))].into_iter().collect();
        assert_eq!(
            placements("a", Some(&map), [Device::Cpu], Direction::Request).unwrap(),
            [Device::Cuda(0)]
        );
        assert_eq!(
            placements("a", None, [Device::Cpu], Direction::Request).unwrap(),
            [Device::Cpu]
        );
    }

    #[test]
    fn missing_entries_name_destination_device_and_map() {
        let map: DeviceMap = [(Device::Cuda(1), Device::Cuda(0))].into_iter().collect();
        let e = placements(
            "ps",
            Some(&map),
            [Device::Cpu, Device::Cuda(0)],
            Direction::Request,
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("worker ps") && msg.contains("cuda:0") && msg.contains("{cuda:1: cuda:0}"),
            "{msg}"
        );
        let e = placements("trainer", None, [Device::Cuda(2)], Direction::Response).unwrap_err();
        assert!(e.to_string().contains("response"), "{e}");
    }
}
