//! Simulated hosts for multi-host tests: one Linux network namespace per host, joined by a
//! bridge that lives in a namespace of its own, so nothing is added to the machine's own
//! network. Host `i` has the interface `eth0` with `10.77.0.<i+1>/24`, and `lo`.
//!
//! Names are unique per test run (process id and a counter), and everything is removed when
//! the [`Hosts`] value is dropped, also when a test fails: the processes started through it are
//! killed, then the namespaces deleted (which deletes their interfaces), then the files that
//! gave each host its own `/etc/hosts`.
//!
//! Making namespaces needs root and `ip` (iproute2); [`Hosts::create`] returns why it cannot,
//! and tests print `SKIPPED: <reason>` and pass.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A set of simulated hosts (see the [module](self) documentation).
#[derive(Debug)]
pub struct Hosts {
    prefix: String,
    names: Vec<String>,
    switch: String,
    children: Mutex<Vec<Child>>,
    etc_dirs: Vec<PathBuf>,
}

/// Runs `ip ARGS`, returning its error output when it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` (install iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// Makes `n` hosts (at most 250), each with `/etc/hosts` naming every host as
    /// `<hostname_prefix><i+1>` (so `node1` is `10.77.0.1`); or says why it cannot.
    ///
    /// # Errors
    /// Why namespaces cannot be made here (not root, no `ip`, ...): the reason to skip.
    pub fn create(n: usize, hostname_prefix: &str) -> Result<Hosts, String> {
        assert!((1..=250).contains(&n), "1 to 250 hosts");
        let prefix = format!(
            "tw{}x{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let mut hosts = Hosts {
            switch: format!("{prefix}sw"),
            names: Vec::new(),
            prefix,
            children: Mutex::new(Vec::new()),
            etc_dirs: Vec::new(),
        };
        // Dropping `hosts` on an error removes what was made so far.
        ip(&["netns", "add", &hosts.switch])?;
        let switch = hosts.switch.clone();
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        let mut etc_hosts = String::from("127.0.0.1 localhost\n");
        for i in 0..n {
            etc_hosts.push_str(&format!("{} {hostname_prefix}{}\n", Self::ip_of(i), i + 1));
        }
        for i in 0..n {
            let ns = format!("{}h{i}", hosts.prefix);
            ip(&["netns", "add", &ns])?;
            hosts.names.push(ns.clone());
            let port = format!("h{i}");
            ip(&[
                "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port,
                "netns", &switch,
            ])?;
            ip(&["-n", &switch, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &port, "up"])?;
            let cidr = format!("{}/24", Self::ip_of(i));
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            // `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts.
            let dir = PathBuf::from("/etc/netns").join(&ns);
            std::fs::create_dir_all(&dir)
                .and_then(|()| std::fs::write(dir.join("hosts"), &etc_hosts))
                .map_err(|e| format!("cannot write {}: {e}", dir.display()))?;
            hosts.etc_dirs.push(dir);
        }
        Ok(hosts)
    }

    /// Host `i`'s address.
    pub fn ip_of(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, 0, (i + 1) as u8)
    }

    /// The number of hosts.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether there are no hosts (never: `create` makes at least one).
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The unique prefix of this run's namespace names.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A command that runs `program` on host `i` (`ip netns exec`), with piped stdio.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.names[i]])
            .arg(program)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Starts `cmd` (from [`command`](Self::command)); the process is killed when `self` is
    /// dropped if it is still running. Returns its index for [`take`](Self::take).
    pub fn spawn(&self, cmd: &mut Command) -> usize {
        let child = cmd.spawn().expect("ip netns exec starts");
        let mut children = self.children.lock().unwrap();
        children.push(child);
        children.len() - 1
    }

    /// Runs `f` on the child started as `index`.
    pub fn with_child<R>(&self, index: usize, f: impl FnOnce(&mut Child) -> R) -> R {
        f(&mut self.children.lock().unwrap()[index])
    }

    /// Takes the child's output streams (stdin, stdout, stderr) out of it.
    pub fn take(
        &self,
        index: usize,
    ) -> (
        Option<std::process::ChildStdin>,
        Option<std::process::ChildStdout>,
        Option<std::process::ChildStderr>,
    ) {
        self.with_child(index, |c| {
            (c.stdin.take(), c.stdout.take(), c.stderr.take())
        })
    }

    /// Cuts host `i` off the network: its `eth0` goes down (`ip link set eth0 down`).
    ///
    /// # Errors
    /// `ip`'s message.
    pub fn cut(&self, i: usize) -> Result<(), String> {
        ip(&["-n", &self.names[i], "link", "set", "eth0", "down"])
    }
}

impl Hosts {
    /// Delays, jitters or drops host `i`'s outgoing packets: `tc qdisc replace dev eth0 root
    /// netem ARGS` in its namespace (for example `delay 5ms 2ms loss 1%`). Applied on every
    /// host, each packet between two hosts is treated once per direction.
    ///
    /// # Errors
    /// `tc`'s message (it needs iproute2 and the kernel's `sch_netem`).
    pub fn netem(&self, i: usize, args: &[&str]) -> Result<(), String> {
        let mut all = vec![
            "-n",
            &self.names[i],
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "netem",
        ];
        all.extend_from_slice(args);
        let out = Command::new("tc")
            .args(&all)
            .output()
            .map_err(|e| format!("cannot run `tc` (install iproute2): {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "`tc {}` failed: {}",
                all.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// A command that runs `program` in the switch's namespace, with piped stdio.
    pub fn switch_command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.switch])
            .arg(program)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Takes the hosts' switch ports (`h0`, `h1`, ... in the switch's namespace) off the
    /// kernel bridge, for a program that forwards between them instead (`tw-netem`), and sets
    /// every host's `eth0` to hand over one segment per frame (no segmentation offload
    /// batches), so that a frame is a packet. Returns the port names.
    ///
    /// # Errors
    /// `ip`'s message.
    pub fn detach_ports(&self) -> Result<Vec<String>, String> {
        let mut ports = Vec::new();
        for (i, ns) in self.names.iter().enumerate() {
            let port = format!("h{i}");
            ip(&["-n", &self.switch, "link", "set", &port, "nomaster"])?;
            ip(&["-n", ns, "link", "set", "eth0", "gso_max_segs", "1"])?;
            ports.push(port);
        }
        Ok(ports)
    }

    /// The process id of the child started as `index` (`ip netns exec` runs the program in
    /// its own process, so this is the program's).
    pub fn pid(&self, index: usize) -> u32 {
        self.with_child(index, |c| c.id())
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let children = self.children.get_mut().unwrap_or_else(|e| {
            // A panic while holding the lock must not keep processes alive.
            e.into_inner()
        });
        for child in children.iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for ns in self.names.iter().chain([&self.switch]) {
            let _ = ip(&["netns", "delete", ns]);
        }
        for dir in &self.etc_dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
