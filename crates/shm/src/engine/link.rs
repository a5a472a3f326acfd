//! The connection between a queue pair and its peer: our segment (where we publish), the
//! peer's segment (where we read), the peer's regions mapped here, and the device links that
//! carry the introductions, goodbyes and region questions and whose hang-up reports a dead
//! peer.
//!
//! A device opens one Unix socket to each peer device it links queue pairs with (a
//! [`DeviceLink`]), shared by all of them, as SMC-R shares one link among the connections
//! between two hosts: a thousand connections between two processes cost two sockets per
//! process, not two thousand. Since a queue pair no longer closes a connection of its own when
//! it goes, it says goodbye on its device's link (and an introduction nobody takes is answered
//! with a goodbye on the connection it came over), so its peer fails at once, as before. A
//! process that dies closes all of its links: every queue pair linked with it fails.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use lightpath_verbs::{AccessFlags, Error, Gid, Result};
use rustix::event::{PollFd, PollFlags};

use super::sge::IdMap;
use super::DeviceContext;
use crate::activity::area::{PeerArea, PeerWaiter};
use crate::address::rendezvous_name;
use crate::region::{self, PeerRegion};
use crate::registry::{SocketGuard, SocketRegistry};
use crate::ring::{Consumer, Producer};
use crate::segment::{OwnSegment, PeerSegment, PeerStatus};
use crate::sys::{poll_fds, Memfd, SeqPacket};
use crate::wire::{Message, RegionOffer, WaiterKind};

/// Most peer regions kept mapped per link (the cache is emptied when it would grow past this).
const MAX_CACHED_REGIONS: usize = 1024;

/// How long a goodbye may wait for room in a connection whose reader (the peer's socket
/// thread, which never blocks on anything else) is behind; after that the connection is shut
/// down, which tells the peer's queue pairs on it that we are gone.
const GOODBYE_PATIENCE: Duration = Duration::from_millis(200);

/// Sends `message` on `socket`, waiting up to `patience` for room if the peer's socket thread
/// is behind.
pub(crate) fn send_patiently(
    socket: &SeqPacket,
    message: Message,
    fds: &[BorrowedFd<'_>],
    patience: Duration,
) -> std::io::Result<()> {
    let (bytes, len) = message.encode();
    let deadline = Instant::now() + patience;
    loop {
        match socket.send(&bytes[..len], fds) {
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(err);
                }
                let mut ready = [PollFd::new(socket, PollFlags::OUT)];
                poll_fds(&mut ready, Some(left))?;
            }
            other => return other,
        }
    }
}

/// Our connection to one peer device, shared by every queue pair of ours linked there.
#[derive(Debug)]
pub(crate) struct DeviceLink {
    guard: SocketGuard,
    /// Tags of region questions, unique on this link.
    next_tag: AtomicU32,
    /// A send failed or timed out: the link is shut down and new queue pairs connect afresh.
    broken: AtomicBool,
    /// Held while an introduction is sent; true once one carried the device's descriptors,
    /// which later introductions on this link then refer to (see `Message::Hello`).
    introduced_device: Mutex<bool>,
}

impl DeviceLink {
    /// The socket registry's id of the connection (named in hang-up and goodbye events).
    pub(crate) fn id(&self) -> u64 {
        self.guard.id
    }

    fn usable(&self) -> bool {
        !self.broken.load(Ordering::Acquire) && !self.guard.replies.is_closed()
    }

    /// Sends `message`; a failure breaks the link (see [`Self::give_up`]).
    fn send(&self, message: Message, fds: &[BorrowedFd<'_>], patience: Duration) -> std::io::Result<()> {
        send_patiently(&self.guard.socket, message, fds, patience).inspect_err(|_| self.give_up())
    }

    /// Sends an introduction, with the device's descriptors (`device_fds`) if it is the first
    /// on this link; `rest` are the descriptors that follow (see `Message::Hello`).
    fn introduce(
        &self,
        hello: impl Fn(bool) -> Message,
        segment: BorrowedFd<'_>,
        device_fds: [BorrowedFd<'_>; 3],
        rest: &[BorrowedFd<'_>],
        patience: Duration,
    ) -> std::io::Result<()> {
        // Introductions go one at a time, so the first one sent is the first one the peer reads.
        let mut introduced = self.introduced_device.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut fds = Vec::with_capacity(6);
        fds.push(segment);
        if !*introduced {
            fds.extend(device_fds);
        }
        fds.extend_from_slice(rest);
        self.send(hello(!*introduced), &fds, patience)?;
        *introduced = true;
        Ok(())
    }

    /// Shuts the connection down: the peer's socket thread sees it hang up (every peer queue
    /// pair on it fails, as it would if we had died), and so does ours (ours fail too). A link
    /// that cannot carry a goodbye must not leave peers waiting for one.
    fn give_up(&self) {
        self.broken.store(true, Ordering::Release);
        let _ = rustix::net::shutdown(self.guard.socket.as_fd(), rustix::net::Shutdown::Both);
    }
}

/// A device's links, by the GID of the peer device. Entries live as long as a queue pair
/// holds the link.
#[derive(Debug, Default)]
pub(crate) struct Links {
    by_gid: Mutex<HashMap<Gid, Weak<DeviceLink>>>,
}

impl Links {
    /// The usable link to the device with GID `dgid`, connecting one if there is none; true
    /// if it was just connected.
    fn get_or_connect(&self, dgid: Gid, ctx: &DeviceContext) -> Result<(Arc<DeviceLink>, bool)> {
        let mut by_gid = self.by_gid.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(link) = by_gid.get(&dgid).and_then(Weak::upgrade).filter(|link| link.usable()) {
            return Ok((link, false));
        }
        let link = Arc::new(connect(dgid, ctx)?);
        by_gid.retain(|_, link| link.strong_count() > 0);
        by_gid.insert(dgid, Arc::downgrade(&link));
        Ok((link, true))
    }
}

/// Connects to the device with GID `dgid` (a new link).
fn connect(dgid: Gid, ctx: &DeviceContext) -> Result<DeviceLink> {
    let socket = SeqPacket::connect_abstract(&rendezvous_name(dgid)).map_err(|err| {
        Error::Unavailable(format!(
            "no shm device with GID {dgid} reachable from this process ({err}); shm connects processes \
             of one host and network namespace"
        ))
    })?;
    let uid = socket.peer_uid()?;
    if uid != ctx.uid && !ctx.config.allow_other_users {
        return Err(Error::Unavailable(format!("the shm device with GID {dgid} belongs to user {uid}")));
    }
    let guard = SocketRegistry::register(&ctx.registry, Arc::new(socket));
    Ok(DeviceLink {
        guard,
        next_tag: AtomicU32::new(0),
        broken: AtomicBool::new(false),
        introduced_device: Mutex::new(false),
    })
}

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
    /// How its waiter hears of news (see `crate::activity`).
    pub(crate) waiter: PeerWaiter,
    /// Its device's activity area (with the device's doorbells), and its slot there.
    pub(crate) area: Arc<PeerArea>,
    pub(crate) slot: u32,
    /// The id of the connection it came over (the peer device's link to us).
    pub(crate) served: u64,
    /// A region of the peer's for this queue pair only, handed over with the introduction
    /// (by rkey).
    pub(crate) region: Option<(u32, PeerRegion)>,
    /// Answers the introduction with a goodbye if it is dropped without being taken.
    pub(crate) refusal: Refusal,
}

/// The goodbye owed to a peer queue pair whose introduction was not taken: sent when dropped
/// unless disarmed. An introduction refused for any reason (no such queue pair, another peer
/// expected, a reset, a destroyed queue pair that held it) so fails the peer at once, as the
/// connection of its own that closed used to.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) socket: Arc<SeqPacket>,
    /// Our queue pair the introduction named, and the peer queue pair that sent it.
    pub(crate) qpn: u32,
    pub(crate) from_qpn: u32,
    pub(crate) armed: bool,
}

impl Drop for Refusal {
    fn drop(&mut self) {
        if self.armed {
            let goodbye = Message::Goodbye { from_qpn: self.qpn, to_qpn: self.from_qpn };
            if send_patiently(&self.socket, goodbye, &[], GOODBYE_PATIENCE).is_err() {
                let _ = rustix::net::shutdown(self.socket.as_fd(), rustix::net::Shutdown::Both);
            }
        }
    }
}

/// What we know of an attached peer.
#[derive(Debug)]
pub(crate) struct PeerSide {
    pub(crate) segment: PeerSegment,
    pub(crate) consumer: Consumer,
    pub(crate) waiter: PeerWaiter,
    pub(crate) area: Arc<PeerArea>,
    pub(crate) slot: u32,
    /// The id of the connection its introduction came over.
    pub(crate) served: u64,
    /// Shared so that a direct write can copy into one after the device lock is released.
    /// Looked up on every WRITE and READ, hence the cheap integer hash.
    pub(crate) regions: IdMap<std::sync::Arc<PeerRegion>>,
}

impl PeerSide {
    /// Tells the peer's device its queue pair has news (after publishing it), ringing the
    /// doorbell if the device sleeps and no one rang for this sleep yet, or rather the queue
    /// pair's own doorbell if a thread waits for it alone and the news is for it (`arrival`:
    /// records, a NAK or a state change; else only acknowledgements or freed ring space); never
    /// both (see `PeerArea::notify`).
    pub(crate) fn signal(&self, arrival: bool) {
        self.area.notify(self.slot, &self.waiter, arrival);
    }
}

/// How a queue pair going to RTR asks its peer to tell its waiter of news.
#[derive(Clone, Copy, Debug)]
pub(crate) enum IntroWaiter<'a> {
    /// Nobody waits for it alone (the device is rung if it sleeps).
    Device,
    /// Through this eventfd, the queue pair's own doorbell.
    Own(BorrowedFd<'a>),
    /// Through the device's task doorbell (its waiter is a task).
    Task,
}

/// What a queue pair going to RTR introduces itself with.
pub(crate) struct Introduction<'a> {
    pub(crate) qpn: u32,
    /// Its slot in our device's activity area.
    pub(crate) slot: u32,
    /// The peer device's GID and queue pair.
    pub(crate) dgid: Gid,
    pub(crate) dqpn: u32,
    pub(crate) status: PeerStatus,
    /// How the queue pair's waiter hears of news.
    pub(crate) waiter: IntroWaiter<'a>,
    /// A region of its protection domain for this peer only.
    pub(crate) offer: Option<&'a (RegionOffer, Memfd)>,
}

/// One queue pair's connection.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) outbox: OwnSegment,
    pub(crate) producer: Producer,
    /// Our device's link to the peer's device (shared with our other queue pairs there).
    pub(crate) client: Arc<DeviceLink>,
    pub(crate) peer: Option<PeerSide>,
    /// Our queue pair and the peer's, for the goodbye.
    qpn: u32,
    dqpn: u32,
    rpc_timeout: Duration,
}

impl Drop for Link {
    /// Tells the peer's queue pair this one is gone (destroyed, reset or failed).
    fn drop(&mut self) {
        let goodbye = Message::Goodbye { from_qpn: self.qpn, to_qpn: self.dqpn };
        let _ = self.client.send(goodbye, &[], GOODBYE_PATIENCE);
    }
}

impl Link {
    /// Creates our segment and introduces queue pair `intro.qpn` to the device with GID
    /// `intro.dgid`, asking for its queue pair `intro.dqpn`. Fails if no such device is
    /// reachable.
    ///
    /// `intro.status` (the queue pair's status once in RTR) is published before the
    /// introduction is sent: the peer may attach and carry out requests the moment it reads the
    /// introduction, and would fail them against a segment that does not say RTR yet.
    pub(crate) fn establish(intro: Introduction<'_>, ctx: &DeviceContext) -> Result<Self> {
        let Introduction { qpn, slot, dgid, dqpn, status, waiter, offer } = intro;
        let config = &ctx.config;
        let (outbox, outbox_memfd) = OwnSegment::create(config.ring_bytes, config.max_fragment)?;
        outbox.publish_status(status);
        let producer = Producer::new(config.ring_bytes, config.max_fragment)
            .ok_or(Error::InvalidAttribute("ring size"))?;
        let hello = |device: bool| Message::Hello {
            from_gid: ctx.gid,
            from_qpn: qpn,
            to_qpn: dqpn,
            slot,
            waiter: match waiter {
                IntroWaiter::Device => WaiterKind::Device,
                IntroWaiter::Own(_) => WaiterKind::Own,
                IntroWaiter::Task => WaiterKind::Task,
            },
            device,
            region: offer.map(|(offer, _)| *offer),
        };
        let device_fds = [ctx.doorbell.as_fd(), ctx.activity.memfd().as_fd(), ctx.task_doorbell.as_fd()];
        let mut rest = Vec::with_capacity(2);
        if let IntroWaiter::Own(fd) = waiter {
            rest.push(fd);
        }
        rest.extend(offer.map(|(_, memfd)| memfd.as_fd()));
        let segment = outbox_memfd.as_fd();
        let (mut client, fresh) = ctx.links.get_or_connect(dgid, ctx)?;
        if let Err(err) = client.introduce(hello, segment, device_fds, &rest, config.rpc_timeout) {
            // A link that served earlier queue pairs may have died since (its device closed,
            // or it broke): one fresh try tells which.
            if fresh {
                return Err(unreachable(dgid, &err));
            }
            client = ctx.links.get_or_connect(dgid, ctx)?.0;
            client
                .introduce(hello, segment, device_fds, &rest, config.rpc_timeout)
                .map_err(|err| unreachable(dgid, &err))?;
        }
        // In flight, the message holds the file; the peer maps it, and so do we already.
        drop(outbox_memfd);
        Ok(Self { outbox, producer, client, peer: None, qpn, dqpn, rpc_timeout: config.rpc_timeout })
    }

    /// Starts reading the peer's segment; false (and the introduction refused) if its ring
    /// is unusable.
    pub(crate) fn attach(&mut self, mut attach: PeerAttach) -> bool {
        let Some(consumer) = Consumer::new(attach.segment.capacity(), attach.segment.max_payload()) else {
            return false;
        };
        attach.refusal.armed = false;
        let mut regions = IdMap::default();
        if let Some((rkey, region)) = attach.region {
            regions.insert(rkey, Arc::new(region));
        }
        self.peer = Some(PeerSide {
            segment: attach.segment,
            consumer,
            waiter: attach.waiter,
            area: attach.area,
            slot: attach.slot,
            served: attach.served,
            regions,
        });
        true
    }

    /// The peer's region with remote key `rkey` as seen by its queue pair `dqpn`: from the
    /// cache if still registered, else asked for over the link. `Ok(None)` if the peer has no
    /// such region for that queue pair.
    pub(crate) fn peer_region(
        &mut self,
        rkey: u32,
        dqpn: u32,
    ) -> std::result::Result<Option<&std::sync::Arc<PeerRegion>>, LinkFailure> {
        let peer = self.peer.as_mut().ok_or(LinkFailure::PeerGone)?;
        let cached = peer.regions.get(&rkey).map(|region| region.is_valid());
        if cached == Some(false) {
            peer.regions.remove(&rkey);
        }
        if cached != Some(true) {
            let Some(region) = query_region(&self.client, rkey, dqpn, self.rpc_timeout)? else {
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

fn unreachable(dgid: Gid, err: &std::io::Error) -> Error {
    Error::Unavailable(format!("the shm device with GID {dgid} did not take the introduction ({err})"))
}

/// Asks the peer's device about region `rkey` and waits for the answer (the socket thread
/// reads it and hands it over).
fn query_region(
    link: &DeviceLink,
    rkey: u32,
    dqpn: u32,
    timeout: Duration,
) -> std::result::Result<Option<PeerRegion>, LinkFailure> {
    let tag = link.next_tag.fetch_add(1, Ordering::Relaxed);
    let deadline = Instant::now() + timeout;
    let replies = &link.guard.replies;
    replies.expect(tag);
    if link.send(Message::RegionQuery { tag, qpn: dqpn, rkey }, &[], timeout).is_err() {
        replies.forget(tag);
        return Err(LinkFailure::PeerGone);
    }
    let reply = replies.wait(tag, deadline).map_err(|_| LinkFailure::PeerGone)?;
    let Message::RegionReply { found, addr, len, access, .. } = reply.message else {
        return Err(LinkFailure::PeerCorrupt);
    };
    if !found {
        return Ok(None);
    }
    let access = AccessFlags::from_raw(access).ok_or(LinkFailure::PeerCorrupt)?;
    let mut fds = reply.fds.into_iter();
    let (Some(fd), None) = (fds.next(), fds.next()) else { return Err(LinkFailure::PeerCorrupt) };
    let (_, file_len) = region::layout(len).ok_or(LinkFailure::PeerCorrupt)?;
    let memfd = Memfd::from_peer(fd, file_len).map_err(|_| LinkFailure::PeerCorrupt)?;
    PeerRegion::map(memfd, rkey, addr, len, access).map(Some).map_err(|_| LinkFailure::PeerCorrupt)
}

#[cfg(test)]
mod tests {
    use lightpath_verbs::QpState;

    use super::*;
    use crate::activity::area::OwnArea;
    use crate::config::ShmConfig;
    use crate::registry::SocketRegistry;
    use crate::segment::RING_OFFSET;
    use crate::sys::EventFd;
    use crate::sys::Listener;
    use crate::wire::MAX_MESSAGE;

    fn context() -> DeviceContext {
        DeviceContext {
            gid: crate::address::random_gid().expect("gid"),
            uid: rustix::process::getuid().as_raw(),
            config: ShmConfig { ring_bytes: 4096, max_fragment: 512, ..ShmConfig::default() },
            doorbell: EventFd::new(false).expect("eventfd"),
            task_doorbell: EventFd::new(false).expect("eventfd"),
            activity: Arc::new(OwnArea::create(64).expect("activity area")),
            registry: Arc::new(SocketRegistry::new().expect("registry")),
            links: Links::default(),
        }
    }

    /// Introduces queue pair `qpn` (slot `slot`) of `ctx`'s device to queue pair `dqpn` of the
    /// device with GID `peer_gid`, as RTR does.
    fn introduce(ctx: &DeviceContext, peer_gid: Gid, qpn: u32, slot: u32, dqpn: u32) -> (Link, PeerStatus) {
        let status = PeerStatus { state: QpState::Rtr, access: AccessFlags::REMOTE_WRITE, rnr_retry: 3 };
        let intro = Introduction {
            qpn,
            slot,
            dgid: peer_gid,
            dqpn,
            status,
            waiter: IntroWaiter::Device,
            offer: None,
        };
        (Link::establish(intro, ctx).expect("establish"), status)
    }

    /// The introduction `introduce` sends: no own doorbell, no region.
    fn plain_hello(ctx: &DeviceContext, from_qpn: u32, to_qpn: u32, slot: u32, device: bool) -> Message {
        Message::Hello {
            from_gid: ctx.gid,
            from_qpn,
            to_qpn,
            slot,
            waiter: WaiterKind::Device,
            device,
            region: None,
        }
    }

    fn next_message(socket: &SeqPacket) -> (Option<Message>, usize) {
        let mut buf = [0u8; MAX_MESSAGE];
        let mut ready = [PollFd::new(socket, PollFlags::IN)];
        poll_fds(&mut ready, Some(Duration::from_secs(5))).expect("poll");
        let received = socket.recv(&mut buf).expect("recv").expect("a message");
        (Message::decode(&buf[..received.len]), received.fds.len())
    }

    /// The segment handed over with the introduction already says RTR: a peer that attaches
    /// the moment it reads the introduction (before `modify` returns) sees a queue pair ready to
    /// receive, not an unpublished status that fails its requests.
    #[test]
    fn the_introduced_segment_already_says_rtr() {
        let peer_gid = crate::address::random_gid().expect("gid");
        let listener = Listener::bind_abstract(&rendezvous_name(peer_gid)).expect("listener");
        let ctx = context();
        let (link, status) = introduce(&ctx, peer_gid, 7, 5, 9);

        let served = listener.accept().expect("accept").expect("a connection");
        let mut buf = [0u8; MAX_MESSAGE];
        let hello = served.recv(&mut buf).expect("recv").expect("the introduction");
        assert_eq!(Message::decode(&buf[..hello.len]), Some(plain_hello(&ctx, 7, 9, 5, true)));
        assert_eq!(hello.fds.len(), 4, "segment, doorbell, activity area and task doorbell");
        let segment_fd = hello.fds.into_iter().next().expect("the segment");
        let memfd = Memfd::from_peer(segment_fd, RING_OFFSET as u64).expect("memfd");
        let segment = PeerSegment::from_memfd(&memfd, ShmConfig::MAX_RING).expect("segment");
        assert_eq!(segment.status_line().status, Some(status));
        drop(link);
    }

    /// Queue pairs linked with one peer device share one connection; each one that goes says
    /// goodbye on it, and the connection closes with the last.
    #[test]
    fn queue_pairs_towards_one_device_share_a_connection_and_say_goodbye() {
        let peer_gid = crate::address::random_gid().expect("gid");
        let listener = Listener::bind_abstract(&rendezvous_name(peer_gid)).expect("listener");
        let ctx = context();
        let (first, _) = introduce(&ctx, peer_gid, 7, 5, 9);
        let (second, _) = introduce(&ctx, peer_gid, 8, 6, 10);
        assert_eq!(first.client.id(), second.client.id(), "two links to one device");

        let served = listener.accept().expect("accept").expect("a connection");
        assert!(listener.accept().expect("accept").is_none(), "a second connection was opened");
        // The device's descriptors go with the link's first introduction only.
        assert_eq!(next_message(&served), (Some(plain_hello(&ctx, 7, 9, 5, true)), 4));
        assert_eq!(next_message(&served), (Some(plain_hello(&ctx, 8, 10, 6, false)), 1));
        drop(first);
        assert_eq!(next_message(&served), (Some(Message::Goodbye { from_qpn: 7, to_qpn: 9 }), 0));
        drop(second);
        assert_eq!(next_message(&served), (Some(Message::Goodbye { from_qpn: 8, to_qpn: 10 }), 0));
        let mut buf = [0u8; MAX_MESSAGE];
        let mut ready = [PollFd::new(&served, PollFlags::IN)];
        poll_fds(&mut ready, Some(Duration::from_secs(5))).expect("poll");
        assert_eq!(served.recv(&mut buf).expect("recv").expect("end").len, 0, "the link stayed open");
    }
}
