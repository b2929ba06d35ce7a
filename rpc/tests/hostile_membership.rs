//! A hostile member of a dynamic group (it joined for real, over loopback TCP with the
//! cluster secret) sends membership messages it has no right to send: the victim drops it as
//! a violation, and the honest members' calls still succeed.
//!
//! The group: `w0` coordinates, `w1` is hostile and joins second, `w2` joins last and so dials
//! `w1`, whose transport records the link.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::ports::store::Store;
use tensorwire_core::protocol::membership::dynamic::DynMessage;
use tensorwire_core::protocol::{LostCause, ProtocolViolation};
use tensorwire_core::wire::Frame;
use tensorwire_rpc::{start_agent, Agent, Functions, PeerEvent, Rendezvous, Shutdown};
use tensorwire_store::InMemoryStore;
use tensorwire_testkit::base_options;
use tensorwire_testkit::hostile::{HostilePeer, HostileTransport};
use tensorwire_testkit::nets::{transports, Net};

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
async fn group() -> (Vec<Agent>, HostilePeer) {
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let transports = transports(Net::Tcp);
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
    Frame::control(postcard::to_allocvec(msg).unwrap(), Vec::new())
}

/// Sends `frames` from the hostile member to the victim and checks that the victim drops it
/// as a membership violation, and that the honest members still call each other.
async fn attack(frames: Vec<Frame>) {
    let (agents, hostile) = group().await;
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
    let cause = loop {
        match events.recv().await {
            Some(PeerEvent::Lost { worker, cause }) => {
                assert_eq!(
                    worker, HOSTILE,
                    "only the hostile member is dropped ({cause})"
                );
                break cause;
            }
            Some(_) => {}
            None => panic!("the victim's peer events ended"),
        }
    };
    match &cause {
        LostCause::Misbehaved(v) if matches!(**v, ProtocolViolation::Membership { .. }) => {}
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_sent_to_a_worker_that_is_not_joining_drops_the_sender() {
    bounded(async {
        // Only a joiner's coordinator admits it, and only while it joins.
        attack(vec![membership_frame(&DynMessage::Admit {
            seq: 9,
            members: Vec::new(),
        })])
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_welcome_out_of_turn_drops_the_sender() {
    bounded(async {
        attack(vec![membership_frame(&DynMessage::Welcome)]).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_departures_announced_by_a_non_coordinator_drops_the_sender() {
    bounded(async {
        // A member's word as the coordinator is held (it may have learned first that it
        // coordinates now), but only so much of it: beyond the bound it is a violation, and
        // the coordinator it named as gone stays.
        let forged = membership_frame(&DynMessage::Left { rank: 0 });
        attack(vec![forged; 100]).await;
    })
    .await;
}
