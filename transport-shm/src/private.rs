//! Received bytes that lie in a peer's slab, as writable memory of the receiver's own without
//! a copy: a copy-on-write (`MAP_PRIVATE`) mapping of the slab's pages, see [`private_view`].
//!
//! A received frame's bytes are handed up as immutable [`Bytes`] over the read-only mapping of
//! the sender's slab. A layer above that must give its user writable memory (a tensor) would
//! copy them. Instead it may ask for a private mapping of the same pages: reads see the slab's
//! bytes without a copy, and a write copies only the page written, into memory of ours. The
//! view keeps the frame's bytes referenced, so the sender does not write the slab again until
//! the view is gone.
//!
//! The receiving connections register their peers' slabs here (address range and memfd): the
//! `Bytes` handed up name no owner that a caller could ask, so the address is what says whether
//! bytes lie in a slab (one line of why: `bytes` offers no downcast of its owner).

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;

use crate::mem::Mapping;

/// Bytes shorter than this are copied: a mapping of their own costs two system calls and the
/// page-table work, which a copy of fewer bytes beats.
pub const PRIVATE_VIEW_MIN: usize = 256 << 10;

/// A peer's slab mapped here: its address range and its memfd.
struct Slab {
    start: usize,
    end: usize,
    fd: Arc<OwnedFd>,
}

static SLABS: Mutex<Vec<Slab>> = Mutex::new(Vec::new());

fn slabs() -> std::sync::MutexGuard<'static, Vec<Slab>> {
    SLABS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A peer's slab listed for [`private_view`] while this value lives (the connection's record of
/// the slab holds it, and drops it before the slab's mapping).
#[derive(Debug)]
pub(crate) struct Registered {
    start: usize,
}

impl Registered {
    /// Lists the slab mapped at `map` (of the memfd `fd`).
    pub(crate) fn new(map: &Mapping, fd: OwnedFd) -> Registered {
        let start = map.ptr() as usize;
        slabs().push(Slab {
            start,
            end: start + map.len(),
            fd: Arc::new(fd),
        });
        Registered { start }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        slabs().retain(|s| s.start != self.start);
    }
}

/// Received bytes as writable memory of this process's own (see the module docs). Reading
/// costs no copy; a write copies the page it lands in. The sender's slab stays reserved for
/// these bytes until this value drops.
#[derive(Debug)]
pub struct PrivateView {
    map: Mapping,
    /// Where the bytes start in `map` (their offset in their first page).
    offset: usize,
    len: usize,
    /// The received bytes: while they are referenced the sender leaves the slab alone, so the
    /// pages not yet written here keep the bytes received.
    _frame: Bytes,
}

impl PrivateView {
    /// The first byte: writable, `len()` bytes long, as long as `self` lives.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        // SAFETY: `offset < page size <= map.len()` (made so in `private_view`).
        unsafe { self.map.ptr().add(self.offset) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty (never: empty bytes get no view).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// `bytes` as a [`PrivateView`], when they were received in a peer's slab on this host and are
/// at least [`PRIVATE_VIEW_MIN`] long; `None` otherwise (the caller copies them).
pub fn private_view(bytes: &Bytes) -> Option<PrivateView> {
    if bytes.len() < PRIVATE_VIEW_MIN {
        return None;
    }
    let at = bytes.as_ptr() as usize;
    let (fd, in_slab) = {
        let slabs = slabs();
        let slab = slabs
            .iter()
            .find(|s| s.start <= at && at + bytes.len() <= s.end)?;
        (Arc::clone(&slab.fd), at - slab.start)
    };
    let page = rustix::param::page_size();
    let first = in_slab - in_slab % page;
    let offset = in_slab - first;
    let len = (offset + bytes.len()).next_multiple_of(page);
    let map = Mapping::map_private(&*fd, first as u64, len).ok()?;
    Some(PrivateView {
        map,
        offset,
        len: bytes.len(),
        _frame: bytes.clone(),
    })
}
