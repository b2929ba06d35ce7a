//! A hostile member of a dynamic group (it joined for real, with the cluster secret, over
//! loopback TCP, shared memory and QUIC) sends membership messages and gather contributions it
//! has no right to send: the victim drops it as a violation, and the honest members' calls and
//! gathers still succeed.
//!
//! The group: `w0` coordinates (and leads every gather it is in), `w1` is hostile and joins
//! second, `w2` joins last and so dials `w1`, whose transport records the link.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::codec::{Format, Undecodable};
use tensorwire_core::ports::store::Store;
use tensorwire_core::protocol::gather::{Contribution, GatherError, GatherOutcome};
use tensorwire_core::protocol::membership::dynamic::DynMessage;
use tensorwire_core::protocol::{LostCause, MalformedMessage, ProtocolViolation};
use tensorwire_core::wire::Frame;
use tensorwire_rpc::{start_agent, Agent, Functions, GatherDebugInfo, Rendezvous, Shutdown};
use tensorwire_store::InMemoryStore;
use tensorwire_testkit::hostile::{dropped, HostilePeer, HostileTransport};
use tensorwire_testkit::nets::{transports, Net};
use tensorwire_testkit::{base_options, wait_until};

const TEST_BOUND: Duration = Duration::from_secs(60);
const HOSTILE: u32 = 1;
const VICTIM: u32 = 2;

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("test took too long")
}

fn functions() -> Functions {
    let f = Functions::new();
    f.register(
        "add",
        |(a, b): (i64, i64)| async move { Ok::<_, String>(a + b) },
    )
    .unwrap();
    f
}

/// The three members, joined one after the other, and the hostile worker's handle.
async fn group(net: Net) -> (Vec<Agent>, HostilePeer) {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let transports = transports(net);
    let mut agents = Vec::new();
    let mut hostile = None;
    for rank in 0..3 {
        let mut t = transports(rank);
        if rank == HOSTILE as usize {
            let (wrapped, peer) = HostileTransport::new(t);
            hostile = Some(peer);
            t = Arc::new(wrapped);
        }
        let rdv = Rendezvous::from_store(store.clone(), rank, rank + 1);
        let options = base_options().with_functions(functions());
        let agent = start_agent(t, rdv, &format!("w{rank}"), rank, None, options)
            .await
            .unwrap_or_else(|e| panic!("w{rank} did not join: {e}"));
        agents.push(agent);
    }
    (agents, hostile.expect("made above"))
}

fn membership_frame(msg: &DynMessage) -> Frame {
    Frame::control(msg.encode(), Vec::new())
}

/// Sends `frames` from the hostile member to the victim and checks that the victim drops it
/// as a membership violation, and that the honest members still call each other.
async fn attack(net: Net, frames: Vec<Frame>) {
    let (agents, hostile) = group(net).await;
    let victim = &agents[VICTIM as usize];
    assert_eq!(
        victim
            .rpc_sync::<_, i64>("w0", "add", &(1i64, 2i64), None)
            .await
            .unwrap(),
        3
    );
    let mut events = victim.peer_events();
    for frame in frames {
        // The victim may close the link before the last frame of a flood is written.
        if hostile.send_frame(VICTIM, frame).await.is_err() {
            break;
        }
    }
    let cause = dropped(&mut events, HOSTILE).await;
    match &cause {
        LostCause::Misbehaved(v) if matches!(**v, ProtocolViolation::Membership(_)) => {}
        other => panic!("the hostile member was lost for {other}, not a membership violation"),
    }
    // The honest members are untouched: both ways, and the coordinator stays.
    assert_eq!(
        victim
            .rpc_sync::<_, i64>("w0", "add", &(2i64, 3i64), None)
            .await
            .unwrap(),
        5
    );
    assert_eq!(
        agents[0]
            .rpc_sync::<_, i64>("w2", "add", &(4i64, 5i64), None)
            .await
            .unwrap(),
        9
    );
    for a in agents.into_iter().rev() {
        let _ = a.shutdown(Shutdown::Immediate).await;
    }
}

async fn an_admission_sent_to_a_worker_that_is_not_joining_drops_the_sender(net: Net) {
    bounded(async {
        // Only a joiner's coordinator admits it, and only while it joins.
        attack(
            net,
            vec![membership_frame(&DynMessage::Admit {
                seq: 9,
                members: Vec::new(),
            })],
        )
        .await;
    })
    .await;
}

async fn a_welcome_out_of_turn_drops_the_sender(net: Net) {
    bounded(async {
        attack(net, vec![membership_frame(&DynMessage::Welcome)]).await;
    })
    .await;
}

async fn a_flood_of_departures_announced_by_a_non_coordinator_drops_the_sender(net: Net) {
    bounded(async {
        // A member's word as the coordinator is held (it may have learned first that it
        // coordinates now), but only so much of it: beyond the bound it is a violation, and
        // the coordinator it named as gone stays.
        let forged = membership_frame(&DynMessage::Left { rank: 0 });
        attack(net, vec![forged; 100]).await;
    })
    .await;
}

/// The internal function a member sends its gather contribution to the leader through.
const GATHER: &str = "__tw/gather";

/// The hostile member's contribution to gather `name`, naming `expected`, sent as the
/// agent's own gathers send theirs (core's encoding, as bytes; the answer read by core's
/// decoder).
async fn contribute(
    hostile: &Agent,
    name: &str,
    expected: Vec<u32>,
) -> Result<GatherOutcome, tensorwire_rpc::RpcError> {
    let c = Contribution {
        name: name.to_owned(),
        expected,
        wait: Duration::from_secs(50),
        value: b"forged".to_vec(),
    };
    let answer: Vec<u8> = hostile.rpc_sync("w0", GATHER, &c.encode(), None).await?;
    Ok(GatherOutcome::decode(&answer).expect("the leader's answer decodes"))
}

/// `w0` and `w2` meet in a barrier of their own (`w1` takes no part).
async fn honest_barrier(agents: &[Agent], name: &str) {
    let among = || ["w0", "w2"];
    let timeout = Duration::from_secs(20);
    let (a, b) = tokio::join!(
        agents[0].barrier_among(name, among(), timeout),
        agents[2].barrier_among(name, among(), timeout),
    );
    a.unwrap_or_else(|e| panic!("w0's barrier {name:?} failed: {e}"));
    b.unwrap_or_else(|e| panic!("w2's barrier {name:?} failed: {e}"));
}

async fn a_gather_held_first_with_a_member_list_of_its_choosing_does_not_stop_the_others(net: Net) {
    bounded(async {
        let (agents, _hostile) = group(net).await;
        // w1 takes the name of w0 and w2's barrier first, naming itself and w0 as the members:
        // before the leader's view won, w0 and w2 were refused ("the members disagree") for as
        // long as w1's call waited.
        // It sends the same contribution twice: the answer to one of them is "duplicate",
        // which says that the other is held by w0 before w0 and w2 start.
        let mut early = tokio::task::JoinSet::new();
        for _ in 0..2 {
            let h = agents[HOSTILE as usize].clone();
            early
                .spawn(async move { contribute(&h, "barrier-among/sync", vec![0, HOSTILE]).await });
        }
        assert_eq!(
            early.join_next().await.unwrap().unwrap().unwrap(),
            GatherOutcome::Failed(GatherError::Duplicate {
                from: HOSTILE,
                name: "barrier-among/sync".into(),
            })
        );
        honest_barrier(&agents, "sync").await;
        assert_eq!(
            early.join_next().await.unwrap().unwrap().unwrap(),
            GatherOutcome::Failed(GatherError::Disagreement {
                name: "barrier-among/sync".into(),
                ours: vec![0, VICTIM],
                theirs: vec![0, HOSTILE],
            })
        );
        for a in agents.into_iter().rev() {
            let _ = a.shutdown(Shutdown::Immediate).await;
        }
    })
    .await;
}

async fn a_flood_of_gathers_the_leader_has_not_joined_is_held_to_the_senders_share(net: Net) {
    bounded(async {
        let (agents, _hostile) = group(net).await;
        // More rounds than the leader holds in all (1,024): before each member had a share,
        // w1 alone used them up and every other gather was refused.
        const FLOOD: usize = 1100;
        const SHARE: usize = 64;
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..FLOOD {
            let h = agents[HOSTILE as usize].clone();
            calls.spawn(
                async move { contribute(&h, &format!("flood/{i}"), vec![0, HOSTILE]).await },
            );
        }
        // All but its share are refused at once, naming the bound.
        for _ in 0..FLOOD - SHARE {
            match calls.join_next().await.unwrap().unwrap().unwrap() {
                GatherOutcome::Failed(GatherError::MemberTooManyRounds { from, limit, .. }) => {
                    assert_eq!((from, limit), (HOSTILE, SHARE));
                }
                other => panic!("a gather beyond w1's share was answered {other:?}"),
            }
        }
        honest_barrier(&agents, "after-flood").await;
        assert_eq!(
            agents[VICTIM as usize]
                .rpc_sync::<_, i64>("w0", "add", &(2i64, 3i64), None)
                .await
                .unwrap(),
            5
        );
        // The leader holds w1's share, and no more; once w1 is gone, nothing.
        let held = agents[0].debug_info().gathers;
        assert_eq!((held.rounds, held.waiting), (SHARE, SHARE), "{held:?}");
        assert_eq!(held.held_bytes, SHARE * b"forged".len());
        let mut agents = agents;
        let hostile = agents.remove(HOSTILE as usize);
        hostile.shutdown(Shutdown::Immediate).await.unwrap();
        wait_until("w0 lets go of w1's gathers", TEST_BOUND, || {
            agents[0].debug_info().gathers == GatherDebugInfo::default()
        })
        .await;
        for a in agents.into_iter().rev() {
            let _ = a.shutdown(Shutdown::Immediate).await;
        }
        calls.abort_all();
    })
    .await;
}

async fn a_gather_contribution_no_honest_member_sends_drops_the_sender(net: Net) {
    bounded(async {
        let (agents, _hostile) = group(net).await;
        let mut events = agents[0].peer_events();
        // A value for a gather among w0 and w2, from w1: it does not count itself a member.
        let _ = contribute(&agents[HOSTILE as usize], "x", vec![0, VICTIM]).await;
        let cause = dropped(&mut events, HOSTILE).await;
        match &cause {
            LostCause::Misbehaved(v)
                if matches!(
                    &**v,
                    ProtocolViolation::Gather(GatherError::NotAMember { from: HOSTILE, .. })
                ) => {}
            other => panic!("w1 was lost for {other}, not a gather violation"),
        }
        honest_barrier(&agents, "after-forgery").await;
        assert_eq!(
            agents[0]
                .rpc_sync::<_, i64>("w2", "add", &(4i64, 5i64), None)
                .await
                .unwrap(),
            9
        );
        for a in agents.into_iter().rev() {
            let _ = a.shutdown(Shutdown::Immediate).await;
        }
    })
    .await;
}

async fn a_gather_contribution_that_does_not_parse_drops_the_sender(net: Net) {
    bounded(async {
        let (agents, _hostile) = group(net).await;
        let mut events = agents[0].peer_events();
        let garbage: Vec<u8> = vec![0xff; 12];
        // Its call fails (refused, or its connection dropped first); it is dropped either way.
        let answer = agents[HOSTILE as usize]
            .rpc_sync::<_, Vec<u8>>("w0", GATHER, &garbage, None)
            .await;
        assert!(answer.is_err(), "garbage got an answer: {answer:?}");
        let cause = dropped(&mut events, HOSTILE).await;
        match &cause {
            LostCause::Misbehaved(v)
                if matches!(
                    &**v,
                    ProtocolViolation::Malformed(MalformedMessage::Undecodable(Undecodable {
                        format: Format::GatherContribution,
                        ..
                    }))
                ) => {}
            other => panic!("w1 was lost for {other}, not a malformed contribution"),
        }
        honest_barrier(&agents, "after-garbage").await;
        for a in agents.into_iter().rev() {
            let _ = a.shutdown(Shutdown::Immediate).await;
        }
    })
    .await;
}

// Every attack over every transport: `mod tcp`, `mod shm`, `mod quic`, a test each.
tensorwire_testkit::over_every_net! {
    an_admission_sent_to_a_worker_that_is_not_joining_drops_the_sender,
    a_welcome_out_of_turn_drops_the_sender,
    a_flood_of_departures_announced_by_a_non_coordinator_drops_the_sender,
    a_gather_held_first_with_a_member_list_of_its_choosing_does_not_stop_the_others,
    a_flood_of_gathers_the_leader_has_not_joined_is_held_to_the_senders_share,
    a_gather_contribution_no_honest_member_sends_drops_the_sender,
    a_gather_contribution_that_does_not_parse_drops_the_sender,
}
