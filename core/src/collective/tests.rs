//! Every collective, simulated for every rank of every world size 1..=64.

use proptest::prelude::*;

use super::sim::{self, hand_schedule, hand_step, Outcome};
use super::*;

const MAX_WORLD: usize = 64;

fn ceil_log2(n: usize) -> usize {
    if n <= 1 {
        0
    } else {
        (n - 1).ilog2() as usize + 1
    }
}

fn everyone(n: usize) -> u128 {
    (1u128 << n) - 1
}

/// SplitMix64: deterministic test data without a dependency.
fn mix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn simulate(schedules: &[Schedule], inputs: &[Vec<u8>]) -> Result<Outcome, String> {
    sim::run(schedules, inputs)
}

// ---------------------------------------------------------------------------------------------
// barrier

#[test]
fn barrier_every_world_is_dissemination() {
    for n in 1..=MAX_WORLD {
        let schedules: Vec<Schedule> = (0..n).map(|r| barrier(r, n).unwrap()).collect();
        for (r, s) in schedules.iter().enumerate() {
            assert_eq!(s.steps().len(), ceil_log2(n), "rank {r} of {n}");
            for (k, step) in s.steps().iter().enumerate() {
                let [send] = step.sends() else {
                    panic!("one send")
                };
                let [recv] = step.receives() else {
                    panic!("one receive")
                };
                assert_eq!(send.peer(), (r + (1 << k)) % n);
                assert_eq!(recv.peer(), (r + n - (1 << k) % n) % n);
                assert!(send.is_empty() && recv.is_empty());
                assert_eq!(step.waits_on().collect::<Vec<_>>(), vec![recv.peer()]);
            }
        }
        let out = simulate(&schedules, &vec![Vec::new(); n]).unwrap();
        assert_eq!(out.depth, ceil_log2(n), "rounds for {n} ranks");
        // The barrier's guarantee: no rank leaves before hearing (transitively) from all.
        assert!(out.heard.iter().all(|h| *h == everyone(n)), "world {n}");
    }
}

// ---------------------------------------------------------------------------------------------
// broadcast

fn check_broadcast(n: usize, root: usize, len: usize) -> Result<(), String> {
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| broadcast(r, n, root, len).unwrap())
        .collect();
    let payload: Vec<u8> = (0..len)
        .map(|i| mix((root * 1000 + i) as u64) as u8)
        .collect();
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| {
            if r == root {
                payload.clone()
            } else {
                Vec::new()
            }
        })
        .collect();
    let out = simulate(&schedules, &inputs)?;
    for (r, buffer) in out.buffers.iter().enumerate() {
        if *buffer != payload {
            return Err(format!(
                "world {n} root {root} len {len}: rank {r} got other bytes"
            ));
        }
        let receives: usize = schedules[r]
            .steps()
            .iter()
            .map(|s| s.receives().len())
            .sum();
        let want = usize::from(r != root && len > 0);
        if receives != want {
            return Err(format!("rank {r} receives {receives} times, want {want}"));
        }
        if len > 0 && out.heard[r] & (1 << root) == 0 {
            return Err(format!("rank {r} never heard from root {root}"));
        }
    }
    let depth = if len == 0 { 0 } else { ceil_log2(n) };
    if out.depth != depth {
        return Err(format!(
            "world {n} root {root}: depth {} want {depth}",
            out.depth
        ));
    }
    Ok(())
}

#[test]
fn broadcast_every_world_every_root() {
    for n in 1..=MAX_WORLD {
        for root in 0..n {
            for len in [0, 5] {
                check_broadcast(n, root, len).unwrap();
            }
        }
        check_broadcast(n, n / 2, 1000).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// all_gather

fn check_all_gather(lens: &[usize], algorithm: AllGatherAlgorithm) -> Result<Outcome, String> {
    let n = lens.len();
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| all_gather(r, lens, algorithm).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let inputs: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(r, len)| (0..*len).map(|i| mix((r << 20 | i) as u64) as u8).collect())
        .collect();
    let want = inputs.concat();
    let out = simulate(&schedules, &inputs)?;
    for (r, buffer) in out.buffers.iter().enumerate() {
        if *buffer != want {
            return Err(format!(
                "{algorithm:?} lens {lens:?}: rank {r} has the wrong blocks"
            ));
        }
        // No block reaches a rank twice: it receives exactly the others' bytes.
        let received: usize = schedules[r]
            .steps()
            .iter()
            .flat_map(|s| s.receives())
            .map(|x| x.len())
            .sum();
        if received != want.len() - lens[r] {
            return Err(format!(
                "{algorithm:?} lens {lens:?}: rank {r} receives {received} bytes"
            ));
        }
    }
    Ok(out)
}

#[test]
fn all_gather_every_world_every_algorithm() {
    for n in 1..=MAX_WORLD {
        let patterns: [Vec<usize>; 5] = [
            vec![0; n],
            vec![1; n],
            vec![5; n],
            (0..n).map(|i| (i * 7 + 3) % 6).collect(),
            (0..n).map(|i| if i == n / 2 { 9 } else { 0 }).collect(),
        ];
        let mut algorithms = vec![AllGatherAlgorithm::Ring, AllGatherAlgorithm::Bruck];
        if n.is_power_of_two() {
            algorithms.push(AllGatherAlgorithm::RecursiveDoubling);
        }
        for algorithm in algorithms {
            for lens in &patterns {
                let out = check_all_gather(lens, algorithm).unwrap();
                if lens.iter().all(|l| *l > 0) {
                    let depth = match algorithm {
                        AllGatherAlgorithm::Ring => n - 1,
                        _ => ceil_log2(n),
                    };
                    assert_eq!(out.depth, depth, "{algorithm:?} world {n}");
                    assert!(out.heard.iter().all(|h| *h == everyone(n)));
                }
            }
        }
    }
}

#[test]
fn all_gather_recursive_doubling_needs_power_of_two() {
    assert_eq!(
        all_gather(0, &[1; 6], AllGatherAlgorithm::RecursiveDoubling),
        Err(CollectiveError::NotPowerOfTwo { world: 6 })
    );
}

#[test]
fn all_gather_selection_follows_thresholds() {
    use AllGatherAlgorithm::*;
    assert_eq!(AllGatherAlgorithm::select(&[8; 8]), RecursiveDoubling);
    assert_eq!(AllGatherAlgorithm::select(&[8; 7]), Bruck);
    assert_eq!(AllGatherAlgorithm::select(&[1 << 20; 8]), Ring);
    assert_eq!(
        AllGatherAlgorithm::select(&[ALL_GATHER_BRUCK_MAX_BYTES / 3 + 1; 3]),
        Ring
    );
    assert_eq!(AllGatherAlgorithm::select(&[1]), RecursiveDoubling);
    assert_eq!(AllGatherAlgorithm::select(&[usize::MAX, 1, 1]), Ring);
}

// ---------------------------------------------------------------------------------------------
// all_reduce

/// The element types and operations checked against floating-point tolerances; every type and
/// every operation is checked exactly by [`check_all_reduce_exact`] and the reduce tests.
const BASIC_TYPES: [ElementType; 4] = [
    ElementType::F32,
    ElementType::F64,
    ElementType::I32,
    ElementType::I64,
];
const BASIC_OPS: [ReduceOp; 4] = [
    ReduceOp::Sum,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
];

/// One rank's input: values chosen per operation so that results stay finite, float sums
/// depend on the order of operands, and min/max see ties between -0.0 and +0.0.
fn element_values(rank: usize, count: usize, element: ElementType, op: ReduceOp) -> Vec<f64> {
    (0..count)
        .map(|i| {
            let h = mix((rank as u64) << 32 | i as u64);
            match (element.is_float(), op) {
                (true, ReduceOp::Sum) => ((h % 200_001) as f64 - 100_000.0) / 77.0,
                (true, ReduceOp::Product) => 0.5 + (h % 1000) as f64 / 1000.0,
                (true, _) if h % 4 == 0 => {
                    if h % 8 == 0 {
                        -0.0
                    } else {
                        0.0
                    }
                }
                (true, _) => ((h % 2001) as f64 - 1000.0) / 8.0,
                (false, _) => 0.0,
            }
        })
        .collect()
}

fn encode_floats(values: &[f64], element: ElementType) -> Vec<u8> {
    match element {
        ElementType::F32 => values
            .iter()
            .flat_map(|v| (*v as f32).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn decode_floats(bytes: &[u8], element: ElementType) -> Vec<f64> {
    match element {
        ElementType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        _ => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
    }
}

fn int_values(rank: usize, count: usize) -> Vec<i64> {
    (0..count)
        .map(|i| mix((rank as u64) << 32 | i as u64 | 1 << 63) as i64)
        .collect()
}

fn encode_ints(values: &[i64], element: ElementType) -> Vec<u8> {
    match element {
        ElementType::I32 => values
            .iter()
            .flat_map(|v| (*v as i32).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Runs an all_reduce and checks it; returns the depth.
fn check_all_reduce(
    n: usize,
    count: usize,
    element: ElementType,
    op: ReduceOp,
    algorithm: AllReduceAlgorithm,
) -> Result<usize, String> {
    let context = format!("{algorithm:?} {op} {element} x{count} world {n}");
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| all_reduce(r, n, count, element, op, algorithm).unwrap())
        .collect();
    let want: Vec<u8>;
    let inputs: Vec<Vec<u8>>;
    let mut tolerance = Vec::new();
    let mut reference = Vec::new();
    if element.is_float() {
        let values: Vec<Vec<f64>> = (0..n)
            .map(|r| {
                let v = element_values(r, count, element, op);
                // Round through the element type so the reference sees what the ranks see.
                decode_floats(&encode_floats(&v, element), element)
            })
            .collect();
        inputs = values.iter().map(|v| encode_floats(v, element)).collect();
        let eps = if element == ElementType::F32 {
            f64::from(f32::EPSILON)
        } else {
            f64::EPSILON
        };
        for i in 0..count {
            let column = values.iter().map(|v| v[i]);
            let (value, bound) = match op {
                ReduceOp::Sum => {
                    let abs: f64 = values.iter().map(|v| v[i].abs()).sum();
                    (column.sum::<f64>(), 2.0 * n as f64 * eps * abs)
                }
                ReduceOp::Product => {
                    let p: f64 = column.product();
                    (p, 2.0 * n as f64 * eps * p.abs())
                }
                ReduceOp::Min => (column.fold(f64::INFINITY, f64::min), 0.0),
                ReduceOp::Max => (column.fold(f64::NEG_INFINITY, f64::max), 0.0),
                other => unreachable!("{other} is checked by check_all_reduce_exact"),
            };
            reference.push(value);
            tolerance.push(bound);
        }
        want = Vec::new();
    } else {
        let values: Vec<Vec<i64>> = (0..n).map(|r| int_values(r, count)).collect();
        inputs = values.iter().map(|v| encode_ints(v, element)).collect();
        let narrow = |v: i64| {
            if element == ElementType::I32 {
                i64::from(v as i32)
            } else {
                v
            }
        };
        let reduced: Vec<i64> = (0..count)
            .map(|i| {
                let mut column = values.iter().map(|v| narrow(v[i]));
                let first = column.next().unwrap_or(0);
                narrow(column.fold(first, |a, b| match op {
                    ReduceOp::Sum => a.wrapping_add(b),
                    ReduceOp::Product => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                    other => unreachable!("{other} is checked by check_all_reduce_exact"),
                }))
            })
            .collect();
        want = encode_ints(&reduced, element);
    }
    let out = simulate(&schedules, &inputs).map_err(|e| format!("{context}: {e}"))?;
    for (r, buffer) in out.buffers.iter().enumerate() {
        if *buffer != out.buffers[0] {
            return Err(format!("{context}: rank {r} differs bitwise from rank 0"));
        }
    }
    if element.is_float() {
        let got = decode_floats(&out.buffers[0], element);
        for (i, ((g, w), t)) in got.iter().zip(&reference).zip(&tolerance).enumerate() {
            if (g - w).abs() > *t {
                return Err(format!(
                    "{context}: element {i} is {g}, reference {w} ± {t}"
                ));
            }
        }
    } else if out.buffers[0] != want {
        return Err(format!("{context}: wrong integer result"));
    }
    if count > 0 && out.heard.iter().any(|h| *h != everyone(n)) {
        return Err(format!(
            "{context}: a rank's result misses some rank's data"
        ));
    }
    Ok(out.depth)
}

fn expected_depth(n: usize, count: usize, algorithm: AllReduceAlgorithm) -> Option<usize> {
    match algorithm {
        _ if count == 0 => Some(0),
        AllReduceAlgorithm::RecursiveDoubling => {
            let p = 1usize << n.ilog2();
            Some(p.ilog2() as usize + if p == n { 0 } else { 2 })
        }
        AllReduceAlgorithm::Ring if count >= n => Some(2 * (n - 1)),
        // With empty chunks some ring hops are left out; the depth is then not fixed.
        AllReduceAlgorithm::Ring => None,
    }
}

#[test]
fn all_reduce_every_world_both_algorithms() {
    for n in 1..=MAX_WORLD {
        for algorithm in [
            AllReduceAlgorithm::RecursiveDoubling,
            AllReduceAlgorithm::Ring,
        ] {
            for count in [0, 1, n.saturating_sub(1), n, 2 * n + 3] {
                let depth =
                    check_all_reduce(n, count, ElementType::I64, ReduceOp::Sum, algorithm).unwrap();
                if let Some(want) = expected_depth(n, count, algorithm) {
                    assert_eq!(depth, want, "{algorithm:?} world {n} count {count}");
                }
            }
            check_all_reduce(n, n + 5, ElementType::F32, ReduceOp::Sum, algorithm).unwrap();
        }
    }
}

#[test]
fn all_reduce_every_op_and_element() {
    for n in [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 31, 33, 64] {
        for algorithm in [
            AllReduceAlgorithm::RecursiveDoubling,
            AllReduceAlgorithm::Ring,
        ] {
            for element in BASIC_TYPES {
                for op in BASIC_OPS {
                    for count in [0, 3, n + 1, 2 * n + 5] {
                        check_all_reduce(n, count, element, op, algorithm).unwrap();
                    }
                }
            }
        }
    }
}

#[test]
fn all_reduce_selection_follows_thresholds() {
    use AllReduceAlgorithm::*;
    let big = ALL_REDUCE_RING_MIN_BYTES / 4;
    assert_eq!(AllReduceAlgorithm::select(8, big, ElementType::F32), Ring);
    assert_eq!(
        AllReduceAlgorithm::select(8, big - 1, ElementType::F32),
        RecursiveDoubling
    );
    assert_eq!(
        AllReduceAlgorithm::select(2, 1 << 30, ElementType::F64),
        RecursiveDoubling
    );
    assert_eq!(
        AllReduceAlgorithm::select(1 << 20, big, ElementType::I32),
        RecursiveDoubling
    );
}

#[test]
fn builders_reject_bad_arguments() {
    assert_eq!(barrier(0, 0), Err(CollectiveError::EmptyWorld));
    assert_eq!(
        barrier(3, 3),
        Err(CollectiveError::RankOutOfRange { rank: 3, world: 3 })
    );
    assert_eq!(
        broadcast(0, 4, 4, 1),
        Err(CollectiveError::RootOutOfRange { root: 4, world: 4 })
    );
    assert_eq!(
        all_gather(0, &[], AllGatherAlgorithm::Ring),
        Err(CollectiveError::EmptyWorld)
    );
    assert_eq!(
        all_gather(0, &[usize::MAX, 1], AllGatherAlgorithm::Ring),
        Err(CollectiveError::SizeOverflow)
    );
    assert_eq!(
        all_reduce(
            0,
            2,
            usize::MAX,
            ElementType::I64,
            ReduceOp::Sum,
            AllReduceAlgorithm::Ring
        ),
        Err(CollectiveError::SizeOverflow)
    );
    let message = barrier(5, 2).unwrap_err().to_string();
    assert_eq!(message, "rank 5 is out of range for a world of 2 ranks");
}

#[test]
fn receive_apply_rejects_bad_messages_untouched() {
    let schedule = all_reduce(
        0,
        2,
        4,
        ElementType::F32,
        ReduceOp::Sum,
        AllReduceAlgorithm::Ring,
    )
    .unwrap();
    let recv = &schedule.steps()[0].receives()[0];
    assert_eq!(recv.peer(), 1);
    let mut buffer = vec![1u8; 16];
    assert_eq!(
        recv.apply(&mut buffer, &[0u8; 7]),
        Err(CollectiveError::MessageLength {
            peer: 1,
            expected: 8,
            actual: 7
        })
    );
    let mut short = vec![1u8; 12];
    assert!(matches!(
        recv.apply(&mut short, &[0u8; 8]),
        Err(CollectiveError::BufferTooShort { peer: 1, .. })
    ));
    assert_eq!(buffer, vec![1u8; 16]);
    assert_eq!(short, vec![1u8; 12]);
}

// ---------------------------------------------------------------------------------------------
// every element type and operation, exactly

/// One element of `element` from a small integer, as its little-endian bytes.
fn encode_one(v: i64, element: ElementType) -> Vec<u8> {
    match element {
        ElementType::F32 => (v as f32).to_le_bytes().to_vec(),
        ElementType::F64 => (v as f64).to_le_bytes().to_vec(),
        ElementType::F16 => half::f16::from_f32(v as f32).to_le_bytes().to_vec(),
        ElementType::BF16 => half::bf16::from_f32(v as f32).to_le_bytes().to_vec(),
        ElementType::I32 => (v as i32).to_le_bytes().to_vec(),
        ElementType::I64 => v.to_le_bytes().to_vec(),
        ElementType::I16 => (v as i16).to_le_bytes().to_vec(),
        ElementType::U8 | ElementType::I8 | ElementType::Bool => vec![v as u8],
    }
}

/// Inputs whose reduction is exact in any order: small integers for floats (±1 for products,
/// so 64 ranks stay within f16 and bf16), anything for integers (they wrap), any byte for
/// bool (nonzero is true).
fn exact_input(
    rank: usize,
    count: usize,
    element: ElementType,
    op: ReduceOp,
    salt: u64,
) -> Vec<u8> {
    (0..count)
        .flat_map(|i| {
            let h = mix(salt ^ (rank as u64) << 32 ^ i as u64);
            let v = match (element.is_float(), op) {
                (true, ReduceOp::Product) => {
                    if h % 2 == 0 {
                        1
                    } else {
                        -1
                    }
                }
                (true, _) => (h % 5) as i64 - 2,
                (false, _) if element == ElementType::Bool => (h % 3) as i64 * 3,
                (false, _) => h as i64,
            };
            encode_one(v, element)
        })
        .collect()
}

/// The reduction of `inputs` folded left to right, then finished (avg divides).
fn fold_reference(inputs: &[Vec<u8>], element: ElementType, op: ReduceOp) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for incoming in &inputs[1..] {
        reduce_into(op, element, &mut acc, incoming, false).unwrap();
    }
    op.finish(element, &mut acc, inputs.len());
    acc
}

fn supported_pairs() -> Vec<(ElementType, ReduceOp)> {
    ElementType::ALL
        .iter()
        .flat_map(|e| ReduceOp::ALL.iter().map(move |o| (*e, *o)))
        .filter(|(e, o)| o.supports(*e))
        .collect()
}

/// An all_reduce of exact inputs: every rank ends bitwise equal to the folded reference.
fn check_all_reduce_exact(
    n: usize,
    count: usize,
    element: ElementType,
    op: ReduceOp,
    algorithm: AllReduceAlgorithm,
) -> Result<(), String> {
    let context = format!("{algorithm:?} {op} {element} x{count} world {n}");
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| all_reduce(r, n, count, element, op, algorithm).unwrap())
        .collect();
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| exact_input(r, count, element, op, 7))
        .collect();
    let want = fold_reference(&inputs, element, op);
    let out = simulate(&schedules, &inputs).map_err(|e| format!("{context}: {e}"))?;
    for (r, mut buffer) in out.buffers.into_iter().enumerate() {
        op.finish(element, &mut buffer, n);
        if buffer != want {
            return Err(format!("{context}: rank {r} has {buffer:?}, want {want:?}"));
        }
    }
    Ok(())
}

#[test]
fn all_reduce_every_type_and_supported_op_is_exact() {
    for n in [1, 2, 3, 4, 5, 7, 8, 13, 16, 33, 64] {
        for (element, op) in supported_pairs() {
            for algorithm in [
                AllReduceAlgorithm::RecursiveDoubling,
                AllReduceAlgorithm::Ring,
            ] {
                for count in [0, 1, n + 2] {
                    check_all_reduce_exact(n, count, element, op, algorithm).unwrap();
                }
            }
        }
    }
}

/// f16 and bf16 sums round at every step, so they depend on the order of operands; every rank
/// must still end with the same bits (values here are not exact in either type).
#[test]
fn half_float_reductions_are_bitwise_identical_on_every_rank() {
    for n in [2, 3, 5, 8, 13, 16, 33, 64] {
        for element in [ElementType::F16, ElementType::BF16] {
            for op in [
                ReduceOp::Sum,
                ReduceOp::Avg,
                ReduceOp::Product,
                ReduceOp::Max,
            ] {
                for algorithm in [
                    AllReduceAlgorithm::RecursiveDoubling,
                    AllReduceAlgorithm::Ring,
                ] {
                    let count = n + 3;
                    let inputs: Vec<Vec<u8>> = (0..n)
                        .map(|r| {
                            (0..count)
                                .flat_map(|i| {
                                    let h = mix((r as u64) << 32 | i as u64);
                                    let v = 0.9 + (h % 1000) as f32 / 4096.0;
                                    match element {
                                        ElementType::F16 => half::f16::from_f32(v).to_le_bytes(),
                                        _ => half::bf16::from_f32(v).to_le_bytes(),
                                    }
                                })
                                .collect()
                        })
                        .collect();
                    let schedules: Vec<Schedule> = (0..n)
                        .map(|r| all_reduce(r, n, count, element, op, algorithm).unwrap())
                        .collect();
                    let out = simulate(&schedules, &inputs).unwrap();
                    for (r, buffer) in out.buffers.iter().enumerate() {
                        assert_eq!(
                            buffer, &out.buffers[0],
                            "{algorithm:?} {op} {element} world {n}: rank {r} differs"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn builders_refuse_what_gloo_refuses_naming_op_and_type() {
    for (element, op) in ElementType::ALL
        .iter()
        .flat_map(|e| ReduceOp::ALL.iter().map(move |o| (*e, *o)))
        .filter(|(e, o)| !o.supports(*e))
    {
        let want = Err(CollectiveError::UnsupportedReduction { op, element });
        assert_eq!(
            all_reduce(0, 2, 1, element, op, AllReduceAlgorithm::Ring),
            want
        );
        assert_eq!(reduce(0, 2, 0, 1, element, op), want);
        assert_eq!(reduce_scatter(0, &[1, 1], element, op), want);
    }
}

// ---------------------------------------------------------------------------------------------
// reduce

fn check_reduce(
    n: usize,
    root: usize,
    count: usize,
    element: ElementType,
    op: ReduceOp,
) -> Result<Outcome, String> {
    let context = format!("reduce {op} {element} x{count} world {n} root {root}");
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| reduce(r, n, root, count, element, op).unwrap())
        .collect();
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| exact_input(r, count, element, op, 11))
        .collect();
    let want = fold_reference(&inputs, element, op);
    let out = simulate(&schedules, &inputs).map_err(|e| format!("{context}: {e}"))?;
    let mut got = out.buffers[root][schedules[root].output_range()].to_vec();
    op.finish(element, &mut got, n);
    if got != want {
        return Err(format!("{context}: root has {got:?}, want {want:?}"));
    }
    for (r, s) in schedules.iter().enumerate() {
        if r != root && !s.output_range().is_empty() {
            return Err(format!("{context}: rank {r} claims a result"));
        }
    }
    if count > 0 && out.heard[root] != everyone(n) {
        return Err(format!("{context}: the root misses some rank's data"));
    }
    Ok(out)
}

#[test]
fn reduce_every_world_every_root() {
    for n in 1..=MAX_WORLD {
        let out = check_reduce(n, 0, 0, ElementType::I64, ReduceOp::Sum).unwrap();
        assert_eq!(out.depth, 0, "world {n}");
        for root in 0..n {
            let out = check_reduce(n, root, 3, ElementType::I64, ReduceOp::Sum).unwrap();
            assert_eq!(out.depth, ceil_log2(n), "world {n}");
        }
        // A fifth of the (type, op) pairs per world size: every pair within five sizes.
        for (element, op) in supported_pairs().into_iter().skip(n % 5).step_by(5) {
            check_reduce(n, n / 3, 2, element, op).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// reduce_scatter

fn check_reduce_scatter(
    counts: &[usize],
    element: ElementType,
    op: ReduceOp,
) -> Result<Outcome, String> {
    let n = counts.len();
    let context = format!("reduce_scatter {op} {element} {counts:?}");
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| reduce_scatter(r, counts, element, op).unwrap())
        .collect();
    let total: usize = counts.iter().sum();
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| exact_input(r, total, element, op, 13))
        .collect();
    let want = fold_reference(&inputs, element, op);
    let out = simulate(&schedules, &inputs).map_err(|e| format!("{context}: {e}"))?;
    let mut offset = 0;
    for (r, count) in counts.iter().enumerate() {
        let range = offset * element.size()..(offset + count) * element.size();
        offset += count;
        if schedules[r].output_range() != range {
            return Err(format!(
                "{context}: rank {r}'s output range {:?}",
                schedules[r].output_range()
            ));
        }
        let mut got = out.buffers[r][range.clone()].to_vec();
        op.finish(element, &mut got, n);
        if got != want[range] {
            return Err(format!("{context}: rank {r} has the wrong chunk"));
        }
    }
    Ok(out)
}

#[test]
fn reduce_scatter_every_world_even_and_uneven_chunks() {
    for n in 1..=MAX_WORLD {
        let patterns: [Vec<usize>; 4] = [
            vec![0; n],
            vec![2; n],
            (0..n).map(|i| (i * 5 + 1) % 4).collect(),
            (0..n).map(|i| usize::from(i == n / 2) * 3).collect(),
        ];
        for counts in &patterns {
            let out = check_reduce_scatter(counts, ElementType::I32, ReduceOp::Sum).unwrap();
            if counts.iter().all(|c| *c > 0) {
                assert_eq!(out.depth, n - 1, "world {n}");
                assert!(out.heard.iter().all(|h| *h == everyone(n)));
            }
        }
        for (element, op) in supported_pairs().into_iter().skip(n % 5).step_by(5) {
            check_reduce_scatter(&patterns[2], element, op).unwrap();
        }
    }
}

/// reduce_scatter_v on exact inputs: every rank's output range is its chunk and holds the
/// reduction; each rank sends its own chunks once (nothing forwarded).
fn check_reduce_scatter_v(
    counts: &[usize],
    element: ElementType,
    op: ReduceOp,
) -> Result<Outcome, String> {
    let n = counts.len();
    let context = format!("reduce_scatter_v {op} {element} {counts:?}");
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| reduce_scatter_v(r, counts, element, op).unwrap())
        .collect();
    let total: usize = counts.iter().sum();
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| exact_input(r, total, element, op, 17))
        .collect();
    let want = fold_reference(&inputs, element, op);
    let out = simulate(&schedules, &inputs).map_err(|e| format!("{context}: {e}"))?;
    let mut offset = 0;
    for (r, count) in counts.iter().enumerate() {
        let range = offset * element.size()..(offset + count) * element.size();
        offset += count;
        if schedules[r].output_range() != range {
            return Err(format!("{context}: rank {r}'s output range"));
        }
        let sent: usize = schedules[r]
            .steps()
            .iter()
            .flat_map(|s| s.sends())
            .map(|t| t.len())
            .sum();
        if sent != (total - count) * element.size() {
            return Err(format!("{context}: rank {r} sent {sent} bytes"));
        }
        let mut got = out.buffers[r][range.clone()].to_vec();
        op.finish(element, &mut got, n);
        if got != want[range] {
            return Err(format!("{context}: rank {r} has the wrong chunk"));
        }
    }
    Ok(out)
}

#[test]
fn reduce_scatter_v_every_world_even_and_uneven_chunks() {
    for n in 1..=MAX_WORLD {
        let patterns: [Vec<usize>; 4] = [
            vec![0; n],
            vec![2; n],
            (0..n).map(|i| (i * 5 + 1) % 4).collect(),
            (0..n).map(|i| usize::from(i == n / 2) * 3).collect(),
        ];
        for counts in &patterns {
            let out = check_reduce_scatter_v(counts, ElementType::I32, ReduceOp::Sum).unwrap();
            if counts.iter().all(|c| *c > 0) {
                assert_eq!(out.depth, n - 1, "world {n}");
                assert!(out.heard.iter().all(|h| *h == everyone(n)));
            }
        }
        for (element, op) in supported_pairs().into_iter().skip(n % 5).step_by(5) {
            check_reduce_scatter_v(&patterns[2], element, op).unwrap();
        }
    }
}

/// Floats whose sum depends on the order: rank r's chunk is its own, then rank r − 1's,
/// r − 2's, ... folded left to right, bit for bit, as the schedule documents.
#[test]
fn reduce_scatter_v_folds_in_its_documented_order() {
    for n in 1..=MAX_WORLD {
        let counts: Vec<usize> = (0..n).map(|i| 1 + (i * 3) % 4).collect();
        let total: usize = counts.iter().sum();
        let inputs: Vec<Vec<u8>> = (0..n)
            .map(|r| {
                (0..total)
                    .flat_map(|i| {
                        let h = mix(((r as u64) << 32) ^ i as u64);
                        (f32::from_bits((h as u32 & 0x007f_ffff) | 0x3f80_0000) * 1e3
                            / (1 + h % 97) as f32)
                            .to_le_bytes()
                    })
                    .collect()
            })
            .collect();
        let schedules: Vec<Schedule> = (0..n)
            .map(|r| reduce_scatter_v(r, &counts, ElementType::F32, ReduceOp::Sum).unwrap())
            .collect();
        let out = simulate(&schedules, &inputs).unwrap();
        let mut offset = 0;
        for (r, count) in counts.iter().enumerate() {
            let range = 4 * offset..4 * (offset + count);
            offset += count;
            let mut acc = inputs[r][range.clone()].to_vec();
            for k in 1..n {
                let from = (r + n - k) % n;
                let incoming = &inputs[from][range.clone()];
                reduce_into(ReduceOp::Sum, ElementType::F32, &mut acc, incoming, false).unwrap();
            }
            assert_eq!(out.buffers[r][range], acc, "world {n}, rank {r}");
        }
    }
}

#[test]
fn reduce_scatter_v_refuses_what_the_ring_refuses() {
    assert_eq!(
        reduce_scatter_v(2, &[1, 1], ElementType::F32, ReduceOp::Sum).unwrap_err(),
        reduce_scatter(2, &[1, 1], ElementType::F32, ReduceOp::Sum).unwrap_err()
    );
    assert_eq!(
        reduce_scatter_v(0, &[usize::MAX, 1], ElementType::F32, ReduceOp::Sum).unwrap_err(),
        CollectiveError::SizeOverflow
    );
    assert!(matches!(
        reduce_scatter_v(0, &[1], ElementType::F32, ReduceOp::BXor),
        Err(CollectiveError::UnsupportedReduction { .. })
    ));
    assert!(matches!(
        reduce_scatter_v(0, &[], ElementType::F32, ReduceOp::Sum),
        Err(CollectiveError::EmptyWorld)
    ));
}

// ---------------------------------------------------------------------------------------------
// gather and scatter

fn block_of(rank: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| mix((rank << 20 | i) as u64 ^ 0x5ca7) as u8)
        .collect()
}

fn check_gather(root: usize, lens: &[usize]) -> Result<(), String> {
    let n = lens.len();
    let context = format!("gather root {root} {lens:?}");
    // Other ranks know only their own length: give them zeros for the rest.
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| {
            let view: Vec<usize> = if r == root {
                lens.to_vec()
            } else {
                (0..n).map(|p| if p == r { lens[p] } else { 0 }).collect()
            };
            gather(r, root, &view).unwrap()
        })
        .collect();
    let inputs: Vec<Vec<u8>> = (0..n).map(|r| block_of(r, lens[r])).collect();
    let out = simulate(&schedules, &inputs).map_err(|e| format!("{context}: {e}"))?;
    let got = &out.buffers[root][schedules[root].output_range()];
    if got != inputs.concat() {
        return Err(format!("{context}: the root has other blocks"));
    }
    if out.depth > 1 {
        return Err(format!("{context}: depth {}", out.depth));
    }
    Ok(())
}

fn check_scatter(root: usize, lens: &[usize]) -> Result<(), String> {
    let n = lens.len();
    let context = format!("scatter root {root} {lens:?}");
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| {
            let view: Vec<usize> = if r == root {
                lens.to_vec()
            } else {
                (0..n).map(|p| if p == r { lens[p] } else { 0 }).collect()
            };
            scatter(r, root, &view).unwrap()
        })
        .collect();
    let blocks: Vec<Vec<u8>> = (0..n).map(|r| block_of(r, lens[r])).collect();
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| {
            if r == root {
                blocks.concat()
            } else {
                Vec::new()
            }
        })
        .collect();
    let out = simulate(&schedules, &inputs).map_err(|e| format!("{context}: {e}"))?;
    for r in 0..n {
        if out.buffers[r][schedules[r].output_range()] != blocks[r][..] {
            return Err(format!("{context}: rank {r} has another block"));
        }
    }
    if out.depth > 1 {
        return Err(format!("{context}: depth {}", out.depth));
    }
    Ok(())
}

#[test]
fn gather_and_scatter_every_world_every_root() {
    for n in 1..=MAX_WORLD {
        let patterns: [Vec<usize>; 3] = [
            vec![0; n],
            vec![4; n],
            (0..n).map(|i| (i * 7 + 3) % 6).collect(),
        ];
        for root in 0..n {
            for lens in &patterns {
                check_gather(root, lens).unwrap();
                check_scatter(root, lens).unwrap();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// all_to_all

fn check_all_to_all(n: usize, len: impl Fn(usize, usize) -> usize) -> Result<Outcome, String> {
    // send[r][p] = len(r, p); rank r receives len(p, r) from p.
    let schedules: Vec<Schedule> = (0..n)
        .map(|r| {
            let send: Vec<usize> = (0..n).map(|p| len(r, p)).collect();
            let recv: Vec<usize> = (0..n).map(|p| len(p, r)).collect();
            all_to_all(r, &send, &recv).unwrap()
        })
        .collect();
    let piece = |from: usize, to: usize| block_of(from * 1000 + to, len(from, to));
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| (0..n).flat_map(|p| piece(r, p)).collect())
        .collect();
    let out = simulate(&schedules, &inputs).map_err(|e| format!("world {n}: {e}"))?;
    for (r, schedule) in schedules.iter().enumerate() {
        let want: Vec<u8> = (0..n).flat_map(|p| piece(p, r)).collect();
        if out.buffers[r][schedule.output_range()] != want[..] {
            return Err(format!("world {n}: rank {r} received other blocks"));
        }
    }
    Ok(out)
}

#[test]
fn all_to_all_every_world_even_and_uneven() {
    for n in 1..=MAX_WORLD {
        let out = check_all_to_all(n, |_, _| 3).unwrap();
        assert_eq!(out.depth, n - 1, "world {n}");
        assert!(out.heard.iter().all(|h| *h == everyone(n)));
        check_all_to_all(n, |r, p| (r * 7 + p * 3) % 5).unwrap();
        check_all_to_all(n, |_, _| 0).unwrap();
    }
}

#[test]
fn all_to_all_refuses_inconsistent_lists() {
    assert_eq!(
        all_to_all(0, &[1, 2], &[1]),
        Err(CollectiveError::LengthsCount { lens: 1, world: 2 })
    );
    assert_eq!(
        all_to_all(1, &[1, 2], &[1, 3]),
        Err(CollectiveError::InputLength {
            rank: 1,
            expected: 3,
            actual: 2
        })
    );
    // Peers that disagree about a length: the receiver sees a message of the wrong length
    // (every pair exchanges a message, empty or not), it does not wait forever.
    let a = all_to_all(0, &[0, 0], &[0, 4]).unwrap();
    let b = all_to_all(1, &[0, 0], &[0, 0]).unwrap();
    let err = simulate(&[a, b], &[vec![], vec![]]).unwrap_err();
    assert!(
        err.contains("from rank 1 has 0 bytes, the schedule expects 4"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// monitored barrier

#[test]
fn monitored_barrier_every_world() {
    for n in 1..=MAX_WORLD {
        let schedules: Vec<Schedule> = (0..n).map(|r| monitored_barrier(r, n).unwrap()).collect();
        // Rank 0 waits on every other rank in one step: it can name all that are missing.
        if n > 1 {
            let waits: Vec<usize> = schedules[0].steps()[0].waits_on().collect();
            assert_eq!(waits, (1..n).collect::<Vec<_>>());
        }
        let out = simulate(&schedules, &vec![Vec::new(); n]).unwrap();
        assert_eq!(out.depth, if n == 1 { 0 } else { 2 });
        assert!(out.heard.iter().all(|h| *h == everyone(n)), "world {n}");
    }
}

#[test]
fn monitored_barrier_names_every_missing_rank_or_the_first() {
    assert_eq!(monitored_barrier_missing(&[3, 1, 3], true), vec![1, 3]);
    assert_eq!(monitored_barrier_missing(&[3, 1], false), vec![1]);
    assert_eq!(monitored_barrier_missing(&[], false), Vec::<usize>::new());
}

#[test]
fn new_builders_reject_bad_arguments() {
    assert_eq!(
        reduce(0, 3, 3, 1, ElementType::F32, ReduceOp::Sum),
        Err(CollectiveError::RootOutOfRange { root: 3, world: 3 })
    );
    assert_eq!(
        gather(0, 2, &[1, 1]),
        Err(CollectiveError::RootOutOfRange { root: 2, world: 2 })
    );
    assert_eq!(scatter(0, 0, &[]), Err(CollectiveError::EmptyWorld));
    assert_eq!(
        reduce_scatter(2, &[1, 1], ElementType::F32, ReduceOp::Sum),
        Err(CollectiveError::RankOutOfRange { rank: 2, world: 2 })
    );
    assert_eq!(
        reduce_scatter(0, &[usize::MAX, 1], ElementType::F32, ReduceOp::Sum),
        Err(CollectiveError::SizeOverflow)
    );
    assert_eq!(monitored_barrier(0, 0), Err(CollectiveError::EmptyWorld));
}

// ---------------------------------------------------------------------------------------------
// the simulator catches broken schedules

#[test]
fn simulator_reports_deadlock_naming_ranks() {
    // Both ranks receive before they send.
    let schedules = vec![
        hand_schedule(
            0,
            2,
            4,
            vec![hand_step(&[], &[(1, 0..4)]), hand_step(&[(1, 0..4)], &[])],
        ),
        hand_schedule(
            1,
            2,
            4,
            vec![hand_step(&[], &[(0, 0..4)]), hand_step(&[(0, 0..4)], &[])],
        ),
    ];
    let err = simulate(&schedules, &[vec![0; 4], vec![0; 4]]).unwrap_err();
    assert!(
        err.contains("deadlock") && err.contains("rank 0 at step 0 waits on receives from [1]"),
        "{err}"
    );
    // Both send in one step and receive in the next: fine with buffering, a deadlock when a
    // send completes only on receipt (the model the simulator checks).
    let schedules = vec![
        hand_schedule(
            0,
            2,
            4,
            vec![hand_step(&[(1, 0..2)], &[]), hand_step(&[], &[(1, 2..4)])],
        ),
        hand_schedule(
            1,
            2,
            4,
            vec![hand_step(&[(0, 0..2)], &[]), hand_step(&[], &[(0, 2..4)])],
        ),
    ];
    let err = simulate(&schedules, &[vec![0; 4], vec![0; 4]]).unwrap_err();
    assert!(err.contains("1 unconsumed send"), "{err}");
}

#[test]
fn simulator_reports_mismatched_lengths_and_overlaps() {
    let schedules = vec![
        hand_schedule(0, 2, 4, vec![hand_step(&[(1, 0..4)], &[])]),
        hand_schedule(1, 2, 4, vec![hand_step(&[], &[(0, 0..3)])]),
    ];
    let err = simulate(&schedules, &[vec![0; 4], vec![0; 4]]).unwrap_err();
    assert!(
        err.contains("mismatched") && err.contains("from rank 0 has 4 bytes"),
        "{err}"
    );
    let schedules = vec![
        hand_schedule(0, 2, 4, vec![hand_step(&[(1, 0..2)], &[(1, 1..3)])]),
        hand_schedule(1, 2, 4, vec![hand_step(&[(0, 0..2)], &[(0, 2..4)])]),
    ];
    let err = simulate(&schedules, &[vec![0; 4], vec![0; 4]]).unwrap_err();
    assert!(err.contains("overlaps send"), "{err}");
    let schedules = vec![
        hand_schedule(0, 2, 4, vec![hand_step(&[(0, 0..2)], &[])]),
        hand_schedule(1, 2, 4, vec![]),
    ];
    let err = simulate(&schedules, &[vec![0; 4], vec![0; 4]]).unwrap_err();
    assert!(err.contains("bad peer 0"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// random sizes, roots and worlds

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn all_gather_random_blocks(
        lens in (1usize..=MAX_WORLD).prop_flat_map(|n| proptest::collection::vec(0usize..24, n)),
        pick in 0usize..3,
    ) {
        let algorithm = match pick {
            0 => AllGatherAlgorithm::Ring,
            1 => AllGatherAlgorithm::Bruck,
            _ => AllGatherAlgorithm::select(&lens),
        };
        check_all_gather(&lens, algorithm).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn broadcast_random_root_and_len(
        (n, root) in (1usize..=MAX_WORLD).prop_flat_map(|n| (Just(n), 0..n)),
        len in 0usize..300,
    ) {
        check_broadcast(n, root, len).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn all_reduce_random(
        n in 1usize..=MAX_WORLD,
        count in 0usize..150,
        element in proptest::sample::select(BASIC_TYPES.to_vec()),
        op in proptest::sample::select(BASIC_OPS.to_vec()),
        ring in any::<bool>(),
    ) {
        let algorithm = if ring { AllReduceAlgorithm::Ring } else { AllReduceAlgorithm::RecursiveDoubling };
        check_all_reduce(n, count, element, op, algorithm).map_err(TestCaseError::fail)?;
    }
}
