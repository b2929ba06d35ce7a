//! A hostile rank that completes the real setup (it holds the cluster secret and greets like a
//! rank) and then sends group frames it has no right to send, over real loopback TCP, shared
//! memory and QUIC ([`tensorwire_testkit::nets`]): each is a violation of the sender, who is
//! dropped and named, and no innocent rank is blamed.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::budget::Use;
use tensorwire_core::collective::inbox::InboxLimits;
use tensorwire_core::collective::stage_failure::{StageCause, StageReport};
use tensorwire_core::collective::Signature;
use tensorwire_core::ports::process_group::{Collectives, MeshViolation, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::Connection;
use tensorwire_core::protocol::mesh::{GroupFrame, Hello};
use tensorwire_core::wire::{Frame, FrameKind};
use tensorwire_process_group::{Group, GroupOptions, InMemoryStore};
use tensorwire_testkit::nets::{transports, Net};

/// The clock of the test's own dials and waits (the groups' default).
const RT: &dyn tensorwire_core::ports::runtime::Runtime = &tensorwire_mesh::TokioRuntime;

const TEST_BOUND: Duration = Duration::from_secs(60);
const WORLD: usize = 3;
/// The hostile rank: the highest, so the honest ranks dial it and it only accepts.
const HOSTILE: usize = 2;

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("test took too long")
}

/// Honest ranks 0 and 1 and the hostile rank's connections to them (by rank).
struct Cluster {
    honest: Vec<Group>,
    hostile: Vec<Arc<dyn Connection>>,
}

async fn cluster(net: Net, name: &str, options: GroupOptions) -> Cluster {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let transports = transports(net);
    let listener = transports(HOSTILE)
        .listen("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    store
        .set(
            &tensorwire_mesh::address_key(name, HOSTILE),
            listener.local_addr().to_string().as_bytes(),
        )
        .await
        .unwrap();
    let tasks: Vec<_> = (0..HOSTILE)
        .map(|rank| {
            let (store, transport, options) = (store.clone(), transports(rank), options.clone());
            tokio::spawn(
                async move { Group::connect(store, transport, rank, WORLD, options).await },
            )
        })
        .collect();
    let mut hostile: Vec<Option<Arc<dyn Connection>>> = vec![None, None];
    let deadline = RT.deadline_after(Duration::from_secs(20));
    for _ in 0..HOSTILE {
        let conn: Arc<dyn Connection> = Arc::from(listener.accept().await.unwrap());
        let hello = tensorwire_mesh::link::read_hello(RT, &*conn, deadline)
            .await
            .unwrap();
        hostile[hello.rank as usize] = Some(conn);
    }
    let mut honest = Vec::new();
    for t in tasks {
        honest.push(t.await.unwrap().unwrap());
    }
    Cluster {
        honest,
        hostile: hostile.into_iter().map(Option::unwrap).collect(),
    }
}

/// A control frame saying that `rank` aborted, encoded as the mesh encodes its frames.
fn abort_frame(rank: u8, reason: &str) -> Frame {
    GroupFrame::Abort {
        rank: rank.into(),
        reason: reason.to_owned(),
    }
    .frame(Vec::new())
}

/// A collective message under `key` (group id in bits 48.., sequence number below).
fn data_frame(key: u64, payload: Bytes) -> Frame {
    GroupFrame::Data {
        seq: key,
        signature: Signature::Barrier.encode(),
    }
    .frame(vec![payload])
}

/// The hostile rank's connection to honest rank 0 is dropped: rank 0 tells it why first (an
/// abort in rank 0's name that names the hostile rank's violation; best effort: a close with
/// the hostile rank's bytes still unread resets a TCP connection, which may discard it), then
/// nothing more comes.
async fn assert_dropped(conn: &Arc<dyn Connection>) {
    if let Err(e) = told_why_then_dropped(conn).await {
        eprintln!("dropped without being told why: {e}");
    }
}

/// As [`assert_dropped`], but rank 0 must have told the hostile rank why (where the hostile
/// rank left nothing unread at rank 0, whose close then cannot discard the abort).
async fn assert_told_why_and_dropped(conn: &Arc<dyn Connection>) {
    if let Err(e) = told_why_then_dropped(conn).await {
        panic!("rank 0 dropped the hostile rank without telling it why: {e}");
    }
}

/// Reads what rank 0 sent the hostile rank it dropped: `Err` when the connection ended at
/// once; an abort naming the violation and then the end; anything else fails the test.
async fn told_why_then_dropped(
    conn: &Arc<dyn Connection>,
) -> Result<(), tensorwire_core::ports::transport::TransportError> {
    match conn.recv().await {
        Ok(frame) => {
            let told = GroupFrame::from_frame(&frame);
            assert!(
                matches!(&told, Ok(GroupFrame::Abort { rank: 0, reason })
                    if reason.starts_with(&format!("rank {HOSTILE} broke the group's protocol: "))),
                "rank 0 sent something other than why it dropped the hostile rank: {told:?}"
            );
            assert!(
                conn.recv().await.is_err(),
                "the victim kept the hostile peer's connection open"
            );
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Both honest ranks make the subgroup of ranks 0 and 1 (id 1), which the hostile rank is
/// not in, and run a barrier in it.
async fn honest_subgroup(c: &Cluster) -> Vec<Group> {
    let pair: Vec<Group> = c
        .honest
        .iter()
        .map(|g| g.new_group(&[0, 1]).unwrap().unwrap())
        .collect();
    let (a, b) = tokio::join!(pair[0].barrier(), pair[1].barrier());
    a.unwrap();
    b.unwrap();
    pair
}

fn options(name: &str) -> GroupOptions {
    // The link path: what a hostile peer may send over the links is what is tested.
    GroupOptions::new(name)
        .with_timeout(Duration::from_secs(30))
        .with_collectives(tensorwire_process_group::CollectivePath::Links)
}

async fn an_abort_naming_another_rank_is_the_senders_violation(net: Net) {
    bounded(async {
        let c = cluster(net, "forged-abort", options("forged-abort")).await;
        // Rank 2 tells rank 0 that rank 1 aborted.
        c.hostile[0]
            .send(abort_frame(1, "rank 1 died"))
            .await
            .unwrap();
        let err = c.honest[0].barrier().await.unwrap_err();
        assert_eq!(
            err,
            ProcessGroupError::Misbehaved {
                rank: HOSTILE,
                violation: MeshViolation::ForeignAbort { named: 1 }
            }
        );
        assert!(!err.to_string().contains("rank 1 died"), "{err}");
        assert_dropped(&c.hostile[0]).await;
        // Rank 1 hears of it from rank 0, in rank 0's name, or sees rank 2's drop itself:
        // either way rank 1 is never the one blamed.
        let err = c.honest[1].barrier().await.unwrap_err();
        match &err {
            ProcessGroupError::PeerAborted { rank: 0, reason } => {
                assert!(
                    reason.contains("rank 2 broke the group's protocol"),
                    "{err}"
                )
            }
            ProcessGroupError::PeerDied { rank: HOSTILE, .. } => {}
            other => panic!("rank 1 failed with {other}"),
        }
    })
    .await;
}

async fn an_abort_in_the_senders_own_name_breaks_the_group_naming_it(net: Net) {
    bounded(async {
        let c = cluster(net, "own-abort", options("own-abort")).await;
        c.hostile[0]
            .send(abort_frame(2, "it saw something"))
            .await
            .unwrap();
        let err = c.honest[0].barrier().await.unwrap_err();
        assert_eq!(
            err,
            ProcessGroupError::PeerAborted {
                rank: HOSTILE,
                reason: "it saw something".into()
            }
        );
    })
    .await;
}

async fn collective_frames_for_a_group_the_sender_is_not_in_are_refused(net: Net) {
    bounded(async {
        let c = cluster(net, "not-in-group", options("not-in-group")).await;
        let _pair = honest_subgroup(&c).await;
        // Rank 2 sends 1 MiB as collective #1 of the subgroup it is not in.
        c.hostile[0]
            .send(data_frame(1 << 48 | 1, Bytes::from(vec![7u8; 1 << 20])))
            .await
            .unwrap();
        assert_dropped(&c.hostile[0]).await;
        let err = c.honest[0].barrier().await.unwrap_err();
        assert_eq!(
            err,
            ProcessGroupError::Misbehaved {
                rank: HOSTILE,
                violation: MeshViolation::NotInGroup { group: 1 }
            }
        );
    })
    .await;
}

async fn a_sequence_number_beyond_the_window_is_refused(net: Net) {
    bounded(async {
        let c = cluster(net, "window", options("window")).await;
        let window = InboxLimits::default().sequence_window;
        c.hostile[0]
            .send(data_frame(window + 1, Bytes::new()))
            .await
            .unwrap();
        assert_dropped(&c.hostile[0]).await;
        let err = c.honest[0].barrier().await.unwrap_err();
        assert_eq!(
            err,
            ProcessGroupError::Misbehaved {
                rank: HOSTILE,
                violation: MeshViolation::AheadOfWindow {
                    group: 0,
                    seq: window + 1,
                    here: 0,
                    window
                }
            }
        );
    })
    .await;
}

async fn a_peer_may_hold_only_so_many_unclaimed_bytes(net: Net) {
    bounded(async {
        let c = cluster(
            net,
            "inbox-bytes",
            options("inbox-bytes").with_peer_budget(1 << 20),
        )
        .await;
        // Collectives #1.. that rank 0 has not run: the first is held, the second passes
        // the peer's budget.
        for seq in 1..=2 {
            c.hostile[0]
                .send(data_frame(seq, Bytes::from(vec![1u8; 700 << 10])))
                .await
                .unwrap();
        }
        assert_dropped(&c.hostile[0]).await;
        let err = c.honest[0].barrier().await.unwrap_err();
        match err {
            // Over TCP the reader counts the frame as it arrives and closes the connection
            // before it is whole; elsewhere the frame arrives whole and the inbox refuses it.
            ProcessGroupError::PeerDied {
                rank: HOSTILE,
                cause: tensorwire_core::ports::process_group::DeathCause::Transport(e),
                ..
            } if net == Net::Tcp => {
                // The transport's error, kept as it is: the budget it passed.
                let tensorwire_core::ports::transport::TransportError::OverBudget {
                    source: over,
                    ..
                } = &*e
                else {
                    panic!("{e}")
                };
                assert_eq!((over.budget, over.held.inbox), (1 << 20, 700 << 10));
                let reason = e.to_string();
                assert!(
                    reason.contains("past its budget of 1048576 bytes per peer (peer_budget)"),
                    "{reason}"
                );
                assert!(reason.contains("716800 in collective inboxes"), "{reason}");
            }
            ProcessGroupError::Misbehaved {
                rank: HOSTILE,
                violation: MeshViolation::OverBudget(over),
            } => {
                assert_eq!(over.budget, 1 << 20);
                assert_eq!(over.what, Use::Inbox);
                assert_eq!(over.held.inbox, 700 << 10);
                assert!(over.to_string().contains("(peer_budget)"), "{over}");
            }
            other => panic!("{other}"),
        }
    })
    .await;
}

/// A disagreement notice: the sender says `peer` ran `theirs` as collective `seq` of group
/// `group` where the sender ran `ours`.
fn notice_frame(group: u64, seq: u64, peer: u32, theirs: Signature, ours: Signature) -> Frame {
    GroupFrame::Disagreement {
        group,
        seq,
        peer,
        theirs,
        ours,
    }
    .frame(Vec::new())
}

async fn a_disagreement_notice_it_could_not_have_seen_is_the_senders_violation(net: Net) {
    // Each forged notice blames innocent rank 1 (or the sender itself); before the check the
    // victim failed with a disagreement naming rank 1.
    let window = InboxLimits::default().sequence_window;
    let cases = [
        (
            "same-sides",
            notice_frame(0, 0, 1, Signature::Barrier, Signature::Barrier),
            (0, 1, 0),
            "both sides ran the same collective",
        ),
        (
            "names-itself",
            notice_frame(0, 0, 2, Signature::Barrier, Signature::AllGatherLengths),
            (0, 2, 0),
            "it named itself as the rank that disagreed with it",
        ),
        (
            "no-such-rank",
            notice_frame(0, 0, 7, Signature::Barrier, Signature::AllGatherLengths),
            (0, 7, 0),
            "the rank it blamed is not a member of that group",
        ),
        (
            "no-such-group",
            notice_frame(5, 0, 1, Signature::Barrier, Signature::AllGatherLengths),
            (5, 1, 0),
            "no such group is made here",
        ),
        (
            "beyond-window",
            notice_frame(
                0,
                window + 1,
                1,
                Signature::Barrier,
                Signature::AllGatherLengths,
            ),
            (0, 1, window + 1),
            "the collective is beyond the group's sequence window here",
        ),
    ];
    for (name, frame, (group, peer, seq), reason) in cases {
        bounded(async {
            let c = cluster(net, name, options(name)).await;
            c.hostile[0].send(frame).await.unwrap();
            let err = c.honest[0].barrier().await.unwrap_err();
            assert_eq!(
                err,
                ProcessGroupError::Misbehaved {
                    rank: HOSTILE,
                    violation: MeshViolation::ForgedDisagreement {
                        group,
                        peer,
                        seq,
                        reason
                    }
                },
                "{name}"
            );
            assert_dropped(&c.hostile[0]).await;
        })
        .await;
    }
}

async fn a_disagreement_notice_about_a_group_its_sender_is_not_in_is_refused(net: Net) {
    bounded(async {
        let c = cluster(net, "notice-subgroup", options("notice-subgroup")).await;
        let pair = honest_subgroup(&c).await;
        // Rank 2 shares the world group with rank 1, but not subgroup 1: it cannot have seen
        // rank 1's messages there. Before the notice named its group (wire version 3) this
        // was believed and broke rank 0's groups, blaming rank 1.
        c.hostile[0]
            .send(notice_frame(
                1,
                1,
                1,
                Signature::Barrier,
                Signature::AllGatherLengths,
            ))
            .await
            .unwrap();
        assert_dropped(&c.hostile[0]).await;
        let err = pair[0].barrier().await.unwrap_err();
        assert_eq!(
            err,
            ProcessGroupError::Misbehaved {
                rank: HOSTILE,
                violation: MeshViolation::ForgedDisagreement {
                    group: 1,
                    peer: 1,
                    seq: 1,
                    reason: "it is not a member of that group"
                }
            }
        );
    })
    .await;
}

async fn a_group_frame_that_does_not_decode_is_the_senders_violation(net: Net) {
    bounded(async {
        let c = cluster(net, "bad-frame", options("bad-frame")).await;
        c.hostile[0]
            .send(Frame::collective(Bytes::from_static(&[9]), Vec::new()))
            .await
            .unwrap();
        assert_told_why_and_dropped(&c.hostile[0]).await;
        let err = c.honest[0].barrier().await.unwrap_err();
        match &err {
            ProcessGroupError::Misbehaved {
                rank: HOSTILE,
                violation: MeshViolation::MalformedGroupFrame { source },
            } => assert!(source.to_string().contains("malformed"), "{err}"),
            other => panic!("rank 0 failed with {other}"),
        }
    })
    .await;
}

async fn a_stage_report_for_a_group_not_across_hosts_is_the_senders_violation(net: Net) {
    bounded(async {
        let c = cluster(net, "stage-report", options("stage-report")).await;
        // These ranks share one process's host: the world runs no stages, so no rank could
        // have seen rank 1 fail in one. Believed, it would break rank 0's group blaming rank 1.
        let report = StageReport {
            ranks: vec![1],
            cause: StageCause::TimedOut {
                waited: Duration::from_secs(3),
            },
        };
        c.hostile[0]
            .send(GroupFrame::StageFailed { group: 0, report }.frame(Vec::new()))
            .await
            .unwrap();
        assert_dropped(&c.hostile[0]).await;
        let err = c.honest[0].barrier().await.unwrap_err();
        assert_eq!(
            err,
            ProcessGroupError::Misbehaved {
                rank: HOSTILE,
                violation: MeshViolation::ForgedStageReport {
                    group: 0,
                    reason: "no such group runs across hosts here"
                }
            }
        );
    })
    .await;
}

async fn a_plausible_disagreement_notice_breaks_the_group_naming_its_reporter(net: Net) {
    bounded(async {
        let c = cluster(net, "notice", options("notice")).await;
        c.hostile[0]
            .send(notice_frame(
                0,
                0,
                1,
                Signature::Barrier,
                Signature::AllGatherLengths,
            ))
            .await
            .unwrap();
        let err = c.honest[0].barrier().await.unwrap_err();
        // Believed, but as rank 2's report (`here: false`, `rank: 2`): the message names who
        // said so, so a lie is traceable to its teller.
        assert_eq!(
            err,
            ProcessGroupError::Disagreement {
                seq: 0,
                peer: 1,
                theirs: Signature::Barrier,
                rank: HOSTILE,
                ours: Signature::AllGatherLengths,
                here: false,
            }
        );
        assert!(err.to_string().contains("rank 2"), "{err}");
    })
    .await;
}

async fn a_hello_after_setup_drops_its_sender_not_the_rank_it_names(net: Net) {
    bounded(async {
        let c = cluster(net, "late-hello", options("late-hello")).await;
        // Rank 2 greets rank 0 again, claiming to be rank 1: a process group's link takes no
        // control frame after its setup.
        let hello = Hello {
            group: "late-hello".into(),
            rank: 1,
            world: Some(WORLD as u32),
            introduction: Vec::new(),
        };
        c.hostile[0].send(hello.frame()).await.unwrap();
        assert_dropped(&c.hostile[0]).await;
        let err = c.honest[0].barrier().await.unwrap_err();
        assert_eq!(
            err,
            ProcessGroupError::Misbehaved {
                rank: HOSTILE,
                violation: MeshViolation::NotAGroupFrame {
                    kind: FrameKind::Control
                }
            }
        );
    })
    .await;
}

async fn a_rank_claimed_twice_during_setup_fails_the_setup_naming_the_claim(net: Net) {
    bounded(async {
        // A worker holding the secret dials rank 2 first, claiming to be rank 1; the real
        // rank 1 dials it next. Before, rank 2 took the impostor for rank 1 and refused the
        // real one in silence: every setup succeeded, and rank 2's messages for rank 1 went
        // to the impostor.
        let name = "claimed-twice";
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let transports = transports(net);
        // No setup here may end by its timeout: each outcome is decided by the claim. (With a
        // 3 s timeout, rank 2's setup could end before the real rank 1 dialled it, or rank 1's
        // before rank 0 dialled it, under a loaded machine: it failed once so under load 17.)
        // The link path: a rank claimed twice while the links are set up is what is tested.
        let options = GroupOptions::new(name)
            .with_timeout(TEST_BOUND)
            .with_collectives(tensorwire_process_group::CollectivePath::Links);
        let start = |rank: usize| {
            let (store, transport, options) = (store.clone(), transports(rank), options.clone());
            tokio::spawn(
                async move { Group::connect(store, transport, rank, WORLD, options).await },
            )
        };
        let listening = start(2);
        let key = tensorwire_mesh::address_key(name, 2);
        store.wait(&[&key], TEST_BOUND).await.unwrap();
        let addr = String::from_utf8(store.get(&key).await.unwrap())
            .unwrap()
            .parse()
            .unwrap();
        let hello = Hello {
            group: name.into(),
            rank: 1,
            world: Some(WORLD as u32),
            introduction: Vec::new(),
        };
        let impostor = tensorwire_mesh::link::dial(
            RT,
            &*transports(1),
            addr,
            &hello,
            RT.deadline_after(TEST_BOUND),
        )
        .await
        .unwrap();
        let real = start(1);
        // Rank 2 fails, naming the claim (rank 0 has not even started: it is not needed).
        match listening.await.unwrap() {
            Err(ProcessGroupError::ClaimedTwice {
                rank: 2,
                claimed: 1,
                ..
            }) => {}
            Err(other) => panic!("rank 2 failed with {other}"),
            Ok(_) => panic!("rank 2 set up with two ranks 1"),
        }
        // Both claimants are told why, in rank 2's name, and their links end.
        let told = impostor.recv().await.unwrap();
        match GroupFrame::from_frame(&told).unwrap() {
            GroupFrame::Abort { rank: 2, reason } => {
                assert!(
                    reason.contains("two connections claimed rank 1"),
                    "{reason}"
                )
            }
            other => panic!("the impostor got {other:?}"),
        }
        assert!(impostor.recv().await.is_err());
        // Rank 0 dials rank 1 first (rank 1 waits for it), then the failed rank 2, which it
        // cannot reach: it would wait out its timeout, so it is stopped once rank 1 is done.
        let zero = start(0);
        // The real rank 1 learns it too: its setup fails, or its first collective does,
        // naming rank 2's abort and the claim.
        let outcome = match real.await.unwrap() {
            Ok(group) => group.barrier().await.map(drop),
            Err(e) => Err(e),
        };
        let err = outcome.expect_err("the real rank 1 went on as if nothing happened");
        assert!(
            err.to_string().contains("two connections claimed rank 1")
                || matches!(err, ProcessGroupError::PeerAborted { rank: 2, .. }),
            "{err}"
        );
        // Rank 0 cannot have set up without rank 2.
        if zero.is_finished() {
            assert!(zero.await.unwrap().is_err(), "rank 0 set up without rank 2");
        } else {
            zero.abort();
        }
    })
    .await;
}

/// A rank that skips the lengths round (an all_gather of equal blocks) reads each message as
/// long as its own lengths say: a peer whose message carries the signature of equal blocks but
/// another size (a forged size) is named, and no byte past the block is taken.
async fn a_forged_block_size_is_named_when_lengths_are_not_exchanged(net: Net) {
    bounded(async {
        let c = cluster(net, "forged-size", options("forged-size")).await;
        let lens = [16usize; WORLD];
        // Bruck at three ranks: rank 1's first message comes from rank 2, one block long.
        let forged = 4096;
        let frame = GroupFrame::Data {
            seq: 0,
            signature: Signature::all_gather(&lens).encode(),
        }
        .frame(vec![Bytes::from(vec![7u8; forged])]);
        c.hostile[1].send(frame).await.unwrap();
        let e = c.honest[1]
            .all_gather_equal(&[1u8; 16])
            .await
            .expect_err("a block of another size was taken");
        assert!(
            matches!(&e, ProcessGroupError::Mismatch { peer: HOSTILE, reason, .. }
                if reason.contains("4096 bytes")),
            "{e}"
        );
    })
    .await;
}

// Every attack over every transport: `mod tcp`, `mod shm`, `mod quic`, a test each.
tensorwire_testkit::over_every_net! {
    an_abort_naming_another_rank_is_the_senders_violation,
    an_abort_in_the_senders_own_name_breaks_the_group_naming_it,
    collective_frames_for_a_group_the_sender_is_not_in_are_refused,
    a_sequence_number_beyond_the_window_is_refused,
    a_peer_may_hold_only_so_many_unclaimed_bytes,
    a_disagreement_notice_it_could_not_have_seen_is_the_senders_violation,
    a_plausible_disagreement_notice_breaks_the_group_naming_its_reporter,
    a_disagreement_notice_about_a_group_its_sender_is_not_in_is_refused,
    a_group_frame_that_does_not_decode_is_the_senders_violation,
    a_stage_report_for_a_group_not_across_hosts_is_the_senders_violation,
    a_hello_after_setup_drops_its_sender_not_the_rank_it_names,
    a_rank_claimed_twice_during_setup_fails_the_setup_naming_the_claim,
    a_forged_block_size_is_named_when_lengths_are_not_exchanged,
}
