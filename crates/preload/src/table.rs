//! Which descriptors the library tracks: the application's TCP connections (by fd number),
//! and the application's epoll instances that have a shadow (see `crate::epoll`).
//!
//! The pass-through test is one atomic load for descriptors below [`FAST`] (every other hook
//! call is for an fd the library does not track), so the hooks cost nothing measurable for
//! files, pipes, UDP and the library's own descriptors. Only a tracked fd takes the lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use libc::c_int;

use crate::conn::Conn;

/// Descriptors below this have a flag each; above it, a count says whether any is tracked.
pub(crate) const FAST: usize = 1 << 16;

static CONN_FLAGS: [AtomicBool; FAST] = [const { AtomicBool::new(false) }; FAST];
static CONN_HIGH: AtomicUsize = AtomicUsize::new(0);
static CONNS: Mutex<Option<HashMap<c_int, Arc<Conn>>>> = Mutex::new(None);

static EPOLL_FLAGS: [AtomicBool; FAST] = [const { AtomicBool::new(false) }; FAST];
static EPOLL_HIGH: AtomicUsize = AtomicUsize::new(0);

fn flagged(flags: &[AtomicBool; FAST], high: &AtomicUsize, fd: c_int) -> bool {
    match usize::try_from(fd) {
        Ok(index) if index < FAST => flags[index].load(Ordering::Acquire),
        Ok(_) => high.load(Ordering::Acquire) > 0,
        Err(_) => false,
    }
}

fn set_flag(flags: &[AtomicBool; FAST], high: &AtomicUsize, fd: c_int, on: bool) {
    match usize::try_from(fd) {
        Ok(index) if index < FAST => flags[index].store(on, Ordering::Release),
        Ok(_) if on => {
            high.fetch_add(1, Ordering::AcqRel);
        }
        Ok(_) => {
            let _ = high.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
        Err(_) => {}
    }
}

fn conns() -> MutexGuard<'static, Option<HashMap<c_int, Arc<Conn>>>> {
    CONNS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Whether `fd` may be tracked (cheap; no lock). False on the library's own threads.
pub(crate) fn maybe_tracked(fd: c_int) -> bool {
    flagged(&CONN_FLAGS, &CONN_HIGH, fd) && !crate::guard::internal()
}

/// The connection behind `fd`, if the application's fd is tracked.
pub(crate) fn conn(fd: c_int) -> Option<Arc<Conn>> {
    if !maybe_tracked(fd) {
        return None;
    }
    conns().as_ref()?.get(&fd).cloned()
}

/// Tracks `fd` as `conn`; returns what a reused number had.
pub(crate) fn insert(fd: c_int, conn: Arc<Conn>) -> Option<Arc<Conn>> {
    let old = conns().get_or_insert_with(HashMap::new).insert(fd, conn);
    if old.is_none() {
        set_flag(&CONN_FLAGS, &CONN_HIGH, fd, true);
    }
    old
}

/// Stops tracking `fd`; returns its connection.
pub(crate) fn remove(fd: c_int) -> Option<Arc<Conn>> {
    if !flagged(&CONN_FLAGS, &CONN_HIGH, fd) {
        return None;
    }
    let removed = conns().as_mut()?.remove(&fd);
    if removed.is_some() {
        set_flag(&CONN_FLAGS, &CONN_HIGH, fd, false);
    }
    removed
}

/// Every tracked connection (at exit).
pub(crate) fn all() -> Vec<(c_int, Arc<Conn>)> {
    conns().as_ref().map(|map| map.iter().map(|(fd, c)| (*fd, Arc::clone(c))).collect()).unwrap_or_default()
}

/// Whether the epoll fd `epfd` may have a shadow (cheap; no lock).
pub(crate) fn maybe_shadowed(epfd: c_int) -> bool {
    flagged(&EPOLL_FLAGS, &EPOLL_HIGH, epfd) && !crate::guard::internal()
}

/// Marks whether `epfd` has a shadow.
pub(crate) fn set_shadowed(epfd: c_int, on: bool) {
    set_flag(&EPOLL_FLAGS, &EPOLL_HIGH, epfd, on);
}
