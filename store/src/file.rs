//! A [`Store`] in a file shared by processes (`file:///path`), in PyTorch `FileStore`'s format.
//!
//! The file is an append-only log of records, each a key and a value written as a `u32` length
//! (host byte order) followed by the bytes. User keys carry the prefix `/`; a deletion appends
//! the key with a further `-` prefix (`-/key`) and an empty value; `add` appends the new decimal
//! value. Every operation opens the file and takes `flock(2)`: exclusive to append, shared to
//! read, so several processes (PyTorch's `FileStore` among them) can share one file. Each
//! handle keeps a cache of the log and reads only what was appended since.
//!
//! Waiting (`get`, `wait`) polls the file with a short backoff (1 ms doubling to 10 ms), as
//! PyTorch does: change notification does not work on shared file systems such as NFS.
//!
//! `barrier` is PyTorch `FileStore`'s (c10d's default `Store::barrier`), so that PyTorch's
//! processes and ours can meet at one: an arrival adds one to `KEY/num_members`, the arrival
//! that brings it to the world size sets `KEY/last_member`, and every arrival waits for
//! `KEY/last_member`. A world size of 1 or less is met by the first arrival (PyTorch's would
//! wait for a count it never reaches).
//!
//! A record cut short at the end of the file (its writer died mid-append; every writer holds
//! the exclusive lock, so no live writer's record is ever seen half-written) was never
//! acknowledged to anyone: readers ignore it, and the next writer truncates it away before
//! appending, with a warning naming the offset. PyTorch's `FileStore` fails on such a file until
//! it is removed; we recover, since no completed operation is lost.
//!
//! When opened with a world size, dropping the store counts the handle out under the key
//! `cleanup/` and the last of `world_size` handles removes the file, as PyTorch does.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rustix::fs::{flock, FlockOperation};
use tensorwire_core::ports::store::{Store, StoreError};

use crate::in_memory::check_multi_set;
use crate::protocol::parse_c10d_int;
use crate::DEFAULT_TIMEOUT;

const REGULAR_PREFIX: &str = "/";
const DELETE_PREFIX: &str = "-";
const CLEANUP_KEY: &str = "cleanup/";

/// A store in a file; clones share one cache. See the [module documentation](self).
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use tensorwire_core::ports::store::Store;
/// use tensorwire_store::FileStore;
///
/// let path = std::env::temp_dir().join(format!("tw-doc-{}", std::process::id()));
/// let a = FileStore::new(&path, None);
/// let b = FileStore::new(&path, None); // another process would do the same
/// a.set("k", b"v").await.unwrap();
/// assert_eq!(b.get("k").await.unwrap(), b"v");
/// # std::fs::remove_file(&path).unwrap();
/// # });
/// ```
#[derive(Clone)]
pub struct FileStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    cache: Mutex<Cache>,
    timeout: Duration,
    world_size: Option<usize>,
}

#[derive(Default)]
struct Cache {
    pos: u64,
    map: HashMap<Vec<u8>, Vec<u8>>,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.inner.path)
            .field("world_size", &self.inner.world_size)
            .finish_non_exhaustive()
    }
}

impl FileStore {
    /// A store in `path` (created on first write), with the default timeout. With
    /// `world_size`, the last of that many handles to be dropped removes the file.
    pub fn new(path: impl AsRef<Path>, world_size: Option<usize>) -> Self {
        Self::with_timeout(path, world_size, DEFAULT_TIMEOUT)
    }

    /// Like [`new`](FileStore::new) with the timeout of `get` and `multi_get`.
    pub fn with_timeout(
        path: impl AsRef<Path>,
        world_size: Option<usize>,
        timeout: Duration,
    ) -> Self {
        FileStore {
            inner: Arc::new(Inner {
                path: path.as_ref().to_path_buf(),
                cache: Mutex::new(Cache::default()),
                timeout,
                world_size,
            }),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| StoreError::File {
                path: self.inner.path.display().to_string(),
                reason: format!("file operation task failed: {e}"),
            })?
    }

    async fn poll_until<T: Send + 'static>(
        &self,
        keys: &[&str],
        timeout: Duration,
        probe: impl Fn(&Inner) -> Result<Option<T>, StoreError> + Send + Sync + 'static,
    ) -> Result<T, StoreError> {
        let probe = Arc::new(probe);
        let started = Instant::now();
        // The one backoff-with-jitter helper: ranks polling one file spread out.
        let mut backoff =
            crate::backoff::Backoff::new(Duration::from_millis(1), Duration::from_millis(10));
        loop {
            let p = probe.clone();
            if let Some(v) = self.run(move |inner| p(inner)).await? {
                return Ok(v);
            }
            if started.elapsed() >= timeout {
                return Err(StoreError::timeout(keys, timeout));
            }
            let delay = backoff.next_delay();
            tokio::time::sleep(delay.min(timeout.saturating_sub(started.elapsed()))).await;
        }
    }
}

fn regular(key: &str) -> Vec<u8> {
    format!("{REGULAR_PREFIX}{key}").into_bytes()
}

impl Inner {
    fn err(&self, what: &str, e: impl std::fmt::Display) -> StoreError {
        StoreError::File {
            path: self.path.display().to_string(),
            reason: format!("{what}: {e}"),
        }
    }

    /// Opens the file and locks it; the lock is released when the file is closed.
    fn open(&self, exclusive: bool) -> Result<File, StoreError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.path)
            .map_err(|e| self.err("open", e))?;
        let op = if exclusive {
            FlockOperation::LockExclusive
        } else {
            FlockOperation::LockShared
        };
        loop {
            match flock(&file, op) {
                Ok(()) => return Ok(file),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(self.err("flock", e)),
            }
        }
    }

    /// Reads the records appended since the last refresh into the cache. A torn last record is
    /// ignored; holding the exclusive lock (`writer`), it is also cut off the file, so that the
    /// next record starts where the last complete one ended.
    fn refresh(&self, file: &mut File, cache: &mut Cache, writer: bool) -> Result<(), StoreError> {
        let size = file.metadata().map_err(|e| self.err("stat", e))?.len();
        if size == cache.pos {
            return Ok(());
        }
        if size < cache.pos {
            // The file was removed and recreated: start over.
            *cache = Cache::default();
        }
        file.seek(SeekFrom::Start(cache.pos))
            .map_err(|e| self.err("seek", e))?;
        let mut rest = Vec::with_capacity((size - cache.pos) as usize);
        file.take(size - cache.pos)
            .read_to_end(&mut rest)
            .map_err(|e| self.err("read", e))?;
        let mut at = 0usize;
        let field = |at: &mut usize| -> Option<Vec<u8>> {
            let len = u32::from_ne_bytes(rest.get(*at..*at + 4)?.try_into().ok()?) as usize;
            let bytes = rest.get(*at + 4..*at + 4 + len)?.to_vec();
            *at += 4 + len;
            Some(bytes)
        };
        while at < rest.len() {
            let record_at = cache.pos + at as u64;
            let (Some(key), Some(value)) = (field(&mut at), field(&mut at)) else {
                // Only a writer that died mid-append leaves this: every writer holds the
                // exclusive lock, and this handle holds a lock too.
                if writer {
                    file.set_len(record_at)
                        .map_err(|e| self.err("truncate a torn record", e))?;
                    tracing::warn!(
                        path = %self.path.display(),
                        offset = record_at,
                        bytes = size - record_at,
                        "file store: removed a torn last record (its writer died mid-append)"
                    );
                }
                cache.pos = record_at;
                return Ok(());
            };
            if let Some(deleted) = key.strip_prefix(DELETE_PREFIX.as_bytes()) {
                cache.map.remove(deleted);
            } else {
                cache.map.insert(key, value);
            }
        }
        cache.pos = size;
        Ok(())
    }

    fn append_record(&self, file: &mut File, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        let too_big = |what: &str, len: usize| {
            self.err(
                "write",
                format!("{what} of {len} bytes does not fit the u32 length field"),
            )
        };
        let klen = u32::try_from(key.len()).map_err(|_| too_big("key", key.len()))?;
        let vlen = u32::try_from(value.len()).map_err(|_| too_big("value", value.len()))?;
        let mut record = Vec::with_capacity(8 + key.len() + value.len());
        record.extend_from_slice(&klen.to_ne_bytes());
        record.extend_from_slice(key);
        record.extend_from_slice(&vlen.to_ne_bytes());
        record.extend_from_slice(value);
        file.seek(SeekFrom::End(0))
            .map_err(|e| self.err("seek", e))?;
        file.write_all(&record).map_err(|e| self.err("write", e))
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on a refreshed cache under the file lock.
    fn locked<T>(
        &self,
        exclusive: bool,
        f: impl FnOnce(&Self, &mut File, &mut Cache) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut cache = self.cache();
        let mut file = self.open(exclusive)?;
        self.refresh(&mut file, &mut cache, exclusive)?;
        f(self, &mut file, &mut cache)
    }

    fn add_raw(&self, key: Vec<u8>, delta: i64, shown: &str) -> Result<i64, StoreError> {
        self.locked(true, |this, file, cache| {
            let current = match cache.map.get(&key) {
                Some(v) if !v.is_empty() => {
                    parse_c10d_int(v).ok_or_else(|| StoreError::NotAnInteger {
                        key: shown.to_owned(),
                        value: String::from_utf8_lossy(v).chars().take(64).collect(),
                    })?
                }
                _ => 0,
            };
            let sum = current
                .checked_add(delta)
                .ok_or_else(|| StoreError::InvalidArgument {
                    reason: format!("add on key {shown:?} overflows a 64-bit integer"),
                })?;
            this.append_record(file, &key, sum.to_string().as_bytes())?;
            Ok(sum)
        })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let Some(world_size) = self.world_size else {
            return;
        };
        if !self.path.exists() {
            return;
        }
        match self.add_raw(CLEANUP_KEY.as_bytes().to_vec(), 1, CLEANUP_KEY) {
            Ok(n) if n as usize == world_size => {
                let _ = std::fs::remove_file(&self.path);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "file store cleanup failed"),
        }
    }
}

#[async_trait]
impl Store for FileStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let (key, value) = (regular(key), value.to_vec());
        self.run(move |inner| {
            inner.locked(true, |this, file, _| this.append_record(file, &key, &value))
        })
        .await
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let full = regular(key);
        self.poll_until(&[key], self.inner.timeout, move |inner| {
            inner.locked(false, |_, _, cache| Ok(cache.map.get(&full).cloned()))
        })
        .await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let (full, shown) = (regular(key), key.to_owned());
        self.run(move |inner| inner.add_raw(full, delta, &shown))
            .await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let full: Vec<Vec<u8>> = keys.iter().map(|k| regular(k)).collect();
        self.run(move |inner| {
            inner.locked(false, |_, _, cache| {
                Ok(full.iter().all(|k| cache.map.contains_key(k)))
            })
        })
        .await
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let full: Vec<Vec<u8>> = keys.iter().map(|k| regular(k)).collect();
        self.poll_until(keys, timeout, move |inner| {
            inner.locked(false, |_, _, cache| {
                Ok(full.iter().all(|k| cache.map.contains_key(k)).then_some(()))
            })
        })
        .await
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let (full, expected, desired) = (regular(key), expected.to_vec(), desired.to_vec());
        self.run(move |inner| {
            inner.locked(true, |this, file, cache| match cache.map.get(&full) {
                None if expected.is_empty() => {
                    this.append_record(file, &full, &desired)?;
                    Ok(desired)
                }
                None => Ok(expected),
                Some(current) if *current == expected => {
                    this.append_record(file, &full, &desired)?;
                    Ok(desired)
                }
                Some(current) => Ok(current.clone()),
            })
        })
        .await
    }

    async fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let full = regular(key);
        self.run(move |inner| {
            inner.locked(true, |this, file, cache| {
                let existed = cache.map.contains_key(&full);
                let mut tombstone = DELETE_PREFIX.as_bytes().to_vec();
                tombstone.extend_from_slice(&full);
                this.append_record(file, &tombstone, &[])?;
                Ok(existed)
            })
        })
        .await
    }

    async fn num_keys(&self) -> Result<i64, StoreError> {
        self.run(|inner| inner.locked(false, |_, _, cache| Ok(cache.map.len() as i64)))
            .await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let (full, value) = (regular(key), value.to_vec());
        self.run(move |inner| {
            inner.locked(true, |this, file, cache| {
                let mut joined = cache.map.get(&full).cloned().unwrap_or_default();
                joined.extend_from_slice(&value);
                this.append_record(file, &full, &joined)
            })
        })
        .await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        let full: Vec<Vec<u8>> = keys.iter().map(|k| regular(k)).collect();
        self.poll_until(keys, self.inner.timeout, move |inner| {
            inner.locked(false, |_, _, cache| {
                Ok(full
                    .iter()
                    .map(|k| cache.map.get(k).cloned())
                    .collect::<Option<Vec<_>>>())
            })
        })
        .await
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
        check_multi_set(keys, values)?;
        let pairs: Vec<(Vec<u8>, Vec<u8>)> = keys
            .iter()
            .zip(values)
            .map(|(k, v)| (regular(k), v.to_vec()))
            .collect();
        self.run(move |inner| {
            inner.locked(true, |this, file, _| {
                pairs
                    .iter()
                    .try_for_each(|(k, v)| this.append_record(file, k, v))
            })
        })
        .await
    }

    async fn barrier(
        &self,
        key: &str,
        world_size: i64,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        tensorwire_core::ports::store::barrier_by_counting(self, key, world_size, timeout).await
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("tw-filestore-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    #[tokio::test]
    async fn a_torn_last_record_is_ignored_by_readers_and_cut_off_by_the_next_writer() {
        let path = temp("torn");
        let s = FileStore::with_timeout(&path, None, Duration::ZERO);
        s.set("done", b"1").await.unwrap();
        let complete = std::fs::metadata(&path).unwrap().len();
        // A writer that died after the key and half of the value's length field.
        let mut torn = Vec::new();
        torn.extend_from_slice(&5u32.to_ne_bytes());
        torn.extend_from_slice(b"/half");
        torn.extend_from_slice(&[7, 0]);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(&torn)
            .unwrap();
        // A fresh handle (another process) reads the complete records and not the torn one.
        let reader = FileStore::with_timeout(&path, None, Duration::ZERO);
        assert_eq!(reader.get("done").await.unwrap(), b"1");
        assert!(!reader.check(&["half"]).await.unwrap());
        assert_eq!(reader.num_keys().await.unwrap(), 1);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            complete + torn.len() as u64
        );
        // The next write cuts the torn bytes off and lands right after the last complete record.
        reader.set("next", b"2").await.unwrap();
        let record = 4 + "/next".len() as u64 + 4 + 1;
        assert_eq!(std::fs::metadata(&path).unwrap().len(), complete + record);
        for h in [
            &s,
            &reader,
            &FileStore::with_timeout(&path, None, Duration::ZERO),
        ] {
            assert_eq!(h.get("next").await.unwrap(), b"2");
            assert_eq!(h.get("done").await.unwrap(), b"1");
            assert_eq!(h.num_keys().await.unwrap(), 2);
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[tokio::test]
    async fn the_command_set_and_pytorch_layout() {
        let path = temp("cmds");
        let s = FileStore::with_timeout(&path, None, Duration::from_secs(5));
        s.set("k", b"v").await.unwrap();
        assert_eq!(s.add("n", 4).await.unwrap(), 4);
        assert_eq!(s.add("n", 1).await.unwrap(), 5);
        assert_eq!(s.get("n").await.unwrap(), b"5");
        assert!(s.check(&["k", "n"]).await.unwrap());
        assert_eq!(s.compare_set("c", b"x", b"y").await.unwrap(), b"x");
        assert_eq!(s.compare_set("c", b"", b"y").await.unwrap(), b"y");
        assert_eq!(s.compare_set("c", b"y", b"z").await.unwrap(), b"z");
        s.append("a", b"1").await.unwrap();
        s.append("a", b"2").await.unwrap();
        s.multi_set(&["m", "o"], &[b"M", b"O"]).await.unwrap();
        assert_eq!(
            s.multi_get(&["a", "m", "o"]).await.unwrap(),
            vec![b"12".to_vec(), b"M".to_vec(), b"O".to_vec()]
        );
        assert_eq!(s.num_keys().await.unwrap(), 6);
        assert!(s.delete_key("k").await.unwrap());
        assert!(!s.check(&["k"]).await.unwrap());
        assert_eq!(s.num_keys().await.unwrap(), 5);

        // The first record is PyTorch's: u32 length, "/k", u32 length, "v".
        let bytes = std::fs::read(&path).unwrap();
        let mut first = 2u32.to_ne_bytes().to_vec();
        first.extend_from_slice(b"/k");
        first.extend_from_slice(&1u32.to_ne_bytes());
        first.extend_from_slice(b"v");
        assert_eq!(&bytes[..first.len()], first.as_slice());
        std::fs::remove_file(&path).unwrap();
    }

    #[tokio::test]
    async fn barrier_across_handles_in_pytorchs_layout() {
        let path = temp("barrier");
        let limit = Duration::from_secs(30);
        let early: Vec<_> = (0..2)
            .map(|_| {
                let s = FileStore::new(&path, None);
                tokio::spawn(async move { s.barrier("fb", 3, limit).await })
            })
            .collect();
        let s = FileStore::new(&path, None);
        s.barrier("fb", 3, limit).await.unwrap();
        for arrival in early {
            arrival.await.unwrap().unwrap();
        }
        assert_eq!(s.get("fb/num_members").await.unwrap(), b"3");
        assert_eq!(s.get("fb/last_member").await.unwrap(), b"1");
        assert_eq!(s.num_keys().await.unwrap(), 2);
        // Reused: goes through at once and counts on.
        s.barrier("fb", 3, limit).await.unwrap();
        assert_eq!(s.get("fb/num_members").await.unwrap(), b"4");
        s.barrier("alone", 0, limit).await.unwrap();

        let err = s
            .barrier("lonely", 2, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert_eq!(
            err,
            StoreError::BarrierTimeout {
                key: "lonely".into(),
                world_size: 2,
                timeout: Duration::from_millis(50)
            }
        );
        // The arrival that timed out has counted: one more meets the barrier.
        s.barrier("lonely", 2, limit).await.unwrap();
        std::fs::remove_file(&path).unwrap();
    }

    #[tokio::test]
    async fn get_waits_for_another_handle_and_times_out_naming_the_key() {
        let path = temp("wait");
        let a = FileStore::with_timeout(&path, None, Duration::from_millis(100));
        let b = FileStore::new(&path, None);
        assert!(
            matches!(a.get("late").await, Err(StoreError::Timeout { keys, .. }) if keys == ["late"])
        );
        let getter = {
            let a = FileStore::with_timeout(&path, None, Duration::from_secs(10));
            tokio::spawn(async move { a.get("late").await })
        };
        b.set("late", b"now").await.unwrap();
        assert_eq!(getter.await.unwrap().unwrap(), b"now");
        assert!(matches!(
            b.add("late", 1).await,
            Err(StoreError::NotAnInteger { .. })
        ));
        std::fs::remove_file(&path).unwrap();
    }

    #[tokio::test]
    async fn the_last_of_world_size_handles_removes_the_file() {
        let path = temp("cleanup");
        let a = FileStore::new(&path, Some(2));
        let b = FileStore::new(&path, Some(2));
        a.set("k", b"v").await.unwrap();
        drop(a);
        assert!(path.exists());
        assert_eq!(b.get("k").await.unwrap(), b"v");
        drop(b);
        assert!(!path.exists());
    }

    #[test]
    fn threads_hammering_add_lose_no_increment() {
        let path = temp("threads");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    // A handle per thread: separate caches and file descriptors, like processes.
                    let s = FileStore::new(&path, None);
                    rt.block_on(async {
                        for _ in 0..50 {
                            s.add("n", 1).await.unwrap();
                        }
                    });
                });
            }
        });
        let s = FileStore::new(&path, None);
        assert_eq!(rt.block_on(s.get("n")).unwrap(), b"200");
        std::fs::remove_file(&path).unwrap();
    }
}
