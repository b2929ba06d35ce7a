//! A static group's world process group on one host runs its collectives through the group
//! arena, keeping time on the agent's runtime: here tokio's paused clock, so the deadlines
//! below pass in virtual time only if the arena's waits judge them on that clock.

use std::time::Duration;

use tensorwire_rpc::{Agent, RpcError, Runtime, Shutdown, TokioRuntime, WaitingFor};
use tensorwire_testkit::MemoryCluster as Cluster;

/// Three in-process workers share a host: their world group takes the arena; all_gathers and
/// barriers go through it; an all_gather that w2 never joins fails on w0 and w1 at their
/// timeout on the agent's clock (seven virtual seconds), naming w2, and breaks the group: the
/// next one fails with the same error at once.
#[tokio::test(start_paused = true)]
async fn the_world_group_takes_the_arena_and_times_out_on_the_agents_clock() {
    let cluster = Cluster::new();
    let agents: Vec<Agent> = cluster.group(3, |_, _| {}).await.unwrap();
    for a in &agents {
        assert!(a.process_group().unwrap().uses_arena());
    }
    let t = Duration::from_secs(10);
    let rounds = agents.iter().cloned().map(|a| {
        tokio::spawn(async move {
            a.barrier("b", t).await?;
            a.all_gather("g", &a.worker_info().id, t).await
        })
    });
    for r in rounds.collect::<Vec<_>>() {
        assert_eq!(r.await.unwrap().unwrap(), vec![0, 1, 2]);
    }

    let short = Duration::from_secs(7);
    let t0 = TokioRuntime.now();
    let late = agents[..2].iter().cloned().map(|a| {
        tokio::spawn(async move {
            let first = a.all_gather("late", &1u8, short).await.unwrap_err();
            let waited = TokioRuntime.now() - t0;
            let again = a.all_gather("again", &1u8, short).await.unwrap_err();
            let waited_again = TokioRuntime.now() - t0 - waited;
            (first, waited, again, waited_again)
        })
    });
    for task in late.collect::<Vec<_>>() {
        let (first, waited, again, waited_again) = task.await.unwrap();
        match &first {
            RpcError::Timeout {
                waiting_for: Some(WaitingFor::Workers(w)),
                after,
                ..
            } => {
                assert_eq!(*after, short);
                assert_eq!(
                    w.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(),
                    ["w2"],
                    "{first}"
                );
            }
            other => panic!("{other}"),
        }
        assert!(
            waited >= short && waited < short + Duration::from_secs(1),
            "{waited:?}"
        );
        // The broken group fails the next one at once, with the same cause.
        assert_eq!(
            again.to_string(),
            first.to_string().replace("late", "again")
        );
        assert!(
            waited_again < Duration::from_millis(100),
            "{waited_again:?}"
        );
    }
    for a in agents {
        let _ = a.shutdown(Shutdown::Immediate).await;
    }
}
