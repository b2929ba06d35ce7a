//! The protocol endpoint's bounds are the user's to set: `RpcOptions::endpoint` reaches the
//! agent's endpoint (they were fixed at their defaults before).

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::protocol::{EndpointConfig, RemoteErrorKind};
use tensorwire_rpc::{Functions, Shutdown};
use tensorwire_testkit::MemoryCluster;
use tokio::sync::Semaphore;

/// With `requests_per_peer` set to 2 on w0, a third call from w1 while two are served is
/// answered `Busy`, naming the bound; the two served ones finish once let go.
#[tokio::test(start_paused = true)]
async fn the_bounds_per_peer_are_set_through_the_options() {
    let gate = Arc::new(Semaphore::new(0));
    let functions = Functions::new();
    let g = gate.clone();
    functions
        .register("gate", move |n: u32| {
            let g = g.clone();
            async move {
                g.acquire().await.map_err(|e| e.to_string())?.forget();
                Ok::<_, String>(n)
            }
        })
        .unwrap();
    let cluster = MemoryCluster::new();
    let agents = cluster
        .group(2, |rank, options| {
            options.functions = functions.clone();
            if rank == 0 {
                options.endpoint = EndpointConfig {
                    requests_per_peer: 2,
                    ..EndpointConfig::default()
                };
            }
        })
        .await
        .unwrap();
    let caller = &agents[1];
    let first = caller
        .rpc_async::<_, u32>("w0", "gate", &1u32, None)
        .unwrap();
    let second = caller
        .rpc_async::<_, u32>("w0", "gate", &2u32, None)
        .unwrap();
    // Both are being served before the third arrives (one connection keeps their order).
    let third = caller
        .rpc_sync::<_, u32>("w0", "gate", &3u32, Some(Duration::from_secs(30)))
        .await
        .unwrap_err();
    let remote = third.remote().expect("a remote error");
    assert_eq!(remote.kind, RemoteErrorKind::Busy, "{third}");
    assert!(third.to_string().contains("requests_per_peer"), "{third}");
    gate.add_permits(2);
    assert_eq!(first.await.unwrap(), 1);
    assert_eq!(second.await.unwrap(), 2);
    for a in agents {
        a.shutdown(Shutdown::Immediate).await.unwrap();
    }
}

/// A bound no agent can work with (here: no request served at all) is refused at start,
/// naming the setting, rather than failing every call later.
#[tokio::test(start_paused = true)]
async fn a_zero_bound_is_refused_at_start_naming_it() {
    let cluster = MemoryCluster::new();
    let e = cluster
        .group(1, |_, options| {
            options.endpoint = EndpointConfig {
                requests_per_peer: 0,
                ..EndpointConfig::default()
            };
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            &e.error,
            tensorwire_rpc::RpcError::Init(tensorwire_rpc::InitError::Endpoint(c))
                if c.setting == "requests_per_peer"
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("requests_per_peer is zero"), "{e}");
}
