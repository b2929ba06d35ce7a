//! The store server survives its clients: one raw client per attack, each refused at the bound
//! it reaches, while an honest client in the same run is served and the server's own
//! accounting ([`TcpStoreServer::stats`]) stays within its budget.

use std::time::Duration;

use tensorwire_store::protocol::{self, Limits, Request};
use tensorwire_store::{ClientConfig, ServerConfig, Store, TcpStoreClient, TcpStoreServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MIB: usize = 1024 * 1024;

async fn server(config: ServerConfig) -> TcpStoreServer {
    TcpStoreServer::bind("127.0.0.1:0", config).await.unwrap()
}

/// A client with the default, long, timeouts: under a paused clock a short one could expire
/// while the server is idle.
async fn honest(server: &TcpStoreServer) -> TcpStoreClient {
    TcpStoreClient::connect(&server.local_addr().to_string(), ClientConfig::default())
        .await
        .unwrap()
}

/// set, get, add and wait by an honest client all succeed.
async fn honest_work(c: &TcpStoreClient, tag: &str) {
    let key = format!("honest/{tag}");
    c.set(&key, b"value").await.unwrap();
    assert_eq!(c.get(&key).await.unwrap(), b"value");
    let n = c.add("honest/count", 1).await.unwrap();
    assert!(n >= 1);
    c.wait(&[key.as_str()], Duration::from_secs(60))
        .await
        .unwrap();
}

fn encode(r: Request) -> Vec<u8> {
    let mut b = Vec::new();
    r.encode(&mut b);
    b
}

/// A raw, validated connection for speaking the wire protocol by hand. Our client prefixes
/// keys with `/`, so raw keys that it is to see start with one.
async fn raw(server: &TcpStoreServer) -> TcpStream {
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    s.write_all(&encode(Request::Validate {
        magic: protocol::VALIDATION_MAGIC,
    }))
    .await
    .unwrap();
    s
}

/// Reads to EOF (or a reset): the server closed the connection when this returns. Returns
/// how many bytes came before.
async fn until_closed(s: &mut TcpStream) -> usize {
    let mut sink = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut sink)).await;
    assert!(read.is_ok(), "the server should have closed the connection");
    sink.len()
}

/// Lets the server do all it can: under the paused clock, time moves on only once every task
/// waits, so when this returns the server is blocked (on a socket or a deadline).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(100)).await;
}

#[tokio::test]
async fn a_multi_get_of_many_big_values_is_refused_without_building_the_reply() {
    let config = ServerConfig {
        max_response_len: 16 * MIB,
        memory_budget: 32 * MIB,
        ..ServerConfig::default()
    };
    let srv = server(config).await;
    let c = honest(&srv).await;
    let big: Vec<u8> = (0..MIB).map(|i| i as u8).collect();
    for i in 0..4 {
        c.set(&format!("big/{i}"), &big).await.unwrap();
    }
    // SET has no reply: a request with one makes sure they are in before the attack.
    assert!(c
        .check(&["big/0", "big/1", "big/2", "big/3"])
        .await
        .unwrap());
    // 4,096 keys of 1 MiB: a 4 GiB reply, which the old server built whole and aborted on.
    let keys: Vec<Vec<u8>> = (0..4096)
        .map(|i| format!("/big/{}", i % 4).into_bytes())
        .collect();
    let mut attacker = raw(&srv).await;
    attacker
        .write_all(&encode(Request::MultiGet { keys }))
        .await
        .unwrap();
    assert_eq!(until_closed(&mut attacker).await, 0, "nothing was answered");

    // Within the bound, a MULTI_GET streams the shared values back intact.
    let got = c
        .multi_get(&["big/0", "big/1", "big/2", "big/3", "big/0"])
        .await
        .unwrap();
    assert_eq!(got.len(), 5);
    assert!(got.iter().all(|v| *v == big));
    honest_work(&c, "multi-get").await;
    let stats = srv.stats();
    assert!(stats.bytes_held <= 32 * MIB, "{stats:?}");
    assert!(stats.bytes_held >= 4 * MIB, "{stats:?}");
    assert_eq!(stats.bytes_queued, 0, "{stats:?}");
}

#[tokio::test]
async fn append_stops_at_the_value_bound_and_the_value_stays_readable() {
    let limits = Limits {
        max_value_len: MIB,
        ..Limits::default()
    };
    let srv = server(ServerConfig {
        limits,
        ..ServerConfig::default()
    })
    .await;
    let c = honest(&srv).await;
    let mut attacker = raw(&srv).await;
    let chunk = vec![7u8; 400 * 1024];
    for _ in 0..3 {
        attacker
            .write_all(&encode(Request::Append {
                key: b"/grown".to_vec(),
                value: chunk.clone(),
            }))
            .await
            .unwrap();
    }
    // APPEND has no reply: the third one, past 1 MiB, closes the connection.
    until_closed(&mut attacker).await;
    let value = c.get("grown").await.unwrap();
    assert_eq!(
        value.len(),
        800 * 1024,
        "the refused APPEND changed nothing"
    );
    assert!(value.iter().all(|b| *b == 7));
    // The honest connection is still in step after reading the value.
    honest_work(&c, "append").await;
    assert!(srv.stats().bytes_held <= 2 * MIB, "{:?}", srv.stats());
}

#[tokio::test]
async fn the_totals_of_keys_and_bytes_are_bounded() {
    let srv = server(ServerConfig {
        max_stored_keys: 100,
        memory_budget: MIB,
        ..ServerConfig::default()
    })
    .await;
    let c = honest(&srv).await;
    // The honest client's keys exist before the attack; afterwards it overwrites them.
    honest_work(&c, "totals").await;

    let mut attacker = raw(&srv).await;
    for i in 0..200 {
        attacker
            .write_all(&encode(Request::Set {
                key: format!("/flood/{i}").into_bytes(),
                value: vec![],
            }))
            .await
            .unwrap();
    }
    until_closed(&mut attacker).await;
    assert_eq!(srv.stats().keys_held, 100, "{:?}", srv.stats());
    assert_eq!(c.num_keys().await.unwrap(), 100);
    honest_work(&c, "totals").await;

    // Make room for keys, then run into the bytes.
    for i in 0..50 {
        assert!(c.delete_key(&format!("flood/{i}")).await.unwrap());
    }
    let mut attacker = raw(&srv).await;
    for i in 0..4 {
        attacker
            .write_all(&encode(Request::Set {
                key: format!("/heavy/{i}").into_bytes(),
                value: vec![1; 300 * 1024],
            }))
            .await
            .unwrap();
    }
    until_closed(&mut attacker).await;
    let stats = srv.stats();
    assert!(stats.memory_used <= MIB, "{stats:?}");
    // The attacker's requests waiting in its buffer count against the budget too, so two or
    // three values went in before one was refused.
    assert!(
        stats.bytes_held >= 600 * 1024,
        "values went in up to the budget: {stats:?}"
    );
    assert!(!c.check(&["heavy/3"]).await.unwrap());
    honest_work(&c, "totals").await;
}

#[tokio::test(start_paused = true)]
async fn a_client_that_does_not_read_is_paused_then_dropped() {
    let max_queued = 4 * MIB;
    let srv = server(ServerConfig {
        max_queued_bytes: max_queued,
        write_stall_timeout: Duration::from_secs(5),
        ..ServerConfig::default()
    })
    .await;
    let c = honest(&srv).await;
    c.set("big", &vec![3u8; MIB]).await.unwrap();
    // SET has no reply: a request with one makes sure it is in before the attack.
    assert_eq!(c.get("big").await.unwrap().len(), MIB);
    // 2,000 pipelined GETs of 1 MiB (about 24 KB sent), and never a read.
    let mut attacker = raw(&srv).await;
    let mut requests = Vec::new();
    for _ in 0..2000 {
        Request::Get {
            key: b"/big".to_vec(),
        }
        .encode(&mut requests);
    }
    attacker.write_all(&requests).await.unwrap();
    settle().await;
    // Others are served meanwhile, and the queue stays at the bound (plus one reply).
    honest_work(&c, "stalled").await;
    let stats = srv.stats();
    assert!(
        stats.bytes_queued >= max_queued && stats.bytes_queued <= max_queued + MIB + 8,
        "back-pressure: {stats:?}"
    );
    assert_eq!(stats.connections, 2);
    // The server drops it once it has read nothing for the stall timeout, not before (the
    // paused clock moves on whenever everything waits).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(srv.stats().connections, 2);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stats = srv.stats();
    assert_eq!((stats.connections, stats.bytes_queued), (1, 0), "{stats:?}");
    honest_work(&c, "stalled").await;
    drop(attacker);
}

#[tokio::test(start_paused = true)]
async fn idle_unauthenticated_connections_are_capped_and_closed_at_their_deadline() {
    let srv = server(ServerConfig {
        max_connections: 64,
        unauthenticated_idle_timeout: Duration::from_secs(10),
        handshake_timeout: Duration::from_secs(30),
        ..ServerConfig::default()
    })
    .await;
    let start = tokio::time::Instant::now();
    let mut idle = Vec::new();
    for _ in 0..100 {
        idle.push(TcpStream::connect(srv.local_addr()).await.unwrap());
    }
    // 64 are held, the other 36 closed at once.
    settle().await;
    assert_eq!(srv.stats().connections, 64);
    for s in &mut idle {
        until_closed(s).await;
    }
    assert!(
        start.elapsed() >= Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert!(
        start.elapsed() < Duration::from_secs(11),
        "{:?}",
        start.elapsed()
    );
    settle().await;
    assert_eq!(srv.stats().connections, 0);
    let c = honest(&srv).await;
    honest_work(&c, "idle").await;

    // A client that keeps talking without ever validating is closed at the handshake deadline.
    let mut chatty = TcpStream::connect(srv.local_addr()).await.unwrap();
    let start = tokio::time::Instant::now();
    let hello = encode(Request::AuthHello {
        nonce: [1; protocol::AUTH_LEN],
    });
    let closed = loop {
        if chatty.write_all(&hello).await.is_err() {
            break start.elapsed();
        }
        // A server without a secret answers each AUTH_HELLO with one status byte.
        let mut status = [0u8; 1];
        match chatty.read(&mut status).await {
            Ok(1) => {}
            _ => break start.elapsed(),
        }
        tokio::time::sleep(Duration::from_secs(4)).await;
    };
    assert!(closed >= Duration::from_secs(30), "{closed:?}");
    assert!(closed <= Duration::from_secs(35), "{closed:?}");
    honest_work(&c, "idle").await;
}

#[tokio::test(start_paused = true)]
async fn a_partial_request_is_held_only_within_the_request_bound() {
    let srv = server(ServerConfig::default()).await;
    let c = honest(&srv).await;
    let mut slow = raw(&srv).await;
    // A SET announcing an 8 MiB value, of which 1 MiB comes.
    let mut request = encode(Request::Set {
        key: b"/slow".to_vec(),
        value: vec![5; 8 * MIB],
    });
    request.truncate(request.len() - 7 * MIB);
    slow.write_all(&request).await.unwrap();
    settle().await;
    let stats = srv.stats();
    assert!(
        stats.bytes_buffered >= MIB && stats.bytes_buffered <= 2 * MIB,
        "{stats:?}"
    );
    honest_work(&c, "partial").await;
    // A request announcing more than the bounds allow is refused from its header.
    let mut greedy = raw(&srv).await;
    greedy
        .write_all(&[protocol::QueryType::MultiSet as u8])
        .await
        .unwrap();
    greedy
        .write_all(&(u64::MAX / 2).to_ne_bytes())
        .await
        .unwrap();
    until_closed(&mut greedy).await;
    drop(slow);
    settle().await;
    let stats = srv.stats();
    assert_eq!(
        (stats.bytes_buffered, stats.connections),
        (0, 1),
        "{stats:?}"
    );
    assert!(!c.check(&["slow"]).await.unwrap());
}

/// A raw client that asks for reasons (CHECK of the reserved key right after validation) gets
/// tagged replies and, when a request reaches a bound, a refusal naming it before the close.
#[tokio::test]
async fn a_client_that_asked_is_told_which_bound_its_request_reached() {
    let limits = Limits {
        max_value_len: 1024,
        ..Limits::default()
    };
    let srv = server(ServerConfig {
        limits,
        ..ServerConfig::default()
    })
    .await;
    let c = honest(&srv).await;
    let mut s = raw(&srv).await;
    s.write_all(&encode(Request::Check {
        keys: vec![protocol::CLOSING_REASONS_KEY.to_vec()],
    }))
    .await
    .unwrap();
    assert_eq!(s.read_u8().await.unwrap(), protocol::CHECK_READY);
    // From now on every reply starts with its status.
    s.write_all(&encode(Request::Get {
        key: b"/missing".to_vec(),
    }))
    .await
    .unwrap();
    let mut reply = [0u8; 9];
    s.read_exact(&mut reply).await.unwrap();
    assert_eq!(reply[0], protocol::REPLY_OK);
    assert_eq!(reply[1..], 0u64.to_ne_bytes());
    // A SET past the value bound (SET has no reply: the refusal stands in for the next one).
    s.write_all(&encode(Request::Set {
        key: b"/big".to_vec(),
        value: vec![1; 2048],
    }))
    .await
    .unwrap();
    assert_eq!(s.read_u8().await.unwrap(), protocol::REPLY_REFUSED);
    let bound = read_string(&mut s).await;
    let reason = read_string(&mut s).await;
    assert_eq!(bound, "limits.max_value_len");
    assert!(
        reason.contains("2048") && reason.contains("1024"),
        "{reason}"
    );
    assert_eq!(
        until_closed(&mut s).await,
        0,
        "the refusal is the last word"
    );
    // The reserved key was never stored, and others are served on.
    assert_eq!(c.num_keys().await.unwrap(), 0);
    honest_work(&c, "reasons").await;
}

async fn read_string(s: &mut TcpStream) -> String {
    let mut len = [0u8; 8];
    s.read_exact(&mut len).await.unwrap();
    let len = u64::from_ne_bytes(len) as usize;
    let mut b = vec![0u8; len];
    s.read_exact(&mut b).await.unwrap();
    String::from_utf8(b).unwrap()
}

/// tensorwire's client asks for reasons: a SET past the memory budget is reported by its next
/// request as `StoreError::Refused` naming `memory_budget`; PyTorch's client (like the raw
/// clients of the tests above) only sees the connection close.
#[tokio::test]
async fn our_client_gets_an_error_naming_the_bound() {
    let srv = server(ServerConfig {
        memory_budget: MIB,
        ..ServerConfig::default()
    })
    .await;
    let c = honest(&srv).await;
    let other = honest(&srv).await;
    let value = vec![1u8; 400 * 1024];
    c.set("a", &value).await.unwrap();
    c.set("b", &value).await.unwrap();
    assert!(c.check(&["a", "b"]).await.unwrap());
    c.set("c", &value).await.unwrap();
    let err = c.get("a").await.unwrap_err();
    match &err {
        tensorwire_store::StoreError::Refused { bound, reason, .. } => {
            assert_eq!(bound, "memory_budget");
            assert!(reason.contains("--memory-budget"), "{reason}");
        }
        other => panic!("expected a refusal naming the bound, got {other}"),
    }
    assert!(err.to_string().contains("memory_budget"), "{err}");
    honest_work(&other, "refused").await;
    assert!(!other.check(&["c"]).await.unwrap());
    let stats = srv.stats();
    assert!(stats.memory_used <= MIB, "{stats:?}");
}

/// A connection past `max_connections` is told so where the PING echo would be; our client
/// retries and, at its deadline, names the bound. (Real clock: under a paused one the
/// connect deadline could pass while the kernel completes a connect.)
#[tokio::test]
async fn a_client_past_the_connection_bound_is_told_the_bound() {
    let srv = server(ServerConfig {
        max_connections: 1,
        ..ServerConfig::default()
    })
    .await;
    let c = honest(&srv).await;
    let config = ClientConfig {
        connect_timeout: Duration::from_millis(300),
        ..ClientConfig::default()
    };
    let err = TcpStoreClient::connect(&srv.local_addr().to_string(), config)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("max_connections"), "{err}");
    honest_work(&c, "full").await;
    let mut s = TcpStream::connect(srv.local_addr()).await.unwrap();
    let mut marker = [0u8; 4];
    s.read_exact(&mut marker).await.unwrap();
    assert_eq!(
        u32::from_ne_bytes(marker),
        protocol::CONNECTIONS_FULL_MARKER
    );
    assert_eq!(until_closed(&mut s).await, 0);
}

/// One memory budget for everything the server holds: keys and values, values still being
/// written to a client after they left the table, request bytes buffered and reply copies.
/// Under a client that does not read, a delete of what it is being sent, a greedy writer and a
/// request too large for what is left, the server's accounting stays within the budget and an
/// honest client is served throughout.
#[tokio::test(start_paused = true)]
async fn one_memory_budget_counts_connections_and_holds_under_attack() {
    let budget = 4 * MIB;
    let srv = server(ServerConfig {
        memory_budget: budget,
        max_queued_bytes: 2 * MIB,
        ..ServerConfig::default()
    })
    .await;
    let within = |srv: &TcpStoreServer| {
        let stats = srv.stats();
        assert!(stats.memory_used <= budget, "{stats:?}");
        stats
    };
    let c = honest(&srv).await;
    c.set("big", &vec![3u8; MIB]).await.unwrap();
    assert_eq!(c.get("big").await.unwrap().len(), MIB);

    // A client that does not read: its replies share the stored value, so they queue up to
    // its bound without counting twice.
    let mut reader = raw(&srv).await;
    let mut requests = Vec::new();
    for _ in 0..200 {
        Request::Get {
            key: b"/big".to_vec(),
        }
        .encode(&mut requests);
    }
    reader.write_all(&requests).await.unwrap();
    settle().await;
    let stats = within(&srv);
    assert!(stats.bytes_queued >= 2 * MIB, "{stats:?}");
    assert!(stats.memory_used < 2 * MIB, "{stats:?}");
    honest_work(&c, "memory").await;

    // Deleting the value while it is being sent leaves it in memory, and counted.
    assert!(c.delete_key("big").await.unwrap());
    let stats = within(&srv);
    assert!(stats.bytes_held >= MIB, "{stats:?}");

    // A writer fills what is left: a refusal naming the budget, never past it.
    let writer = honest(&srv).await;
    let mut refused = None;
    for i in 0..4 {
        if let Err(e) = writer.set(&format!("fill/{i}"), &vec![1u8; MIB]).await {
            refused = Some(e);
            break;
        }
        within(&srv);
    }
    let refused = match refused {
        Some(e) => e,
        None => writer.get("fill/0").await.unwrap_err(),
    };
    assert!(
        matches!(&refused, tensorwire_store::StoreError::Refused { bound, .. } if bound == "memory_budget"),
        "{refused}"
    );
    within(&srv);
    honest_work(&c, "memory").await;

    // A request larger than the room left is refused once its bytes reach the budget.
    let mut greedy = raw(&srv).await;
    let mut big_set = encode(Request::Set {
        key: b"/greedy".to_vec(),
        value: vec![5; 3 * MIB],
    });
    big_set.truncate(2 * MIB);
    let _ = greedy.write_all(&big_set).await;
    until_closed(&mut greedy).await;
    within(&srv);
    honest_work(&c, "memory").await;

    // The reader goes: its replies and the deleted value they shared are freed.
    let before = within(&srv).memory_used;
    drop(reader);
    settle().await;
    let after = within(&srv).memory_used;
    assert!(after + MIB <= before, "{before} -> {after}");
    writer_free(&srv).await;
}

/// With the memory freed, a fresh client stores a value again.
async fn writer_free(srv: &TcpStoreServer) {
    let w = honest(srv).await;
    w.set("again", &vec![2u8; MIB]).await.unwrap();
    assert_eq!(w.get("again").await.unwrap().len(), MIB);
}
