//! Writes the seed corpus of the fuzz targets into `fuzz/corpus/TARGET/`: real encodings made
//! by the crates' own encoders, in each target's input format (see the targets' docs). Run by
//! `cargo xtask fuzz seeds`; the files are kept in the repository.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use tensorwire_core::auth::{insecure_hello, ClientHandshake, ClusterSecret, NONCE_LEN};
use tensorwire_core::collective::stage_failure::{StageCause, StageReport};
use tensorwire_core::collective::Signature;
use tensorwire_core::device::Device;
use tensorwire_core::protocol::mesh::{GroupFrame, Hello, HelloReply};
use tensorwire_core::protocol::{GlobalId, Header};
use tensorwire_core::tensor::{DType, TensorMeta};
use tensorwire_core::wire::{encode_to_vec, Frame, WireLimits};
use tensorwire_rpc::fuzzing::{encode_hello, encode_message_header};
use tensorwire_store::protocol::{Request, VALIDATION_MAGIC};

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(name), bytes).unwrap();
}

fn enc(r: Request) -> Vec<u8> {
    let mut out = Vec::new();
    r.encode(&mut out);
    out
}

/// `store` input: `[connection, len, bytes]` per piece.
fn pieces(list: &[(u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (conn, bytes) in list {
        assert!(bytes.len() < 256);
        out.push(*conn);
        out.push(bytes.len() as u8);
        out.extend_from_slice(bytes);
    }
    out
}

fn store(dir: &Path) {
    let k = |s: &str| s.as_bytes().to_vec();
    let validate = enc(Request::Validate {
        magic: VALIDATION_MAGIC,
    });
    let every = [
        Request::Ping { nonce: 1234 },
        Request::Set {
            key: k("/a"),
            value: k("1"),
        },
        Request::Get { key: k("/a") },
        Request::Add {
            key: k("/a"),
            delta: 41,
        },
        Request::CompareSet {
            key: k("/a"),
            expected: k("42"),
            desired: k("x"),
        },
        Request::Check {
            keys: vec![k("/a"), k("/b")],
        },
        Request::Wait {
            keys: vec![k("/a")],
        },
        Request::GetNumKeys,
        Request::Append {
            key: k("/a"),
            value: k("yz"),
        },
        Request::MultiGet {
            keys: vec![k("/a")],
        },
        Request::MultiSet {
            pairs: vec![(k("/c"), k("3")), (k("/d"), k(""))],
        },
        Request::QueuePush {
            key: k("/q"),
            value: k("item"),
        },
        Request::QueueLen { key: k("/q") },
        Request::QueuePop { key: k("/q") },
        Request::ListKeys,
        Request::DeleteKey { key: k("/a") },
        Request::Barrier {
            key: k("/bar"),
            world_size: 1,
        },
        Request::CancelWait,
    ];
    let mut list = vec![(0, validate.clone())];
    list.extend(every.into_iter().map(|r| (0u8, enc(r))));
    write(dir, "store", "every-request", &pieces(&list));
    // A wait on connection 1 released by a set on connection 0; a barrier of two; a cancel.
    let list = vec![
        (0, validate.clone()),
        (1, validate.clone()),
        (
            1,
            enc(Request::Wait {
                keys: vec![k("/w")],
            }),
        ),
        (
            0,
            enc(Request::Set {
                key: k("/w"),
                value: k("go"),
            }),
        ),
        (
            1,
            enc(Request::Barrier {
                key: k("/b"),
                world_size: 2,
            }),
        ),
        (
            0,
            enc(Request::Barrier {
                key: k("/b"),
                world_size: 2,
            }),
        ),
        (2, validate.clone()),
        (
            2,
            enc(Request::Wait {
                keys: vec![k("/never")],
            }),
        ),
        (2, enc(Request::CancelWait)),
        (0x40, Vec::new()),
    ];
    let mut bytes = pieces(&list[..list.len() - 1]);
    bytes.push(0x41); // connection 1 hangs up
    write(dir, "store", "waits-and-barriers", &bytes);
    // One request split across pieces.
    let set = enc(Request::Set {
        key: k("/split"),
        value: vec![7; 40],
    });
    let (a, b) = set.split_at(13);
    write(
        dir,
        "store",
        "split-request",
        &pieces(&[(0, validate), (0, a.to_vec()), (0, b.to_vec())]),
    );
}

fn store_auth(dir: &Path) {
    let validate = enc(Request::Validate {
        magic: VALIDATION_MAGIC,
    });
    let ping = enc(Request::Ping { nonce: 9 });
    // op 1 hello (nonce follows), op 2 right proof, op 4 validate, op 0 raw bytes.
    let mut ok = vec![1];
    ok.extend_from_slice(&[0x11; 32]);
    ok.extend_from_slice(&[2, 4, 0, ping.len() as u8]);
    ok.extend_from_slice(&ping);
    write(dir, "store_auth", "honest-client", &ok);
    let mut wrong = vec![1];
    wrong.extend_from_slice(&[0x22; 32]);
    wrong.extend_from_slice(&[3, 5, 0, validate.len() as u8]);
    wrong.extend_from_slice(&validate);
    write(dir, "store_auth", "wrong-proof-then-pytorch-client", &wrong);
}

fn handshake(dir: &Path) {
    // Every mode (side, our secret, peer's secret), with an honest peer throughout.
    for mode in 0u8..12 {
        write(
            dir,
            "handshake",
            &format!("honest-mode-{mode}"),
            &[mode, 1, 1, 1],
        );
    }
    // A raw HELLO to a server with a secret, then a raw PROOF.
    let (_, hello) = ClientHandshake::start(ClusterSecret::new("x").unwrap(), [1; NONCE_LEN]);
    let mut raw = vec![3, 0];
    raw.extend_from_slice(&hello);
    raw.push(0);
    raw.extend_from_slice(&[0; 32]);
    write(dir, "handshake", "raw-hello-and-proof", &raw);
    let mut insecure = vec![1, 0];
    insecure.extend_from_slice(&insecure_hello());
    write(dir, "handshake", "raw-insecure-hello", &insecure);
}

fn frames(frames: &[Frame]) -> Vec<u8> {
    let limits = WireLimits::default();
    let mut out = vec![0x07]; // pieces of 8 bytes
    for f in frames {
        out.extend(encode_to_vec(f, &limits).unwrap());
    }
    out
}

fn rpc(dir: &Path) {
    let hello = encode_hello(1, "rpc");
    let call = Header::Call {
        id: 1,
        function: "add".into(),
        timeout: Duration::from_secs(60),
    };
    let metas = [
        TensorMeta {
            dtype: DType::F32,
            shape: vec![2, 3],
            device: Device::Cpu,
            ipc: None,
        },
        TensorMeta {
            dtype: DType::I64,
            shape: vec![1],
            device: Device::Cuda(1),
            ipc: None,
        },
    ];
    let with_tensors = Frame::message(
        encode_message_header(&call, &metas),
        vec![
            Bytes::from_static(b"\x02\x03"),
            Bytes::from(vec![0u8; 24]),
            Bytes::from(vec![0u8; 8]),
        ],
    );
    let plain = Frame::message(
        encode_message_header(&call, &[]),
        vec![Bytes::from_static(b"\x02\x03")],
    );
    let ack = Frame::message(
        encode_message_header(&Header::Ack { id: 1 }, &[]),
        Vec::new(),
    );
    write(
        dir,
        "rpc",
        "hello-call-tensors-ack",
        &frames(&[hello, with_tensors, plain, ack]),
    );
}

fn record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    out.extend_from_slice(&(key.len() as u32).to_ne_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(value.len() as u32).to_ne_bytes());
    out.extend_from_slice(value);
}

fn file_store(dir: &Path) {
    // A log as PyTorch's FileStore writes it: sets, an add, a deletion, the cleanup counter.
    let mut log = Vec::new();
    record(&mut log, b"/a", b"1");
    record(&mut log, b"/b", b"hello");
    record(&mut log, b"/a", b"2");
    record(&mut log, b"-/b", b"");
    record(&mut log, b"cleanup/", b"1");
    // Every operation on keys "a" and "b" (op, key index, value length, value).
    let mut ops = Vec::new();
    for op in 0u8..9 {
        ops.extend_from_slice(&[op, 8, 2, b'4', b'2']);
    }
    let mut input = (log.len() as u16).to_le_bytes().to_vec();
    input.extend_from_slice(&log);
    input.extend_from_slice(&ops);
    write(dir, "file_store", "pytorch-log-every-op", &input);
    // A torn last record (a writer died mid-write).
    let torn = &log[..log.len() - 3];
    let mut input = (torn.len() as u16).to_le_bytes().to_vec();
    input.extend_from_slice(torn);
    input.extend_from_slice(&ops);
    write(dir, "file_store", "torn-record", &input);
}

fn wire(dir: &Path) {
    let f = Frame::message(
        encode_message_header(&Header::Ack { id: 7 }, &[]),
        vec![Bytes::from_static(b"body")],
    );
    let c = Frame::control(Bytes::from_static(b"ctl"), Vec::new());
    let mut input = frames(&[f.clone(), c.clone()]);
    write(dir, "wire", "message-and-control", &input);
    input[0] = 0x1f; // whole, through direct reads
    write(dir, "wire", "message-and-control-direct", &input);
    // A process group's own frame (a collective message) between the agent's.
    let g = Frame::collective(
        GroupFrame::data_header(7, &Signature::Barrier.encode()),
        vec![Bytes::from_static(b"block")],
    );
    write(
        dir,
        "wire",
        "message-collective-control",
        &frames(&[f, g, c]),
    );
}

fn mesh_frames(dir: &Path) {
    let group = [
        GroupFrame::Data {
            seq: 7,
            signature: Signature::Barrier.encode(),
        },
        GroupFrame::Goodbye,
        GroupFrame::Abort {
            rank: 2,
            reason: "connection reset".into(),
        },
        GroupFrame::Disagreement {
            group: 1,
            seq: 3,
            peer: 1,
            theirs: Signature::Barrier,
            ours: Signature::AllToAll,
        },
        GroupFrame::StageFailed {
            group: 0,
            report: StageReport {
                ranks: vec![5],
                cause: StageCause::TimedOut {
                    waited: Duration::from_millis(3500),
                },
            },
        },
    ];
    for (i, f) in group.iter().enumerate() {
        let mut input = vec![0u8];
        input.extend_from_slice(&f.header());
        write(dir, "mesh_frames", &format!("group-{i}"), &input);
    }
    let hello = Hello {
        group: "rpc".into(),
        rank: 3,
        world: None,
        introduction: vec![1, 2, 3],
    };
    let mut input = vec![1u8];
    input.extend_from_slice(&hello.frame().header);
    write(dir, "mesh_frames", "hello", &input);
    for (i, r) in [
        HelloReply::Welcome,
        HelloReply::Refused {
            reason: "rank 3 is taken".into(),
            retry: true,
        },
    ]
    .iter()
    .enumerate()
    {
        let mut input = vec![2u8];
        input.extend_from_slice(&r.frame().header);
        write(dir, "mesh_frames", &format!("hello-reply-{i}"), &input);
    }
}

fn protocol(dir: &Path) {
    // Every kind of header, injected from worker 0 into worker 1 (op 0x10: with a body), each
    // followed by a delivery (op 2) and a timer tick (op 3).
    let id = |created_on, local| GlobalId { created_on, local };
    let headers = [
        Header::Call {
            id: 100,
            function: "echo".into(),
            timeout: Duration::from_secs(5),
        },
        Header::Remote {
            id: 101,
            function: "make".into(),
            rref: id(0, 9),
            fork: id(0, 9),
            secret: 9,
            timeout: Duration::from_secs(5),
        },
        Header::Fetch {
            id: 102,
            rref: id(1, 1),
            fork: id(0, 10),
            timeout: Duration::ZERO,
        },
        Header::Reply {
            id: 1,
            outcome: Ok(()),
            forks: Vec::new(),
        },
        Header::ForkRequest {
            id: 103,
            floor: 1,
            rref: id(1, 1),
            fork: id(0, 10),
            secret: 0,
        },
        Header::ChildAccept {
            id: 104,
            floor: 1,
            fork: id(0, 10),
        },
        Header::UserDelete {
            id: 105,
            floor: 1,
            rref: id(1, 1),
            fork: id(0, 10),
        },
        Header::Abandoned {
            rref: id(1, 1),
            reason: "gone".into(),
        },
        Header::Ack { id: 1 },
    ];
    for (seed, header) in headers.iter().enumerate() {
        let encoded = postcard::to_allocvec(header).unwrap();
        assert!(encoded.len() < 64);
        // Mode 1: the cluster simulation's forged headers (odd first byte).
        let mut input = vec![1u8];
        input.extend_from_slice(&(seed as u64 + 1).to_le_bytes());
        input.extend_from_slice(&[0x10, encoded.len() as u8]);
        input.extend_from_slice(&encoded);
        input.extend_from_slice(&[2, 2, 3]);
        write(dir, "protocol", &format!("header-{seed}"), &input);

        // Mode 0: the hostile peer. Worker 0 calls worker 1 (id 1), makes a value there (rref
        // 0:2, id 3) and fetches it (id 4); worker 2's forged header goes to worker 1 (op 5)
        // and to worker 0 (op 0x15, with a body: 0x35), between deliveries and a timer tick.
        let mut input = vec![0u8, 0, 1, 0x02, 7, 7, 7];
        for op in [0x05u8, 0x35] {
            input.push(op);
            input.push(encoded.len() as u8);
            input.extend_from_slice(&encoded);
            if op & 0x20 != 0 {
                input.extend_from_slice(&[5, b'f', b'o', b'r', b'g', b'e']);
            }
            input.extend_from_slice(&[7, 7, 4]);
        }
        input.extend_from_slice(&[7, 7, 7, 7, 6, 7, 7]);
        write(dir, "protocol", &format!("hostile-{seed}"), &input);
    }
    // Mode 0: worker 0 makes a value on worker 1 (op 1), it arrives (op 7); worker 2 fetches
    // it (op 8), calls a method on it (0x18), and fetches it through a made-up fork (0x28),
    // each a violation; then worker 0 fetches it (op 2) and everything is delivered.
    let input = vec![0u8, 1, 7, 7, 8, 0x18, 0x28, 2, 7, 7, 7, 7];
    write(dir, "protocol", "hostile-reads", &input);
}

/// `[len, bytes]`, as the targets' `chunk` reads it.
fn chunk(out: &mut Vec<u8>, bytes: &[u8]) {
    assert!(bytes.len() < 128);
    out.push(bytes.len() as u8);
    out.extend_from_slice(bytes);
}

fn membership(dir: &Path) {
    use std::net::SocketAddr;
    use tensorwire_core::protocol::gather::{Contribution, GatherOutcome};
    use tensorwire_core::protocol::membership::{DynMessage, MemberRecord};
    use tensorwire_core::protocol::JoinMessage;
    use tensorwire_core::validate::WorkerDeviceInfo;

    let record = |rank: u32| MemberRecord {
        rank,
        addr: SocketAddr::from(([127, 0, 0, 1], 1000 + rank as u16)),
        devices: WorkerDeviceInfo {
            name: format!("w{rank}"),
            ..WorkerDeviceInfo::default()
        },
    };
    let messages = [
        DynMessage::JoinRequest { record: record(4) },
        DynMessage::Joining {
            seq: 3,
            record: record(3),
        },
        DynMessage::Expecting { rank: 3 },
        DynMessage::Admit {
            seq: 3,
            members: vec![(0, record(0)), (1, record(1)), (2, record(2))],
        },
        DynMessage::Connected,
        DynMessage::Withdraw {
            reason: "plans differ".into(),
        },
        DynMessage::Welcome,
        DynMessage::Refused {
            reason: "name in use".into(),
            retry: true,
        },
        DynMessage::LeaveRequest,
        DynMessage::Left { rank: 1 },
    ];
    for (i, m) in messages.iter().enumerate() {
        let encoded = m.encode();
        let mut input = Vec::new();
        // To rank 0 from rank 2, to rank 1 from rank 2, to rank 0 from the stranger; each
        // followed by deliveries, a timer tick and the honest second contribution.
        for op in [0u8, 0x20, 0x10] {
            input.push(op);
            chunk(&mut input, &encoded);
            input.extend_from_slice(&[2, 2, 0x43, 7]);
        }
        input.extend_from_slice(&[4, 2, 2]);
        write(dir, "membership", &format!("dyn-{i}"), &input);
    }
    let mut input = Vec::new();
    for m in [JoinMessage::Ready, JoinMessage::Go] {
        input.push(5);
        chunk(&mut input, &postcard::to_allocvec(&m).unwrap());
    }
    write(dir, "membership", "static-join", &input);
    let contributions = [
        Contribution {
            name: "h".into(),
            expected: vec![0, 1],
            wait: Duration::from_secs(10),
            value: b"forged".to_vec(),
        },
        Contribution {
            name: "other".into(),
            expected: vec![0, 2],
            wait: Duration::from_secs(1),
            value: b"two".to_vec(),
        },
    ];
    for (i, c) in contributions.iter().enumerate() {
        let mut input = vec![6];
        chunk(&mut input, &c.encode());
        input.extend_from_slice(&[7, 0x23, 0x24]);
        write(dir, "membership", &format!("gather-{i}"), &input);
    }
    let answer = GatherOutcome::Done(vec![(0, b"a".to_vec()), (1, b"b".to_vec()), (2, vec![])]);
    let mut input = vec![6];
    chunk(&mut input, &answer.encode());
    write(dir, "membership", "gather-answer", &input);
}

fn shm_records(dir: &Path) {
    use tensorwire_transport_shm::fuzzing::{produce, Record};
    let sets: [&[Record]; 4] = [
        &[Record::Data { len: 100 }],
        &[
            Record::Data { len: 13 },
            Record::Segment { len: 1 << 20 },
            Record::Data { len: 0 },
        ],
        &[
            Record::Slab {
                id: 0,
                new: true,
                at: 0,
                seq: 1,
                len: 65536,
            },
            Record::Slab {
                id: 7,
                new: false,
                at: 40,
                seq: 9,
                len: 100,
            },
        ],
        &[Record::Data { len: 4000 }, Record::Segment { len: 5 }],
    ];
    for (i, records) in sets.iter().enumerate() {
        let (data, write_pos) = produce(4096, records).unwrap();
        let mut input = write_pos.to_le_bytes().to_vec();
        input.extend_from_slice(&0u64.to_le_bytes());
        input.extend_from_slice(&0u64.to_le_bytes());
        input.extend_from_slice(&data);
        write(dir, "shm_records", &format!("records-{i}"), &input);
    }
}

fn quic_prefix(dir: &Path) {
    use tensorwire_transport_quic::fuzzing::{
        encode, Deps, TAG_FRAME, TAG_GOODBYE, TAG_GOODBYE_ACK,
    };
    let stream = |out: &mut Vec<u8>, seq: u8, tag: u8, deps: Option<Deps>| {
        let mut prefix = vec![tag];
        if let Some(d) = &deps {
            encode(d, &mut prefix);
        }
        prefix.extend_from_slice(b"frame");
        out.push(seq);
        out.push(prefix.len() as u8);
        out.extend_from_slice(&prefix);
    };
    let deps = |below, extra: &[u64]| {
        Some(Deps {
            below,
            extra: extra.to_vec(),
        })
    };
    // Sequential sends arriving out of order, a concurrent one overtaking, a cancelled
    // stream, a goodbye and its answer.
    let mut input = Vec::new();
    stream(&mut input, 2, TAG_FRAME, deps(2, &[]));
    stream(&mut input, 0, TAG_FRAME, deps(0, &[]));
    stream(&mut input, 4, TAG_FRAME, deps(1, &[3]));
    input.extend_from_slice(&[1, 0]);
    stream(&mut input, 3, TAG_FRAME, deps(1, &[]));
    stream(&mut input, 5, TAG_GOODBYE, deps(5, &[]));
    stream(&mut input, 6, TAG_GOODBYE_ACK, None);
    write(dir, "quic_prefix", "streams", &input);
    let mut input = Vec::new();
    let many: Vec<u64> = (1..=32).collect();
    stream(&mut input, 200, TAG_FRAME, deps(0, &many[..16]));
    write(dir, "quic_prefix", "many-deps", &input);
}

fn store_client(dir: &Path) {
    use tensorwire_store::protocol::{CHECK_READY, REPLY_OK, REPLY_REFUSED, WAIT_STOP_WAITING};
    let value = |v: &[u8]| {
        let mut out = (v.len() as u64).to_ne_bytes().to_vec();
        out.extend_from_slice(v);
        out
    };
    let i64_reply = |n: i64| n.to_ne_bytes().to_vec();
    // Per op (see the target): the untagged reply bytes.
    let replies: [(u8, Vec<u8>); 12] = [
        (0, vec![]),
        (1, [vec![WAIT_STOP_WAITING], value(b"hello")].concat()),
        (2, i64_reply(42)),
        (3, vec![CHECK_READY]),
        (4, vec![WAIT_STOP_WAITING]),
        (5, value(b"new")),
        (6, i64_reply(1)),
        (7, i64_reply(3)),
        (8, vec![]),
        (
            9,
            [
                vec![WAIT_STOP_WAITING],
                value(b"a"),
                value(b""),
                value(b"c"),
            ]
            .concat(),
        ),
        (10, vec![]),
        (11, vec![WAIT_STOP_WAITING]),
    ];
    for (op, reply) in &replies {
        // Untagged: the op twice, its reply twice.
        let mut input = vec![0, *op, *op];
        input.extend_from_slice(reply);
        input.extend_from_slice(reply);
        write(dir, "store_client", &format!("plain-{op}"), &input);
        // Tagged: a status byte before each reply (two for a get: the wait's and the get's).
        let mut input = vec![1, *op];
        if matches!(op, 0 | 8 | 10) {
            // No reply.
        } else if matches!(op, 1 | 9) {
            input.extend_from_slice(&[REPLY_OK, WAIT_STOP_WAITING, REPLY_OK]);
            input.extend_from_slice(&reply[1..]);
        } else {
            input.push(REPLY_OK);
            input.extend_from_slice(reply);
        }
        write(dir, "store_client", &format!("tagged-{op}"), &input);
    }
    let mut refused = vec![1, 2, REPLY_REFUSED];
    refused.extend_from_slice(&value(b"max_value_len"));
    refused.extend_from_slice(&value(b"the value is too long"));
    write(dir, "store_client", "tagged-refused", &refused);
}

fn autograd(dir: &Path) {
    use tensorwire_core::autograd::{AutogradMessageId, BackwardError, ContextId};
    // Worker 0's first context, and the message it sent worker 2 in it (its second send).
    let shared = ContextId::new(0, 0);
    let private = ContextId::new(0, 1);
    let to_two = AutogradMessageId::new(0, 1);
    let mut input = Vec::new();
    // A gradient for it (op 0); the local run finishes (op 4); worker 1 answers (op 5), worker
    // 2 answers (op 3); a backward at the root (op 6), its run; a release (op 2); a recv of
    // a new message (op 1); worker 2 lost (op 7).
    input.push(0);
    chunk(
        &mut input,
        &postcard::to_allocvec(&(shared, to_two)).unwrap(),
    );
    input.extend_from_slice(&[4, 5]);
    input.push(3);
    chunk(
        &mut input,
        &postcard::to_allocvec(&Ok::<(), BackwardError>(())).unwrap(),
    );
    input.extend_from_slice(&[6, 4, 5, 4]);
    input.push(1);
    chunk(
        &mut input,
        &postcard::to_allocvec(&(private, AutogradMessageId::new(2, 1))).unwrap(),
    );
    input.push(2);
    let cause = Some(BackwardError::PeerLost {
        worker: 1,
        context: shared,
    });
    chunk(
        &mut input,
        &postcard::to_allocvec(&(shared, cause)).unwrap(),
    );
    input.push(7);
    write(dir, "autograd", "backward-release-lost", &input);
    let mut input = vec![0];
    chunk(
        &mut input,
        &postcard::to_allocvec(&(private, AutogradMessageId::new(0, 2))).unwrap(),
    );
    input.push(2);
    chunk(
        &mut input,
        &postcard::to_allocvec(&(private, None::<BackwardError>)).unwrap(),
    );
    write(dir, "autograd", "not-in-context", &input);
}

fn slurm(dir: &Path) {
    for (i, list) in [
        "node[01-04,7],gpu[1-3]",
        "r[1-2]n[1-2]",
        "n[098-101],login1",
        "n[0-999999999]",
        "a, b ,c",
        "n[3]-ib",
    ]
    .iter()
    .enumerate()
    {
        write(dir, "slurm", &format!("list-{i}"), list.as_bytes());
    }
}

fn main() {
    let dir: PathBuf = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus"));
    store(&dir);
    store_auth(&dir);
    handshake(&dir);
    rpc(&dir);
    file_store(&dir);
    wire(&dir);
    protocol(&dir);
    mesh_frames(&dir);
    membership(&dir);
    shm_records(&dir);
    quic_prefix(&dir);
    store_client(&dir);
    autograd(&dir);
    slurm(&dir);
    println!("seeds written to {}", dir.display());
}
