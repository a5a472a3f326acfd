//! Keeping the preload's own work out of its hooks, and panics out of the C caller.
//!
//! Threads the library starts (rendezvous, pairing) mark themselves internal: their socket
//! calls, even `connect` on a TCP socket, go straight to the C library. The mark is a
//! `const`-initialised thread-local `Cell<bool>`: no destructor, no allocation, so it is safe
//! to read from any thread at any time, including during thread exit.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use libc::c_int;

use crate::real;

thread_local! {
    static INTERNAL: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is one of the library's own.
pub(crate) fn internal() -> bool {
    INTERNAL.try_with(Cell::get).unwrap_or(true)
}

/// Marks the calling thread as the library's own for the rest of its life.
pub(crate) fn mark_internal() {
    let _ = INTERNAL.try_with(|flag| flag.set(true));
}

/// Runs a hook's tracked path: a panic becomes `-1` with errno `EIO` (and one line on the
/// report), never an unwind into C. On success errno is what it was on entry, whatever the
/// library's internal calls did to it.
pub(crate) fn hook<T: Copy>(failed: T, body: impl FnOnce() -> Result<T, c_int>) -> T {
    let saved = real::errno();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => {
            real::set_errno(saved);
            value
        }
        Ok(Err(errno)) => {
            real::set_errno(errno);
            failed
        }
        Err(_) => {
            crate::report::line(format_args!("internal panic caught at the C boundary; returning EIO"));
            real::set_errno(libc::EIO);
            failed
        }
    }
}

/// Where the library's own long-lived descriptors are moved: a program that closes a number
/// twice (iperf3 does) must not close one of them, and programs expect the low numbers.
const HIGH_FD_BASE: i32 = 512;

/// `fd` moved to a number at or above [`HIGH_FD_BASE`] (unchanged if that fails).
pub(crate) fn high<T: From<std::os::fd::OwnedFd> + Into<std::os::fd::OwnedFd>>(fd: T) -> T {
    let owned: std::os::fd::OwnedFd = fd.into();
    match rustix::io::fcntl_dupfd_cloexec(&owned, HIGH_FD_BASE) {
        Ok(moved) => T::from(moved),
        Err(_) => T::from(owned),
    }
}
