//! Device-map validation: the rules of PyTorch's `_validate_device_maps`.
//!
//! Every worker of a group contributes a [`WorkerDeviceInfo`]: its name, how many CUDA devices
//! it has, the devices it declared it will use (possibly none), and its device maps. Before any
//! agent starts, [`validate_device_maps`] checks all of them together, with the eight rules in
//! PyTorch's order, and reports the first violation as a [`DeviceMapError`]:
//!
//! 1. for each worker, in group order: its declared devices have no duplicates
//!    ([`DuplicatedDevices`](DeviceMapError::DuplicatedDevices)), then
//! 2. each declared device exists: the CPU, or `cuda:i` with `i` below its device count
//!    ([`InvalidDeviceIndices`](DeviceMapError::InvalidDeviceIndices));
//!
//! then, for each worker as a source, in group order:
//!
//! 3. (static groups only) every destination of its maps is a member
//!    ([`InvalidTargetNodeNames`](DeviceMapError::InvalidTargetNodeNames)); then for each
//!    destination, in the order the maps list them:
//! 4. no two sources map to the same target device
//!    ([`DuplicatedTargetDevices`](DeviceMapError::DuplicatedTargetDevices));
//! 5. if the source declared devices, every source device is one of them
//!    ([`UnexpectedSourceDevices`](DeviceMapError::UnexpectedSourceDevices)),
//! 6. otherwise every source device exists on the source
//!    ([`InvalidSourceDeviceIndices`](DeviceMapError::InvalidSourceDeviceIndices));
//! 7. if the destination declared devices, every target device is one of them
//!    ([`UnexpectedTargetDevices`](DeviceMapError::UnexpectedTargetDevices)),
//! 8. otherwise, if the destination is a known member, every target device exists on it
//!    ([`InvalidTargetDeviceIndices`](DeviceMapError::InvalidTargetDeviceIndices)).
//!
//! Dynamic groups skip rule 3 (a destination may not have joined yet), and rules 7 and 8 are
//! then skipped for destinations that are not members.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::device::{Device, DeviceList, DeviceMap, DeviceMaps};

/// What one worker tells the others about its devices, as PyTorch's agents exchange it at init.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerDeviceInfo {
    /// The worker's name.
    pub name: String,
    /// How many CUDA devices the worker has.
    pub device_count: u32,
    /// The devices the worker declared it will use; empty means "derive them from the maps".
    #[serde(default)]
    pub devices: Vec<Device>,
    /// Where the worker's tensors land on each destination worker.
    #[serde(default)]
    pub device_maps: DeviceMaps,
}

/// Whether a group's membership is fixed at init.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// A fixed world size: every destination must be a member.
    Static,
    /// Workers join and leave: destinations may not have joined yet.
    Dynamic,
}

/// The eight kinds of device-map error, in the order the rules are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceMapErrorKind {
    /// Rule 1.
    DuplicatedDevices,
    /// Rule 2.
    InvalidDeviceIndices,
    /// Rule 3.
    InvalidTargetNodeNames,
    /// Rule 4.
    DuplicatedTargetDevices,
    /// Rule 5.
    UnexpectedSourceDevices,
    /// Rule 6.
    InvalidSourceDeviceIndices,
    /// Rule 7.
    UnexpectedTargetDevices,
    /// Rule 8.
    InvalidTargetDeviceIndices,
}

impl DeviceMapErrorKind {
    /// All kinds, in rule order.
    pub const ALL: [DeviceMapErrorKind; 8] = [
        Self::DuplicatedDevices,
        Self::InvalidDeviceIndices,
        Self::InvalidTargetNodeNames,
        Self::DuplicatedTargetDevices,
        Self::UnexpectedSourceDevices,
        Self::InvalidSourceDeviceIndices,
        Self::UnexpectedTargetDevices,
        Self::InvalidTargetDeviceIndices,
    ];

    /// The snake_case name used in JSON reports, e.g. `duplicated_target_devices`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DuplicatedDevices => "duplicated_devices",
            Self::InvalidDeviceIndices => "invalid_device_indices",
            Self::InvalidTargetNodeNames => "invalid_target_node_names",
            Self::DuplicatedTargetDevices => "duplicated_target_devices",
            Self::UnexpectedSourceDevices => "unexpected_source_devices",
            Self::InvalidSourceDeviceIndices => "invalid_source_device_indices",
            Self::UnexpectedTargetDevices => "unexpected_target_devices",
            Self::InvalidTargetDeviceIndices => "invalid_target_device_indices",
        }
    }
}

impl fmt::Display for DeviceMapErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A device-map rule that a group's plan breaks. Messages start as PyTorch's do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceMapError {
    /// Rule 1: a worker declared the same device twice.
    #[error("Node {node} has duplicated devices\ndevices = {}", DeviceList(.devices))]
    DuplicatedDevices {
        /// The worker.
        node: String,
        /// Its declared devices.
        devices: Vec<Device>,
    },
    /// Rule 2: a worker declared a device it does not have.
    #[error(
        "Node {node} has devices with invalid indices\ndevices = {}\ndevice count = {device_count}",
        DeviceList(.devices)
    )]
    InvalidDeviceIndices {
        /// The worker.
        node: String,
        /// Its declared devices.
        devices: Vec<Device>,
        /// Its CUDA device count.
        device_count: u32,
    },
    /// Rule 3: a worker has maps for workers that are not in the (static) group.
    #[error(
        "Node {node} has invalid target node names in its device maps\ndevice maps = [{}]\nnode names = [{}]\nunknown = [{}]",
        .targets.join(", "), .names.join(", "), .unknown.join(", ")
    )]
    InvalidTargetNodeNames {
        /// The worker.
        node: String,
        /// The destinations of its maps.
        targets: Vec<String>,
        /// The members of the group.
        names: Vec<String>,
        /// The destinations that are not members.
        unknown: Vec<String>,
    },
    /// Rule 4: two source devices map to the same target device.
    #[error("Node {node} has duplicated target devices in its device map for {target}\ndevice map = {map}")]
    DuplicatedTargetDevices {
        /// The source worker.
        node: String,
        /// The destination worker.
        target: String,
        /// The offending map.
        map: DeviceMap,
    },
    /// Rule 5: a map uses source devices the worker did not declare.
    #[error(
        "Node {node} has unexpected source devices in its device map for {target}\ndevice map = {map}\ndevices = {}",
        DeviceList(.devices)
    )]
    UnexpectedSourceDevices {
        /// The source worker.
        node: String,
        /// The destination worker.
        target: String,
        /// The offending map.
        map: DeviceMap,
        /// The source worker's declared devices.
        devices: Vec<Device>,
    },
    /// Rule 6: a map uses source devices the worker does not have.
    #[error(
        "Node {node} has source devices with invalid indices in its device map for {target}\ndevice map = {map}\ndevice count = {device_count}"
    )]
    InvalidSourceDeviceIndices {
        /// The source worker.
        node: String,
        /// The destination worker.
        target: String,
        /// The offending map.
        map: DeviceMap,
        /// The source worker's CUDA device count.
        device_count: u32,
    },
    /// Rule 7: a map uses target devices the destination did not declare.
    #[error(
        "Node {node} has unexpected target devices in its device map for {target}\ndevice map = {map}\ndevices = {}",
        DeviceList(.devices)
    )]
    UnexpectedTargetDevices {
        /// The source worker.
        node: String,
        /// The destination worker.
        target: String,
        /// The offending map.
        map: DeviceMap,
        /// The destination's declared devices.
        devices: Vec<Device>,
    },
    /// Rule 8: a map uses target devices the destination does not have.
    #[error(
        "Node {node} has target devices with invalid indices in its device map for {target}\ndevice map = {map}\ndevice count = {device_count}"
    )]
    InvalidTargetDeviceIndices {
        /// The source worker.
        node: String,
        /// The destination worker.
        target: String,
        /// The offending map.
        map: DeviceMap,
        /// The destination's CUDA device count.
        device_count: u32,
    },
}

impl DeviceMapError {
    /// Which rule was broken.
    pub fn kind(&self) -> DeviceMapErrorKind {
        use DeviceMapErrorKind as K;
        match self {
            Self::DuplicatedDevices { .. } => K::DuplicatedDevices,
            Self::InvalidDeviceIndices { .. } => K::InvalidDeviceIndices,
            Self::InvalidTargetNodeNames { .. } => K::InvalidTargetNodeNames,
            Self::DuplicatedTargetDevices { .. } => K::DuplicatedTargetDevices,
            Self::UnexpectedSourceDevices { .. } => K::UnexpectedSourceDevices,
            Self::InvalidSourceDeviceIndices { .. } => K::InvalidSourceDeviceIndices,
            Self::UnexpectedTargetDevices { .. } => K::UnexpectedTargetDevices,
            Self::InvalidTargetDeviceIndices { .. } => K::InvalidTargetDeviceIndices,
        }
    }

    /// The worker whose plan is at fault.
    pub fn node(&self) -> &str {
        match self {
            Self::DuplicatedDevices { node, .. }
            | Self::InvalidDeviceIndices { node, .. }
            | Self::InvalidTargetNodeNames { node, .. }
            | Self::DuplicatedTargetDevices { node, .. }
            | Self::UnexpectedSourceDevices { node, .. }
            | Self::InvalidSourceDeviceIndices { node, .. }
            | Self::UnexpectedTargetDevices { node, .. }
            | Self::InvalidTargetDeviceIndices { node, .. } => node,
        }
    }

    /// The destination whose map is at fault, for rules 4 to 8.
    pub fn target(&self) -> Option<&str> {
        match self {
            Self::DuplicatedDevices { .. }
            | Self::InvalidDeviceIndices { .. }
            | Self::InvalidTargetNodeNames { .. } => None,
            Self::DuplicatedTargetDevices { target, .. }
            | Self::UnexpectedSourceDevices { target, .. }
            | Self::InvalidSourceDeviceIndices { target, .. }
            | Self::UnexpectedTargetDevices { target, .. }
            | Self::InvalidTargetDeviceIndices { target, .. } => Some(target),
        }
    }
}

fn all_exist<I: IntoIterator<Item = Device>>(devices: I, device_count: u32) -> bool {
    devices.into_iter().all(|d| d.exists_among(device_count))
}

fn has_duplicates<I: IntoIterator<Item = Device>>(devices: I) -> bool {
    let mut seen = std::collections::HashSet::new();
    devices.into_iter().any(|d| !seen.insert(d))
}

/// Checks the device plans of a whole group, in PyTorch's rule order (see the module docs).
///
/// `workers` is the group in rank order. Names are expected to be distinct; if one repeats, the
/// later entry stands for that name, as it does in PyTorch's dictionaries.
///
/// ```
/// use tensorwire_core::device::{Device, DeviceMap, DeviceMaps};
/// use tensorwire_core::validate::{validate_device_maps, DeviceMapErrorKind, GroupKind, WorkerDeviceInfo};
///
/// let mut maps = DeviceMaps::new();
/// maps.insert("ps", [(Device::Cuda(0), Device::Cuda(1)), (Device::Cuda(1), Device::Cuda(1))].into_iter().collect());
/// let trainer = WorkerDeviceInfo { name: "trainer".into(), device_count: 2, devices: vec![], device_maps: maps };
/// let ps = WorkerDeviceInfo { name: "ps".into(), device_count: 2, ..Default::default() };
/// let err = validate_device_maps(&[trainer, ps], GroupKind::Static).unwrap_err();
/// assert_eq!(err.kind(), DeviceMapErrorKind::DuplicatedTargetDevices);
/// assert!(err.to_string().starts_with("Node trainer has duplicated target devices in its device map for ps"));
/// ```
// The error is large, but it is returned at most once per init, never on a hot path.
#[allow(clippy::result_large_err)]
pub fn validate_device_maps(
    workers: &[WorkerDeviceInfo],
    group: GroupKind,
) -> Result<(), DeviceMapError> {
    let by_name: HashMap<&str, &WorkerDeviceInfo> =
        workers.iter().map(|w| (w.name.as_str(), w)).collect();
    // Iterate names in group order but resolve each through the name table, as PyTorch does.
    let resolve = |name: &str| by_name[name];

    for w in workers {
        let w = resolve(&w.name);
        if has_duplicates(w.devices.iter().copied()) {
            return Err(DeviceMapError::DuplicatedDevices {
                node: w.name.clone(),
                devices: w.devices.clone(),
            });
        }
        if !all_exist(w.devices.iter().copied(), w.device_count) {
            return Err(DeviceMapError::InvalidDeviceIndices {
                node: w.name.clone(),
                devices: w.devices.clone(),
                device_count: w.device_count,
            });
        }
    }

    for source in workers {
        let source = resolve(&source.name);
        if group == GroupKind::Static {
            let unknown: Vec<String> = source
                .device_maps
                .destinations()
                .filter(|t| !by_name.contains_key(t))
                .map(str::to_owned)
                .collect();
            if !unknown.is_empty() {
                return Err(DeviceMapError::InvalidTargetNodeNames {
                    node: source.name.clone(),
                    targets: source
                        .device_maps
                        .destinations()
                        .map(str::to_owned)
                        .collect(),
                    names: workers.iter().map(|w| w.name.clone()).collect(),
                    unknown,
                });
            }
        }
        for (target, map) in source.device_maps.iter() {
            if has_duplicates(map.targets()) {
                return Err(DeviceMapError::DuplicatedTargetDevices {
                    node: source.name.clone(),
                    target: target.to_owned(),
                    map: map.clone(),
                });
            }
            if !source.devices.is_empty() {
                if !map.sources().all(|d| source.devices.contains(&d)) {
                    return Err(DeviceMapError::UnexpectedSourceDevices {
                        node: source.name.clone(),
                        target: target.to_owned(),
                        map: map.clone(),
                        devices: source.devices.clone(),
                    });
                }
            } else if !all_exist(map.sources(), source.device_count) {
                return Err(DeviceMapError::InvalidSourceDeviceIndices {
                    node: source.name.clone(),
                    target: target.to_owned(),
                    map: map.clone(),
                    device_count: source.device_count,
                });
            }
            // Dynamic groups: a destination that has not joined yet is not checked.
            let Some(dest) = by_name.get(target) else {
                continue;
            };
            if !dest.devices.is_empty() {
                if !map.targets().all(|d| dest.devices.contains(&d)) {
                    return Err(DeviceMapError::UnexpectedTargetDevices {
                        node: source.name.clone(),
                        target: target.to_owned(),
                        map: map.clone(),
                        devices: dest.devices.clone(),
                    });
                }
            } else if !all_exist(map.targets(), dest.device_count) {
                return Err(DeviceMapError::InvalidTargetDeviceIndices {
                    node: source.name.clone(),
                    target: target.to_owned(),
                    map: map.clone(),
                    device_count: dest.device_count,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(s: &str) -> Device {
        s.parse().unwrap()
    }

    fn map(pairs: &[(&str, &str)]) -> DeviceMap {
        pairs.iter().map(|(a, b)| (dev(a), dev(b))).collect()
    }

    fn worker(
        name: &str,
        count: u32,
        devices: &[&str],
        maps: &[(&str, DeviceMap)],
    ) -> WorkerDeviceInfo {
        WorkerDeviceInfo {
            name: name.into(),
            device_count: count,
            devices: devices.iter().map(|d| dev(d)).collect(),
            device_maps: maps
                .iter()
                .map(|(t, m)| ((*t).to_owned(), m.clone()))
                .collect(),
        }
    }

    fn kind(ws: &[WorkerDeviceInfo], g: GroupKind) -> Option<DeviceMapErrorKind> {
        validate_device_maps(ws, g).err().map(|e| e.kind())
    }

    #[test]
    fn each_rule_fires() {
        use DeviceMapErrorKind as K;
        let s = GroupKind::Static;
        let ok = worker("b", 2, &[], &[]);
        let cases: Vec<(Vec<WorkerDeviceInfo>, K)> = vec![
            (
                vec![worker("a", 2, &["cuda:0", "cuda:0"], &[]), ok.clone()],
                K::DuplicatedDevices,
            ),
            (
                vec![worker("a", 2, &["cuda:2"], &[]), ok.clone()],
                K::InvalidDeviceIndices,
            ),
            (
                vec![worker("a", 2, &[], &[("zz", map(&[]))]), ok.clone()],
                K::InvalidTargetNodeNames,
            ),
            (
                vec![
                    worker(
                        "a",
                        2,
                        &[],
                        &[("b", map(&[("cuda:0", "cuda:1"), ("cuda:1", "cuda:1")]))],
                    ),
                    ok.clone(),
                ],
                K::DuplicatedTargetDevices,
            ),
            (
                vec![
                    worker("a", 2, &["cuda:0"], &[("b", map(&[("cuda:1", "cuda:1")]))]),
                    ok.clone(),
                ],
                K::UnexpectedSourceDevices,
            ),
            (
                vec![
                    worker("a", 1, &[], &[("b", map(&[("cuda:1", "cuda:1")]))]),
                    ok.clone(),
                ],
                K::InvalidSourceDeviceIndices,
            ),
            (
                vec![
                    worker("a", 2, &[], &[("b", map(&[("cuda:1", "cuda:1")]))]),
                    worker("b", 2, &["cuda:0"], &[]),
                ],
                K::UnexpectedTargetDevices,
            ),
            (
                vec![
                    worker("a", 2, &[], &[("b", map(&[("cuda:1", "cuda:2")]))]),
                    ok.clone(),
                ],
                K::InvalidTargetDeviceIndices,
            ),
        ];
        for (ws, want) in cases {
            assert_eq!(kind(&ws, s), Some(want), "{ws:?}");
        }
    }

    #[test]
    fn cpu_always_exists_and_maps_to_cpu_are_fine() {
        let ws = [
            worker("a", 0, &["cpu"], &[("b", map(&[("cpu", "cpu")]))]),
            worker("b", 0, &[], &[]),
        ];
        assert_eq!(kind(&ws, GroupKind::Static), None);
    }

    #[test]
    fn dynamic_groups_skip_unknown_targets() {
        let ws = [worker(
            "a",
            1,
            &[],
            &[("later", map(&[("cuda:0", "cuda:5")]))],
        )];
        assert_eq!(
            kind(&ws, GroupKind::Static),
            Some(DeviceMapErrorKind::InvalidTargetNodeNames)
        );
        assert_eq!(kind(&ws, GroupKind::Dynamic), None);
        // Source-side rules still apply to unknown targets.
        let ws = [worker(
            "a",
            1,
            &[],
            &[("later", map(&[("cuda:3", "cuda:0")]))],
        )];
        assert_eq!(
            kind(&ws, GroupKind::Dynamic),
            Some(DeviceMapErrorKind::InvalidSourceDeviceIndices)
        );
    }

    #[test]
    fn first_error_follows_pytorch_order() {
        // Rule 2 on the second worker is found before rule 4 on the first.
        let ws = [
            worker(
                "a",
                2,
                &[],
                &[("b", map(&[("cuda:0", "cuda:1"), ("cuda:1", "cuda:1")]))],
            ),
            worker("b", 1, &["cuda:3"], &[]),
        ];
        let err = validate_device_maps(&ws, GroupKind::Static).unwrap_err();
        assert_eq!(err.kind(), DeviceMapErrorKind::InvalidDeviceIndices);
        assert_eq!(err.node(), "b");
        // Targets are checked in the order the maps list them.
        let ws = [
            worker(
                "a",
                2,
                &[],
                &[
                    ("b", map(&[("cuda:0", "cuda:9")])),
                    ("a", map(&[("cuda:0", "cuda:0"), ("cuda:1", "cuda:0")])),
                ],
            ),
            worker("b", 2, &[], &[]),
        ];
        let err = validate_device_maps(&ws, GroupKind::Static).unwrap_err();
        assert_eq!(err.kind(), DeviceMapErrorKind::InvalidTargetDeviceIndices);
        assert_eq!(err.target(), Some("b"));
    }

    #[test]
    fn messages_name_the_worker_and_the_map() {
        let ws = [
            worker(
                "trainer0",
                2,
                &[],
                &[("ps", map(&[("cuda:0", "cuda:1"), ("cuda:1", "cuda:1")]))],
            ),
            worker("ps", 2, &[], &[]),
        ];
        let err = validate_device_maps(&ws, GroupKind::Static).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Node trainer0 has duplicated target devices in its device map for ps\n\
             device map = {cuda:0: cuda:1, cuda:1: cuda:1}"
        );
        let ws = [worker("w", 1, &["cuda:0", "cuda:4"], &[])];
        assert_eq!(
            validate_device_maps(&ws, GroupKind::Static)
                .unwrap_err()
                .to_string(),
            "Node w has devices with invalid indices\ndevices = [cuda:0, cuda:4]\ndevice count = 1"
        );
    }
}
