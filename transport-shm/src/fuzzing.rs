//! The pure decoding of what a peer writes into a ring's shared memory (record headers, slab
//! and segment descriptors, positions), for the `shm_records` fuzz target in `fuzz/` and its
//! seeds. Not part of the API: it may change at any time.

use bytes::{Bytes, BytesMut};

pub use crate::ring::{
    check_read_position, check_write_position, decode_record, Record, MAX_SLABS,
};
use crate::ring::{Chunks, Producer, Ring};

/// Writes `records` with the producer's own code into a fresh ring of `capacity` bytes (a
/// power of two of at least 4096) and publishes them; returns the data area and the write
/// position. A `Data` record is written with `len` bytes of stream (`0x5A`).
///
/// # Errors
/// Why the ring could not be made, or that the records do not fit.
pub fn produce(capacity: usize, records: &[Record]) -> Result<(Vec<u8>, u64), String> {
    let (ring, _fd) = Ring::create(capacity).map_err(|e| e.to_string())?;
    let mut producer = Producer::default();
    for record in records {
        let free = producer.free(&ring).map_err(|e| e.to_string())?;
        if free < record.size() {
            return Err(format!("{record:?} does not fit the {free} bytes free"));
        }
        match *record {
            Record::Data { len } => {
                let mut chunks = Chunks::new(vec![Bytes::from(vec![0x5A; len as usize])]);
                let written = producer.write_data(&ring, free, &mut chunks);
                if written != len {
                    return Err(format!("wrote {written} of {len} bytes of stream"));
                }
            }
            Record::Segment { len } => producer.write_segment(&ring, len),
            Record::Slab {
                id,
                new,
                at,
                seq,
                len,
            } => {
                producer.write_slab(
                    &ring,
                    crate::ring::SlabRecord {
                        id,
                        new,
                        at,
                        seq,
                        len,
                    },
                );
            }
        }
    }
    producer.publish(&ring);
    let write = ring.write_pos().load(std::sync::atomic::Ordering::Acquire);
    let mut data = BytesMut::with_capacity(capacity);
    ring.copy_all(&mut data);
    Ok((data.to_vec(), write))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the producer writes, the pure decoder reads back record by record; and it reads
    /// only words within the bytes published.
    #[test]
    fn produced_records_decode_to_themselves() {
        let records = [
            Record::Data { len: 13 },
            Record::Segment { len: 1 << 40 },
            Record::Slab {
                id: MAX_SLABS - 1,
                new: true,
                at: 40,
                seq: 7,
                len: 4096,
            },
            Record::Data { len: 0 },
        ];
        let cap = 4096u64;
        let (data, write) = produce(cap as usize, &records[..3]).unwrap();
        let mut found = Vec::new();
        let mut r = 0;
        loop {
            let published = check_write_position(write, r, cap).unwrap();
            if published == 0 {
                break;
            }
            let record = decode_record(r, published, |i| {
                assert!(u64::from(i) * 8 + 8 <= published, "word {i} not published");
                let off = ((r + 8 * u64::from(i)) & (cap - 1)) as usize;
                u64::from_le_bytes(data[off..off + 8].try_into().unwrap())
            })
            .unwrap();
            r += record.size();
            found.push(record);
        }
        assert_eq!(found, records[..3]);
        assert_eq!(r, write);
        assert_eq!(check_read_position(r, write, cap), Ok(cap));
        assert!(check_read_position(write + 8, write, cap).is_err());
        assert!(check_write_position(write + 4, 0, cap).is_err());
    }
}
