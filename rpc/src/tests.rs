//! What the crate's own tests share: two agents, w0 and w1, over the in-memory network, and
//! a wait for a condition in virtual time.

use std::sync::Arc;

use tensorwire_store::InMemoryStore;
use tensorwire_transport_memory::MemoryNetwork;

use crate::{start_agent, Agent, Functions, Rendezvous, RpcOptions};

/// Two agents, w0 and w1, started with the options `options` gives for each rank.
pub(crate) async fn pair_of(options: impl Fn(usize) -> RpcOptions) -> Vec<Agent> {
    let net = MemoryNetwork::new();
    let store: Arc<dyn tensorwire_core::ports::store::Store> = Arc::new(InMemoryStore::new());
    let mut tasks = Vec::new();
    for rank in 0..2 {
        let o = options(rank);
        let transport = Arc::new(net.transport());
        let rdv = Rendezvous::from_store(Arc::clone(&store), rank, 2);
        tasks.push(tokio::spawn(async move {
            start_agent(transport, rdv, &format!("w{rank}"), rank, Some(2), o).await
        }));
    }
    let mut agents = Vec::new();
    for t in tasks {
        agents.push(t.await.unwrap().unwrap());
    }
    agents
}

/// Two agents, w0 and w1, both serving `functions`.
pub(crate) async fn pair_serving(functions: &Functions) -> Vec<Agent> {
    pair_of(|_| RpcOptions {
        init_timeout: std::time::Duration::from_secs(20),
        functions: functions.clone(),
        ..RpcOptions::default()
    })
    .await
}

/// Lets the agents' tasks run until `done` holds (virtual time: nothing really waits).
pub(crate) async fn until(mut done: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("the condition never held");
}
