//! The tensor collectives and point-to-point messages on owned tensors, each returning what
//! its in-place form leaves in its output: what the `issue_*` work handles of
//! [`ProcessGroup`] give. The port's default `issue_*` run these; a backend that overrides
//! an `issue_*` (to run it on a task of its own) runs the same function there, so the
//! handle's result means the same on every backend.
//!
//! Each checks its arguments in its first poll, before it awaits anything, as the in-place
//! form does.

use crate::collective::ReduceOp;
use crate::tensor::Tensor;

use super::{ProcessGroup, ProcessGroupError};

/// [`ProcessGroup::reduce_tensor`]: the reduction on `root`, `tensor` unchanged elsewhere.
pub async fn reduce_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    mut tensor: Tensor,
    op: ReduceOp,
    root: usize,
) -> Result<Tensor, ProcessGroupError> {
    pg.reduce_tensor(&mut tensor, op, root).await?;
    Ok(tensor)
}

/// [`ProcessGroup::gather_tensor`]: `Some` of the filled list on `root`, `None` elsewhere.
pub async fn gather_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    input: Tensor,
    mut gather_list: Option<Vec<Tensor>>,
    root: usize,
) -> Result<Option<Vec<Tensor>>, ProcessGroupError> {
    pg.gather_tensor(&input, gather_list.as_deref_mut(), root)
        .await?;
    Ok(gather_list)
}

/// [`ProcessGroup::scatter_tensor`]: this rank's tensor of `root`'s list.
pub async fn scatter_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    mut output: Tensor,
    scatter_list: Option<Vec<Tensor>>,
    root: usize,
) -> Result<Tensor, ProcessGroupError> {
    pg.scatter_tensor(&mut output, scatter_list.as_deref(), root)
        .await?;
    Ok(output)
}

/// [`ProcessGroup::all_to_all_single_tensor`]: `output` with the rows received.
pub async fn all_to_all_single_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    mut output: Tensor,
    input: Tensor,
    output_split_sizes: Option<Vec<usize>>,
    input_split_sizes: Option<Vec<usize>>,
) -> Result<Tensor, ProcessGroupError> {
    pg.all_to_all_single_tensor(
        &mut output,
        &input,
        output_split_sizes.as_deref(),
        input_split_sizes.as_deref(),
    )
    .await?;
    Ok(output)
}

/// [`ProcessGroup::all_to_all_tensor`]: `outputs`, `outputs[i]` from rank i.
pub async fn all_to_all_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    mut outputs: Vec<Tensor>,
    inputs: Vec<Tensor>,
) -> Result<Vec<Tensor>, ProcessGroupError> {
    pg.all_to_all_tensor(&mut outputs, &inputs).await?;
    Ok(outputs)
}

/// [`ProcessGroup::all_gather_into_tensor`]: `output`, every rank's input in rank order.
pub async fn all_gather_into_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    mut output: Tensor,
    input: Tensor,
) -> Result<Tensor, ProcessGroupError> {
    pg.all_gather_into_tensor(&mut output, &input).await?;
    Ok(output)
}

/// [`ProcessGroup::reduce_scatter_tensor`]: `output`, this rank's chunk of the reduction.
pub async fn reduce_scatter_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    mut output: Tensor,
    input: Tensor,
    op: ReduceOp,
) -> Result<Tensor, ProcessGroupError> {
    pg.reduce_scatter_tensor(&mut output, &input, op).await?;
    Ok(output)
}

/// [`ProcessGroup::recv_tensor`]: `tensor` with the message as its contents.
pub async fn recv_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    mut tensor: Tensor,
    src: usize,
    tag: u32,
) -> Result<Tensor, ProcessGroupError> {
    pg.recv_tensor(&mut tensor, src, tag).await?;
    Ok(tensor)
}

/// [`ProcessGroup::recv_any_tensor`]: the sender, and `tensor` with the message as its
/// contents.
pub async fn recv_any_tensor<P: ProcessGroup + ?Sized>(
    pg: &P,
    mut tensor: Tensor,
    tag: u32,
) -> Result<(usize, Tensor), ProcessGroupError> {
    let src = pg.recv_any_tensor(&mut tensor, tag).await?;
    Ok((src, tensor))
}
