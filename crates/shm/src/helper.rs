//! The device's helper thread: the part of the device that runs when the application does
//! not.
//!
//! It accepts peers' introductions on the rendezvous socket, answers their questions about
//! memory regions, notices hang-ups (a peer that crashed or closed), and — once the
//! application has not driven the device for `ShmConfig::idle_after` — sleeps until a peer
//! rings the doorbell and then processes what arrived, so peers' requests complete and
//! notification fds fire. With nothing to do it blocks in `poll(2)` without a timeout: an idle
//! device costs no CPU.
//!
//! It never blocks on the engine lock (`try_lock`, retried shortly), and answers questions
//! without it, so two devices whose applications hold their locks while asking each other
//! something cannot deadlock.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::sync::{Arc, TryLockError};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use crate::config::ShmConfig;
use crate::device::DeviceShared;
use crate::engine::{DeviceCore, Event, PeerAttach};
use crate::registry::{SocketRole, Watched};
use crate::segment::{PeerSegment, RING_OFFSET};
use crate::sys::{poll_fds, EventFd, Memfd, SeqPacket};
use crate::wire::{Message, MAX_MESSAGE};

/// Connections that have not introduced themselves yet, at most.
const MAX_PENDING: usize = 256;
/// How long a new connection may take to introduce itself.
const HELLO_PATIENCE: Duration = Duration::from_secs(5);
/// Descriptors polled before the newcomers and the watched sockets.
const FIXED: usize = 5;
/// How soon to retry when the engine lock was busy.
const LOCK_RETRY: Duration = Duration::from_micros(100);

/// A connection waiting for its first message.
struct Newcomer {
    socket: SeqPacket,
    since: Instant,
}

/// The thread's state between rounds.
struct Helper<'a> {
    shared: &'a DeviceShared,
    newcomers: Vec<Newcomer>,
    watched: Vec<Watched>,
    /// Sockets already reported closed (not polled again: a hang-up stays readable).
    closed: HashSet<u64>,
    /// This thread counts as a sleeper (peers ring).
    armed: bool,
    retry_lock: bool,
    deadline: Option<Instant>,
    /// The application's drive counter as last seen, and when it last changed.
    drives_seen: u64,
    last_activity: Option<Instant>,
    /// When the application last armed a notification (see `app_active`).
    kicked_at: Option<Instant>,
}

/// The thread body; returns when the device's stop fd is signalled.
pub(crate) fn run(shared: &DeviceShared) {
    let mut helper = Helper {
        shared,
        newcomers: Vec::new(),
        watched: shared.ctx.registry.snapshot(),
        closed: HashSet::new(),
        armed: false,
        retry_lock: false,
        deadline: None,
        drives_seen: 0,
        last_activity: None,
        kicked_at: None,
    };
    while helper.round() {}
    if helper.armed {
        shared.lock_core().disarm();
    }
}

/// Which descriptors had events in one `poll`.
struct Ready {
    stop: bool,
    kick: bool,
    changed: bool,
    listener: bool,
    doorbell: bool,
    newcomers: Vec<bool>,
    watched: Vec<PollFlags>,
}

impl Helper<'_> {
    fn config(&self) -> &ShmConfig {
        &self.shared.ctx.config
    }

    /// Whether the application drove the device within the last `idle_after`.
    ///
    /// For `idle_after` after the application armed a notification it counts as idle whatever
    /// it does: the notification protocol polls the queue empty right after arming and then
    /// waits on the fd, and those last polls must not keep the helper napping while the
    /// application sleeps. An application that keeps polling after that is active again.
    fn app_active(&mut self) -> bool {
        let now = Instant::now();
        let drives = self.shared.drives();
        if let Some(kicked) = self.kicked_at {
            self.drives_seen = drives;
            if now.duration_since(kicked) >= self.config().idle_after {
                self.kicked_at = None;
            }
            return false;
        }
        if drives != self.drives_seen {
            self.drives_seen = drives;
            self.last_activity = Some(now);
        }
        self.last_activity.is_some_and(|last| now.duration_since(last) < self.config().idle_after)
    }

    fn timeout(&mut self) -> Option<Duration> {
        let active = self.app_active();
        let now = Instant::now();
        let mut timeout = if self.retry_lock {
            Some(LOCK_RETRY)
        } else if active {
            Some(self.config().idle_after)
        } else {
            self.deadline.map(|d| d.saturating_duration_since(now))
        };
        if let Some(oldest) = self.newcomers.iter().map(|n| n.since).min() {
            let expiry = (oldest + HELLO_PATIENCE).saturating_duration_since(now);
            timeout = Some(timeout.map_or(expiry, |t| t.min(expiry)));
        }
        timeout
    }

    fn wait(&mut self) -> Ready {
        let timeout = self.timeout();
        let ctx = &self.shared.ctx;
        let mut fds = vec![
            PollFd::new(&self.shared.stop, PollFlags::IN),
            PollFd::new(&self.shared.kick, PollFlags::IN),
            PollFd::new(&ctx.registry.changed, PollFlags::IN),
            PollFd::new(&self.shared.listener, PollFlags::IN),
            PollFd::new(&ctx.doorbell, PollFlags::IN),
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
            kick: false,
            changed: false,
            listener: false,
            doorbell: false,
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
        ready.kick = has(&fds[1]);
        ready.changed = has(&fds[2]);
        ready.listener = has(&fds[3]);
        ready.doorbell = has(&fds[4]);
        let newcomer_fds = &fds[FIXED..FIXED + self.newcomers.len()];
        for (flag, fd) in ready.newcomers.iter_mut().zip(newcomer_fds) {
            *flag = has(fd);
        }
        for (fd, &index) in fds[FIXED + self.newcomers.len()..].iter().zip(&polled) {
            ready.watched[index] = fd.revents();
        }
        ready
    }

    /// One round: wait, handle what happened, drive the engine. Returns false to stop.
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
        if ready.doorbell {
            ctx.doorbell.take();
        }
        if ready.kick {
            // The application armed a notification and is about to wait for it: treat it as
            // idle from now on (its next call that drives the device makes it active again).
            self.shared.kick.take();
            self.kicked_at = Some(Instant::now());
            self.last_activity = None;
        }
        self.drive();
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

    /// Applies events and, when the application is idle, processes arrivals and sleeps armed.
    fn drive(&mut self) {
        if !self.armed && self.app_active() && !self.shared.has_events() {
            // The application polls: it applies events and does the work itself; taking its
            // lock here would only get in its way.
            self.retry_lock = false;
            self.deadline = None;
            return;
        }
        let mut core = match self.shared.core.try_lock() {
            Ok(core) => core,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                self.retry_lock = true;
                return;
            }
        };
        self.retry_lock = false;
        self.shared.apply_events(&mut core);
        self.step(&mut core);
    }

    fn step(&mut self, core: &mut DeviceCore) {
        if self.app_active() {
            // The application polls: it does the work, and peers need not ring anyone.
            if self.armed {
                core.disarm();
                self.armed = false;
            }
            self.deadline = None;
            return;
        }
        // A fresh sleep each round, so peers that rang for the last one ring again.
        if self.armed {
            core.disarm();
        }
        core.arm();
        self.armed = true;
        self.deadline = core.progress();
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
        Some(Message::Hello { from_gid, from_qpn, to_qpn }) => {
            if let Some(attach) = accept_hello(shared, socket, received.fds, from_gid, from_qpn, to_qpn) {
                shared.post_event(Event::Attach(attach));
            }
        }
        _ => {}
    }
}

/// Checks an introduction's descriptors: a sealed memfd holding a valid segment, and an
/// eventfd doorbell.
fn accept_hello(
    shared: &DeviceShared,
    socket: SeqPacket,
    fds: Vec<OwnedFd>,
    from_gid: lightpath_verbs::Gid,
    from_qpn: u32,
    to_qpn: u32,
) -> Option<PeerAttach> {
    let mut fds = fds.into_iter();
    let (Some(segment_fd), Some(doorbell_fd), None) = (fds.next(), fds.next(), fds.next()) else {
        return None;
    };
    let min_len = (RING_OFFSET + crate::ring::MIN_CAPACITY) as u64;
    let memfd = Memfd::from_peer(segment_fd, min_len).ok()?;
    let segment = PeerSegment::from_memfd(&memfd, ShmConfig::MAX_RING).ok()?;
    let doorbell = EventFd::from_peer(doorbell_fd).ok()?;
    let served = shared.ctx.registry.register(Arc::new(socket), SocketRole::Served { qpn: to_qpn });
    Some(PeerAttach { qpn: to_qpn, from_gid, from_qpn, segment, doorbell, served })
}
