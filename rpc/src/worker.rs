//! How workers are named: [`WorkerInfo`] (a name and a rank) and [`WorkerRef`] (how a caller
//! names a callee). Plain data, below the agent and its errors.

use std::fmt;

use serde::{Deserialize, Serialize};
use tensorwire_core::protocol::WorkerId;

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
