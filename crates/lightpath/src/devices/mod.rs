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

/// This side's verbs objects for the connection `tcp` over `provider`.
pub(crate) fn setup(
    provider: ProviderId,
    tcp: &TcpStream,
    options: &Options,
) -> io::Result<Box<dyn PendingSetup>> {
    let options = &Options { rendezvous_min: Some(options.rendezvous_min_for(provider)), ..options.clone() };
    match provider {
        ProviderId::Soft => soft::setup(tcp, options),
        ProviderId::Shm => shm::setup(options),
        ProviderId::Ibverbs => ibverbs::setup(tcp, options),
    }
}
