//! The TCP store server and client over real sockets on 127.0.0.1.

use std::time::Duration;

use tensorwire_store::protocol::{self, Limits, Request};
use tensorwire_store::{
    ClientConfig, ClusterSecret, ServerConfig, Store, StoreError, TcpStoreClient, TcpStoreServer,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMIT: Duration = Duration::from_secs(10);

async fn server(config: ServerConfig) -> TcpStoreServer {
    TcpStoreServer::bind("127.0.0.1:0", config).await.unwrap()
}

fn client_config() -> ClientConfig {
    ClientConfig {
        timeout: LIMIT,
        connect_timeout: LIMIT,
        ..ClientConfig::default()
    }
}

async fn client(server: &TcpStoreServer) -> TcpStoreClient {
    TcpStoreClient::connect(&server.local_addr().to_string(), client_config())
        .await
        .unwrap()
}

/// A raw, validated connection for speaking the wire protocol by hand.
async fn raw(server: &TcpStoreServer) -> TcpStream {
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    let mut b = Vec::new();
    Request::Validate {
        magic: protocol::VALIDATION_MAGIC,
    }
    .encode(&mut b);
    s.write_all(&b).await.unwrap();
    s
}

async fn send(s: &mut TcpStream, r: Request) {
    let mut b = Vec::new();
    r.encode(&mut b);
    s.write_all(&b).await.unwrap();
}

/// Reads to EOF within the limit; the server closed the connection when this returns.
async fn expect_closed(s: &mut TcpStream) {
    let mut sink = Vec::new();
    tokio::time::timeout(LIMIT, s.read_to_end(&mut sink))
        .await
        .expect("the server should close the connection")
        .ok();
}

#[tokio::test]
async fn every_command_against_our_server() {
    let srv = server(ServerConfig::default()).await;
    let c = client(&srv).await;
    c.ping().await.unwrap();

    c.set("k", b"v").await.unwrap();
    assert_eq!(c.get("k").await.unwrap(), b"v");
    assert_eq!(c.add("n", 5).await.unwrap(), 5);
    assert_eq!(c.add("n", -2).await.unwrap(), 3);
    assert_eq!(
        c.get("n").await.unwrap(),
        b"3",
        "add stores a decimal string"
    );
    assert!(c.check(&["k", "n"]).await.unwrap());
    assert!(!c.check(&["k", "missing"]).await.unwrap());
    c.wait(&["k"], LIMIT).await.unwrap();

    // compare_set: missing key + non-empty expected leaves it alone and returns expected.
    assert_eq!(c.compare_set("cas", b"x", b"y").await.unwrap(), b"x");
    assert!(!c.check(&["cas"]).await.unwrap());
    assert_eq!(c.compare_set("cas", b"", b"first").await.unwrap(), b"first");
    assert_eq!(
        c.compare_set("cas", b"nope", b"second").await.unwrap(),
        b"first"
    );
    assert_eq!(
        c.compare_set("cas", b"first", b"second").await.unwrap(),
        b"second"
    );

    c.append("log", b"ab").await.unwrap();
    c.append("log", b"cd").await.unwrap();
    assert_eq!(c.get("log").await.unwrap(), b"abcd");

    c.multi_set(&["m1", "m2"], &[b"1", b"22"]).await.unwrap();
    assert_eq!(
        c.multi_get(&["m1", "m2", "k"]).await.unwrap(),
        vec![b"1".to_vec(), b"22".to_vec(), b"v".to_vec()]
    );

    assert_eq!(c.num_keys().await.unwrap(), 6);
    assert!(c.delete_key("k").await.unwrap());
    assert!(!c.delete_key("k").await.unwrap());
    assert_eq!(c.num_keys().await.unwrap(), 5);

    // Keys carry PyTorch's "/" prefix on the wire; the unprefixed view sees them so.
    let unprefixed = c.with_prefix("");
    assert_eq!(unprefixed.get("/n").await.unwrap(), b"3");
    srv.shutdown().await;
}

#[tokio::test]
async fn a_parked_wait_is_released_by_a_set_from_another_client() {
    let srv = server(ServerConfig::default()).await;
    let waiter = client(&srv).await;
    let setter = client(&srv).await;
    let mut probe = raw(&srv).await;

    let parked = tokio::spawn(async move { waiter.get("late").await });
    // Wait on the same key from a raw connection too, so we know the key is awaited before
    // setting it: its STOP_WAITING must only come after the set.
    send(
        &mut probe,
        Request::Wait {
            keys: vec![b"/late".to_vec()],
        },
    )
    .await;
    let mut byte = [0u8; 1];
    assert!(
        tokio::time::timeout(Duration::from_millis(100), probe.read_exact(&mut byte))
            .await
            .is_err(),
        "wait must not answer before the key exists"
    );
    setter.set("late", b"now").await.unwrap();
    tokio::time::timeout(LIMIT, probe.read_exact(&mut byte))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(byte[0], protocol::WAIT_STOP_WAITING);
    let got = tokio::time::timeout(LIMIT, parked).await.unwrap().unwrap();
    assert_eq!(got.unwrap(), b"now");
}

#[tokio::test]
async fn many_waiters_on_several_keys_all_released() {
    let srv = server(ServerConfig::default()).await;
    let setter = client(&srv).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let c = client(&srv).await;
        tasks.push(tokio::spawn(async move {
            c.wait(&["a", "b"], LIMIT).await?;
            c.multi_get(&["a", "b"]).await
        }));
    }
    setter.set("a", b"1").await.unwrap();
    setter.add("b", 7).await.unwrap();
    for t in tasks {
        let v = tokio::time::timeout(LIMIT, t)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(v, vec![b"1".to_vec(), b"7".to_vec()]);
    }
}

#[tokio::test]
async fn wait_times_out_naming_keys_and_the_connection_stays_usable() {
    let srv = server(ServerConfig::default()).await;
    let c = client(&srv).await;
    let err = c
        .wait(&["never", "nor-this"], Duration::from_millis(50))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        StoreError::Timeout {
            keys: vec!["never".into(), "nor-this".into()],
            timeout: Duration::from_millis(50)
        }
    );
    // CANCEL_WAIT resynchronised the stream.
    c.set("after", b"ok").await.unwrap();
    assert_eq!(c.get("after").await.unwrap(), b"ok");
    // And the cancelled wait does not fire later into the stream.
    c.set("never", b"x").await.unwrap();
    c.set("nor-this", b"y").await.unwrap();
    assert_eq!(c.add("z", 1).await.unwrap(), 1);
}

#[tokio::test]
async fn get_times_out_with_the_client_timeout() {
    let srv = server(ServerConfig::default()).await;
    let c = TcpStoreClient::connect(
        &srv.local_addr().to_string(),
        ClientConfig {
            timeout: Duration::from_millis(100),
            ..client_config()
        },
    )
    .await
    .unwrap();
    assert!(matches!(
        c.get("absent").await,
        Err(StoreError::Timeout { keys, .. }) if keys == vec!["absent".to_string()]
    ));
}

#[tokio::test]
async fn cancel_after_the_keys_arrived_answers_stop_waiting_then_canceled() {
    let srv = server(ServerConfig::default()).await;
    let mut s = raw(&srv).await;
    let setter = client(&srv).await;
    send(
        &mut s,
        Request::Wait {
            keys: vec![b"/k".to_vec()],
        },
    )
    .await;
    // Round-trip something on the same connection so the wait is surely parked.
    send(&mut s, Request::Ping { nonce: 1 }).await;
    let mut echo = [0u8; 4];
    s.read_exact(&mut echo).await.unwrap();
    setter.set("k", b"v").await.unwrap();
    send(&mut s, Request::CancelWait).await;
    let mut two = [0u8; 2];
    tokio::time::timeout(LIMIT, s.read_exact(&mut two))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(two, [protocol::WAIT_STOP_WAITING, protocol::WAIT_CANCELED]);
}

#[tokio::test]
async fn malformed_input_closes_only_that_connection() {
    let srv = server(ServerConfig::default()).await;
    let good = client(&srv).await;
    good.set("alive", b"1").await.unwrap();

    // Unknown query type.
    let mut bad = raw(&srv).await;
    bad.write_all(&[99]).await.unwrap();
    expect_closed(&mut bad).await;

    // No VALIDATE first.
    let mut bad = TcpStream::connect(srv.local_addr()).await.unwrap();
    send(&mut bad, Request::GetNumKeys).await;
    expect_closed(&mut bad).await;

    // Wrong magic number.
    let mut bad = TcpStream::connect(srv.local_addr()).await.unwrap();
    send(&mut bad, Request::Validate { magic: 1 }).await;
    expect_closed(&mut bad).await;

    // A length of 2^64-1.
    let mut bad = raw(&srv).await;
    let mut b = vec![3u8];
    b.extend_from_slice(&u64::MAX.to_ne_bytes());
    bad.write_all(&b).await.unwrap();
    expect_closed(&mut bad).await;

    // add on a non-integer closes (c10d has no error reply).
    let mut bad = raw(&srv).await;
    send(
        &mut bad,
        Request::Set {
            key: b"/text".to_vec(),
            value: b"abc".to_vec(),
        },
    )
    .await;
    send(
        &mut bad,
        Request::Add {
            key: b"/text".to_vec(),
            delta: 1,
        },
    )
    .await;
    expect_closed(&mut bad).await;

    // Our client asked for reasons: the server's refusal names the key and why.
    let other = client(&srv).await;
    let err = other.add("text", 1).await.unwrap_err();
    assert!(matches!(err, StoreError::Refused { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("add on key \"/text\" whose value \"abc\" is not a decimal integer"),
        "{err}"
    );

    // The server and the good connection keep going.
    assert_eq!(good.get("alive").await.unwrap(), b"1");
    assert_eq!(good.add("alive", 1).await.unwrap(), 2);
    client(&srv).await.ping().await.unwrap();
}

#[tokio::test]
async fn limits_give_typed_errors_on_the_client_and_close_on_the_server() {
    let limits = Limits {
        max_key_len: 16,
        max_value_len: 32,
        max_keys: 4,
        max_request_len: 1024,
    };
    let srv = server(ServerConfig {
        limits,
        ..ServerConfig::default()
    })
    .await;
    let c = TcpStoreClient::connect(
        &srv.local_addr().to_string(),
        ClientConfig {
            limits,
            ..client_config()
        },
    )
    .await
    .unwrap();
    assert!(matches!(
        c.set(&"k".repeat(20), b"v").await,
        Err(StoreError::KeyTooLarge {
            len: 20,
            max: 16,
            ..
        })
    ));
    assert!(matches!(
        c.set("k", &[0u8; 33]).await,
        Err(StoreError::ValueTooLarge {
            len: 33,
            max: 32,
            ..
        })
    ));
    assert!(matches!(
        c.check(&["a", "b", "c", "d", "e"]).await,
        Err(StoreError::TooManyKeys { count: 5, max: 4 })
    ));
    // Nothing was sent, so the connection is fine.
    c.set("k", &[0u8; 32]).await.unwrap();

    // A client with looser limits gets its connection closed by the server.
    let loose = client(&srv).await;
    let err = loose.set("k", &[0u8; 100]).await;
    // `set` has no reply, so the close shows on the next request.
    let next = loose.num_keys().await;
    assert!(
        err.is_err() || next.is_err(),
        "the server must drop the oversized request"
    );
    assert_eq!(c.num_keys().await.unwrap(), 1);
}

#[tokio::test]
async fn secret_authenticates_and_refuses_others() {
    let secret = ClusterSecret::new("s3cret").unwrap();
    let srv = server(ServerConfig {
        secret: Some(secret.clone()),
        ..ServerConfig::default()
    })
    .await;
    let addr = srv.local_addr().to_string();

    let ok = TcpStoreClient::connect(
        &addr,
        ClientConfig {
            secret: Some(secret),
            ..client_config()
        },
    )
    .await
    .unwrap();
    ok.set("k", b"v").await.unwrap();
    assert_eq!(ok.get("k").await.unwrap(), b"v");

    let wrong = TcpStoreClient::connect(
        &addr,
        ClientConfig {
            secret: Some(ClusterSecret::new("guess").unwrap()),
            ..client_config()
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(wrong, StoreError::Auth { .. }), "{wrong}");

    // No secret: refused at once (no retrying until the 10 s deadline), saying why.
    let started = std::time::Instant::now();
    let none = TcpStoreClient::connect(&addr, client_config())
        .await
        .unwrap_err();
    assert!(matches!(none, StoreError::Auth { .. }), "{none}");
    assert!(
        none.to_string().contains("requires a cluster secret"),
        "{none}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    // A raw c10d client gets the connection closed at its first query.
    let mut raw_client = TcpStream::connect(srv.local_addr()).await.unwrap();
    send(
        &mut raw_client,
        Request::Validate {
            magic: protocol::VALIDATION_MAGIC,
        },
    )
    .await;
    expect_closed(&mut raw_client).await;

    // The authenticated client was not disturbed.
    assert_eq!(ok.add("n", 1).await.unwrap(), 1);
}

#[tokio::test]
async fn a_client_with_a_secret_refuses_a_server_without_one() {
    let srv = server(ServerConfig::default()).await;
    let err = TcpStoreClient::connect(
        &srv.local_addr().to_string(),
        ClientConfig {
            secret: Some(ClusterSecret::new("x").unwrap()),
            ..client_config()
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, StoreError::Auth { .. }), "{err}");
    assert!(err.to_string().contains("no cluster secret"), "{err}");
}

#[tokio::test]
async fn connect_retries_until_the_server_appears() {
    // Reserve a port, free it, and start the server there a little later.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let connecting = tokio::spawn({
        let addr = addr.clone();
        async move { TcpStoreClient::connect(&addr, client_config()).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let srv = TcpStoreServer::bind(addr.as_str(), ServerConfig::default())
        .await
        .unwrap();
    let c = tokio::time::timeout(LIMIT, connecting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    c.set("k", b"v").await.unwrap();
    drop(srv);
}

/// An address that can never connect fails at once, whatever the connect timeout.
#[tokio::test]
async fn a_malformed_address_fails_at_once() {
    for addr in [
        "nohost",
        "host:port",
        ":29500",
        "::1:29500",
        "10.0.0.1:70000",
    ] {
        let config = ClientConfig {
            connect_timeout: Duration::from_secs(3600),
            ..client_config()
        };
        let err = tokio::time::timeout(
            Duration::from_secs(60),
            TcpStoreClient::connect(addr, config),
        )
        .await
        .unwrap_or_else(|_| panic!("{addr}: still retrying after 60 s"))
        .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("not a store address") && text.contains(addr),
            "{text}"
        );
    }
}

#[tokio::test]
async fn connect_gives_up_at_the_deadline_with_the_attempt_count() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = TcpStoreClient::connect(
        &format!("127.0.0.1:{port}"),
        ClientConfig {
            connect_timeout: Duration::from_millis(200),
            ..client_config()
        },
    )
    .await
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("gave up after") && text.contains("attempt"),
        "{text}"
    );
}

#[tokio::test]
async fn shutdown_closes_client_connections() {
    let srv = server(ServerConfig::default()).await;
    let c = client(&srv).await;
    let parked = tokio::spawn({
        let c = c.clone();
        async move { c.wait(&["never"], LIMIT).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    srv.shutdown().await;
    let result = tokio::time::timeout(LIMIT, parked).await.unwrap().unwrap();
    assert!(
        matches!(result, Err(StoreError::Connection { .. })),
        "{result:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_hammering_add_lose_nothing() {
    let srv = server(ServerConfig::default()).await;
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let c = client(&srv).await;
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..100 {
                seen.push(c.add("counter", 1).await.unwrap());
            }
            seen
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(tokio::time::timeout(LIMIT, t).await.unwrap().unwrap());
    }
    // Every add returned a distinct value: 1..=1600, each exactly once.
    all.sort_unstable();
    assert_eq!(all, (1..=1600).collect::<Vec<i64>>());
}

#[tokio::test]
async fn queues_and_list_keys_on_the_wire() {
    let srv = server(ServerConfig::default()).await;
    let mut s = raw(&srv).await;
    let q = || b"/q".to_vec();
    send(
        &mut s,
        Request::QueuePush {
            key: q(),
            value: b"a".to_vec(),
        },
    )
    .await;
    send(
        &mut s,
        Request::QueuePush {
            key: q(),
            value: b"bc".to_vec(),
        },
    )
    .await;
    send(
        &mut s,
        Request::Set {
            key: b"/k".to_vec(),
            value: b"v".to_vec(),
        },
    )
    .await;
    send(&mut s, Request::QueueLen { key: q() }).await;
    send(&mut s, Request::QueuePop { key: q() }).await;
    send(&mut s, Request::ListKeys).await;
    let mut expected = Vec::new();
    expected.extend_from_slice(&2i64.to_ne_bytes()); // QUEUE_LEN
    expected.extend_from_slice(&2i64.to_ne_bytes()); // QUEUE_POP: length before the pop,
    protocol::put_bytes(&mut expected, b"a"); //           then the item
    expected.extend_from_slice(&1u64.to_ne_bytes()); // LIST_KEYS: the queue is not a key
    protocol::put_bytes(&mut expected, b"/k");
    let mut got = vec![0u8; expected.len()];
    tokio::time::timeout(LIMIT, s.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, expected);
}

/// `n` clients, each on its own connection (a parked barrier holds its connection).
async fn clients(server: &TcpStoreServer, n: usize) -> Vec<TcpStoreClient> {
    let mut all = Vec::with_capacity(n);
    for _ in 0..n {
        all.push(client(server).await);
    }
    all
}

/// Every client arrives at `key` at once; all must be released.
async fn meet(all: &[TcpStoreClient], key: &'static str) {
    let arrivals: Vec<_> = all
        .iter()
        .map(|c| {
            let c = c.clone();
            let world_size = all.len() as i64;
            tokio::spawn(async move { c.barrier(key, world_size, LIMIT).await })
        })
        .collect();
    for arrival in arrivals {
        tokio::time::timeout(LIMIT, arrival)
            .await
            .expect("released")
            .unwrap()
            .unwrap();
    }
}

#[tokio::test]
async fn barrier_with_two_and_three_clients_counts_in_an_ordinary_key() {
    let srv = server(ServerConfig::default()).await;
    let three = clients(&srv, 3).await;
    meet(&three[..2], "two").await;
    meet(&three, "three").await;
    let c = &three[0];
    assert_eq!(c.get("two").await.unwrap(), b"2");
    assert_eq!(c.get("three").await.unwrap(), b"3");
    assert_eq!(c.num_keys().await.unwrap(), 2);
    // The count is never reset: a later arrival goes through at once and counts on.
    c.barrier("two", 2, LIMIT).await.unwrap();
    assert_eq!(c.get("two").await.unwrap(), b"3");
    // A world size of one or less needs nobody else.
    c.barrier("alone", 1, LIMIT).await.unwrap();
    c.barrier("nobody", 0, LIMIT).await.unwrap();
}

#[tokio::test]
async fn a_timed_out_arrival_names_its_key_has_counted_and_leaves_the_connection_usable() {
    let srv = server(ServerConfig::default()).await;
    let all = clients(&srv, 3).await;
    let err = all[0]
        .barrier("lonely", 3, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        StoreError::BarrierTimeout {
            key: "lonely".into(),
            world_size: 3,
            timeout: Duration::from_millis(100)
        }
    );
    assert!(
        err.to_string()
            .starts_with("barrier timeout after 100ms, key: \"lonely\""),
        "{err}"
    );
    // The cancelled arrival counted, and its connection is in step.
    assert_eq!(all[0].get("lonely").await.unwrap(), b"1");
    // So two more arrivals meet the barrier of three.
    meet(&all[1..], "lonely").await;
    assert_eq!(all[0].get("lonely").await.unwrap(), b"3");
}

#[tokio::test]
async fn a_barrier_met_while_its_arrival_cancels_answers_stop_waiting_then_canceled() {
    let srv = server(ServerConfig::default()).await;
    let mut s = raw(&srv).await;
    send(
        &mut s,
        Request::Barrier {
            key: b"/x".to_vec(),
            world_size: 2,
        },
    )
    .await;
    // Round-trip something on the same connection so the arrival is surely counted.
    send(&mut s, Request::Ping { nonce: 1 }).await;
    let mut echo = [0u8; 4];
    s.read_exact(&mut echo).await.unwrap();
    client(&srv).await.barrier("x", 2, LIMIT).await.unwrap();
    send(&mut s, Request::CancelWait).await;
    let mut two = [0u8; 2];
    tokio::time::timeout(LIMIT, s.read_exact(&mut two))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(two, [protocol::WAIT_STOP_WAITING, protocol::WAIT_CANCELED]);
}

#[tokio::test]
async fn a_count_that_is_no_integer_or_would_overflow_closes_and_stays_as_it_was() {
    let srv = server(ServerConfig::default()).await;
    let c = client(&srv).await;
    c.set("text", b"abc").await.unwrap();
    c.set("full", i64::MAX.to_string().as_bytes())
        .await
        .unwrap();
    for key in ["/text", "/full"] {
        let mut bad = raw(&srv).await;
        send(
            &mut bad,
            Request::Barrier {
                key: key.as_bytes().to_vec(),
                world_size: 2,
            },
        )
        .await;
        expect_closed(&mut bad).await;
    }
    // add past the i64 range: refused the same way (PyTorch's server wraps around).
    let mut bad = raw(&srv).await;
    send(
        &mut bad,
        Request::Add {
            key: b"/full".to_vec(),
            delta: 1,
        },
    )
    .await;
    expect_closed(&mut bad).await;
    assert_eq!(c.get("text").await.unwrap(), b"abc");
    assert_eq!(
        c.get("full").await.unwrap(),
        i64::MAX.to_string().as_bytes()
    );
    // Our client is told which key, and why the server closed.
    let err = client(&srv)
        .await
        .barrier("text", 2, LIMIT)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Refused { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("barrier on key \"/text\" whose value \"abc\" is not a decimal integer"),
        "{err}"
    );
}
