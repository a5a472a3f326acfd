//! The socket thread: everything a device does on its sockets.
//!
//! It accepts connections on the rendezvous socket and reads their introductions (or probes),
//! answers peers' questions about memory regions from the device's exports, and watches every
//! registered connection for a hang-up — how a crashed or closed peer is noticed within
//! microseconds. What it learns (an introduction, a hang-up) it posts to the mailbox and then
//! rings the driver thread's bell. It never takes the engine lock and never waits for another
//! device, so a question to this device is answered whatever this device's driver thread, or
//! its application, is blocked on (see the [module docs](super)).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use crate::config::ShmConfig;
use crate::device::DeviceShared;
use crate::engine::{Event, PeerAttach};
use crate::registry::{Changes, SocketRole, Watched};
use crate::segment::{PeerSegment, RING_OFFSET};
use crate::sys::{poll_fds, Epoll, EventFd, Interest, Memfd, SeqPacket};
use crate::wire::{Message, MAX_MESSAGE};

/// Connections that have not introduced themselves yet, at most.
const MAX_PENDING: usize = 256;
/// How long a new connection may take to introduce itself.
const HELLO_PATIENCE: Duration = Duration::from_secs(5);
/// How long to wait before trying again to set the thread up (its epoll instance) after the
/// system refused, e.g. for want of descriptors.
const SETUP_RETRY: Duration = Duration::from_millis(10);

/// What an epoll token stands for. The top two bits say which kind of descriptor it is; the
/// rest is the newcomer's sequence number or the registry's id of a watched socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Token {
    Stop,
    Changed,
    Listener,
    Newcomer(u64),
    Watched(u64),
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
            _ => None,
        }
    }
}

/// A connection waiting for its first message.
struct Newcomer {
    socket: SeqPacket,
    since: Instant,
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
        epoll.add(&shared.stop, Token::Stop.encode(), Interest::Readable)?;
        epoll.add(&shared.ctx.registry.changed, Token::Changed.encode(), Interest::Readable)?;
        epoll.add(&shared.listener, Token::Listener.encode(), Interest::Readable)?;
        let mut thread = Self {
            shared,
            epoll,
            newcomers: BTreeMap::new(),
            next_newcomer: 0,
            watched: HashMap::new(),
            closed: HashSet::new(),
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
            }
        }
        if changed {
            self.apply_registry_changes();
        }
        for seq in introduced {
            if let Some(newcomer) = self.newcomers.remove(&seq) {
                self.epoll.remove(&newcomer.socket);
                // Introduced (or failed to): either way it leaves the list.
                introduce(self.shared, newcomer.socket);
            }
        }
        self.drop_impatient_newcomers(Instant::now());
        if listener {
            self.accept();
        }
        true
    }

    /// Serves a ready watched socket, or reports it closed.
    fn watched_ready(&mut self, id: u64) {
        let Some(watched) = self.watched.get(&id) else { return };
        if self.closed.contains(&id) {
            return;
        }
        let keep = match watched.role {
            SocketRole::Served { qpn } => serve(self.shared, &watched.socket, qpn),
            SocketRole::Client => false,
        };
        if !keep {
            self.epoll.remove(&*watched.socket);
            self.closed.insert(id);
            self.shared.post_event(Event::SocketClosed(id));
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
            // Our own connections only ever need hang-ups (replies are read by the caller that
            // asked); peers' connections bring questions.
            let interest = match watched.role {
                SocketRole::Client => Interest::HangUp,
                SocketRole::Served { .. } => Interest::Readable,
            };
            if self.epoll.add(&*watched.socket, Token::Watched(id).encode(), interest).is_err() {
                // A connection whose hang-up could go unnoticed is given up now, loudly.
                self.closed.insert(id);
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
                    if self.epoll.add(&socket, Token::Newcomer(seq).encode(), Interest::Readable).is_ok() {
                        self.newcomers.insert(seq, Newcomer { socket, since: Instant::now() });
                    }
                }
                Ok(None) | Err(_) => return,
            }
        }
    }
}

/// Answers what a peer's connection sent; false if the connection is closed or misbehaved.
fn serve(shared: &DeviceShared, socket: &SeqPacket, qpn: u32) -> bool {
    for _ in 0..64 {
        let mut buf = [0u8; MAX_MESSAGE];
        let received = match socket.recv(&mut buf) {
            Ok(Some(received)) if received.len > 0 && received.fds.is_empty() => received,
            Ok(None) => return true,
            _ => return false,
        };
        let reply = match Message::decode(&buf[..received.len]) {
            Some(Message::RegionQuery { tag, qpn: asked, rkey }) if asked == qpn => {
                answer_region(shared, socket, tag, qpn, rkey)
            }
            Some(Message::Ping { tag }) => send(socket, Message::Pong { tag }, &[]),
            _ => false,
        };
        if !reply {
            return false;
        }
    }
    true
}

fn send(socket: &SeqPacket, message: Message, fds: &[std::os::fd::BorrowedFd<'_>]) -> bool {
    let (bytes, len) = message.encode();
    socket.send(&bytes[..len], fds).is_ok()
}

/// Describes region `rkey` if it belongs to the protection domain of queue pair `qpn`.
fn answer_region(shared: &DeviceShared, socket: &SeqPacket, tag: u32, qpn: u32, rkey: u32) -> bool {
    let exports = shared.exports_read();
    let region = exports.regions.get(&rkey).filter(|region| exports.qp_pds.get(&qpn) == Some(&region.pd));
    match region {
        Some(region) => {
            let reply = Message::RegionReply {
                tag,
                found: true,
                addr: region.addr,
                len: region.len,
                access: region.access.bits(),
            };
            use std::os::fd::AsFd;
            send(socket, reply, &[region.memfd.as_fd()])
        }
        None => send(socket, Message::RegionReply { tag, found: false, addr: 0, len: 0, access: 0 }, &[]),
    }
}

/// Handles the first message of a new connection: a probe, or a queue pair's introduction.
fn introduce(shared: &DeviceShared, socket: SeqPacket) {
    let mut buf = [0u8; MAX_MESSAGE];
    let Ok(Some(received)) = socket.recv(&mut buf) else { return };
    match Message::decode(&buf[..received.len]) {
        Some(Message::Ping { tag }) => {
            send(&socket, Message::Pong { tag }, &[]);
        }
        Some(hello @ Message::Hello { .. }) => {
            if let Some(attach) = accept_hello(shared, socket, received.fds, hello) {
                shared.post_event(Event::Attach(attach));
            }
        }
        _ => {}
    }
}

/// Checks an introduction's descriptors: a sealed memfd holding a valid segment, an eventfd
/// doorbell, a sealed memfd holding a valid activity area with the queue pair's slot, and
/// optionally the queue pair's own doorbell (an eventfd).
fn accept_hello(
    shared: &DeviceShared,
    socket: SeqPacket,
    fds: Vec<OwnedFd>,
    hello: Message,
) -> Option<PeerAttach> {
    let Message::Hello { from_gid, from_qpn, to_qpn, slot } = hello else { return None };
    let mut fds = fds.into_iter();
    let (Some(segment_fd), Some(doorbell_fd), Some(area_fd), waiter_fd, None) =
        (fds.next(), fds.next(), fds.next(), fds.next(), fds.next())
    else {
        return None;
    };
    let min_len = (RING_OFFSET + crate::ring::MIN_CAPACITY) as u64;
    let memfd = Memfd::from_peer(segment_fd, min_len).ok()?;
    let segment = PeerSegment::from_memfd(&memfd, ShmConfig::MAX_RING).ok()?;
    let doorbell = EventFd::from_peer(doorbell_fd).ok()?;
    let waiter = match waiter_fd {
        Some(fd) => Some(EventFd::from_peer(fd).ok()?),
        None => None,
    };
    let area = shared.peer_areas.get(&Memfd::from_peer(area_fd, 1).ok()?, doorbell).ok()?;
    if !area.has_slot(slot) {
        return None;
    }
    let served = shared.ctx.registry.register(Arc::new(socket), SocketRole::Served { qpn: to_qpn });
    Some(PeerAttach { qpn: to_qpn, from_gid, from_qpn, segment, waiter, area, slot, served })
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
        ];
        for token in tokens {
            assert_eq!(Token::decode(token.encode()), Some(token));
        }
        let mut encoded: Vec<u64> = tokens.iter().map(|t| t.encode()).collect();
        encoded.sort_unstable();
        encoded.dedup();
        assert_eq!(encoded.len(), tokens.len());
        assert_eq!(Token::decode(3 << Token::KIND_SHIFT), None);
        assert_eq!(Token::decode(3), None);
    }
}
