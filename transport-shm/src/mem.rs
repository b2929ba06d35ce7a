//! Shared memory: memfd files, their mappings, and the sealed segments that carry large frames.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;

use bytes::Bytes;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// Seals every segment carries before it is sent: its size and contents are fixed for good, so
/// the receiver can hand out its bytes as immutable [`Bytes`].
const SEGMENT_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::WRITE);
/// Seals a ring carries: its size is fixed (a peer that shrank a mapped file would make our
/// accesses fault), its contents are not.
pub(crate) const RING_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// Why shared memory could not be set up or taken over.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MemError {
    #[error("{op}: {source}")]
    Os {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the peer's memfd lacks the seals {missing:?} (a peer could resize or rewrite it)")]
    Unsealed { missing: SealFlags },
    #[error("the peer's memfd holds {actual} bytes, expected {expected}")]
    WrongSize { actual: u64, expected: u64 },
}

fn os(op: &'static str) -> impl FnOnce(rustix::io::Errno) -> MemError {
    move |e| MemError::Os {
        op,
        source: e.into(),
    }
}

/// A mapping of a file (shared, or private: [`Mapping::map_private`]), unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; every access through it goes through
// raw pointers or atomics (the memory is shared with another process anyway).
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` gives out only raw pointers and atomics.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len > 0` bytes of `fd` shared, readable and, with `write`, writable. `populate`
    /// faults every page in with the call (one system call instead of one fault per page).
    pub(crate) fn map(
        fd: impl AsFd,
        len: usize,
        write: bool,
        populate: bool,
    ) -> Result<Self, MemError> {
        let prot = if write {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        let flags = if populate {
            MapFlags::SHARED | MapFlags::POPULATE
        } else {
            MapFlags::SHARED
        };
        // SAFETY: a fresh mapping at an address the kernel picks (null hint) aliases no Rust
        // object; callers have checked that the file holds `len` bytes and cannot shrink
        // (seals), so every page of the mapping stays backed.
        let ptr = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) }
            .map_err(os("mmap"))?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(MemError::Os {
            op: "mmap",
            source: std::io::Error::other("mmap returned a null pointer"),
        })?;
        Ok(Mapping { ptr, len })
    }

    /// Maps `len > 0` bytes of `fd` from `offset` (a multiple of the page size) private and
    /// writable: copy-on-write, so that a write lands in a page of this process's own and the
    /// file never changes. Pages are mapped at first touch (the kernel maps several around
    /// each read fault; populating them up front measured slower).
    pub(crate) fn map_private(fd: impl AsFd, offset: u64, len: usize) -> Result<Self, MemError> {
        // SAFETY: a fresh mapping at an address the kernel picks (null hint) aliases no Rust
        // object; the caller maps a range of a file sealed against shrinking, so every page of
        // the mapping stays backed.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
                fd,
                offset,
            )
        }
        .map_err(os("mmap"))?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(MemError::Os {
            op: "mmap",
            source: std::io::Error::other("mmap returned a null pointer"),
        })?;
        Ok(Mapping { ptr, len })
    }

    /// The first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `map`, and nothing borrows it any
        // more (the `Bytes` that may point into a segment own this value).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A read-only mapping of a sealed segment, as the owner of received [`Bytes`].
struct SealedView(Mapping);

impl AsRef<[u8]> for SealedView {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the segment is sealed against writes, shrinking and growing (checked in
        // `open_segment` before mapping), so these bytes stay mapped and never change while
        // this value lives; the mapping is read-only here.
        unsafe { std::slice::from_raw_parts(self.0.ptr(), self.0.len()) }
    }
}

/// A fresh memfd of `len` bytes, open for sealing. `name` shows in `/proc/PID/fd`.
pub(crate) fn memfd(name: &str, len: u64) -> Result<OwnedFd, MemError> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(os("memfd_create"))?;
    rustix::fs::ftruncate(&fd, len).map_err(os("ftruncate"))?;
    Ok(fd)
}

/// Checks that `fd` is a memfd of exactly `expected` bytes sealed with at least `seals`.
pub(crate) fn check_memfd(fd: impl AsFd, expected: u64, seals: SealFlags) -> Result<(), MemError> {
    let have = rustix::fs::fcntl_get_seals(&fd).map_err(os("reading the seals of a memfd"))?;
    if !have.contains(seals) {
        return Err(MemError::Unsealed {
            missing: seals.difference(have),
        });
    }
    let actual = rustix::fs::fstat(&fd).map_err(os("fstat"))?.st_size;
    let actual = u64::try_from(actual).unwrap_or(0);
    if actual != expected {
        return Err(MemError::WrongSize { actual, expected });
    }
    Ok(())
}

/// Writes `chunks` (`len` bytes in all, `len > 0`) once into a new sealed segment: a fixed
/// number of system calls (memfd_create, ftruncate, mmap, munmap, fcntl) whatever the size.
pub(crate) fn write_segment(chunks: &[Bytes], len: usize) -> Result<OwnedFd, MemError> {
    let fd = memfd("tensorwire-shm-frame", len as u64)?;
    {
        let map = Mapping::map(&fd, len, true, true)?;
        let mut at = 0usize;
        for chunk in chunks {
            let n = chunk.len().min(len - at);
            // SAFETY: the mapping is ours alone (the memfd has not been sent yet) and holds
            // `len` bytes; `at + n <= len`.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), map.ptr().add(at), n) };
            at += n;
        }
        // The writable mapping must be gone before F_SEAL_WRITE can be added.
    }
    rustix::fs::fcntl_add_seals(&fd, SEGMENT_SEALS | SealFlags::SEAL)
        .map_err(os("sealing a segment"))?;
    Ok(fd)
}

/// A fresh slab of `cap` bytes: a memfd sealed against resizing (not against writes: the
/// sender reuses it), mapped writable with its pages faulted in; and its descriptor, to send.
pub(crate) fn create_slab(cap: usize) -> Result<(Mapping, OwnedFd), MemError> {
    let fd = memfd("tensorwire-shm-slab", cap as u64)?;
    rustix::fs::fcntl_add_seals(&fd, RING_SEALS | SealFlags::SEAL).map_err(os("sealing a slab"))?;
    let map = Mapping::map(&fd, cap, true, true)?;
    Ok((map, fd))
}

/// Maps the peer's slab of `cap` bytes read-only, after checking that it holds exactly that
/// many and cannot be resized (so the mapping stays backed for as long as it lives).
pub(crate) fn open_slab(fd: &OwnedFd, cap: usize) -> Result<Mapping, MemError> {
    check_memfd(fd, cap as u64, RING_SEALS)?;
    Mapping::map(fd, cap, false, true)
}

/// Maps a segment received from the peer, after checking that it is sealed and holds `len`
/// bytes, as [`Bytes`] that own the mapping (no copy).
pub(crate) fn open_segment(fd: OwnedFd, len: usize) -> Result<Bytes, MemError> {
    check_memfd(&fd, len as u64, SEGMENT_SEALS)?;
    let map = Mapping::map(&fd, len, false, true)?;
    Ok(Bytes::from_owner(SealedView(map)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_round_trips_without_copies_and_is_sealed() {
        let chunks = [
            Bytes::from_static(b"hello "),
            Bytes::from(vec![7u8; 10_000]),
        ];
        let fd = write_segment(&chunks, 10_006).unwrap();
        let dup = fd.try_clone().unwrap();
        let bytes = open_segment(fd, 10_006).unwrap();
        assert_eq!(&bytes[..6], b"hello ");
        assert!(bytes[6..].iter().all(|&b| b == 7));
        // Nobody can change it any more.
        assert!(rustix::fs::ftruncate(&dup, 1).is_err());
        assert!(Mapping::map(&dup, 10_006, true, false).is_err());
    }

    #[test]
    fn unsealed_or_wrongly_sized_segments_are_refused() {
        let fd = memfd("t", 4096).unwrap();
        assert!(matches!(
            open_segment(fd, 4096),
            Err(MemError::Unsealed { .. })
        ));
        let fd = write_segment(&[Bytes::from_static(b"abc")], 3).unwrap();
        assert!(matches!(
            open_segment(fd, 4096),
            Err(MemError::WrongSize {
                actual: 3,
                expected: 4096
            })
        ));
    }
}
