//! Devices and device maps.
//!
//! A [`Device`] is `cpu` or `cuda:N`, written and read as exactly those strings (also through
//! serde). A [`DeviceMap`] says, for one destination worker, on which of its devices a tensor
//! from each of our devices lands. [`DeviceMaps`] holds one map per destination worker.
//!
//! Both maps keep insertion order: PyTorch walks Python dicts in insertion order, so the first
//! problem its rules report depends on it, and so does ours.

use std::fmt;
use std::str::FromStr;

use indexmap::IndexMap;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The largest CUDA device index PyTorch can represent (`c10::DeviceIndex` is an `int8_t`).
pub const MAX_DEVICE_INDEX: u8 = i8::MAX as u8;

/// A device: the host CPU or one CUDA device.
///
/// ```
/// use tensorwire_core::device::Device;
/// let d: Device = "cuda:1".parse().unwrap();
/// assert_eq!(d, Device::Cuda(1));
/// assert_eq!(d.to_string(), "cuda:1");
/// assert!("gpu:0".parse::<Device>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// The CUDA device with this index.
    Cuda(u8),
}

impl Device {
    /// The CUDA index, or `None` for the CPU (PyTorch's `device.index`).
    pub fn index(self) -> Option<u8> {
        match self {
            Device::Cpu => None,
            Device::Cuda(i) => Some(i),
        }
    }

    /// Whether this is the CPU.
    pub fn is_cpu(self) -> bool {
        self == Device::Cpu
    }

    /// PyTorch's `_tensorpipe_validate_devices` for one device: the CPU always exists; a CUDA
    /// device exists when its index is below `device_count`.
    pub fn exists_among(self, device_count: u32) -> bool {
        match self {
            Device::Cpu => true,
            Device::Cuda(i) => u32::from(i) < device_count,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Why a string is not a device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid device {input:?}: {reason}")]
pub struct DeviceParseError {
    /// The string that was given.
    pub input: String,
    /// What is wrong with it.
    pub reason: DeviceParseReason,
}

/// The ways a device string can be wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceParseReason {
    /// Neither `cpu` nor `cuda`.
    #[error("unknown device type; expected \"cpu\" or \"cuda:N\"")]
    UnknownType,
    /// `cuda` without `:N`.
    #[error("a CUDA device needs an index, as in \"cuda:0\"")]
    MissingIndex,
    /// `cpu:N`: the CPU has no index here.
    #[error("the CPU takes no index; write \"cpu\"")]
    CpuWithIndex,
    /// The index is not a plain non-negative decimal number without leading zeros.
    #[error("the index must be a non-negative decimal number without sign or leading zeros")]
    BadIndex,
    /// The index is larger than PyTorch's device index type can hold.
    #[error("the index is larger than 127, the largest device index PyTorch supports")]
    IndexTooLarge,
}

impl FromStr for Device {
    type Err = DeviceParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |reason| DeviceParseError {
            input: s.to_owned(),
            reason,
        };
        let (kind, index) = match s.split_once(':') {
            Some((kind, index)) => (kind, Some(index)),
            None => (s, None),
        };
        match (kind, index) {
            ("cpu", None) => Ok(Device::Cpu),
            ("cpu", Some(_)) => Err(fail(DeviceParseReason::CpuWithIndex)),
            ("cuda", None) => Err(fail(DeviceParseReason::MissingIndex)),
            ("cuda", Some(index)) => {
                let canonical = !index.is_empty()
                    && index.bytes().all(|b| b.is_ascii_digit())
                    && (index == "0" || !index.starts_with('0'));
                if !canonical {
                    return Err(fail(DeviceParseReason::BadIndex));
                }
                match index.parse::<u8>() {
                    Ok(i) if i <= MAX_DEVICE_INDEX => Ok(Device::Cuda(i)),
                    _ => Err(fail(DeviceParseReason::IndexTooLarge)),
                }
            }
            _ => Err(fail(DeviceParseReason::UnknownType)),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DeviceVisitor;
        impl Visitor<'_> for DeviceVisitor {
            type Value = Device;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a device string such as \"cpu\" or \"cuda:0\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Device, E> {
                v.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_str(DeviceVisitor)
    }
}

/// Formats a list of devices as `[cuda:0, cpu]`.
pub struct DeviceList<'a>(pub &'a [Device]);

impl fmt::Display for DeviceList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Where tensors from each local device land on one destination worker.
///
/// Keeps insertion order. A map read through serde refuses a source device listed twice.
///
/// ```
/// use tensorwire_core::device::{Device, DeviceMap};
/// let mut map = DeviceMap::new();
/// map.insert(Device::Cuda(0), Device::Cuda(1));
/// assert_eq!(map.get(Device::Cuda(0)), Some(Device::Cuda(1)));
/// assert_eq!(map.to_string(), "{cuda:0: cuda:1}");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceMap {
    entries: IndexMap<Device, Device>,
}

impl DeviceMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Maps `source` to `target`, returning the target it had before.
    pub fn insert(&mut self, source: Device, target: Device) -> Option<Device> {
        self.entries.insert(source, target)
    }

    /// The target for `source`.
    pub fn get(&self, source: Device) -> Option<Device> {
        self.entries.get(&source).copied()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the map has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// `(source, target)` pairs in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (Device, Device)> + '_ {
        self.entries.iter().map(|(s, t)| (*s, *t))
    }

    /// Source devices in insertion order.
    pub fn sources(&self) -> impl Iterator<Item = Device> + '_ {
        self.entries.keys().copied()
    }

    /// Target devices in insertion order.
    pub fn targets(&self) -> impl Iterator<Item = Device> + '_ {
        self.entries.values().copied()
    }
}

/// Why entries cannot be added to a device map ([`DeviceMaps::add`]): PyTorch's
/// `set_device_map` rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DeviceMapChange {
    /// The entry changes the target of a source mapped earlier.
    #[error("{from} is already mapped to {old}, not {new}")]
    Remapped {
        /// The source device.
        from: Device,
        /// Its target so far.
        old: Device,
        /// The target asked for.
        new: Device,
    },
    /// The entry gives a target a second source.
    #[error("{target} is already the target of {other}; maps must be one-to-one")]
    SharedTarget {
        /// The target device.
        target: Device,
        /// The source already mapped to it.
        other: Device,
    },
}

impl FromIterator<(Device, Device)> for DeviceMap {
    fn from_iter<I: IntoIterator<Item = (Device, Device)>>(iter: I) -> Self {
        Self {
            entries: iter.into_iter().collect(),
        }
    }
}

impl fmt::Display for DeviceMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (s, t)) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{s}: {t}")?;
        }
        f.write_str("}")
    }
}

impl Serialize for DeviceMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.entries.iter())
    }
}

impl<'de> Deserialize<'de> for DeviceMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let entries = deserializer.deserialize_map(UniqueKeys::<Device, Device>::new(
            "a device map such as {\"cuda:0\": \"cuda:1\"}",
            "source device",
        ))?;
        Ok(Self { entries })
    }
}

/// The device maps of one worker: destination worker name to [`DeviceMap`].
///
/// Keeps insertion order. Read through serde, a destination listed twice is refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceMaps {
    maps: IndexMap<String, DeviceMap>,
}

impl DeviceMaps {
    /// No maps.
    pub fn new() -> Self {
        Self::default()
    }

    /// The map for destination `to`.
    pub fn get(&self, to: &str) -> Option<&DeviceMap> {
        self.maps.get(to)
    }

    /// Whether there is a map for destination `to`.
    pub fn contains(&self, to: &str) -> bool {
        self.maps.contains_key(to)
    }

    /// Sets the whole map for destination `to`, returning the one it replaces.
    pub fn insert(&mut self, to: impl Into<String>, map: DeviceMap) -> Option<DeviceMap> {
        self.maps.insert(to.into(), map)
    }

    /// The map for destination `to`, created empty if missing.
    pub fn entry(&mut self, to: impl Into<String>) -> &mut DeviceMap {
        self.maps.entry(to.into()).or_default()
    }

    /// `(destination, map)` pairs in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &DeviceMap)> + '_ {
        self.maps.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Destination names in insertion order.
    pub fn destinations(&self) -> impl Iterator<Item = &str> + '_ {
        self.maps.keys().map(String::as_str)
    }

    /// Number of destinations.
    pub fn len(&self) -> usize {
        self.maps.len()
    }

    /// Whether there are no maps.
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }
}

impl DeviceMaps {
    /// Adds `entries` to the map for `to`, as PyTorch's `set_device_map`: incremental (an
    /// entry already there is kept), one-to-one, and an entry that changes an earlier one is
    /// refused. Refused, nothing changes.
    ///
    /// # Errors
    /// [`DeviceMapChange`]: which entry, and which rule it breaks.
    pub fn add(&mut self, to: &str, entries: &[(Device, Device)]) -> Result<(), DeviceMapChange> {
        let mut merged = self.get(to).cloned().unwrap_or_default();
        for &(from, new) in entries {
            if let Some(old) = merged.get(from).filter(|old| *old != new) {
                return Err(DeviceMapChange::Remapped { from, old, new });
            }
            if let Some((other, _)) = merged.iter().find(|&(o, t)| t == new && o != from) {
                return Err(DeviceMapChange::SharedTarget { target: new, other });
            }
            merged.insert(from, new);
        }
        self.insert(to, merged);
        Ok(())
    }
}

impl FromIterator<(String, DeviceMap)> for DeviceMaps {
    fn from_iter<I: IntoIterator<Item = (String, DeviceMap)>>(iter: I) -> Self {
        Self {
            maps: iter.into_iter().collect(),
        }
    }
}

impl Serialize for DeviceMaps {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.maps.iter())
    }
}

impl<'de> Deserialize<'de> for DeviceMaps {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let maps = deserializer.deserialize_map(UniqueKeys::<String, DeviceMap>::new(
            "device maps: an object from worker name to device map",
            "destination worker",
        ))?;
        Ok(Self { maps })
    }
}

/// A map visitor that keeps order and refuses a key seen twice, naming it.
struct UniqueKeys<K, V> {
    expecting: &'static str,
    key_role: &'static str,
    _types: std::marker::PhantomData<(K, V)>,
}

impl<K, V> UniqueKeys<K, V> {
    fn new(expecting: &'static str, key_role: &'static str) -> Self {
        Self {
            expecting,
            key_role,
            _types: std::marker::PhantomData,
        }
    }
}

impl<'de, K, V> Visitor<'de> for UniqueKeys<K, V>
where
    K: Deserialize<'de> + Eq + std::hash::Hash + fmt::Display,
    V: Deserialize<'de>,
{
    type Value = IndexMap<K, V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        let mut out = IndexMap::with_capacity(access.size_hint().unwrap_or(0).min(1024));
        while let Some(key) = access.next_key::<K>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!(
                    "{} {key} is listed twice",
                    self.key_role
                )));
            }
            let value = access.next_value::<V>()?;
            out.insert(key, value);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn device_map_entries_are_added_incrementally_and_one_to_one() {
        let (c0, c1, c2) = (Device::Cuda(0), Device::Cuda(1), Device::Cuda(2));
        let mut maps = DeviceMaps::new();
        maps.add("ps", &[(c0, c1)]).unwrap();
        maps.add("ps", &[(c1, c0), (c0, c1)]).unwrap();
        assert_eq!(maps.get("ps").unwrap().len(), 2);
        let before = maps.clone();
        let e = maps.add("ps", &[(c2, c2), (c0, c2)]).unwrap_err();
        assert_eq!(
            e,
            DeviceMapChange::Remapped {
                from: c0,
                old: c1,
                new: c2
            }
        );
        assert_eq!(
            e.to_string(),
            "cuda:0 is already mapped to cuda:1, not cuda:2"
        );
        assert_eq!(maps, before, "a refused change changes nothing");
        let e = maps.add("ps", &[(c2, c1)]).unwrap_err();
        assert_eq!(
            e,
            DeviceMapChange::SharedTarget {
                target: c1,
                other: c0
            }
        );
        assert!(e.to_string().ends_with("maps must be one-to-one"), "{e}");
        maps.add("w1", &[(c2, c1)]).unwrap();
        assert_eq!(maps.get("w1").unwrap().get(c2), Some(c1));
    }

    use super::*;

    #[test]
    fn parses_and_displays() {
        for s in ["cpu", "cuda:0", "cuda:7", "cuda:127"] {
            let d: Device = s.parse().unwrap();
            assert_eq!(d.to_string(), s);
        }
    }

    #[test]
    fn rejects_bad_strings_with_reasons() {
        let cases = [
            ("gpu:0", DeviceParseReason::UnknownType),
            ("", DeviceParseReason::UnknownType),
            ("CUDA:0", DeviceParseReason::UnknownType),
            ("cuda", DeviceParseReason::MissingIndex),
            ("cpu:0", DeviceParseReason::CpuWithIndex),
            ("cuda:-1", DeviceParseReason::BadIndex),
            ("cuda:x", DeviceParseReason::BadIndex),
            ("cuda:", DeviceParseReason::BadIndex),
            ("cuda:01", DeviceParseReason::BadIndex),
            ("cuda:+1", DeviceParseReason::BadIndex),
            ("cuda: 1", DeviceParseReason::BadIndex),
            ("cuda:128", DeviceParseReason::IndexTooLarge),
            (
                "cuda:99999999999999999999",
                DeviceParseReason::IndexTooLarge,
            ),
        ];
        for (s, reason) in cases {
            let err = s.parse::<Device>().unwrap_err();
            assert_eq!(err.reason, reason, "{s}");
            assert!(err.to_string().contains(&format!("{s:?}")), "{err}");
        }
    }

    #[test]
    fn serde_uses_plain_strings_and_keeps_order() {
        let json = r#"{"ps":{"cuda:1":"cuda:0","cpu":"cpu"},"a":{"cuda:0":"cuda:0"}}"#;
        let maps: DeviceMaps = serde_json::from_str(json).unwrap();
        assert_eq!(maps.destinations().collect::<Vec<_>>(), ["ps", "a"]);
        let ps = maps.get("ps").unwrap();
        assert_eq!(
            ps.sources().collect::<Vec<_>>(),
            [Device::Cuda(1), Device::Cpu]
        );
        assert_eq!(serde_json::to_string(&maps).unwrap(), json);
    }

    #[test]
    fn serde_refuses_duplicate_keys() {
        let err = serde_json::from_str::<DeviceMap>(r#"{"cuda:0":"cuda:1","cuda:0":"cuda:2"}"#)
            .unwrap_err();
        assert!(err
            .to_string()
            .contains("source device cuda:0 is listed twice"));
        let err = serde_json::from_str::<DeviceMaps>(r#"{"ps":{},"ps":{}}"#).unwrap_err();
        assert!(err
            .to_string()
            .contains("destination worker ps is listed twice"));
        let err = serde_json::from_str::<DeviceMap>(r#"{"gpu:0":"cuda:1"}"#).unwrap_err();
        assert!(err.to_string().contains("\"gpu:0\""));
    }

    #[test]
    fn existence_follows_device_count() {
        assert!(Device::Cpu.exists_among(0));
        assert!(!Device::Cuda(0).exists_among(0));
        assert!(Device::Cuda(1).exists_among(2));
        assert!(!Device::Cuda(2).exists_among(2));
    }
}
