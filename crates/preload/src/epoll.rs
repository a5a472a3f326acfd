//! epoll for tracked connections: a shadow epoll instance per application epoll.
//!
//! The application's epoll fd stays a real kernel epoll and keeps every descriptor the
//! library does not track (listeners, pipes, eventfds, timers). The first time a tracked
//! connection is added to it, the library creates a hidden *shadow* epoll that holds the
//! application's epoll (token [`APP`]), each tracked connection's TCP socket (interest
//! reduced to what still matters: no `EPOLLIN` once reads come from the stream, no
//! `EPOLLOUT` once writes go to it) and, after the switch, the stream's event fds
//! (`lightpath::Stream::event_fds`: the completion notification eventfd, a soft queue pair's
//! own UDP port if it has one, and the TCP liveness connection), each edge-triggered with a
//! token of its own, so that a look at the stream reads only those that signalled
//! (`Stream::poll_ready_signalled`): a level-triggered connection looked at again at every
//! wait receives from its port only after datagrams came (an edge comes with each).
//! `epoll_wait` on the application's fd waits on the shadow instead and translates: events of
//! the application's own epoll are taken from it as they are; a connection's events are
//! computed from its state (TCP part, stream part via `poll_ready_signalled`) and delivered
//! with the application's `epoll_data`, filtered by its interest, with its edge/level choice
//! and `EPOLLONESHOT`.
//! Level-triggered connections with a stream that were ready at their last look are looked at
//! again at each wait (the stream's fds only signal changes). A connection added, modified or
//! switched is queued for a look by the next wait (which reads both stream fds after an add
//! or a switch, and otherwise only those that signalled meanwhile); the per-shadow eventfd ([`KICK`]) is
//! written only when a wait sleeps in the shadow meanwhile (another thread), so an event loop
//! that changes its interest between waits pays no system call for it.
//!
//! `EPOLL_CTL_DEL` parks a registration rather than removing it from the shadow: event
//! loops that delete and re-add a connection around every request (redis-benchmark's) would
//! otherwise pay four shadow `epoll_ctl` calls per request. A parked registration reports
//! nothing; an event on its TCP socket (a hang-up is reported whatever the interest) disables
//! the socket in the shadow (`EPOLLONESHOT`) until the connection is added again. It leaves
//! the shadow when the connection closes.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libc::{c_int, epoll_event};
use rustix::event::{epoll, eventfd, EventfdFlags};

use crate::conn::{Conn, State};
use crate::{real, table};

const APP: u64 = u64::MAX;
const KICK: u64 = u64::MAX - 1;
/// Token kinds, in a token's low `TOKEN_BITS` bits (the connection id above them): the TCP
/// socket (0), or a set of the stream fd bits below.
const TOKEN_BITS: u32 = 3;
const TOKEN_KIND: u64 = (1 << TOKEN_BITS) - 1;
const TOKEN_TCP: u64 = 0;
const TOKEN_NOTIFY: u64 = 1;
const TOKEN_LIVENESS: u64 = 2;
/// A soft queue pair's own UDP port: its event says datagrams came since the last look (see
/// `lightpath::Signalled::port`).
const TOKEN_PORT: u64 = 4;

const IN: u32 = libc::EPOLLIN as u32;
const OUT: u32 = libc::EPOLLOUT as u32;
const RDHUP: u32 = libc::EPOLLRDHUP as u32;
const PRI: u32 = libc::EPOLLPRI as u32;
const ERR: u32 = libc::EPOLLERR as u32;
const HUP: u32 = libc::EPOLLHUP as u32;
const ET: u32 = libc::EPOLLET as u32;
const ONESHOT: u32 = libc::EPOLLONESHOT as u32;
const EXCLUSIVE: u32 = libc::EPOLLEXCLUSIVE as u32;
/// `Reg::delivered` of a registration not looked at since it was added or modified.
const UNKNOWN: u32 = u32::MAX;

/// One tracked connection registered in an application epoll.
struct Reg {
    conn: Arc<Conn>,
    fd: c_int,
    events: u32,
    data: u64,
    /// EPOLLONESHOT fired; waits for EPOLL_CTL_MOD.
    disabled: bool,
    /// The TCP socket's interest in the shadow now.
    tcp_mask: u32,
    /// The stream's event fds in the shadow, with their token kinds (empty before the switch).
    stream_fds: Vec<(c_int, u64)>,
    /// What the last evaluation delivered (see `wait`).
    delivered: u32,
    /// To be looked at by the next wait (added, modified or switched since the last look).
    queued: bool,
    /// What that look reads besides what the shadow reports then: both stream fds after an
    /// add or a switch; the ones that signalled while the registration was parked.
    owed: Seen,
    /// The application deleted it (see the module docs): reports nothing.
    parked: bool,
}

impl Reg {
    fn has_stream(&self) -> bool {
        !self.stream_fds.is_empty()
    }
}

struct Shadow {
    inner: OwnedFd,
    kick: OwnedFd,
    regs: HashMap<u64, Reg>,
    /// Waits sleeping in the shadow now: a change then writes `kick` to wake them.
    sleepers: usize,
    /// When every switched connection was last looked at in full (see `wait`).
    full_look: Instant,
}

impl Shadow {
    /// Queues `id` for a look by the next wait that also reads what `owed` names, waking a
    /// wait that sleeps meanwhile.
    fn queue(&mut self, id: u64, owed: Seen) {
        if let Some(reg) = self.regs.get_mut(&id) {
            reg.queued = true;
            reg.owed = reg.owed.or(owed);
            reg.delivered = UNKNOWN;
        }
        if self.sleepers > 0 {
            let _ = rustix::io::write(&self.kick, &1u64.to_ne_bytes());
        }
    }
}

type Shadows = HashMap<c_int, Arc<Mutex<Shadow>>>;
static SHADOWS: Mutex<Option<Shadows>> = Mutex::new(None);

fn shadows() -> std::sync::MutexGuard<'static, Option<Shadows>> {
    SHADOWS.lock().unwrap_or_else(|p| p.into_inner())
}

fn shadow_of(epfd: c_int) -> Option<Arc<Mutex<Shadow>>> {
    shadows().as_ref()?.get(&epfd).cloned()
}

fn lock(shadow: &Mutex<Shadow>) -> std::sync::MutexGuard<'_, Shadow> {
    shadow.lock().unwrap_or_else(|p| p.into_inner())
}

fn get_or_create(epfd: c_int) -> Result<Arc<Mutex<Shadow>>, c_int> {
    let mut all = shadows();
    let map = all.get_or_insert_with(HashMap::new);
    if let Some(existing) = map.get(&epfd) {
        return Ok(Arc::clone(existing));
    }
    let errno = |e: rustix::io::Errno| e.raw_os_error();
    let inner = crate::guard::high(epoll::create(epoll::CreateFlags::CLOEXEC).map_err(errno)?);
    let kick = crate::guard::high(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(errno)?);
    // SAFETY: the application passed `epfd` to epoll_ctl, so it is open for this call.
    let app = unsafe { BorrowedFd::borrow_raw(epfd) };
    epoll::add(&inner, app, epoll::EventData::new_u64(APP), epoll::EventFlags::IN).map_err(errno)?;
    epoll::add(&inner, &kick, epoll::EventData::new_u64(KICK), epoll::EventFlags::IN).map_err(errno)?;
    let shadow = Arc::new(Mutex::new(Shadow {
        inner,
        kick,
        regs: HashMap::new(),
        sleepers: 0,
        full_look: Instant::now(),
    }));
    map.insert(epfd, Arc::clone(&shadow));
    table::set_shadowed(epfd, true);
    Ok(shadow)
}

/// The TCP socket's interest for a registration with `events`, given the state.
fn tcp_mask(state: &State, events: u32) -> u32 {
    let mut mask = events & (PRI | ET);
    if events & (IN | RDHUP) != 0 && state.tcp_readable_matters() {
        mask |= events & (IN | RDHUP);
    }
    if state.late_tcp_watched() {
        // Late bytes (see `conn`): taken in by `evaluate`, not reported. Whatever the
        // application asks for (the library's own interest), so that an application that
        // switches between asking for IN and for OUT (redis-benchmark, around each request)
        // costs no `EPOLL_CTL_MOD` of the socket.
        mask |= IN;
    }
    if events & OUT != 0 && !state.send_switched {
        mask |= OUT;
    }
    mask
}

fn shadow_ctl(inner: &OwnedFd, op: c_int, fd: c_int, mask: u32, token: u64) -> c_int {
    raw_ctl(inner.as_raw_fd(), op, fd, mask, token)
}

fn raw_ctl(inner: c_int, op: c_int, fd: c_int, mask: u32, token: u64) -> c_int {
    let mut event = epoll_event { events: mask, u64: token };
    // SAFETY: `event` is a valid epoll_event for the call.
    unsafe { real::epoll_ctl(inner, op, fd, &mut event) }
}

/// The stream's event fds with their token kinds: the notification fd, a soft queue pair's
/// own UDP port if it has one (whose news the next look takes in: only after its event, see
/// `evaluate`), then the TCP liveness connection.
fn stream_fds(state: &State) -> Vec<(c_int, u64)> {
    let Some(stream) = state.stream.as_ref() else { return Vec::new() };
    let fds = stream.event_fds();
    match fds.as_slice() {
        // Not an RDMA stream (the library installs none): its one fd counts as both.
        [one] => vec![(*one, TOKEN_NOTIFY | TOKEN_LIVENESS)],
        [notify, port, liveness] => {
            vec![(*notify, TOKEN_NOTIFY), (*port, TOKEN_PORT), (*liveness, TOKEN_LIVENESS)]
        }
        // Without a port of its own (or in an order not known here): every event of the
        // others takes in whatever the look can, as before ports had a token.
        [notify @ .., liveness] => notify
            .iter()
            .map(|&fd| (fd, TOKEN_NOTIFY | TOKEN_PORT))
            .chain([(*liveness, TOKEN_LIVENESS)])
            .collect(),
        [] => Vec::new(),
    }
}

/// Adds the stream's event fds of connection `id` to the shadow, edge-triggered.
fn add_stream_fds(inner: c_int, id: u64, fds: &[(c_int, u64)]) {
    for &(fd, kind) in fds {
        raw_ctl(inner, libc::EPOLL_CTL_ADD, fd, IN | ET, (id << TOKEN_BITS) | kind);
    }
}

/// epoll_ctl for a tracked connection `fd`.
pub(crate) fn ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    conn: &Arc<Conn>,
    event: Option<&epoll_event>,
) -> Result<c_int, c_int> {
    let shadow = match op {
        libc::EPOLL_CTL_ADD => get_or_create(epfd)?,
        _ => shadow_of(epfd).ok_or(libc::ENOENT)?,
    };
    let mut shadow = lock(&shadow);
    let shadow = &mut *shadow;
    let inner = shadow.inner.as_raw_fd();
    match op {
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
            let event = event.ok_or(libc::EFAULT)?;
            let (events, data) = (event.events, event.u64);
            // As the kernel: EPOLLEXCLUSIVE only when adding, and not with EPOLLONESHOT. (On
            // a connection it changes nothing here: each registration is its own.)
            if events & EXCLUSIVE != 0 && (op == libc::EPOLL_CTL_MOD || events & ONESHOT != 0) {
                return Err(libc::EINVAL);
            }
            let existing = shadow.regs.get(&conn.id).map(|reg| reg.parked);
            match (op, existing) {
                (libc::EPOLL_CTL_ADD, Some(false)) => return Err(libc::EEXIST),
                (libc::EPOLL_CTL_MOD, None | Some(true)) => return Err(libc::ENOENT),
                _ => {}
            }
            let mut state = conn.lock();
            state.offer(conn, fd);
            let mask = tcp_mask(&state, events);
            let fds = stream_fds(&state);
            if !state.epolls.contains(&epfd) {
                state.epolls.push(epfd);
            }
            drop(state);
            let token = (conn.id << TOKEN_BITS) | TOKEN_TCP;
            match shadow.regs.get_mut(&conn.id) {
                None => {
                    if raw_ctl(inner, libc::EPOLL_CTL_ADD, fd, mask, token) != 0 {
                        return Err(real::errno());
                    }
                    add_stream_fds(inner, conn.id, &fds);
                    shadow.regs.insert(
                        conn.id,
                        Reg {
                            conn: Arc::clone(conn),
                            fd,
                            events,
                            data,
                            disabled: false,
                            tcp_mask: mask,
                            stream_fds: fds,
                            delivered: UNKNOWN,
                            queued: false,
                            owed: Seen::default(),
                            parked: false,
                        },
                    );
                }
                Some(reg) => {
                    if reg.parked && reg.fd != fd {
                        // Added again through another fd of the connection (a dup).
                        raw_ctl(inner, libc::EPOLL_CTL_DEL, reg.fd, 0, 0);
                        if raw_ctl(inner, libc::EPOLL_CTL_ADD, fd, mask, token) != 0 {
                            let errno = real::errno();
                            let reg = shadow.regs.remove(&conn.id);
                            for &(stream_fd, _) in reg.iter().flat_map(|reg| reg.stream_fds.iter()) {
                                raw_ctl(inner, libc::EPOLL_CTL_DEL, stream_fd, 0, 0);
                            }
                            conn.lock().epolls.retain(|e| *e != epfd);
                            return Err(errno);
                        }
                        reg.fd = fd;
                    } else if mask != reg.tcp_mask {
                        raw_ctl(inner, libc::EPOLL_CTL_MOD, fd, mask, token);
                    }
                    reg.tcp_mask = mask;
                    reg.events = events;
                    reg.data = data;
                    reg.disabled = false;
                    reg.parked = false;
                    if reg.stream_fds.is_empty() && !fds.is_empty() {
                        add_stream_fds(inner, conn.id, &fds);
                        reg.stream_fds = fds;
                    }
                }
            }
            // New interest, and a connection may be ready in ways no fd signals (bytes
            // already taken off the stream): the next wait looks. A new registration's look
            // reads both stream fds; a modified or re-added one's reads what signalled while it
            // was parked (the look itself arms the stream and sees its data without them).
            shadow.queue(conn.id, if existing.is_none() { Seen::FULL } else { Seen::default() });
            Ok(0)
        }
        libc::EPOLL_CTL_DEL => {
            let reg = shadow.regs.get_mut(&conn.id).filter(|reg| !reg.parked).ok_or(libc::ENOENT)?;
            // Parked (see the module docs): the socket keeps only what is always reported, and
            // the watch for late bytes (the library's, not the application's interest), so
            // that a connection deleted and added again around each request (redis-benchmark)
            // costs no `EPOLL_CTL_MOD` of its socket either way.
            reg.parked = true;
            reg.queued = false;
            let parked_mask = if conn.lock().late_tcp_watched() { IN } else { 0 };
            if reg.tcp_mask & !ET != parked_mask {
                raw_ctl(inner, libc::EPOLL_CTL_MOD, reg.fd, parked_mask, (conn.id << TOKEN_BITS) | TOKEN_TCP);
                reg.tcp_mask = parked_mask;
            }
            Ok(0)
        }
        _ => Err(libc::EINVAL),
    }
}

/// A connection switched: its stream's event fds join the shadows it is registered in.
pub(crate) fn conn_switched(conn: &Arc<Conn>) {
    let (epolls, peer) = {
        let state = conn.lock();
        (state.epolls.clone(), state.peer)
    };
    crate::report::debug(format_args!("stream to {peer:?} installed; in {} epoll(s)", epolls.len()));
    for epfd in epolls {
        let Some(shadow) = shadow_of(epfd) else { continue };
        let mut shadow = lock(&shadow);
        let inner = shadow.inner.as_raw_fd();
        let Some(reg) = shadow.regs.get_mut(&conn.id) else { continue };
        let state = conn.lock();
        let fds = stream_fds(&state);
        let mask = tcp_mask(&state, reg.events);
        drop(state);
        if reg.stream_fds.is_empty() && !fds.is_empty() {
            add_stream_fds(inner, conn.id, &fds);
            reg.stream_fds = fds;
        }
        if !reg.parked && mask != reg.tcp_mask {
            raw_ctl(inner, libc::EPOLL_CTL_MOD, reg.fd, mask, (conn.id << TOKEN_BITS) | TOKEN_TCP);
            reg.tcp_mask = mask;
        }
        if reg.parked {
            reg.owed = Seen::FULL;
        } else {
            shadow.queue(conn.id, Seen::FULL);
        }
    }
}

/// A connection closed: it leaves every shadow.
pub(crate) fn conn_closed(conn: &Arc<Conn>, epolls: &[c_int]) {
    for &epfd in epolls {
        let Some(shadow) = shadow_of(epfd) else { continue };
        let mut shadow = lock(&shadow);
        if let Some(reg) = shadow.regs.remove(&conn.id) {
            shadow_ctl(&shadow.inner, libc::EPOLL_CTL_DEL, reg.fd, 0, 0);
            for (fd, _) in reg.stream_fds {
                shadow_ctl(&shadow.inner, libc::EPOLL_CTL_DEL, fd, 0, 0);
            }
        }
    }
}

/// Descriptor `fd` of a connection that stays open (a dup of it remains) went away: a parked
/// registration made through that number leaves the shadows. Kept, it would name the number
/// in the shadow after the application reused it, and adding the connection again through
/// another fd would remove whatever the number names then. (A live registration stays, as
/// the kernel keeps an epoll item while its open file lives.)
pub(crate) fn fd_gone(conn: &Arc<Conn>, fd: c_int) {
    let epolls = conn.lock().epolls.clone();
    for epfd in epolls {
        let Some(shadow) = shadow_of(epfd) else { continue };
        let mut shadow = lock(&shadow);
        if !shadow.regs.get(&conn.id).is_some_and(|reg| reg.parked && reg.fd == fd) {
            continue;
        }
        if let Some(reg) = shadow.regs.remove(&conn.id) {
            shadow_ctl(&shadow.inner, libc::EPOLL_CTL_DEL, reg.fd, 0, 0);
            for (stream_fd, _) in reg.stream_fds {
                shadow_ctl(&shadow.inner, libc::EPOLL_CTL_DEL, stream_fd, 0, 0);
            }
        }
        conn.lock().epolls.retain(|e| *e != epfd);
    }
}

/// The application closed an epoll fd: its shadow goes.
pub(crate) fn epoll_closed(epfd: c_int) {
    if let Some(map) = shadows().as_mut() {
        if map.remove(&epfd).is_some() {
            table::set_shadowed(epfd, false);
        }
    }
}

/// What the shadow said of one connection in one wait.
#[derive(Clone, Copy, Default)]
struct Seen {
    /// Events of its TCP socket.
    tcp: u32,
    /// Read its stream's notification fd (full looks only: the fd's events need no read,
    /// see `wait`).
    notified: bool,
    /// Its stream's TCP liveness connection signalled.
    liveness: bool,
    /// Its stream's own port signalled (datagrams came since the last look took it in).
    port: bool,
}

impl Seen {
    /// A look that reads every stream fd (not prompted by their events).
    const FULL: Seen = Seen { tcp: 0, notified: true, liveness: true, port: true };

    fn or(self, other: Seen) -> Seen {
        Seen {
            tcp: self.tcp | other.tcp,
            notified: self.notified | other.notified,
            liveness: self.liveness | other.liveness,
            port: self.port | other.port,
        }
    }
}

/// What registration `reg` reports now, given what the shadow said of it.
fn evaluate(inner: c_int, reg: &mut Reg, seen: Seen) -> u32 {
    reg.queued = false;
    let seen = seen.or(std::mem::take(&mut reg.owed));
    if reg.disabled || reg.parked {
        return 0;
    }
    let tcp = seen.tcp;
    let mut state = reg.conn.lock();
    if tcp & (IN | HUP | ERR) != 0 && state.late_tcp_watched() {
        state.take_late_tcp(reg.fd);
    }
    let mut events = 0;
    if state.tcp_readable_matters() {
        events |= tcp & (IN | RDHUP | PRI);
    }
    if !state.send_switched {
        events |= tcp & OUT;
    }
    events |= tcp & ERR;
    if tcp & HUP != 0 && state.stream.is_none() {
        events |= HUP;
    }
    let signalled = lightpath::Signalled { notify: seen.notified, port: seen.port, liveness: seen.liveness };
    let (readable, writable) = state.stream_readiness_after(signalled);
    if readable {
        events |= IN;
    }
    if writable {
        events |= OUT;
    }
    let mask = tcp_mask(&state, reg.events);
    drop(state);
    if mask != reg.tcp_mask {
        raw_ctl(inner, libc::EPOLL_CTL_MOD, reg.fd, mask, (reg.conn.id << TOKEN_BITS) | TOKEN_TCP);
        reg.tcp_mask = mask;
    }
    let delivered = events & (reg.events | ERR | HUP);
    if delivered != 0 && reg.events & ONESHOT != 0 {
        reg.disabled = true;
    }
    reg.delivered = delivered;
    delivered
}

/// epoll_wait on an application epoll that has a shadow. `timeout` in ms (-1: forever).
pub(crate) fn wait(
    epfd: c_int,
    out: &mut [epoll_event],
    timeout: c_int,
    sigmask: *const libc::sigset_t,
) -> Result<c_int, c_int> {
    let Some(shadow) = shadow_of(epfd) else {
        // SAFETY: `out` is the caller's buffer.
        let n = unsafe { real::epoll_pwait(epfd, out.as_mut_ptr(), out.len() as c_int, timeout, sigmask) };
        return if n < 0 { Err(real::errno()) } else { Ok(n) };
    };
    let deadline = (timeout >= 0).then(|| Instant::now() + Duration::from_millis(timeout as u64));
    let mut got: Vec<(u64, u32, u64)> = Vec::new(); // (conn id or APP, events, data)
    let mut seen: Vec<(u64, Seen)> = Vec::new();
    let mut buf = [epoll_event { events: 0, u64: 0 }; 64];
    let mut spin_until: Option<Instant> = None;
    loop {
        let mut guard = lock(&shadow);
        let inner = guard.inner.as_raw_fd();
        // Connections queued by a change (added, modified, switched) get a look.
        // Level-triggered connections with a stream that were ready at the last look: look
        // again (the application may have taken everything since), reading neither of the
        // stream's fds (an edge on one is reported by the shadow below). One that was not
        // ready changes only with such an edge; looking at every connection on every wait
        // cost a few system calls per connection per wait (redis-server with 50 clients: most
        // of its time).
        // Every switched connection is looked at in full at least every `RECHECK_MS`, also
        // when the wait never sleeps (an application kept busy by other connections): a bound
        // on any stream wake-up missed.
        let now = Instant::now();
        let full =
            now.duration_since(guard.full_look) >= Duration::from_millis(crate::wait::RECHECK_MS as u64);
        if full {
            guard.full_look = now;
        }
        let mut has_streams = false;
        for reg in guard.regs.values_mut() {
            if reg.parked {
                continue;
            }
            has_streams |= reg.has_stream();
            let look = if full && reg.has_stream() {
                Seen::FULL
            } else if reg.queued || (reg.events & ET == 0 && reg.has_stream() && reg.delivered != 0) {
                Seen::default()
            } else {
                continue;
            };
            let events = evaluate(inner, reg, look);
            if events != 0 {
                merge(&mut got, reg.conn.id, events, reg.data);
            }
        }
        let mut wait_ms = if !got.is_empty() {
            0
        } else {
            match deadline {
                None => -1,
                Some(d) => {
                    d.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128) as c_int
                }
            }
        };
        if has_streams && !(0..=crate::wait::RECHECK_MS).contains(&wait_ms) {
            wait_ms = crate::wait::RECHECK_MS;
        }
        // With switched connections, look without sleeping for a short while first: a sleep
        // and a wake-up cost more than a stream message takes to arrive.
        let spinning = has_streams
            && wait_ms != 0
            && *spin_until.get_or_insert_with(|| Instant::now() + crate::io::spin()) > Instant::now();
        if spinning {
            wait_ms = 0;
        }
        // A change made while this wait sleeps writes the kick (see `Shadow::queue`).
        if wait_ms != 0 {
            guard.sleepers += 1;
        }
        drop(guard);
        // SAFETY: `buf` is a local array of 64 events.
        let n = unsafe { real::epoll_pwait(inner, buf.as_mut_ptr(), buf.len() as c_int, wait_ms, sigmask) };
        let errno = real::errno();
        let mut guard = lock(&shadow);
        if wait_ms != 0 {
            guard.sleepers -= 1;
        }
        if n < 0 && got.is_empty() {
            return Err(errno);
        }
        // After a real sleep that saw nothing (at most `RECHECK_MS`), every switched connection
        // is looked at in full: a bound on any event missed. Not after the spin's zero-time
        // looks.
        if n == 0 && has_streams && wait_ms != 0 {
            guard.full_look = Instant::now();
            for reg in guard.regs.values_mut() {
                if reg.has_stream() && !reg.parked {
                    let events = evaluate(inner, reg, Seen::FULL);
                    if events != 0 {
                        merge(&mut got, reg.conn.id, events, reg.data);
                    }
                }
            }
        }
        // What the shadow said, per connection (one look each, however many of its fds
        // signalled).
        seen.clear();
        let mut kicked = false;
        for event in buf.iter().take(n.max(0) as usize) {
            let (token, events) = (event.u64, event.events);
            match token {
                APP => {
                    let room = out.len().saturating_sub(got.len());
                    if room == 0 {
                        continue;
                    }
                    let mut app = vec![epoll_event { events: 0, u64: 0 }; room];
                    // SAFETY: `app` holds `room` events.
                    let m = unsafe { real::epoll_wait(epfd, app.as_mut_ptr(), room as c_int, 0) };
                    for e in app.iter().take(m.max(0) as usize) {
                        got.push((APP, e.events, e.u64));
                    }
                }
                KICK => kicked = true,
                token => {
                    let id = token >> TOKEN_BITS;
                    let at = seen.iter().position(|(i, _)| *i == id).unwrap_or_else(|| {
                        seen.push((id, Seen::default()));
                        seen.len() - 1
                    });
                    let entry = &mut seen[at].1;
                    let kind = token & TOKEN_KIND;
                    if kind == TOKEN_TCP {
                        entry.tcp |= events;
                    }
                    // The notification eventfd is not read for its event: registered
                    // edge-triggered, each write of it raises one whatever its count (eventfd
                    // wakes its waiters on every write), so its count may grow (one per wake-up,
                    // in a u64) until a full look drains it. Reading it was a system call per
                    // message.
                    entry.liveness |= kind & TOKEN_LIVENESS != 0;
                    entry.port |= kind & TOKEN_PORT != 0;
                }
            }
        }
        if kicked {
            let mut counter = [0u8; 8];
            let _ = rustix::io::read(&guard.kick, &mut counter);
        }
        for &(id, look) in &seen {
            let Some(reg) = guard.regs.get_mut(&id) else { continue };
            if reg.parked {
                if look.tcp != 0 && reg.tcp_mask != ONESHOT {
                    // A hang-up or error of a parked connection's socket (reported whatever
                    // the interest): disabled until the connection is added again.
                    raw_ctl(inner, libc::EPOLL_CTL_MOD, reg.fd, ONESHOT, (id << TOKEN_BITS) | TOKEN_TCP);
                    reg.tcp_mask = ONESHOT;
                }
                // Read by the look after it is added again.
                reg.owed = reg.owed.or(Seen { tcp: 0, ..look });
                continue;
            }
            let events = evaluate(inner, reg, look);
            if events != 0 {
                merge(&mut got, id, events, reg.data);
            }
        }
        if kicked {
            for reg in guard.regs.values_mut() {
                if reg.queued && !reg.parked {
                    let events = evaluate(inner, reg, Seen::default());
                    if events != 0 {
                        merge(&mut got, reg.conn.id, events, reg.data);
                    }
                }
            }
        }
        drop(guard);
        if !got.is_empty() {
            let count = got.len().min(out.len());
            for (slot, (_, events, data)) in out.iter_mut().zip(got.iter()) {
                *slot = epoll_event { events: *events, u64: *data };
            }
            return Ok(count as c_int);
        }
        if n < 0 {
            return Err(libc::EINTR);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(0);
        }
        if spinning {
            std::thread::yield_now();
        }
    }
}

fn merge(got: &mut Vec<(u64, u32, u64)>, id: u64, events: u32, data: u64) {
    if let Some(entry) = got.iter_mut().find(|(i, _, _)| *i == id && *i != APP) {
        entry.1 |= events;
    } else {
        got.push((id, events, data));
    }
}
