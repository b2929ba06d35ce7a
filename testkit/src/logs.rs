//! Capturing what a test's log subscriber writes.

use std::sync::{Arc, Mutex, PoisonError};

/// A log writer into a shared buffer: hand clones to a subscriber
/// (`tracing_subscriber::fmt().with_writer(move || logs.clone())`), read it back with
/// [`text`](Self::text).
#[derive(Debug, Clone, Default)]
pub struct CapturedLogs(Arc<Mutex<Vec<u8>>>);

impl CapturedLogs {
    /// Everything written so far (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }
}

impl std::io::Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn clones_write_into_one_buffer() {
        let logs = CapturedLogs::default();
        let mut a = logs.clone();
        let mut b = logs.clone();
        write!(a, "one ").unwrap();
        write!(b, "two").unwrap();
        assert_eq!(logs.text(), "one two");
    }
}
