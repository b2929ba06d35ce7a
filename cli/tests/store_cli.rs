//! `tensorwire store ...` as a real binary: a server process and client processes.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_tensorwire");

struct Server {
    child: Child,
    addr: String,
    stdout: BufReader<std::process::ChildStdout>,
}

fn serve(extra: &[&str]) -> Server {
    let mut child = Command::new(BIN)
        .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("tensorwire store listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    Server {
        child,
        addr,
        stdout,
    }
}

fn client(addr: &str, args: &[&str]) -> Output {
    let (sub, rest) = args.split_first().unwrap();
    Command::new(BIN)
        .args(["store", sub, "--addr", addr, "--timeout", "10"])
        .args(rest)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// Sends SIGINT (what Ctrl-C sends) to `child` and waits (on a thread, without polling) for it
/// to exit successfully, within 10 s.
fn stops_cleanly_on_sigint(mut child: Child) {
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(status)) => assert!(status.success(), "server exited with {status}"),
        Ok(Err(e)) => panic!("waiting for the server: {e}"),
        Err(_) => panic!("server did not stop on SIGINT"),
    }
}

/// Sends SIGINT and waits for a clean exit; returns what the server printed meanwhile.
fn interrupt(server: Server) -> String {
    let Server {
        child, mut stdout, ..
    } = server;
    stops_cleanly_on_sigint(child);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    rest
}

/// A server whose standard output nobody reads any more (a benchmark read the address and
/// closed the pipe) still stops cleanly: it panicked on EPIPE writing its last line.
#[test]
fn a_server_whose_stdout_is_closed_stops_cleanly() {
    let Server {
        child,
        addr,
        stdout,
    } = serve(&[]);
    drop(stdout);
    ok(&client(&addr, &["set", "k", "v"]));
    stops_cleanly_on_sigint(child);
}

#[test]
fn serve_and_every_client_command() {
    let server = serve(&[]);
    let addr = server.addr.clone();

    ok(&client(&addr, &["set", "greeting", "hello world"]));
    assert_eq!(ok(&client(&addr, &["get", "greeting"])), "hello world");
    assert_eq!(ok(&client(&addr, &["add", "n"])), "1\n");
    assert_eq!(ok(&client(&addr, &["add", "n", "41"])), "42\n");
    assert_eq!(ok(&client(&addr, &["add", "n", "-2"])), "40\n");
    ok(&client(&addr, &["wait", "greeting", "n"]));
    assert_eq!(ok(&client(&addr, &["check", "greeting", "n"])), "ready\n");
    let not_ready = client(&addr, &["check", "greeting", "absent"]);
    assert_eq!(not_ready.status.code(), Some(1));
    assert_eq!(String::from_utf8_lossy(&not_ready.stdout), "not ready\n");
    assert_eq!(ok(&client(&addr, &["num-keys"])), "2\n");
    assert_eq!(ok(&client(&addr, &["delete", "greeting"])), "deleted\n");
    assert_eq!(ok(&client(&addr, &["delete", "greeting"])), "absent\n");
    assert_eq!(ok(&client(&addr, &["num-keys"])), "1\n");

    // A get parked in one process is released by a set from another.
    let waiting = Command::new(BIN)
        .args(["store", "get", "--addr", &addr, "--timeout", "10", "later"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    ok(&client(&addr, &["set", "later", "arrived"]));
    let out = waiting.wait_with_output().unwrap();
    assert_eq!(ok(&out), "arrived");

    // A wait that times out names the key and fails.
    let timed_out = Command::new(BIN)
        .args([
            "store",
            "wait",
            "--addr",
            &addr,
            "--timeout",
            "0.2",
            "never",
        ])
        .output()
        .unwrap();
    assert!(!timed_out.status.success());
    let err = String::from_utf8_lossy(&timed_out.stderr);
    assert!(err.contains("\"never\""), "{err}");

    // A barrier of two: one process parked until a second arrives; the count stays in the key.
    let first = Command::new(BIN)
        .args([
            "store",
            "barrier",
            "--addr",
            &addr,
            "--timeout",
            "10",
            "met",
            "2",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    ok(&client(&addr, &["barrier", "met", "2"]));
    ok(&first.wait_with_output().unwrap());
    assert_eq!(ok(&client(&addr, &["get", "met"])), "2");
    // A reached barrier lets a later arrival through at once.
    ok(&client(&addr, &["barrier", "met", "2"]));
    // One that times out fails naming the key, and has counted.
    let alone = Command::new(BIN)
        .args([
            "store",
            "barrier",
            "--addr",
            &addr,
            "--timeout",
            "0.2",
            "lonely",
            "3",
        ])
        .output()
        .unwrap();
    assert!(!alone.status.success());
    let err = String::from_utf8_lossy(&alone.stderr);
    assert!(
        err.contains("barrier timeout after 200ms, key: \"lonely\""),
        "{err}"
    );
    assert_eq!(ok(&client(&addr, &["get", "lonely"])), "1");

    assert!(interrupt(server).contains("tensorwire store stopped"));
}

#[test]
fn secret_file_protects_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "shared-secret\n").unwrap();
    let secret = secret.to_str().unwrap().to_owned();
    let server = serve(&["--secret-file", &secret]);
    let addr = server.addr.clone();

    ok(&client(&addr, &["set", "k", "v", "--secret-file", &secret]));
    assert_eq!(
        ok(&client(&addr, &["get", "k", "--secret-file", &secret])),
        "v"
    );
    let refused = Command::new(BIN)
        .args(["store", "get", "--addr", &addr, "--timeout", "10", "k"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("requires a cluster secret"), "{err}");

    interrupt(server);
}

#[test]
fn serving_without_a_secret_warns() {
    let mut child = Command::new(BIN)
        .args(["store", "serve", "--host", "127.0.0.1", "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("tensorwire store listening on"), "{line}");
    stops_cleanly_on_sigint(child);
    let mut err = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut err).unwrap();
    assert!(
        err.contains("warning: no --secret-file") && err.contains("127.0.0.1:0"),
        "{err}"
    );
}

/// A malformed --addr is a usage error at once (exit 2), not 30 s of retries.
#[test]
fn an_invalid_address_is_refused_at_once() {
    for addr in ["nohost", "host:port", ":29500"] {
        let started = std::time::Instant::now();
        let out = Command::new(BIN)
            .args(["store", "get", "--addr", addr, "k"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{addr}: {err}");
        assert!(err.contains("HOST:PORT") && err.contains(addr), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
    }
}

#[test]
fn client_against_an_absent_server_fails_with_the_address() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let out = Command::new(BIN)
        .args(["store", "num-keys", "--addr", &addr, "--timeout", "0.3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&addr) && err.contains("gave up"), "{err}");
}

const PY_SERVER: &str = r#"
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
s.set("from-python", "py-value")
print(s.port, flush=True)
s.get("cli-done")
print("SEEN", s.get("cli-key").decode(), s.get("cli-count").decode(), flush=True)
"#;

/// The CLI against PyTorch's own store server. Skips (passes, printing why) without torch;
/// set TENSORWIRE_TORCH_PYTHON to a Python that has it.
#[test]
fn cli_against_pytorch_server() {
    let python = std::env::var("TENSORWIRE_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_torch = Command::new(&python)
        .args(["-c", "import torch.distributed"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_torch {
        // CI sets this after installing torch: a skip there would hide a broken install.
        if std::env::var_os("TENSORWIRE_REQUIRE_TORCH").is_some() {
            panic!("TENSORWIRE_REQUIRE_TORCH is set but {python} has no torch");
        }
        eprintln!("SKIPPED: needs a Python with torch ({python} has none)");
        return;
    }
    let mut child = Command::new(&python)
        .args(["-c", PY_SERVER])
        .env("PYTHONWARNINGS", "ignore")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut port = String::new();
    stdout.read_line(&mut port).unwrap();
    let addr = format!("127.0.0.1:{}", port.trim());

    assert_eq!(ok(&client(&addr, &["get", "from-python"])), "py-value");
    ok(&client(&addr, &["set", "cli-key", "cli-value"]));
    assert_eq!(ok(&client(&addr, &["add", "cli-count", "5"])), "5\n");
    assert_eq!(
        ok(&client(&addr, &["check", "cli-key", "from-python"])),
        "ready\n"
    );
    ok(&client(&addr, &["barrier", "cli-bar", "1"]));
    assert_eq!(ok(&client(&addr, &["get", "cli-bar"])), "1");
    assert_eq!(ok(&client(&addr, &["num-keys"])), "4\n");
    ok(&client(&addr, &["set", "cli-done", "1"]));
    let mut seen = String::new();
    stdout.read_line(&mut seen).unwrap();
    assert_eq!(seen.trim(), "SEEN cli-value 5");
    assert!(child.wait().unwrap().success());
}
