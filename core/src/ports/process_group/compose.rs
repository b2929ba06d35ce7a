//! Operations built from simpler ones, for backends with a few collectives of their own
//! (NCCL's all_reduce, all_gather and broadcast; a test's group of one): [`compose`] runs
//! any other [`Op`] on those, on host bytes. Correct, not fast: a reduce is an all_reduce, a
//! scatter a broadcast of every block, an all_to_all an all_gather of every block.

use bytes::Bytes;

use crate::collective::{CollectiveError, ElementType, ReduceOp};
use crate::tensor::Storage;

use super::checks::{check_count, check_root, chunk_range, decode_blocks, encode_blocks};
use super::{Buf, Collectives, Done, Op, ProcessGroup, ProcessGroupError, MAX_BROADCAST_BYTES};

/// Runs `op` on `pg`'s barrier, all_gather, broadcast and all_reduce (each issued through
/// [`ProcessGroup::start`]). Those four themselves, point-to-point messages and the
/// monitored barrier are [`ProcessGroupError::Unsupported`] here (a backend answers them
/// itself or not at all), as is data on a device.
///
/// Every argument a composition can check alone is checked before its first collective is
/// issued, so a refused call takes no place in the sequence.
pub async fn compose<P: ProcessGroup + ?Sized>(
    pg: &P,
    op: Op<'_>,
) -> Result<Done, ProcessGroupError> {
    let name = op.name();
    match op {
        Op::BroadcastBytes { data, root } => {
            let data = host(pg, name, &data)?;
            broadcast_bytes(pg, data, root).await.map(Done::from)
        }
        Op::Reduce {
            data,
            element,
            op,
            root,
        } => {
            check_root(name, root, pg.size())?;
            let mut data = data
                .into_host_mut(name, pg)
                .map_err(|_| unsupported(pg, name))?;
            if pg.rank() == root {
                pg.all_reduce(&mut data[..], element, op).await?;
                Ok(data.done())
            } else {
                pg.all_reduce(&mut data.to_vec(), element, op).await?;
                Ok(Done::Unit)
            }
        }
        Op::ReduceScatter {
            input,
            counts,
            element,
            op,
        }
        | Op::ReduceScatterV {
            input,
            counts,
            element,
            op,
        } => reduce_scatter(pg, name, host(pg, name, &input)?, &counts, element, op).await,
        Op::Gather { input, root } => {
            check_root(name, root, pg.size())?;
            let blocks = pg.all_gather(host(pg, name, &input)?).await?;
            let on_root = pg.rank() == root;
            Ok(Done::Gathered(
                on_root.then(|| blocks.into_iter().map(Storage::Host).collect()),
            ))
        }
        Op::Scatter { blocks, root } => scatter(pg, &blocks, root).await.map(Done::from),
        Op::AllToAll {
            inputs,
            output_lens,
        } => all_to_all(pg, &inputs, &output_lens).await.map(Done::from),
        Op::AllToAllSingle {
            input,
            input_splits,
            output_splits,
        } => {
            let input = host(pg, name, &input)?;
            check_count(name, input_splits.len(), pg.size())?;
            let sum = input_splits
                .iter()
                .try_fold(0usize, |acc, s| acc.checked_add(*s));
            if sum != Some(input.len()) {
                return Err(ProcessGroupError::Arguments {
                    collective: name,
                    source: CollectiveError::SplitsSum {
                        sum: sum.unwrap_or(usize::MAX),
                        actual: input.len(),
                    },
                });
            }
            let mut blocks = Vec::with_capacity(input_splits.len());
            let mut offset = 0;
            for len in &input_splits {
                blocks.push(Bytes::copy_from_slice(&input[offset..offset + len]));
                offset += len;
            }
            let out = all_to_all(pg, &blocks, &output_splits).await?;
            Ok(Done::from(out.concat()))
        }
        _ => Err(unsupported(pg, name)),
    }
}

fn unsupported<P: ProcessGroup + ?Sized>(pg: &P, collective: &'static str) -> ProcessGroupError {
    ProcessGroupError::Unsupported {
        collective,
        backend: pg.backend(),
    }
}

/// The host bytes of `data`; a device buffer is unsupported here.
fn host<'b, P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    data: &'b Buf<'_>,
) -> Result<&'b [u8], ProcessGroupError> {
    data.host(collective, pg)
        .map_err(|_| unsupported(pg, collective))
}

/// Two broadcasts, the length first.
async fn broadcast_bytes<P: ProcessGroup + ?Sized>(
    pg: &P,
    data: &[u8],
    root: usize,
) -> Result<Bytes, ProcessGroupError> {
    check_root("broadcast", root, pg.size())?;
    let mut len = (data.len() as u64).to_le_bytes();
    pg.broadcast(&mut len, root).await?;
    let len = u64::from_le_bytes(len);
    let len = usize::try_from(len)
        .ok()
        .filter(|len| *len <= MAX_BROADCAST_BYTES)
        .ok_or_else(|| ProcessGroupError::Mismatch {
            peer: root,
            collective: "broadcast",
            seq: 0,
            reason: format!("it announced {len} bytes, more than {MAX_BROADCAST_BYTES}"),
        })?;
    let mut out = if pg.rank() == root {
        data.to_vec()
    } else {
        vec![0u8; len]
    };
    pg.broadcast(&mut out, root).await?;
    Ok(out.into())
}

/// An all_reduce of a copy, of which this rank keeps its chunk.
async fn reduce_scatter<P: ProcessGroup + ?Sized>(
    pg: &P,
    collective: &'static str,
    input: &[u8],
    counts: &[usize],
    element: ElementType,
    op: ReduceOp,
) -> Result<Done, ProcessGroupError> {
    let range = chunk_range(collective, input.len(), counts, element, pg)?;
    let mut data = input.to_vec();
    pg.all_reduce(&mut data, element, op).await?;
    Ok(Done::from(data[range].to_vec()))
}

/// Every block broadcast with [`broadcast_bytes`]; each rank keeps its own.
async fn scatter<P: ProcessGroup + ?Sized>(
    pg: &P,
    blocks: &[Bytes],
    root: usize,
) -> Result<Bytes, ProcessGroupError> {
    check_root("scatter", root, pg.size())?;
    let encoded = if pg.rank() == root {
        check_count("scatter", blocks.len(), pg.size())?;
        encode_blocks(blocks)
    } else {
        Vec::new()
    };
    let all = broadcast_bytes(pg, &encoded, root).await?;
    decode_blocks(&all, pg.size())
        .and_then(|mut blocks| blocks.get_mut(pg.rank()).map(std::mem::take))
        .ok_or_else(|| ProcessGroupError::Mismatch {
            peer: root,
            collective: "scatter",
            seq: 0,
            reason: "its blocks do not decode".to_owned(),
        })
}

/// Every rank's blocks all-gathered; each rank keeps its column.
async fn all_to_all<P: ProcessGroup + ?Sized>(
    pg: &P,
    inputs: &[Bytes],
    output_lens: &[usize],
) -> Result<Vec<Bytes>, ProcessGroupError> {
    let (rank, world) = (pg.rank(), pg.size());
    check_count("all_to_all", inputs.len(), world)?;
    check_count("all_to_all", output_lens.len(), world)?;
    let all = pg.all_gather(&encode_blocks(inputs)).await?;
    let mut out = Vec::with_capacity(world);
    for (peer, encoded) in all.iter().enumerate() {
        let mismatch = |reason: String| ProcessGroupError::Mismatch {
            peer,
            collective: "all_to_all",
            seq: 0,
            reason,
        };
        let mut blocks = decode_blocks(encoded, world)
            .ok_or_else(|| mismatch("its blocks do not decode".to_owned()))?;
        let block = std::mem::take(&mut blocks[rank]);
        if block.len() != output_lens[peer] {
            return Err(mismatch(format!(
                "it sent {} bytes, this rank expects {}",
                block.len(),
                output_lens[peer]
            )));
        }
        out.push(block);
    }
    Ok(out)
}
