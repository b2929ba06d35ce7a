//! Bulk frames over the QUIC transport on loopback, with connection statistics in the log:
//! `RUST_LOG=tensorwire_transport_quic=debug cargo run --release --example quic_bulk -- 64 8`.

use std::time::Instant;

use bytes::Bytes;
use tensorwire_core::ports::transport::Transport;
use tensorwire_core::wire::Frame;
use tensorwire_transport_quic::{certs::ClusterCa, ClusterTls, QuicConfig, QuicTransport};

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map_or(Ok(64), |a| a.parse())?;
    let rounds: usize = args.next().map_or(Ok(8), |a| a.parse())?;
    let ca = ClusterCa::generate()?;
    let tls = ClusterTls::new(ca.issue_node("bench")?, vec![ca.cert_der().clone()]);
    let mut config = QuicConfig::new(tls);
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    if let Some(v) = env("TW_MTU") {
        config.max_mtu = v as u16;
    }
    if let Some(v) = env("TW_INIT_MTU") {
        config.initial_mtu = v as u16;
    }
    if let Some(v) = env("TW_LOOP_MTU") {
        config.loopback_mtu = v as u16;
    }
    if let Some(v) = env("TW_LOOP_WIN") {
        config.loopback_receive_window = v << 20;
    }
    if let Some(v) = env("TW_SWIN") {
        config.stream_receive_window = v << 20;
    }
    if let Some(v) = env("TW_CWIN") {
        config.connection_receive_window = v << 20;
        config.send_window = v << 20;
    }
    println!("{config:?}");
    let transport = QuicTransport::new(config)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = transport.listen("127.0.0.1:0".parse()?).await?;
        let (c, s) = tokio::join!(transport.connect(listener.local_addr()), listener.accept());
        let (c, s) = (c?, s?);
        let server = tokio::spawn(async move {
            while let Ok(f) = s.recv().await {
                if s.send(Frame::message(Bytes::from_static(&[1]), vec![]))
                    .await
                    .is_err()
                {
                    break;
                }
                drop(f);
            }
        });
        if mib == 0 {
            // Ping-pong of 64-byte messages: `rounds` round trips, median reported.
            let ping = Frame::message(Bytes::from(vec![7u8; 64]), vec![]);
            let mut times = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                let t = Instant::now();
                c.send(ping.clone()).await?;
                c.recv().await?;
                times.push(t.elapsed());
            }
            times.sort();
            println!(
                "ping-pong p50 {:?} p99 {:?}",
                times[rounds / 2],
                times[rounds * 99 / 100]
            );
            c.close().await?;
            drop(c);
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), server).await;
            return anyhow::Ok(());
        }
        let frame = Frame::message(Bytes::new(), vec![Bytes::from(vec![3u8; mib << 20])]);
        for round in 0..rounds {
            let t = Instant::now();
            c.send(frame.clone()).await?;
            c.recv().await?;
            let took = t.elapsed();
            println!(
                "round {round}: {mib} MiB in {:.1} ms = {:.0} MB/s",
                took.as_secs_f64() * 1e3,
                (mib << 20) as f64 / took.as_secs_f64() / 1e6
            );
        }
        c.close().await?;
        drop(c);
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), server).await;
        anyhow::Ok(())
    })
}
