use std::time::Duration;

use bytes::Bytes;

use super::checks::{decode_blocks, encode_blocks};
use super::*;
use crate::collective::{CollectiveError, ElementType, ReduceOp, Signature};
use crate::tensor::Tensor;

#[test]
fn errors_name_the_ranks() {
    let e = ProcessGroupError::Timeout {
        collective: "barrier",
        seq: 3,
        rank: 0,
        waiting_on: vec![2, 5],
        timeout: Duration::from_secs(1),
    };
    assert_eq!(
        e.to_string(),
        "barrier #3 on rank 0 timed out after 1s waiting for rank(s) 2, 5"
    );
    let e = ProcessGroupError::PeerDied {
        rank: 2,
        reported_by: Some(1),
        cause: DeathCause::InStage,
    };
    assert_eq!(
        e.to_string(),
        "rank 2 died (reported by rank 1): its process ended (or its connection broke) during a \
         stage of a collective across hosts"
    );
    let e = ProcessGroupError::PeerDied {
        rank: 4,
        reported_by: None,
        cause: DeathCause::ConnectionClosed,
    };
    assert_eq!(e.to_string(), "rank 4 died: its connection closed");
    let e = ProcessGroupError::PeerDied {
        rank: 3,
        reported_by: None,
        cause: DeathCause::ProcessEnded {
            pid: Some(42),
            collective: "barrier",
        },
    };
    assert_eq!(
        e.to_string(),
        "rank 3 died: its process 42 ended during barrier through the group arena"
    );
}

/// What a send or a collective's task failed with stays typed: the transport's error is the
/// source, not words copied from it.
#[test]
fn send_failures_keep_their_cause() {
    let peer = std::net::SocketAddr::from(([127, 0, 0, 1], 9));
    let closed = crate::ports::transport::TransportError::Closed { peer };
    let e = ProcessGroupError::Send {
        rank: 3,
        source: Box::new(closed.clone()),
    };
    assert_eq!(
        e.to_string(),
        "sending to rank 3 failed: connection to 127.0.0.1:9 closed by the peer"
    );
    let source = std::error::Error::source(&e).expect("the transport's error is the source");
    assert_eq!(source.to_string(), closed.to_string());
    assert_eq!(
        ProcessGroupError::NoConnection { rank: 1 }.to_string(),
        "sending to rank 1 failed: no connection to that rank"
    );
    let e = ProcessGroupError::TaskFailed {
        collective: "all_gather",
        rank: 2,
        panicked: true,
    };
    assert_eq!(e.to_string(), "the all_gather task for rank 2 panicked");
    let e = ProcessGroupError::RefusedFrame {
        rank: 1,
        kind: crate::wire::FrameKind::Control,
    };
    assert_eq!(
        e.to_string(),
        "rank 1 broke the RPC protocol on the group's connection (the agent refused a Control \
         frame it sent)"
    );
}

#[test]
fn disagreements_name_both_sides() {
    let e = ProcessGroupError::Disagreement {
        seq: 7,
        peer: 1,
        theirs: Signature::AllReduce {
            op: ReduceOp::Sum,
            element: ElementType::I64,
            count: 1,
        },
        rank: 0,
        ours: Signature::AllReduce {
            op: ReduceOp::Sum,
            element: ElementType::F32,
            count: 2,
        },
        here: true,
    };
    assert_eq!(
        e.to_string(),
        "rank 1 ran all_reduce(sum, i64 x1) as collective #7, this rank (0) all_reduce(sum, f32 x2)"
    );
    let mut reported = e.clone();
    if let ProcessGroupError::Disagreement { here, .. } = &mut reported {
        *here = false;
    }
    assert_eq!(
        reported.to_string(),
        "rank 1 ran all_reduce(sum, i64 x1) as collective #7, rank 0 all_reduce(sum, f32 x2) (reported by rank 0)"
    );
}

#[test]
fn monitored_barrier_errors_read_as_pytorchs() {
    let e = ProcessGroupError::MonitoredBarrier {
        rank: 0,
        missing: vec![1, 3],
        timeout: Duration::from_millis(1500),
    };
    assert_eq!(
        e.to_string(),
        "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 1.5s"
    );
    let e = ProcessGroupError::MonitoredBarrier {
        rank: 0,
        missing: vec![2],
        timeout: Duration::from_secs(2),
    };
    assert_eq!(
        e.to_string(),
        "[Rank 0]: Rank 2 failed to pass monitoredBarrier in 2s"
    );
}

#[test]
fn blocks_encode_and_refuse_garbage() {
    let blocks = vec![
        Bytes::from_static(b"ab"),
        Bytes::new(),
        Bytes::from_static(b"xyz"),
    ];
    let e = encode_blocks(&blocks);
    assert_eq!(decode_blocks(&e, 3), Some(blocks));
    assert_eq!(decode_blocks(&e, 2), None);
    assert_eq!(decode_blocks(&e[..e.len() - 1], 3), None);
    assert_eq!(decode_blocks(&[], 0), None);
    let mut huge = e.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(decode_blocks(&huge, 3), None);
}

#[test]
fn the_trait_is_object_safe() {
    fn takes(_: Option<&dyn ProcessGroup>) {}
    takes(None);
}

/// A future that is pending until `go` is set, then gives `result`.
fn gated<T: Send + 'static>(
    go: std::sync::Arc<std::sync::atomic::AtomicBool>,
    result: Result<T, ProcessGroupError>,
) -> Pending<'static, T> {
    let mut result = Some(result);
    Box::pin(std::future::poll_fn(move |_| {
        if go.load(std::sync::atomic::Ordering::SeqCst) {
            std::task::Poll::Ready(result.take().expect("polled once ready"))
        } else {
            std::task::Poll::Pending
        }
    }))
}

/// The default work handle: asked, it polls the collective (no task to drive it in a
/// port), reports the error without giving the result away, and `wait` gives the result.
#[test]
fn the_default_work_handle_polls_when_asked_and_keeps_the_result() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let block_on = |f: Pending<'static, u32>| {
        let mut f = f;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match f.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(r) => r,
            std::task::Poll::Pending => panic!("the result was kept"),
        }
    };
    let go = Arc::new(AtomicBool::new(false));
    let mut work: Box<dyn WorkHandle<'static, u32>> = lazy(gated(go.clone(), Ok(7)));
    assert!(!work.is_completed());
    assert_eq!(work.error(), None);
    go.store(true, Ordering::SeqCst);
    assert!(work.is_completed());
    assert_eq!(work.error(), None);
    assert_eq!(block_on(work.wait(Duration::from_secs(1))), Ok(7));

    let failed = ProcessGroupError::ShutDown;
    let mut work: Box<dyn WorkHandle<'static, u32>> =
        lazy(gated(Arc::new(AtomicBool::new(true)), Err(failed.clone())));
    assert!(work.is_completed(), "finished in the issuing poll");
    assert_eq!(work.error(), Some(failed.clone()));
    assert_eq!(block_on(work.wait(Duration::from_secs(1))), Err(failed));
}

/// A one-rank group whose byte collectives give this rank's data back, or never finish
/// while `stuck` (so a handle that has finished at its issue finished on its arguments).
struct Solo {
    stuck: bool,
}

impl Solo {
    async fn gate(&self) {
        if self.stuck {
            std::future::pending::<()>().await;
        }
    }
}

impl ProcessGroup for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    /// The four primitives give this rank's data back; the rest is [`compose::compose`]d.
    fn start<'a>(&'a self, op: Op<'a>) -> Started<'a> {
        lazy(Box::pin(async move {
            match op {
                Op::Barrier => {
                    self.gate().await;
                    Ok(Done::Unit)
                }
                Op::AllGather { input, .. } => {
                    self.gate().await;
                    Ok(Done::from(vec![input.into_bytes("all_gather", self)?]))
                }
                Op::Broadcast { data, .. } | Op::AllReduce { data, .. } => {
                    let data = data.into_host_mut("all_reduce", self)?;
                    self.gate().await;
                    Ok(data.done())
                }
                op => compose::compose(self, op).await,
            }
        }))
    }
}

/// Waits for a handle that must be able to finish without a runtime.
fn waited<'a, T: Send + 'a>(work: Box<dyn WorkHandle<'a, T> + 'a>) -> Result<T, ProcessGroupError> {
    let mut f = work.wait(Duration::from_secs(1));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(r) => r,
        std::task::Poll::Pending => panic!("the handle did not finish"),
    }
}

fn f32s(values: &[f32]) -> Tensor {
    Tensor::from_f32(vec![values.len()], values).unwrap()
}

/// The default `issue_*` of every tensor collective gives the collective's result (here
/// on one rank, where each is the identity).
#[test]
fn the_default_issue_forms_give_the_collectives_results() {
    let pg = Solo { stuck: false };
    let t = f32s(&[1.0, 2.0]);
    let value = |t: Tensor| t.to_f32_vec().unwrap();
    let zeros = || f32s(&[0.0, 0.0]);
    assert_eq!(
        value(waited(pg.issue_reduce_tensor(t.clone(), ReduceOp::Sum, 0)).unwrap()),
        [1.0, 2.0]
    );
    let gathered = waited(pg.issue_gather_tensor(t.clone(), Some(vec![zeros()]), 0)).unwrap();
    assert_eq!(
        gathered.map(|l| l.into_iter().map(value).collect::<Vec<_>>()),
        Some(vec![vec![1.0, 2.0]])
    );
    assert_eq!(
        value(waited(pg.issue_scatter_tensor(zeros(), Some(vec![t.clone()]), 0)).unwrap()),
        [1.0, 2.0]
    );
    assert_eq!(
        value(waited(pg.issue_all_to_all_single_tensor(zeros(), t.clone(), None, None)).unwrap()),
        [1.0, 2.0]
    );
    let list = waited(pg.issue_all_to_all_tensor(vec![zeros()], vec![t.clone()])).unwrap();
    assert_eq!(
        list.into_iter().map(value).collect::<Vec<_>>(),
        [[1.0, 2.0]]
    );
    assert_eq!(
        value(waited(pg.issue_all_gather_into_tensor(zeros(), t.clone())).unwrap()),
        [1.0, 2.0]
    );
    assert_eq!(
        value(waited(pg.issue_reduce_scatter_tensor(zeros(), t, ReduceOp::Sum)).unwrap()),
        [1.0, 2.0]
    );
}

/// The default `issue_*` checks its arguments in the call: on a group whose collectives
/// never finish, a refused call's handle has finished with the typed error when it is
/// returned, and a good call's has not.
#[test]
fn the_default_issue_forms_refuse_bad_arguments_in_the_call() {
    let pg = Solo { stuck: true };
    let t = f32s(&[1.0, 2.0]);
    let wide = f32s(&[0.0; 3]);
    let f64s = Tensor::from_f64(vec![2], &[0.0; 2]).unwrap();
    fn refused<'a, T: Send + 'a>(mut w: Box<dyn WorkHandle<'a, T> + 'a>) -> CollectiveError {
        assert!(w.is_completed(), "refused in the call");
        match w.error() {
            Some(ProcessGroupError::Arguments { source, .. }) => source,
            other => panic!("not an argument error: {other:?}"),
        }
    }
    fn running<'a, T: Send + 'a>(mut w: Box<dyn WorkHandle<'a, T> + 'a>) {
        assert!(!w.is_completed());
        assert_eq!(w.error(), None);
    }
    assert!(matches!(
        refused(pg.issue_reduce_tensor(t.clone(), ReduceOp::Sum, 1)),
        CollectiveError::RootOutOfRange { root: 1, world: 1 }
    ));
    running(pg.issue_reduce_tensor(t.clone(), ReduceOp::Sum, 0));
    assert!(matches!(
        refused(pg.issue_gather_tensor(t.clone(), None, 0)),
        CollectiveError::TensorList { on_root: true, .. }
    ));
    assert!(matches!(
        refused(pg.issue_gather_tensor(t.clone(), Some(vec![wide.clone()]), 0)),
        CollectiveError::TensorSize { .. }
    ));
    assert!(matches!(
        refused(pg.issue_gather_tensor(t.clone(), Some(vec![t.clone()]), 2)),
        CollectiveError::RootOutOfRange { root: 2, .. }
    ));
    running(pg.issue_gather_tensor(t.clone(), Some(vec![t.clone()]), 0));
    assert!(matches!(
        refused(pg.issue_scatter_tensor(t.clone(), Some(vec![]), 0)),
        CollectiveError::LengthsCount { lens: 0, world: 1 }
    ));
    running(pg.issue_scatter_tensor(t.clone(), Some(vec![t.clone()]), 0));
    assert!(matches!(
        refused(pg.issue_all_to_all_single_tensor(t.clone(), t.clone(), None, Some(vec![1]))),
        CollectiveError::SplitsSum { .. }
    ));
    assert!(matches!(
        refused(pg.issue_all_to_all_single_tensor(f64s.clone(), t.clone(), None, None)),
        CollectiveError::TensorType { .. }
    ));
    running(pg.issue_all_to_all_single_tensor(t.clone(), t.clone(), None, None));
    assert!(matches!(
        refused(pg.issue_all_to_all_tensor(vec![], vec![t.clone()])),
        CollectiveError::LengthsCount { lens: 0, .. }
    ));
    assert!(matches!(
        refused(pg.issue_all_to_all_tensor(vec![f64s.clone()], vec![t.clone()])),
        CollectiveError::TensorType { .. }
    ));
    running(pg.issue_all_to_all_tensor(vec![t.clone()], vec![t.clone()]));
    assert!(matches!(
        refused(pg.issue_all_gather_into_tensor(wide.clone(), t.clone())),
        CollectiveError::TensorSize { .. }
    ));
    running(pg.issue_all_gather_into_tensor(t.clone(), t.clone()));
    assert!(matches!(
        refused(pg.issue_reduce_scatter_tensor(f64s, t.clone(), ReduceOp::Sum)),
        CollectiveError::TensorType { .. }
    ));
    running(pg.issue_reduce_scatter_tensor(t.clone(), t.clone(), ReduceOp::Sum));
    // A port without point-to-point messages refuses their tensor forms in the call.
    let unsupported = |e: Option<ProcessGroupError>, what: &str| {
        assert!(
            matches!(e, Some(ProcessGroupError::Unsupported { collective, .. }) if collective == what),
            "{what}"
        )
    };
    let mut w = pg.issue_send_tensor(t.clone(), 0, 1);
    assert!(w.is_completed());
    unsupported(w.error(), "send");
    let mut w = pg.issue_recv_tensor(t.clone(), 0, 1);
    assert!(w.is_completed());
    unsupported(w.error(), "recv");
    let mut w = pg.issue_recv_any_tensor(t, 1);
    assert!(w.is_completed());
    unsupported(w.error(), "recv");
}
