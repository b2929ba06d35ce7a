//! A static group's admission of its members: the worker records gathered at init (one per
//! rank, in rank order) are checked before anything is derived from them, the same way on
//! every worker, so every worker refuses a bad group with the same error.

use std::collections::HashMap;

use super::dynamic::MemberRecord;
use crate::protocol::WorkerId;
use crate::validate::{validate_device_maps, DeviceMapError, GroupKind, WorkerDeviceInfo};

/// Why a static group's records are refused. Each variant names the ranks involved; callers
/// map each to an error of their own (so the enum is exhaustive).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Rank `rank`'s place holds the record of rank `claimed`.
    #[error("rank {rank} sent the record of rank {claimed}")]
    OfAnotherRank {
        /// The rank that sent it.
        rank: WorkerId,
        /// The rank the record claims.
        claimed: WorkerId,
    },
    /// Two workers have the same name.
    #[error("worker name {name:?} is used by ranks {first} and {second}")]
    DuplicateName {
        /// The name.
        name: String,
        /// The lower rank using it.
        first: WorkerId,
        /// The other rank using it.
        second: WorkerId,
    },
    /// The device maps break a rule of a static group.
    #[error(transparent)]
    DeviceMaps(Box<DeviceMapError>),
}

/// Checks a static group's records, `records[r]` being rank `r`'s: every record is its own
/// rank's, names are unique, and the device maps keep the rules of a static group
/// ([`validate_device_maps`] with [`GroupKind::Static`]). The first failure, in that order.
pub fn check_static_records(records: &[MemberRecord]) -> Result<(), RecordError> {
    let mut by_name = HashMap::new();
    for (r, rec) in records.iter().enumerate() {
        if rec.rank as usize != r {
            return Err(RecordError::OfAnotherRank {
                rank: r as WorkerId,
                claimed: rec.rank,
            });
        }
        if let Some(other) = by_name.insert(rec.devices.name.clone(), rec.rank) {
            return Err(RecordError::DuplicateName {
                name: rec.devices.name.clone(),
                first: other,
                second: rec.rank,
            });
        }
    }
    let infos: Vec<WorkerDeviceInfo> = records.iter().map(|r| r.devices.clone()).collect();
    validate_device_maps(&infos, GroupKind::Static)
        .map_err(|e| RecordError::DeviceMaps(Box::new(e)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::validate::DeviceMapErrorKind;

    fn record(rank: WorkerId, name: &str) -> MemberRecord {
        MemberRecord {
            rank,
            addr: "127.0.0.1:0".parse().unwrap(),
            devices: WorkerDeviceInfo {
                name: name.to_owned(),
                device_count: 0,
                devices: Vec::new(),
                device_maps: Default::default(),
            },
        }
    }

    #[test]
    fn a_good_group_is_admitted() {
        assert_eq!(check_static_records(&[]), Ok(()));
        assert_eq!(
            check_static_records(&[record(0, "a"), record(1, "b"), record(2, "c")]),
            Ok(())
        );
    }

    #[test]
    fn a_duplicate_name_names_both_ranks() {
        let e = check_static_records(&[record(0, "a"), record(1, "b"), record(2, "a")]);
        assert_eq!(
            e,
            Err(RecordError::DuplicateName {
                name: "a".into(),
                first: 0,
                second: 2
            })
        );
        assert_eq!(
            e.unwrap_err().to_string(),
            "worker name \"a\" is used by ranks 0 and 2"
        );
    }

    #[test]
    fn a_record_in_another_ranks_place_is_refused_before_names_are_compared() {
        // Rank 1's place holds rank 2's record, which also repeats rank 0's name: the
        // misplaced record is what is reported.
        let e = check_static_records(&[record(0, "a"), record(2, "a")]);
        assert_eq!(
            e,
            Err(RecordError::OfAnotherRank {
                rank: 1,
                claimed: 2
            })
        );
    }

    #[test]
    fn device_maps_are_checked_by_the_static_rules() {
        // a maps both its devices to b's cuda:1: duplicated target devices.
        let mut a = record(0, "a");
        a.devices.device_count = 2;
        a.devices.device_maps.insert(
            "b",
            [
                (Device::Cuda(0), Device::Cuda(1)),
                (Device::Cuda(1), Device::Cuda(1)),
            ]
            .into_iter()
            .collect(),
        );
        let mut b = record(1, "b");
        b.devices.device_count = 2;
        let e = check_static_records(&[a, b]).unwrap_err();
        match e {
            RecordError::DeviceMaps(e) => {
                assert_eq!(e.kind(), DeviceMapErrorKind::DuplicatedTargetDevices)
            }
            e => panic!("{e:?}"),
        }
    }
}
