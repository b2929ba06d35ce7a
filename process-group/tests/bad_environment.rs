//! A group's settings read from the environment: a value its setting does not take fails the
//! group's setup naming the variable, rather than being taken for the default.
//!
//! One test in this file, because it changes the process's environment: under `cargo test` the
//! tests of one file share a process (nextest gives each its own).

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::env::BadVariable;
use tensorwire_core::ports::process_group::{Collectives, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_process_group::{
    CollectivePath, Group, GroupOptions, InMemoryStore, ARENA_BYTES_ENV, COLLECTIVES_ENV,
};
use tensorwire_transport_tcp::{ClusterSecret, TcpConfig, TcpTransport};

async fn connect(options: GroupOptions) -> Result<Group, ProcessGroupError> {
    let secret = ClusterSecret::new(b"environment test secret".to_vec()).unwrap();
    let transport = Arc::new(TcpTransport::new(TcpConfig::new(secret)).unwrap());
    let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
    let options = options.with_timeout(Duration::from_secs(20));
    tokio::time::timeout(
        Duration::from_secs(60),
        Group::connect(store, transport, 0, 1, options),
    )
    .await
    .expect("a group of one sets up or fails at once")
}

fn bad_variable(result: Result<Group, ProcessGroupError>) -> BadVariable {
    match result {
        Err(ProcessGroupError::BadVariable { rank: 0, source }) => source,
        Err(other) => panic!("expected the variable's error, got {other}"),
        Ok(_) => panic!("expected the variable's error, the group was set up"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_value_in_the_environment_fails_setup_naming_it_unless_the_setting_is_replaced() {
    // The only test of this process: nothing else reads the environment meanwhile.
    std::env::set_var(COLLECTIVES_ENV, "fast");
    let bad = bad_variable(connect(GroupOptions::new("env-a")).await);
    assert_eq!(
        (bad.var.as_str(), bad.value.as_str()),
        (COLLECTIVES_ENV, "fast")
    );
    assert!(bad.to_string().contains("arena or links"), "{bad}");
    // Replaced by the caller: the variable is not used, and not an error.
    let group = connect(GroupOptions::new("env-b").with_collectives(CollectivePath::Links))
        .await
        .unwrap();
    group.barrier().await.unwrap();
    std::env::set_var(COLLECTIVES_ENV, " Links ");
    assert_eq!(CollectivePath::from_env(), Ok(CollectivePath::Links));
    std::env::remove_var(COLLECTIVES_ENV);

    std::env::set_var(ARENA_BYTES_ENV, "32MiB");
    let err = connect(GroupOptions::new("env-c")).await.err().unwrap();
    assert!(
        err.to_string().contains(ARENA_BYTES_ENV) && err.to_string().contains("\"32MiB\""),
        "{err}"
    );
    let bad = bad_variable(Err(err));
    assert_eq!(bad.expected, "a size in bytes");
    connect(GroupOptions::new("env-d").with_arena_bytes(1 << 20))
        .await
        .unwrap();
    std::env::remove_var(ARENA_BYTES_ENV);

    std::env::set_var("TENSORWIRE_DEBUG", "loud");
    let bad = bad_variable(connect(GroupOptions::new("env-e")).await);
    assert_eq!(
        (bad.var.as_str(), bad.value.as_str()),
        ("TENSORWIRE_DEBUG", "loud")
    );
    std::env::remove_var("TENSORWIRE_DEBUG");

    std::env::set_var("TENSORWIRE_SHM_SPIN_US", "fast");
    let bad = bad_variable(connect(GroupOptions::new("env-f")).await);
    assert_eq!(bad.var, "TENSORWIRE_SHM_SPIN_US");
    std::env::remove_var("TENSORWIRE_SHM_SPIN_US");

    // And with nothing set, a group of one sets up.
    connect(GroupOptions::new("env-g")).await.unwrap();
}
