//! The file store shared by real OS processes: this test binary re-runs itself as children.

use std::process::{Command, Stdio};
use std::time::Duration;

use tensorwire_store::{FileStore, Store};

const CHILD_ENV: &str = "TW_FILESTORE_CHILD_PATH";
const ADDS_PER_PROCESS: i64 = 100;

/// Not a test of its own: the body each child process runs (it returns at once otherwise).
#[test]
fn child_entry() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = FileStore::with_timeout(&path, None, Duration::from_secs(30));
        let mut last = 0;
        for _ in 0..ADDS_PER_PROCESS {
            let now = store.add("counter", 1).await.unwrap();
            assert!(now > last, "add went backwards: {last} then {now}");
            last = now;
        }
        store
            .set(&format!("done/{}", std::process::id()), b"1")
            .await
            .unwrap();
    });
}

#[test]
fn processes_hammering_add_lose_no_increment() {
    let path = std::env::temp_dir().join(format!("tw-filestore-procs-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..4)
        .map(|_| {
            Command::new(&exe)
                .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, &path)
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    // The parent adds concurrently too.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = FileStore::with_timeout(&path, None, Duration::from_secs(30));
    rt.block_on(async {
        for _ in 0..ADDS_PER_PROCESS {
            store.add("counter", 1).await.unwrap();
        }
    });
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
    rt.block_on(async {
        assert_eq!(
            store.get("counter").await.unwrap(),
            (5 * ADDS_PER_PROCESS).to_string().as_bytes()
        );
        let done: Vec<String> = pids.iter().map(|p| format!("done/{p}")).collect();
        let done: Vec<&str> = done.iter().map(String::as_str).collect();
        assert!(store.check(&done).await.unwrap());
    });
    std::fs::remove_file(&path).unwrap();
}
