//! The RDMA devices this process's streams use, one per provider (and, for soft and ibverbs,
//! per local address), opened on first use and shared by every connection. Each module turns
//! "a connection between these two TCP addresses" into the verbs objects of one side
//! ([`crate::rdma::PendingSetup`]).

pub(crate) mod ibverbs;
pub(crate) mod shm;
pub(crate) mod soft;

use std::io;
use std::net::TcpStream;

use lightpath_stream::negotiate::ProviderId;

use crate::options::Options;
use crate::rdma::PendingSetup;

/// Whether this process could set up `provider` for the connection `tcp` (cheap after the
/// first call: devices are cached), so a client offers only what it can open.
pub(crate) fn usable(provider: ProviderId, tcp: &TcpStream) -> bool {
    match provider {
        ProviderId::Soft => true,
        ProviderId::Shm => shm::host_id() != [0; 16],
        ProviderId::Ibverbs => tcp.local_addr().is_ok_and(|local| ibverbs::available_for(local.ip())),
    }
}

/// Whether this process is too short of file descriptors to give `tcp` an RDMA transport.
///
/// An RDMA connection holds several descriptors (shm: its queue pair's segment and doorbell,
/// its completion queue's wake-up fds, made as they are needed; soft: a notification fd), and
/// some of them only once it is busy. Run out of descriptors and an established connection
/// can fail the first time it needs one, and `accept` fails for everyone. So a connection
/// whose set-up would leave fewer than [`descriptor_reserve`] descriptors free carries its
/// data over its TCP socket instead (`FallbackReason::Resources`), which needs no more; the
/// reserve keeps serving the connections already established, and TCP fallbacks continue
/// until the limit itself.
///
/// How many are free is read cheaply, not counted: the kernel gives out the lowest free
/// number, so a duplicate of `tcp` lands just above the last descriptor of a densely used
/// table. (After many closes the table has holes and this overestimates what is free; a set-up
/// that then fails for want of a descriptor still falls back, as any set-up failure does.)
pub(crate) fn short_of_descriptors(tcp: &TcpStream) -> bool {
    let Some(limit) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current else {
        return false;
    };
    let lowest_free = match rustix::io::fcntl_dupfd_cloexec(tcp, 0) {
        Ok(probe) => std::os::fd::AsRawFd::as_raw_fd(&probe) as u64,
        // Not even one left.
        Err(_) => return true,
    };
    lowest_free.saturating_add(descriptor_reserve(limit)) > limit
}

/// Descriptors kept free for the established connections (see [`short_of_descriptors`]): an
/// eighth of the limit, at least 64.
fn descriptor_reserve(limit: u64) -> u64 {
    (limit / 8).max(64)
}

/// The provider a server will likely pick from a client's `offered` list (in the client's
/// order; servers rank alike by default) for a connection whose soft devices are `key`'s: shm
/// for a peer on this host (loopback, or this side's own address), else the first other
/// provider offered.
fn likely_pick(offered: &[ProviderId], key: soft::DeviceKey) -> Option<ProviderId> {
    let same_host = key == soft::DeviceKey::Loopback;
    offered.iter().copied().find(|&p| p != ProviderId::Shm || same_host)
}

/// Opens the device of the provider a server will likely pick from a client's `offered` list
/// ([`likely_pick`]) for the connection `tcp`, if none is open yet (see
/// `Handshake::before_waiting`): what a process's first connection gains. A process with a
/// device of an offered provider open already has connected before and looks no further (no
/// system call). Nothing for ibverbs, whose devices open with their first use as before.
pub(crate) fn warm_likely_pick(offered: &[ProviderId], tcp: &TcpStream, options: &Options) {
    let connected_before = offered.iter().any(|provider| match provider {
        ProviderId::Soft => soft::any_open(),
        ProviderId::Shm => shm::is_open(),
        ProviderId::Ibverbs => false,
    });
    if connected_before {
        return;
    }
    let (Ok(local), Ok(peer)) = (tcp.local_addr(), tcp.peer_addr()) else { return };
    let key = soft::DeviceKey::for_connection(local, peer);
    match likely_pick(offered, key) {
        Some(ProviderId::Soft) => soft::warm(key, options),
        Some(ProviderId::Shm) => shm::warm(),
        Some(ProviderId::Ibverbs) | None => {}
    }
}

/// This side's verbs objects for the connection `tcp` over `provider`, towards a Lightpath
/// peer of the same provider (or any peer but a soft side facing hardware, see
/// [`setup_towards_hardware`]).
pub(crate) fn setup(
    provider: ProviderId,
    tcp: &TcpStream,
    options: &Options,
) -> io::Result<Box<dyn PendingSetup>> {
    let options = &Options { rendezvous_min: Some(options.rendezvous_min_for(provider)), ..options.clone() };
    match provider {
        ProviderId::Soft => soft::setup(tcp, options, soft::Facing::Lightpath),
        ProviderId::Shm => shm::setup(options),
        ProviderId::Ibverbs => ibverbs::setup(tcp, options),
    }
}

/// A soft side's verbs objects for a connection whose peer is RoCE hardware (an ibverbs
/// device, which sends to the RoCE v2 port only): the device on that port, and no port of the
/// queue pair's own.
pub(crate) fn setup_towards_hardware(
    tcp: &TcpStream,
    options: &Options,
) -> io::Result<Box<dyn PendingSetup>> {
    let options = &Options {
        rendezvous_min: Some(options.rendezvous_min_for(ProviderId::Soft)),
        soft_qp_port: Some(false),
        ..options.clone()
    };
    soft::setup(tcp, options, soft::Facing::Hardware)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_expects_shm_from_a_server_on_its_host_else_its_next_provider() {
        use ProviderId::{Ibverbs, Shm, Soft};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let key = soft::DeviceKey::for_connection(tcp.local_addr().unwrap(), tcp.peer_addr().unwrap());
        assert_eq!(likely_pick(&[Shm, Soft], key), Some(Shm), "loopback: the same host");
        assert_eq!(likely_pick(&[Soft, Shm], key), Some(Soft), "the client's order");
        assert_eq!(likely_pick(&[Ibverbs, Soft], key), Some(Ibverbs));
        assert_eq!(likely_pick(&[], key), None);
        let remote = soft::DeviceKey::Local("10.0.0.1".parse().unwrap());
        assert_eq!(likely_pick(&[Shm, Soft], remote), Some(Soft), "another host: no shm");
    }
}
