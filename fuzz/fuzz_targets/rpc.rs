//! Fuzzes what an RPC agent does with the bytes of a connection, up to its protocol endpoint:
//! the frame decoder (in pieces, as `wire` does), then each frame as the agent decodes it
//! (`tensorwire_rpc::fuzzing`): the first as the connection's hello, every one as a message
//! (header, tensors announced against tensors carried, each tensor's bytes against its type,
//! shape and landing device on a worker with two simulated CUDA devices).
//!
//! Must hold: no panic; a decoded header re-encodes and decodes to itself; every tensor
//! accepted has exactly the bytes its type and shape need.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tensorwire_core::wire::{Frame, FrameDecoder, WireLimits};
use tensorwire_rpc::fuzzing::{decode_hello, decode_message, encode_message_header};

fn check(frame: Frame, first: bool) {
    if first {
        let _ = decode_hello(&frame);
    }
    if let Ok((header, body)) = decode_message(frame, 2) {
        let again = Frame::message(encode_message_header(&header, &[]), Vec::new());
        let (back, none) = decode_message(again, 2).expect("a re-encoded header decodes");
        assert_eq!(back, header);
        assert!(none.is_none());
        for t in body.map(|(_, t)| t).unwrap_or_default() {
            let need = t.shape().iter().product::<usize>() * t.dtype().size();
            assert_eq!(t.nbytes(), need);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let limits = WireLimits::default()
        .with_max_frame_len(1 << 20)
        .with_max_frame_header_len(4096)
        .with_max_message_header_len(64 << 10);
    let Some((&steer, input)) = data.split_first() else {
        return;
    };
    let piece = usize::from(steer & 0x0f) + 1;
    let mut decoder = FrameDecoder::new(limits);
    let mut staging = BytesMut::new();
    let mut first = true;
    for chunk in input.chunks(piece) {
        staging.extend_from_slice(chunk);
        loop {
            match decoder.decode(&mut staging) {
                Ok(Some(frame)) => {
                    check(frame, first);
                    first = false;
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
