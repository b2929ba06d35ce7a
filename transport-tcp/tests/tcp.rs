//! TCP-specific behaviour beyond the conformance suite (which lives in `tensorwire-tests`):
//! logs of refused peers, where the secret comes from, and mismatched security settings.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, ensure, Result};
use bytes::Bytes;
use tensorwire_core::ports::transport::{Transport, TransportError};
use tensorwire_core::wire::{Frame, WireError, WireLimits};
use tensorwire_transport_tcp::{ClusterSecret, TcpConfig, TcpTransport, SECRET_ENV};

const T: Duration = Duration::from_secs(20);

fn localhost() -> std::net::SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn within<F: std::future::Future>(fut: F) -> Result<F::Output> {
    tokio::time::timeout(T, fut)
        .await
        .map_err(|_| anyhow!("timed out after {T:?}"))
}

fn with_secret(s: &str) -> TcpTransport {
    TcpTransport::new(TcpConfig::new(ClusterSecret::new(s).unwrap())).unwrap()
}

/// Captured log output; wakes waiters on every write.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>, Arc<tokio::sync::Notify>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        self.1.notify_waiters();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Waits until the logs contain `needle`.
    async fn wait_for(&self, needle: &str) -> Result<()> {
        within(async {
            loop {
                let written = self.1.notified();
                if self.text().contains(needle) {
                    return;
                }
                written.await;
            }
        })
        .await
        .map_err(|e| anyhow!("{e} waiting for {needle:?} in the logs: {}", self.text()))
    }
}

/// A wrong secret: the connecting side hears that authentication failed, the accepting side
/// logs the peer's address; an insecure transport logs a warning.
#[tokio::test(flavor = "current_thread")]
async fn wrong_secret_is_logged_with_the_peer_address() -> Result<()> {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let listener = with_secret("right").listen(localhost()).await?;
    let err = within(with_secret("wrong").connect(listener.local_addr()))
        .await?
        .err()
        .ok_or_else(|| anyhow!("a wrong secret was accepted"))?;
    ensure!(
        matches!(err, TransportError::Authentication { .. }),
        "unexpected error {err}"
    );
    ensure!(err.to_string().contains("authentication"), "{err}");
    ensure!(err.to_string().contains("wrong cluster secret"), "{err}");

    // The listener's handshake task logs the refusal (with the peer's address) on its own.
    logs.wait_for("authentication failed").await?;
    let text = logs.text();
    ensure!(
        text.contains("peer=127.0.0.1:"),
        "log lacks the peer address: {text}"
    );

    let _insecure = TcpTransport::new(TcpConfig::insecure())?;
    ensure!(
        logs.text().contains("WITHOUT authentication"),
        "no warning for an insecure transport: {}",
        logs.text()
    );
    Ok(())
}

/// Both sides without a secret work together (when asked for); mixing fails the handshake.
#[tokio::test]
async fn insecure_only_with_insecure() -> Result<()> {
    let insecure = TcpTransport::new(TcpConfig::insecure())?;
    let listener = insecure.listen(localhost()).await?;
    let (client, server) =
        within(async { tokio::join!(insecure.connect(listener.local_addr()), listener.accept()) })
            .await?;
    let (client, server) = (client?, server?);
    client.send(Frame::message(&b"hi"[..], vec![])).await?;
    ensure!(&within(server.recv()).await??.header[..] == b"hi");

    // A client with a secret refuses an insecure listener.
    let err = within(with_secret("s").connect(listener.local_addr()))
        .await?
        .err()
        .ok_or_else(|| anyhow!("a secure client accepted an insecure listener"))?;
    ensure!(
        matches!(err, TransportError::Authentication { .. }),
        "{err}"
    );

    // An insecure client is refused by a listener with a secret.
    let secure = with_secret("s").listen(localhost()).await?;
    let err = within(insecure.connect(secure.local_addr()))
        .await?
        .err()
        .ok_or_else(|| anyhow!("an insecure client got in"))?;
    ensure!(
        err.to_string().contains("requires a cluster secret"),
        "{err}"
    );
    Ok(())
}

/// The secret comes from configuration first, then `TENSORWIRE_SECRET`; without either only an
/// explicit insecure request works. (One test: it changes the process environment.)
#[tokio::test]
async fn secret_resolution() -> Result<()> {
    std::env::remove_var(SECRET_ENV);
    let err = TcpConfig::from_env().unwrap_err();
    ensure!(err.to_string().contains(SECRET_ENV), "{err}");
    ensure!(TcpConfig::resolve(None, true)?.secret().is_none());

    std::env::set_var(SECRET_ENV, "from-env");
    let from_env = TcpTransport::new(TcpConfig::from_env()?)?;
    let listener = with_secret("from-env").listen(localhost()).await?;
    let (c, s) =
        within(async { tokio::join!(from_env.connect(listener.local_addr()), listener.accept()) })
            .await?;
    c?;
    s?;
    // Configuration wins over the environment.
    let configured = TcpConfig::resolve(Some(ClusterSecret::new("configured")?), false)?;
    let err = within(TcpTransport::new(configured)?.connect(listener.local_addr()))
        .await?
        .err()
        .ok_or_else(|| anyhow!("the configured secret was ignored"))?;
    ensure!(
        matches!(err, TransportError::Authentication { .. }),
        "{err}"
    );
    std::env::remove_var(SECRET_ENV);
    ensure!(!format!("{:?}", TcpConfig::new(ClusterSecret::new("hidden")?)).contains("hidden"));
    Ok(())
}

/// A frame over the sender's limits is refused before anything is sent; the connection stays
/// usable.
#[tokio::test]
async fn oversized_send_is_refused_locally() -> Result<()> {
    let t = TcpTransport::new(
        TcpConfig::new(ClusterSecret::new("s")?)
            .with_limits(WireLimits::default().with_max_frame_len(1000)),
    )?;
    let listener = t.listen(localhost()).await?;
    let (c, s) =
        within(async { tokio::join!(t.connect(listener.local_addr()), listener.accept()) }).await?;
    let (c, s) = (c?, s?);
    let err = c
        .send(Frame::message(
            Bytes::new(),
            vec![Bytes::from(vec![0; 2000])],
        ))
        .await
        .unwrap_err();
    ensure!(
        matches!(
            err,
            TransportError::Wire {
                source: WireError::FrameTooLarge { .. },
                ..
            }
        ),
        "{err}"
    );
    c.send(Frame::message(&b"small"[..], vec![])).await?;
    ensure!(&within(s.recv()).await??.header[..] == b"small");
    Ok(())
}

/// `received_all` says whether the frame `recv` returned left anything in the read buffer:
/// two frames sent in one vectored write arrive in one read, so the first leaves the second
/// behind (the agent then lets its reply wait to be batched) and the second leaves nothing
/// (its reply is written at once).
#[tokio::test]
async fn received_all_says_whether_a_frame_of_the_same_read_waits() -> Result<()> {
    let t = with_secret("s");
    let listener = t.listen(localhost()).await?;
    let (c, s) =
        within(async { tokio::join!(t.connect(listener.local_addr()), listener.accept()) }).await?;
    let (c, s) = (c?, s?);
    ensure!(!s.received_all(), "nothing received yet");
    c.send_many(vec![
        Frame::message(&b"one"[..], vec![]),
        Frame::message(&b"two"[..], vec![Bytes::from_static(b"payload")]),
    ])
    .await?;
    ensure!(&within(s.recv()).await??.header[..] == b"one");
    ensure!(
        !s.received_all(),
        "the second frame of the read is still buffered"
    );
    ensure!(&within(s.recv()).await??.header[..] == b"two");
    ensure!(s.received_all(), "nothing is left after the second frame");
    c.send(Frame::message(&b"three"[..], vec![])).await?;
    ensure!(&within(s.recv()).await??.header[..] == b"three");
    ensure!(s.received_all());
    Ok(())
}

/// A single frame is written by `try_send_now` straight from the frame; when the socket does
/// not take it whole, what it took stays written and the rest is held, written first by the
/// next `send_many`: the peer gets the frame whole, then the next.
#[tokio::test]
async fn a_single_frame_the_socket_does_not_take_whole_is_held_past_what_was_written() -> Result<()>
{
    let t = with_secret("s");
    let listener = t.listen(localhost()).await?;
    let (c, s) =
        within(async { tokio::join!(t.connect(listener.local_addr()), listener.accept()) }).await?;
    let (c, s) = (c?, s?);
    // Nobody reads: 32 MiB cannot all fit in the socket buffers.
    let big = Bytes::from((0..32u32 << 20).map(|i| i as u8).collect::<Vec<_>>());
    let mut frames = vec![Frame::message(&b"big"[..], vec![big.clone()])];
    ensure!(
        c.try_send_now(&mut frames).is_none(),
        "32 MiB went out with no reader"
    );
    ensure!(frames.is_empty(), "the frame is held");
    let mut later = vec![Frame::message(&b"later"[..], vec![])];
    ensure!(c.try_send_now(&mut later).is_none(), "held bytes go first");
    ensure!(later.len() == 1, "nothing was taken while bytes are held");
    let (sent, got) = within(async {
        tokio::join!(c.send_many(later), async {
            let first = s.recv().await?;
            let second = s.recv().await?;
            Ok::<_, TransportError>((first, second))
        })
    })
    .await?;
    sent?;
    let (first, second) = got?;
    ensure!(&first.header[..] == b"big" && first.payloads == vec![big]);
    ensure!(&second.header[..] == b"later" && second.payloads.is_empty());
    Ok(())
}

/// `try_send_now` writes on the caller's thread when the socket takes everything; when it
/// fills, what it took is held and the next `send_many` writes it first, so the peer gets
/// every frame whole and in order. A frame over the limits fails before anything is sent.
#[tokio::test]
async fn try_send_now_writes_at_once_or_leaves_the_rest_to_the_next_send() -> Result<()> {
    let t = with_secret("s");
    let listener = t.listen(localhost()).await?;
    let (c, s) =
        within(async { tokio::join!(t.connect(listener.local_addr()), listener.accept()) }).await?;
    let (c, s) = (c?, s?);
    let mut frames = vec![Frame::message(&b"small"[..], vec![])];
    ensure!(matches!(c.try_send_now(&mut frames), Some(Ok(()))));
    ensure!(frames.is_empty(), "the frame was taken");
    ensure!(frames.capacity() >= 1, "the caller's list keeps its room");
    ensure!(&within(s.recv()).await??.header[..] == b"small");
    // The same list again, with two frames: both go, in order (the writer's list reused).
    frames.push(Frame::message(&b"one"[..], vec![]));
    frames.push(Frame::message(&b"two"[..], vec![]));
    ensure!(matches!(c.try_send_now(&mut frames), Some(Ok(()))));
    ensure!(&within(s.recv()).await??.header[..] == b"one");
    ensure!(&within(s.recv()).await??.header[..] == b"two");

    // More payloads than the frame header's 64 KiB can list.
    let mut over = vec![Frame::message(Bytes::new(), vec![Bytes::new(); 70_000])];
    match c.try_send_now(&mut over) {
        Some(Err(TransportError::Wire { .. })) => {}
        other => {
            return Err(anyhow!(
                "an oversized frame header was not refused: {other:?}"
            ))
        }
    }

    // Nobody reads: 32 MiB cannot all fit in the socket buffers.
    let big = Bytes::from(vec![7u8; 32 << 20]);
    let mut frames = vec![
        Frame::message(&b"big"[..], vec![big.clone()]),
        Frame::message(&b"after big"[..], vec![]),
    ];
    ensure!(
        c.try_send_now(&mut frames).is_none(),
        "32 MiB went out with no reader"
    );
    ensure!(frames.is_empty(), "both frames are held");
    let mut later = vec![Frame::message(&b"later"[..], vec![])];
    ensure!(c.try_send_now(&mut later).is_none(), "held bytes go first");
    ensure!(later.len() == 1, "nothing was taken while bytes are held");
    let (sent, got) = within(async {
        tokio::join!(c.send_many(later), async {
            let mut got = Vec::new();
            for _ in 0..3 {
                got.push(s.recv().await?);
            }
            Ok::<_, TransportError>(got)
        })
    })
    .await?;
    sent?;
    let got = got?;
    ensure!(&got[0].header[..] == b"big" && got[0].payloads == vec![big]);
    ensure!(&got[1].header[..] == b"after big");
    ensure!(&got[2].header[..] == b"later");
    Ok(())
}

/// A send cancelled half-way through a frame (its future dropped) leaves no half frame for a
/// later send to follow: later sends fail, and the peer sees the frame cut off, never garbage.
#[tokio::test]
async fn a_cancelled_send_poisons_the_sending_side() -> Result<()> {
    let t = with_secret("s");
    let listener = t.listen(localhost()).await?;
    let (c, s) =
        within(async { tokio::join!(t.connect(listener.local_addr()), listener.accept()) }).await?;
    let (c, s) = (c?, s?);
    // Nobody reads yet, so 64 MiB cannot fit in the socket buffers: the send is still
    // running when the timeout drops it.
    let big = Frame::message(Bytes::new(), vec![Bytes::from(vec![1u8; 64 << 20])]);
    let cancelled = tokio::time::timeout(Duration::from_millis(200), c.send(big)).await;
    ensure!(cancelled.is_err(), "a 64 MiB send completed with no reader");
    let err = c
        .send(Frame::message(&b"after"[..], vec![]))
        .await
        .unwrap_err();
    ensure!(err.to_string().contains("cancelled half-way"), "{err}");
    drop(c);
    match within(s.recv()).await? {
        Err(TransportError::ClosedMidFrame { .. }) => Ok(()),
        other => Err(anyhow!("expected the frame to be cut off, got {other:?}")),
    }
}

/// Peers that connect and say nothing do not hold up others: handshakes run concurrently.
/// Silent connections (no handshake) from one source address hold only that address's share
/// of the handshake slots: a good peer from another address is served at once, even with more
/// silent connections than there are slots (256), and the excess from the flooding address is
/// closed at once.
#[tokio::test]
async fn silent_peers_do_not_block_accepting() -> Result<()> {
    let t = TcpTransport::new(
        TcpConfig::new(ClusterSecret::new("s")?).with_handshake_timeout(Duration::from_secs(60)),
    )?;
    let listener = t.listen(localhost()).await?;
    let flooder: std::net::SocketAddr = "127.0.0.2:0".parse()?;
    let mut silent = Vec::new();
    for _ in 0..300 {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(flooder)?;
        silent.push(within(socket.connect(listener.local_addr())).await??);
    }
    // Well before the 60 s handshake timeout of the silent ones.
    let (c, s) = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(t.connect(listener.local_addr()), listener.accept())
    })
    .await
    .map_err(|_| anyhow!("a good peer waited behind silent ones"))?;
    let (c, s) = (c?, s?);
    c.send(Frame::message(&b"through"[..], vec![])).await?;
    ensure!(&within(s.recv()).await??.header[..] == b"through");
    // The last silent connection is beyond its address's share: closed without a word.
    let mut last = silent.pop().unwrap();
    let mut byte = [0u8; 1];
    use tokio::io::AsyncReadExt;
    ensure!(matches!(
        within(last.read(&mut byte)).await?,
        Ok(0) | Err(_)
    ));
    drop(silent);
    Ok(())
}

/// A burst of honest peers from one address (ranks on one host dial from 127.0.0.1) beyond
/// its handshakes in progress waits its turn instead of being refused: with 2 handshakes per
/// source, 10 connect at once and all get in; an 11th at the same moment would be refused.
#[tokio::test]
async fn a_burst_from_one_address_waits_its_turn() -> Result<()> {
    let t =
        TcpTransport::new(TcpConfig::new(ClusterSecret::new("s")?).with_handshakes_per_source(2))?;
    let listener = t.listen(localhost()).await?;
    let addr = listener.local_addr();
    let mut dials = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let t = t.clone();
        dials.spawn(async move { t.connect(addr).await });
    }
    let dials = async {
        let mut out = Vec::new();
        while let Some(c) = dials.join_next().await {
            out.push(c.expect("a dial task panicked"));
        }
        out
    };
    let accepts = async {
        let mut got = Vec::new();
        for _ in 0..10 {
            got.push(listener.accept().await?);
        }
        Ok::<_, TransportError>(got)
    };
    let (dialled, accepted) = within(async { tokio::join!(dials, accepts) }).await?;
    for (i, c) in dialled.into_iter().enumerate() {
        c.map_err(|e| anyhow!("connection {i} of the burst: {e}"))?;
    }
    ensure!(accepted?.len() == 10);
    Ok(())
}

/// A peer that completes the handshake, starts a frame and stalls: the receive fails once the
/// frame's deadline passes, naming the bound, and the connection is closed.
#[tokio::test]
async fn a_frame_that_stalls_fails_at_its_deadline() -> Result<()> {
    use tensorwire_core::auth::{ClientHandshake, CHALLENGE_LEN, VERDICT_LEN};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let timeout = Duration::from_millis(300);
    let t = TcpTransport::new(
        TcpConfig::new(ClusterSecret::new("s")?).with_frame_timeout(Some(timeout)),
    )?;
    let listener = t.listen(localhost()).await?;
    let hostile = async {
        let mut stream = tokio::net::TcpStream::connect(listener.local_addr()).await?;
        let (hs, hello) = ClientHandshake::start(ClusterSecret::new("s")?, [7u8; 32]);
        stream.write_all(&hello).await?;
        let mut challenge = [0u8; CHALLENGE_LEN];
        stream.read_exact(&mut challenge).await?;
        stream.write_all(&hs.handle_challenge(&challenge)?).await?;
        let mut verdict = [0u8; VERDICT_LEN];
        stream.read_exact(&mut verdict).await?;
        hs.handle_verdict(&verdict)?;
        Ok::<_, anyhow::Error>(stream)
    };
    let (stream, server) = within(async { tokio::join!(hostile, listener.accept()) }).await?;
    let (mut stream, server) = (stream?, server?);
    // A 4 MiB frame, of which the preamble and 1 MiB arrive.
    let frame = Frame::message(Bytes::new(), vec![Bytes::from(vec![3u8; 4 << 20])]);
    let preamble = tensorwire_core::wire::encode_preamble(&frame, &WireLimits::default())?;
    stream.write_all(&preamble).await?;
    stream.write_all(&vec![3u8; 1 << 20]).await?;
    match within(server.recv()).await? {
        Err(TransportError::FrameTimeout {
            after, received, ..
        }) => {
            ensure!(after == timeout);
            ensure!(received == preamble.len() as u64 + (1 << 20), "{received}");
        }
        other => return Err(anyhow!("expected a frame timeout, got {other:?}")),
    }
    let mut rest = Vec::new();
    let _ = within(stream.read_to_end(&mut rest)).await?;
    ensure!(rest.is_empty(), "the stalled peer got {} bytes", rest.len());
    Ok(())
}
