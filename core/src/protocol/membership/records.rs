//! A static group's admission of its members: the worker records gathered at init (one per
//! rank, in rank order) are checked before anything is derived from them, the same way on
//! every worker, so every worker refuses a bad group with the same error.

use std::collections::HashMap;

use super::dynamic::MemberRecord;
use crate::ports::transport::IdentityError;
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

/// A static group's member whose credentials do not certify the name its record gives
/// ([`check_certified`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank} says it is {name:?}, but {source}")]
pub struct NotCertified {
    /// The member's rank.
    pub rank: WorkerId,
    /// The name its record gives.
    pub name: String,
    /// What its credentials say.
    #[source]
    pub source: IdentityError,
}

/// Checks that the credentials of the connection to the member at rank `rank` (the ranks
/// they certify, and `certify`: whether they are issued for a name,
/// `Connection::check_peer_name`) certify its record, which may have come through other
/// ranks: a rank certificate (`rank-N`, which the mesh already checked against the rank the
/// peer claimed) certifies the connection's own record, whatever name the user chose in it;
/// anything else must be issued for the name (QUIC node certificates; a cluster secret lets
/// any member take any name, and `certify` says yes).
pub fn check_certified(
    rank: usize,
    record: &MemberRecord,
    certified_ranks: &[u32],
    certify: impl FnOnce(&str) -> Result<(), IdentityError>,
) -> Result<(), NotCertified> {
    let rank_certified = u32::try_from(rank).is_ok_and(|r| certified_ranks.contains(&r));
    if rank_certified && record.rank as usize == rank {
        return Ok(());
    }
    let name = record.name();
    certify(name).map_err(|source| NotCertified {
        rank: rank as WorkerId,
        name: name.to_owned(),
        source,
    })
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

    #[test]
    fn a_rank_certificate_certifies_its_own_rank_under_any_name_and_nothing_else() {
        let refuse = |name: &str| {
            Err(IdentityError {
                peer: "127.0.0.1:1".parse().unwrap(),
                name: name.to_owned(),
                reason: "issued for rank-1".into(),
            })
        };
        let certified = [1_u32];
        assert!(check_certified(1, &record(1, "anyone"), &certified, refuse).is_ok());
        // The same certificate at another rank, or with the record of another rank, must
        // be issued for the name.
        let e = check_certified(2, &record(2, "w2"), &certified, refuse).unwrap_err();
        assert_eq!((e.rank, e.name.as_str()), (2, "w2"));
        assert!(
            e.to_string().starts_with("rank 2 says it is \"w2\", but "),
            "{e}"
        );
        assert!(check_certified(1, &record(3, "w3"), &certified, refuse).is_err());
        // Credentials issued for the name (or a cluster secret's) pass.
        assert!(check_certified(2, &record(2, "w2"), &[], |_| Ok(())).is_ok());
        let asked = std::cell::RefCell::new(String::new());
        let _ = check_certified(4, &record(4, "w4"), &[], |n| {
            *asked.borrow_mut() = n.to_owned();
            Ok(())
        });
        assert_eq!(
            *asked.borrow(),
            "w4",
            "the record's name is the one checked"
        );
    }
}
