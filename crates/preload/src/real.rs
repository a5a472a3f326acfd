//! The C library's own functions, found with `dlsym(RTLD_NEXT)` on first use and cached.
//!
//! The preload defines `read`, `write`, `poll`, ... itself; every call inside this library
//! (the standard library's, the `lightpath` crate's) to those names lands in those
//! definitions, which pass untracked descriptors here. Nothing in this module allocates or
//! locks, so the pass-through path stays as cheap and signal-safe as libc's own.

use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{c_char, fd_set, iovec, sigset_t, sockaddr, socklen_t, ssize_t, timespec, timeval};
use libc::{c_int, c_long, c_uint, c_ulong, c_void, epoll_event, msghdr, nfds_t, off_t, pollfd, size_t};

/// Sets the calling thread's errno.
pub(crate) fn set_errno(value: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, valid for the
    // thread's life.
    unsafe { *libc::__errno_location() = value };
}

/// The calling thread's errno.
pub(crate) fn errno() -> c_int {
    // SAFETY: as in `set_errno`.
    unsafe { *libc::__errno_location() }
}

/// Looks `name` (NUL-terminated) up in the objects loaded after this one; 0 if absent.
fn lookup(slot: &AtomicUsize, name: &'static str) -> usize {
    let cached = slot.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    // SAFETY: `name` is a NUL-terminated literal (every caller appends "\0").
    let found = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) } as usize;
    slot.store(found, Ordering::Relaxed);
    found
}

macro_rules! real_fns {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty ; )*) => {
        $(
            /// The C library's function of this name.
            ///
            /// # Safety
            /// The same contract as the C function.
            pub(crate) unsafe fn $name($($arg: $ty),*) -> $ret {
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                let address = lookup(&SLOT, concat!(stringify!($name), "\0"));
                if address == 0 {
                    set_errno(libc::ENOSYS);
                    return -1 as $ret;
                }
                // SAFETY: `address` is the C library's definition of this very symbol, whose
                // C prototype the signature below spells.
                let function: unsafe extern "C" fn($($ty),*) -> $ret = unsafe { std::mem::transmute(address) };
                // SAFETY: the caller keeps the C function's contract.
                unsafe { function($($arg),*) }
            }
        )*
    };
}

real_fns! {
    fn read(fd: c_int, buf: *mut c_void, count: size_t) -> ssize_t;
    fn write(fd: c_int, buf: *const c_void, count: size_t) -> ssize_t;
    fn readv(fd: c_int, iov: *const iovec, count: c_int) -> ssize_t;
    fn writev(fd: c_int, iov: *const iovec, count: c_int) -> ssize_t;
    fn recv(fd: c_int, buf: *mut c_void, len: size_t, flags: c_int) -> ssize_t;
    fn send(fd: c_int, buf: *const c_void, len: size_t, flags: c_int) -> ssize_t;
    fn recvfrom(fd: c_int, buf: *mut c_void, len: size_t, flags: c_int, addr: *mut sockaddr, addrlen: *mut socklen_t) -> ssize_t;
    fn sendto(fd: c_int, buf: *const c_void, len: size_t, flags: c_int, addr: *const sockaddr, addrlen: socklen_t) -> ssize_t;
    fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    fn __read_chk(fd: c_int, buf: *mut c_void, count: size_t, buflen: size_t) -> ssize_t;
    fn __recv_chk(fd: c_int, buf: *mut c_void, len: size_t, buflen: size_t, flags: c_int) -> ssize_t;
    fn __recvfrom_chk(fd: c_int, buf: *mut c_void, len: size_t, buflen: size_t, flags: c_int, addr: *mut sockaddr, addrlen: *mut socklen_t) -> ssize_t;
    fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    fn close(fd: c_int) -> c_int;
    fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int;
    fn shutdown(fd: c_int, how: c_int) -> c_int;
    fn setsockopt(fd: c_int, level: c_int, name: c_int, value: *const c_void, len: socklen_t) -> c_int;
    fn dup(fd: c_int) -> c_int;
    fn dup2(fd: c_int, new: c_int) -> c_int;
    fn dup3(fd: c_int, new: c_int, flags: c_int) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, arg: c_long) -> c_int;
    fn fcntl64(fd: c_int, cmd: c_int, arg: c_long) -> c_int;
    fn ioctl(fd: c_int, request: c_ulong, arg: *mut c_void) -> c_int;
    fn poll(fds: *mut pollfd, nfds: nfds_t, timeout: c_int) -> c_int;
    fn __poll_chk(fds: *mut pollfd, nfds: nfds_t, timeout: c_int, fdslen: size_t) -> c_int;
    fn ppoll(fds: *mut pollfd, nfds: nfds_t, timeout: *const timespec, sigmask: *const sigset_t) -> c_int;
    fn __ppoll_chk(fds: *mut pollfd, nfds: nfds_t, timeout: *const timespec, sigmask: *const sigset_t, fdslen: size_t) -> c_int;
    fn select(nfds: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, timeout: *mut timeval) -> c_int;
    fn pselect(nfds: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, timeout: *const timespec, sigmask: *const sigset_t) -> c_int;
    fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, event: *mut epoll_event) -> c_int;
    fn epoll_wait(epfd: c_int, events: *mut epoll_event, max: c_int, timeout: c_int) -> c_int;
    fn epoll_pwait(epfd: c_int, events: *mut epoll_event, max: c_int, timeout: c_int, sigmask: *const sigset_t) -> c_int;
    fn epoll_pwait2(epfd: c_int, events: *mut epoll_event, max: c_int, timeout: *const timespec, sigmask: *const sigset_t) -> c_int;
    fn sendfile(out: c_int, input: c_int, offset: *mut off_t, count: size_t) -> ssize_t;
    fn sendfile64(out: c_int, input: c_int, offset: *mut off_t, count: size_t) -> ssize_t;
    fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fn execv(path: *const c_char, argv: *const *const c_char) -> c_int;
    fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int;
    fn execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fn splice(fd_in: c_int, off_in: *mut libc::loff_t, fd_out: c_int, off_out: *mut libc::loff_t, len: size_t, flags: c_uint) -> ssize_t;
}
