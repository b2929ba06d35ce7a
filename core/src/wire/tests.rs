use std::io::IoSlice;

use bytes::{BufMut, Bytes, BytesMut};

use super::*;
use proptest::prelude::*;

fn frame_strategy() -> impl Strategy<Value = Frame> {
    (
        1u8..=3,
        proptest::collection::vec(any::<u8>(), 0..64),
        proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..6),
    )
        .prop_map(|(kind, header, payloads)| Frame {
            kind: FrameKind::from_wire(kind).expect("1 to 3 are kinds"),
            header: Bytes::from(header),
            payloads: payloads.into_iter().map(Bytes::from).collect(),
        })
}

fn prefix(kind: u8, table_len: u32, body_len: u64) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&MAGIC);
    v.push(VERSION);
    v.push(kind);
    v.extend_from_slice(&0u16.to_le_bytes());
    v.extend_from_slice(&table_len.to_le_bytes());
    v.extend_from_slice(&body_len.to_le_bytes());
    v
}

proptest! {
    #[test]
    fn round_trip_in_one_piece(frames in proptest::collection::vec(frame_strategy(), 1..5)) {
        let limits = WireLimits::default();
        let mut wire = BytesMut::new();
        for f in &frames {
            wire.extend_from_slice(&encode_to_vec(f, &limits).unwrap());
        }
        let mut dec = FrameDecoder::new(limits);
        for f in &frames {
            prop_assert_eq!(dec.decode(&mut wire).unwrap(), Some(f.clone()));
        }
        prop_assert!(wire.is_empty());
        prop_assert!(dec.finish().is_ok());
    }

    #[test]
    fn round_trip_in_pieces(
        frames in proptest::collection::vec(frame_strategy(), 1..4),
        cuts in proptest::collection::vec(1usize..50, 1..200),
        direct in any::<bool>(),
    ) {
        let limits = WireLimits::default();
        let mut wire = Vec::new();
        for f in &frames {
            wire.extend_from_slice(&encode_to_vec(f, &limits).unwrap());
        }
        let mut dec = FrameDecoder::new(limits);
        let mut got = Vec::new();
        let mut pos = 0;
        let mut cut = cuts.iter().cycle();
        let mut staging = BytesMut::new();
        while pos < wire.len() {
            let n = (*cut.next().unwrap()).min(wire.len() - pos);
            if direct {
                if let Some(mut buf) = dec.direct_read_buf(1) {
                    let n = n.min(buf.remaining_mut());
                    buf.put_slice(&wire[pos..pos + n]);
                    pos += n;
                    if let Some(f) = dec.decode(&mut staging).unwrap() {
                        got.push(f);
                    }
                    continue;
                }
            }
            staging.extend_from_slice(&wire[pos..pos + n]);
            pos += n;
            while let Some(f) = dec.decode(&mut staging).unwrap() {
                got.push(f);
            }
        }
        prop_assert_eq!(got, frames);
        prop_assert!(dec.finish().is_ok());
    }

    #[test]
    fn arbitrary_input_never_panics(input in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_frame(&input, &WireLimits::default());
    }

    #[test]
    fn arbitrary_input_after_a_valid_prefix_never_panics(
        table_len in 0u32..100, body_len in 0u64..1000,
        rest in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut input = prefix(1, table_len, body_len);
        input.extend_from_slice(&rest);
        let _ = decode_frame(&input, &WireLimits::default());
    }

    #[test]
    fn every_strict_prefix_is_truncated(f in frame_strategy(), cut in any::<prop::sample::Index>()) {
        let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
        let cut = cut.index(wire.len());
        let err = decode_frame(&wire[..cut], &WireLimits::default()).unwrap_err();
        prop_assert!(matches!(err, WireError::Truncated { .. }), "{err}");
    }
}

#[test]
fn debug_shows_lengths_not_contents() {
    let f = Frame::message(&b"secret-ish"[..], vec![Bytes::from(vec![0u8; 1000])]);
    let text = format!("{f:?}");
    assert_eq!(
        text,
        "Frame { kind: Message, header: 10 bytes, payloads: [1000 bytes] }"
    );
}

#[test]
fn empty_frame_round_trips() {
    let f = Frame::message(Bytes::new(), vec![]);
    let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
    assert_eq!(
        decode_frame(&wire, &WireLimits::default()).unwrap(),
        (f, wire.len())
    );
}

#[test]
fn bad_magic_is_refused() {
    let mut wire =
        encode_to_vec(&Frame::message(&b"x"[..], vec![]), &WireLimits::default()).unwrap();
    wire[0] = b'X';
    let err = decode_frame(&wire, &WireLimits::default()).unwrap_err();
    assert!(
        matches!(err, WireError::BadMagic { found } if found == *b"XWFR"),
        "{err}"
    );
}

#[test]
fn unknown_version_is_refused() {
    let mut wire = prefix(1, 2, 2);
    wire[4] = 9;
    let err = decode_frame(&wire, &WireLimits::default()).unwrap_err();
    assert_eq!(err, WireError::UnknownVersion { found: 9 });
    assert!(err.to_string().contains("version 9"));
}

#[test]
fn unknown_kind_is_refused() {
    let err = decode_frame(&prefix(7, 2, 2), &WireLimits::default()).unwrap_err();
    assert_eq!(err, WireError::UnknownKind { found: 7 });
}

#[test]
fn oversized_length_is_refused_before_anything_is_read() {
    // Claims u64::MAX bytes; no body follows. Must fail from the prefix alone.
    let mut dec = FrameDecoder::new(WireLimits::default());
    let err = dec
        .decode(&mut BytesMut::from(&prefix(1, 2, u64::MAX)[..]))
        .unwrap_err();
    assert_eq!(
        err,
        WireError::FrameTooLarge {
            len: u64::MAX,
            max: 1 << 30
        }
    );
    // The decoder stays failed.
    assert_eq!(dec.decode(&mut BytesMut::new()).unwrap_err(), err);
    assert_eq!(dec.finish().unwrap_err(), err);
}

#[test]
fn configured_limit_applies_to_sender_and_receiver() {
    let small = WireLimits::default().with_max_frame_len(100);
    let f = Frame::message(Bytes::new(), vec![Bytes::from(vec![0u8; 200])]);
    assert!(matches!(
        encode_preamble(&f, &small),
        Err(WireError::FrameTooLarge { max: 100, .. })
    ));
    let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
    assert!(matches!(
        decode_frame(&wire, &small),
        Err(WireError::FrameTooLarge { max: 100, .. })
    ));
}

#[test]
fn oversized_frame_header_is_refused() {
    let err = decode_frame(&prefix(1, 1 << 20, 1 << 21), &WireLimits::default()).unwrap_err();
    assert!(
        matches!(err, WireError::FrameHeaderTooLarge { len: 1_048_576, .. }),
        "{err}"
    );
    let many = Frame::message(Bytes::new(), vec![Bytes::new(); 100]);
    let tight = WireLimits::default().with_max_frame_header_len(10);
    assert!(matches!(
        encode_preamble(&many, &tight),
        Err(WireError::FrameHeaderTooLarge { max: 10, .. })
    ));
}

#[test]
fn oversized_message_header_is_refused() {
    let f = Frame::message(vec![1u8; 50], vec![]);
    let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
    let tight = WireLimits::default().with_max_message_header_len(10);
    assert!(matches!(
        decode_frame(&wire, &tight),
        Err(WireError::MessageHeaderTooLarge { len: 50, max: 10 })
    ));
    assert!(encode_preamble(&f, &tight).is_err());
}

#[test]
fn malformed_frame_headers_are_refused() {
    let limits = WireLimits::default();
    // Lengths that do not add up to the body length.
    let table = postcard::to_allocvec(&FrameHeader {
        message_len: 3,
        payload_lens: vec![5],
    })
    .unwrap();
    let mut wire = prefix(1, table.len() as u32, table.len() as u64 + 7);
    wire.extend_from_slice(&table);
    let err = decode_frame(&wire, &limits).unwrap_err();
    assert!(
        matches!(err, WireError::MalformedHeader { ref reason } if reason.contains("add up to")),
        "{err}"
    );
    // Lengths that overflow u64.
    let table = postcard::to_allocvec(&FrameHeader {
        message_len: u64::MAX,
        payload_lens: vec![u64::MAX],
    })
    .unwrap();
    let mut wire = prefix(1, table.len() as u32, 1000);
    wire.extend_from_slice(&table);
    let limits_big = limits.with_max_message_header_len(u64::MAX);
    assert!(matches!(
        decode_frame(&wire, &limits_big),
        Err(WireError::MalformedHeader { .. })
    ));
    // A frame header that is not postcard: a varint that never ends.
    let mut wire = prefix(1, 4, 4);
    wire.extend_from_slice(&[0xff; 4]);
    assert!(matches!(
        decode_frame(&wire, &limits),
        Err(WireError::MalformedHeader { .. })
    ));
    // Trailing bytes inside the frame header.
    let mut wire = prefix(1, 3, 3);
    wire.extend_from_slice(&[0, 0, 0]);
    let err = decode_frame(&wire, &limits).unwrap_err();
    assert!(
        matches!(err, WireError::MalformedHeader { ref reason } if reason.contains("trailing")),
        "{err}"
    );
    // Reserved bits, empty and inconsistent frame-header lengths.
    let mut wire = prefix(1, 2, 2);
    wire[6] = 1;
    assert!(matches!(
        decode_frame(&wire, &limits),
        Err(WireError::MalformedHeader { .. })
    ));
    assert!(matches!(
        decode_frame(&prefix(1, 0, 0), &limits),
        Err(WireError::MalformedHeader { .. })
    ));
    assert!(matches!(
        decode_frame(&prefix(1, 9, 3), &limits),
        Err(WireError::MalformedHeader { .. })
    ));
}

#[test]
fn a_claimed_payload_count_does_not_allocate() {
    // A frame header claiming 2^60 payloads in a few bytes: postcard must not pre-allocate.
    let mut table = vec![0u8]; // message_len = 0
    table.extend_from_slice(&[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x10]);
    let mut wire = prefix(1, table.len() as u32, table.len() as u64);
    wire.extend_from_slice(&table);
    assert!(matches!(
        decode_frame(&wire, &WireLimits::default()),
        Err(WireError::MalformedHeader { .. })
    ));
}

#[test]
fn truncation_reports_the_part() {
    let f = Frame::message(&b"hello"[..], vec![Bytes::from_static(b"world")]);
    let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
    let err = decode_frame(&wire[..5], &WireLimits::default()).unwrap_err();
    assert_eq!(
        err,
        WireError::Truncated {
            part: "prefix",
            received: 5,
            expected: 20
        }
    );
    let err = decode_frame(&wire[..wire.len() - 1], &WireLimits::default()).unwrap_err();
    assert!(
        matches!(err, WireError::Truncated { part: "body", .. }),
        "{err}"
    );
    let err = decode_frame(&[], &WireLimits::default()).unwrap_err();
    assert!(matches!(
        err,
        WireError::Truncated {
            part: "prefix",
            received: 0,
            ..
        }
    ));
}

#[test]
fn outgoing_frame_survives_partial_writes() {
    let f = Frame::message(
        &b"abc"[..],
        vec![Bytes::from_static(b"defgh"), Bytes::new()],
    );
    let whole = encode_to_vec(&f, &WireLimits::default()).unwrap();
    let mut out = OutgoingFrame::new(f, &WireLimits::default()).unwrap();
    assert_eq!(out.remaining(), whole.len() as u64);
    let mut written = Vec::new();
    while !out.is_done() {
        let mut slices = [IoSlice::new(&[]); 4];
        let n = out.io_slices(&mut slices);
        // A writer that takes at most 3 bytes per call.
        let mut took = 0;
        for s in &slices[..n] {
            let k = s.len().min(3 - took);
            written.extend_from_slice(&s[..k]);
            took += k;
            if took == 3 {
                break;
            }
        }
        out.advance(took);
    }
    assert_eq!(written, whole);
}

/// Copied out front by front, 5 bytes at most at a time, a frame with an empty payload in
/// the middle and its preamble in place or spilled gives the bytes `encode_to_vec` gives;
/// `front` is never empty before the end.
#[test]
fn outgoing_frame_front_by_front_gives_the_encoded_bytes() {
    for payloads in [0usize, 2, 40] {
        let f = Frame::message(
            &b"hdr"[..],
            (0..payloads)
                .map(|i| Bytes::from(vec![i as u8; i % 3]))
                .collect::<Payloads>(),
        );
        let whole = encode_to_vec(&f, &WireLimits::default()).unwrap();
        let mut out = OutgoingFrame::new(f, &WireLimits::default()).unwrap();
        let mut written = Vec::new();
        while !out.is_done() {
            let front = out.front();
            assert!(
                !front.is_empty(),
                "{payloads} payloads: an empty front before the end"
            );
            let n = front.len().min(5);
            written.extend_from_slice(&front[..n]);
            out.advance(n);
        }
        assert!(out.front().is_empty());
        assert_eq!(written, whole, "{payloads} payloads");
    }
}

/// Whether its preamble is kept in place (a few payloads) or spilled to a buffer of its own
/// (many), a frame written a few bytes at a time, or handed over as chunks part-way through,
/// gives the bytes `encode_to_vec` gives.
#[test]
fn outgoing_frame_bytes_match_with_the_preamble_in_place_or_spilled() {
    for payloads in [0usize, 1, 3, 40] {
        let f = Frame::message(
            &b"header"[..],
            (0..payloads)
                .map(|i| Bytes::from(vec![i as u8; i % 5]))
                .collect::<Payloads>(),
        );
        let whole = encode_to_vec(&f, &WireLimits::default()).unwrap();
        for cut in [0usize, 3, 19, 20, 23, whole.len() - 1] {
            let mut out = OutgoingFrame::new(f.clone(), &WireLimits::default()).unwrap();
            assert_eq!(out.remaining(), whole.len() as u64);
            let mut written = Vec::new();
            // Written 7 bytes at a time up to `cut`, then the rest taken as chunks.
            while written.len() < cut {
                let mut slices = [IoSlice::new(&[]); 64];
                let n = out.io_slices(&mut slices);
                let mut took = 0;
                for s in &slices[..n] {
                    let k = s.len().min(7 - took).min(cut - written.len());
                    written.extend_from_slice(&s[..k]);
                    took += k;
                    if took == 7 || written.len() == cut {
                        break;
                    }
                }
                out.advance(took);
            }
            assert_eq!(out.remaining(), (whole.len() - cut) as u64);
            for chunk in out.into_chunks() {
                assert!(!chunk.is_empty(), "no empty chunk is handed over");
                written.extend_from_slice(&chunk);
            }
            assert_eq!(written, whole, "{payloads} payloads, cut at {cut}");
        }
    }
}

/// A peer announces a 1 GiB payload and sends 3 MiB: the receiver holds about what
/// arrived, whichever way it reads, and gives it up when told the peer is gone.
#[test]
fn an_announced_length_is_not_reserved_up_front() {
    let limits = WireLimits::default();
    let big: u64 = (1 << 30) - 64;
    let table = postcard::to_allocvec(&FrameHeader {
        message_len: 0,
        payload_lens: vec![big],
    })
    .unwrap();
    let mut preamble = prefix(1, table.len() as u32, table.len() as u64 + big);
    preamble.extend_from_slice(&table);
    for direct in [false, true] {
        let mut dec = FrameDecoder::new(limits);
        let mut src = BytesMut::from(&preamble[..]);
        assert_eq!(dec.decode(&mut src).unwrap(), None);
        let mut sent = 0usize;
        while sent < 3 << 20 {
            let chunk = [7u8; 64 << 10];
            if direct {
                let mut buf = dec.direct_read_buf(1).unwrap();
                let k = chunk.len().min(buf.remaining_mut());
                buf.put_slice(&chunk[..k]);
                sent += k;
                assert_eq!(dec.decode(&mut BytesMut::new()).unwrap(), None);
            } else {
                let mut src = BytesMut::from(&chunk[..]);
                assert_eq!(dec.decode(&mut src).unwrap(), None);
                sent += chunk.len();
            }
            assert!(
                dec.reserved() <= 2 * sent + GROWTH_STEP,
                "{} bytes reserved after {sent} arrived (direct: {direct})",
                dec.reserved()
            );
        }
        dec.release();
        assert_eq!(dec.reserved(), 0);
        assert!(matches!(
            dec.decode(&mut BytesMut::new()),
            Err(WireError::Truncated { part: "body", .. })
        ));
    }
}

#[test]
fn large_buffers_are_reused_once_dropped() {
    let limits = WireLimits::default();
    let frame = Frame::message(Bytes::new(), vec![Bytes::from(vec![5u8; 1 << 20])]);
    let wire = encode_to_vec(&frame, &limits).unwrap();
    let mut dec = FrameDecoder::new(limits);
    let receive = |dec: &mut FrameDecoder| {
        // Force the pooled path: the payload arrives through direct reads.
        let mut staging = BytesMut::from(&wire[..100]);
        assert_eq!(dec.decode(&mut staging).unwrap(), None);
        let mut buf = dec.direct_read_buf(1).unwrap();
        buf.put_slice(&wire[100..]);
        dec.decode(&mut staging).unwrap().unwrap()
    };
    let first = receive(&mut dec);
    let first_ptr = first.payloads[0].as_ptr();
    // Still in use: a new buffer.
    let second = receive(&mut dec);
    assert_ne!(second.payloads[0].as_ptr(), first_ptr);
    assert_eq!(second, frame);
    drop(first);
    // Dropped: its allocation comes back.
    let third = receive(&mut dec);
    assert_eq!(third.payloads[0].as_ptr(), first_ptr);
    assert_eq!(third, frame);
    // Reuse off: still correct.
    let mut dec = FrameDecoder::new(limits).with_buffer_reuse(0);
    assert_eq!(receive(&mut dec), frame);
    assert_eq!(receive(&mut dec), frame);
}

#[test]
fn direct_reads_land_in_the_final_buffer() {
    let payload = Bytes::from(vec![9u8; 10_000]);
    let f = Frame::message(&b"h"[..], vec![payload.clone()]);
    let wire = encode_to_vec(&f, &WireLimits::default()).unwrap();
    let mut dec = FrameDecoder::new(WireLimits::default());
    // Prefix, frame header, message header and 100 payload bytes arrive together.
    let first = wire.len() - 9_900;
    let mut staging = BytesMut::from(&wire[..first]);
    assert_eq!(dec.decode(&mut staging).unwrap(), None);
    assert!(dec.direct_read_buf(20_000).is_none());
    let mut buf = dec.direct_read_buf(1024).expect("waiting for the payload");
    assert_eq!(buf.remaining_mut(), 9_900);
    buf.put_slice(&wire[first..]);
    let got = dec.decode(&mut staging).unwrap().unwrap();
    assert_eq!(got, f);
    assert!(!dec.is_mid_frame());
}

proptest! {
    #[test]
    fn shared_decoding_matches_the_decoder(frame in frame_strategy(), cut in any::<prop::sample::Index>()) {
        let limits = WireLimits::default();
        let mut wire = encode_to_vec(&frame, &limits).unwrap();
        wire.extend_from_slice(b"next");
        let input = Bytes::from(wire.clone());
        let (got, used) = decode_frame_shared(&input, &limits).unwrap();
        prop_assert_eq!(&got, &frame);
        prop_assert_eq!(used, wire.len() - 4);
        // Any cut before the end of the frame is a truncation, never a panic.
        let cut = cut.index(used);
        let short = input.slice(..cut);
        let truncated = matches!(
            decode_frame_shared(&short, &limits),
            Err(WireError::Truncated { .. })
        );
        prop_assert!(truncated);
    }

    #[test]
    fn shared_decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_frame_shared(&Bytes::from(bytes), &WireLimits::default());
    }
}

#[test]
fn a_held_small_payload_leaves_the_read_buffer_unshared() {
    // A transport reads into one buffer; the application still holds the last frame's
    // payloads when the next read needs room (its header decoded and dropped by then, as the
    // agent's node and the mesh's reader do). A small payload must not pin the buffer, else
    // room means a fresh allocation per read.
    let limits = WireLimits::default();
    let small = Frame::message(&b"header"[..], vec![Bytes::from(vec![3u8; 64])]);
    let large = Frame::message(
        &b"h"[..],
        vec![Bytes::from(vec![4u8; COPY_SEGMENT_MAX + 1])],
    );
    let mut wire = encode_to_vec(&small, &limits).unwrap();
    wire.extend(encode_to_vec(&large, &limits).unwrap());
    const ROOM: usize = 64 << 10;
    let mut buf = BytesMut::with_capacity(ROOM);
    let base = buf.as_ptr() as usize;
    buf.extend_from_slice(&wire);
    let mut dec = FrameDecoder::new(limits);
    let held = dec.decode(&mut buf).unwrap().unwrap();
    assert_eq!(held, small);
    let in_buffer = |p: *const u8| (base..base + ROOM).contains(&(p as usize));
    assert!(
        in_buffer(held.header.as_ptr()),
        "the message header was split off in place, not copied"
    );
    assert!(
        !in_buffer(held.payloads[0].as_ptr()),
        "a small segment was copied out"
    );
    // The large frame's payload is split off (shared) as before: no copy.
    let big = dec.decode(&mut buf).unwrap().unwrap();
    assert_eq!(big, large);
    assert!(in_buffer(big.payloads[0].as_ptr()));
    assert!(in_buffer(big.header.as_ptr()));
    drop(big);
    let Frame {
        header,
        payloads: held,
        ..
    } = held;
    drop(header);
    // Only the small frame's payload is held now: the buffer makes room in place.
    buf.reserve(ROOM);
    assert!(in_buffer(buf.as_ptr()), "the read buffer was reallocated");
    assert_eq!(held, small.payloads);
}

#[test]
fn a_forged_frame_cut_after_its_split_header_reports_what_arrived() {
    // Forged by hand: a frame header announcing a 4-byte message header and one 10-byte
    // payload, with the header sent whole (split off in place) and 3 bytes of the payload.
    let table = [4u8, 1, 10];
    let body_len = (table.len() + 4 + 10) as u64;
    let mut wire = prefix(1, table.len() as u32, body_len);
    wire.extend_from_slice(&table);
    wire.extend_from_slice(b"head");
    wire.extend_from_slice(&[7, 7, 7]);
    let mut dec = FrameDecoder::new(WireLimits::default());
    let mut buf = BytesMut::from(&wire[..]);
    assert_eq!(dec.decode(&mut buf).unwrap(), None);
    assert!(buf.is_empty());
    assert_eq!(
        dec.finish().unwrap_err(),
        WireError::Truncated {
            part: "body",
            received: (table.len() + 4 + 3) as u64,
            expected: body_len,
        }
    );
    assert_eq!(dec.received(), (PREFIX_LEN + table.len() + 4 + 3) as u64);
    // The rest arrives: the frame is whole, its payload in one piece.
    buf.extend_from_slice(&[7; 7]);
    let frame = dec.decode(&mut buf).unwrap().unwrap();
    assert_eq!(&frame.header[..], b"head");
    assert_eq!(frame.payloads, vec![Bytes::from(vec![7u8; 10])]);
    // A forged count of payloads past the bytes the frame header has left is refused, with
    // no list reserved for them.
    let table = [4u8, 200, 10];
    let mut wire = prefix(1, table.len() as u32, (table.len() + 14) as u64);
    wire.extend_from_slice(&table);
    assert!(matches!(
        FrameDecoder::new(WireLimits::default()).decode(&mut BytesMut::from(&wire[..])),
        Err(WireError::MalformedHeader { .. })
    ));
}

#[test]
fn a_forged_frame_is_refused_alike_whole_and_byte_by_byte() {
    // A frame that arrives whole is taken in one step; one that arrives a byte at a time goes
    // through the decoder's states. Both refuse the same forged frames with the same error.
    let frame_of = |table: &[u8], body: &[u8], body_len: u64| {
        let mut wire = prefix(1, table.len() as u32, body_len);
        wire.extend_from_slice(table);
        wire.extend_from_slice(body);
        wire
    };
    let forged = [
        // Segment lengths adding up to more than the body.
        frame_of(&[4, 1, 10], &[0; 14], 3 + 13),
        // ... and to less.
        frame_of(&[4, 1, 10], &[0; 15], 3 + 15),
        // More payloads than bytes left in the frame header.
        frame_of(&[4, 9, 10], &[0; 14], 3 + 14),
        // A cut-off varint.
        frame_of(&[4, 1, 0x80], &[0; 14], 3 + 14),
        // Trailing bytes after the frame header.
        frame_of(&[4, 0, 0], &[0; 4], 3 + 4),
        // A message header over the limit (1 KiB here).
        frame_of(&[0x81, 0x10, 0], &[0; 2049], 3 + 2049),
    ];
    let limits = WireLimits::default().with_max_message_header_len(1024);
    for (i, wire) in forged.iter().enumerate() {
        let whole = FrameDecoder::new(limits)
            .decode(&mut BytesMut::from(&wire[..]))
            .unwrap_err();
        let mut dec = FrameDecoder::new(limits);
        let mut piecewise = None;
        for byte in wire {
            match dec.decode(&mut BytesMut::from(&[*byte][..])) {
                Ok(None) => {}
                Ok(Some(f)) => panic!("forged frame {i} decoded: {f:?}"),
                Err(e) => {
                    piecewise = Some(e);
                    break;
                }
            }
        }
        assert_eq!(Some(whole), piecewise, "forged frame {i}");
    }
}

#[test]
fn a_header_cut_between_reads_is_copied_whole() {
    // A message header that has not all arrived is gathered in a buffer of its own, and the
    // frame is the same as one read at once.
    let limits = WireLimits::default();
    let frame = Frame::message(
        &b"a header of some length"[..],
        vec![Bytes::from(vec![5u8; 9])],
    );
    let wire = encode_to_vec(&frame, &limits).unwrap();
    for cut in PREFIX_LEN + 1..wire.len() {
        let mut dec = FrameDecoder::new(limits);
        let mut buf = BytesMut::from(&wire[..cut]);
        assert_eq!(dec.decode(&mut buf).unwrap(), None, "cut at {cut}");
        assert!(buf.is_empty());
        buf.extend_from_slice(&wire[cut..]);
        assert_eq!(
            dec.decode(&mut buf).unwrap(),
            Some(frame.clone()),
            "cut at {cut}"
        );
    }
}

/// The preamble writes the frame header itself: the bytes postcard writes for `FrameHeader`,
/// for lengths at every varint width.
#[test]
fn the_preamble_holds_the_frame_header_postcard_writes() {
    let widths = [0u64, 1, 127, 128, 16_383, 16_384, 1 << 21, (1 << 35) + 3];
    for (i, &message_len) in widths.iter().enumerate() {
        for count in [0usize, 1, 3, 130] {
            let payload_lens: Vec<u64> = (0..count).map(|j| widths[(i + j) % 4] % 200).collect();
            let frame = Frame {
                kind: FrameKind::Message,
                header: Bytes::from(vec![7u8; (message_len % 300) as usize]),
                payloads: payload_lens
                    .iter()
                    .map(|&n| Bytes::from(vec![1u8; n as usize]))
                    .collect(),
            };
            let expected = postcard::to_allocvec(&FrameHeader {
                message_len: frame.header.len() as u64,
                payload_lens,
            })
            .unwrap();
            let preamble = encode_preamble(&frame, &WireLimits::default()).unwrap();
            assert_eq!(&preamble[PREFIX_LEN..], &expected[..]);
            let table_len = u32::from_le_bytes(preamble[8..12].try_into().unwrap());
            assert_eq!(table_len as usize, expected.len());
            let (back, used) = decode_frame(
                &encode_to_vec(&frame, &WireLimits::default()).unwrap(),
                &WireLimits::default(),
            )
            .unwrap();
            assert_eq!(back, frame);
            assert_eq!(
                used as u64,
                PREFIX_LEN as u64 + table_len as u64 + frame.content_len()
            );
        }
    }
    // Past one byte of varint on its own (the message header is at most the limit above).
    for v in [u64::MAX, 1 << 63, (1 << 56) - 1, 1 << 56, 300] {
        let mut out = BytesMut::new();
        super::encode::put_varint(&mut out, v);
        assert_eq!(&out[..], &postcard::to_allocvec(&v).unwrap()[..], "{v}");
    }
}

proptest! {
    /// The hand-written frame-header decoder takes what postcard takes, gives the same lengths,
    /// and refuses what postcard refuses (cut-off and too-long varints, trailing bytes).
    #[test]
    fn the_frame_header_decodes_as_postcard_decodes_it(
        message_len in any::<u64>(),
        payload_lens in proptest::collection::vec(any::<u64>(), 0..20),
        noise in proptest::collection::vec(any::<u8>(), 0..24),
        cut in any::<prop::sample::Index>(),
    ) {
        let table = postcard::to_allocvec(&FrameHeader { message_len, payload_lens: payload_lens.clone() }).unwrap();
        let mut segments = vec![7, 7, 7];
        decode::decode_table(&table, &mut segments).unwrap();
        let mut expected = vec![message_len];
        expected.extend(&payload_lens);
        prop_assert_eq!(&segments, &expected);
        // Cut off, or with other bytes after it, or any bytes at all: accepted exactly when
        // postcard accepts them whole, with the same lengths.
        let cut_table = &table[..cut.index(table.len())];
        let mut longer = table.clone();
        longer.extend(&noise);
        for bytes in [cut_table, &longer[..], &noise[..]] {
            let ours = decode::decode_table(bytes, &mut segments).map(|()| segments.clone());
            let theirs = match postcard::take_from_bytes::<FrameHeader>(bytes) {
                Ok((h, [])) => Ok(std::iter::once(h.message_len).chain(h.payload_lens).collect::<Vec<_>>()),
                _ => Err(()),
            };
            prop_assert_eq!(ours.ok(), theirs.ok(), "bytes {:?}", bytes);
        }
    }
}

#[test]
fn a_frame_header_with_too_long_a_varint_is_refused_by_name() {
    // Eleven bytes of continuation: no u64 is that long.
    let mut table = vec![0xff; 10];
    table.push(0);
    let err = decode::decode_table(&table, &mut Vec::new()).unwrap_err();
    assert!(
        err.to_string().contains("the message header's length"),
        "{err}"
    );
    // A count of payloads past the bytes left reserves nothing and is refused.
    let err = decode::decode_table(&[0, 0xff, 0xff, 0xff, 0x0f], &mut Vec::new()).unwrap_err();
    assert!(
        err.to_string().contains("more payloads than bytes left"),
        "{err}"
    );
}

#[test]
fn exact_bytes_copies_a_small_encoding_out_and_keeps_the_room_for_the_next() {
    // Each test runs on a thread of its own: the scratch buffer starts empty.
    let first = exact_bytes(|mut buf| {
        assert!(buf.is_empty());
        buf.extend_from_slice(b"envelope");
        Ok::<_, ()>(buf)
    })
    .unwrap();
    assert_eq!(first, Bytes::from_static(b"envelope"));
    // The next encoding gets the same room back, emptied.
    let second = exact_bytes(|mut buf| {
        assert!(buf.is_empty(), "the scratch buffer comes back empty");
        assert!(buf.capacity() >= 8, "and with the room the first left");
        buf.push(7);
        Ok::<_, ()>(buf)
    })
    .unwrap();
    assert_eq!(second, Bytes::from_static(&[7]));
    // The first result is its own copy: the buffer's reuse did not change it.
    assert_eq!(first, Bytes::from_static(b"envelope"));
}

#[test]
fn exact_bytes_keeps_a_large_encoding_in_its_buffer_and_passes_errors_on() {
    let large = exact_bytes(|mut buf| {
        buf.resize(EXACT_COPY_MAX + 1, 3);
        Ok::<_, ()>(buf)
    })
    .unwrap();
    assert_eq!(large.len(), EXACT_COPY_MAX + 1);
    assert!(large.iter().all(|&b| b == 3));
    // That buffer went with its bytes: the next encoding starts from an empty one.
    exact_bytes(|buf| {
        assert_eq!(buf.capacity(), 0);
        Ok::<_, ()>(buf)
    })
    .unwrap();
    let failed = exact_bytes(|_| Err::<Vec<u8>, _>("cannot encode"));
    assert_eq!(failed, Err("cannot encode"));
}

#[test]
fn exact_bytes_inside_an_encoding_gets_a_buffer_of_its_own() {
    let outer = exact_bytes(|mut buf| {
        buf.extend_from_slice(b"outer:");
        let inner = exact_bytes(|mut buf| {
            assert!(buf.is_empty());
            buf.extend_from_slice(b"inner");
            Ok::<_, ()>(buf)
        })?;
        buf.extend_from_slice(&inner);
        Ok::<_, ()>(buf)
    })
    .unwrap();
    assert_eq!(outer, Bytes::from_static(b"outer:inner"));
}

#[test]
fn bytes_in_a_room_share_it_and_the_room_is_reclaimed_once_they_are_gone() {
    let mut room = BytesMut::new();
    let header = |n: usize, b: u8| {
        move |mut buf: Vec<u8>| {
            buf.resize(n, b);
            Ok::<_, ()>(buf)
        }
    };
    // Consecutive encodings lie one after the other in one allocation.
    let first = bytes_in(&mut room, header(40, 1)).unwrap();
    let second = bytes_in(&mut room, header(40, 2)).unwrap();
    assert_eq!(&first[..], &[1; 40][..]);
    assert_eq!(&second[..], &[2; 40][..]);
    assert_eq!(first.as_ptr().wrapping_add(40), second.as_ptr());
    let start = first.as_ptr();
    // Gone before the room fills: the room starts over at the same place.
    drop((first, second));
    let mut held = Vec::new();
    assert!(room.capacity() >= 40);
    while room.capacity() >= 40 {
        held.push(bytes_in(&mut room, header(40, 3)).unwrap());
    }
    drop(held);
    let again = bytes_in(&mut room, header(40, 4)).unwrap();
    assert_eq!(again.as_ptr(), start, "reclaimed in place");
    // Still held when it fills: a new room, the held bytes unchanged.
    let mut held = vec![again];
    while room.capacity() >= 40 {
        held.push(bytes_in(&mut room, header(40, 5)).unwrap());
    }
    let next = bytes_in(&mut room, header(40, 6)).unwrap();
    let old = start..start.wrapping_add(ROOM_CHUNK);
    assert!(!old.contains(&next.as_ptr()), "a new room");
    assert_eq!(&held[0][..], &[4; 40][..]);
    assert!(held[1..].iter().all(|h| h[..] == [5; 40][..]));
    assert_eq!(&next[..], &[6; 40][..]);
    // A long encoding is copied out at its size (the room untouched); errors pass on.
    let before = room.capacity();
    let long = bytes_in(&mut room, header(ROOM_MAX + 1, 7)).unwrap();
    assert_eq!(long.len(), ROOM_MAX + 1);
    assert_eq!(room.capacity(), before);
    let failed = bytes_in(&mut room, |_| Err::<Vec<u8>, _>("cannot encode"));
    assert_eq!(failed, Err("cannot encode"));
}
