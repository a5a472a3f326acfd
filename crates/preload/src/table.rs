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
/// The application's tracked connections by fd.
type ConnMap = Option<HashMap<c_int, Arc<Conn>>>;

static CONNS: Mutex<ConnMap> = Mutex::new(None);

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

fn conns() -> MutexGuard<'static, ConnMap> {
    CONNS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The table's guard across a `fork`: taken by the forking thread before the fork (so that no
/// other thread is inside the table when the child's copy of memory is made: a child that
/// inherited the lock taken would wait for ever on its first tracked descriptor, as a CGI
/// child of a preloaded python server did in its `dup2`), dropped in parent and child after.
struct ForkGuard(std::cell::UnsafeCell<Option<MutexGuard<'static, ConnMap>>>);

// SAFETY: the slot is only touched by the fork handlers of the thread that holds `CONNS`
// (stored after locking it, taken before unlocking it), so two threads never touch it at once.
unsafe impl Sync for ForkGuard {}

static FORK_GUARD: ForkGuard = ForkGuard(std::cell::UnsafeCell::new(None));

extern "C" fn before_fork() {
    let guard = conns();
    // SAFETY: this thread holds `CONNS` (see `ForkGuard`).
    unsafe { *FORK_GUARD.0.get() = Some(guard) };
}

extern "C" fn after_fork() {
    // SAFETY: this thread (the forking one, in parent or child) still holds `CONNS`.
    drop(unsafe { (*FORK_GUARD.0.get()).take() });
}

/// Registers the fork handlers that keep the table usable in a fork child (once, at load).
pub(crate) fn guard_forks() {
    // SAFETY: registers handlers that only lock and unlock the table's mutex.
    unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork)) };
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
