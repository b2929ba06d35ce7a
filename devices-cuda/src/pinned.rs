//! Pooled pinned host buffers handed out as [`Bytes`].
//!
//! A device-to-host copy of a large buffer lands directly in pinned (page-locked) memory, which
//! the DMA engine writes at full speed, and that memory is returned to the caller as `Bytes`.
//! When the last `Bytes` referencing it is dropped, the buffer goes back to the pool for the
//! next copy (up to a cap of idle bytes), much like PyTorch's caching host allocator. Because
//! the pool knows every range it allocated, a host-to-device copy whose source lies in one of
//! its buffers (a tensor that just came off a device) is copied by DMA without staging.

use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use cudarc::driver::{sys, CudaContext, DriverError, PinnedHostSlice};

/// Allocation granularity of pooled buffers.
const GRANULE: usize = 1 << 20;

/// Pinned buffers for device-to-host outputs.
pub(crate) struct HostPool {
    /// Idle buffers, ready for reuse.
    idle: Mutex<Vec<PinnedHostSlice<u8>>>,
    /// Most idle bytes kept; beyond, returned buffers are freed.
    cap: usize,
    /// Address ranges `[start, end)` of every buffer this pool has allocated and not freed.
    ranges: Mutex<Vec<(usize, usize)>>,
}

impl HostPool {
    pub(crate) fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            idle: Mutex::new(Vec::new()),
            cap,
            ranges: Mutex::new(Vec::new()),
        })
    }

    /// A pinned buffer of at least `len` bytes: an idle one no more than twice as large, or a
    /// new one.
    pub(crate) fn take(
        &self,
        ctx: &Arc<CudaContext>,
        len: usize,
    ) -> Result<PinnedHostSlice<u8>, DriverError> {
        {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let best = idle
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len && b.len() <= len.saturating_mul(2).max(GRANULE))
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                return Ok(idle.swap_remove(i));
            }
        }
        let size = len.next_multiple_of(GRANULE);
        // SAFETY: the memory is uninitialised; it is only read after a copy fills it.
        let buf =
            unsafe { ctx.alloc_pinned_with_flags::<u8>(size, sys::CU_MEMHOSTALLOC_PORTABLE) }?;
        let start = buf.as_ptr()? as usize;
        self.ranges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((start, start + size));
        Ok(buf)
    }

    /// Takes back a buffer whose copies are complete.
    pub(crate) fn give_back(&self, buf: PinnedHostSlice<u8>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = idle.iter().map(|b| b.len()).sum();
        if held + buf.len() <= self.cap {
            idle.push(buf);
            return;
        }
        drop(idle);
        self.forget(&buf);
        drop(buf);
    }

    /// Drops a buffer whose state is unknown (after a failed copy): it is freed, not reused.
    pub(crate) fn discard(&self, buf: PinnedHostSlice<u8>) {
        self.forget(&buf);
        drop(buf);
    }

    fn forget(&self, buf: &PinnedHostSlice<u8>) {
        if let Ok(p) = buf.as_ptr() {
            let start = p as usize;
            self.ranges
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|&(s, _)| s != start);
        }
    }

    /// Whether `bytes` lies inside a pinned buffer of this pool.
    pub(crate) fn contains(&self, bytes: &[u8]) -> bool {
        let (start, end) = (
            bytes.as_ptr() as usize,
            bytes.as_ptr() as usize + bytes.len(),
        );
        self.ranges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|&(s, e)| s <= start && end <= e)
    }

    /// Hands the first `len` bytes of `buf` (filled, copies complete) out as `Bytes`.
    pub(crate) fn into_bytes(
        self: &Arc<Self>,
        buf: PinnedHostSlice<u8>,
        len: usize,
    ) -> Result<Bytes, DriverError> {
        let ptr = buf.as_ptr()? as usize;
        Ok(Bytes::from_owner(PinnedBytes {
            buf: Some(buf),
            ptr,
            len,
            pool: Arc::downgrade(self),
        }))
    }
}

/// The owner behind `Bytes` from [`HostPool::into_bytes`].
struct PinnedBytes {
    buf: Option<PinnedHostSlice<u8>>,
    ptr: usize,
    len: usize,
    pool: Weak<HostPool>,
}

impl AsRef<[u8]> for PinnedBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` lies in `buf`, which lives as long as `self`; the copy that
        // filled it completed before `self` was made, and nothing writes it while lent.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            match self.pool.upgrade() {
                Some(pool) => pool.give_back(buf),
                None => drop(buf),
            }
        }
    }
}
