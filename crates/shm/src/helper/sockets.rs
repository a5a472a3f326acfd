//! The socket thread: everything a device does on its sockets.
//!
//! It accepts connections on the rendezvous socket and reads their first message (a probe, or
//! the introduction that makes the connection a peer device's link to us), then reads every
//! link: on peers' links to us, introductions, goodbyes and questions about memory regions
//! (answered from the device's exports); on our links to peers, the answers to our questions
//! (handed to whoever asked) and goodbyes. A hang-up on any link is how a crashed or closed
//! peer is noticed within microseconds. What it learns (an introduction, a goodbye, a hang-up)
//! it posts to the mailbox and then rings the driver thread's bell. It never takes the engine
//! lock and never waits for another device (beyond [`REPLY_PATIENCE`] for room to answer in a
//! peer's full socket), so a question to this device is answered whatever this device's driver
//! thread, or its application, is blocked on (see the [module docs](super)).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use crate::activity::area::{PeerArea, PeerWaiter};
use crate::config::ShmConfig;
use crate::device::DeviceShared;
use crate::engine::{send_patiently, Event, PeerAttach, Refusal};
use crate::region::PeerRegion;
use crate::registry::{Changes, Reply, Watched};
use crate::segment::{PeerSegment, RING_OFFSET};
use crate::sys::{poll_fds, Epoll, EventFd, Memfd, SeqPacket};
use crate::wire::{Message, WaiterKind, MAX_MESSAGE};

/// Connections that have not introduced themselves yet, at most.
const MAX_PENDING: usize = 256;
/// How long a new connection may take to introduce itself.
const HELLO_PATIENCE: Duration = Duration::from_secs(5);
/// How long an answer may wait for room in a peer's connection (its socket thread reads all
/// the time); a peer that does not take it in that time loses the link.
const REPLY_PATIENCE: Duration = Duration::from_millis(50);
/// Most (our queue pair, peer queue pair) introductions one peer link may have standing: more
/// queue pairs than a device has.
const MAX_PAIRS_PER_LINK: usize = 1 << 20;
/// How long to wait before trying again to set the thread up (its epoll instance) after the
/// system refused, e.g. for want of descriptors.
const SETUP_RETRY: Duration = Duration::from_millis(10);

/// What an epoll token stands for. The top two bits say which kind of descriptor it is; the
/// rest is the newcomer's sequence number or the id of a link (ours or a peer's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Token {
    Stop,
    Changed,
    Listener,
    Newcomer(u64),
    /// Our link to a peer device (registered by the queue pairs that use it).
    Watched(u64),
    /// A peer device's link to us.
    Served(u64),
}

impl Token {
    const KIND_SHIFT: u32 = 62;
    const ID_MASK: u64 = (1 << Self::KIND_SHIFT) - 1;

    fn encode(self) -> u64 {
        let (kind, id) = match self {
            Token::Stop => (0, 0),
            Token::Changed => (0, 1),
            Token::Listener => (0, 2),
            Token::Newcomer(seq) => (1, seq),
            Token::Watched(id) => (2, id),
            Token::Served(id) => (3, id),
        };
        (kind << Self::KIND_SHIFT) | (id & Self::ID_MASK)
    }

    fn decode(token: u64) -> Option<Self> {
        let id = token & Self::ID_MASK;
        match (token >> Self::KIND_SHIFT, id) {
            (0, 0) => Some(Token::Stop),
            (0, 1) => Some(Token::Changed),
            (0, 2) => Some(Token::Listener),
            (1, _) => Some(Token::Newcomer(id)),
            (2, _) => Some(Token::Watched(id)),
            (3, _) => Some(Token::Served(id)),
            _ => None,
        }
    }
}

/// A connection waiting for its first message.
struct Newcomer {
    socket: SeqPacket,
    since: Instant,
}

/// A peer device's link to us, and the introductions that came over it and stand: (our queue
/// pair, the peer's). A question about a region is answered only for a queue pair of ours some
/// peer queue pair on this link introduced itself to.
struct ServedLink {
    socket: Arc<SeqPacket>,
    /// The peer device's activity area and doorbells, from the link's first introduction.
    area: Arc<PeerArea>,
    pairs: HashMap<u32, HashSet<u32>>,
    pair_count: usize,
}

/// The thread's state between rounds.
///
/// Every descriptor it waits on is registered with `epoll` once, when it appears, and removed
/// when it goes, so a round costs what is ready rather than what is open: with one socket per
/// connection, setting up or tearing down N connections used to cost N² descriptor scans.
struct SocketThread<'a> {
    shared: &'a DeviceShared,
    epoll: Epoll,
    /// Newcomers by sequence number: accepted in order, so the first is the oldest.
    newcomers: BTreeMap<u64, Newcomer>,
    next_newcomer: u64,
    /// Every socket the registry has handed over and not yet taken back, by id. The thread's
    /// copy keeps the descriptor open (and so its `epoll` registration valid) until then.
    watched: HashMap<u64, Watched>,
    /// Sockets already reported closed (no longer in `epoll`: a hang-up stays readable).
    closed: HashSet<u64>,
    /// Peer devices' links to us, by id (from the registry's counter, so ids never collide
    /// with our own links').
    served: HashMap<u64, ServedLink>,
    /// The registry's changes being applied; empty between rounds, kept for its buffers.
    changes: Changes,
}

/// The thread body; returns when the device's stop fd is signalled.
pub(super) fn run(shared: &DeviceShared) {
    let mut thread = loop {
        match SocketThread::new(shared) {
            Ok(thread) => break thread,
            Err(_) => {
                // Without its epoll instance the thread can do nothing but wait to be stopped.
                let mut stop = [PollFd::new(&shared.stop, PollFlags::IN)];
                if poll_fds(&mut stop, Some(SETUP_RETRY)).is_ok_and(|ready| ready > 0) {
                    return;
                }
            }
        }
    };
    while thread.round() {}
}

impl<'a> SocketThread<'a> {
    fn new(shared: &'a DeviceShared) -> std::io::Result<Self> {
        let epoll = Epoll::new()?;
        epoll.add(&shared.stop, Token::Stop.encode())?;
        epoll.add(&shared.ctx.registry.changed, Token::Changed.encode())?;
        epoll.add(&shared.listener, Token::Listener.encode())?;
        let mut thread = Self {
            shared,
            epoll,
            newcomers: BTreeMap::new(),
            next_newcomer: 0,
            watched: HashMap::new(),
            closed: HashSet::new(),
            served: HashMap::new(),
            changes: Changes::default(),
        };
        thread.apply_registry_changes();
        Ok(thread)
    }

    fn config(&self) -> &ShmConfig {
        &self.shared.ctx.config
    }

    /// Until the oldest newcomer runs out of patience; forever without newcomers.
    fn timeout(&self) -> Option<Duration> {
        let (_, oldest) = self.newcomers.first_key_value()?;
        Some((oldest.since + HELLO_PATIENCE).saturating_duration_since(Instant::now()))
    }

    /// The tokens of the descriptors that are ready (none after a timeout).
    fn wait(&mut self) -> Vec<Token> {
        let timeout = self.timeout();
        match self.epoll.wait(timeout) {
            Ok(tokens) => tokens.into_iter().filter_map(Token::decode).collect(),
            Err(_) => {
                // Only EINVAL/ENOMEM are possible here; back off instead of spinning.
                std::thread::sleep(Duration::from_millis(1));
                Vec::new()
            }
        }
    }

    /// One round: wait, then answer, accept and report what happened. Returns false to stop.
    fn round(&mut self) -> bool {
        let ready = self.wait();
        if ready.contains(&Token::Stop) {
            return false;
        }
        let (mut changed, mut listener) = (false, false);
        let mut introduced = Vec::new();
        for token in ready {
            match token {
                Token::Stop => {}
                Token::Changed => changed = true,
                Token::Listener => listener = true,
                Token::Newcomer(seq) => introduced.push(seq),
                Token::Watched(id) => self.watched_ready(id),
                Token::Served(id) => self.served_ready(id),
            }
        }
        if changed {
            self.apply_registry_changes();
        }
        for seq in introduced {
            if let Some(newcomer) = self.newcomers.remove(&seq) {
                self.epoll.remove(&newcomer.socket);
                // Introduced (or failed to): either way it leaves the list.
                self.introduce(newcomer.socket);
            }
        }
        self.drop_impatient_newcomers(Instant::now());
        if listener {
            self.accept();
        }
        true
    }

    /// Reads what arrived on one of our links, or reports it closed.
    fn watched_ready(&mut self, id: u64) {
        let Some(watched) = self.watched.get(&id) else { return };
        if self.closed.contains(&id) {
            return;
        }
        if !read_own_link(self.shared, watched) {
            self.epoll.remove(&*watched.socket);
            self.closed.insert(id);
            watched.replies.close();
            self.shared.post_event(Event::SocketClosed(id));
        }
    }

    /// Serves what arrived on a peer's link to us, or closes it (which the peer sees).
    fn served_ready(&mut self, id: u64) {
        let Some(link) = self.served.get_mut(&id) else { return };
        if !serve(self.shared, link, id) {
            self.epoll.remove(&*link.socket);
            self.served.remove(&id);
            self.shared.post_event(Event::SocketClosed(id));
        }
    }

    /// Handles the first message of a new connection: a probe, or a queue pair's
    /// introduction, which makes the connection a peer device's link to us.
    fn introduce(&mut self, socket: SeqPacket) {
        let mut buf = [0u8; MAX_MESSAGE];
        let Ok(Some(received)) = socket.recv(&mut buf) else { return };
        match Message::decode(&buf[..received.len]) {
            Some(Message::Ping { tag }) => {
                let _ = send_patiently(&socket, Message::Pong { tag }, &[], REPLY_PATIENCE);
            }
            Some(hello @ Message::Hello { .. }) => {
                let id = self.shared.ctx.registry.allocate_id();
                let socket = Arc::new(socket);
                let Some(attach) = accept_hello(self.shared, &socket, id, received.fds, hello, None) else {
                    return;
                };
                // A link whose hang-up could go unnoticed is not taken (the introduction
                // dropped here says goodbye).
                if self.epoll.add(&*socket, Token::Served(id).encode()).is_err() {
                    return;
                }
                let area = Arc::clone(&attach.area);
                let mut link = ServedLink { socket, area, pairs: HashMap::new(), pair_count: 0 };
                link.add_pair(attach.qpn, attach.from_qpn);
                self.served.insert(id, link);
                self.shared.post_event(Event::Attach(attach));
            }
            _ => {}
        }
    }

    /// Takes the registry's changes since the last look: sockets whose owners let go leave
    /// `epoll` (before the thread drops its copy, so a registration never outlives the
    /// descriptor it names), new sockets join it. Costs what changed, not what is watched.
    fn apply_registry_changes(&mut self) {
        let registry = &self.shared.ctx.registry;
        // Reset the bell before taking, so a change made after the take rings it again.
        registry.changed.take();
        registry.take_changes(&mut self.changes);
        for id in self.changes.removed.drain(..) {
            let Some(watched) = self.watched.remove(&id) else { continue };
            // A socket already reported closed left `epoll` then.
            if !self.closed.remove(&id) {
                self.epoll.remove(&*watched.socket);
            }
        }
        for watched in self.changes.added.drain(..) {
            let id = watched.id;
            if self.epoll.add(&*watched.socket, Token::Watched(id).encode()).is_err() {
                // A connection whose hang-up could go unnoticed is given up now, loudly.
                self.closed.insert(id);
                watched.replies.close();
                self.shared.post_event(Event::SocketClosed(id));
            }
            self.watched.insert(id, watched);
        }
    }

    /// Forgets newcomers that did not introduce themselves in time (the oldest come first).
    fn drop_impatient_newcomers(&mut self, now: Instant) {
        while let Some(entry) = self.newcomers.first_entry() {
            if now.duration_since(entry.get().since) < HELLO_PATIENCE {
                return;
            }
            let newcomer = entry.remove();
            self.epoll.remove(&newcomer.socket);
        }
    }

    fn accept(&mut self) {
        while self.newcomers.len() < MAX_PENDING {
            match self.shared.listener.accept() {
                Ok(Some(socket)) => {
                    let allowed = self.config().allow_other_users
                        || socket.peer_uid().is_ok_and(|uid| uid == self.shared.ctx.uid);
                    if !allowed {
                        continue;
                    }
                    let seq = self.next_newcomer;
                    self.next_newcomer += 1;
                    // A newcomer that cannot be watched is dropped, as one over the limit is.
                    if self.epoll.add(&socket, Token::Newcomer(seq).encode()).is_ok() {
                        self.newcomers.insert(seq, Newcomer { socket, since: Instant::now() });
                    }
                }
                Ok(None) | Err(_) => return,
            }
        }
    }
}

impl ServedLink {
    /// Records a standing introduction; false if the link has too many.
    fn add_pair(&mut self, qpn: u32, from_qpn: u32) -> bool {
        if self.pair_count >= MAX_PAIRS_PER_LINK {
            return false;
        }
        if self.pairs.entry(qpn).or_default().insert(from_qpn) {
            self.pair_count += 1;
        }
        true
    }

    fn remove_pair(&mut self, qpn: u32, from_qpn: u32) {
        let Some(peers) = self.pairs.get_mut(&qpn) else { return };
        if peers.remove(&from_qpn) {
            self.pair_count -= 1;
        }
        if peers.is_empty() {
            self.pairs.remove(&qpn);
        }
    }
}

/// Serves what a peer device sent on its link to us (link `id`); false if the link is closed
/// or misbehaved.
fn serve(shared: &DeviceShared, link: &mut ServedLink, id: u64) -> bool {
    for _ in 0..64 {
        let mut buf = [0u8; MAX_MESSAGE];
        let received = match link.socket.recv(&mut buf) {
            Ok(Some(received)) if received.len > 0 => received,
            Ok(None) => return true,
            _ => return false,
        };
        let message = Message::decode(&buf[..received.len]);
        if let Some(hello @ Message::Hello { .. }) = message {
            let known = Some(&link.area);
            let Some(attach) = accept_hello(shared, &link.socket, id, received.fds, hello, known) else {
                return false;
            };
            link.area = Arc::clone(&attach.area);
            if !link.add_pair(attach.qpn, attach.from_qpn) {
                return false;
            }
            shared.post_event(Event::Attach(attach));
            continue;
        }
        if !received.fds.is_empty() {
            return false;
        }
        let keep = match message {
            Some(Message::RegionQuery { tag, qpn, rkey }) => {
                let introduced = link.pairs.contains_key(&qpn);
                answer_region(shared, &link.socket, tag, qpn, rkey, introduced)
            }
            Some(Message::Ping { tag }) => send(&link.socket, Message::Pong { tag }, &[]),
            Some(Message::Goodbye { from_qpn, to_qpn }) => {
                link.remove_pair(to_qpn, from_qpn);
                shared.post_event(Event::PeerLeft { link: id, qpn: to_qpn, from_qpn });
                true
            }
            _ => false,
        };
        if !keep {
            return false;
        }
    }
    true
}

/// Reads what a peer device sent on our link to it: answers to our questions (handed to the
/// asker) and goodbyes; false if the link is closed or misbehaved.
fn read_own_link(shared: &DeviceShared, watched: &Watched) -> bool {
    for _ in 0..64 {
        let mut buf = [0u8; MAX_MESSAGE];
        let received = match watched.socket.recv(&mut buf) {
            Ok(Some(received)) if received.len > 0 => received,
            Ok(None) => return true,
            _ => return false,
        };
        match Message::decode(&buf[..received.len]) {
            Some(message @ Message::RegionReply { tag, .. }) => {
                // An answer nobody waits for any more (its asker gave up) is dropped.
                watched.replies.deliver(tag, Reply { message, fds: received.fds });
            }
            Some(Message::Pong { .. }) if received.fds.is_empty() => {}
            Some(Message::Goodbye { from_qpn, to_qpn }) if received.fds.is_empty() => {
                shared.post_event(Event::PeerLeft { link: watched.id, qpn: to_qpn, from_qpn });
            }
            _ => return false,
        }
    }
    true
}

fn send(socket: &SeqPacket, message: Message, fds: &[std::os::fd::BorrowedFd<'_>]) -> bool {
    send_patiently(socket, message, fds, REPLY_PATIENCE).is_ok()
}

/// Describes region `rkey` if it belongs to the protection domain of queue pair `qpn`, which
/// must have been `introduced` to the asker. A region shared with its first peer only is
/// described once: its memfd goes with that answer and is not kept.
fn answer_region(
    shared: &DeviceShared,
    socket: &SeqPacket,
    tag: u32,
    qpn: u32,
    rkey: u32,
    introduced: bool,
) -> bool {
    let mut exports = shared.lock_exports();
    let pd = exports.qp_pds.get(&qpn).copied();
    let region = exports
        .regions
        .get_mut(&rkey)
        .filter(|region| introduced && pd == Some(region.pd) && region.memfd.is_some());
    let Some(region) = region else {
        drop(exports);
        return send(socket, Message::RegionReply { tag, found: false, addr: 0, len: 0, access: 0 }, &[]);
    };
    let reply = Message::RegionReply {
        tag,
        found: true,
        addr: region.addr,
        len: region.len,
        access: region.access.bits(),
    };
    let (taken, pd) = (if region.first_peer_only { region.memfd.take() } else { None }, region.pd);
    if taken.is_some() && exports.offers.get(&pd) == Some(&rkey) {
        exports.offers.remove(&pd);
    }
    let Some(region) = exports.regions.get(&rkey) else { return false };
    match taken.as_ref().or(region.memfd.as_ref()) {
        Some(memfd) => send(socket, reply, &[memfd.as_fd()]),
        None => false,
    }
}

/// Checks an introduction's descriptors: a sealed memfd holding a valid segment; with the
/// device flag (always on a link's first introduction, `known` being `None`) an eventfd
/// doorbell, a sealed memfd holding a valid activity area and an eventfd task doorbell (else
/// the link's `known` area); the queue pair's slot in that area; then as its flags say the queue pair's own doorbell (an eventfd) and a region for our queue pair
/// alone (a memfd that maps as the region it is described as), and nothing more.
fn accept_hello(
    shared: &DeviceShared,
    socket: &Arc<SeqPacket>,
    link: u64,
    fds: Vec<OwnedFd>,
    hello: Message,
    known: Option<&Arc<PeerArea>>,
) -> Option<PeerAttach> {
    let Message::Hello { from_gid, from_qpn, to_qpn, slot, waiter, device, region } = hello else {
        return None;
    };
    let mut fds = fds.into_iter();
    let segment_fd = fds.next()?;
    let device_fds = match device {
        true => Some((fds.next()?, fds.next()?, fds.next()?)),
        false => None,
    };
    let waiter_fd = if waiter == WaiterKind::Own { Some(fds.next()?) } else { None };
    let region_fd = if region.is_some() { Some(fds.next()?) } else { None };
    if fds.next().is_some() {
        return None;
    }
    let min_len = (RING_OFFSET + crate::ring::MIN_CAPACITY) as u64;
    let memfd = Memfd::from_peer(segment_fd, min_len).ok()?;
    let segment = PeerSegment::from_memfd(&memfd, ShmConfig::MAX_RING).ok()?;
    let waiter = match (waiter, waiter_fd) {
        (WaiterKind::Own, Some(fd)) => PeerWaiter::Own(EventFd::from_peer(fd).ok()?),
        (WaiterKind::Task, _) => PeerWaiter::Task,
        _ => PeerWaiter::Device,
    };
    let area = match (device_fds, known) {
        (Some((doorbell_fd, area_fd, task_doorbell_fd)), _) => {
            let doorbell = EventFd::from_peer(doorbell_fd).ok()?;
            let task_doorbell = EventFd::from_peer(task_doorbell_fd).ok()?;
            shared.peer_areas.get(&Memfd::from_peer(area_fd, 1).ok()?, doorbell, task_doorbell).ok()?
        }
        (None, Some(known)) => Arc::clone(known),
        (None, None) => return None,
    };
    if !area.has_slot(slot) {
        return None;
    }
    let region = match (region, region_fd) {
        (Some(offer), Some(fd)) => {
            let access = lightpath_verbs::AccessFlags::from_raw(offer.access)?;
            let (_, file_len) = crate::region::layout(offer.len)?;
            let memfd = Memfd::from_peer(fd, file_len).ok()?;
            let mapped = PeerRegion::map(memfd, offer.rkey, offer.addr, offer.len, access).ok()?;
            Some((offer.rkey, mapped))
        }
        _ => None,
    };
    let refusal = Refusal { socket: Arc::clone(socket), qpn: to_qpn, from_qpn, armed: true };
    Some(PeerAttach {
        qpn: to_qpn,
        from_gid,
        from_qpn,
        segment,
        waiter,
        area,
        slot,
        served: link,
        region,
        refusal,
    })
}

#[cfg(test)]
mod tests {
    use super::Token;

    #[test]
    fn tokens_round_trip_and_kinds_never_collide() {
        let tokens = [
            Token::Stop,
            Token::Changed,
            Token::Listener,
            Token::Newcomer(0),
            Token::Newcomer(2),
            Token::Watched(0),
            Token::Watched(2),
            Token::Watched(Token::ID_MASK),
            Token::Served(0),
            Token::Served(2),
            Token::Served(Token::ID_MASK),
        ];
        for token in tokens {
            assert_eq!(Token::decode(token.encode()), Some(token));
        }
        let mut encoded: Vec<u64> = tokens.iter().map(|t| t.encode()).collect();
        encoded.sort_unstable();
        encoded.dedup();
        assert_eq!(encoded.len(), tokens.len());
        assert_eq!(Token::decode(3), None, "an unknown fixed token");
    }
}
