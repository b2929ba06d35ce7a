//! A static group's init, as DESIGN's flow: the world process group over the backend's
//! transport, an `all_gather_object` of the worker records, their validation, the agent
//! attached to the group's connections, and a barrier. The store holds no worker record.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::ports::process_group::{Collectives, ProcessGroup, ProcessGroupError};
use tensorwire_core::ports::transport::{Connection, Transport};
use tensorwire_core::protocol::membership::{
    check_certified, check_static_records, NotCertified, RecordError,
};
use tensorwire_core::protocol::{LostCause, ProtocolViolation, WorkerId};
use tensorwire_core::validate::WorkerDeviceInfo;
use tensorwire_core::wire::Frame;
use tensorwire_process_group::{
    CollectivesExt, FrameSink, Group, GroupOptions, PeerEnd, Rendezvous,
};

use crate::error::{RpcError, WaitingFor};
use crate::init::advertise_ip;
use crate::links;
use crate::options::RpcOptions;
use crate::state::WorkerRecord;
use crate::state::{Agent, RPC_GROUP};

/// Static groups, as DESIGN's init flow: the world process group over `transport` (one
/// connection per pair of workers, which the agent then shares), an `all_gather_object` of the
/// worker records, and their validation (names, device maps). The store holds no record.
pub(crate) async fn join_static(
    transport: Arc<dyn Transport>,
    rdv: &Rendezvous,
    name: &str,
    rank: usize,
    world_size: usize,
    options: &RpcOptions,
    budget: &tensorwire_core::budget::Budget,
) -> Result<(Group, Vec<WorkerRecord>), RpcError> {
    let ip = advertise_ip(options)?;
    // The world group's inboxes and readers draw from the agent's budget: one per peer.
    // Its collectives take the group arena when every worker is on this host (its waits keep
    // time on the agent's runtime, as the links do).
    let group_options = GroupOptions::new(RPC_GROUP)
        .with_listen(SocketAddr::new(ip, 0))
        .with_timeout(options.init_timeout)
        .with_runtime(options.runtime.clone())
        .with_budget(budget.clone());
    let group = Group::connect(
        Arc::clone(&rdv.store),
        transport,
        rank,
        world_size,
        group_options,
    )
    .await
    .map_err(|e| init_error(e, "connecting to every worker", options.init_timeout))?;
    let record = WorkerRecord {
        rank: rank as WorkerId,
        // Nobody dials this: the group's connections are the agent's.
        addr: SocketAddr::new(ip, 0),
        devices: WorkerDeviceInfo {
            name: name.to_owned(),
            device_count: options.device_backend.device_count(),
            devices: options.devices.clone(),
            device_maps: options.device_maps.clone(),
        },
    };
    let records = match group.all_gather_object(&record).await {
        Ok(records) => records,
        Err(e) => {
            group.shutdown().await;
            return Err(init_error(
                e,
                "gathering every worker's record",
                options.init_timeout,
            ));
        }
    };
    if let Err(e) = validate_records(&records).and_then(|()| check_names(&group, &records)) {
        group.shutdown().await;
        return Err(e);
    }
    Ok((group, records))
}

/// Each member's connection must certify the name its record gives (core decides what
/// certifies what: `check_certified`).
fn check_names(group: &Group, records: &[WorkerRecord]) -> Result<(), RpcError> {
    for (rank, conn) in group.connections() {
        if let Some(record) = records.get(rank) {
            let ranks = conn.peer_credentials().ranks();
            check_certified(rank, record, &ranks, |name| conn.check_peer_name(name)).map_err(
                |NotCertified { rank, name, source }| RpcError::NotCertified { rank, name, source },
            )?;
        }
    }
    Ok(())
}

/// Every worker's record is its own rank's, names are unique, and the device maps keep the
/// rules of a static group (decided in core: [`check_static_records`]).
fn validate_records(records: &[WorkerRecord]) -> Result<(), RpcError> {
    check_static_records(records).map_err(|e| match e {
        RecordError::OfAnotherRank { rank, claimed } => {
            RpcError::RecordOfAnotherRank { rank, claimed }
        }
        RecordError::DuplicateName {
            name,
            first,
            second,
        } => RpcError::DuplicateName {
            name,
            first,
            second,
        },
        RecordError::DeviceMaps(e) => RpcError::DeviceMaps(e),
    })
}

/// A failure of the group under init: a timeout names the ranks it waited for.
fn init_error(e: ProcessGroupError, what: &str, after: Duration) -> RpcError {
    let waiting_on = match &e {
        ProcessGroupError::SetupTimeout { waiting_on, .. }
        | ProcessGroupError::Timeout { waiting_on, .. } => waiting_on.clone(),
        _ => return RpcError::ProcessGroup(e),
    };
    RpcError::Timeout {
        what: format!("init_rpc: {what}"),
        after,
        waiting_for: Some(WaitingFor::Ranks(
            waiting_on.iter().map(|r| *r as WorkerId).collect(),
        )),
    }
}

/// The agent's side of its static group's connections: the frames that are not the group's
/// own, handled on the connection's reader task as the agent's own readers would. It holds
/// the agent as a reader task does; the agent's shutdown lets go of the group, whose readers
/// then end, and with them this.
struct AgentFrames(Agent);

impl FrameSink for AgentFrames {
    fn on_frame(
        &self,
        peer: usize,
        conn: &Arc<dyn Connection>,
        frame: Frame,
    ) -> Result<(), ProtocolViolation> {
        let agent = &self.0;
        let peer = peer as WorkerId;
        crate::driver::on_frame(
            agent,
            peer,
            frame,
            conn.cheap_sends() || conn.received_all(),
        )
        .inspect_err(|violation| {
            links::peer_lost_on(
                agent,
                peer,
                LostCause::Misbehaved(Box::new(violation.clone())),
                conn,
            );
        })
    }

    fn on_closed(&self, peer: usize, end: &PeerEnd) {
        let agent = &self.0;
        let peer = peer as WorkerId;
        let current = {
            let st = agent.lock();
            st.node.ep().state() == tensorwire_core::protocol::RunState::Running
                && st.peers.contains_key(&peer)
        };
        if current {
            let cause = match end {
                // Its group said goodbye: the peer shut down (at once, or ahead of us).
                PeerEnd::Goodbye => LostCause::Shutdown,
                PeerEnd::Transport(e) => LostCause::Transport(Box::new(e.clone())),
                PeerEnd::Refused(violation) => LostCause::Misbehaved(violation.clone()),
                PeerEnd::Misbehaved(violation) => {
                    LostCause::GroupViolation(Box::new(violation.clone()))
                }
                PeerEnd::Aborted { reason } => LostCause::Aborted {
                    reason: reason.clone(),
                },
            };
            links::peer_lost(agent, peer, cause);
        }
    }
}

/// Shares the connections of the static group's world process group: its reader tasks
/// hand the agent's frames to the agent (see [`AgentFrames`]), the agent writes its own
/// beside the group's, and a barrier makes sure that every worker has attached before any
/// sends the others a call. The agent's shutdown shuts the group down.
pub(crate) async fn attach_group(
    this: &Agent,
    group: Group,
    timeout: Duration,
) -> Result<(), RpcError> {
    let sink: Arc<dyn FrameSink> = Arc::new(AgentFrames(this.clone()));
    let routed = group.route_frames(sink);
    for (peer, conn) in group.connections() {
        let _ = links::attach_conn(
            this,
            peer as WorkerId,
            conn,
            false,
            crate::driver::resume_requests,
        );
    }
    this.lock().owned.group = Some(group.clone());
    routed.map_err(RpcError::ProcessGroup)?;
    group
        .barrier()
        .await
        .map_err(|e| init_error(e, "waiting for every worker to start", timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(rank: WorkerId, name: &str) -> WorkerRecord {
        WorkerRecord {
            rank,
            addr: "127.0.0.1:0".parse().unwrap(),
            devices: WorkerDeviceInfo {
                name: name.to_owned(),
                device_count: 0,
                devices: Vec::new(),
                device_maps: Default::default(),
            },
        }
    }

    #[test]
    fn a_bad_set_of_records_is_a_typed_error_naming_the_ranks() {
        assert!(validate_records(&[record(0, "a"), record(1, "b")]).is_ok());
        let e = validate_records(&[record(0, "a"), record(1, "a")]).unwrap_err();
        assert!(
            matches!(&e, RpcError::DuplicateName { name, first: 0, second: 1 } if name == "a"),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "init_rpc: worker name \"a\" is used by ranks 0 and 1"
        );
        let e = validate_records(&[record(0, "a"), record(2, "b")]).unwrap_err();
        assert!(
            matches!(
                e,
                RpcError::RecordOfAnotherRank {
                    rank: 1,
                    claimed: 2
                }
            ),
            "{e:?}"
        );
    }
}
