//! Fuzzes the frame decoder: arbitrary bytes, delivered in arbitrary pieces, through both the
//! buffered and the direct-read paths. The decoder must never panic, never allocate beyond its
//! limits, and whatever it accepts must survive a re-encode unchanged.
#![no_main]

use bytes::{BufMut, BytesMut};
use libfuzzer_sys::fuzz_target;
use tensorwire_core::wire::{decode_frame, encode_to_vec, FrameDecoder, WireLimits};

fuzz_target!(|data: &[u8]| {
    // Small limits keep runs fast and make the limit checks reachable.
    let limits = WireLimits::default()
        .with_max_frame_len(1 << 20)
        .with_max_frame_header_len(4096)
        .with_max_message_header_len(64 << 10);
    let Some((&steer, input)) = data.split_first() else {
        return;
    };

    // One shot.
    if let Ok((frame, used)) = decode_frame(input, &limits) {
        assert!(used <= input.len());
        let again = encode_to_vec(&frame, &limits).expect("a decoded frame re-encodes");
        let (back, n) = decode_frame(&again, &limits).expect("a re-encoded frame decodes");
        assert_eq!(n, again.len());
        assert_eq!(back, frame);
    }

    // In pieces of 1..=16 bytes, steered by the first byte, some through direct reads.
    let piece = usize::from(steer & 0x0f) + 1;
    let direct = steer & 0x10 != 0;
    let mut decoder = FrameDecoder::new(limits);
    let mut staging = BytesMut::new();
    let mut pos = 0;
    let mut frames = Vec::new();
    while pos < input.len() {
        let n = piece.min(input.len() - pos);
        if direct {
            if let Some(mut buf) = decoder.direct_read_buf(1) {
                let n = n.min(buf.remaining_mut());
                buf.put_slice(&input[pos..pos + n]);
                pos += n;
                match decoder.decode(&mut staging) {
                    Ok(Some(f)) => frames.push(f),
                    Ok(None) => {}
                    Err(_) => return,
                }
                continue;
            }
        }
        staging.extend_from_slice(&input[pos..pos + n]);
        pos += n;
        loop {
            match decoder.decode(&mut staging) {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = decoder.finish();
    // Whatever arrives in pieces is what arrives at once.
    if let Some(first) = frames.first() {
        let (whole, _) = decode_frame(input, &limits).expect("piecewise and one-shot agree");
        assert_eq!(&whole, first);
    }
});
