//! Over QUIC a worker is the name its node certificate is issued for: a member holding a
//! certificate of the cluster CA, but for another name, cannot take a name in a static group, join
//! a dynamic group under it, or pass for a dynamic group's coordinator. (With a cluster secret
//! every member may take any name: `Connection::check_peer_name`.)

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::Transport;
use tensorwire_rpc::{start_agent, Rendezvous, RpcError, Shutdown};
use tensorwire_store::InMemoryStore;
use tensorwire_testkit::base_options;
use tensorwire_transport_quic::certs::ClusterCa;
use tensorwire_transport_quic::{ClusterTls, QuicConfig, QuicTransport};

const TEST_BOUND: Duration = Duration::from_secs(60);

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("test took too long")
}

/// A QUIC transport presenting a certificate of `ca` issued for `certified`.
fn quic(ca: &ClusterCa, certified: &str) -> Arc<dyn Transport> {
    let tls = ClusterTls::new(
        ca.issue_node(certified).expect("a node certificate"),
        vec![ca.cert_der().clone()],
    );
    Arc::new(QuicTransport::new(QuicConfig::new(tls)).expect("QUIC"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_group_refuses_a_name_the_certificate_does_not_give() {
    bounded(async {
        let ca = ClusterCa::generate().unwrap();
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let start = |rank: usize, certified: &str, name: &'static str| {
            let t = quic(&ca, certified);
            let rdv = Rendezvous::from_store(store.clone(), rank, 2);
            let mut options = base_options();
            options.init_timeout = Duration::from_secs(10);
            async move { start_agent(t, rdv, name, rank, Some(2), options).await }
        };
        // Rank 1 holds a certificate of the cluster, issued for "w7", and says it is "w1".
        let (honest, impostor) = tokio::join!(start(0, "w0", "w0"), start(1, "w7", "w1"));
        match honest {
            Err(RpcError::NotCertified { rank, name, source }) => {
                assert_eq!((rank, name.as_str()), (1, "w1"));
                assert!(source.reason.contains("w7"), "{source}");
            }
            other => panic!("rank 0 should refuse rank 1's name, got {other:?}"),
        }
        assert!(impostor.is_err(), "the impostor's init must fail too");
    })
    .await;
}

/// Starts (or joins) a dynamic group as `name`, presenting a certificate for `certified`.
fn dynamic(
    ca: &ClusterCa,
    store: &Arc<dyn Store>,
    rank: usize,
    certified: &str,
    name: &'static str,
) -> impl Future<Output = Result<tensorwire_rpc::Agent, RpcError>> {
    let t = quic(ca, certified);
    let rdv = Rendezvous::from_store(store.clone(), rank, rank + 1);
    let mut options = base_options();
    options.init_timeout = Duration::from_secs(10);
    async move { start_agent(t, rdv, name, rank, None, options).await }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dynamic_group_refuses_a_joiner_and_a_coordinator_not_certified_for_their_names() {
    bounded(async {
        let ca = ClusterCa::generate().unwrap();
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let join = |rank, certified, name| dynamic(&ca, &store, rank, certified, name);
        let w0 = join(0, "w0", "w0").await.expect("the coordinator starts");
        // A joiner whose certificate names another worker is refused, saying why.
        let err = join(1, "w9", "w1").await.expect_err("an impostor joined");
        let text = err.to_string();
        assert!(text.contains("w9") && text.contains("w1"), "{text}");
        // The honest joiner still gets in and can call the coordinator.
        let w1 = join(1, "w1", "w1").await.expect("the honest joiner");
        assert_eq!(w1.worker_infos().len(), 2);
        w1.shutdown(Shutdown::Immediate).await.ok();
        w0.shutdown(Shutdown::Immediate).await.ok();

        // A coordinator whose certificate is for another name is not believed by a joiner.
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let start = |rank, certified, name| dynamic(&ca, &store, rank, certified, name);
        let fake = start(0, "w5", "w0").await.expect("it starts alone");
        match start(1, "w1", "w1").await {
            Err(RpcError::NotCertified { rank, name, source }) => {
                assert_eq!((rank, name.as_str()), (0, "w0"));
                assert!(source.reason.contains("w5"), "{source}");
            }
            other => panic!("the joiner should refuse the coordinator, got {other:?}"),
        }
        fake.shutdown(Shutdown::Immediate).await.ok();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_certificates_certify_the_names_their_holders_choose() {
    bounded(async {
        // `tensorwire launch --quic-certs` cannot know the names workers will choose: it
        // issues `rank-N`. The mesh checks each hello's rank against the certificate, and the
        // agent then takes a rank-certified connection's own record, whatever its name.
        use tensorwire_core::identity::rank_name;
        let ca = ClusterCa::generate().unwrap();
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let start = |rank: usize, name: &'static str| {
            let t = quic(&ca, &rank_name(rank as u32));
            let rdv = Rendezvous::from_store(store.clone(), rank, 2);
            let mut options = base_options();
            options.init_timeout = Duration::from_secs(10);
            async move { start_agent(t, rdv, name, rank, Some(2), options).await }
        };
        let (trainer, ps) = tokio::join!(start(0, "trainer"), start(1, "ps"));
        let (trainer, ps) = (trainer.expect("rank 0"), ps.expect("rank 1"));
        let names: Vec<String> = trainer
            .worker_infos()
            .into_iter()
            .map(|w| w.name.clone())
            .collect();
        assert!(names.contains(&"ps".to_owned()), "{names:?}");
        trainer.shutdown(Shutdown::Immediate).await.ok();
        ps.shutdown(Shutdown::Immediate).await.ok();

        // A certificate for rank 1 held by the worker that claims rank 0 gets nowhere.
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let start = |rank: usize, certified: u32, name: &'static str| {
            let t = quic(&ca, &rank_name(certified));
            let rdv = Rendezvous::from_store(store.clone(), rank, 2);
            let mut options = base_options();
            options.init_timeout = Duration::from_secs(5);
            async move { start_agent(t, rdv, name, rank, Some(2), options).await }
        };
        let (a, b) = tokio::join!(start(0, 1, "trainer"), start(1, 1, "ps"));
        let err = a.expect_err("rank 0 started with rank 1's certificate");
        assert!(err.to_string().contains("issued for rank 1"), "{err}");
        assert!(b.is_err(), "rank 1 set up without rank 0");
    })
    .await;
}
