//! Same-host device memory sharing (CUDA IPC): which path a device tensor takes to a peer, and
//! how long the sender keeps memory it shared.
//!
//! Two workers on one host can move a CUDA tensor without a trip through host memory: the
//! sender exports an IPC handle of the buffer (and of an event marking the end of the work that
//! wrote it), the receiver opens the handle, copies device to device into its own buffer, closes
//! it and tells the sender it is done ([`IpcMessage::Release`]). Only then may the sender reuse
//! the memory: until the release arrives (or the peer is lost) the sender holds the buffer.
//!
//! Whether a tensor may go that way is decided here, from what each side says of itself in an
//! [`IpcMessage::Hello`] (an [`IpcIdentity`]: host, namespaces, process, GPUs): the same host
//! (boot id), the same IPC and PID namespaces (a different container cannot open the handle),
//! another process (a process cannot open its own handles), no MIG instance on either side
//! (CUDA IPC is unsupported there), and the tensor landing on the same physical GPU it leaves.
//! Anything else takes the **staged** path (device → host bytes → device), with the reason
//! ([`StagedReason`]) kept for the agent's report. An export that fails, or a receiver that
//! cannot open a handle ([`IpcMessage::Refused`]), also falls back to staging.
//!
//! # The state machine
//!
//! [`IpcState`] is sans-IO, in quinn's shape: the driver asks [`route`](IpcState::route) for
//! each device tensor it sends, reports what the backend did ([`exported`](IpcState::exported),
//! [`export_failed`](IpcState::export_failed), [`imported`](IpcState::imported),
//! [`import_failed`](IpcState::import_failed)), hands in every IPC message received
//! ([`handle_message`](IpcState::handle_message)) and lost peers
//! ([`peer_lost`](IpcState::peer_lost)), and sends what [`poll_transmit`](IpcState::poll_transmit)
//! gives. The exported buffers are held as opaque values `T` and handed back when they may be
//! dropped.
//!
//! # Trust and bounds
//!
//! A release is checked against the exports before anything changes: every id must name a
//! buffer exported *to that peer* and already sent; an unknown id, one released before, one
//! still being exported, or another peer's is an [`IpcViolation`] and nothing is released. A
//! descriptor received from a peer this worker never introduced itself to is a violation too.
//! A peer can make the sender hold at most [`IpcConfig::max_exports_per_peer`] buffers and
//! [`IpcConfig::max_bytes_per_peer`] bytes awaiting its release: past either bound, tensors to
//! it take the staged path ([`StagedReason::Bound`]) until it releases some.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::device::Device;
use crate::name::WorkerId;

/// Where a process runs, as far as sharing device memory is concerned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostIdentity {
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`): equal on one host, and only there.
    pub boot_id: String,
    /// The inode of the IPC namespace (`/proc/self/ns/ipc`).
    pub ipc_namespace: u64,
    /// The inode of the PID namespace (`/proc/self/ns/pid`).
    pub pid_namespace: u64,
    /// The process id (in its namespace).
    pub pid: u32,
}

/// One GPU as the sharing side sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuIdentity {
    /// The GPU's UUID (`cuDeviceGetUuid`): the physical device behind a `cuda:N` index.
    pub uuid: [u8; 16],
    /// Whether it is a MIG instance (CUDA IPC is unsupported on MIG).
    pub mig: bool,
}

/// What a worker says of itself so that its peers can decide whether to share memory with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcIdentity {
    /// The host and process.
    pub host: HostIdentity,
    /// The GPUs, by `cuda:N` index.
    pub gpus: Vec<GpuIdentity>,
}

impl IpcIdentity {
    fn gpu(&self, device: Device) -> Option<&GpuIdentity> {
        self.gpus.get(usize::from(device.index()?))
    }
}

/// Why a device tensor took the staged path (through host memory) instead of IPC.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StagedReason {
    /// This worker's device backend cannot share memory (or IPC is turned off here).
    #[error("this worker's device backend does not share device memory")]
    NotSupported,
    /// The peer's backend cannot share memory (or IPC is turned off there).
    #[error("the peer's device backend does not share device memory")]
    PeerNotSupported,
    /// The peer has not said who it is yet (the first tensors to a peer are staged).
    #[error("the peer has not introduced itself yet")]
    PeerUnknown,
    /// Sender and receiver are one process.
    #[error("the peer is this process")]
    SameProcess,
    /// The peer runs on another host.
    #[error("the peer runs on another host")]
    OtherHost,
    /// The peer runs in another container (another namespace of this kind).
    #[error("the peer runs in another {namespace} namespace (another container)")]
    OtherContainer {
        /// `ipc` or `pid`.
        namespace: &'static str,
    },
    /// A device on either side is a MIG instance.
    #[error("{device} is a MIG instance (CUDA IPC is unsupported on MIG)")]
    Mig {
        /// The device (the sender's or the landing one).
        device: Device,
    },
    /// The tensor lands on another physical GPU than the one it leaves.
    #[error("the tensor leaves {from} and lands on {to}, another GPU")]
    OtherGpu {
        /// The sender's device.
        from: Device,
        /// The landing device at the peer.
        to: Device,
    },
    /// A side does not list the device.
    #[error("{device} is not among the GPUs the {side} announced")]
    UnknownDevice {
        /// The device.
        device: Device,
        /// `sender` or `receiver`.
        side: &'static str,
    },
    /// The peer already holds as many of our buffers as the bounds allow.
    #[error(
        "the peer holds {held} buffers ({held_bytes} bytes) awaiting release; the bounds are \
         {max_exports} buffers and {max_bytes} bytes (IpcConfig)"
    )]
    Bound {
        /// Buffers held for the peer.
        held: usize,
        /// Their bytes.
        held_bytes: u64,
        /// `IpcConfig::max_exports_per_peer`.
        max_exports: usize,
        /// `IpcConfig::max_bytes_per_peer`.
        max_bytes: u64,
    },
    /// The backend could not export the buffer.
    #[error("exporting the buffer failed: {0}")]
    ExportFailed(String),
    /// The peer could not open one of our handles; later tensors are staged.
    #[error("the peer could not open an IPC handle: {0}")]
    PeerRefused(String),
}

/// The id of one export to one peer (numbered per peer from 0).
pub type ExportId = u64;

/// How one device tensor goes to a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// By IPC handle, as export `id`: export the buffer, then [`IpcState::exported`] (or
    /// [`IpcState::export_failed`] and stage it).
    Ipc(ExportId),
    /// Through host memory.
    Staged(StagedReason),
}

/// The IPC messages between two agents (control frames).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum IpcMessage {
    /// Who the sender is; `None`: it cannot share device memory.
    Hello(Option<IpcIdentity>),
    /// The receiver copied these exports out: the sender may reuse their memory.
    Release(Vec<ExportId>),
    /// The receiver could not open a handle: send it staged copies from now on.
    Refused(String),
}

/// A message that no honest peer sends. Nothing changed when one is returned; the driver drops
/// the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IpcViolation {
    /// A release naming an export this worker never made to that peer.
    #[error("it released IPC export {id}, which this worker never made to it")]
    UnknownExport {
        /// The id.
        id: ExportId,
    },
    /// A release of an export already released.
    #[error("it released IPC export {id} twice")]
    ReleasedTwice {
        /// The id.
        id: ExportId,
    },
    /// A release of an export whose descriptor has not been sent yet.
    #[error("it released IPC export {id} before it was sent")]
    NotYetSent {
        /// The id.
        id: ExportId,
    },
    /// An IPC descriptor from a peer this worker never introduced itself to (or that cannot
    /// share with it).
    #[error("it sent a tensor by IPC handle without the two workers agreeing on IPC ({0})")]
    Unannounced(StagedReason),
    /// A second hello with another identity.
    #[error("it introduced itself twice, as two different processes")]
    IdentityChanged,
    /// A message that does not decode.
    #[error("it sent {0}")]
    Malformed(#[source] crate::codec::Undecodable),
}

/// Bounds on what a peer can make this worker hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct IpcConfig {
    /// Exported buffers awaiting one peer's release (default 64).
    pub max_exports_per_peer: usize,
    /// Bytes of exported buffers awaiting one peer's release (default 8 GiB).
    pub max_bytes_per_peer: u64,
}

impl Default for IpcConfig {
    fn default() -> Self {
        Self {
            max_exports_per_peer: 64,
            max_bytes_per_peer: 8 << 30,
        }
    }
}

impl IpcConfig {
    /// The default bounds with other values.
    pub fn new(max_exports_per_peer: usize, max_bytes_per_peer: u64) -> Self {
        Self {
            max_exports_per_peer,
            max_bytes_per_peer,
        }
    }
}

/// Which way tensors to a peer go, for the agent's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPaths {
    /// The peer.
    pub peer: WorkerId,
    /// Device tensors sent by IPC handle.
    pub sent_ipc: u64,
    /// Device tensors sent staged through host memory.
    pub sent_staged: u64,
    /// Device tensors received by IPC handle.
    pub received_ipc: u64,
    /// Why the last staged tensor was staged (`None` while every tensor went by IPC).
    pub last_staged: Option<StagedReason>,
    /// Whether the next device tensor to the peer (on a GPU the two share) would go by IPC.
    pub ipc_now: bool,
    /// Buffers held for the peer awaiting its release.
    pub held: usize,
    /// Their bytes.
    pub held_bytes: u64,
}

#[derive(Debug)]
enum Export<T> {
    /// Reserved by `route`, being exported.
    Reserved { bytes: u64 },
    /// Its descriptor is out; the buffer is held until released.
    Sent { bytes: u64, held: T },
}

impl<T> Export<T> {
    fn bytes(&self) -> u64 {
        match self {
            Export::Reserved { bytes } | Export::Sent { bytes, .. } => *bytes,
        }
    }
}

#[derive(Debug)]
enum PeerIdentity {
    Unknown,
    Known(Option<IpcIdentity>),
    Refused(String),
}

#[derive(Debug)]
struct Peer<T> {
    hello_sent: bool,
    identity: PeerIdentity,
    next_export: ExportId,
    exports: BTreeMap<ExportId, Export<T>>,
    held_bytes: u64,
    sent_ipc: u64,
    sent_staged: u64,
    received_ipc: u64,
    last_staged: Option<StagedReason>,
}

impl<T> Peer<T> {
    fn new() -> Self {
        Self {
            hello_sent: false,
            identity: PeerIdentity::Unknown,
            next_export: 0,
            exports: BTreeMap::new(),
            held_bytes: 0,
            sent_ipc: 0,
            sent_staged: 0,
            received_ipc: 0,
            last_staged: None,
        }
    }
}

/// Whether a tensor on `from` here may land on `to` at a peer by IPC (see the module docs).
pub fn decide(
    me: Option<&IpcIdentity>,
    peer: Option<&IpcIdentity>,
    from: Device,
    to: Device,
) -> Result<(), StagedReason> {
    let me = me.ok_or(StagedReason::NotSupported)?;
    let peer = peer.ok_or(StagedReason::PeerNotSupported)?;
    if me.host.boot_id != peer.host.boot_id {
        return Err(StagedReason::OtherHost);
    }
    if me.host.ipc_namespace != peer.host.ipc_namespace {
        return Err(StagedReason::OtherContainer { namespace: "ipc" });
    }
    if me.host.pid_namespace != peer.host.pid_namespace {
        return Err(StagedReason::OtherContainer { namespace: "pid" });
    }
    if me.host.pid == peer.host.pid {
        return Err(StagedReason::SameProcess);
    }
    let src = me.gpu(from).ok_or(StagedReason::UnknownDevice {
        device: from,
        side: "sender",
    })?;
    let dst = peer.gpu(to).ok_or(StagedReason::UnknownDevice {
        device: to,
        side: "receiver",
    })?;
    if src.mig {
        return Err(StagedReason::Mig { device: from });
    }
    if dst.mig {
        return Err(StagedReason::Mig { device: to });
    }
    if src.uuid != dst.uuid {
        return Err(StagedReason::OtherGpu { from, to });
    }
    Ok(())
}

/// The IPC decisions of one agent: peers' identities, exports held, messages to send.
#[derive(Debug)]
pub struct IpcState<T> {
    me: Option<IpcIdentity>,
    config: IpcConfig,
    peers: BTreeMap<WorkerId, Peer<T>>,
    transmits: VecDeque<(WorkerId, IpcMessage)>,
}

impl<T> IpcState<T> {
    /// The state of a worker that is `me` (`None`: it cannot share device memory; it still
    /// answers hellos so that its peers stage at once).
    pub fn new(me: Option<IpcIdentity>, config: IpcConfig) -> Self {
        Self {
            me,
            config,
            peers: BTreeMap::new(),
            transmits: VecDeque::new(),
        }
    }

    /// The bounds in force.
    pub fn config(&self) -> IpcConfig {
        self.config
    }

    fn peer(&mut self, peer: WorkerId) -> &mut Peer<T> {
        self.peers.entry(peer).or_insert_with(Peer::new)
    }

    /// Queues our hello to `peer` unless it went already.
    fn introduce(&mut self, peer: WorkerId) {
        let me = self.me.clone();
        let p = self.peer(peer);
        if !p.hello_sent {
            p.hello_sent = true;
            self.transmits.push_back((peer, IpcMessage::Hello(me)));
        }
    }

    /// How a device tensor of `bytes` bytes on `from` goes to `peer`, where it lands on `to`.
    /// A tensor to a peer not yet known is staged and this worker introduces itself to it.
    pub fn route(&mut self, peer: WorkerId, from: Device, to: Device, bytes: u64) -> Route {
        let route = self.choose(peer, from, to, bytes);
        let p = self.peer(peer);
        match &route {
            Route::Ipc(id) => {
                p.exports.insert(*id, Export::Reserved { bytes });
                p.held_bytes += bytes;
                p.next_export += 1;
            }
            Route::Staged(why) => {
                p.sent_staged += 1;
                p.last_staged = Some(why.clone());
            }
        }
        route
    }

    fn choose(&mut self, peer: WorkerId, from: Device, to: Device, bytes: u64) -> Route {
        if self.me.is_none() {
            return Route::Staged(StagedReason::NotSupported);
        }
        self.introduce(peer);
        let config = self.config;
        let me = self.me.as_ref();
        let p = self.peers.get(&peer).expect("introduced above");
        let identity = match &p.identity {
            PeerIdentity::Unknown => return Route::Staged(StagedReason::PeerUnknown),
            PeerIdentity::Refused(why) => {
                return Route::Staged(StagedReason::PeerRefused(why.clone()))
            }
            PeerIdentity::Known(identity) => identity.as_ref(),
        };
        if let Err(why) = decide(me, identity, from, to) {
            return Route::Staged(why);
        }
        let held = p.exports.len();
        if held >= config.max_exports_per_peer
            || p.held_bytes.saturating_add(bytes) > config.max_bytes_per_peer
        {
            return Route::Staged(StagedReason::Bound {
                held,
                held_bytes: p.held_bytes,
                max_exports: config.max_exports_per_peer,
                max_bytes: config.max_bytes_per_peer,
            });
        }
        Route::Ipc(p.next_export)
    }

    /// Export `id` to `peer` was made and its descriptor goes out now: `held` (the buffer and
    /// whatever keeps the handle valid) is kept until the peer releases it.
    pub fn exported(&mut self, peer: WorkerId, id: ExportId, held: T) {
        if let Some(p) = self.peers.get_mut(&peer) {
            if let Some(e) = p.exports.get_mut(&id) {
                let bytes = e.bytes();
                *e = Export::Sent { bytes, held };
                p.sent_ipc += 1;
            }
        }
    }

    /// Export `id` to `peer` failed: the tensor goes staged, and so do later ones to that peer
    /// (a backend that failed once is not asked again).
    pub fn export_failed(&mut self, peer: WorkerId, id: ExportId, why: String) {
        if let Some(p) = self.peers.get_mut(&peer) {
            if let Some(e) = p.exports.remove(&id) {
                p.held_bytes -= e.bytes();
            }
            p.sent_staged += 1;
            p.last_staged = Some(StagedReason::ExportFailed(why.clone()));
            p.identity = PeerIdentity::Refused(format!("our export failed: {why}"));
        }
    }

    /// Checks an IPC descriptor received from `peer` before the backend opens it: the two
    /// workers must have agreed on IPC (this worker introduced itself and can share).
    pub fn check_import(&self, peer: WorkerId) -> Result<(), IpcViolation> {
        let p = self.peers.get(&peer);
        if self.me.is_none() {
            return Err(IpcViolation::Unannounced(StagedReason::NotSupported));
        }
        if !p.is_some_and(|p| p.hello_sent) {
            return Err(IpcViolation::Unannounced(StagedReason::PeerUnknown));
        }
        Ok(())
    }

    /// The backend copied export `id` of `peer` out: a release goes back (releases to one peer
    /// queued together travel in one message).
    pub fn imported(&mut self, peer: WorkerId, id: ExportId) {
        self.peer(peer).received_ipc += 1;
        self.queue_release(peer, id);
    }

    /// The backend could not open export `id` of `peer`: it is released (nothing holds it
    /// here) and the peer is told to stage from now on.
    pub fn import_failed(&mut self, peer: WorkerId, id: ExportId, why: String) {
        self.queue_release(peer, id);
        self.transmits.push_back((peer, IpcMessage::Refused(why)));
    }

    fn queue_release(&mut self, peer: WorkerId, id: ExportId) {
        if let Some((to, IpcMessage::Release(ids))) = self.transmits.back_mut() {
            if *to == peer {
                ids.push(id);
                return;
            }
        }
        self.transmits
            .push_back((peer, IpcMessage::Release(vec![id])));
    }

    /// Handles an IPC message from `peer`; returns the buffers it released (drop them, outside
    /// any lock). A violation changes nothing.
    pub fn handle_message(
        &mut self,
        peer: WorkerId,
        msg: IpcMessage,
    ) -> Result<Vec<T>, IpcViolation> {
        match msg {
            IpcMessage::Hello(identity) => {
                let p = self.peer(peer);
                match &p.identity {
                    PeerIdentity::Known(known) if *known != identity => {
                        return Err(IpcViolation::IdentityChanged)
                    }
                    PeerIdentity::Unknown => p.identity = PeerIdentity::Known(identity),
                    _ => {}
                }
                self.introduce(peer);
                Ok(Vec::new())
            }
            IpcMessage::Refused(why) => {
                self.peer(peer).identity = PeerIdentity::Refused(why);
                Ok(Vec::new())
            }
            IpcMessage::Release(ids) => {
                let Some(p) = self.peers.get_mut(&peer) else {
                    return match ids.first() {
                        Some(&id) => Err(IpcViolation::UnknownExport { id }),
                        None => Ok(Vec::new()),
                    };
                };
                let mut seen = std::collections::BTreeSet::new();
                for &id in &ids {
                    match p.exports.get(&id) {
                        Some(Export::Sent { .. }) if seen.insert(id) => {}
                        Some(Export::Sent { .. }) => {
                            return Err(IpcViolation::ReleasedTwice { id })
                        }
                        Some(Export::Reserved { .. }) => {
                            return Err(IpcViolation::NotYetSent { id })
                        }
                        None if id < p.next_export => {
                            return Err(IpcViolation::ReleasedTwice { id })
                        }
                        None => return Err(IpcViolation::UnknownExport { id }),
                    }
                }
                let mut freed = Vec::with_capacity(ids.len());
                for id in ids {
                    if let Some(Export::Sent { bytes, held }) = p.exports.remove(&id) {
                        p.held_bytes -= bytes;
                        freed.push(held);
                    }
                }
                Ok(freed)
            }
        }
    }

    /// `peer` is gone: every buffer held for it is handed back (it can open no handle any
    /// more), and its state is forgotten (a worker joining again under its rank introduces
    /// itself anew).
    pub fn peer_lost(&mut self, peer: WorkerId) -> Vec<T> {
        self.transmits.retain(|(to, _)| *to != peer);
        let Some(p) = self.peers.remove(&peer) else {
            return Vec::new();
        };
        p.exports
            .into_values()
            .filter_map(|e| match e {
                Export::Sent { held, .. } => Some(held),
                Export::Reserved { .. } => None,
            })
            .collect()
    }

    /// The next message to send.
    pub fn poll_transmit(&mut self) -> Option<(WorkerId, IpcMessage)> {
        self.transmits.pop_front()
    }

    /// Buffers and bytes held for `peer` awaiting its release (reserved exports included).
    pub fn held(&self, peer: WorkerId) -> (usize, u64) {
        self.peers
            .get(&peer)
            .map_or((0, 0), |p| (p.exports.len(), p.held_bytes))
    }

    /// The paths each peer's tensors took, in rank order.
    pub fn report(&self) -> Vec<PeerPaths> {
        self.peers
            .iter()
            .map(|(&peer, p)| PeerPaths {
                peer,
                sent_ipc: p.sent_ipc,
                sent_staged: p.sent_staged,
                received_ipc: p.received_ipc,
                last_staged: p.last_staged.clone(),
                ipc_now: match (&self.me, &p.identity) {
                    (Some(me), PeerIdentity::Known(Some(id))) => shares_a_gpu(me, id),
                    _ => false,
                },
                held: p.exports.len(),
                held_bytes: p.held_bytes,
            })
            .collect()
    }
}

/// Whether some GPU of `me` is a GPU of `peer` that IPC can use between them.
fn shares_a_gpu(me: &IpcIdentity, peer: &IpcIdentity) -> bool {
    (0..me.gpus.len()).any(|a| {
        (0..peer.gpus.len()).any(|b| {
            let (Ok(a), Ok(b)) = (u8::try_from(a), u8::try_from(b)) else {
                return false;
            };
            decide(Some(me), Some(peer), Device::Cuda(a), Device::Cuda(b)).is_ok()
        })
    })
}

/// The first bytes of an IPC control frame's header (the rest is an [`IpcMessage`] in postcard).
pub const FRAME_TAG: &[u8; 6] = b"TWIPC1";

/// Encodes an IPC message as a control frame header.
pub fn encode_message(msg: &IpcMessage) -> Vec<u8> {
    let mut out = FRAME_TAG.to_vec();
    out.extend(crate::codec::encode(msg));
    out
}

/// Decodes a control frame header: `None` when it is not an IPC message, else the message or
/// why it is malformed.
pub fn decode_message(header: &[u8]) -> Option<Result<IpcMessage, IpcViolation>> {
    let body = header.strip_prefix(&FRAME_TAG[..])?;
    Some(
        crate::codec::decode(crate::codec::Format::IpcMessage, body)
            .map_err(IpcViolation::Malformed),
    )
}

#[cfg(test)]
mod tests;
