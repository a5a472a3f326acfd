//! `poll`/`ppoll` and `select`/`pselect` with tracked connections among the descriptors.
//!
//! Calls without a tracked connection go straight to the C library. Otherwise each tracked
//! connection is watched through what still matters of its TCP socket plus its stream's
//! readiness fd; what the stream can do now (`poll_ready`) is folded into the results, and a
//! wait on a connection whose pairing is under way is cut into short slices.

use std::sync::Arc;
use std::time::{Duration, Instant};

use libc::{c_int, fd_set, nfds_t, pollfd, sigset_t, timespec, timeval};

use crate::conn::Conn;
use crate::{real, table};

const SLICE_MS: c_int = 10;
/// A wait with switched connections looks at them again at least this often. Known bug:
/// under several threads with connections on one shm device a stream's wake-up is
/// occasionally not seen by a waiter (seen with memcslap); re-examining bounds the stall.
pub(crate) const RECHECK_MS: c_int = 100;

/// A wait's limit.
#[derive(Clone, Copy)]
pub(crate) enum Timeout {
    Ms(c_int),
}

impl Timeout {
    /// # Safety
    /// `ts` null or a valid timespec.
    pub(crate) unsafe fn from_timespec(ts: *const timespec) -> Timeout {
        // SAFETY: the caller's contract.
        match unsafe { ts.as_ref() } {
            None => Timeout::Ms(-1),
            Some(ts) => {
                let ms = ts.tv_sec.saturating_mul(1000) + (ts.tv_nsec + 999_999) / 1_000_000;
                Timeout::Ms(ms.clamp(0, c_int::MAX as i64) as c_int)
            }
        }
    }

    /// # Safety
    /// `tv` null or a valid timeval.
    pub(crate) unsafe fn from_timeval(tv: *const timeval) -> Timeout {
        // SAFETY: the caller's contract.
        match unsafe { tv.as_ref() } {
            None => Timeout::Ms(-1),
            Some(tv) => {
                let ms = tv.tv_sec.saturating_mul(1000) + (tv.tv_usec + 999) / 1000;
                Timeout::Ms(ms.clamp(0, c_int::MAX as i64) as c_int)
            }
        }
    }

    pub(crate) fn as_ms(self) -> c_int {
        let Timeout::Ms(ms) = self;
        ms
    }
}

/// # Safety
/// `fds` must hold `nfds` entries; `sigmask` null or valid.
pub(crate) unsafe fn poll(
    fds: *mut pollfd,
    nfds: nfds_t,
    timeout: Timeout,
    sigmask: *const sigset_t,
) -> c_int {
    let real_poll = |fds: *mut pollfd, nfds: nfds_t, ms: c_int| -> c_int {
        if sigmask.is_null() {
            // SAFETY: the caller's array.
            unsafe { real::poll(fds, nfds, ms) }
        } else {
            let ts = (ms >= 0).then(|| timespec {
                tv_sec: (ms / 1000) as _,
                tv_nsec: ((ms % 1000) as i64 * 1_000_000) as _,
            });
            let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const timespec);
            // SAFETY: the caller's array and mask.
            unsafe { real::ppoll(fds, nfds, ts_ptr, sigmask) }
        }
    };
    if fds.is_null() || nfds == 0 {
        return real_poll(fds, nfds, timeout.as_ms());
    }
    // SAFETY: the caller's array of `nfds` entries.
    let app = unsafe { std::slice::from_raw_parts_mut(fds, nfds as usize) };
    if !app.iter().any(|p| table::maybe_tracked(p.fd)) {
        return real_poll(fds, nfds, timeout.as_ms());
    }
    let conns: Vec<Option<Arc<Conn>>> =
        app.iter().map(|p| crate::tracked(p.fd).filter(|c| c.owned())).collect();
    if conns.iter().all(Option::is_none) {
        return real_poll(fds, nfds, timeout.as_ms());
    }
    let saved = real::errno();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        poll_tracked(app, &conns, timeout, &real_poll)
    }));
    match result {
        Ok(Ok(n)) => {
            real::set_errno(saved);
            n
        }
        Ok(Err(errno)) => {
            real::set_errno(errno);
            -1
        }
        Err(_) => {
            real::set_errno(libc::EIO);
            -1
        }
    }
}

fn poll_tracked(
    app: &mut [pollfd],
    conns: &[Option<Arc<Conn>>],
    timeout: Timeout,
    real_poll: &dyn Fn(*mut pollfd, nfds_t, c_int) -> c_int,
) -> Result<c_int, c_int> {
    let deadline =
        (timeout.as_ms() >= 0).then(|| Instant::now() + Duration::from_millis(timeout.as_ms() as u64));
    loop {
        let mut watch: Vec<pollfd> = Vec::with_capacity(app.len() + 4);
        let mut extra: Vec<pollfd> = Vec::new();
        let mut user = vec![0i16; app.len()];
        let mut tcp_asked = vec![0i16; app.len()];
        // Entries whose socket is watched for late bytes only (see `conn`): not the caller's.
        let mut late_watch = vec![false; app.len()];
        let mut transient = false;
        for (i, entry) in app.iter().enumerate() {
            let Some(conn) = &conns[i] else {
                watch.push(pollfd { fd: entry.fd, events: entry.events, revents: 0 });
                continue;
            };
            let mut state = conn.lock();
            state.offer(conn, entry.fd);
            transient |= state.phase.transient();
            let want_in = entry.events & libc::POLLIN != 0;
            let want_out = entry.events & libc::POLLOUT != 0;
            let (readable, writable) = state.stream_readiness();
            if want_in && readable {
                user[i] |= libc::POLLIN;
            }
            if want_out && writable {
                user[i] |= libc::POLLOUT;
            }
            let mut events = 0;
            if want_in && state.tcp_readable_matters() {
                events |= libc::POLLIN | (entry.events & libc::POLLRDHUP);
            }
            if want_out && !state.send_switched {
                events |= libc::POLLOUT;
            }
            tcp_asked[i] = events;
            late_watch[i] = want_in && state.late_tcp_watched();
            let watched = events | if late_watch[i] { libc::POLLIN } else { 0 };
            watch.push(pollfd { fd: entry.fd, events: watched, revents: 0 });
            if state.stream_watched(want_in, want_out) {
                if let Some(stream) = state.stream.as_ref() {
                    if let Ok(ready_fd) = stream.readiness_fd() {
                        use std::os::fd::AsRawFd;
                        extra.push(pollfd { fd: ready_fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                    }
                }
            }
        }
        watch.extend_from_slice(&extra);
        let any_user = user.iter().any(|u| *u != 0);
        let left = deadline.map(|d| {
            d.saturating_duration_since(Instant::now()).as_millis().min(c_int::MAX as u128) as c_int
        });
        let mut wait_ms = if any_user { 0 } else { left.unwrap_or(-1) };
        if transient && !(0..=SLICE_MS).contains(&wait_ms) {
            wait_ms = SLICE_MS;
        } else if !extra.is_empty() && !(0..=RECHECK_MS).contains(&wait_ms) {
            wait_ms = RECHECK_MS;
        }
        let n = real_poll(watch.as_mut_ptr(), watch.len() as nfds_t, wait_ms);
        if n < 0 {
            return Err(real::errno());
        }
        let mut count = 0;
        let mut extra_fired = false;
        for (i, entry) in app.iter_mut().enumerate() {
            let got = watch[i].revents;
            if late_watch[i] && got & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                if let Some(conn) = &conns[i] {
                    conn.lock().take_late_tcp(entry.fd);
                    // Taken in: the next round looks at the connection again.
                    extra_fired = true;
                }
            }
            let revents = if conns[i].is_some() {
                let mut r = got & (tcp_asked[i] | libc::POLLERR | libc::POLLNVAL);
                if got & libc::POLLHUP != 0 && tcp_asked[i] != 0 {
                    r |= libc::POLLHUP;
                }
                r | user[i]
            } else {
                got
            };
            entry.revents = revents;
            if revents != 0 {
                count += 1;
            }
        }
        if watch[app.len()..].iter().any(|p| p.revents != 0) {
            extra_fired = true;
        }
        if count > 0 {
            return Ok(count);
        }
        if extra_fired || !extra.is_empty() {
            // A stream woke us (or the re-check slice ended): look again.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(0);
            }
            continue;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(0);
        }
    }
}

fn fd_isset(set: *mut fd_set, fd: c_int) -> bool {
    // SAFETY: `set` is non-null here and the caller's fd_set; fd < FD_SETSIZE.
    !set.is_null() && unsafe { libc::FD_ISSET(fd, set) }
}

/// # Safety
/// The sets null or valid for `nfds` descriptors; `sigmask` null or valid.
pub(crate) unsafe fn select(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    timeout: Timeout,
    sigmask: *const sigset_t,
    fallback: impl FnOnce() -> c_int,
) -> c_int {
    let limit = nfds.clamp(0, libc::FD_SETSIZE as c_int);
    let mut any = false;
    for fd in 0..limit {
        if (fd_isset(r, fd) || fd_isset(w, fd)) && table::maybe_tracked(fd) {
            any = true;
            break;
        }
    }
    if !any {
        return fallback();
    }
    let mut fds = Vec::new();
    for fd in 0..limit {
        let mut events = 0;
        if fd_isset(r, fd) {
            events |= libc::POLLIN;
        }
        if fd_isset(w, fd) {
            events |= libc::POLLOUT;
        }
        if fd_isset(e, fd) {
            events |= libc::POLLPRI;
        }
        if events != 0 {
            fds.push(pollfd { fd, events, revents: 0 });
        }
    }
    // SAFETY: a local array.
    let n = unsafe { poll(fds.as_mut_ptr(), fds.len() as nfds_t, timeout, sigmask) };
    if n < 0 {
        return n;
    }
    for set in [r, w, e] {
        if !set.is_null() {
            // SAFETY: the caller's set.
            unsafe { libc::FD_ZERO(set) };
        }
    }
    let mut count = 0;
    for p in &fds {
        if p.revents & libc::POLLNVAL != 0 {
            real::set_errno(libc::EBADF);
            return -1;
        }
        let readable =
            p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 && p.events & libc::POLLIN != 0;
        let writable = p.revents & (libc::POLLOUT | libc::POLLERR) != 0 && p.events & libc::POLLOUT != 0;
        let exceptional = p.revents & libc::POLLPRI != 0;
        for (yes, set) in [(readable, r), (writable, w), (exceptional, e)] {
            if yes && !set.is_null() {
                // SAFETY: the caller's set; fd < FD_SETSIZE.
                unsafe { libc::FD_SET(p.fd, set) };
                count += 1;
            }
        }
    }
    count
}
