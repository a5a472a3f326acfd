//! The data calls on a tracked connection: each tries without waiting under the
//! connection's lock, and a blocking caller then waits (lock released) on what
//! [`crate::conn::State::wait_set`] names, in slices while a pairing may still change the
//! picture.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use libc::c_int;

use crate::conn::{Conn, Io};
use crate::real;

/// How long a blocked call on a switched connection retries (yielding the core between
/// tries) before it sleeps: a sleep and a wake-up cost tens of µs here, a stream message a
/// microsecond. `LIGHTPATH_PRELOAD_SPIN_US` sets it (0: sleep at once).
pub(crate) fn spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("LIGHTPATH_PRELOAD_SPIN_US").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
        Duration::from_micros(us)
    })
}

/// Retries while a spin lasts: true to try again now.
fn keep_spinning(conn: &Conn, until: &mut Option<Instant>) -> bool {
    let now = Instant::now();
    let limit = *until.get_or_insert_with(|| if conn.lock().stream.is_some() { now + spin() } else { now });
    if now < limit {
        std::thread::yield_now();
        return true;
    }
    false
}

/// Longest single wait before a blocked call looks at the connection again.
const SLICE_MS: c_int = 10;
/// Even with nothing pending, a blocked call looks again this often (see `crate::wait`'s
/// note on missed wake-ups).
const IDLE_SLICE_MS: c_int = 100;

fn wait(conn: &Conn, fd: c_int, read: bool, write: bool) -> Result<(), c_int> {
    let (set, transient) = {
        let mut state = conn.lock();
        if state.closed {
            return Err(libc::EBADF);
        }
        let transient = state.phase.transient() || (state.tcp_eof && state.switch_at.is_none());
        (state.wait_set(fd, read, write), transient)
    };
    let Some(set) = set else { return Ok(()) };
    let mut fds: Vec<libc::pollfd> =
        set.iter().map(|&(fd, events)| libc::pollfd { fd, events, revents: 0 }).collect();
    let timeout = if transient { SLICE_MS } else { IDLE_SLICE_MS };
    // SAFETY: `fds` is a valid array of its length.
    let n = unsafe { real::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
    if n < 0 && real::errno() == libc::EINTR {
        return Err(libc::EINTR);
    }
    if read && fds.iter().any(|p| p.fd == fd && p.revents != 0) {
        // Late bytes (or the end) on a socket whose stream is still open: taken in, or the
        // socket would stay readable and the wait would not sleep again.
        conn.lock().take_late_tcp(fd);
    }
    Ok(())
}

/// recv(2) on a tracked connection.
pub(crate) fn recv(conn: &Arc<Conn>, fd: c_int, buf: &mut [u8], flags: c_int) -> Result<isize, c_int> {
    if !conn.owned() {
        return foreign(conn, fd);
    }
    let peek = flags & libc::MSG_PEEK != 0;
    let dont_wait = flags & libc::MSG_DONTWAIT != 0 || conn.nonblocking(fd);
    let wait_all = flags & libc::MSG_WAITALL != 0 && !dont_wait && !peek;
    let mut done = 0usize;
    let mut spin_until = None;
    loop {
        let attempt = {
            let mut state = conn.lock();
            state.offer(conn, fd);
            state.try_recv(fd, &mut buf[done..], peek)
        };
        match attempt {
            Io::Done(0) => return Ok(done as isize),
            Io::Done(n) => {
                done += n;
                if !wait_all || done == buf.len() {
                    return Ok(done as isize);
                }
            }
            Io::Err(errno) => return if done > 0 { Ok(done as isize) } else { Err(errno) },
            Io::WouldBlock if dont_wait => {
                return if done > 0 { Ok(done as isize) } else { Err(libc::EAGAIN) }
            }
            Io::WouldBlock if keep_spinning(conn, &mut spin_until) => {}
            Io::WouldBlock => wait(conn, fd, true, false)?,
        }
    }
}

/// send(2) on a tracked connection: a blocking caller gets everything sent (or an error).
pub(crate) fn send(conn: &Arc<Conn>, fd: c_int, data: &[u8], flags: c_int) -> Result<isize, c_int> {
    let dont_wait = flags & libc::MSG_DONTWAIT != 0 || conn.nonblocking(fd);
    send_waiting(conn, fd, data, flags, !dont_wait)
}

/// Sends all of `data` (or fails), waiting for room even on a nonblocking connection: for
/// bytes the library took from somewhere else on the application's behalf (a pipe, by
/// `splice`), which a short send would lose.
pub(crate) fn send_all(conn: &Arc<Conn>, fd: c_int, data: &[u8]) -> Result<isize, c_int> {
    send_waiting(conn, fd, data, 0, true)
}

fn send_waiting(
    conn: &Arc<Conn>,
    fd: c_int,
    data: &[u8],
    flags: c_int,
    may_wait: bool,
) -> Result<isize, c_int> {
    if !conn.owned() {
        return foreign(conn, fd);
    }
    let dont_wait = !may_wait;
    let mut done = 0usize;
    let mut spin_until = None;
    loop {
        let attempt = {
            let mut state = conn.lock();
            state.offer(conn, fd);
            state.try_send(fd, &data[done..], flags & !libc::MSG_DONTWAIT)
        };
        match attempt {
            Io::Done(n) => {
                done += n;
                if done == data.len() || dont_wait {
                    if flags & libc::MSG_MORE != 0 {
                        // What it left held goes after `CORK_LIMIT` if no send follows.
                        crate::conn::list_held(conn);
                    }
                    return Ok(done as isize);
                }
            }
            Io::Err(errno) => {
                if done > 0 {
                    return Ok(done as isize);
                }
                if errno == libc::EPIPE && flags & libc::MSG_NOSIGNAL == 0 {
                    // As TCP would: the writer gets SIGPIPE.
                    // SAFETY: raise has no preconditions.
                    unsafe { libc::raise(libc::SIGPIPE) };
                }
                return Err(errno);
            }
            Io::WouldBlock if dont_wait => {
                return if done > 0 { Ok(done as isize) } else { Err(libc::EAGAIN) }
            }
            Io::WouldBlock if keep_spinning(conn, &mut spin_until) => {}
            Io::WouldBlock => {
                if let Err(errno) = wait(conn, fd, false, true) {
                    return if done > 0 { Ok(done as isize) } else { Err(errno) };
                }
            }
        }
    }
}

/// A fork child touching a connection its parent owns: untouched TCP if the parent never
/// switched it, otherwise refused (the stream belongs to the parent's process). No lock: a
/// thread of the parent may have held it at the fork.
fn foreign(conn: &Conn, _fd: c_int) -> Result<isize, c_int> {
    if conn.was_streamed() {
        return Err(libc::EIO);
    }
    // Unswitched: the caller passes through (the hook sees this sentinel).
    Err(PASS)
}

/// Sentinel "errno": let the C library do the call.
pub(crate) const PASS: c_int = -4242;
