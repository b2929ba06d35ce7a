//! The functions every multi-process RPC worker serves (`tw-rpc-worker`, `tw-chaos-worker`):
//! arithmetic, a worker's rank, a slow call, a counter held in a remote reference, and a vector
//! passed by reference.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tensorwire_rpc::{Functions, RRef};

/// A counter owned by one worker and incremented through its remote references.
pub struct Counter(pub AtomicI64);

impl serde::Serialize for Counter {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.load(Ordering::SeqCst).serialize(s)
    }
}

/// Registers the shared workload on `f`: `add`, `whoami` (the `RANK` variable), `sleep_ms`,
/// `make_counter`, the method `increment`, `make_vec` and `sum_rref`.
pub fn register(f: &Functions) {
    const ONCE: &str = "each name is registered once";
    f.register(
        "add",
        |(a, b): (i64, i64)| async move { Ok::<_, String>(a + b) },
    )
    .expect(ONCE);
    f.register("whoami", |(): ()| async move {
        Ok::<_, String>(std::env::var("RANK").unwrap_or_default())
    })
    .expect(ONCE);
    f.register("sleep_ms", |ms: u64| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, String>(ms)
    })
    .expect(ONCE);
    f.register("make_counter", |start: i64| async move {
        Ok::<_, String>(Counter(AtomicI64::new(start)))
    })
    .expect(ONCE);
    f.register_method("increment", |c: Arc<Counter>, by: i64| async move {
        Ok::<_, String>(c.0.fetch_add(by, Ordering::SeqCst) + by)
    })
    .expect(ONCE);
    f.register("make_vec", |n: i64| async move {
        Ok::<_, String>((0..n).collect::<Vec<i64>>())
    })
    .expect(ONCE);
    f.register("sum_rref", |r: RRef<Vec<i64>>| async move {
        let v = r.to_here(None).await.map_err(|e| e.to_string())?;
        Ok::<_, String>(v.iter().sum::<i64>())
    })
    .expect(ONCE);
}
