//! Fuzzes the TCP store client's reading of a server's replies (`TcpStoreClient`, the code
//! every rank runs against the rendezvous store): a fake server on a loopback socket answers
//! the client's connection handshake honestly (the ping's echo, tagged or not as the input
//! says), then sends the input's bytes as its replies to whatever the client asks, and closes.
//!
//! Input: `[flags][op][op][op][op][reply bytes...]`: flags bit 0 picks a tagged server (one
//! that sends a status byte before each reply and names its refusals) or a plain c10d one;
//! each op byte picks a request (set, get, add, check, wait, compare_set, delete_key,
//! num_keys, append, multi_get, multi_set, barrier). Checks, for every request:
//! - it ends with a value or a typed `StoreError` with a message (the server closes after
//!   its bytes, so nothing waits: a hang is a finding), never a panic;
//! - a value read is within the client's limits and was sent by the server (it occurs in the
//!   reply bytes); `multi_get` gives one value per key.
//!
//! Run under AddressSanitizer with libFuzzer's memory limit: a reply that made the client
//! allocate what the server merely announced would be a finding too.
#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tensorwire_store::protocol::{Limits, CHECK_NOT_READY, CHECK_READY};
use tensorwire_store::{ClientConfig, Store, StoreError, TcpStoreClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;

const LIMITS: Limits = Limits {
    max_key_len: 64,
    max_value_len: 4096,
    max_keys: 8,
    max_request_len: 1 << 16,
};

struct Fixture {
    rt: Runtime,
    listener: TcpListener,
    addr: String,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let listener = rt
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .expect("a loopback listener");
        let addr = listener.local_addr().expect("its address").to_string();
        Fixture { rt, listener, addr }
    })
}

fn occurs(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

fn check_error(e: &StoreError) {
    assert!(
        !e.to_string().is_empty(),
        "an error without a message: {e:?}"
    );
}

async fn run_op(client: &TcpStoreClient, op: u8, reply: &[u8]) {
    let t = Duration::from_secs(5);
    let value = |r: Result<Vec<u8>, StoreError>| match r {
        Ok(v) => {
            assert!(v.len() <= LIMITS.max_value_len, "a value over the limit");
            assert!(occurs(reply, &v), "a value the server never sent: {v:?}");
        }
        Err(e) => check_error(&e),
    };
    let unit = |r: Result<(), StoreError>| {
        if let Err(e) = r {
            check_error(&e);
        }
    };
    match op % 12 {
        0 => unit(client.set("k", b"v").await),
        1 => value(client.get("k").await),
        2 => {
            if let Err(e) = client.add("k", 3).await {
                check_error(&e);
            }
        }
        3 => {
            if let Err(e) = client.check(&["a", "b"]).await {
                check_error(&e);
            }
        }
        4 => unit(client.wait(&["a"], t).await),
        5 => value(client.compare_set("k", b"old", b"new").await),
        6 => {
            if let Err(e) = client.delete_key("k").await {
                check_error(&e);
            }
        }
        7 => {
            if let Err(e) = client.num_keys().await {
                check_error(&e);
            }
        }
        8 => unit(client.append("k", b"more").await),
        9 => match client.multi_get(&["a", "b", "c"]).await {
            Ok(values) => {
                assert_eq!(values.len(), 3, "multi_get of 3 keys");
                for v in values {
                    value(Ok(v));
                }
            }
            Err(e) => check_error(&e),
        },
        10 => unit(client.multi_set(&["a", "b"], &[b"1", b"2"]).await),
        _ => unit(client.barrier("b", 2, t).await),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let (ops, reply) = rest.split_at(rest.len().min(4));
    let f = fixture();
    f.rt.block_on(async {
        let reply = reply.to_vec();
        let tagged = flags & 1 != 0;
        let server = {
            let reply = reply.clone();
            async move {
                let (mut s, _) = f.listener.accept().await.expect("accept");
                // The honest handshake: the ping's echo (the client's nonce is its process
                // id), then the answer to its CHECK of the reserved key.
                let mut hello = std::process::id().to_ne_bytes().to_vec();
                hello.push(if tagged { CHECK_READY } else { CHECK_NOT_READY });
                hello.extend_from_slice(&reply);
                let _ = s.write_all(&hello).await;
                let _ = s.shutdown().await;
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await;
            }
        };
        let server = tokio::spawn(server);
        let config = ClientConfig {
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            limits: LIMITS,
            ..ClientConfig::default()
        };
        let client = TcpStoreClient::connect(&f.addr, config)
            .await
            .expect("the honest handshake connects");
        for &op in ops {
            run_op(&client, op, &reply).await;
        }
        drop(client);
        server.await.expect("the server task");
    });
});
