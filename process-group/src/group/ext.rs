//! The typed and object forms of the collectives for any [`ProcessGroup`] ([`CollectivesExt`]):
//! slices of an [`Element`] type, and serde values (postcard) gathered, broadcast and scattered.

use super::*;

/// An element type the typed collectives ([`CollectivesExt::all_reduce_typed`], ...) work on:
/// `f32`, `f64`, [`half::f16`], [`half::bf16`], `i32`, `i64`, `u8`, `i8` and `bool`.
pub trait Element: Copy + Send + Sync + sealed::Sealed + 'static {
    /// The element type on the wire.
    const TYPE: ElementType;
    /// Writes the value's little-endian bytes into `out` (exactly `TYPE.size()` bytes).
    fn write_le(self, out: &mut [u8]);
    /// Reads a value from `TYPE.size()` little-endian bytes.
    fn read_le(bytes: &[u8]) -> Self;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for u8 {}
    impl Sealed for i8 {}
    impl Sealed for i16 {}
    impl Sealed for bool {}
}

macro_rules! element {
    ($t:ty, $e:expr) => {
        impl Element for $t {
            const TYPE: ElementType = $e;
            fn write_le(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            fn read_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element-sized chunk"))
            }
        }
    };
}

element!(f32, ElementType::F32);
element!(f64, ElementType::F64);
element!(i32, ElementType::I32);
element!(i64, ElementType::I64);
element!(half::f16, ElementType::F16);
element!(half::bf16, ElementType::BF16);
element!(u8, ElementType::U8);
element!(i8, ElementType::I8);
element!(i16, ElementType::I16);

impl Element for bool {
    const TYPE: ElementType = ElementType::Bool;
    fn write_le(self, out: &mut [u8]) {
        out[0] = u8::from(self);
    }
    fn read_le(bytes: &[u8]) -> Self {
        bytes.first().is_some_and(|b| *b != 0)
    }
}

pub(super) fn to_bytes<T: Element>(data: &[T]) -> Vec<u8> {
    let size = T::TYPE.size();
    let mut bytes = vec![0u8; data.len() * size];
    for (x, out) in data.iter().zip(bytes.chunks_exact_mut(size)) {
        x.write_le(out);
    }
    bytes
}

pub(super) fn from_bytes<T: Element>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(T::TYPE.size()).map(T::read_le).collect()
}

pub(super) fn encode_object<T: Serialize>(
    rank: usize,
    value: &T,
) -> Result<Vec<u8>, ProcessGroupError> {
    postcard::to_allocvec(value).map_err(|source| ProcessGroupError::Object {
        rank,
        op: "encoded",
        source,
    })
}

pub(super) fn decode_object<T: DeserializeOwned>(
    rank: usize,
    bytes: &[u8],
) -> Result<T, ProcessGroupError> {
    postcard::from_bytes(bytes).map_err(|source| ProcessGroupError::Object {
        rank,
        op: "decoded",
        source,
    })
}

/// Typed collectives on top of any [`ProcessGroup`]'s byte collectives.
#[async_trait]
pub trait CollectivesExt: ProcessGroup {
    /// [`all_reduce`](Collectives::all_reduce) on a slice of any [`Element`].
    async fn all_reduce_typed<T: Element>(
        &self,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<(), ProcessGroupError> {
        let mut bytes = to_bytes(data);
        self.all_reduce(&mut bytes, T::TYPE, op).await?;
        data.copy_from_slice(&from_bytes(&bytes));
        Ok(())
    }

    /// [`reduce`](Collectives::reduce) on a slice: the result lands in `root`'s `data`.
    async fn reduce_typed<T: Element>(
        &self,
        data: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), ProcessGroupError> {
        let mut bytes = to_bytes(data);
        self.reduce(&mut bytes, T::TYPE, op, root).await?;
        if self.rank() == root {
            data.copy_from_slice(&from_bytes(&bytes));
        }
        Ok(())
    }

    /// [`reduce_scatter`](Collectives::reduce_scatter) of one slice (PyTorch's
    /// `reduce_scatter_tensor`): chunk i of `input` is `counts[i]` elements; returns this
    /// rank's reduced chunk.
    async fn reduce_scatter_typed<T: Element>(
        &self,
        input: &[T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Vec<T>, ProcessGroupError> {
        let out = self
            .reduce_scatter(&to_bytes(input), counts, T::TYPE, op)
            .await?;
        Ok(from_bytes(&out))
    }

    /// Reduce-scatter of a list of blocks, one per rank (PyTorch's `reduce_scatter` with an
    /// input list): returns the reduction of every rank's block for this rank. Blocks may
    /// differ in length; every rank passes blocks of the same lengths.
    async fn reduce_scatter_blocks_typed<T: Element>(
        &self,
        blocks: &[Vec<T>],
        op: ReduceOp,
    ) -> Result<Vec<T>, ProcessGroupError> {
        let counts: Vec<usize> = blocks.iter().map(Vec::len).collect();
        let input: Vec<T> = blocks.iter().flatten().copied().collect();
        self.reduce_scatter_typed(&input, &counts, op).await
    }

    /// [`all_to_all_single`](Collectives::all_to_all_single) on a slice, with splits counted
    /// in elements.
    async fn all_to_all_single_typed<T: Element>(
        &self,
        input: &[T],
        input_splits: &[usize],
        output_splits: &[usize],
    ) -> Result<Vec<T>, ProcessGroupError> {
        let size = T::TYPE.size();
        let bytes = |splits: &[usize]| -> Vec<usize> { splits.iter().map(|s| s * size).collect() };
        let out = self
            .all_to_all_single(
                &to_bytes(input),
                &bytes(input_splits),
                &bytes(output_splits),
            )
            .await?;
        Ok(from_bytes(&out))
    }

    /// Gathers one serde value from every rank on `root` (postcard-encoded): `Some` of them in
    /// rank order there, `None` elsewhere. Runs [`gather`](Collectives::gather).
    async fn gather_object<T>(
        &self,
        value: &T,
        root: usize,
    ) -> Result<Option<Vec<T>>, ProcessGroupError>
    where
        T: Serialize + DeserializeOwned + Sync,
    {
        let bytes = encode_object(self.rank(), value)?;
        let Some(blocks) = self.gather(&bytes, root).await? else {
            return Ok(None);
        };
        let values = blocks
            .iter()
            .enumerate()
            .map(|(peer, block)| decode_object(peer, block))
            .collect::<Result<Vec<T>, _>>()?;
        Ok(Some(values))
    }

    /// Sends value i of `root`'s `values` to rank i and returns this rank's (postcard-encoded;
    /// `values` is read on the root only, where it must hold one value per rank). Runs
    /// [`scatter`](Collectives::scatter).
    async fn scatter_object<T>(
        &self,
        values: Option<&[T]>,
        root: usize,
    ) -> Result<T, ProcessGroupError>
    where
        T: Serialize + DeserializeOwned + Sync,
    {
        let rank = self.rank();
        let blocks = if rank == root {
            let values = values.ok_or(ProcessGroupError::NoRootValue {
                collective: "scatter_object",
                root,
            })?;
            values
                .iter()
                .map(|v| encode_object(rank, v).map(Bytes::from))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let bytes = self.scatter(&blocks, root).await?;
        decode_object(root, &bytes)
    }

    /// Gathers one serde value from every rank (postcard-encoded; the lengths travel first),
    /// in rank order.
    async fn all_gather_object<T>(&self, value: &T) -> Result<Vec<T>, ProcessGroupError>
    where
        T: Serialize + DeserializeOwned + Sync,
    {
        let rank = self.rank();
        let bytes = encode_object(rank, value)?;
        let blocks = self.all_gather(&bytes).await?;
        blocks
            .iter()
            .enumerate()
            .map(|(peer, block)| decode_object(peer, block))
            .collect()
    }

    /// Sends `root`'s serde value to every rank: `value` must be `Some` on the root (other
    /// ranks' values are ignored). Runs [`broadcast_bytes`](Collectives::broadcast_bytes).
    async fn broadcast_object<T>(
        &self,
        value: Option<&T>,
        root: usize,
    ) -> Result<T, ProcessGroupError>
    where
        T: Serialize + DeserializeOwned + Sync,
    {
        let rank = self.rank();
        let bytes = if rank == root {
            let value = value.ok_or(ProcessGroupError::NoRootValue {
                collective: "broadcast_object",
                root,
            })?;
            encode_object(rank, value)?
        } else {
            Vec::new()
        };
        let bytes = self.broadcast_bytes(&bytes, root).await?;
        decode_object(root, &bytes)
    }
}

impl<P: ProcessGroup + ?Sized> CollectivesExt for P {}
