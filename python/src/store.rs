//! The store c10d hands a backend (a `PrefixStore` over a `TCPStore`, a `FileStore`, ...), seen
//! from Rust as a [`Store`]: each call runs the Python object's own method on a blocking thread
//! with the GIL, so tensorwire meets its peers through whatever store the user chose.

use std::time::Duration;

use async_trait::async_trait;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use tensorwire_core::ports::store::{Store, StoreError};

/// A c10d `Store` object of Python's.
pub(crate) struct PyStore {
    store: Py<PyAny>,
    timeout: Duration,
}

impl PyStore {
    pub(crate) fn new(store: Py<PyAny>, timeout: Duration) -> Self {
        PyStore { store, timeout }
    }

    /// Runs `f` on the store with the GIL, on a blocking thread (a store call may wait).
    async fn call<T, F>(&self, what: &'static str, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T> + Send + 'static,
    {
        let store = Python::attach(|py| self.store.clone_ref(py));
        tokio::task::spawn_blocking(move || {
            Python::attach(|py| f(store.bind(py)).map_err(|e| failed(py, what, e)))
        })
        .await
        .unwrap_or_else(|e| Err(failed_reason(what, e.to_string())))
    }
}

fn failed_reason(what: &str, reason: String) -> StoreError {
    StoreError::Connection {
        addr: format!("the store c10d passed ({what})"),
        reason,
    }
}

/// A Python exception from the store as a [`StoreError`]: a timeout stays a timeout (c10d
/// raises `DistStoreError` whose message says so), anything else names the call.
fn failed(py: Python<'_>, what: &'static str, e: PyErr) -> StoreError {
    let reason = e
        .value(py)
        .str()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "an exception that cannot be shown".to_owned());
    failed_reason(what, reason)
}

fn bytes_of(value: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    value.extract::<Vec<u8>>()
}

fn timedelta<'py>(py: Python<'py>, d: Duration) -> PyResult<Bound<'py, PyAny>> {
    py.import("datetime")?
        .getattr("timedelta")?
        .call1((0, d.as_secs(), d.subsec_micros()))
}

#[async_trait]
impl Store for PyStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let (key, value) = (key.to_owned(), value.to_vec());
        self.call("set", move |s| {
            s.call_method1("set", (key, PyBytes::new(s.py(), &value)))
                .map(|_| ())
        })
        .await
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let key = key.to_owned();
        self.call("get", move |s| bytes_of(&s.call_method1("get", (key,))?))
            .await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let key = key.to_owned();
        self.call("add", move |s| {
            s.call_method1("add", (key, delta))?.extract()
        })
        .await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        self.call("check", move |s| {
            s.call_method1("check", (keys,))?.extract()
        })
        .await
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let waited = keys.clone();
        let result = self
            .call("wait", move |s| {
                let t = timedelta(s.py(), timeout)?;
                s.call_method1("wait", (keys, t)).map(|_| ())
            })
            .await;
        // c10d's wait raises on its deadline; the port's callers tell a timeout by its kind.
        result.map_err(|_| StoreError::Timeout {
            keys: waited,
            timeout,
        })
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let (key, expected, desired) = (key.to_owned(), expected.to_vec(), desired.to_vec());
        self.call("compare_set", move |s| {
            let py = s.py();
            bytes_of(&s.call_method1(
                "compare_set",
                (key, PyBytes::new(py, &expected), PyBytes::new(py, &desired)),
            )?)
        })
        .await
    }

    async fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let key = key.to_owned();
        self.call("delete_key", move |s| {
            s.call_method1("delete_key", (key,))?.extract()
        })
        .await
    }

    async fn num_keys(&self) -> Result<i64, StoreError> {
        self.call("num_keys", |s| s.call_method0("num_keys")?.extract())
            .await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let (key, value) = (key.to_owned(), value.to_vec());
        self.call("append", move |s| {
            s.call_method1("append", (key, PyBytes::new(s.py(), &value)))
                .map(|_| ())
        })
        .await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>, StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        self.call("multi_get", move |s| {
            let values = s.call_method1("multi_get", (keys,))?;
            values.try_iter()?.map(|v| bytes_of(&v?)).collect()
        })
        .await
    }

    async fn multi_set(&self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let values: Vec<Vec<u8>> = values.iter().map(|v| v.to_vec()).collect();
        self.call("multi_set", move |s| {
            let py = s.py();
            let values = PyList::new(py, values.iter().map(|v| PyBytes::new(py, v)))?;
            s.call_method1("multi_set", (keys, values)).map(|_| ())
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
        self.timeout
    }
}
