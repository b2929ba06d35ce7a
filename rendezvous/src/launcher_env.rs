//! The environments launchers give their workers, read the same way by `env://` rendezvous
//! (process groups' `new_group`, `init_rpc`) and by [`DistEnv::from_env`].
//!
//! | variable | explicit (torchrun, PyTorchJob, `tensorwire launch`) | else, under Slurm (`srun`) |
//! | --- | --- | --- |
//! | rank | `RANK` | `SLURM_PROCID` |
//! | world size | `WORLD_SIZE` | `SLURM_NTASKS` |
//! | local rank | `LOCAL_RANK` | `SLURM_LOCALID` |
//! | local world size | `LOCAL_WORLD_SIZE` | `SLURM_NTASKS_PER_NODE` (its first number) |
//! | master | `MASTER_ADDR` | the first host of `SLURM_JOB_NODELIST` (else `SLURM_NODELIST`) |
//! | master port | `MASTER_PORT` | `15000 + SLURM_JOB_ID % 10000` (PyTorch Lightning's choice) |
//!
//! Explicit variables always win over Slurm's, one by one; an empty variable counts as unset.
//! Slurm's node list is in its compressed syntax (`node[01-03,07]`, see [`crate::hostlist`]).

use crate::hostlist::{HostList, HostListError};

/// The variable that names the rank.
pub const RANK: &str = "RANK";
/// The variable that names the world size.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// The variable that names the local rank (the rank on this node).
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// The variable that names the number of workers on this node.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// The variable that names the host of the job's store.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// The variable that names the port of the job's store.
pub const MASTER_PORT: &str = "MASTER_PORT";

/// Why a launcher's variable cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LauncherEnvError {
    /// Slurm's node list, needed for the master's address, is malformed.
    #[error("cannot take MASTER_ADDR from {variable}: {source}")]
    NodeList {
        /// `SLURM_JOB_NODELIST` or `SLURM_NODELIST`.
        variable: &'static str,
        /// What is wrong with it.
        #[source]
        source: HostListError,
    },
    /// A variable that must hold a number does not.
    #[error("{variable}={value:?} is not a non-negative integer")]
    NotANumber {
        /// The variable read.
        variable: &'static str,
        /// Its value.
        value: String,
    },
    /// A variable is missing, and Slurm's environment does not supply it either.
    #[error("environment variable {variable} expected, but not set (nor is {slurm}, its Slurm counterpart)")]
    Missing {
        /// The variable.
        variable: &'static str,
        /// The Slurm variable that could have supplied it.
        slurm: &'static str,
    },
    /// The rank is not below the world size.
    #[error("rank {rank} is not below the world size {world_size}")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
}

/// The Slurm variable that supplies `name` when it is unset.
fn slurm_counterpart(name: &str) -> Option<&'static str> {
    Some(match name {
        RANK => "SLURM_PROCID",
        WORLD_SIZE => "SLURM_NTASKS",
        LOCAL_RANK => "SLURM_LOCALID",
        LOCAL_WORLD_SIZE => "SLURM_NTASKS_PER_NODE",
        MASTER_ADDR => "SLURM_JOB_NODELIST",
        MASTER_PORT => "SLURM_JOB_ID",
        _ => return None,
    })
}

/// The value of launcher variable `name` (one of the constants of this module): the explicit
/// variable when set and not empty, else what Slurm's variables say, else `None`. Other names
/// are looked up as they are.
///
/// # Errors
/// [`LauncherEnvError`] when a Slurm variable needed is malformed.
pub fn launcher_var(
    name: &str,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<Option<String>, LauncherEnvError> {
    let get = |n: &str| env(n).filter(|v| !v.trim().is_empty());
    if let Some(v) = get(name) {
        return Ok(Some(v));
    }
    Ok(match name {
        RANK | WORLD_SIZE | LOCAL_RANK => slurm_counterpart(name).and_then(get),
        LOCAL_WORLD_SIZE => get("SLURM_NTASKS_PER_NODE").map(|v| {
            // `2(x3)` or `2,1`: the first node's count.
            v.chars().take_while(char::is_ascii_digit).collect()
        }),
        MASTER_ADDR => {
            let (variable, list) = match get("SLURM_JOB_NODELIST") {
                Some(l) => ("SLURM_JOB_NODELIST", l),
                None => match get("SLURM_NODELIST") {
                    Some(l) => ("SLURM_NODELIST", l),
                    None => return Ok(None),
                },
            };
            let hosts = HostList::parse(&list)
                .map_err(|source| LauncherEnvError::NodeList { variable, source })?;
            Some(hosts.first())
        }
        MASTER_PORT => match get("SLURM_JOB_ID") {
            Some(id) => {
                let id: u64 = id
                    .trim()
                    .parse()
                    .map_err(|_| LauncherEnvError::NotANumber {
                        variable: "SLURM_JOB_ID",
                        value: id.clone(),
                    })?;
                Some((15_000 + id % 10_000).to_string())
            }
            None => None,
        },
        _ => None,
    })
}

/// [`launcher_var`] over the process environment.
///
/// # Errors
/// As [`launcher_var`].
pub fn launcher_var_from_process(name: &str) -> Result<Option<String>, LauncherEnvError> {
    launcher_var(name, &|n| std::env::var(n).ok())
}

/// Where a worker stands in its job, as its launcher said (see the [module](self) table).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DistEnv {
    /// This worker's global rank.
    pub rank: usize,
    /// Workers in the job.
    pub world_size: usize,
    /// This worker's rank on its node (0 when no launcher says).
    pub local_rank: usize,
    /// Workers on this node (1 when no launcher says).
    pub local_world_size: usize,
    /// The host of the job's store, when known.
    pub master_addr: Option<String>,
    /// The port of the job's store, when known.
    pub master_port: Option<u16>,
}

impl DistEnv {
    /// Reads the process environment: what a worker calls before `init_rpc`.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let env = tensorwire_rendezvous::DistEnv::from_env()?;
    /// println!("worker {} of {} (local {})", env.rank, env.world_size, env.local_rank);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`LauncherEnvError`]: a missing rank or world size, a malformed value.
    pub fn from_env() -> Result<DistEnv, LauncherEnvError> {
        Self::from_lookup(|n| std::env::var(n).ok())
    }

    /// Like [`from_env`](Self::from_env), with the environment given as a lookup function.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_lookup(env: impl Fn(&str) -> Option<String>) -> Result<DistEnv, LauncherEnvError> {
        let number = |name: &'static str| -> Result<Option<usize>, LauncherEnvError> {
            launcher_var(name, &env)?
                .map(|v| {
                    v.trim().parse().map_err(|_| LauncherEnvError::NotANumber {
                        variable: name,
                        value: v,
                    })
                })
                .transpose()
        };
        let required = |name: &'static str| -> Result<usize, LauncherEnvError> {
            number(name)?.ok_or(LauncherEnvError::Missing {
                variable: name,
                slurm: slurm_counterpart(name).unwrap_or("-"),
            })
        };
        let rank = required(RANK)?;
        let world_size = required(WORLD_SIZE)?;
        if rank >= world_size {
            return Err(LauncherEnvError::RankOutOfRange { rank, world_size });
        }
        let master_port = match launcher_var(MASTER_PORT, &env)? {
            Some(p) => Some(p.trim().parse().map_err(|_| LauncherEnvError::NotANumber {
                variable: MASTER_PORT,
                value: p,
            })?),
            None => None,
        };
        Ok(DistEnv {
            rank,
            world_size,
            local_rank: number(LOCAL_RANK)?.unwrap_or(0),
            local_world_size: number(LOCAL_WORLD_SIZE)?.unwrap_or(1),
            master_addr: launcher_var(MASTER_ADDR, &env)?,
            master_port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    const SLURM: [(&str, &str); 6] = [
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "2(x4)"),
        ("SLURM_JOB_NODELIST", "gpu[07-10],login1"),
        ("SLURM_JOB_ID", "4242421"),
    ];

    #[test]
    fn slurm_alone_gives_everything() {
        let env = DistEnv::from_lookup(env_of(&SLURM)).unwrap();
        assert_eq!(
            env,
            DistEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 2,
                master_addr: Some("gpu07".into()),
                master_port: Some(17421),
            }
        );
    }

    #[test]
    fn explicit_variables_win_one_by_one() {
        let mut vars = SLURM.to_vec();
        vars.extend([
            ("MASTER_ADDR", "10.1.2.3"),
            ("RANK", "0"),
            ("MASTER_PORT", ""),
        ]);
        let env = DistEnv::from_lookup(env_of(&vars)).unwrap();
        assert_eq!(env.rank, 0);
        assert_eq!(env.world_size, 8);
        assert_eq!(env.master_addr.as_deref(), Some("10.1.2.3"));
        // Empty counts as unset: Slurm's port.
        assert_eq!(env.master_port, Some(17421));
        // SLURM_NODELIST when the job's list is absent.
        let env = DistEnv::from_lookup(env_of(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("SLURM_NODELIST", "a[3-4]"),
        ]))
        .unwrap();
        assert_eq!(env.master_addr.as_deref(), Some("a3"));
        assert_eq!((env.local_rank, env.local_world_size), (0, 1));
    }

    #[test]
    fn torchrun_variables_alone() {
        let env = DistEnv::from_lookup(env_of(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "master-0"),
            ("MASTER_PORT", "23456"),
        ]))
        .unwrap();
        assert_eq!(
            (
                env.rank,
                env.local_rank,
                env.master_addr.as_deref(),
                env.master_port
            ),
            (3, 1, Some("master-0"), Some(23456))
        );
    }

    #[test]
    fn errors_name_the_variable() {
        let err =
            |vars: &[(&str, &str)]| DistEnv::from_lookup(env_of(vars)).unwrap_err().to_string();
        assert_eq!(
            err(&[("WORLD_SIZE", "2")]),
            "environment variable RANK expected, but not set (nor is SLURM_PROCID, its Slurm counterpart)"
        );
        assert_eq!(
            err(&[("RANK", "x"), ("WORLD_SIZE", "2")]),
            "RANK=\"x\" is not a non-negative integer"
        );
        assert_eq!(
            err(&[("RANK", "2"), ("WORLD_SIZE", "2")]),
            "rank 2 is not below the world size 2"
        );
        assert_eq!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("SLURM_JOB_NODELIST", "n[1-")]),
            "cannot take MASTER_ADDR from SLURM_JOB_NODELIST: host list \"n[1-\" has unbalanced brackets"
        );
        assert_eq!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("SLURM_JOB_ID", "abc")]),
            "SLURM_JOB_ID=\"abc\" is not a non-negative integer"
        );
    }
}
