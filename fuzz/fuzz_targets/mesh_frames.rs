//! Fuzzes the mesh's frame decoders (`core::protocol::mesh`): the first byte picks the
//! decoder (a process group's own frame, a hello, the answer to a hello), the rest is the
//! header. Decoding never panics, and whatever decodes encodes back to a header that decodes
//! to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorwire_core::protocol::mesh::{GroupFrame, Hello, HelloReply};
use tensorwire_core::wire::Frame;

fuzz_target!(|data: &[u8]| {
    let Some((which, header)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            if let Ok(f) = GroupFrame::decode(header) {
                assert_eq!(GroupFrame::decode(&f.header()).as_ref(), Ok(&f));
            }
        }
        1 => {
            if let Ok(h) = Hello::from_frame(&Frame::control(header.to_vec(), Vec::new())) {
                assert_eq!(Hello::from_frame(&h.frame()).as_ref(), Ok(&h));
            }
        }
        _ => {
            if let Ok(r) = HelloReply::from_frame(&Frame::control(header.to_vec(), Vec::new())) {
                assert_eq!(HelloReply::from_frame(&r.frame()).as_ref(), Ok(&r));
            }
        }
    }
});
