//! Who is in the group, as one worker sees it: each member's name, rank and device plan, and
//! what this worker derives from them (its reverse device maps and the devices it handles).
//! Fixed after a static group's init; in a dynamic group the membership's events change it.
//! The agent keeps one and asks it to resolve the workers its callers name.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::MemberRecord;
use crate::device::{Device, DeviceMaps};
use crate::name::WorkerId;
use crate::reverse::{device_list, reverse_device_maps};
use crate::validate::WorkerDeviceInfo;

/// A worker's name and id (its rank in a static group).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The name.
    pub name: String,
    /// The id (rank).
    pub id: WorkerId,
}

impl fmt::Display for WorkerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (rank {})", self.name, self.id)
    }
}

/// How to name a callee: by name, rank or [`WorkerInfo`].
#[derive(Debug, Clone)]
pub enum WorkerRef {
    /// By name.
    Name(String),
    /// By rank.
    Rank(WorkerId),
}

impl From<&str> for WorkerRef {
    fn from(s: &str) -> Self {
        WorkerRef::Name(s.to_owned())
    }
}
impl From<String> for WorkerRef {
    fn from(s: String) -> Self {
        WorkerRef::Name(s)
    }
}
impl From<WorkerId> for WorkerRef {
    fn from(r: WorkerId) -> Self {
        WorkerRef::Rank(r)
    }
}
impl From<&WorkerInfo> for WorkerRef {
    fn from(w: &WorkerInfo) -> Self {
        WorkerRef::Rank(w.id)
    }
}

/// A worker named that is not in the group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown worker {worker}")]
pub struct UnknownWorker {
    /// The name, or "rank N", asked for.
    pub worker: String,
    /// The workers of the group at that moment, in rank order.
    pub known: Vec<WorkerInfo>,
}

/// The members of the group and what worker `me` derives from their plans.
#[derive(Debug, Clone)]
pub struct Directory {
    me: String,
    declared: Vec<Device>,
    maps: DeviceMaps,
    workers: BTreeMap<WorkerId, WorkerInfo>,
    by_name: HashMap<String, WorkerId>,
    /// Every member's device plan, in rank order.
    infos: BTreeMap<WorkerId, WorkerDeviceInfo>,
    reverse: DeviceMaps,
    devices: Vec<Device>,
}

impl Directory {
    /// The members `records`, seen by worker `me`, which declared the devices `declared` and
    /// the device maps `maps`.
    pub fn new(me: &str, declared: &[Device], maps: &DeviceMaps, records: &[MemberRecord]) -> Self {
        let mut d = Directory {
            me: me.to_owned(),
            declared: declared.to_vec(),
            maps: maps.clone(),
            workers: BTreeMap::new(),
            by_name: HashMap::new(),
            infos: BTreeMap::new(),
            reverse: DeviceMaps::default(),
            devices: Vec::new(),
        };
        for r in records {
            d.add(r.clone());
        }
        d.derive();
        d
    }

    /// Adds a worker that joined, and derives this worker's maps again.
    pub fn insert(&mut self, record: MemberRecord) {
        self.add(record);
        self.derive();
    }

    /// Drops a worker that left or died, and derives this worker's maps again.
    pub fn remove(&mut self, rank: WorkerId) {
        if let Some(w) = self.workers.remove(&rank) {
            self.by_name.remove(&w.name);
        }
        self.infos.remove(&rank);
        self.derive();
    }

    /// The member `to` names.
    pub fn resolve(&self, to: &WorkerRef) -> Result<WorkerId, UnknownWorker> {
        let unknown = |worker: String| UnknownWorker {
            worker,
            known: self.workers.values().cloned().collect(),
        };
        match to {
            WorkerRef::Name(n) => self
                .by_name
                .get(n)
                .copied()
                .ok_or_else(|| unknown(n.clone())),
            WorkerRef::Rank(r) if self.workers.contains_key(r) => Ok(*r),
            WorkerRef::Rank(r) => Err(unknown(format!("rank {r}"))),
        }
    }

    /// Every member, in rank order.
    pub fn workers(&self) -> impl Iterator<Item = &WorkerInfo> + '_ {
        self.workers.values()
    }

    /// Member `id`, if it is one.
    pub fn get(&self, id: WorkerId) -> Option<&WorkerInfo> {
        self.workers.get(&id)
    }

    /// How many members there are.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// This worker's reverse device maps (where its responses' tensors land).
    pub fn reverse(&self) -> &DeviceMaps {
        &self.reverse
    }

    /// The devices this worker handles (sorted, without the CPU).
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    fn add(&mut self, record: MemberRecord) {
        let name = record.devices.name.clone();
        let info = WorkerInfo {
            name: name.clone(),
            id: record.rank,
        };
        self.workers.insert(record.rank, info);
        self.by_name.insert(name, record.rank);
        self.infos.insert(record.rank, record.devices);
    }

    /// Recomputes this worker's reverse maps and device list from the members' plans.
    fn derive(&mut self) {
        let infos: Vec<WorkerDeviceInfo> = self.infos.values().cloned().collect();
        self.reverse = reverse_device_maps(&self.me, &infos);
        self.devices = device_list(&self.declared, &self.maps, &self.reverse);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(rank: WorkerId, name: &str, maps: DeviceMaps) -> MemberRecord {
        MemberRecord {
            rank,
            addr: "127.0.0.1:1".parse().unwrap(),
            devices: WorkerDeviceInfo {
                name: name.into(),
                device_count: 2,
                devices: Vec::new(),
                device_maps: maps,
            },
        }
    }

    #[test]
    fn members_resolve_by_name_and_rank_and_unknown_ones_list_the_group() {
        let mut d = Directory::new(
            "ps",
            &[],
            &DeviceMaps::new(),
            &[record(0, "ps", DeviceMaps::new())],
        );
        assert_eq!(d.resolve(&"ps".into()), Ok(0));
        assert_eq!(d.resolve(&0.into()), Ok(0));
        let err = d.resolve(&"trainer".into()).unwrap_err();
        assert_eq!(err.worker, "trainer");
        assert_eq!(
            err.known,
            vec![WorkerInfo {
                name: "ps".into(),
                id: 0
            }]
        );
        assert_eq!(d.resolve(&3.into()).unwrap_err().worker, "rank 3");

        // A trainer that maps its cuda:0 to the ps's cuda:1 joins: the ps now answers it on
        // cuda:0 and handles cuda:1; it leaves, and both are gone.
        let mut maps = DeviceMaps::new();
        maps.insert(
            "ps",
            [(Device::Cuda(0), Device::Cuda(1))].into_iter().collect(),
        );
        d.insert(record(1, "trainer", maps));
        assert_eq!(d.resolve(&"trainer".into()), Ok(1));
        assert_eq!(d.len(), 2);
        assert_eq!(
            d.reverse()
                .get("trainer")
                .and_then(|m| m.get(Device::Cuda(1))),
            Some(Device::Cuda(0))
        );
        assert_eq!(d.devices(), &[Device::Cuda(1)]);
        d.remove(1);
        assert!(d.resolve(&"trainer".into()).is_err());
        assert!(d.reverse().get("trainer").is_none());
        assert!(d.devices().is_empty());
    }
}
