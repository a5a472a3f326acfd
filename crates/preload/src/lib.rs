//! `liblightpath_preload.so`: unmodified programs' TCP connections move to Lightpath streams
//! (RDMA over shm between processes of one host; soft between hosts that
//! `LIGHTPATH_PRELOAD_PEERS` names) when both ends run the library, and stay plain TCP
//! otherwise. Load it with `lightpath run -- CMD ARGS...` (or `LD_PRELOAD`).
//!
//! What is where:
//!
//! * the application's fd is always the kernel TCP socket: `getpeername`, `fstat`, socket
//!   options, `CLOEXEC`, inheritance and fd numbers are the kernel's. Nothing is ever sent on
//!   that socket that the application did not write, so a plain peer sees plain TCP;
//! * `rendezvous`: how the two ends of one connection find each other (an abstract Unix
//!   socket named after the connection's addresses) and negotiate a Lightpath stream;
//! * `remote`: the same across hosts: the peer rule, the UDP hello to the peer's rendezvous
//!   port and the relay that hands it to the end waiting on the abstract name;
//! * `conn`: the switch protocol (each direction moves to the stream at a byte offset the
//!   sender announces on the stream);
//! * `io`: the data calls; `epoll` and `wait` (`poll`/`select`): readiness;
//! * `report`: per-connection lines saying which transport each connection ended on.
//!
//! Intercepted (everything else, and every call on a descriptor that is not a tracked
//! TCP connection, goes to the C library untouched): `connect`, `accept`, `accept4`,
//! `read`, `write`, `readv`, `writev`, `recv`, `send`, `recvfrom`, `sendto`, `recvmsg`,
//! `sendmsg`, `__read_chk`, `__recv_chk`, `__recvfrom_chk`, `shutdown`, `close`,
//! `close_range`, `dup`, `dup2`, `dup3`, `fcntl`/`fcntl64` (`F_DUPFD`, `F_DUPFD_CLOEXEC`),
//! `ioctl` (`FIONREAD`), `poll`, `__poll_chk`, `ppoll`, `__ppoll_chk`, `select`, `pselect`,
//! `epoll_ctl`, `epoll_wait`, `epoll_pwait`, `epoll_pwait2`, `sendfile`, `sendfile64`,
//! `splice`, `setsockopt` (`TCP_CORK`), `execve`, `execv`, `execvp`, `execvpe`, `fexecve`
//! (switched connections send back on TCP first). Flags: `MSG_PEEK`, `MSG_WAITALL`, `MSG_DONTWAIT`,
//! `MSG_NOSIGNAL`, `MSG_TRUNC` (discards), `MSG_MORE` (holds until the next send).
//!
//! The library's own calls: the threads it starts mark themselves internal
//! (`guard`), the C library's functions are reached through `dlsym(RTLD_NEXT)`
//! (`real`), and no hook body lets a panic reach the C caller.

mod conn;
mod epoll;
mod guard;
mod handover;
mod io;
mod real;
mod remote;
mod rendezvous;
mod report;
mod table;
mod wait;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use libc::{c_char, fd_set, iovec, sigset_t, sockaddr, socklen_t, ssize_t, timespec, timeval};
use libc::{c_int, c_uint, c_ulong, c_void, epoll_event, msghdr, nfds_t, off_t, pollfd, size_t};

use crate::conn::Conn;
use crate::io::PASS;

/// The tracked connection behind `fd`; a fork child adopts a connection its parent never
/// used (without taking its lock, which a thread of the parent may have held at the fork).
fn tracked(fd: c_int) -> Option<Arc<Conn>> {
    let conn = table::conn(fd)?;
    if conn.owned() || conn.was_offered() {
        return Some(conn);
    }
    let adopted = Arc::new(Conn::new());
    if let Some(old) = table::insert(fd, Arc::clone(&adopted)) {
        // The parent's copy: never touched here.
        std::mem::forget(old);
    }
    Some(adopted)
}

/// Starts tracking a new TCP connection `fd` (after connect or accept).
fn track(fd: c_int) {
    if guard::internal() || rendezvous::why_not().is_some() || !conn::is_tcp(fd) {
        return;
    }
    if let Some(old) = table::insert(fd, Arc::new(Conn::new())) {
        forget_conn(old, fd);
    }
}

/// The application's fd `fd` for `conn` went away (close, dup2 over it, a reused number).
fn forget_conn(conn: Arc<Conn>, fd: c_int) {
    if conn.fds.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) != 1 {
        if conn.owned() {
            epoll::fd_gone(&conn, fd);
        }
        return;
    }
    if !conn.owned() {
        // A fork child's copy of its parent's connection: leave the parent's stream alone.
        std::mem::forget(conn);
        return;
    }
    let epolls = {
        let mut state = conn.lock();
        report::line(format_args!("closed {}", state.describe()));
        state.close();
        std::mem::take(&mut state.epolls)
    };
    epoll::conn_closed(&conn, &epolls);
}

/// Runs a data hook: `None` means "let the C library do it".
fn data_hook(body: impl FnOnce() -> Result<isize, c_int>) -> Option<isize> {
    let saved = real::errno();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => {
            real::set_errno(saved);
            Some(value)
        }
        Ok(Err(PASS)) => {
            real::set_errno(saved);
            None
        }
        Ok(Err(errno)) => {
            real::set_errno(errno);
            Some(-1)
        }
        Err(_) => {
            report::line(format_args!("internal panic caught at the C boundary; returning EIO"));
            real::set_errno(libc::EIO);
            Some(-1)
        }
    }
}

/// # Safety
/// `ptr` must be valid for `len` bytes (or `len` 0).
unsafe fn bytes_mut<'a>(ptr: *mut c_void, len: size_t) -> &'a mut [u8] {
    if ptr.is_null() || len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(ptr.cast(), len) }
}

/// # Safety
/// `ptr` must be valid for `len` bytes (or `len` 0).
unsafe fn bytes<'a>(ptr: *const c_void, len: size_t) -> &'a [u8] {
    if ptr.is_null() || len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(ptr.cast(), len) }
}

/// Most bytes one `MSG_TRUNC` receive discards (a larger request discards less: a short
/// read, as sockets may give).
const DISCARD_MAX: usize = 1 << 20;

/// A receive of up to `len` bytes into `buf`, as `recv` with `flags` takes it. With
/// `MSG_TRUNC` a TCP socket discards the bytes instead of copying them (`buf` may then be
/// null): they are read into a buffer of the library's and dropped.
///
/// # Safety
/// `buf` must be valid for `len` bytes unless `flags` has `MSG_TRUNC`.
unsafe fn recv_flags(
    conn: &Arc<Conn>,
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    flags: c_int,
) -> Result<isize, c_int> {
    if flags & libc::MSG_TRUNC != 0 {
        let mut discarded = vec![0u8; len.min(DISCARD_MAX)];
        let chunk_flags = flags & !libc::MSG_TRUNC;
        // In pieces of the buffer's size until `len` with MSG_WAITALL (not with MSG_PEEK,
        // which would see the same bytes again), once otherwise.
        let whole = flags & libc::MSG_WAITALL != 0 && flags & libc::MSG_PEEK == 0;
        let mut total = 0usize;
        loop {
            let want = (len - total).min(discarded.len());
            let got = match io::recv(conn, fd, &mut discarded[..want], chunk_flags) {
                Ok(got) => got as usize,
                Err(errno) if total == 0 => return Err(errno),
                Err(_) => return Ok(total as isize),
            };
            total += got;
            if got == 0 || total == len || !whole {
                return Ok(total as isize);
            }
        }
    }
    // SAFETY: the caller's contract.
    io::recv(conn, fd, unsafe { bytes_mut(buf, len) }, flags)
}

/// # Safety
/// `iov` must point at `count` valid iovecs.
unsafe fn iovecs<'a>(iov: *const iovec, count: c_int) -> &'a [iovec] {
    if iov.is_null() || count <= 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(iov, count as usize) }
}

/// Most bytes one vectored read gathers through a buffer of its own (a larger request reads
/// less: a short read, as sockets may give).
const SCATTER_MAX: usize = 1 << 20;

/// Reads into the buffers of `iov` in order, as `readv` does: one buffer directly; several
/// through one receive into a buffer of their total size (at most [`SCATTER_MAX`]), scattered
/// after, so one call fills as many of them as the data there is (`MSG_PEEK` and
/// `MSG_WAITALL` apply to the whole, as they do to a socket's `recvmsg`).
///
/// # Safety
/// `iov` must describe valid writable buffers.
unsafe fn recv_vectored(conn: &Arc<Conn>, fd: c_int, iov: &[iovec], flags: c_int) -> Result<isize, c_int> {
    if flags & libc::MSG_TRUNC != 0 {
        // Discarded: the buffers are not touched.
        let total = iov.iter().fold(0usize, |sum, v| sum.saturating_add(v.iov_len));
        // SAFETY: with MSG_TRUNC no buffer is written.
        return unsafe { recv_flags(conn, fd, std::ptr::null_mut(), total, flags) };
    }
    if iov.iter().any(|v| v.iov_len > 0 && v.iov_base.is_null()) {
        return Err(libc::EFAULT);
    }
    let mut buffers = iov.iter().filter(|v| v.iov_len > 0);
    let Some(first) = buffers.next() else { return Ok(0) };
    if buffers.next().is_none() {
        // SAFETY: the caller's contract.
        return io::recv(conn, fd, unsafe { bytes_mut(first.iov_base, first.iov_len) }, flags);
    }
    let total = iov.iter().fold(0usize, |sum, v| sum.saturating_add(v.iov_len)).min(SCATTER_MAX);
    let mut gathered = vec![0u8; total];
    let received = io::recv(conn, fd, &mut gathered, flags)?;
    let mut rest = &gathered[..usize::try_from(received).unwrap_or(0)];
    for v in iov {
        if rest.is_empty() {
            break;
        }
        let take = v.iov_len.min(rest.len());
        // SAFETY: the caller's contract (`take` is within the buffer, possibly 0).
        lightpath_verbs::copy::copy_bytes(unsafe { bytes_mut(v.iov_base, take) }, &rest[..take]);
        rest = &rest[take..];
    }
    Ok(received)
}

/// Sends the buffers of `iov`, gathered.
///
/// # Safety
/// `iov` must describe valid readable buffers.
unsafe fn send_vectored(conn: &Arc<Conn>, fd: c_int, iov: &[iovec], flags: c_int) -> Result<isize, c_int> {
    let total: usize = iov.iter().map(|v| v.iov_len).sum();
    let mut gathered = Vec::with_capacity(total);
    for v in iov {
        // SAFETY: the caller's contract.
        gathered.extend_from_slice(unsafe { bytes(v.iov_base, v.iov_len) });
    }
    io::send(conn, fd, &gathered, flags)
}

// ---------------------------------------------------------------------------------------
// Connection set-up and teardown.

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: the caller's contract.
    let rc = unsafe { real::connect(fd, addr, len) };
    if (rc == 0 || real::errno() == libc::EINPROGRESS) && !table::maybe_tracked(fd) {
        let saved = real::errno();
        let _ = catch_unwind(|| track(fd));
        real::set_errno(saved);
    }
    rc
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: the caller's contract.
    let new = unsafe { real::accept(fd, addr, len) };
    if new >= 0 {
        let saved = real::errno();
        let _ = catch_unwind(|| track(new));
        real::set_errno(saved);
    }
    new
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    // SAFETY: the caller's contract.
    let new = unsafe { real::accept4(fd, addr, len, flags) };
    if new >= 0 {
        let saved = real::errno();
        let _ = catch_unwind(|| track(new));
        real::set_errno(saved);
    }
    new
}

/// The library's side of closing `fd` (before the C library closes it).
fn on_close(fd: c_int) {
    if table::maybe_tracked(fd) {
        let saved = real::errno();
        let _ = catch_unwind(|| {
            if let Some(conn) = table::remove(fd) {
                forget_conn(conn, fd);
            }
        });
        real::set_errno(saved);
    }
    if table::maybe_shadowed(fd) {
        let _ = catch_unwind(|| epoll::epoll_closed(fd));
    }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    on_close(fd);
    // SAFETY: the caller's contract.
    unsafe { real::close(fd) }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if flags & (libc::CLOSE_RANGE_CLOEXEC as c_int) == 0 && !guard::internal() {
        let high = last.min(table::FAST as c_uint * 4);
        for fd in first..=high {
            on_close(fd as c_int);
        }
    }
    // SAFETY: the caller's contract.
    unsafe { real::close_range(first, last, flags) }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if let Some(conn) = tracked(fd) {
        if conn.owned() {
            let _ = catch_unwind(AssertUnwindSafe(|| conn.lock().shutdown(how)));
        }
    }
    // SAFETY: the caller's contract.
    unsafe { real::shutdown(fd, how) }
}

/// TCP_CORK on a switched connection holds its stream's writes too (one record for a header
/// and the body that follows, as the kernel sends one segment), see `State::set_corked`.
/// Everything else, and TCP_CORK itself, goes to the socket as it is.
///
/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    value: *const c_void,
    len: socklen_t,
) -> c_int {
    // SAFETY: the caller's contract.
    let result = unsafe { real::setsockopt(fd, level, name, value, len) };
    let cork = level == libc::IPPROTO_TCP
        && name == libc::TCP_CORK
        && result == 0
        && !value.is_null()
        && len as usize >= std::mem::size_of::<c_int>();
    if cork {
        if let Some(conn) = tracked(fd).filter(|conn| conn.owned()) {
            // SAFETY: the kernel just read a c_int there (the call succeeded with this length).
            let on = unsafe { value.cast::<c_int>().read_unaligned() } != 0;
            let errno = real::errno();
            let _ = catch_unwind(AssertUnwindSafe(|| conn::set_corked(&conn, on)));
            real::set_errno(errno);
        }
    }
    result
}

/// `new` names the same connection as `old` (dup family).
fn on_dup(old: c_int, new: c_int) {
    if new < 0 || new == old {
        return;
    }
    if let Some(conn) = tracked(old) {
        conn.fds.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        if let Some(replaced) = table::insert(new, conn) {
            forget_conn(replaced, new);
        }
    }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: the caller's contract.
    let new = unsafe { real::dup(fd) };
    if table::maybe_tracked(fd) {
        let saved = real::errno();
        let _ = catch_unwind(|| on_dup(fd, new));
        real::set_errno(saved);
    }
    new
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if old != new {
        on_close(new);
    }
    // SAFETY: the caller's contract.
    let rc = unsafe { real::dup2(old, new) };
    if rc >= 0 && table::maybe_tracked(old) {
        let saved = real::errno();
        let _ = catch_unwind(|| on_dup(old, rc));
        real::set_errno(saved);
    }
    rc
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    if old != new {
        on_close(new);
    }
    // SAFETY: the caller's contract.
    let rc = unsafe { real::dup3(old, new, flags) };
    if rc >= 0 && table::maybe_tracked(old) {
        let saved = real::errno();
        let _ = catch_unwind(|| on_dup(old, rc));
        real::set_errno(saved);
    }
    rc
}

fn fcntl_common(fd: c_int, cmd: c_int, arg: libc::c_long, large: bool) -> c_int {
    // SAFETY: the caller's arguments, passed on as given.
    let rc = unsafe {
        if large {
            real::fcntl64(fd, cmd, arg)
        } else {
            real::fcntl(fd, cmd, arg)
        }
    };
    if rc >= 0 && (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) && table::maybe_tracked(fd) {
        let saved = real::errno();
        let _ = catch_unwind(|| on_dup(fd, rc));
        real::set_errno(saved);
    }
    if cmd == libc::F_SETFL {
        flags_changed(fd);
    }
    rc
}

/// `fd`'s file status flags may have changed (`F_SETFL`, `FIONBIO`): a tracked connection
/// forgets whether it is nonblocking.
fn flags_changed(fd: c_int) {
    if table::maybe_tracked(fd) {
        let saved = real::errno();
        let _ = catch_unwind(|| {
            if let Some(conn) = tracked(fd) {
                conn.forget_nonblocking();
            }
        });
        real::set_errno(saved);
    }
}

/// `fcntl(fd, cmd, ...)`: the third argument is read as a long, which on the supported
/// (x86-64, aarch64) ABIs carries an int or a pointer alike.
///
/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: libc::c_long) -> c_int {
    fcntl_common(fd, cmd, arg, false)
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: libc::c_long) -> c_int {
    fcntl_common(fd, cmd, arg, true)
}

/// `ioctl(fd, request, ...)`: `FIONREAD` on a switched connection counts the stream's bytes.
///
/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: c_ulong, arg: *mut c_void) -> c_int {
    if request == libc::FIONREAD as c_ulong && !arg.is_null() {
        if let Some(conn) = tracked(fd).filter(|conn| conn.owned()) {
            let answer = guard::hook(None, || {
                let mut state = conn.lock();
                let late = state.late_pending();
                if late > 0 {
                    // Read before the socket's own bytes.
                    return Ok(Some(late.min(c_int::MAX as usize) as c_int));
                }
                if !state.peeked.is_empty() || state.stream.is_some() && !state.tcp_readable_matters() {
                    if state.peeked.is_empty() {
                        let mut chunk = vec![0u8; 64 << 10];
                        if let conn::Io::Done(n) = state.try_recv(fd, &mut chunk, true) {
                            chunk.truncate(n);
                        }
                    }
                    return Ok(Some(state.peeked.len().min(c_int::MAX as usize) as c_int));
                }
                Ok(None)
            });
            if let Some(count) = answer {
                // SAFETY: FIONREAD's argument is an int the caller provides.
                unsafe { *arg.cast::<c_int>() = count };
                return 0;
            }
        }
    }
    // SAFETY: the caller's contract.
    let rc = unsafe { real::ioctl(fd, request, arg) };
    if request == libc::FIONBIO as c_ulong {
        flags_changed(fd);
    }
    rc
}

// ---------------------------------------------------------------------------------------
// Data.

macro_rules! data {
    ($fd:expr, $body:expr, $fallback:expr) => {{
        if let Some(conn) = tracked($fd) {
            #[allow(clippy::redundant_closure_call)]
            if let Some(result) = data_hook(|| $body(&conn)) {
                return result;
            }
        }
        $fallback
    }};
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, count: size_t) -> ssize_t {
    // SAFETY: the caller's contract.
    data!(fd, |c| io::recv(c, fd, unsafe { bytes_mut(buf, count) }, 0), unsafe { real::read(fd, buf, count) })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, count: size_t, buflen: size_t) -> ssize_t {
    if count > buflen {
        // SAFETY: the C library reports the overflow.
        return unsafe { real::__read_chk(fd, buf, count, buflen) };
    }
    // SAFETY: the caller's contract.
    data!(fd, |c| io::recv(c, fd, unsafe { bytes_mut(buf, count) }, 0), unsafe {
        real::__read_chk(fd, buf, count, buflen)
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, count: size_t) -> ssize_t {
    // SAFETY: the caller's contract.
    data!(fd, |c| io::send(c, fd, unsafe { bytes(buf, count) }, 0), unsafe { real::write(fd, buf, count) })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, count: c_int) -> ssize_t {
    // SAFETY: the caller's contract.
    data!(fd, |c| unsafe { recv_vectored(c, fd, iovecs(iov, count), 0) }, unsafe {
        real::readv(fd, iov, count)
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, count: c_int) -> ssize_t {
    // SAFETY: the caller's contract.
    data!(fd, |c| unsafe { send_vectored(c, fd, iovecs(iov, count), 0) }, unsafe {
        real::writev(fd, iov, count)
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, len: size_t, flags: c_int) -> ssize_t {
    // SAFETY: the caller's contract.
    data!(fd, |c| unsafe { recv_flags(c, fd, buf, len, flags) }, unsafe { real::recv(fd, buf, len, flags) })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if len > buflen {
        // SAFETY: the C library reports the overflow.
        return unsafe { real::__recv_chk(fd, buf, len, buflen, flags) };
    }
    // SAFETY: the caller's contract.
    data!(fd, |c| unsafe { recv_flags(c, fd, buf, len, flags) }, unsafe {
        real::__recv_chk(fd, buf, len, buflen, flags)
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, len: size_t, flags: c_int) -> ssize_t {
    // SAFETY: the caller's contract.
    data!(fd, |c| io::send(c, fd, unsafe { bytes(buf, len) }, flags), unsafe {
        real::send(fd, buf, len, flags)
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    addrlen: *mut socklen_t,
) -> ssize_t {
    // SAFETY: the caller's contract.
    data!(fd, |c| unsafe { recv_flags(c, fd, buf, len, flags) }, unsafe {
        real::recvfrom(fd, buf, len, flags, addr, addrlen)
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    addrlen: *mut socklen_t,
) -> ssize_t {
    if len > buflen {
        // SAFETY: the C library reports the overflow.
        return unsafe { real::__recvfrom_chk(fd, buf, len, buflen, flags, addr, addrlen) };
    }
    // SAFETY: the caller's contract.
    data!(fd, |c| unsafe { recv_flags(c, fd, buf, len, flags) }, unsafe {
        real::__recvfrom_chk(fd, buf, len, buflen, flags, addr, addrlen)
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    len: size_t,
    flags: c_int,
    addr: *const sockaddr,
    addrlen: socklen_t,
) -> ssize_t {
    // SAFETY: the caller's contract.
    data!(fd, |c| io::send(c, fd, unsafe { bytes(buf, len) }, flags), unsafe {
        real::sendto(fd, buf, len, flags, addr, addrlen)
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    if msg.is_null() {
        // SAFETY: the C library reports the bad pointer.
        return unsafe { real::recvmsg(fd, msg, flags) };
    }
    data!(
        fd,
        |c| {
            // SAFETY: the caller's msghdr.
            let header = unsafe { &mut *msg };
            header.msg_controllen = 0;
            header.msg_flags = 0;
            // SAFETY: the caller's iovecs.
            unsafe { recv_vectored(c, fd, iovecs(header.msg_iov, header.msg_iovlen as c_int), flags) }
        },
        // SAFETY: the caller's contract.
        unsafe { real::recvmsg(fd, msg, flags) }
    )
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    if msg.is_null() {
        // SAFETY: the C library reports the bad pointer.
        return unsafe { real::sendmsg(fd, msg, flags) };
    }
    data!(
        fd,
        |c| {
            // SAFETY: the caller's msghdr.
            let header = unsafe { &*msg };
            // SAFETY: the caller's iovecs.
            unsafe { send_vectored(c, fd, iovecs(header.msg_iov, header.msg_iovlen as c_int), flags) }
        },
        // SAFETY: the caller's contract.
        unsafe { real::sendmsg(fd, msg, flags) }
    )
}

/// sendfile onto a switched connection: read from the file, write to the stream.
fn sendfile_common(out: c_int, input: c_int, offset: *mut off_t, count: size_t, large: bool) -> ssize_t {
    let fallback = || {
        // SAFETY: the caller's arguments, passed on.
        unsafe {
            if large {
                real::sendfile64(out, input, offset, count)
            } else {
                real::sendfile(out, input, offset, count)
            }
        }
    };
    let Some(conn) = tracked(out) else { return fallback() };
    let result = data_hook(|| {
        if !conn.owned() {
            return Err(PASS);
        }
        {
            let mut state = conn.lock();
            state.offer(&conn, out);
            if !state.send_switched {
                // Counted under the lock, so the switch point stays exact.
                let sent = fallback();
                if sent < 0 {
                    return Err(real::errno());
                }
                state.tcp_sent += sent as u64;
                return Ok(sent);
            }
        }
        // SAFETY: offset, if given, is the caller's off_t.
        let position = if offset.is_null() {
            // SAFETY: lseek on the caller's fd has no memory preconditions.
            unsafe { libc::lseek(input, 0, libc::SEEK_CUR) }
        } else {
            // SAFETY: a non-null offset is the caller's off_t.
            unsafe { *offset }
        };
        if position < 0 {
            return Err(real::errno());
        }
        let mut chunk = vec![0u8; count.min(256 << 10)];
        // SAFETY: `chunk` is writable for its length.
        let got = unsafe { libc::pread(input, chunk.as_mut_ptr().cast(), chunk.len(), position) };
        if got <= 0 {
            return if got == 0 { Ok(0) } else { Err(real::errno()) };
        }
        let sent = io::send(&conn, out, &chunk[..got as usize], 0)?;
        let next = position + sent as off_t;
        if offset.is_null() {
            // SAFETY: plain lseek on the caller's fd.
            unsafe { libc::lseek(input, next, libc::SEEK_SET) };
        } else {
            // SAFETY: the caller's off_t.
            unsafe { *offset = next };
        }
        Ok(sent)
    });
    result.unwrap_or_else(fallback)
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, input: c_int, offset: *mut off_t, count: size_t) -> ssize_t {
    sendfile_common(out, input, offset, count, false)
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, input: c_int, offset: *mut off_t, count: size_t) -> ssize_t {
    sendfile_common(out, input, offset, count, true)
}

/// Most bytes one `splice` to or from a tracked connection moves (a larger request moves
/// less, as a pipe's capacity limits `splice` too).
const SPLICE_MAX: usize = 64 << 10;

/// Whether `fd` is ready for `events` now (`poll` with no wait).
fn ready_now(fd: c_int, events: libc::c_short) -> bool {
    let mut probe = pollfd { fd, events, revents: 0 };
    // SAFETY: one valid pollfd.
    unsafe { real::poll(&mut probe, 1, 0) > 0 && probe.revents & events != 0 }
}

/// Reads up to `buf.len()` bytes of `fd` at `*offset` (then advanced), or at its file
/// position when `offset` is null.
///
/// # Safety
/// `offset` is null or the caller's valid `loff_t`.
unsafe fn read_at(fd: c_int, offset: *mut libc::loff_t, buf: &mut [u8]) -> Result<usize, c_int> {
    let got = if offset.is_null() {
        // SAFETY: `buf` is writable for its length.
        unsafe { real::read(fd, buf.as_mut_ptr().cast(), buf.len()) }
    } else {
        // SAFETY: as above; a non-null offset is the caller's.
        let got = unsafe { libc::pread64(fd, buf.as_mut_ptr().cast(), buf.len(), *offset) };
        if got > 0 {
            // SAFETY: the caller's offset.
            unsafe { *offset += got as libc::loff_t };
        }
        got
    };
    if got < 0 {
        Err(real::errno())
    } else {
        Ok(got as usize)
    }
}

/// Writes `data` to `fd` at `*offset` (then advanced), or at its file position when
/// `offset` is null; may write less (a nonblocking pipe with less room).
///
/// # Safety
/// `offset` is null or the caller's valid `loff_t`.
unsafe fn write_at(fd: c_int, offset: *mut libc::loff_t, data: &[u8]) -> Result<usize, c_int> {
    let put = if offset.is_null() {
        // SAFETY: `data` is readable for its length.
        unsafe { real::write(fd, data.as_ptr().cast(), data.len()) }
    } else {
        // SAFETY: as above; a non-null offset is the caller's.
        let put = unsafe { libc::pwrite64(fd, data.as_ptr().cast(), data.len(), *offset) };
        if put > 0 {
            // SAFETY: the caller's offset.
            unsafe { *offset += put as libc::loff_t };
        }
        put
    };
    if put < 0 {
        Err(real::errno())
    } else {
        Ok(put as usize)
    }
}

/// `splice` from a tracked connection into `out` (a pipe): the bytes are peeked, written,
/// and only what was written is taken from the connection, so a pipe with less room loses
/// nothing. The connection's own mode decides whether the read waits, `SPLICE_F_NONBLOCK`
/// whether the pipe's side does (as the kernel's splice).
///
/// # Safety
/// `off_out` is null or the caller's valid `loff_t`.
unsafe fn splice_from(
    conn: &Arc<Conn>,
    fd: c_int,
    out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: c_uint,
) -> Result<isize, c_int> {
    if len == 0 {
        return Ok(0);
    }
    if flags & libc::SPLICE_F_NONBLOCK != 0 && !ready_now(out, libc::POLLOUT) {
        return Err(libc::EAGAIN);
    }
    let mut chunk = vec![0u8; len.min(SPLICE_MAX)];
    let peeked = io::recv(conn, fd, &mut chunk, libc::MSG_PEEK)? as usize;
    if peeked == 0 {
        return Ok(0);
    }
    // SAFETY: the caller's offset.
    let written = unsafe { write_at(out, off_out, &chunk[..peeked]) }?;
    let taken = io::recv(conn, fd, &mut chunk[..written], libc::MSG_DONTWAIT)?;
    Ok(taken)
}

/// `splice` from `input` (a pipe, or a file at `off_in`) into a tracked connection: what is
/// read is sent whole, waiting for room if the connection is nonblocking (a short send would
/// lose bytes already taken from the pipe).
///
/// # Safety
/// `off_in` is null or the caller's valid `loff_t`.
unsafe fn splice_to(
    conn: &Arc<Conn>,
    fd: c_int,
    input: c_int,
    off_in: *mut libc::loff_t,
    len: size_t,
    flags: c_uint,
) -> Result<isize, c_int> {
    if len == 0 {
        return Ok(0);
    }
    if flags & libc::SPLICE_F_NONBLOCK != 0 && !ready_now(input, libc::POLLIN) {
        return Err(libc::EAGAIN);
    }
    let mut chunk = vec![0u8; len.min(SPLICE_MAX)];
    // SAFETY: the caller's offset.
    let got = unsafe { read_at(input, off_in, &mut chunk) }?;
    if got == 0 {
        return Ok(0);
    }
    io::send_all(conn, fd, &chunk[..got])
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    // SAFETY: the caller's arguments, passed on.
    let fallback = || unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) };
    let (from, to) = (tracked(fd_in), tracked(fd_out));
    if from.is_none() && to.is_none() {
        return fallback();
    }
    // Before and after the switch alike, so that TCP bytes are counted for the switch point.
    let result = data_hook(|| match (&from, &to) {
        // Neither end is a pipe: the kernel refuses that too.
        (Some(_), Some(_)) => Err(libc::EINVAL),
        // A socket has no offset.
        (Some(_), None) if !off_in.is_null() => Err(libc::ESPIPE),
        (None, Some(_)) if !off_out.is_null() => Err(libc::ESPIPE),
        // SAFETY: the caller's offset.
        (Some(conn), None) => unsafe { splice_from(conn, fd_in, fd_out, off_out, len, flags) },
        // SAFETY: the caller's offset.
        (None, Some(conn)) => unsafe { splice_to(conn, fd_out, fd_in, off_in, len, flags) },
        (None, None) => Err(PASS),
    });
    result.unwrap_or_else(fallback)
}

// ---------------------------------------------------------------------------------------
// Readiness: poll, select, epoll.

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, nfds: nfds_t, timeout: c_int) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { wait::poll(fds, nfds, wait::Timeout::Ms(timeout), std::ptr::null()) }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn __poll_chk(fds: *mut pollfd, nfds: nfds_t, timeout: c_int, fdslen: size_t) -> c_int {
    if fdslen / std::mem::size_of::<pollfd>() < nfds as usize {
        // SAFETY: the C library reports the overflow.
        return unsafe { real::__poll_chk(fds, nfds, timeout, fdslen) };
    }
    // SAFETY: the caller's contract.
    unsafe { wait::poll(fds, nfds, wait::Timeout::Ms(timeout), std::ptr::null()) }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    nfds: nfds_t,
    timeout: *const timespec,
    sigmask: *const sigset_t,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { wait::poll(fds, nfds, wait::Timeout::from_timespec(timeout), sigmask) }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    nfds: nfds_t,
    timeout: *const timespec,
    sigmask: *const sigset_t,
    fdslen: size_t,
) -> c_int {
    if fdslen / std::mem::size_of::<pollfd>() < nfds as usize {
        // SAFETY: the C library reports the overflow.
        return unsafe { real::__ppoll_chk(fds, nfds, timeout, sigmask, fdslen) };
    }
    // SAFETY: the caller's contract.
    unsafe { wait::poll(fds, nfds, wait::Timeout::from_timespec(timeout), sigmask) }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    timeout: *mut timeval,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe {
        wait::select(nfds, r, w, e, wait::Timeout::from_timeval(timeout), std::ptr::null(), || {
            real::select(nfds, r, w, e, timeout)
        })
    }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    timeout: *const timespec,
    sigmask: *const sigset_t,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe {
        wait::select(nfds, r, w, e, wait::Timeout::from_timespec(timeout), sigmask, || {
            real::pselect(nfds, r, w, e, timeout, sigmask)
        })
    }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, event: *mut epoll_event) -> c_int {
    if let Some(conn) = tracked(fd) {
        if conn.owned() {
            // SAFETY: the caller's event, if any.
            let event = unsafe { event.as_ref() };
            return guard::hook(-1, || epoll::ctl(epfd, op, fd, &conn, event));
        }
    }
    // SAFETY: the caller's contract.
    unsafe { real::epoll_ctl(epfd, op, fd, event) }
}

/// # Safety
/// `events` must hold `max` entries.
unsafe fn epoll_common(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    sigmask: *const sigset_t,
) -> Option<c_int> {
    if !table::maybe_shadowed(epfd) || events.is_null() || max <= 0 {
        return None;
    }
    // SAFETY: the caller's buffer of `max` events.
    let out = unsafe { std::slice::from_raw_parts_mut(events, max as usize) };
    Some(guard::hook(-1, || epoll::wait(epfd, out, timeout, sigmask)))
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: the caller's contract.
    if let Some(n) = unsafe { epoll_common(epfd, events, max, timeout, std::ptr::null()) } {
        return n;
    }
    // SAFETY: the caller's contract.
    unsafe { real::epoll_wait(epfd, events, max, timeout) }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    sigmask: *const sigset_t,
) -> c_int {
    // SAFETY: the caller's contract.
    if let Some(n) = unsafe { epoll_common(epfd, events, max, timeout, sigmask) } {
        return n;
    }
    // SAFETY: the caller's contract.
    unsafe { real::epoll_pwait(epfd, events, max, timeout, sigmask) }
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: *const timespec,
    sigmask: *const sigset_t,
) -> c_int {
    // SAFETY: the caller's timespec, if any.
    let ms = unsafe { wait::Timeout::from_timespec(timeout) }.as_ms();
    // SAFETY: the caller's contract.
    if let Some(n) = unsafe { epoll_common(epfd, events, max, ms, sigmask) } {
        return n;
    }
    // SAFETY: the caller's contract.
    unsafe { real::epoll_pwait2(epfd, events, max, timeout, sigmask) }
}

// ---------------------------------------------------------------------------------------
// execve: the new program knows nothing of the streams; this process's switched connections
// send back on TCP first (see `State::send_back`), so what the new program writes on an
// inherited socket reaches the peer after everything written before.

/// How long an exec waits for a connection's peer to acknowledge what was written before.
const EXEC_FLUSH_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Sends every switched connection of this process back on TCP, before an `execve`. Not in a
/// `vfork` child (it shares the parent's memory and would take the parent's streams: its
/// pid differs from the owner's, asked of the kernel, not of the cache the child shares), nor
/// for a fork child's copies (their streams are the parent's).
fn before_exec() -> handover::Handover {
    if guard::internal() {
        return handover::Handover::default();
    }
    catch_unwind(|| {
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() } as u32;
        handover::Handover::prepare(me, EXEC_FLUSH_LIMIT)
    })
    .unwrap_or_default()
}

/// Runs an exec (`exec` with the environment to pass, `None`: the caller's own), with the
/// handover's environment when there is one; if the exec returns (it failed), the handover
/// is abandoned and the C library's errno kept.
fn exec_with(envp: *const *const c_char, exec: impl FnOnce(Option<*const *const c_char>) -> c_int) -> c_int {
    let handover = before_exec();
    // SAFETY: the caller's environment array (or null: the process's).
    let environment = unsafe { handover.environment(envp) };
    let rc = exec(environment.as_ref().map(|env| env.as_ptr()));
    let errno = real::errno();
    handover.abandon();
    real::set_errno(errno);
    rc
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the caller's contract; the handover's environment lives through the call.
    exec_with(envp, |env| unsafe { real::execve(path, argv, env.unwrap_or(envp)) })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: as `execve`; with nothing to hand over, the C library's own `execv`.
    exec_with(std::ptr::null(), |env| unsafe {
        match env {
            Some(env) => real::execve(path, argv, env),
            None => real::execv(path, argv),
        }
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: as `execv`.
    exec_with(std::ptr::null(), |env| unsafe {
        match env {
            Some(env) => real::execvpe(file, argv, env),
            None => real::execvp(file, argv),
        }
    })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: as `execve`.
    exec_with(envp, |env| unsafe { real::execvpe(file, argv, env.unwrap_or(envp)) })
}

/// # Safety
/// The C function's contract.
#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    // SAFETY: as `execve`.
    exec_with(envp, |env| unsafe { real::fexecve(fd, argv, env.unwrap_or(envp)) })
}

// ---------------------------------------------------------------------------------------
// Process exit: connections still open close cleanly (their last bytes delivered) and are
// reported.

extern "C" fn at_exit() {
    let _ = catch_unwind(|| {
        for (fd, conn) in table::all() {
            if !conn.owned() {
                std::mem::forget(conn);
                continue;
            }
            let mut state = conn.lock();
            report::line(format_args!("at exit fd={fd} {}", state.describe()));
            if state.send_switched {
                state.close_and_wait();
            }
        }
    });
}

extern "C" fn init() {
    // Read the environment now: servers such as nginx clear it before their workers run, and
    // a worker (a fork of this process) keeps what was read here. Every setting the library
    // reads is cached on first use; these are all of them.
    table::guard_forks();
    let _ = catch_unwind(|| {
        report::init();
        handover::adopt();
        let _ = rendezvous::why_not();
        let _ = remote::rule();
        let _ = remote::port();
        let _ = io::spin();
    });
    // SAFETY: registering a handler with no preconditions.
    unsafe { libc::atexit(at_exit) };
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;
