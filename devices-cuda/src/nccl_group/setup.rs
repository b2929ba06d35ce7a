//! The setup exchange of a backend that needs one value made by rank 0 (NCCL's unique id)
//! and must know, before it starts, that every rank can take part.
//!
//! Each rank says through the store whether it can join (`ok`, or why not); rank 0 also
//! publishes the value. Every rank then waits for every other rank's answer, so a rank that
//! cannot join (no GPU, no NCCL) makes every rank's setup fail at once with its reason, and a
//! rank that never comes is named by the timeout, instead of the backend's own
//! initialisation hanging on it.

use std::time::Duration;

use tensorwire_core::ports::process_group::ProcessGroupError;
use tensorwire_core::ports::store::Store;

/// What this rank brings to the exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// This rank can join; rank 0 passes the value to publish (other ranks pass `None`).
    Ready(Option<Vec<u8>>),
    /// This rank cannot join, and why.
    Unable(String),
}

/// Runs the exchange under `prefix` (unique per group) and returns rank 0's value.
///
/// # Errors
/// - [`ProcessGroupError::Setup`] naming every rank that cannot join and its reason (this
///   rank's own reason included);
/// - [`ProcessGroupError::Timeout`] (collective `"new_group"`) naming the ranks that did not
///   answer within `timeout`;
/// - [`ProcessGroupError::Setup`] when the store fails.
pub async fn exchange(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    readiness: Readiness,
) -> Result<Vec<u8>, ProcessGroupError> {
    let setup = |reason: String| ProcessGroupError::Setup { rank, reason };
    let store_err = |doing: &'static str, source| ProcessGroupError::SetupStore {
        rank,
        doing,
        source,
    };
    let id_key = format!("{prefix}/id");
    let status_key = |r: usize| format!("{prefix}/status/{r}");
    let status = match &readiness {
        Readiness::Ready(value) => {
            if rank == 0 {
                let Some(value) = value else {
                    return Err(setup("rank 0 must publish the group's id".into()));
                };
                if store.check(&[id_key.as_str()]).await.unwrap_or(false) {
                    return Err(setup(format!(
                        "{id_key} is already in the store: a group of this name was set up \
                         through it before (group names must be unique)"
                    )));
                }
                store
                    .set(&id_key, value)
                    .await
                    .map_err(|e| store_err("publishing the id", e))?;
            }
            b"ok".to_vec()
        }
        Readiness::Unable(why) => format!("error:{why}").into_bytes(),
    };
    store
        .set(&status_key(rank), &status)
        .await
        .map_err(|e| store_err("publishing this rank's status", e))?;

    let keys: Vec<String> = (0..world_size).map(status_key).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    if let Err(e) = store.wait(&key_refs, timeout).await {
        let mut missing = Vec::new();
        for (r, key) in key_refs.iter().enumerate() {
            match store.check(&[key]).await {
                Ok(true) => {}
                Ok(false) => missing.push(r),
                Err(_) => return Err(store_err("waiting for the other ranks", e)),
            }
        }
        if missing.is_empty() {
            return Err(store_err("waiting for the other ranks", e));
        }
        return Err(ProcessGroupError::Timeout {
            collective: "new_group",
            seq: 0,
            rank,
            waiting_on: missing,
            timeout,
        });
    }
    let result = read_outcome(store, &keys, &id_key, rank, readiness).await;
    // Rank 0 usually hosts the store: it must not leave (its process may exit on an error)
    // before every rank has read what it needs. The last reader says so.
    let read_key = format!("{prefix}/read");
    let all_read_key = format!("{prefix}/all-read");
    if let Ok(n) = store.add(&read_key, 1).await {
        if n == world_size as i64 {
            let _ = store.set(&all_read_key, b"1").await;
        }
    }
    if rank == 0 {
        let _ = store.wait(&[all_read_key.as_str()], timeout).await;
    }
    result
}

/// Reads every rank's status and, when all can join, rank 0's value.
async fn read_outcome(
    store: &dyn Store,
    keys: &[String],
    id_key: &str,
    rank: usize,
    readiness: Readiness,
) -> Result<Vec<u8>, ProcessGroupError> {
    let setup = |reason: String| ProcessGroupError::Setup { rank, reason };
    let store_err = |doing: &'static str, source| ProcessGroupError::SetupStore {
        rank,
        doing,
        source,
    };
    let mut unable = Vec::new();
    for (r, key) in keys.iter().enumerate() {
        let value = store
            .get(key)
            .await
            .map_err(|e| store_err("reading the ranks' status", e))?;
        if let Some(why) = value.strip_prefix(b"error:") {
            unable.push(format!(
                "rank {r} cannot join: {}",
                String::from_utf8_lossy(why)
            ));
        } else if value != b"ok" {
            return Err(setup(format!(
                "rank {r} published an unreadable status {:?}",
                String::from_utf8_lossy(&value)
            )));
        }
    }
    if !unable.is_empty() {
        return Err(setup(unable.join("; ")));
    }
    match readiness {
        Readiness::Ready(Some(value)) if rank == 0 => Ok(value),
        _ => store
            .get(id_key)
            .await
            .map_err(|e| store_err("reading rank 0's id", e)),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use tensorwire_store::InMemoryStore;

    async fn run_all(
        world: usize,
        timeout: Duration,
        readiness: impl Fn(usize) -> Option<Readiness>,
    ) -> Vec<Option<Result<Vec<u8>, ProcessGroupError>>> {
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let tasks: Vec<_> = (0..world)
            .map(|rank| {
                readiness(rank).map(|r| {
                    let store = store.clone();
                    tokio::spawn(async move {
                        exchange(&*store, "nccl7", rank, world, timeout, r).await
                    })
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(match t {
                Some(t) => Some(t.await.unwrap()),
                None => None,
            });
        }
        out
    }

    #[tokio::test]
    async fn every_rank_gets_rank_0s_value() {
        let id = vec![7u8; 128];
        let got = run_all(4, Duration::from_secs(10), |r| {
            Some(Readiness::Ready((r == 0).then(|| id.clone())))
        })
        .await;
        for g in got {
            assert_eq!(g.unwrap().unwrap(), id);
        }
    }

    #[tokio::test]
    async fn a_rank_that_cannot_join_fails_every_rank_with_its_reason() {
        let got = run_all(3, Duration::from_secs(10), |r| {
            Some(match r {
                2 => Readiness::Unable("no CUDA devices: no driver".into()),
                0 => Readiness::Ready(Some(vec![1; 128])),
                _ => Readiness::Ready(None),
            })
        })
        .await;
        for (rank, g) in got.into_iter().enumerate() {
            let e = g.unwrap().unwrap_err();
            assert_eq!(
                e.to_string(),
                format!(
                    "process group setup on rank {rank}: rank 2 cannot join: no CUDA devices: no driver"
                )
            );
        }
    }

    #[tokio::test]
    async fn a_group_name_used_twice_is_refused_at_rank_0() {
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let ready = || Readiness::Ready(Some(vec![5; 128]));
        exchange(&*store, "g", 0, 1, Duration::from_secs(5), ready())
            .await
            .unwrap();
        let e = exchange(&*store, "g", 0, 1, Duration::from_secs(5), ready())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("group names must be unique"), "{e}");
    }

    #[tokio::test]
    async fn rank_0_unable_is_named_too() {
        let got = run_all(2, Duration::from_secs(10), |r| {
            Some(match r {
                0 => Readiness::Unable("NCCL is unavailable: not installed".into()),
                _ => Readiness::Ready(None),
            })
        })
        .await;
        for g in got {
            let e = g.unwrap().unwrap_err().to_string();
            assert!(
                e.ends_with("rank 0 cannot join: NCCL is unavailable: not installed"),
                "{e}"
            );
        }
    }

    #[tokio::test]
    async fn a_rank_that_never_comes_is_named_by_the_timeout() {
        let got = run_all(3, Duration::from_millis(300), |r| {
            (r != 1).then(|| Readiness::Ready((r == 0).then(|| vec![3; 128])))
        })
        .await;
        for (rank, g) in got.into_iter().enumerate() {
            if rank == 1 {
                assert!(g.is_none());
                continue;
            }
            let e = g.unwrap().unwrap_err();
            assert!(
                matches!(&e, ProcessGroupError::Timeout { waiting_on, .. } if waiting_on == &[1]),
                "{e}"
            );
            assert!(e.to_string().contains("waiting for rank(s) 1"), "{e}");
        }
    }
}
