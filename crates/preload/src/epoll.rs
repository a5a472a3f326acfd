//! epoll for tracked connections: a shadow epoll instance per application epoll.
//!
//! The application's epoll fd stays a real kernel epoll and keeps every descriptor the
//! library does not track (listeners, pipes, eventfds, timers). The first time a tracked
//! connection is added to it, the library creates a hidden *shadow* epoll that holds the
//! application's epoll (token [`APP`]), each tracked connection's TCP socket (interest
//! reduced to what still matters: no `EPOLLIN` once reads come from the stream, no
//! `EPOLLOUT` once writes go to it) and, after the switch, the stream's readiness fd.
//! `epoll_wait` on the application's fd waits on the shadow instead and translates: events
//! of the application's own epoll are taken from it as they are; a connection's events are
//! computed from its state (TCP part, stream part via `poll_ready`) and delivered with the
//! application's `epoll_data`, filtered by its interest, with its edge/level choice and
//! `EPOLLONESHOT`. Level-triggered connections with a stream are re-examined at each wait
//! (the stream's readiness fd only signals changes); a per-shadow eventfd ([`KICK`]) makes
//! every wait look again when a connection switches.

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

const IN: u32 = libc::EPOLLIN as u32;
const OUT: u32 = libc::EPOLLOUT as u32;
const RDHUP: u32 = libc::EPOLLRDHUP as u32;
const PRI: u32 = libc::EPOLLPRI as u32;
const ERR: u32 = libc::EPOLLERR as u32;
const HUP: u32 = libc::EPOLLHUP as u32;
const ET: u32 = libc::EPOLLET as u32;
const ONESHOT: u32 = libc::EPOLLONESHOT as u32;
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
    /// The stream's readiness fd, once added to the shadow.
    ready_fd: Option<c_int>,
    /// What the last evaluation delivered (see `wait`).
    delivered: u32,
}

struct Shadow {
    inner: OwnedFd,
    kick: OwnedFd,
    regs: HashMap<u64, Reg>,
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
    let shadow = Arc::new(Mutex::new(Shadow { inner, kick, regs: HashMap::new() }));
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
    if events & OUT != 0 && !state.send_switched {
        mask |= OUT;
    }
    mask
}

fn shadow_ctl(inner: &OwnedFd, op: c_int, fd: c_int, mask: u32, token: u64) -> c_int {
    let mut event = epoll_event { events: mask, u64: token };
    // SAFETY: `event` is a valid epoll_event for the call.
    unsafe { real::epoll_ctl(inner.as_raw_fd(), op, fd, &mut event) }
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
    match op {
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
            let event = event.ok_or(libc::EFAULT)?;
            let (events, data) = (event.events, event.u64);
            let exists = shadow.regs.contains_key(&conn.id);
            if op == libc::EPOLL_CTL_ADD && exists {
                return Err(libc::EEXIST);
            }
            if op == libc::EPOLL_CTL_MOD && !exists {
                return Err(libc::ENOENT);
            }
            let mut state = conn.lock();
            state.offer(conn, fd);
            let mask = tcp_mask(&state, events);
            let ready_fd = state.stream.as_ref().and_then(|s| s.readiness_fd().ok()).map(|f| f.as_raw_fd());
            if !state.epolls.contains(&epfd) {
                state.epolls.push(epfd);
            }
            drop(state);
            let token = conn.id << 1;
            if op == libc::EPOLL_CTL_ADD {
                if shadow_ctl(&shadow.inner, libc::EPOLL_CTL_ADD, fd, mask, token) != 0 {
                    return Err(real::errno());
                }
                if let Some(ready) = ready_fd {
                    shadow_ctl(&shadow.inner, libc::EPOLL_CTL_ADD, ready, IN | ET, token | 1);
                }
                shadow.regs.insert(
                    conn.id,
                    Reg {
                        conn: Arc::clone(conn),
                        fd,
                        events,
                        data,
                        disabled: false,
                        tcp_mask: mask,
                        ready_fd,
                        // Looked at by the next wait.
                        delivered: UNKNOWN,
                    },
                );
            } else {
                let reg = shadow.regs.get_mut(&conn.id).ok_or(libc::ENOENT)?;
                reg.events = events;
                reg.data = data;
                reg.disabled = false;
                // New interest: looked at by the next wait.
                reg.delivered = UNKNOWN;
                reg.tcp_mask = mask;
                let inner = shadow.inner.as_raw_fd();
                let mut ev = epoll_event { events: mask, u64: token };
                // SAFETY: valid event for the call.
                unsafe { real::epoll_ctl(inner, libc::EPOLL_CTL_MOD, fd, &mut ev) };
            }
            // A connection may be ready in ways no fd signals (bytes already taken off the
            // stream): let the next wait look.
            let _ = rustix::io::write(&shadow.kick, &1u64.to_ne_bytes());
            Ok(0)
        }
        libc::EPOLL_CTL_DEL => {
            let reg = shadow.regs.remove(&conn.id).ok_or(libc::ENOENT)?;
            shadow_ctl(&shadow.inner, libc::EPOLL_CTL_DEL, fd, 0, 0);
            if let Some(ready) = reg.ready_fd {
                shadow_ctl(&shadow.inner, libc::EPOLL_CTL_DEL, ready, 0, 0);
            }
            conn.lock().epolls.retain(|e| *e != epfd);
            Ok(0)
        }
        _ => Err(libc::EINVAL),
    }
}

/// A connection switched: its stream's readiness fd joins the shadows it is registered in.
pub(crate) fn conn_switched(conn: &Arc<Conn>) {
    let epolls = conn.lock().epolls.clone();
    for epfd in epolls {
        let Some(shadow) = shadow_of(epfd) else { continue };
        let mut shadow = lock(&shadow);
        let inner = shadow.inner.as_raw_fd();
        let Some(reg) = shadow.regs.get_mut(&conn.id) else { continue };
        let state = conn.lock();
        let ready = state.stream.as_ref().and_then(|s| s.readiness_fd().ok()).map(|f| f.as_raw_fd());
        let mask = tcp_mask(&state, reg.events);
        drop(state);
        if let (Some(ready), None) = (ready, reg.ready_fd) {
            let mut ev = epoll_event { events: IN | ET, u64: (conn.id << 1) | 1 };
            // SAFETY: valid event for the call.
            unsafe { real::epoll_ctl(inner, libc::EPOLL_CTL_ADD, ready, &mut ev) };
            reg.ready_fd = Some(ready);
        }
        reg.delivered = UNKNOWN;
        if mask != reg.tcp_mask {
            let mut ev = epoll_event { events: mask, u64: conn.id << 1 };
            // SAFETY: valid event for the call.
            unsafe { real::epoll_ctl(inner, libc::EPOLL_CTL_MOD, reg.fd, &mut ev) };
            reg.tcp_mask = mask;
        }
        let _ = rustix::io::write(&shadow.kick, &1u64.to_ne_bytes());
    }
}

/// A connection closed: it leaves every shadow.
pub(crate) fn conn_closed(conn: &Arc<Conn>, epolls: &[c_int]) {
    for &epfd in epolls {
        let Some(shadow) = shadow_of(epfd) else { continue };
        let mut shadow = lock(&shadow);
        if let Some(reg) = shadow.regs.remove(&conn.id) {
            shadow_ctl(&shadow.inner, libc::EPOLL_CTL_DEL, reg.fd, 0, 0);
            if let Some(ready) = reg.ready_fd {
                shadow_ctl(&shadow.inner, libc::EPOLL_CTL_DEL, ready, 0, 0);
            }
        }
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

/// What registration `reg` reports now; `tcp` is what the shadow said of its socket.
fn evaluate(inner: c_int, reg: &mut Reg, tcp: u32) -> u32 {
    if reg.disabled {
        return 0;
    }
    let mut state = reg.conn.lock();
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
    let (readable, writable) = state.stream_readiness();
    if readable {
        events |= IN;
    }
    if writable {
        events |= OUT;
    }
    let mask = tcp_mask(&state, reg.events);
    drop(state);
    if mask != reg.tcp_mask {
        let mut ev = epoll_event { events: mask, u64: reg.conn.id << 1 };
        // SAFETY: valid event for the call.
        unsafe { real::epoll_ctl(inner, libc::EPOLL_CTL_MOD, reg.fd, &mut ev) };
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
    let mut buf = [epoll_event { events: 0, u64: 0 }; 64];
    let mut spin_until: Option<Instant> = None;
    loop {
        let inner = lock(&shadow).inner.as_raw_fd();
        // Level-triggered connections with a stream that were ready at the last look: look
        // again (the application may have taken everything since). One that was not ready
        // changes only with an event on its readiness fd (armed by that look), which the
        // shadow reports below; looking at every connection on every wait cost a few system
        // calls per connection per wait (redis-server with 50 clients: most of its time).
        {
            let mut guard = lock(&shadow);
            for reg in guard.regs.values_mut() {
                if reg.events & ET == 0 && reg.ready_fd.is_some() && reg.delivered != 0 {
                    let events = evaluate(inner, reg, 0);
                    if events != 0 {
                        merge(&mut got, reg.conn.id, events, reg.data);
                    }
                }
            }
        }
        let has_streams = lock(&shadow).regs.values().any(|r| r.ready_fd.is_some());
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
        // SAFETY: `buf` is a local array of 64 events.
        let n = unsafe { real::epoll_pwait(inner, buf.as_mut_ptr(), buf.len() as c_int, wait_ms, sigmask) };
        if n < 0 {
            let errno = real::errno();
            if got.is_empty() {
                return Err(errno);
            }
        }
        let mut guard = lock(&shadow);
        // After a real sleep that saw nothing (at most `RECHECK_MS`), every switched connection
        // is looked at: a bound on any event missed. Not after the spin's zero-time looks.
        if n == 0 && has_streams && wait_ms != 0 {
            for reg in guard.regs.values_mut() {
                if reg.ready_fd.is_some() {
                    let events = evaluate(inner, reg, 0);
                    if events != 0 {
                        merge(&mut got, reg.conn.id, events, reg.data);
                    }
                }
            }
        }
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
                KICK => {
                    let mut counter = [0u8; 8];
                    let _ = rustix::io::read(&guard.kick, &mut counter);
                    for reg in guard.regs.values_mut() {
                        let events = evaluate(inner, reg, 0);
                        if events != 0 {
                            merge(&mut got, reg.conn.id, events, reg.data);
                        }
                    }
                }
                token => {
                    let id = token >> 1;
                    let tcp = if token & 1 == 0 { events } else { 0 };
                    if let Some(reg) = guard.regs.get_mut(&id) {
                        let events = evaluate(inner, reg, tcp);
                        if events != 0 {
                            merge(&mut got, id, events, reg.data);
                        }
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
