//! A snapshot of every shared completion queue and the inboxes routed from it, for finding a
//! lost wake-up after the fact (`lightpath::diagnostics`): what each connection has been
//! handed, taken and woken for, whether its event loop is armed, and (once enabled) the state
//! its last wait for the peer's acknowledgement stopped at.
//!
//! Hubs register a weak reference when they are made; the snapshot skips the dropped ones.
//! Until [`enable`] runs, the data path pays one relaxed load per inbox push or pop here; after
//! it, the inboxes count what they are handed, wake and give up, and a waiting flush leaves a
//! note.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, Weak};

/// A hub as the snapshot sees it.
pub(super) trait Describe: Send + Sync {
    fn describe(&self, out: &mut String);
}

/// The registered hubs, and the length at which [`register`] next prunes the dropped ones.
struct Registered {
    hubs: Vec<Weak<dyn Describe>>,
    prune_at: usize,
}

static HUBS: OnceLock<Mutex<Registered>> = OnceLock::new();
static ENABLED: AtomicBool = AtomicBool::new(false);

fn hubs() -> std::sync::MutexGuard<'static, Registered> {
    HUBS.get_or_init(|| Mutex::new(Registered { hubs: Vec::new(), prune_at: MIN_PRUNE_AT }))
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Adds a hub to the snapshot. Dropped hubs are pruned here once the list has doubled since
/// the last pruning (a shm connection has a hub of its own: pruning at every registration
/// made each new connection walk all the others).
pub(super) fn register(hub: Weak<dyn Describe>) {
    let mut registered = hubs();
    if registered.hubs.len() >= registered.prune_at {
        registered.hubs.retain(|hub| hub.strong_count() > 0);
        registered.prune_at = (registered.hubs.len() * 2).max(MIN_PRUNE_AT);
    }
    registered.hubs.push(hub);
}

const MIN_PRUNE_AT: usize = 64;

/// Whether inboxes count and connections leave notes (see [`enable`]).
#[inline]
pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// From now on, inboxes count the completions pushed, the wake-ups asked for and the
/// completions popped, and a connection that waits for its peer's acknowledgement notes the
/// state of its protocol engine in its inbox (a formatted string per wait: for diagnosis, not
/// for speed).
pub(crate) fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// Every live hub's state and its inboxes', one line each.
pub(crate) fn snapshot() -> String {
    let live: Vec<_> = hubs().hubs.iter().filter_map(Weak::upgrade).collect();
    let mut out = String::new();
    let _ = writeln!(out, "lightpath completion queues: {}", live.len());
    for hub in live {
        hub.describe(&mut out);
    }
    out
}
