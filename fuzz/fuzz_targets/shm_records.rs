//! Fuzzes what a peer writes into a shared-memory ring (`tensorwire_transport_shm::fuzzing`,
//! the pure decoding the consumer and producer run): the write position, the record headers,
//! the segment and slab descriptors, and the read position it gives back.
//!
//! Input: `[write: u64 LE][read: u64 LE][peer read: u64 LE][data area...]`, the data area
//! padded with zeros to the ring's 4096 bytes. The consumer walks the records from `read`
//! (made a multiple of 8, as the consumer's own position always is) the way
//! `Consumer::next` does. Checks:
//! - a write position is accepted only within the capacity after the read position, and a
//!   multiple of 8; the producer's check of a read position likewise, with the room it gives
//!   never above the capacity;
//! - the decoder reads no word of a record beyond the bytes published;
//! - a record it accepts fits the bytes published, takes a multiple of 8 bytes and at least
//!   8 (so the walk always moves on and ends), a slab names a slab below `MAX_SLABS`;
//! - a refused record is a typed error with a message.
#![no_main]

use std::cell::Cell;

use libfuzzer_sys::fuzz_target;
use tensorwire_transport_shm::fuzzing::{
    check_read_position, check_write_position, decode_record, Record, MAX_SLABS,
};

const CAP: u64 = 4096;

fn u64_at(data: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    for (i, x) in b.iter_mut().enumerate() {
        *x = data.get(at + i).copied().unwrap_or(0);
    }
    u64::from_le_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    let write = u64_at(data, 0);
    let mut read = u64_at(data, 8) & !7;
    let peer_read = u64_at(data, 16);
    let mut ring = vec![0u8; CAP as usize];
    let area = data.get(24..).unwrap_or(&[]);
    let n = area.len().min(ring.len());
    ring[..n].copy_from_slice(&area[..n]);

    // The producer's view of the consumer's position.
    if let Ok(free) = check_read_position(peer_read, write, CAP) {
        assert!(free <= CAP);
        assert_eq!(free, CAP - (write - peer_read));
    }

    let mut records = 0;
    loop {
        let published = match check_write_position(write, read, CAP) {
            Ok(p) => p,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                break;
            }
        };
        assert!(published <= CAP && write % 8 == 0 && write >= read);
        if published == 0 {
            break;
        }
        let furthest = Cell::new(0u64);
        let record = decode_record(read, published, |i| {
            let end = 8 * (u64::from(i) + 1);
            assert!(
                end <= published,
                "word {i} read with only {published} bytes published"
            );
            furthest.set(furthest.get().max(end));
            let off = ((read + 8 * u64::from(i)) & (CAP - 1)) as usize;
            u64_at(&ring, off)
        });
        let record = match record {
            Ok(r) => r,
            Err(e) => {
                assert!(!e.to_string().is_empty());
                break;
            }
        };
        let size = record.size();
        assert!(size >= 8 && size % 8 == 0 && size <= published);
        assert!(furthest.get() <= size, "read past the record");
        match record {
            Record::Data { len } => assert!(8 + len <= size),
            Record::Segment { .. } => assert_eq!(size, 16),
            Record::Slab { id, .. } => {
                assert!(id < MAX_SLABS);
                assert_eq!(size, 32);
            }
        }
        read += size;
        records += 1;
        assert!(records <= CAP / 8, "the walk did not end");
    }
});
