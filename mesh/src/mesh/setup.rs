//! Setting a mesh up: listening, publishing the address, dialling the higher ranks and
//! accepting the lower ones (through [`crate::link`]), then starting a reader per connection.

use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use tensorwire_core::budget::Budget;
use tensorwire_core::collective::inbox::{Admission, InboxLimits};
use tensorwire_core::identity::check_rank_claim;
use tensorwire_core::ports::process_group::ProcessGroupError;
use tensorwire_core::ports::runtime::Runtime;
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::{Connection, Transport};
use tensorwire_core::protocol::membership::{JoinError, StaticJoin};
use tensorwire_core::protocol::mesh::GroupFrame;
use tracing::{debug, warn};

use super::peer_inbox::Inbox;
use super::reader::read_loop;
use super::{address_key, Mesh, PeerLink, Shared, ABORT_SEND_TIMEOUT};
use crate::link;

/// What setting up a mesh needs.
pub struct MeshSetup<'a> {
    /// The store through which ranks publish where they listen.
    pub store: &'a dyn Store,
    /// The transport that dials and listens.
    pub transport: &'a dyn Transport,
    /// The group's name: it scopes the store keys and is checked in every hello.
    pub group: &'a str,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
    /// Where to listen (port 0 for an ephemeral port); its IP is what peers are told.
    pub listen: SocketAddr,
    /// How long the whole setup may take.
    pub timeout: Duration,
    /// What a peer may make this rank hold in its collective inboxes.
    pub limits: InboxLimits,
    /// The clock and timers of the setup and of the mesh afterwards
    /// ([`TokioRuntime`](crate::TokioRuntime) unless a test or an embedding passes another).
    pub runtime: Arc<dyn Runtime>,
    /// The memory budget each peer's messages draw from (shared with the rest of what a peer
    /// makes this worker hold: see [`tensorwire_core::budget`]). The frame being received
    /// from each peer draws from it too (`Connection::bill_to`).
    pub budget: Budget,
}

impl Mesh {
    /// Connects to every other rank: this rank dials the higher ranks and accepts the lower
    /// ones (as `core::protocol::membership::StaticJoin` decides), through [`crate::link`].
    /// A rank that accepts anyone listens and publishes its address under [`address_key`], and
    /// removes that key once every lower rank has connected (nobody needs it any more), so a
    /// set-up group leaves no key in the store.
    pub async fn connect(setup: MeshSetup<'_>) -> Result<Mesh, ProcessGroupError> {
        let MeshSetup {
            store,
            transport,
            group,
            rank,
            world,
            listen,
            timeout,
            limits,
            runtime,
            budget,
        } = setup;
        let rt = &*runtime;
        let setup_err = |reason: String| ProcessGroupError::Setup { rank, reason };
        if rank >= world {
            return Err(setup_err(format!(
                "rank {rank} is out of range for a world of {world} ranks"
            )));
        }
        let (Ok(me), Ok(world32)) = (u32::try_from(rank), u32::try_from(world)) else {
            return Err(setup_err(format!("a world of {world} ranks is too large")));
        };
        let deadline = rt.deadline_after(timeout);
        // What this rank's own credentials are (a rank certificate requires one of every peer).
        let own = transport.credentials();
        if let Err(e) = check_rank_claim(&own, &own, me) {
            // A worker started with another rank's certificate: every peer would refuse it.
            return Err(setup_err(format!("this worker's own certificate: {e}")));
        }
        let join = Mutex::new(StaticJoin::new(me, world32, None));
        let lock_join = || join.lock().unwrap_or_else(|e| e.into_inner());
        let (dials, accepts) = {
            let j = lock_join();
            (j.dials(), j.accepts())
        };
        let timed_out = || {
            let missing = lock_join().missing();
            ProcessGroupError::SetupTimeout {
                rank,
                waiting_on: missing.into_iter().map(|r| r as usize).collect(),
                timeout,
            }
        };
        let listener = if accepts > 0 {
            let listener = transport.listen(listen).await.map_err(|source| {
                ProcessGroupError::SetupTransport {
                    rank,
                    doing: "listening",
                    source: Box::new(source),
                }
            })?;
            store
                .set(
                    &address_key(group, rank),
                    listener.local_addr().to_string().as_bytes(),
                )
                .await
                .map_err(|source| ProcessGroupError::SetupStore {
                    rank,
                    doing: "publishing this rank's address",
                    source,
                })?;
            debug!(group, rank, world, local = %listener.local_addr(), "mesh listening");
            Some(listener)
        } else {
            None
        };

        let accept = async {
            let mut accepted: Vec<(usize, Arc<dyn Connection>)> = Vec::new();
            let Some(listener) = &listener else {
                return Ok(accepted);
            };
            // Hellos are read beside the accepting, so that a connection that says nothing
            // holds up nobody else's (dropping the set ends those still unread).
            let mut hellos = tokio::task::JoinSet::new();
            while accepted.len() < accepts {
                let (conn, hello) = tokio::select! {
                    conn = listener.accept() => {
                        let conn: Arc<dyn Connection> = Arc::from(conn.map_err(|e| {
                            ProcessGroupError::SetupTransport {
                                rank,
                                doing: "accepting the lower ranks' connections",
                                source: Box::new(e),
                            }
                        })?);
                        let runtime = runtime.clone();
                        hellos.spawn(async move {
                            let hello = link::read_hello(&*runtime, &*conn, deadline).await;
                            (conn, hello)
                        });
                        continue;
                    }
                    Some(Ok(read)) = hellos.join_next() => read,
                    () = rt.sleep_until(deadline) => return Err(timed_out()),
                };
                let hello = match hello {
                    Ok(h) => h,
                    Err(e) => {
                        warn!(group, rank, "refused a mesh connection: {e}");
                        continue;
                    }
                };
                let from = hello.rank;
                if let Err(source) = check_rank_claim(&own, &conn.peer_credentials(), from) {
                    // Its certificate is for another rank (or none, among rank certificates):
                    // an impostor, or a mistake. Tell it why, drop it, and go on waiting for
                    // the real rank, whose claim this one cannot block.
                    let error = ProcessGroupError::RankNotCertified {
                        rank,
                        peer: conn.peer_addr(),
                        source,
                    };
                    warn!(group, rank, "{error}");
                    let abort = GroupFrame::Abort {
                        rank: me,
                        reason: error.to_string(),
                    }
                    .frame(Vec::new());
                    // Beside the accepting: an impostor that does not read holds up nobody.
                    let runtime = runtime.clone();
                    tokio::spawn(async move {
                        let _ = runtime.timeout(ABORT_SEND_TIMEOUT, conn.send(abort)).await;
                        let _ = conn.close().await;
                    });
                    continue;
                }
                let claimed = accepted.iter().find(|(r, _)| *r == from as usize);
                if let Some((_, first)) = claimed {
                    // Two claims of one rank: one is an impostor holding the secret. Which
                    // one, nobody here can tell: this rank fails its setup, and tells every
                    // connection it holds (both claimants among them) why, in its own name.
                    let error = ProcessGroupError::ClaimedTwice {
                        rank,
                        claimed: from as usize,
                        first: first.peer_addr(),
                        second: conn.peer_addr(),
                    };
                    warn!(group, rank, "{error}");
                    let abort = GroupFrame::Abort {
                        rank: me,
                        reason: error.to_string(),
                    }
                    .frame(Vec::new());
                    for link in accepted.iter().map(|(_, c)| c).chain([&conn]) {
                        let _ = rt
                            .timeout(ABORT_SEND_TIMEOUT, link.send(abort.clone()))
                            .await;
                        let _ = link.close().await;
                    }
                    return Err(error);
                }
                let fits = hello.group == group && hello.world == Some(world32);
                let checked = if fits {
                    lock_join().handle_connected(from, false)
                } else {
                    Err(JoinError::Refused {
                        peer: from,
                        what: "a hello for another group or world size",
                    })
                };
                match checked {
                    Ok(()) => accepted.push((from as usize, conn)),
                    Err(e) => {
                        warn!(group, rank, peer = %conn.peer_addr(), ?hello, "refused a mesh connection: {e}");
                    }
                }
            }
            // Every rank that needed this address has connected.
            if let Err(e) = store.delete_key(&address_key(group, rank)).await {
                debug!(
                    group,
                    rank, "could not remove this rank's address from the store: {e}"
                );
            }
            Ok::<_, ProcessGroupError>(accepted)
        };

        let connect = async {
            let mut connected: Vec<(usize, Arc<dyn Connection>)> = Vec::new();
            if dials.is_empty() {
                return Ok(connected);
            }
            let keys: Vec<String> = dials
                .iter()
                .map(|r| address_key(group, *r as usize))
                .collect();
            let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let remaining = deadline.saturating_duration_since(rt.now());
            if store.wait(&key_refs, remaining).await.is_err() {
                // Who has not published: those this rank still misses, as far as it knows.
                let mut unpublished = Vec::new();
                for (r, key) in dials.iter().zip(&key_refs) {
                    if !store.check(&[key]).await.unwrap_or(false) {
                        unpublished.push(*r as usize);
                    }
                }
                return Err(ProcessGroupError::SetupTimeout {
                    rank,
                    waiting_on: unpublished,
                    timeout,
                });
            }
            let values = store.multi_get(&key_refs).await.map_err(|source| {
                ProcessGroupError::SetupStore {
                    rank,
                    doing: "reading the addresses of the higher ranks",
                    source,
                }
            })?;
            let hello = link::Hello {
                group: group.to_owned(),
                rank: me,
                world: Some(world32),
                introduction: Vec::new(),
            };
            for (&peer, value) in dials.iter().zip(&values) {
                let text = String::from_utf8_lossy(value);
                let addr: SocketAddr = text.parse().map_err(|e| {
                    setup_err(format!(
                        "rank {peer} published the address {text:?}, which is not ip:port ({e})"
                    ))
                })?;
                let conn = link::dial(rt, transport, addr, &hello, deadline)
                    .await
                    .map_err(|e| setup_err(format!("rank {peer}: {e}")))?;
                // The listener at rank `peer`'s published address must be certified for it
                // (where certificates name ranks): a forged address gets nobody in.
                if let Err(source) = check_rank_claim(&own, &conn.peer_credentials(), peer) {
                    let _ = conn.close().await;
                    return Err(ProcessGroupError::RankNotCertified {
                        rank,
                        peer: addr,
                        source,
                    });
                }
                lock_join()
                    .handle_connected(peer, true)
                    .map_err(|e| setup_err(e.to_string()))?;
                connected.push((peer as usize, Arc::from(conn)));
            }
            Ok(connected)
        };

        let (accepted, connected) = accept_and_connect(accept, connect).await?;
        drop(listener);
        let mut conns: Vec<Option<Arc<dyn Connection>>> = (0..world).map(|_| None).collect();
        for (peer, conn) in accepted.into_iter().chain(connected) {
            conns[peer] = Some(conn);
        }
        let failure = std::sync::OnceLock::new();
        let shared = Arc::new(Shared {
            rank,
            runtime: runtime.clone(),
            peers: conns
                .into_iter()
                .enumerate()
                .map(|(peer, c)| {
                    c.map(|conn| {
                        let account = budget.account(peer as u32);
                        conn.bill_to(account.clone());
                        PeerLink {
                            conn,
                            inbox: Inbox::new(account),
                            read_all: tokio::sync::watch::Sender::new(false),
                        }
                    })
                })
                .collect(),
            failure,
            disagreements: Mutex::new(Default::default()),
            sink: std::sync::OnceLock::new(),
            admission: Mutex::new(Admission::new(world, limits)),
        });
        let readers = (0..world)
            .filter(|peer| *peer != rank)
            .map(|peer| tokio::spawn(read_loop(shared.clone(), peer)))
            .collect();
        debug!(group, rank, world, "mesh connected");
        Ok(Mesh {
            shared,
            world,
            readers,
        })
    }
}

/// Both sides of a rank's setup, as `try_join!` but for which failure is told: the dialing
/// side's failure at once; the accepting side's once the dialing side has ended too (it ends by
/// the same deadline) and has not failed. At the deadline the dialing side names the higher
/// ranks that never published an address, while the accepting side can only name who has not
/// connected, which includes a lower rank that is itself waiting for the same missing rank;
/// which of the two timers fires first must not decide which is told.
async fn accept_and_connect<A, C>(
    accept: impl Future<Output = Result<A, ProcessGroupError>>,
    connect: impl Future<Output = Result<C, ProcessGroupError>>,
) -> Result<(A, C), ProcessGroupError> {
    let (mut accept, mut connect) = (pin!(accept), pin!(connect));
    let (mut accepted, mut connected) = (None, None);
    poll_fn(|cx| {
        if accepted.is_none() {
            if let Poll::Ready(outcome) = accept.as_mut().poll(cx) {
                accepted = Some(outcome);
            }
        }
        if connected.is_none() {
            if let Poll::Ready(outcome) = connect.as_mut().poll(cx) {
                connected = Some(outcome);
            }
        }
        match (accepted.take(), connected.take()) {
            (_, Some(Err(e))) => Poll::Ready(Err(e)),
            (Some(a), Some(Ok(c))) => Poll::Ready(a.map(|a| (a, c))),
            (a, c) => {
                (accepted, connected) = (a, c);
                Poll::Pending
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::task::{Context, Waker};

    use super::*;

    fn timed_out(waiting_on: usize) -> ProcessGroupError {
        ProcessGroupError::SetupTimeout {
            rank: 1,
            waiting_on: vec![waiting_on],
            timeout: Duration::ZERO,
        }
    }

    fn waiting_on(e: ProcessGroupError) -> Vec<usize> {
        match e {
            ProcessGroupError::SetupTimeout { waiting_on, .. } => waiting_on,
            other => panic!("not a setup timeout: {other}"),
        }
    }

    #[test]
    fn the_dialing_sides_failure_is_told_though_the_accepting_side_failed_first() {
        let mut cx = Context::from_waker(Waker::noop());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let accept = async { Err::<(), _>(timed_out(0)) };
        let connect = async {
            let _ = rx.await;
            Err::<(), _>(timed_out(2))
        };
        let mut both = pin!(accept_and_connect(accept, connect));
        assert!(both.as_mut().poll(&mut cx).is_pending());
        tx.send(()).unwrap();
        let Poll::Ready(Err(e)) = both.as_mut().poll(&mut cx) else {
            panic!("not ended with an error");
        };
        assert_eq!(waiting_on(e), [2]);
    }

    #[test]
    fn a_failure_to_dial_is_told_at_once_and_the_accepting_sides_when_dialing_succeeded() {
        let mut cx = Context::from_waker(Waker::noop());
        let never = std::future::pending::<Result<(), ProcessGroupError>>();
        let mut both = pin!(accept_and_connect(never, async {
            Err::<(), _>(timed_out(2))
        }));
        let Poll::Ready(Err(e)) = both.as_mut().poll(&mut cx) else {
            panic!("a failure to dial waited for the accepting side");
        };
        assert_eq!(waiting_on(e), [2]);
        let mut both = pin!(accept_and_connect(
            async { Err::<(), _>(timed_out(0)) },
            async { Ok(7) }
        ));
        let Poll::Ready(Err(e)) = both.as_mut().poll(&mut cx) else {
            panic!("not ended with the accepting side's error");
        };
        assert_eq!(waiting_on(e), [0]);
        let mut both = pin!(accept_and_connect(async { Ok(1) }, async { Ok(2) }));
        assert!(matches!(
            both.as_mut().poll(&mut cx),
            Poll::Ready(Ok((1, 2)))
        ));
    }
}
