//! The socket thread: everything a device does on its sockets.
//!
//! It accepts connections on the rendezvous socket and reads their introductions (or probes),
//! answers peers' questions about memory regions from the device's exports, and watches every
//! registered connection for a hang-up — how a crashed or closed peer is noticed within
//! microseconds. What it learns (an introduction, a hang-up) it posts to the mailbox and then
//! rings the driver thread's bell. It never takes the engine lock and never waits for another
//! device, so a question to this device is answered whatever this device's driver thread, or
//! its application, is blocked on (see the [module docs](super)).

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use crate::config::ShmConfig;
use crate::device::DeviceShared;
use crate::engine::{Event, PeerAttach};
use crate::registry::{SocketRole, Watched};
use crate::segment::{PeerSegment, RING_OFFSET};
use crate::sys::{poll_fds, EventFd, Memfd, SeqPacket};
use crate::wire::{Message, MAX_MESSAGE};

/// Connections that have not introduced themselves yet, at most.
const MAX_PENDING: usize = 256;
/// How long a new connection may take to introduce itself.
const HELLO_PATIENCE: Duration = Duration::from_secs(5);
/// Descriptors polled before the newcomers and the watched sockets.
const FIXED: usize = 3;

/// A connection waiting for its first message.
struct Newcomer {
    socket: SeqPacket,
    since: Instant,
}

/// The thread's state between rounds.
struct SocketThread<'a> {
    shared: &'a DeviceShared,
    newcomers: Vec<Newcomer>,
    watched: Vec<Watched>,
    /// Sockets already reported closed (not polled again: a hang-up stays readable).
    closed: HashSet<u64>,
}

/// The thread body; returns when the device's stop fd is signalled.
pub(super) fn run(shared: &DeviceShared) {
    let mut thread = SocketThread {
        shared,
        newcomers: Vec::new(),
        watched: shared.ctx.registry.snapshot(),
        closed: HashSet::new(),
    };
    while thread.round() {}
}

/// Which descriptors had events in one `poll`.
struct Ready {
    stop: bool,
    changed: bool,
    listener: bool,
    newcomers: Vec<bool>,
    watched: Vec<PollFlags>,
}

impl SocketThread<'_> {
    fn config(&self) -> &ShmConfig {
        &self.shared.ctx.config
    }

    /// Until the oldest newcomer runs out of patience; forever without newcomers.
    fn timeout(&self) -> Option<Duration> {
        let oldest = self.newcomers.iter().map(|n| n.since).min()?;
        Some((oldest + HELLO_PATIENCE).saturating_duration_since(Instant::now()))
    }

    fn wait(&mut self) -> Ready {
        let timeout = self.timeout();
        let ctx = &self.shared.ctx;
        let mut fds = vec![
            PollFd::new(&self.shared.stop, PollFlags::IN),
            PollFd::new(&ctx.registry.changed, PollFlags::IN),
            PollFd::new(&self.shared.listener, PollFlags::IN),
        ];
        for newcomer in &self.newcomers {
            fds.push(PollFd::new(&newcomer.socket, PollFlags::IN));
        }
        let mut polled = Vec::new();
        for (index, watched) in self.watched.iter().enumerate() {
            if self.closed.contains(&watched.id) {
                continue;
            }
            // Our own connections only ever need hang-ups (replies are read by the caller that
            // asked); peers' connections bring questions.
            let events = match watched.role {
                SocketRole::Client => PollFlags::empty(),
                SocketRole::Served { .. } => PollFlags::IN,
            };
            fds.push(PollFd::new(&*watched.socket, events));
            polled.push(index);
        }
        let mut ready = Ready {
            stop: false,
            changed: false,
            listener: false,
            newcomers: vec![false; self.newcomers.len()],
            watched: vec![PollFlags::empty(); self.watched.len()],
        };
        if poll_fds(&mut fds, timeout).is_err() {
            // Only EINVAL/ENOMEM are possible here; back off instead of spinning.
            std::thread::sleep(Duration::from_millis(1));
            return ready;
        }
        let has = |fd: &PollFd<'_>| !fd.revents().is_empty();
        ready.stop = has(&fds[0]);
        ready.changed = has(&fds[1]);
        ready.listener = has(&fds[2]);
        let newcomer_fds = &fds[FIXED..FIXED + self.newcomers.len()];
        for (flag, fd) in ready.newcomers.iter_mut().zip(newcomer_fds) {
            *flag = has(fd);
        }
        for (fd, &index) in fds[FIXED + self.newcomers.len()..].iter().zip(&polled) {
            ready.watched[index] = fd.revents();
        }
        ready
    }

    /// One round: wait, then answer, accept and report what happened. Returns false to stop.
    fn round(&mut self) -> bool {
        let ready = self.wait();
        if ready.stop {
            return false;
        }
        let ctx = &self.shared.ctx;
        for (index, revents) in ready.watched.iter().enumerate() {
            if revents.is_empty() {
                continue;
            }
            let watched = &self.watched[index];
            let keep = match watched.role {
                SocketRole::Served { qpn } => serve(self.shared, &watched.socket, qpn),
                SocketRole::Client => false,
            };
            if !keep {
                self.closed.insert(watched.id);
                self.shared.post_event(Event::SocketClosed(watched.id));
            }
        }
        if ready.changed {
            ctx.registry.changed.take();
            self.watched = ctx.registry.snapshot();
            let live: HashSet<u64> = self.watched.iter().map(|w| w.id).collect();
            self.closed.retain(|id| live.contains(id));
        }
        let now = Instant::now();
        let newcomers = std::mem::take(&mut self.newcomers);
        for (newcomer, is_ready) in
            newcomers.into_iter().zip(ready.newcomers.into_iter().chain(std::iter::repeat(false)))
        {
            if is_ready {
                // Introduced (or failed to): either way it leaves the list.
                introduce(self.shared, newcomer.socket);
            } else if now.duration_since(newcomer.since) < HELLO_PATIENCE {
                self.newcomers.push(newcomer);
            }
        }
        if ready.listener {
            self.accept();
        }
        true
    }

    fn accept(&mut self) {
        while self.newcomers.len() < MAX_PENDING {
            match self.shared.listener.accept() {
                Ok(Some(socket)) => {
                    let allowed = self.config().allow_other_users
                        || socket.peer_uid().is_ok_and(|uid| uid == self.shared.ctx.uid);
                    if allowed {
                        self.newcomers.push(Newcomer { socket, since: Instant::now() });
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
/// doorbell, and a sealed memfd holding a valid activity area with the queue pair's slot.
fn accept_hello(
    shared: &DeviceShared,
    socket: SeqPacket,
    fds: Vec<OwnedFd>,
    hello: Message,
) -> Option<PeerAttach> {
    let Message::Hello { from_gid, from_qpn, to_qpn, slot } = hello else { return None };
    let mut fds = fds.into_iter();
    let (Some(segment_fd), Some(doorbell_fd), Some(area_fd), None) =
        (fds.next(), fds.next(), fds.next(), fds.next())
    else {
        return None;
    };
    let min_len = (RING_OFFSET + crate::ring::MIN_CAPACITY) as u64;
    let memfd = Memfd::from_peer(segment_fd, min_len).ok()?;
    let segment = PeerSegment::from_memfd(&memfd, ShmConfig::MAX_RING).ok()?;
    let doorbell = EventFd::from_peer(doorbell_fd).ok()?;
    let area = shared.peer_areas.get(&Memfd::from_peer(area_fd, 1).ok()?).ok()?;
    if !area.has_slot(slot) {
        return None;
    }
    let served = shared.ctx.registry.register(Arc::new(socket), SocketRole::Served { qpn: to_qpn });
    Some(PeerAttach { qpn: to_qpn, from_gid, from_qpn, segment, doorbell, area, slot, served })
}
