//! The QUIC transport over real UDP sockets on 127.0.0.1: mutual TLS, frames, order, close,
//! refusal of foreign certificates and of malformed streams.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use tensorwire_core::ports::transport::{Connection, Ended, Listener, Transport, TransportError};
use tensorwire_core::wire::{encode_to_vec, Frame, WireLimits};
use tensorwire_transport_quic::certs::ClusterCa;
use tensorwire_transport_quic::{ClusterTls, QuicConfig, QuicTransport, ADMIT};

const T: Duration = Duration::from_secs(20);

async fn within<F: std::future::Future>(what: &str, f: F) -> Result<F::Output> {
    tokio::time::timeout(T, f)
        .await
        .with_context(|| format!("timed out after {T:?} while {what}"))
}

/// Bounds a whole test, so that a wait not covered by [`within`] cannot hang it either.
async fn bounded(test: impl std::future::Future<Output = Result<()>>) -> Result<()> {
    tokio::time::timeout(Duration::from_secs(120), test)
        .await
        .context("the test did not finish within 120 s")?
}

fn node(ca: &ClusterCa, name: &str) -> Result<QuicConfig> {
    let tls = ClusterTls::new(ca.issue_node(name)?, vec![ca.cert_der().clone()]);
    let mut config = QuicConfig::new(tls);
    config.connect_timeout = Duration::from_secs(5);
    Ok(config)
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A connected pair: (client side, server side, listener).
async fn pair(
    ca: &ClusterCa,
) -> Result<(Box<dyn Connection>, Box<dyn Connection>, Box<dyn Listener>)> {
    let server = QuicTransport::new(node(ca, "server")?)?;
    let client = QuicTransport::new(node(ca, "client")?)?;
    let listener = server.listen(loopback()).await?;
    let addr = listener.local_addr();
    let (c, s) = within("connecting", async {
        tokio::join!(client.connect(addr), listener.accept())
    })
    .await?;
    Ok((c?, s?, listener))
}

fn frame_of(len: usize, seed: u8) -> Frame {
    let payload: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    Frame::message(Bytes::from(vec![seed; 3]), vec![Bytes::from(payload)])
}

#[tokio::test]
async fn frames_of_many_sizes_cross_both_ways_in_order() -> Result<()> {
    bounded(frames_of_many_sizes_cross_both_ways_in_order_body()).await
}

async fn frames_of_many_sizes_cross_both_ways_in_order_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let (c, s, _l) = pair(&ca).await?;
    let sizes = [0usize, 1, 100, 1200, 65_536, 1 << 20, 5 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        within("sending", c.send(frame_of(len, i as u8))).await??;
    }
    for (i, &len) in sizes.iter().enumerate() {
        let got = within("receiving", s.recv()).await??;
        assert_eq!(got, frame_of(len, i as u8), "frame {i} of {len} bytes");
    }
    // An empty frame (no header, no payload) and a frame of several payloads, the other way.
    let multi = Frame::control(
        Bytes::from_static(b"hdr"),
        vec![
            Bytes::from_static(b"a"),
            Bytes::new(),
            Bytes::from(vec![9u8; 70_000]),
        ],
    );
    within("sending", s.send(Frame::message(Bytes::new(), vec![]))).await??;
    within("sending", s.send(multi.clone())).await??;
    assert_eq!(
        within("receiving", c.recv()).await??,
        Frame::message(Bytes::new(), vec![])
    );
    assert_eq!(within("receiving", c.recv()).await??, multi);
    Ok(())
}

#[tokio::test]
async fn sequential_sends_keep_their_order() -> Result<()> {
    bounded(sequential_sends_keep_their_order_body()).await
}

async fn sequential_sends_keep_their_order_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let (c, s, _l) = pair(&ca).await?;
    let n = 300u32;
    let sender = async {
        for i in 0..n {
            // Mix sizes so streams finish out of order on the wire.
            let len = if i % 7 == 0 { 300_000 } else { 10 };
            c.send(Frame::message(
                Bytes::from(i.to_le_bytes().to_vec()),
                vec![Bytes::from(vec![1u8; len])],
            ))
            .await?;
        }
        anyhow::Ok(())
    };
    let receiver = async {
        for i in 0..n {
            let f = s.recv().await?;
            assert_eq!(f.header.as_ref(), i.to_le_bytes(), "frame {i} out of order");
        }
        anyhow::Ok(())
    };
    let (a, b) = within("exchanging", async { tokio::join!(sender, receiver) }).await?;
    a?;
    b?;
    Ok(())
}

#[tokio::test]
async fn a_thousand_concurrent_frames_arrive_exactly_once() -> Result<()> {
    bounded(a_thousand_concurrent_frames_arrive_exactly_once_body()).await
}

async fn a_thousand_concurrent_frames_arrive_exactly_once_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let (c, s, _l) = pair(&ca).await?;
    let c: Arc<dyn Connection> = Arc::from(c);
    let n = 1000u32;
    let mut sends = tokio::task::JoinSet::new();
    for i in 0..n {
        let c = c.clone();
        sends.spawn(async move {
            c.send(Frame::message(
                Bytes::from(i.to_le_bytes().to_vec()),
                vec![Bytes::from(vec![i as u8; 1000])],
            ))
            .await
        });
    }
    let mut seen = vec![false; n as usize];
    within("receiving 1000 frames", async {
        for _ in 0..n {
            let f = s.recv().await?;
            let i = u32::from_le_bytes(f.header.as_ref().try_into()?);
            assert!(!seen[i as usize], "frame {i} twice");
            assert_eq!(f.payloads[0].len(), 1000);
            seen[i as usize] = true;
        }
        anyhow::Ok(())
    })
    .await??;
    while let Some(r) = sends.join_next().await {
        r??;
    }
    assert!(seen.iter().all(|&x| x));
    Ok(())
}

#[tokio::test]
async fn close_delivers_everything_then_closed_and_the_other_way_still_works() -> Result<()> {
    bounded(close_delivers_everything_then_closed_and_the_other_way_still_works_body()).await
}

async fn close_delivers_everything_then_closed_and_the_other_way_still_works_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let (c, s, _l) = pair(&ca).await?;
    for i in 0..10u8 {
        c.send(frame_of(50_000, i)).await?;
    }
    within("closing", c.close()).await??;
    assert!(
        c.send(frame_of(1, 0)).await.is_err(),
        "send after close must fail"
    );
    for i in 0..10u8 {
        assert_eq!(within("receiving", s.recv()).await??, frame_of(50_000, i));
    }
    let end = within("receiving the close", s.recv()).await?;
    assert!(matches!(end, Err(TransportError::Closed { .. })), "{end:?}");
    let again = within("receiving again", s.recv()).await?;
    assert!(
        matches!(again, Err(TransportError::Closed { .. })),
        "{again:?}"
    );
    // The other direction is still open.
    within("sending back", s.send(frame_of(10, 7))).await??;
    assert_eq!(within("receiving back", c.recv()).await??, frame_of(10, 7));
    within("closing back", s.close()).await??;
    let end = within("receiving the close", c.recv()).await?;
    assert!(matches!(end, Err(TransportError::Closed { .. })), "{end:?}");
    Ok(())
}

#[tokio::test]
async fn a_dropped_connection_reads_as_closed_after_its_frames() -> Result<()> {
    bounded(a_dropped_connection_reads_as_closed_after_its_frames_body()).await
}

async fn a_dropped_connection_reads_as_closed_after_its_frames_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let (c, s, _l) = pair(&ca).await?;
    c.send(frame_of(1 << 20, 1)).await?;
    drop(c);
    assert_eq!(within("receiving", s.recv()).await??, frame_of(1 << 20, 1));
    let end = within("receiving the close", s.recv()).await?;
    assert!(matches!(end, Err(TransportError::Closed { .. })), "{end:?}");
    Ok(())
}

#[tokio::test]
async fn oversized_frames_are_refused_before_sending() -> Result<()> {
    bounded(oversized_frames_are_refused_before_sending_body()).await
}

async fn oversized_frames_are_refused_before_sending_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let mut config = node(&ca, "small")?;
    config.limits = WireLimits::default().with_max_frame_len(1000);
    let small = QuicTransport::new(config)?;
    let server = QuicTransport::new(node(&ca, "server")?)?;
    let listener = server.listen(loopback()).await?;
    let (c, _s) = within("connecting", async {
        tokio::join!(small.connect(listener.local_addr()), listener.accept())
    })
    .await?;
    let err = c?.send(frame_of(5000, 0)).await.unwrap_err();
    assert!(matches!(err, TransportError::Wire { .. }), "{err}");
    assert!(err.to_string().contains("exceeds the limit"), "{err}");
    Ok(())
}

#[tokio::test]
async fn a_client_with_a_foreign_certificate_is_refused_and_the_listener_goes_on() -> Result<()> {
    bounded(a_client_with_a_foreign_certificate_is_refused_and_the_listener_goes_on_body()).await
}

async fn a_client_with_a_foreign_certificate_is_refused_and_the_listener_goes_on_body() -> Result<()>
{
    let ca = ClusterCa::generate()?;
    let foreign = ClusterCa::generate()?;
    let server = QuicTransport::new(node(&ca, "server")?)?;
    let listener = server.listen(loopback()).await?;
    let addr = listener.local_addr();
    // The intruder trusts our CA (so it accepts the server) but its own certificate is foreign.
    let tls = ClusterTls::new(foreign.issue_node("intruder")?, vec![ca.cert_der().clone()]);
    let intruder = QuicTransport::new(QuicConfig::new(tls))?;
    let err = within("intruder connecting", intruder.connect(addr))
        .await?
        .err()
        .context("a foreign certificate must be refused")?;
    assert!(
        matches!(err, TransportError::Authentication { .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("refused our certificate") && msg.contains("cluster CA"),
        "{msg}"
    );
    // A member still gets in.
    let member = QuicTransport::new(node(&ca, "member")?)?;
    let (c, s) = within("member connecting", async {
        tokio::join!(member.connect(addr), listener.accept())
    })
    .await?;
    c?.send(frame_of(10, 3)).await?;
    assert_eq!(within("receiving", s?.recv()).await??, frame_of(10, 3));
    Ok(())
}

#[tokio::test]
async fn a_server_with_a_foreign_certificate_is_refused() -> Result<()> {
    bounded(a_server_with_a_foreign_certificate_is_refused_body()).await
}

async fn a_server_with_a_foreign_certificate_is_refused_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let foreign = ClusterCa::generate()?;
    let tls = ClusterTls::new(foreign.issue_node("impostor")?, vec![ca.cert_der().clone()]);
    let impostor = QuicTransport::new(QuicConfig::new(tls))?;
    let listener = impostor.listen(loopback()).await?;
    let client = QuicTransport::new(node(&ca, "client")?)?;
    let err = within("connecting", client.connect(listener.local_addr()))
        .await?
        .err()
        .context("a foreign server certificate must be refused")?;
    assert!(
        matches!(err, TransportError::Authentication { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("not signed by the cluster CA"),
        "{err}"
    );
    Ok(())
}

/// A client that speaks QUIC with a valid certificate but writes raw bytes on a stream.
///
/// The endpoint is returned too: dropping it would stop the connection from sending anything,
/// its close included.
async fn raw_client(
    ca: &ClusterCa,
    addr: SocketAddr,
) -> Result<(quinn::Endpoint, quinn::Connection)> {
    let tls = ClusterTls::new(ca.issue_node("raw")?, vec![ca.cert_der().clone()]);
    let mut endpoint = quinn::Endpoint::client(loopback())?;
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(tls.client_crypto()?)));
    let conn = endpoint.connect(addr, tls.server_name())?.await?;
    let mut admit = conn.accept_uni().await?;
    assert_eq!(admit.read_to_end(100).await?, ADMIT);
    Ok((endpoint, conn))
}

async fn raw_stream(conn: &quinn::Connection, bytes: &[u8], finish: bool) -> Result<()> {
    let mut s = conn.open_uni().await?;
    s.write_all(bytes).await?;
    if finish {
        s.finish()?;
    }
    // Keep the stream open (unfinished) when asked, by leaking it into a task that waits.
    std::mem::forget(s);
    Ok(())
}

/// Tag 0 (frame) and no ordering dependencies.
const FRAME_HEAD: [u8; 10] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

#[tokio::test]
async fn garbage_and_oversized_lengths_close_the_connection_not_the_process() -> Result<()> {
    bounded(garbage_and_oversized_lengths_close_the_connection_not_the_process_body()).await
}

async fn garbage_and_oversized_lengths_close_the_connection_not_the_process_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let server = QuicTransport::new(node(&ca, "server")?)?;
    let listener = server.listen(loopback()).await?;
    let addr = listener.local_addr();

    // Garbage where a frame should start.
    let (_ep, raw) = within("raw connect", raw_client(&ca, addr)).await??;
    let s = within("accepting", listener.accept()).await??;
    let mut garbage = FRAME_HEAD.to_vec();
    garbage.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n and more garbage");
    raw_stream(&raw, &garbage, true).await?;
    let err = within("receiving garbage", s.recv()).await?.unwrap_err();
    assert!(matches!(err, TransportError::Wire { .. }), "{err}");
    assert!(err.to_string().contains("magic"), "{err}");
    let closed = within("waiting for the close", raw.closed()).await?;
    assert!(closed.to_string().contains("magic"), "{closed}");

    // A valid prefix claiming a body far over the limit.
    let (_ep, raw) = within("raw connect", raw_client(&ca, addr)).await??;
    let s = within("accepting", listener.accept()).await??;
    let mut huge = encode_to_vec(&frame_of(10, 0), &WireLimits::default())?;
    huge[12..20].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    let mut bytes = FRAME_HEAD.to_vec();
    bytes.extend_from_slice(&huge[..20]);
    raw_stream(&raw, &bytes, false).await?;
    let err = within("receiving an oversized length", s.recv())
        .await?
        .unwrap_err();
    assert!(matches!(err, TransportError::Wire { .. }), "{err}");
    assert!(err.to_string().contains("exceeds the limit"), "{err}");

    // An unknown stream tag.
    let (_ep, raw) = within("raw connect", raw_client(&ca, addr)).await??;
    let s = within("accepting", listener.accept()).await??;
    raw_stream(&raw, &[77], true).await?;
    let err = within("receiving a bad tag", s.recv()).await?.unwrap_err();
    assert!(err.to_string().contains("stream tag 77"), "{err}");

    // The listener still serves members.
    let member = QuicTransport::new(node(&ca, "member")?)?;
    let (c, s) = within("member connecting", async {
        tokio::join!(member.connect(addr), listener.accept())
    })
    .await?;
    c?.send(frame_of(100, 1)).await?;
    assert_eq!(within("receiving", s?.recv()).await??, frame_of(100, 1));
    Ok(())
}

/// A peer that closes the connection with an error code of its own (not a clean close): the
/// receiver's `recv` and a later `send` say so as data, with the peer's code and words.
#[tokio::test]
async fn a_peer_closing_with_an_error_code_is_told_as_data() -> Result<()> {
    bounded(a_peer_closing_with_an_error_code_is_told_as_data_body()).await
}

async fn a_peer_closing_with_an_error_code_is_told_as_data_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let server = QuicTransport::new(node(&ca, "server")?)?;
    let listener = server.listen(loopback()).await?;
    let (_ep, raw) = within("raw connect", raw_client(&ca, listener.local_addr())).await??;
    let s = within("accepting", listener.accept()).await??;
    raw.close(42u32.into(), b"shutting down for maintenance");
    let expected = Ended::ClosedByPeer {
        code: 42,
        reason: "shutting down for maintenance".into(),
    };
    match within("receiving", s.recv()).await? {
        Err(TransportError::Ended { op, how, .. }) => {
            assert_eq!((op, &how), ("receiving", &expected));
        }
        other => panic!("expected the peer's close as data, got {other:?}"),
    }
    let err = within("sending after", s.send(frame_of(10, 0)))
        .await?
        .unwrap_err();
    match &err {
        TransportError::Ended { op, how, .. } => assert_eq!((*op, how), ("sending", &expected)),
        other => panic!("expected the peer's close as data, got {other}"),
    }
    Ok(())
}

#[tokio::test]
async fn a_peer_that_goes_away_mid_frame_gives_closed_mid_frame() -> Result<()> {
    bounded(a_peer_that_goes_away_mid_frame_gives_closed_mid_frame_body()).await
}

async fn a_peer_that_goes_away_mid_frame_gives_closed_mid_frame_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let server = QuicTransport::new(node(&ca, "server")?)?;
    let listener = server.listen(loopback()).await?;
    let (_ep, raw) = within("raw connect", raw_client(&ca, listener.local_addr())).await??;
    let s = within("accepting", listener.accept()).await??;
    let whole = encode_to_vec(&frame_of(100_000, 5), &WireLimits::default())?;
    let mut bytes = FRAME_HEAD.to_vec();
    bytes.extend_from_slice(&whole[..whole.len() / 2]);
    raw_stream(&raw, &bytes, false).await?;
    // A whole frame after it: once it is delivered, the half frame sent before it has landed.
    let mut next = FRAME_HEAD.to_vec();
    next.extend_from_slice(&encode_to_vec(&frame_of(10, 6), &WireLimits::default())?);
    raw_stream(&raw, &next, true).await?;
    assert_eq!(within("receiving", s.recv()).await??, frame_of(10, 6));
    raw.close(0u32.into(), b"bye");
    let err = within("receiving", s.recv()).await?.unwrap_err();
    assert!(
        matches!(err, TransportError::ClosedMidFrame { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("truncated"), "{err}");
    Ok(())
}

#[tokio::test]
async fn a_stream_that_ends_mid_frame_gives_closed_mid_frame() -> Result<()> {
    bounded(a_stream_that_ends_mid_frame_gives_closed_mid_frame_body()).await
}

async fn a_stream_that_ends_mid_frame_gives_closed_mid_frame_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let server = QuicTransport::new(node(&ca, "server")?)?;
    let listener = server.listen(loopback()).await?;
    let (_ep, raw) = within("raw connect", raw_client(&ca, listener.local_addr())).await??;
    let s = within("accepting", listener.accept()).await??;
    let whole = encode_to_vec(&frame_of(100_000, 5), &WireLimits::default())?;
    let mut bytes = FRAME_HEAD.to_vec();
    bytes.extend_from_slice(&whole[..whole.len() - 1]);
    raw_stream(&raw, &bytes, true).await?;
    let err = within("receiving", s.recv()).await?.unwrap_err();
    assert!(
        matches!(err, TransportError::ClosedMidFrame { .. }),
        "{err}"
    );
    Ok(())
}

#[tokio::test]
async fn certificates_from_pem_files_work_across_transports() -> Result<()> {
    bounded(certificates_from_pem_files_work_across_transports_body()).await
}

async fn certificates_from_pem_files_work_across_transports_body() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("tw-quic-pem-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let ca = ClusterCa::load_or_generate(&dir)?;
    let mut configs = Vec::new();
    for name in ["a", "b"] {
        let (cert, key) = ca.issue_node(name)?.write_pem_files(&dir, name)?;
        let tls = ClusterTls::from_pem_files(&dir.join("ca.pem"), &cert, &key)?;
        configs.push(QuicConfig::new(tls));
    }
    let b = QuicTransport::new(configs.pop().unwrap())?;
    let a = QuicTransport::new(configs.pop().unwrap())?;
    let listener = b.listen(loopback()).await?;
    let (c, s) = within("connecting", async {
        tokio::join!(a.connect(listener.local_addr()), listener.accept())
    })
    .await?;
    c?.send(frame_of(10, 9)).await?;
    assert_eq!(within("receiving", s?.recv()).await??, frame_of(10, 9));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Both directions busy at once, with frames of several packets (this once stalled with an
/// MTU bound above 1452 bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_directions_at_once_keep_their_order() -> Result<()> {
    bounded(both_directions_at_once_keep_their_order_body()).await
}

async fn both_directions_at_once_keep_their_order_body() -> Result<()> {
    both_directions(60_000).await
}

/// The same with the tuning for remote peers (1452-byte datagrams batched with GSO), which
/// loopback peers do not otherwise get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_tuning_works_too() -> Result<()> {
    bounded(remote_tuning_works_too_body()).await
}

async fn remote_tuning_works_too_body() -> Result<()> {
    both_directions(0).await
}

async fn both_directions(loopback_mtu: u16) -> Result<()> {
    let ca = ClusterCa::generate()?;
    let mut configs = Vec::new();
    for name in ["server", "client"] {
        let mut config = node(&ca, name)?;
        config.loopback_mtu = loopback_mtu;
        configs.push(QuicTransport::new(config)?);
    }
    let listener = configs[0].listen(loopback()).await?;
    let (c, s) = within("connecting", async {
        tokio::join!(configs[1].connect(listener.local_addr()), listener.accept())
    })
    .await?;
    let (c, s) = (c?, s?);
    let c: Arc<dyn Connection> = Arc::from(c);
    let s: Arc<dyn Connection> = Arc::from(s);
    let n = 300u32;
    let mut tasks = tokio::task::JoinSet::new();
    for (dir, from, to) in [("up", c.clone(), s.clone()), ("down", s, c)] {
        tasks.spawn(async move {
            let sender = tokio::spawn(async move {
                for i in 0..n {
                    let len = (i as usize % 7) * 1000 + if i % 50 == 0 { 1 << 20 } else { 0 };
                    from.send(Frame::message(
                        Bytes::from(i.to_le_bytes().to_vec()),
                        vec![Bytes::from(vec![1u8; len])],
                    ))
                    .await?;
                }
                anyhow::Ok(())
            });
            for i in 0..n {
                let f = within(&format!("{dir} receiving {i}"), to.recv()).await??;
                assert_eq!(
                    f.header.as_ref(),
                    i.to_le_bytes(),
                    "{dir}: frame {i} out of order"
                );
            }
            sender.await??;
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

/// Every rustls configuration gets the ring provider explicitly: a whole exchange leaves the
/// process-wide default provider unset.
#[tokio::test]
async fn no_process_default_crypto_provider_is_needed() -> Result<()> {
    bounded(no_process_default_crypto_provider_is_needed_body()).await
}

async fn no_process_default_crypto_provider_is_needed_body() -> Result<()> {
    let ca = ClusterCa::generate()?;
    let (c, s, _l) = pair(&ca).await?;
    c.send(frame_of(10, 1)).await?;
    assert_eq!(within("receiving", s.recv()).await??, frame_of(10, 1));
    assert!(
        rustls::crypto::CryptoProvider::get_default().is_none(),
        "a process-wide crypto provider was installed"
    );
    Ok(())
}

/// Listening on an address that is taken is an I/O error naming it.
#[tokio::test]
async fn listening_on_a_taken_address_is_an_io_error() -> Result<()> {
    bounded(async {
        let ca = ClusterCa::generate()?;
        let first = QuicTransport::new(node(&ca, "a")?)?;
        let second = QuicTransport::new(node(&ca, "b")?)?;
        let listener = first.listen(loopback()).await?;
        let addr = listener.local_addr();
        let err = second
            .listen(addr)
            .await
            .err()
            .context("the port is taken")?;
        assert!(matches!(err, TransportError::Io { .. }), "{err}");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        Ok(())
    })
    .await
}

/// A peer that sends more than the receiver will hold of frames not yet taken by `recv`:
/// the receiver hands up what came before the bound, then fails naming it (before, only the
/// count of such frames was bounded, 4,096 frames of up to 1 GiB each).
#[tokio::test]
async fn frames_pending_beyond_the_byte_bound_fail_the_connection() -> Result<()> {
    bounded(async {
        let ca = ClusterCa::generate()?;
        let mut config = node(&ca, "server")?;
        config.max_pending_bytes = 2 << 20;
        let server = QuicTransport::new(config)?;
        let client = QuicTransport::new(node(&ca, "client")?)?;
        let listener = server.listen(loopback()).await?;
        let addr = listener.local_addr();
        let (c, s) = within("connecting", async {
            tokio::join!(client.connect(addr), listener.accept())
        })
        .await?;
        let (c, s) = (c?, s?);
        // Nobody receives while the sender sends four frames of 1 MiB.
        for seed in 0..4u8 {
            if c.send(frame_of(1 << 20, seed)).await.is_err() {
                break;
            }
        }
        let mut taken = 0;
        let err = loop {
            match within("receiving", s.recv()).await? {
                Ok(frame) => {
                    anyhow::ensure!(frame.header[..] == [taken; 3], "frame {taken} garbled");
                    taken += 1;
                }
                Err(e) => break e,
            }
        };
        anyhow::ensure!(
            matches!(err, TransportError::PendingBytes { limit, .. } if limit == 2 << 20),
            "{err}"
        );
        anyhow::ensure!(taken < 4, "all {taken} frames were held");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn each_side_can_check_the_name_the_other_is_certified_for() -> Result<()> {
    bounded(async {
        let ca = ClusterCa::generate()?;
        let (client_side, server_side, _listener) = pair(&ca).await?;
        // The client's connection leads to the node certified as "server", and back.
        client_side.check_peer_name("server")?;
        server_side.check_peer_name("client")?;
        let err = client_side.check_peer_name("client").unwrap_err();
        assert_eq!(err.name, "client");
        assert!(err.reason.contains("server"), "{err}");
        assert_eq!(err.peer, client_side.peer_addr());
        Ok(())
    })
    .await
}
