//! The mesh: the one place that dials, greets and accepts peers ([`link`]), and one
//! authenticated connection between every pair of ranks that carries the frames of several
//! layers ([`Mesh`]): process groups' collectives, sorted by group and sequence number, and
//! every other frame to the [`FrameSink`] of the layer that shares the connections (the RPC
//! agent). See [`mod@mesh`] for the setup, the frames and what a failure does.

pub mod link;
pub mod mesh;
pub mod runtime;

pub use mesh::{
    address_key, FrameSink, GroupMesh, Incoming, Mesh, MeshSetup, PeerEnd, PeerStatusKind,
    MAX_GROUP_ID,
};
pub use runtime::TokioRuntime;
