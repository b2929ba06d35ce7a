//! What starting an agent decides before and between its I/O: whether `init_rpc`'s rank fits
//! its world size, the rendezvous URL it asks (the rank and world size a static group's URL
//! lacks; a dynamic group's own), whether the rendezvous gave what was asked, and whether the
//! group's kind in the store (static or dynamic, set by its first worker) admits this worker.
//! The agent reads and writes the store and the rendezvous; every answer is decided here.
//!
//! ```
//! use tensorwire_core::protocol::start::{rendezvous_url, GroupKind};
//!
//! assert_eq!(rendezvous_url("env://", 1, Some(4)), "env://?rank=1&world_size=4");
//! assert_eq!(rendezvous_url("tcp://h:1?rank=9", 2, None), "tcp://h:1?rank=2&world_size=-1");
//! assert!(GroupKind::Static.admits(b"static").is_ok());
//! assert!(GroupKind::Dynamic.admits(b"static").is_err());
//! ```

/// Why an agent cannot start with what it was given or what the rendezvous and the store say.
/// Exhaustive: the agent gives each its own variant of its error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// `init_rpc` was given a rank that is not below its world size.
    #[error("init_rpc: rank {rank} is not below world_size {world_size}")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
    },
    /// The rendezvous assigned another rank or world size than `init_rpc` was called with.
    #[error("init_rpc: rendezvous gave rank {got_rank} of {got_world_size}, but init_rpc was called with rank {rank} of {world_size:?}")]
    RendezvousMismatch {
        /// The rank given to `init_rpc`.
        rank: usize,
        /// The world size given to `init_rpc` (`None`: a dynamic group).
        world_size: Option<usize>,
        /// The rank the rendezvous gave.
        got_rank: usize,
        /// The world size the rendezvous gave.
        got_world_size: usize,
    },
    /// A static worker tried to join a dynamic group, or the other way round.
    #[error("init_rpc: this group is {group}; a {worker} worker cannot join it (mixing static and dynamic members is refused)")]
    GroupKindMismatch {
        /// The group's kind, as the store holds it (`static` or `dynamic`, or whatever a
        /// foreign writer put there).
        group: String,
        /// This worker's kind.
        worker: &'static str,
    },
}

/// Checks `init_rpc`'s rank against its world size (`None`: a dynamic group, any rank).
pub fn check_rank(rank: usize, world_size: Option<usize>) -> Result<(), StartError> {
    match world_size {
        Some(world_size) if rank >= world_size => {
            Err(StartError::RankOutOfRange { rank, world_size })
        }
        _ => Ok(()),
    }
}

/// Checks that the rendezvous gave the rank (and, in a static group, the world size)
/// `init_rpc` was called with.
pub fn check_rendezvous(
    (rank, world_size): (usize, Option<usize>),
    (got_rank, got_world_size): (usize, usize),
) -> Result<(), StartError> {
    if got_rank != rank || world_size.is_some_and(|n| got_world_size != n) {
        return Err(StartError::RendezvousMismatch {
            rank,
            world_size,
            got_rank,
            got_world_size,
        });
    }
    Ok(())
}

/// The rendezvous URL for `url` (`env://`, `tcp://host:port`, `file:///path`, with a query
/// or not). For a static group of `world_size`, the rank and world size it lacks are added
/// to its query, for every scheme, as PyTorch's `rendezvous(url, rank, world_size)` does:
/// `tcp://host:port` and `file:///path` work without repeating what `init_rpc` was given
/// (what the URL gives wins, and [`check_rendezvous`] checks it). For a dynamic group
/// (`None`): this worker's rank and `world_size=-1` (no fixed size, as PyTorch writes it),
/// whatever the URL said: nobody waits for a count, and no store handle counts the others
/// out (a `file://` store stays while members come and go).
pub fn rendezvous_url(url: &str, rank: usize, world_size: Option<usize>) -> String {
    let Some(world_size) = world_size else {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut pairs: Vec<String> = query
            .split('&')
            .filter(|p| !p.is_empty() && !p.starts_with("rank=") && !p.starts_with("world_size="))
            .map(str::to_owned)
            .collect();
        pairs.push(format!("rank={rank}"));
        pairs.push("world_size=-1".to_owned());
        return format!("{base}?{}", pairs.join("&"));
    };
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let has = |key: &str| query.split('&').any(|kv| kv.split('=').next() == Some(key));
    let mut out = url.to_owned();
    for (key, value) in [("rank", rank), ("world_size", world_size)] {
        if !has(key) {
            out.push(if out.contains('?') { '&' } else { '?' });
            out.push_str(&format!("{key}={value}"));
        }
    }
    out
}

pub use crate::validate::GroupKind;

/// The store key under which a group's kind is kept (set by its first worker).
pub const GROUP_KIND_KEY: &str = "rpc/group_kind";

/// A group's kind at its start: every member of a group is of the same kind, which its first
/// worker records in the store.
impl GroupKind {
    /// The kind of a worker started with `world_size` (`None`: dynamic).
    pub fn of(world_size: Option<usize>) -> Self {
        if world_size.is_some() {
            GroupKind::Static
        } else {
            GroupKind::Dynamic
        }
    }

    /// Its name, as the store holds it.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Static => "static",
            GroupKind::Dynamic => "dynamic",
        }
    }

    /// Whether a worker of this kind may join a group whose kind the store holds as `held`
    /// (what a compare-and-set of [`GROUP_KIND_KEY`] from empty to [`name`](Self::name)
    /// returned: this kind when the worker is the first).
    pub fn admits(self, held: &[u8]) -> Result<(), StartError> {
        if held == self.name().as_bytes() {
            return Ok(());
        }
        Err(StartError::GroupKindMismatch {
            group: String::from_utf8_lossy(held).into_owned(),
            worker: self.name(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_must_be_below_a_static_groups_world_size() {
        assert!(check_rank(3, Some(4)).is_ok());
        assert_eq!(
            check_rank(4, Some(4)),
            Err(StartError::RankOutOfRange {
                rank: 4,
                world_size: 4
            })
        );
        assert!(
            check_rank(1_000, None).is_ok(),
            "a dynamic group has no size"
        );
        assert_eq!(
            check_rank(4, Some(4)).unwrap_err().to_string(),
            "init_rpc: rank 4 is not below world_size 4"
        );
    }

    #[test]
    fn the_rendezvous_must_give_what_was_asked() {
        assert!(check_rendezvous((1, Some(4)), (1, 4)).is_ok());
        assert!(
            check_rendezvous((1, None), (1, 9)).is_ok(),
            "a dynamic group takes any size"
        );
        let e = check_rendezvous((1, Some(4)), (1, 5)).unwrap_err();
        assert!(
            matches!(
                e,
                StartError::RendezvousMismatch {
                    rank: 1,
                    world_size: Some(4),
                    got_rank: 1,
                    got_world_size: 5
                }
            ),
            "{e:?}"
        );
        assert!(check_rendezvous((2, None), (0, 1)).is_err());
    }

    #[test]
    fn a_static_url_gets_the_missing_rank_and_world_size() {
        assert_eq!(
            rendezvous_url("env://", 1, Some(4)),
            "env://?rank=1&world_size=4"
        );
        assert_eq!(
            rendezvous_url("tcp://10.0.0.1:29500", 0, Some(2)),
            "tcp://10.0.0.1:29500?rank=0&world_size=2"
        );
        assert_eq!(
            rendezvous_url("file:///tmp/x?world_size=2", 1, Some(2)),
            "file:///tmp/x?world_size=2&rank=1"
        );
        assert_eq!(
            rendezvous_url("tcp://h:1?rank=3&world_size=5", 3, Some(5)),
            "tcp://h:1?rank=3&world_size=5"
        );
    }

    #[test]
    fn a_dynamic_url_says_its_rank_and_no_size_whatever_it_said() {
        assert_eq!(
            rendezvous_url("tcp://h:1", 2, None),
            "tcp://h:1?rank=2&world_size=-1"
        );
        assert_eq!(
            rendezvous_url("tcp://h:1?world_size=8&timeout=5&rank=0&", 2, None),
            "tcp://h:1?timeout=5&rank=2&world_size=-1"
        );
    }

    #[test]
    fn a_group_admits_only_workers_of_its_kind() {
        assert_eq!(GroupKind::of(Some(2)), GroupKind::Static);
        assert_eq!(GroupKind::of(None), GroupKind::Dynamic);
        assert!(GroupKind::Static.admits(b"static").is_ok());
        assert!(GroupKind::Dynamic.admits(b"dynamic").is_ok());
        let e = GroupKind::Static.admits(b"dynamic").unwrap_err();
        assert_eq!(
            e.to_string(),
            "init_rpc: this group is dynamic; a static worker cannot join it (mixing static and \
             dynamic members is refused)"
        );
        let forged = GroupKind::Dynamic.admits(&[0xff, b'x']).unwrap_err();
        assert!(
            matches!(&forged, StartError::GroupKindMismatch { group, worker: "dynamic" } if group == "\u{fffd}x"),
            "{forged:?}"
        );
    }
}
