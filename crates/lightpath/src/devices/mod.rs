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
    grow_descriptor_table_ahead(lowest_free, limit);
    lowest_free.saturating_add(descriptor_reserve(limit)) > limit
}

/// The size this process's descriptor table has (or is being grown to) as far as
/// [`grow_descriptor_table_ahead`] knows: the kernel's initial 64 until it grew it.
static DESCRIPTOR_TABLE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(64);

/// Grows the descriptor table eightfold, on a thread of its own, once half of it is in use.
///
/// The kernel grows a process's table when a new descriptor does not fit, doubling it, and in
/// a process with several threads each growth waits for an RCU grace period (`synchronize_rcu`
/// in `expand_fdtable`) in the thread that asked for the descriptor: 10-30 ms on this VM, taken
/// by a connection set-up at 64, 128, 256... descriptors. `perf stream_rr --conns 1000` over
/// soft lost ~100 ms to that (of ~600: connections 78, 181, 437 and 949 each waited 10-28 ms in
/// an `fcntl` or `socket` call). Grown ahead, eightfold, the waits are a third as many and in a
/// thread nobody waits for: a descriptor below the current size never waits for a growth under
/// way. A process that never has many descriptors never grows its table.
fn grow_descriptor_table_ahead(lowest_free: u64, limit: u64) {
    use std::sync::atomic::Ordering;
    let known = DESCRIPTOR_TABLE.load(Ordering::Relaxed);
    if lowest_free < known / 2 || known >= limit {
        return;
    }
    let target = known.saturating_mul(8).min(limit);
    if DESCRIPTOR_TABLE.compare_exchange(known, target, Ordering::Relaxed, Ordering::Relaxed).is_err() {
        // Another set-up is growing it.
        return;
    }
    let grow = move || {
        // The lowest free number at or above `target - 1` makes the table hold `target`
        // entries (rounded up by the kernel); the duplicate is closed at once, the table stays.
        if let Ok(any) = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC) {
            let number = i32::try_from(target.saturating_sub(1)).unwrap_or(i32::MAX);
            let _ = rustix::io::fcntl_dupfd_cloexec(&any, number);
        }
    };
    if std::thread::Builder::new().name("lightpath-fdtable".into()).spawn(grow).is_err() {
        // No thread for it: the kernel grows the table as it always did.
        DESCRIPTOR_TABLE.store(known, Ordering::Relaxed);
    }
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

    /// The size of this process's descriptor table, as the kernel reports it.
    fn descriptor_table_size() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("FDSize:")).expect("FDSize in /proc/self/status");
        line["FDSize:".len()..].trim().parse().unwrap()
    }

    #[test]
    fn a_table_half_in_use_is_grown_eightfold_ahead() {
        use std::sync::atomic::Ordering;
        let limit = 1 << 14;
        let known = DESCRIPTOR_TABLE.load(Ordering::Relaxed);
        assert!(known < limit, "grown to {known} already (by another test?)");
        grow_descriptor_table_ahead(known / 2, limit);
        let target = (known * 8).min(limit);
        assert!(DESCRIPTOR_TABLE.load(Ordering::Relaxed) >= target);
        let started = std::time::Instant::now();
        while descriptor_table_size() < target {
            assert!(
                started.elapsed() < std::time::Duration::from_secs(10),
                "the table stayed at {}",
                descriptor_table_size()
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}
