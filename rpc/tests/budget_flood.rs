//! A flood of every kind from one hostile peer, over real TCP sockets, against one per-peer
//! memory budget (`RpcOptions::with_peer_budget`, see `tensorwire_core::budget`): the hostile
//! worker (`tensorwire_testkit::hostile`) makes its victim keep idempotence records of control
//! messages, leaves collective messages in the world group's inboxes that no collective takes,
//! stops reading while the victim calls it (its queue grows), and sends a frame larger than
//! what is left of its budget. Each is held within the one budget: the most the victim ever held
//! for the hostile worker, over every use together, stays within it; the hostile worker is
//! dropped naming the budget; what it held is freed; and the honest worker is served
//! throughout.
//!
//! Before the budget each of these had a bound of its own, and they added up: the inbox alone
//! held up to 1 GiB, the queue 256 MiB, a frame being received up to its length, and the
//! idempotence records of a lost peer stayed.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::budget::Use;
use tensorwire_core::collective::Signature;
use tensorwire_core::protocol::mesh::GroupFrame;
use tensorwire_core::protocol::{GlobalId, Header, LostCause};
use tensorwire_core::wire::{Frame, FrameKind};
use tensorwire_rpc::{Agent, Functions, PeerEvent};
use tensorwire_testkit::hostile::{hostile_group, HostileGroup};
use tensorwire_testkit::nets::{transports, Net};
use tensorwire_testkit::{base_options, wait_until};

const TEST_BOUND: Duration = Duration::from_secs(120);
/// The victim's budget per peer in the test (the default is 256 MiB).
const BUDGET: usize = 8 << 20;
const VICTIM: usize = 0;
const HONEST: usize = 1;
const HOSTILE: u32 = 2;
/// Control messages the hostile worker sends (each leaves an idempotence record).
const CONTROL: u64 = 4_000;
/// Collective messages it leaves in the world group's inbox, and their size.
const COLLECTIVES: u64 = 4;
const COLLECTIVE_BYTES: usize = 1 << 20;
/// Calls the victim makes to it once it stops reading, and their argument's size.
const CALLS: usize = 64;
const ARG: usize = 512 << 10;

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("test took too long")
}

fn functions() -> Functions {
    let f = Functions::new();
    f.register(
        "len",
        |data: Vec<u8>| async move { Ok::<_, String>(data.len()) },
    )
    .unwrap();
    f
}

async fn group() -> HostileGroup {
    hostile_group(3, transports(Net::Tcp), |rank| {
        let options = base_options().with_functions(functions());
        if rank == VICTIM {
            options.with_peer_budget(BUDGET)
        } else {
            options
        }
    })
    .await
    .unwrap()
}

/// A collective message of the world group (id 0), collective `seq` (far ahead of the
/// victim: no collective there takes it, and none could once the sender is gone).
fn collective(seq: u64) -> Frame {
    GroupFrame::Data {
        seq,
        signature: Signature::Barrier.encode(),
    }
    .frame(vec![Bytes::from(vec![7u8; COLLECTIVE_BYTES])])
}

/// Control messages (deletes of forks of values nobody made), each acknowledged and recorded.
/// The acknowledgements are kept from the hostile worker's own agent, which never sent them.
async fn control_flood(g: &HostileGroup) {
    g.hostile.swallow(|h| matches!(h, Header::Ack { .. }));
    for id in 1..=CONTROL {
        let rref = GlobalId {
            created_on: HOSTILE,
            local: 1 << 30 | id,
        };
        let header = Header::UserDelete {
            id: 1 << 40 | id,
            floor: 1 << 40,
            rref,
            fork: rref,
        };
        // The victim may have dropped it already (then the sends fail).
        if g.hostile.send(VICTIM as u32, &header, None).await.is_err() {
            return;
        }
    }
}

async fn honest_calls(victim: &Agent, honest: &Agent) {
    for _ in 0..3 {
        let n: usize = victim
            .rpc_sync("w1", "len", &vec![3u8; 1000], None)
            .await
            .unwrap();
        assert_eq!(n, 1000);
        let n: usize = honest
            .rpc_sync("w0", "len", &vec![3u8; 1000], None)
            .await
            .unwrap();
        assert_eq!(n, 1000);
    }
}

/// Waits for the hostile worker's loss on the victim and returns its cause.
async fn lost(events: &mut tensorwire_rpc::PeerEvents) -> LostCause {
    loop {
        match events.recv().await {
            Some(PeerEvent::Lost { worker, cause }) => {
                assert_eq!(
                    worker, HOSTILE,
                    "only the hostile worker is dropped ({cause})"
                );
                return cause;
            }
            Some(_) => {}
            None => panic!("the victim's peer events ended"),
        }
    }
}

/// What the victim holds for the hostile worker is freed once it is dropped.
async fn freed(victim: &Agent) {
    let budget = victim.budget();
    wait_until(
        "what the hostile worker held is freed",
        Duration::from_secs(30),
        || budget.held(HOSTILE).total() == 0 && victim.queued_bytes() == 0,
    )
    .await;
    assert_eq!(victim.debug_info().protocol.idempotence_records, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_every_kind_is_held_within_one_budget_per_peer() {
    bounded(async {
        let g = group().await;
        let (victim, honest) = (&g.agents[VICTIM], &g.agents[HONEST]);
        let budget = victim.budget();
        assert_eq!(budget.limit(), BUDGET);
        let mut events = victim.peer_events();
        honest_calls(victim, honest).await;

        // Records: control messages the victim must remember.
        control_flood(&g).await;
        wait_until("the records are kept", Duration::from_secs(30), || {
            victim.debug_info().protocol.idempotence_records >= CONTROL as usize
        })
        .await;
        let records = budget.held(HOSTILE).records;
        assert!(records >= CONTROL as usize * 16, "{records}");

        // Inbox: collective messages no collective takes (each alone fits the budget).
        for seq in 1000..1000 + COLLECTIVES {
            g.hostile
                .send_frame(VICTIM as u32, collective(seq))
                .await
                .unwrap();
        }
        wait_until("the inbox holds them", Duration::from_secs(30), || {
            budget.held(HOSTILE).inbox == COLLECTIVES as usize * COLLECTIVE_BYTES
        })
        .await;
        honest_calls(victim, honest).await;

        // Queue: it stops reading while the victim calls it.
        g.hostile.stop_reading();
        let arg = vec![1u8; ARG];
        let calls: Vec<_> = (0..CALLS)
            .map(|_| {
                victim
                    .rpc_async::<_, usize>("w2", "len", &arg, None)
                    .unwrap()
            })
            .collect();
        let cause = lost(&mut events).await;
        let LostCause::OverBudget(over) = &cause else {
            panic!("dropped for {cause}, not for its budget");
        };
        assert_eq!(over.budget, BUDGET);
        assert_eq!(over.what, Use::Queued);
        // Every kind was held at once, drawn from the one budget.
        assert!(over.held.records >= CONTROL as usize * 16, "{over}");
        assert_eq!(
            over.held.inbox,
            COLLECTIVES as usize * COLLECTIVE_BYTES,
            "{over}"
        );
        assert!(over.held.queued > 0, "{over}");
        assert!(
            cause.to_string().contains("(peer_budget)"),
            "the bound is named: {cause}"
        );
        let peak = budget.peak(HOSTILE);
        eprintln!(
            "flood of every kind: peak held for the hostile worker {peak} bytes, budget {BUDGET}; \
             at the drop: {}",
            over.held
        );
        assert!(peak <= BUDGET, "peak {peak} past the budget {BUDGET}");
        // Every call to it fails, but one its reader had already begun to read when it
        // stopped, which it answered.
        let mut failed = 0;
        for call in calls {
            failed += usize::from(call.await.is_err());
        }
        assert!(failed >= CALLS - 1, "only {failed} of {CALLS} calls failed");
        freed(victim).await;
        honest_calls(victim, honest).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_past_what_is_left_of_the_budget_closes_the_connection_as_it_arrives() {
    bounded(async {
        let g = group().await;
        let (victim, honest) = (&g.agents[VICTIM], &g.agents[HONEST]);
        let budget = victim.budget();
        let mut events = victim.peer_events();
        // Most of the budget held in the inbox, then a message frame larger than what is left:
        // the victim's reader counts it as it arrives and closes the connection before it
        // holds more than the budget.
        for seq in 1000..1006 {
            g.hostile
                .send_frame(VICTIM as u32, collective(seq))
                .await
                .unwrap();
        }
        wait_until("the inbox holds them", Duration::from_secs(30), || {
            budget.held(HOSTILE).inbox == 6 * COLLECTIVE_BYTES
        })
        .await;
        let big = Frame {
            kind: FrameKind::Message,
            header: Bytes::from_static(b"not read before the budget says no"),
            payloads: vec![Bytes::from(vec![9u8; 4 << 20])].into(),
        };
        // The victim closes the connection while the frame is being written.
        let _ = g.hostile.send_frame(VICTIM as u32, big).await;
        let cause = lost(&mut events).await;
        let text = cause.to_string();
        assert!(text.contains("(peer_budget)"), "the bound is named: {text}");
        assert!(text.contains("a frame being received"), "{text}");
        let peak = budget.peak(HOSTILE);
        eprintln!("frame past the budget: peak {peak} bytes, budget {BUDGET}: {text}");
        assert!(peak <= BUDGET, "peak {peak} past the budget {BUDGET}");
        freed(victim).await;
        honest_calls(victim, honest).await;
    })
    .await;
}
