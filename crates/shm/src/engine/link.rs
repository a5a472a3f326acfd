//! The connection between a queue pair and its peer: our segment (where we publish), the
//! peer's segment (where we read), the sockets that carry the introductions and region
//! questions and whose hang-up reports a dead peer, and the peer's regions mapped here.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lightpath_verbs::{AccessFlags, Error, Gid, Result};
use rustix::event::{PollFd, PollFlags};

use super::DeviceContext;
use crate::activity::area::PeerArea;
use crate::address::rendezvous_name;
use crate::region::{self, PeerRegion};
use crate::registry::{SocketGuard, SocketRole};
use crate::ring::{Consumer, Producer};
use crate::segment::{OwnSegment, PeerSegment, PeerStatus};
use crate::sys::{poll_fds, EventFd, Memfd, SeqPacket};
use crate::wire::{Message, MAX_MESSAGE};

/// Most peer regions kept mapped per link (the cache is emptied when it would grow past this).
const MAX_CACHED_REGIONS: usize = 1024;

/// Why a link was given up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkFailure {
    /// The peer's process or queue pair went away (its socket hung up, or it stopped
    /// answering).
    PeerGone,
    /// The peer wrote something into shared memory or a socket that the protocol forbids.
    PeerCorrupt,
}

impl LinkFailure {
    /// The `vendor_err` of the completions the failure produces.
    pub(crate) fn vendor_err(self) -> u32 {
        match self {
            LinkFailure::PeerGone => crate::VENDOR_ERR_PEER_GONE,
            LinkFailure::PeerCorrupt => crate::VENDOR_ERR_PEER_CORRUPT,
        }
    }

    /// The status of the request that was in flight when the link failed: what RC reports when
    /// the peer stops answering, or answers nonsense.
    pub(crate) fn head_status(self) -> lightpath_verbs::WcStatus {
        match self {
            LinkFailure::PeerGone => lightpath_verbs::WcStatus::RetryExcErr,
            LinkFailure::PeerCorrupt => lightpath_verbs::WcStatus::BadRespErr,
        }
    }
}

/// A peer queue pair introducing itself (received by the socket thread, applied under the
/// device lock).
#[derive(Debug)]
pub(crate) struct PeerAttach {
    /// Our queue pair it wants.
    pub(crate) qpn: u32,
    pub(crate) from_gid: Gid,
    pub(crate) from_qpn: u32,
    pub(crate) segment: PeerSegment,
    /// Its own doorbell, if a thread of the peer waits for it alone (see `crate::activity`).
    pub(crate) waiter: Option<EventFd>,
    /// Its device's activity area (with the device's doorbell), and its slot there.
    pub(crate) area: Arc<PeerArea>,
    pub(crate) slot: u32,
    /// The socket it connected with.
    pub(crate) served: SocketGuard,
}

/// What we know of an attached peer.
#[derive(Debug)]
pub(crate) struct PeerSide {
    pub(crate) segment: PeerSegment,
    pub(crate) consumer: Consumer,
    pub(crate) waiter: Option<EventFd>,
    pub(crate) area: Arc<PeerArea>,
    pub(crate) slot: u32,
    pub(crate) served: SocketGuard,
    /// Shared so that a direct write can copy into one after the device lock is released.
    pub(crate) regions: HashMap<u32, std::sync::Arc<PeerRegion>>,
}

impl PeerSide {
    /// Tells the peer's device its queue pair has news (after publishing it), ringing the
    /// doorbell if the device sleeps and no one rang for this sleep yet, or rather the queue
    /// pair's own doorbell if a thread waits for it alone and the news is for it (`arrival`:
    /// records, a NAK or a state change; else only acknowledgements or freed ring space); never
    /// both (see `PeerArea::notify`).
    pub(crate) fn signal(&self, arrival: bool) {
        self.area.notify(self.slot, self.waiter.as_ref(), arrival);
    }
}

/// One queue pair's connection.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) outbox: OwnSegment,
    pub(crate) producer: Producer,
    pub(crate) client: SocketGuard,
    pub(crate) peer: Option<PeerSide>,
    rpc_tag: u32,
    rpc_timeout: Duration,
}

impl Link {
    /// Creates our segment and introduces queue pair `qpn` (in activity slot `slot`) to the
    /// device with GID `dgid`, asking for its queue pair `dqpn`, handing over `waiter` (the
    /// queue pair's own doorbell) if there is one. Fails if no such device is reachable.
    ///
    /// `status` (the queue pair's status once in RTR) is published before the introduction is
    /// sent: the peer may attach and carry out requests the moment it reads the introduction,
    /// and would fail them against a segment that does not say RTR yet.
    pub(crate) fn establish(
        qpn: u32,
        slot: u32,
        dgid: Gid,
        dqpn: u32,
        status: PeerStatus,
        waiter: Option<std::os::fd::BorrowedFd<'_>>,
        ctx: &DeviceContext,
    ) -> Result<Self> {
        let config = &ctx.config;
        let (outbox, outbox_memfd) = OwnSegment::create(config.ring_bytes, config.max_fragment)?;
        outbox.publish_status(status);
        let producer = Producer::new(config.ring_bytes, config.max_fragment)
            .ok_or(Error::InvalidAttribute("ring size"))?;
        let socket = SeqPacket::connect_abstract(&rendezvous_name(dgid)).map_err(|err| {
            Error::Unavailable(format!(
                "no shm device with GID {dgid} reachable from this process ({err}); shm connects processes \
                 of one host and network namespace"
            ))
        })?;
        let uid = socket.peer_uid()?;
        if uid != ctx.uid && !config.allow_other_users {
            return Err(Error::Unavailable(format!("the shm device with GID {dgid} belongs to user {uid}")));
        }
        let hello = Message::Hello { from_gid: ctx.gid, from_qpn: qpn, to_qpn: dqpn, slot };
        let (bytes, len) = hello.encode();
        let mut fds = vec![outbox_memfd.as_fd(), ctx.doorbell.as_fd(), ctx.activity.memfd().as_fd()];
        fds.extend(waiter);
        socket.send(&bytes[..len], &fds)?;
        // In flight, the message holds the file; the peer maps it, and so do we already.
        drop(outbox_memfd);
        let client = ctx.registry.register(Arc::new(socket), SocketRole::Client);
        Ok(Self { outbox, producer, client, peer: None, rpc_tag: 0, rpc_timeout: config.rpc_timeout })
    }

    /// Starts reading the peer's segment.
    pub(crate) fn attach(&mut self, attach: PeerAttach) -> std::result::Result<(), PeerAttach> {
        let Some(consumer) = Consumer::new(attach.segment.capacity(), attach.segment.max_payload()) else {
            return Err(attach);
        };
        self.peer = Some(PeerSide {
            segment: attach.segment,
            consumer,
            waiter: attach.waiter,
            area: attach.area,
            slot: attach.slot,
            served: attach.served,
            regions: HashMap::new(),
        });
        Ok(())
    }

    /// The peer's region with remote key `rkey` as seen by its queue pair `dqpn`: from the
    /// cache if still registered, else asked for over the socket. `Ok(None)` if the peer has no
    /// such region for that queue pair.
    pub(crate) fn peer_region(
        &mut self,
        rkey: u32,
        dqpn: u32,
    ) -> std::result::Result<Option<&std::sync::Arc<PeerRegion>>, LinkFailure> {
        let peer = self.peer.as_mut().ok_or(LinkFailure::PeerGone)?;
        if peer.regions.get(&rkey).is_some_and(|region| !region.is_valid()) {
            peer.regions.remove(&rkey);
        }
        if !peer.regions.contains_key(&rkey) {
            self.rpc_tag = self.rpc_tag.wrapping_add(1);
            let Some(region) = query_region(&self.client.socket, self.rpc_tag, rkey, dqpn, self.rpc_timeout)?
            else {
                return Ok(None);
            };
            if !region.is_valid() {
                return Ok(None);
            }
            if peer.regions.len() >= MAX_CACHED_REGIONS {
                peer.regions.clear();
            }
            peer.regions.insert(rkey, std::sync::Arc::new(region));
        }
        Ok(peer.regions.get(&rkey))
    }
}

/// Asks the peer's device about region `rkey` and waits for the answer.
fn query_region(
    socket: &SeqPacket,
    tag: u32,
    rkey: u32,
    dqpn: u32,
    timeout: Duration,
) -> std::result::Result<Option<PeerRegion>, LinkFailure> {
    let (bytes, len) = Message::RegionQuery { tag, qpn: dqpn, rkey }.encode();
    socket.send(&bytes[..len], &[]).map_err(|_| LinkFailure::PeerGone)?;
    let deadline = Instant::now() + timeout;
    loop {
        let mut buf = [0u8; MAX_MESSAGE];
        let received = match socket.recv(&mut buf) {
            Ok(Some(received)) => received,
            Ok(None) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(LinkFailure::PeerGone);
                }
                let mut fds = [PollFd::new(socket, PollFlags::IN)];
                poll_fds(&mut fds, Some(left)).map_err(|_| LinkFailure::PeerGone)?;
                continue;
            }
            Err(_) => return Err(LinkFailure::PeerGone),
        };
        if received.len == 0 {
            return Err(LinkFailure::PeerGone);
        }
        let Some(Message::RegionReply { tag: reply_tag, found, addr, len, access }) =
            Message::decode(&buf[..received.len])
        else {
            return Err(LinkFailure::PeerCorrupt);
        };
        if reply_tag != tag {
            return Err(LinkFailure::PeerCorrupt);
        }
        if !found {
            return Ok(None);
        }
        let access = AccessFlags::from_raw(access).ok_or(LinkFailure::PeerCorrupt)?;
        let mut fds = received.fds.into_iter();
        let (Some(fd), None) = (fds.next(), fds.next()) else { return Err(LinkFailure::PeerCorrupt) };
        let (_, file_len) = region::layout(len).ok_or(LinkFailure::PeerCorrupt)?;
        let memfd = Memfd::from_peer(fd, file_len).map_err(|_| LinkFailure::PeerCorrupt)?;
        return PeerRegion::map(memfd, rkey, addr, len, access)
            .map(Some)
            .map_err(|_| LinkFailure::PeerCorrupt);
    }
}

#[cfg(test)]
mod tests {
    use lightpath_verbs::QpState;

    use super::*;
    use crate::activity::area::OwnArea;
    use crate::config::ShmConfig;
    use crate::registry::SocketRegistry;
    use crate::segment::RING_OFFSET;
    use crate::sys::Listener;

    /// The segment handed over with the introduction already says RTR: a peer that attaches
    /// the moment it reads the introduction (before `modify` returns) sees a queue pair ready to
    /// receive, not an unpublished status that fails its requests.
    #[test]
    fn the_introduced_segment_already_says_rtr() {
        let peer_gid = crate::address::random_gid().expect("gid");
        let listener = Listener::bind_abstract(&rendezvous_name(peer_gid)).expect("listener");
        let ctx = DeviceContext {
            gid: crate::address::random_gid().expect("gid"),
            uid: rustix::process::getuid().as_raw(),
            config: ShmConfig { ring_bytes: 4096, max_fragment: 512, ..ShmConfig::default() },
            doorbell: EventFd::new(false).expect("eventfd"),
            activity: Arc::new(OwnArea::create(64).expect("activity area")),
            registry: Arc::new(SocketRegistry::new().expect("registry")),
        };
        let status = PeerStatus { state: QpState::Rtr, access: AccessFlags::REMOTE_WRITE, rnr_retry: 3 };
        let link = Link::establish(7, 5, peer_gid, 9, status, None, &ctx).expect("establish");

        let served = listener.accept().expect("accept").expect("a connection");
        let mut buf = [0u8; MAX_MESSAGE];
        let hello = served.recv(&mut buf).expect("recv").expect("the introduction");
        assert_eq!(
            Message::decode(&buf[..hello.len]),
            Some(Message::Hello { from_gid: ctx.gid, from_qpn: 7, to_qpn: 9, slot: 5 })
        );
        assert_eq!(hello.fds.len(), 3, "segment, doorbell and activity area");
        let segment_fd = hello.fds.into_iter().next().expect("the segment");
        let memfd = Memfd::from_peer(segment_fd, RING_OFFSET as u64).expect("memfd");
        let segment = PeerSegment::from_memfd(&memfd, ShmConfig::MAX_RING).expect("segment");
        assert_eq!(segment.status_line().status, Some(status));
        drop(link);
    }
}
