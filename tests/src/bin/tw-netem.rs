//! A network emulator in user space, for kernels without `sch_netem`: a hub between the ports of
//! the simulated hosts' switch (`tests/src/netns.rs`) that delays every frame by `DELAY ±
//! JITTER` (uniform, so frames may be reordered, as with netem's jitter) and drops a fraction
//! `LOSS` of them.
//!
//! `tw-netem DELAY_MS JITTER_MS LOSS PORT...`, run in the switch's namespace with the ports taken
//! off the kernel bridge. Frames are read and written with packet sockets carrying the virtio
//! net header (`PACKET_VNET_HDR`), so segmentation and checksum offloads pass through intact: a
//! frame is what one host's kernel handed its interface (the hosts' interfaces are set to one
//! segment per frame, so a frame is a packet). Runs until killed; prints `NETEM READY` once
//! every port is open and `NETEM ERROR ...` on a failure.

use std::collections::BinaryHeap;
use std::ffi::CString;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng as _, SeedableRng};

/// `PACKET_VNET_HDR` and `PACKET_OUTGOING` from `<linux/if_packet.h>`.
const PACKET_VNET_HDR: libc::c_int = 15;
const PACKET_OUTGOING: u8 = 4;

/// A frame due out at `due` on every port but `from`.
struct Due {
    due: Instant,
    seq: u64,
    from: usize,
    bytes: Vec<u8>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    // The earliest first out of a max-heap.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.due, other.seq).cmp(&(self.due, self.seq))
    }
}

#[derive(Default)]
struct Queue {
    heap: Mutex<(BinaryHeap<Due>, u64)>,
    ready: Condvar,
}

fn fail(what: &str) -> ! {
    println!("NETEM ERROR {what}: {}", std::io::Error::last_os_error());
    std::process::exit(1);
}

/// A packet socket on interface `name` with virtio net headers.
fn open(name: &str) -> libc::c_int {
    let proto = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain system calls on values we own; every result is checked.
    unsafe {
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto.into());
        if fd < 0 {
            fail("socket(AF_PACKET)");
        }
        let on: libc::c_int = 1;
        if libc::setsockopt(
            fd,
            libc::SOL_PACKET,
            PACKET_VNET_HDR,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) < 0
        {
            fail("PACKET_VNET_HDR");
        }
        let cname = CString::new(name).expect("interface names have no NUL");
        let index = libc::if_nametoindex(cname.as_ptr());
        if index == 0 {
            fail(&format!("no interface {name}"));
        }
        let mut addr: libc::sockaddr_ll = std::mem::zeroed();
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = proto;
        addr.sll_ifindex = index as i32;
        if libc::bind(
            fd,
            (&addr as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        ) < 0
        {
            fail(&format!("bind to {name}"));
        }
        fd
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 5 {
        eprintln!("usage: tw-netem DELAY_MS JITTER_MS LOSS PORT PORT...");
        std::process::exit(2);
    }
    let num = |i: usize| -> f64 {
        args[i].parse().unwrap_or_else(|_| {
            eprintln!("not a number: {:?}", args[i]);
            std::process::exit(2)
        })
    };
    let (delay, jitter, loss) = (num(0), num(1), num(2));
    let ports: Vec<libc::c_int> = args[3..].iter().map(|p| open(p)).collect();
    let queue = Arc::new(Queue::default());
    for (from, &fd) in ports.iter().enumerate() {
        let queue = queue.clone();
        let mut rng = rand::rngs::SmallRng::from_entropy();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 17];
            loop {
                // SAFETY: reads into our buffer, lengths given; the result is checked.
                let (n, kind) = unsafe {
                    let mut addr: libc::sockaddr_ll = std::mem::zeroed();
                    let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
                    let n = libc::recvfrom(
                        fd,
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        (&mut addr as *mut libc::sockaddr_ll).cast(),
                        &mut len,
                    );
                    (n, addr.sll_pkttype)
                };
                if n < 0 {
                    fail("recvfrom");
                }
                // Our own transmissions on this port come back as outgoing: not for us.
                if kind == PACKET_OUTGOING || rng.gen::<f64>() < loss {
                    continue;
                }
                let ms = (delay + jitter * (2.0 * rng.gen::<f64>() - 1.0)).max(0.0);
                let due = Instant::now() + Duration::from_secs_f64(ms / 1000.0);
                let mut q = queue.heap.lock().unwrap_or_else(|e| e.into_inner());
                q.1 += 1;
                let seq = q.1;
                q.0.push(Due {
                    due,
                    seq,
                    from,
                    bytes: buf[..n as usize].to_vec(),
                });
                queue.ready.notify_one();
            }
        });
    }
    println!("NETEM READY");
    let mut q = queue.heap.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let now = Instant::now();
        match q.0.peek().map(|d| d.due) {
            Some(due) if due <= now => {
                let frame = q.0.pop().expect("peeked");
                drop(q);
                for (to, &fd) in ports.iter().enumerate() {
                    if to != frame.from {
                        // SAFETY: writes our buffer; a failed send is a lost frame, as on a wire.
                        unsafe {
                            libc::send(fd, frame.bytes.as_ptr().cast(), frame.bytes.len(), 0);
                        }
                    }
                }
                q = queue.heap.lock().unwrap_or_else(|e| e.into_inner());
            }
            Some(due) => {
                q = queue
                    .ready
                    .wait_timeout(q, due - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            None => q = queue.ready.wait(q).unwrap_or_else(|e| e.into_inner()),
        }
    }
}
