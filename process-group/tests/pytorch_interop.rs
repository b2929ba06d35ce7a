//! Interoperability with PyTorch's own `torch.distributed.TCPStore`, both ways.
//!
//! Needs a Python with torch: `$TENSORWIRE_TORCH_PYTHON` if set, else `python3`. When
//! `import torch` fails the tests print why and pass without checking anything, so CI without
//! torch stays green; on a machine with torch they run for real.

use std::process::Stdio;
use std::time::Duration;

use tensorwire_process_group::{
    ClientConfig, ServerConfig, Store, StoreError, TcpStoreClient, TcpStoreServer,
};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const LIMIT: Duration = Duration::from_secs(60);

fn python() -> String {
    std::env::var("TENSORWIRE_TORCH_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// A Python command, quiet about torch's optional-dependency warnings.
fn py() -> Command {
    let mut c = Command::new(python());
    c.env("PYTHONWARNINGS", "ignore");
    c
}

/// `Some(reason)` when torch is not importable.
fn torch_missing() -> Option<String> {
    match std::process::Command::new(python())
        .args(["-c", "import torch.distributed"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => None,
        Ok(s) => Some(format!("`{} -c 'import torch'` exited with {s}", python())),
        Err(e) => Some(format!("cannot run {}: {e}", python())),
    }
}

macro_rules! require_torch {
    () => {
        if let Some(reason) = torch_missing() {
            eprintln!(
                "SKIPPED: PyTorch interop test needs torch ({reason}); set TENSORWIRE_TORCH_PYTHON"
            );
            return;
        }
    };
}

const PY_CLIENT: &str = r#"
import sys
from datetime import timedelta
import torch.distributed as dist

host, port = sys.argv[1], int(sys.argv[2])
s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
out = []
def check(cond, what):
    if not cond:
        print("FAIL", what, flush=True)
        sys.exit(1)

check(s.get("rust/set") == b"from-rust", "get a key our client set")
s.set("py/set", "from-python")
check(s.add("py/count", 5) == 5 and s.add("py/count", 2) == 7, "add")
s.wait(["rust/set"])
s.wait(["rust/set"], timedelta(seconds=5))
check(s.check(["rust/set", "py/set"]) and not s.check(["nope"]), "check")
check(s.compare_set("py/cas", "", "one") == b"one", "compare_set on a missing key")
check(s.compare_set("py/cas", "one", "two") == b"two", "compare_set match")
check(s.compare_set("py/cas", "x", "y") == b"two", "compare_set mismatch")
check(s.compare_set("py/none", "x", "y") == b"x", "compare_set missing + expected")
s.set("py/del", "1")
check(s.delete_key("py/del") and not s.delete_key("py/del"), "delete_key")
try:
    s.wait(["never"], timedelta(milliseconds=200))
    check(False, "wait should time out")
except Exception as e:
    out.append("wait-timeout-ok")
s.set("py/after-timeout", "ok")
check(s.get("py/after-timeout") == b"ok", "connection usable after a wait timeout")
s.append("py/app", "a"); s.append("py/app", "b")
check(s.get("py/app") == b"ab", "append")
s.multi_set(["py/m1", "py/m2"], ["1", "22"])
check(s.multi_get(["py/m1", "py/m2"]) == [b"1", b"22"], "multi_get")
print("NUM_KEYS", s.num_keys(), flush=True)
s.set("py/ready", "1")
check(s.get("rust/release") == b"go", "a get parked until our client sets the key")
print("OK", *out, flush=True)
"#;

#[tokio::test]
async fn pytorch_client_against_our_server() {
    require_torch!();
    let server = TcpStoreServer::bind("127.0.0.1:0", ServerConfig::default())
        .await
        .unwrap();
    let port = server.local_addr().port();
    let ours = TcpStoreClient::connect(
        &server.local_addr().to_string(),
        ClientConfig {
            timeout: LIMIT,
            ..ClientConfig::default()
        },
    )
    .await
    .unwrap();
    ours.set("rust/set", b"from-rust").await.unwrap();

    let child = py()
        .args(["-c", PY_CLIENT, "127.0.0.1", &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Parked until Python has done everything else, then release its parked get.
    assert_eq!(ours.get("py/ready").await.unwrap(), b"1");
    ours.set("rust/release", b"go").await.unwrap();
    let output = tokio::time::timeout(LIMIT, child.wait_with_output())
        .await
        .expect("python finished")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    eprintln!("python said: {stdout}");
    assert!(output.status.success(), "python failed: {stdout}");
    assert!(stdout.contains("OK wait-timeout-ok"), "{stdout}");
    // rust/set, py/set, py/count, py/cas, py/after-timeout, py/app, py/m1, py/m2 (py/del deleted)
    assert!(stdout.contains("NUM_KEYS 8"), "{stdout}");

    // What Python wrote is what our client reads under the same names.
    assert_eq!(ours.get("py/set").await.unwrap(), b"from-python");
    assert_eq!(ours.get("py/count").await.unwrap(), b"7");
    assert_eq!(ours.get("py/app").await.unwrap(), b"ab");
    server.shutdown().await;
}

const PY_SERVER: &str = r#"
import sys
from datetime import timedelta
import torch.distributed as dist

s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
s.set("py/hello", "from-python")
print(s.port, flush=True)
done = s.get("rust/done")
ok = (s.get("rust/set") == b"v" and s.get("rust/count") == b"12" and s.get("rust/app") == b"xy"
      and s.get("rust/cas") == b"two" and not s.check(["rust/deleted"]))
print("CHECKED", ok, s.num_keys(), flush=True)
"#;

#[tokio::test]
async fn our_client_against_pytorch_server() {
    require_torch!();
    let mut child = py()
        .args(["-c", PY_SERVER])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let port_line = tokio::time::timeout(LIMIT, lines.next_line())
        .await
        .expect("python printed its port")
        .unwrap()
        .expect("a port line");
    let addr = format!("127.0.0.1:{}", port_line.trim());

    let c = TcpStoreClient::connect(
        &addr,
        ClientConfig {
            timeout: LIMIT,
            ..ClientConfig::default()
        },
    )
    .await
    .unwrap();
    c.ping().await.unwrap();
    assert_eq!(c.get("py/hello").await.unwrap(), b"from-python");
    c.set("rust/set", b"v").await.unwrap();
    assert_eq!(c.add("rust/count", 10).await.unwrap(), 10);
    assert_eq!(c.add("rust/count", 2).await.unwrap(), 12);
    assert!(c.check(&["rust/set", "py/hello"]).await.unwrap());
    assert!(!c.check(&["absent"]).await.unwrap());
    c.wait(&["rust/set"], LIMIT).await.unwrap();
    assert_eq!(
        c.compare_set("rust/cas", b"", b"one").await.unwrap(),
        b"one"
    );
    assert_eq!(
        c.compare_set("rust/cas", b"one", b"two").await.unwrap(),
        b"two"
    );
    assert_eq!(
        c.compare_set("rust/cas", b"bad", b"three").await.unwrap(),
        b"two"
    );
    assert_eq!(c.compare_set("rust/nokey", b"e", b"d").await.unwrap(), b"e");
    c.set("rust/deleted", b"1").await.unwrap();
    assert!(c.delete_key("rust/deleted").await.unwrap());
    assert!(!c.delete_key("rust/deleted").await.unwrap());
    c.append("rust/app", b"x").await.unwrap();
    c.append("rust/app", b"y").await.unwrap();
    c.multi_set(&["rust/m1", "rust/m2"], &[b"1", b"2"])
        .await
        .unwrap();
    assert_eq!(
        c.multi_get(&["rust/m1", "rust/m2"]).await.unwrap(),
        vec![b"1".to_vec(), b"2".to_vec()]
    );
    // The wait-timeout path: CANCEL_WAIT against PyTorch's server, then the stream is in step.
    let err = c
        .wait(&["never"], Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
    // py/hello, rust/set, rust/count, rust/cas, rust/app, rust/m1, rust/m2
    assert_eq!(c.num_keys().await.unwrap(), 7);

    c.set("rust/done", b"1").await.unwrap();
    let checked = tokio::time::timeout(LIMIT, lines.next_line())
        .await
        .expect("python checked")
        .unwrap()
        .expect("a result line");
    assert_eq!(checked.trim(), "CHECKED True 8");
    let status = tokio::time::timeout(LIMIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
}

const PY_FILESTORE: &str = r#"
import sys
from datetime import timedelta
import torch.distributed as dist

s = dist.FileStore(sys.argv[1], -1)
s.set_timeout(timedelta(seconds=30))
s.set("py/k", "from-python")
s.add("shared/count", 5)
s.set("py/gone", "x")
s.delete_key("py/gone")
ok = s.get("rust/k") == b"from-rust"
s.add("shared/count", 1)
print("PYFILE", ok, s.get("shared/count").decode(), flush=True)
"#;

#[tokio::test]
async fn pytorch_file_store_shares_our_file_format() {
    require_torch!();
    let path = std::env::temp_dir().join(format!("tw-interop-file-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let ours = tensorwire_process_group::FileStore::with_timeout(&path, None, LIMIT);
    ours.set("rust/k", b"from-rust").await.unwrap();
    assert_eq!(ours.add("shared/count", 10).await.unwrap(), 10);
    let output = py()
        .args(["-c", PY_FILESTORE, path.to_str().unwrap()])
        .stderr(Stdio::inherit())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert_eq!(stdout.trim(), "PYFILE True 16");
    assert_eq!(ours.get("py/k").await.unwrap(), b"from-python");
    assert_eq!(ours.add("shared/count", 0).await.unwrap(), 16);
    assert!(!ours.check(&["py/gone"]).await.unwrap());
    std::fs::remove_file(&path).unwrap();
}

const PY_REFUSED: &str = r#"
import sys
from datetime import timedelta
import torch.distributed as dist
try:
    dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=2))
    print("CONNECTED", flush=True)
except Exception as e:
    print("REFUSED", type(e).__name__, flush=True)
"#;

#[tokio::test]
async fn a_server_with_a_secret_refuses_pytorch_clients() {
    require_torch!();
    let server = TcpStoreServer::bind(
        "127.0.0.1:0",
        ServerConfig {
            secret: tensorwire_process_group::Secret::new("s"),
            ..ServerConfig::default()
        },
    )
    .await
    .unwrap();
    let output = py()
        .args(["-c", PY_REFUSED, &server.local_addr().port().to_string()])
        .stderr(Stdio::null())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.starts_with("REFUSED"), "{stdout}");
}

const PY_RANK: &str = r#"
import sys
from datetime import timedelta
import torch.distributed as dist

port, rank, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
# What init_process_group("...", init_method="env://") does for this rank: a TCPStore with
# world_size, hosting the server on rank 0 and counting itself in under "init/".
s = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=(rank == 0),
                  timeout=timedelta(seconds=30), wait_for_workers=True)
s.set(f"rank/{rank}", "python")
print("PEER", s.get(f"rank/{1 - rank}").decode(), flush=True)
s.get("all-done")
"#;

async fn mixed_group(python_rank: usize) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = py()
        .args([
            "-c",
            PY_RANK,
            &port.to_string(),
            &python_rank.to_string(),
            "2",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let our_rank = 1 - python_rank;
    let env = move |name: &str| match name {
        "MASTER_ADDR" => Some("127.0.0.1".to_owned()),
        "MASTER_PORT" => Some(port.to_string()),
        "RANK" => Some(our_rank.to_string()),
        "WORLD_SIZE" => Some("2".to_owned()),
        _ => None,
    };
    let group = tensorwire_process_group::rendezvous::rendezvous_with_env(
        "env://",
        tensorwire_process_group::RendezvousOptions {
            timeout: LIMIT,
            ..Default::default()
        },
        env,
    )
    .await
    .unwrap();
    assert_eq!(group.rank, our_rank);
    group
        .store
        .set(&format!("rank/{our_rank}"), b"rust")
        .await
        .unwrap();
    assert_eq!(
        group
            .store
            .get(&format!("rank/{python_rank}"))
            .await
            .unwrap(),
        b"python"
    );
    // Python read our key before it waits for "all-done".
    let mut lines = BufReader::new(child.stdout.unwrap()).lines();
    let peer = tokio::time::timeout(LIMIT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(peer, "PEER rust");
    group.store.set("all-done", b"1").await.unwrap();
}

#[tokio::test]
async fn mixed_group_with_our_rank_zero_hosting() {
    require_torch!();
    mixed_group(1).await;
}

#[tokio::test]
async fn mixed_group_with_pytorch_rank_zero_hosting() {
    require_torch!();
    mixed_group(0).await;
}

/// Runs one sequence of operations and prints every result; run against PyTorch's server and
/// against ours, the outputs must be identical.
const PY_DIFFERENTIAL: &str = r#"
import sys, threading
from datetime import timedelta
import torch.distributed as dist

if sys.argv[1] == "own":
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
else:
    s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=20))
def show(label, f):
    try:
        print(label, repr(f()), flush=True)
    except Exception as e:
        print(label, "raised", type(e).__name__, flush=True)
show("add", lambda: [s.add("n", 3), s.add("n", -10), s.get("n")])
show("set-get", lambda: [s.set("k", b"\x00\xffbin"), s.get("k")])
show("cas-missing", lambda: s.compare_set("c", "x", "y"))
show("cas-create", lambda: s.compare_set("c", "", "y"))
show("cas-wrong", lambda: s.compare_set("c", "z", "w"))
show("cas-right", lambda: s.compare_set("c", "y", "w"))
show("append", lambda: [s.append("ap", "1"), s.append("ap", "2"), s.get("ap")])
show("multi", lambda: [s.multi_set(["m1", "m2"], ["a", "b"]), s.multi_get(["m2", "m1"])])
show("check", lambda: [s.check(["k", "n"]), s.check(["k", "zz"]), s.check([])])
show("delete", lambda: [s.delete_key("m1"), s.delete_key("m1")])
show("num_keys", lambda: s.num_keys())
show("list_keys", lambda: sorted(s.list_keys()))
show("wait-timeout", lambda: s.wait(["never"], timedelta(milliseconds=100)))
show("after-timeout", lambda: s.get("k"))
show("queue", lambda: [s.queue_push("q", "a"), s.queue_push("q", "b"), s.queue_len("q"),
                        s.queue_pop("q"), s.queue_pop("q", block=False), s.queue_len("q")])
show("queue-empty", lambda: s.queue_pop("q", block=False))
show("queue-counts", lambda: [s.num_keys(), s.check(["q"])])
def later():
    t = dist.TCPStore("127.0.0.1", s.port, is_master=False, timeout=timedelta(seconds=20))
    t.queue_push("q2", "late")
threading.Timer(0.2, later).start()
show("queue-blocking", lambda: s.queue_pop("q2"))
show("add-on-text", lambda: s.add("k", 1))
"#;

#[tokio::test]
async fn same_results_from_pytorchs_server_and_ours() {
    require_torch!();
    let server = TcpStoreServer::bind("127.0.0.1:0", ServerConfig::default())
        .await
        .unwrap();
    let run = |arg: String| async move {
        let out = py()
            .args(["-c", PY_DIFFERENTIAL, &arg])
            .stderr(Stdio::null())
            .output()
            .await
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let theirs = run("own".to_owned()).await;
    let ours = run(server.local_addr().port().to_string()).await;
    eprintln!("PyTorch's server:\n{theirs}\nours:\n{ours}");
    assert!(theirs.contains("queue-blocking b'late'"), "{theirs}");
    let theirs: Vec<&str> = theirs.lines().collect();
    let ours: Vec<&str> = ours.lines().collect();
    assert_eq!(theirs.len(), 19, "{theirs:?}");
    for (t, o) in theirs.iter().zip(&ours) {
        assert_eq!(t, o);
    }
    assert_eq!(theirs.len(), ours.len());
}
