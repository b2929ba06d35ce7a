//! Which address a worker advertises to its peers (for its RPC listener and its process-group
//! mesh), in this order:
//!
//! 1. an address given in code (`RpcOptions::listen_ip`, the `listen_ip` backend option);
//! 2. the IPv4 address of the interface named by `TENSORWIRE_IFNAME` (as gloo's
//!    `GLOO_SOCKET_IFNAME` and NCCL's `NCCL_SOCKET_IFNAME`);
//! 3. the local address that packets to `MASTER_ADDR` leave from ([`route_ip`]);
//! 4. loopback, when nothing says otherwise.
//!
//! A worker whose choice is a loopback address while `MASTER_ADDR` is not one (a group that
//! spans hosts) fails with [`AddressError::LoopbackInMultiHostGroup`]: its peers on other hosts
//! could never reach it, and it is better to say so at init than to time out later.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};

use crate::launcher_env::{launcher_var_from_process, MASTER_ADDR};

/// The variable naming the network interface whose address workers advertise.
pub const IFNAME_ENV: &str = "TENSORWIRE_IFNAME";

/// Why no address could be chosen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AddressError {
    /// `TENSORWIRE_IFNAME` names an interface this host does not have.
    #[error("TENSORWIRE_IFNAME={name:?}: no such network interface here (interfaces: {known})")]
    NoSuchInterface {
        /// The name given.
        name: String,
        /// The interfaces this host has, comma-separated.
        known: String,
    },
    /// The interface named by `TENSORWIRE_IFNAME` has no IPv4 address.
    #[error("TENSORWIRE_IFNAME={name:?}: the interface has no IPv4 address")]
    NoIpv4 {
        /// The interface.
        name: String,
    },
    /// The interfaces could not be listed.
    #[error("cannot list the network interfaces for TENSORWIRE_IFNAME={name:?}: {source}")]
    Interfaces {
        /// The interface asked for.
        name: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// This worker would advertise a loopback address in a group whose master is on another
    /// host: peers elsewhere could not reach it.
    #[error(
        "this worker would advertise the loopback address {ip} ({how}), but MASTER_ADDR={master} \
         is not a loopback address, so peers on other hosts could not reach it; set \
         TENSORWIRE_IFNAME to the network interface the hosts share (e.g. eth0), or give the \
         address to listen on in code (RpcOptions::listen_ip, the listen_ip backend option)"
    )]
    LoopbackInMultiHostGroup {
        /// The address it would advertise.
        ip: IpAddr,
        /// Where that address came from.
        how: &'static str,
        /// `MASTER_ADDR` as given.
        master: String,
    },
}

/// The local IP that packets to `MASTER_ADDR` (or Slurm's first node) leave from; no packet is
/// sent. `None` when it is unset or unreachable.
pub fn route_ip() -> Option<IpAddr> {
    let host = launcher_var_from_process(MASTER_ADDR).ok().flatten()?;
    let target = resolve(&host)?;
    let bind: SocketAddr = match target {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(bind).ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip())
}

fn resolve(host: &str) -> Option<SocketAddr> {
    std::net::ToSocketAddrs::to_socket_addrs(&(host, 9))
        .ok()?
        .next()
}

/// The IPv4 address of interface `name`.
///
/// # Errors
/// [`AddressError`] naming the interface: missing, without IPv4, or unlistable.
pub fn interface_ipv4(name: &str) -> Result<Ipv4Addr, AddressError> {
    let interfaces = if_addrs::get_if_addrs().map_err(|source| AddressError::Interfaces {
        name: name.to_owned(),
        source,
    })?;
    let mut found = false;
    for interface in &interfaces {
        if interface.name != name {
            continue;
        }
        found = true;
        if let if_addrs::IfAddr::V4(v4) = &interface.addr {
            return Ok(v4.ip);
        }
    }
    if found {
        return Err(AddressError::NoIpv4 {
            name: name.to_owned(),
        });
    }
    let mut known: Vec<&str> = interfaces.iter().map(|i| i.name.as_str()).collect();
    known.sort_unstable();
    known.dedup();
    Err(AddressError::NoSuchInterface {
        name: name.to_owned(),
        known: known.join(", "),
    })
}

/// The address this worker advertises (see the [module](self) documentation for the order).
///
/// # Errors
/// [`AddressError`]: a bad `TENSORWIRE_IFNAME`, or a loopback address in a group that spans
/// hosts.
pub fn advertise_ip(explicit: Option<IpAddr>) -> Result<IpAddr, AddressError> {
    let ifname = std::env::var(IFNAME_ENV).ok().filter(|n| !n.is_empty());
    let (ip, how) = match (explicit, ifname) {
        (Some(ip), _) => (ip, "given in code"),
        (None, Some(name)) => (IpAddr::V4(interface_ipv4(&name)?), "from TENSORWIRE_IFNAME"),
        (None, None) => match route_ip() {
            Some(ip) => (ip, "the route to MASTER_ADDR"),
            None => (
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                "the default: MASTER_ADDR is unset or unreachable",
            ),
        },
    };
    if ip.is_loopback() {
        if let Some(master) = launcher_var_from_process(MASTER_ADDR).ok().flatten() {
            let master_is_loopback =
                resolve(&master).is_some_and(|a| a.ip().is_loopback()) || master == "localhost";
            if !master_is_loopback {
                return Err(AddressError::LoopbackInMultiHostGroup { ip, how, master });
            }
        }
    }
    Ok(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interfaces_are_found_by_name_or_named_in_the_error() {
        // Every Linux host has `lo` with 127.0.0.1.
        assert_eq!(interface_ipv4("lo").unwrap(), Ipv4Addr::LOCALHOST);
        let err = interface_ipv4("tw-no-such0").unwrap_err().to_string();
        assert!(
            err.starts_with(
                "TENSORWIRE_IFNAME=\"tw-no-such0\": no such network interface here (interfaces: "
            ) && err.contains("lo"),
            "{err}"
        );
    }
}
