//! Cluster plans: every worker's device plan, checked at once before launch.
//!
//! A plan lists the workers of a group in rank order, with their device counts, declared
//! devices and device maps — exactly what the workers would exchange at init. [`ClusterPlan::check`]
//! runs what init would run: the device-map rules, then each worker's reverse maps and device
//! list. A plan that passes here passes init's validation, and one that fails here fails init
//! with the same error on every worker.
//!
//! ```
//! use tensorwire_core::plan::{ClusterPlan, PlanWorker};
//! use tensorwire_core::device::{Device, DeviceMaps};
//!
//! let mut maps = DeviceMaps::new();
//! maps.insert("ps", [(Device::Cuda(0), Device::Cuda(1))].into_iter().collect());
//! let plan = ClusterPlan {
//!     static_group: true,
//!     workers: vec![
//!         PlanWorker { name: "trainer0".into(), device_count: 1, devices: vec![], device_maps: maps },
//!         PlanWorker { name: "ps".into(), device_count: 2, devices: vec![], device_maps: DeviceMaps::new() },
//!     ],
//! };
//! let report = plan.check().unwrap().unwrap();
//! assert_eq!(report.workers["ps"].devices, [Device::Cuda(1)]);
//! ```

use std::collections::HashMap;

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};

use crate::device::{Device, DeviceMaps};
use crate::name::{check_worker_name, NameError};
use crate::reverse::{device_list, reverse_device_maps};
use crate::validate::{validate_device_maps, DeviceMapError, GroupKind, WorkerDeviceInfo};

/// One worker of a [`ClusterPlan`].
pub type PlanWorker = WorkerDeviceInfo;

fn yes() -> bool {
    true
}

/// A whole group's device plans, in rank order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterPlan {
    /// Whether membership is fixed (PyTorch's static group; the default) or dynamic.
    #[serde(default = "yes")]
    pub static_group: bool,
    /// The workers, in rank order.
    pub workers: Vec<PlanWorker>,
}

/// A plan that cannot be checked at all: its workers are not a usable group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanInputError {
    /// The plan lists no workers.
    #[error("workers: the plan lists no workers")]
    NoWorkers,
    /// A worker's name breaks the naming rule.
    #[error("workers[{index}].name: {source}")]
    BadName {
        /// The worker's position in `workers`.
        index: usize,
        /// What is wrong with the name.
        source: NameError,
    },
    /// Two workers have the same name.
    #[error("workers[{second}].name: worker name {name:?} is already used by workers[{first}]")]
    DuplicateName {
        /// The name.
        name: String,
        /// The first worker with it.
        first: usize,
        /// The second worker with it.
        second: usize,
    },
}

/// What init would compute for one worker of a valid plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkerReport {
    /// The devices the worker's agent handles (sorted, without the CPU).
    pub devices: Vec<Device>,
    /// The worker's reverse device maps: for each worker that maps to it, where responses go.
    pub reverse_device_maps: DeviceMaps,
}

/// The result of checking a valid plan: one report per worker, in rank order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanReport {
    /// Reports keyed by worker name.
    pub workers: IndexMap<String, WorkerReport>,
}

impl ClusterPlan {
    /// Whether the group is static or dynamic.
    pub fn group_kind(&self) -> GroupKind {
        if self.static_group {
            GroupKind::Static
        } else {
            GroupKind::Dynamic
        }
    }

    /// Checks that the workers form a usable group: at least one, valid and distinct names.
    pub fn check_input(&self) -> Result<(), PlanInputError> {
        if self.workers.is_empty() {
            return Err(PlanInputError::NoWorkers);
        }
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (index, w) in self.workers.iter().enumerate() {
            check_worker_name(&w.name)
                .map_err(|source| PlanInputError::BadName { index, source })?;
            if let Some(&first) = seen.get(w.name.as_str()) {
                return Err(PlanInputError::DuplicateName {
                    name: w.name.clone(),
                    first,
                    second: index,
                });
            }
            seen.insert(&w.name, index);
        }
        Ok(())
    }

    /// Checks the plan as init would: first that it is usable ([`check_input`](Self::check_input)),
    /// then the device-map rules; for a valid plan, returns every worker's devices and reverse maps.
    #[allow(clippy::result_large_err)] // see validate_device_maps
    pub fn check(&self) -> Result<Result<PlanReport, DeviceMapError>, PlanInputError> {
        self.check_input()?;
        Ok(self.evaluate())
    }

    #[allow(clippy::result_large_err)] // see validate_device_maps
    fn evaluate(&self) -> Result<PlanReport, DeviceMapError> {
        validate_device_maps(&self.workers, self.group_kind())?;
        let workers = self
            .workers
            .iter()
            .map(|w| {
                let reverse = reverse_device_maps(&w.name, &self.workers);
                let devices = device_list(&w.devices, &w.device_maps, &reverse);
                (
                    w.name.clone(),
                    WorkerReport {
                        devices,
                        reverse_device_maps: reverse,
                    },
                )
            })
            .collect();
        Ok(PlanReport { workers })
    }
}
