//! Over QUIC with rank certificates (`rank-N`, issued by a CA whose key no worker holds, as
//! `tensorwire launch --quic-certs` does), a rank is its certificate's: an impostor holding
//! another rank's certificate cannot take a rank at setup, and cannot block the real rank's
//! setup either (core's `identity::check_rank_claim`, asked by the mesh of every hello and of
//! every connection it dials). Real loopback QUIC with mutual TLS.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::identity::rank_name;
use tensorwire_core::ports::process_group::{Collectives, ProcessGroupError};
use tensorwire_core::ports::store::Store;
use tensorwire_core::ports::transport::Transport;
use tensorwire_core::protocol::mesh::{GroupFrame, Hello};
use tensorwire_process_group::{Group, GroupOptions, InMemoryStore};
use tensorwire_transport_quic::certs::ClusterCa;
use tensorwire_transport_quic::{ClusterTls, QuicConfig, QuicTransport};

const RT: &dyn tensorwire_core::ports::runtime::Runtime = &tensorwire_mesh::TokioRuntime;
const TEST_BOUND: Duration = Duration::from_secs(60);

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("test took too long")
}

/// A QUIC transport presenting a certificate of `ca` issued for `name`.
fn quic(ca: &ClusterCa, name: &str) -> Arc<dyn Transport> {
    let tls = ClusterTls::new(
        ca.issue_node(name).expect("a node certificate"),
        vec![ca.cert_der().clone()],
    );
    Arc::new(QuicTransport::new(QuicConfig::new(tls)).expect("QUIC"))
}

/// Reads the address rank `rank` of group `name` published.
async fn published(store: &Arc<dyn Store>, name: &str, rank: usize) -> std::net::SocketAddr {
    let key = tensorwire_mesh::address_key(name, rank);
    store.wait(&[&key], TEST_BOUND).await.unwrap();
    String::from_utf8(store.get(&key).await.unwrap())
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impostor_with_another_ranks_certificate_is_refused_and_blocks_nobody() {
    bounded(async {
        // World 4: rank 3 accepts every other rank. The impostor holds rank 1's certificate
        // and dials rank 3 first, claiming rank 2. Under a shared secret this claim, coming
        // first, would have been taken (or, with the real one, failed the setup).
        const WORLD: usize = 4;
        let name = "certified-ranks";
        let ca = ClusterCa::generate().unwrap();
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let options = GroupOptions::new(name).with_timeout(Duration::from_secs(20));
        let start = |rank: usize| {
            let (store, transport, options) = (
                store.clone(),
                quic(&ca, &rank_name(rank as u32)),
                options.clone(),
            );
            tokio::spawn(
                async move { Group::connect(store, transport, rank, WORLD, options).await },
            )
        };
        let three = start(3);
        let addr = published(&store, name, 3).await;
        let hello = Hello {
            group: name.into(),
            rank: 2,
            world: Some(WORLD as u32),
            introduction: Vec::new(),
        };
        let impostor = tensorwire_mesh::link::dial(
            RT,
            &*quic(&ca, &rank_name(1)),
            addr,
            &hello,
            RT.deadline_after(TEST_BOUND),
        )
        .await
        .unwrap();
        // Rank 3 tells it why, naming the rank it claimed and the rank it is certified for,
        // and closes its link.
        let told = impostor.recv().await.unwrap();
        match GroupFrame::from_frame(&told).unwrap() {
            GroupFrame::Abort { rank: 3, reason } => assert!(
                reason.contains("claimed rank 2")
                    && reason.contains("issued for rank 1")
                    && reason.contains("refused the connection"),
                "{reason}"
            ),
            other => panic!("the impostor got {other:?}"),
        }
        assert!(impostor.recv().await.is_err());
        // The real ranks set up, rank 3 among them, and run a collective.
        let others: Vec<_> = (0..3).map(start).collect();
        let mut groups = vec![three.await.unwrap().expect("rank 3 set up")];
        for task in others {
            groups.push(task.await.unwrap().expect("an honest rank set up"));
        }
        let (a, b, c, d) = tokio::join!(
            groups[0].barrier(),
            groups[1].barrier(),
            groups[2].barrier(),
            groups[3].barrier()
        );
        for done in [a, b, c, d] {
            done.expect("a barrier among the real ranks");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_dialled_at_its_address_must_be_certified_for_it() {
    bounded(async {
        // The listener at rank 1's published address holds rank 2's certificate: rank 0,
        // dialling it as rank 1, refuses it with a typed error naming both ranks.
        let name = "certified-dial";
        let ca = ClusterCa::generate().unwrap();
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let listener = quic(&ca, &rank_name(2))
            .listen("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        store
            .set(
                &tensorwire_mesh::address_key(name, 1),
                listener.local_addr().to_string().as_bytes(),
            )
            .await
            .unwrap();
        let accepting = tokio::spawn(async move {
            let conn = listener.accept().await;
            (listener, conn)
        });
        let options = GroupOptions::new(name).with_timeout(Duration::from_secs(5));
        match Group::connect(store, quic(&ca, &rank_name(0)), 0, 2, options).await {
            Err(ProcessGroupError::RankNotCertified {
                rank: 0, source, ..
            }) => {
                assert_eq!((source.claimed, source.certified), (1, vec![2]));
            }
            Err(other) => panic!("rank 0 failed with {other}"),
            Ok(_) => panic!("rank 0 set up with an impostor as rank 1"),
        }
        drop(accepting.await.unwrap());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_whose_own_certificate_is_for_another_rank_fails_at_once() {
    bounded(async {
        let ca = ClusterCa::generate().unwrap();
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let options = GroupOptions::new("own-certificate").with_timeout(Duration::from_secs(5));
        let Err(err) = Group::connect(store, quic(&ca, &rank_name(2)), 1, 2, options).await else {
            panic!("rank 1 set up with rank 2's certificate");
        };
        let text = err.to_string();
        assert!(
            text.contains("claimed rank 1") && text.contains("issued for rank 2"),
            "{text}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_certificates_refuse_a_peer_certified_for_a_name_only() {
    bounded(async {
        // A certificate of the cluster CA for a worker name (no rank): among rank
        // certificates it cannot take a rank, since nothing tells it from an impostor.
        let name = "certified-names-only";
        let ca = ClusterCa::generate().unwrap();
        let store: Arc<dyn Store> = Arc::new(InMemoryStore::new());
        let one = quic(&ca, &rank_name(1));
        let options = GroupOptions::new(name).with_timeout(Duration::from_secs(20));
        let listening = {
            let (store, options) = (store.clone(), options.clone());
            tokio::spawn(async move { Group::connect(store, one, 1, 2, options).await })
        };
        let addr = published(&store, name, 1).await;
        let hello = Hello {
            group: name.into(),
            rank: 0,
            world: Some(2),
            introduction: Vec::new(),
        };
        let named = tensorwire_mesh::link::dial(
            RT,
            &*quic(&ca, "w0"),
            addr,
            &hello,
            RT.deadline_after(TEST_BOUND),
        )
        .await
        .unwrap();
        match GroupFrame::from_frame(&named.recv().await.unwrap()).unwrap() {
            GroupFrame::Abort { reason, .. } => {
                assert!(
                    reason.contains("names no rank") && reason.contains("w0"),
                    "{reason}"
                )
            }
            other => panic!("got {other:?}"),
        }
        // The real rank 0 still gets in.
        let zero = Group::connect(store, quic(&ca, &rank_name(0)), 0, 2, options)
            .await
            .expect("rank 0 set up");
        let one = listening.await.unwrap().expect("rank 1 set up");
        let (a, b) = tokio::join!(zero.barrier(), one.barrier());
        a.unwrap();
        b.unwrap();
    })
    .await;
}
