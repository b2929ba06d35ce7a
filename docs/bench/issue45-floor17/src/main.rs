// Ping-pong of 64 bytes over loopback TCP: blocking std (raw) vs tokio current-thread,
// tokio with a far timer pending (epoll_wait gets a timeout), pinned or not by the caller.
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const N: usize = 20000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args[1].as_str();
    match mode {
        "serve-raw" => serve_raw(&args[2]),
        "serve-tokio" | "serve-tokio-timer" => serve_tokio(&args[2], mode.ends_with("timer")),
        "raw" => { let s = TcpStream::connect(&args[2]).unwrap(); s.set_nodelay(true).unwrap(); raw(s) }
        "tokio" | "tokio-timer" => client_tokio(&args[2], mode.ends_with("timer")),
        _ => panic!(),
    }
}

fn serve_raw(addr: &str) {
    let l = TcpListener::bind(addr).unwrap();
    let (mut s, _) = l.accept().unwrap();
    s.set_nodelay(true).unwrap();
    let mut b = [0u8; 64];
    loop { if s.read_exact(&mut b).is_err() { return; } s.write_all(&b).unwrap(); }
}

fn raw(mut s: TcpStream) {
    let mut b = [0u8; 64];
    let mut t = Vec::with_capacity(N);
    for _ in 0..N { let t0 = Instant::now(); s.write_all(&b).unwrap(); s.read_exact(&mut b).unwrap(); t.push(t0.elapsed()); }
    report("raw", t);
}

fn rt() -> tokio::runtime::Runtime { tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap() }

fn serve_tokio(addr: &str, timer: bool) {
    rt().block_on(async {
        let l = tokio::net::TcpListener::bind(addr).await.unwrap();
        let (mut s, _) = l.accept().await.unwrap();
        s.set_nodelay(true).unwrap();
        if timer { tokio::spawn(async { tokio::time::sleep(Duration::from_secs(1000)).await; }); }
        let mut b = [0u8; 64];
        loop { if s.read_exact(&mut b).await.is_err() { return; } s.write_all(&b).await.unwrap(); }
    })
}

fn client_tokio(addr: &str, timer: bool) {
    rt().block_on(async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        if timer { tokio::spawn(async { tokio::time::sleep(Duration::from_secs(1000)).await; }); }
        let mut b = [0u8; 64];
        let mut t = Vec::with_capacity(N);
        for _ in 0..N { let t0 = Instant::now(); s.write_all(&b).await.unwrap(); s.read_exact(&mut b).await.unwrap(); t.push(t0.elapsed()); }
        report(if timer { "tokio-timer" } else { "tokio" }, t);
    })
}

fn report(name: &str, mut t: Vec<Duration>) {
    t.sort();
    println!("{name} p50 {:.2} us p10 {:.2}", t[N / 2].as_secs_f64() * 1e6, t[N / 10].as_secs_f64() * 1e6);
}
