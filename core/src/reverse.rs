//! Reverse device maps and the device list an agent handles.
//!
//! When worker `a` maps its `cuda:0` to `b`'s `cuda:1`, `b` must send responses to `a`'s
//! requests back the other way: `b`'s reverse map for `a` is `{cuda:1: cuda:0}`
//! (PyTorch's `_create_reverse_mapping`). The devices an agent handles are the ones it declared,
//! or else every device that appears on its side of its own maps and of its reverse maps
//! (PyTorch's `_create_device_list`).

use std::collections::BTreeSet;

use crate::device::{Device, DeviceMap, DeviceMaps};
use crate::validate::WorkerDeviceInfo;

/// The reverse device maps of worker `my_name`: for every worker (in group order) whose maps
/// have an entry for `my_name`, that map inverted, keyed by that worker's name.
///
/// Call it on a validated group: a map with duplicated targets has no inverse.
///
/// ```
/// use tensorwire_core::device::{Device, DeviceMaps};
/// use tensorwire_core::reverse::reverse_device_maps;
/// use tensorwire_core::validate::WorkerDeviceInfo;
///
/// let mut maps = DeviceMaps::new();
/// maps.insert("ps", [(Device::Cuda(0), Device::Cuda(1))].into_iter().collect());
/// let trainer = WorkerDeviceInfo { name: "trainer".into(), device_count: 1, devices: vec![], device_maps: maps };
/// let ps = WorkerDeviceInfo { name: "ps".into(), device_count: 2, ..Default::default() };
/// let reverse = reverse_device_maps("ps", &[trainer, ps]);
/// assert_eq!(reverse.get("trainer").unwrap().get(Device::Cuda(1)), Some(Device::Cuda(0)));
/// ```
pub fn reverse_device_maps(my_name: &str, workers: &[WorkerDeviceInfo]) -> DeviceMaps {
    let mut reverse = DeviceMaps::new();
    for w in workers {
        if let Some(map) = w.device_maps.get(my_name) {
            let inverted: DeviceMap = map.iter().map(|(s, t)| (t, s)).collect();
            reverse.insert(w.name.clone(), inverted);
        }
    }
    reverse
}

/// The devices an agent handles, sorted by index and without the CPU.
///
/// The declared `devices` when there are any; otherwise every source device of `my_maps` and
/// every source device of `reverse_maps` (the devices responses leave from).
///
/// PyTorch keeps `cpu` in a declared list (and then fails to sort a list that mixes `cpu` with
/// CUDA devices); we leave the CPU out, since it needs no device handling.
pub fn device_list(
    devices: &[Device],
    my_maps: &DeviceMaps,
    reverse_maps: &DeviceMaps,
) -> Vec<Device> {
    let mut out: Vec<Device> = if devices.is_empty() {
        let set: BTreeSet<Device> = my_maps
            .iter()
            .chain(reverse_maps.iter())
            .flat_map(|(_, map)| map.sources())
            .collect();
        set.into_iter().collect()
    } else {
        let mut seen = BTreeSet::new();
        devices
            .iter()
            .copied()
            .filter(|d| seen.insert(*d))
            .collect()
    };
    out.retain(|d| !d.is_cpu());
    out.sort_by_key(|d| d.index());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(s: &str) -> Device {
        s.parse().unwrap()
    }

    #[test]
    fn derived_list_uses_both_sides_and_drops_cpu() {
        let mut mine = DeviceMaps::new();
        mine.insert(
            "b",
            [(dev("cuda:3"), dev("cuda:0")), (dev("cpu"), dev("cuda:1"))]
                .into_iter()
                .collect(),
        );
        let mut rev = DeviceMaps::new();
        rev.insert(
            "c",
            [
                (dev("cuda:1"), dev("cuda:0")),
                (dev("cuda:3"), dev("cuda:1")),
            ]
            .into_iter()
            .collect(),
        );
        assert_eq!(
            device_list(&[], &mine, &rev),
            [dev("cuda:1"), dev("cuda:3")]
        );
    }

    #[test]
    fn declared_list_wins_and_is_sorted() {
        let mut mine = DeviceMaps::new();
        mine.insert("b", [(dev("cuda:3"), dev("cuda:0"))].into_iter().collect());
        let declared = [dev("cuda:2"), dev("cpu"), dev("cuda:0")];
        assert_eq!(
            device_list(&declared, &mine, &DeviceMaps::new()),
            [dev("cuda:0"), dev("cuda:2")]
        );
    }

    #[test]
    fn self_maps_reverse_too() {
        let mut maps = DeviceMaps::new();
        maps.insert("a", [(dev("cuda:0"), dev("cuda:1"))].into_iter().collect());
        let a = WorkerDeviceInfo {
            name: "a".into(),
            device_count: 2,
            devices: vec![],
            device_maps: maps,
        };
        let rev = reverse_device_maps("a", &[a]);
        assert_eq!(
            rev.get("a").unwrap().get(dev("cuda:1")),
            Some(dev("cuda:0"))
        );
    }
}
