//! The connections this device opened to other devices (its *links*, one per peer device, shared
//! by every queue pair linked there), and who owns them.
//!
//! Every link is a Unix socket; when the peer process dies, the kernel closes its end and ours
//! reports a hang-up, which is how a survivor learns about a crash within microseconds. The
//! queue pairs own a link through a [`SocketGuard`] they share; the socket thread watches
//! whatever is registered and reads everything that arrives on it (answers to our questions go
//! to the asker through the link's [`Replies`]). Dropping the guard records the removal and
//! pokes the thread, which lets go of its copy, so the socket closes and the peer in turn sees
//! the hang-up. (Connections other devices opened to us are the socket thread's own.)
//!
//! The registry keeps no table of what is watched: the thread keeps that. It keeps only the
//! changes since the thread last looked, which the thread takes in one swap under the lock, so
//! learning about a change costs the thread O(1) whatever the number of connections (comparing
//! whole tables on every change made setting up N connections cost N²).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::sys::{EventFd, SeqPacket};
use crate::wire::Message;

/// One registered socket.
#[derive(Clone, Debug)]
pub(crate) struct Watched {
    pub(crate) id: u64,
    pub(crate) socket: Arc<SeqPacket>,
    pub(crate) replies: Arc<Replies>,
}

/// An answer the socket thread read for a caller that asked a question on a link.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) message: Message,
    pub(crate) fds: Vec<OwnedFd>,
}

/// The questions outstanding on one link, by tag, and the answers the socket thread read for
/// them. The caller that asks registers its tag before sending and waits here; an answer
/// nobody waits for (its asker gave up) is dropped with its descriptors.
#[derive(Debug, Default)]
pub(crate) struct Replies {
    state: Mutex<ReplyState>,
    arrived: Condvar,
}

#[derive(Debug, Default)]
struct ReplyState {
    waiting: HashMap<u32, Option<Reply>>,
    /// The link hung up: nothing more will arrive.
    closed: bool,
}

/// Why no answer came.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NoReply {
    Closed,
    TimedOut,
}

impl Replies {
    fn lock(&self) -> MutexGuard<'_, ReplyState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers question `tag` (before it is sent, so its answer cannot come first).
    pub(crate) fn expect(&self, tag: u32) {
        self.lock().waiting.insert(tag, None);
    }

    /// Gives question `tag` up (it could not be sent).
    pub(crate) fn forget(&self, tag: u32) {
        self.lock().waiting.remove(&tag);
    }

    /// Whether the link hung up.
    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Waits for the answer to `tag` until `deadline`; the question is forgotten either way.
    pub(crate) fn wait(&self, tag: u32, deadline: Instant) -> Result<Reply, NoReply> {
        let mut state = self.lock();
        loop {
            if let Some(reply) = state.waiting.get_mut(&tag).and_then(Option::take) {
                state.waiting.remove(&tag);
                return Ok(reply);
            }
            let failure = if state.closed {
                Some(NoReply::Closed)
            } else if Instant::now() >= deadline {
                Some(NoReply::TimedOut)
            } else {
                None
            };
            if let Some(failure) = failure {
                state.waiting.remove(&tag);
                return Err(failure);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            state = self.arrived.wait_timeout(state, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
    }

    /// Hands the answer to `tag` to its asker; false (and the answer dropped) if nobody waits
    /// for it: its asker gave up, or the peer answered twice or what nobody asked.
    pub(crate) fn deliver(&self, tag: u32, reply: Reply) -> bool {
        let mut state = self.lock();
        match state.waiting.get_mut(&tag) {
            Some(slot @ None) => {
                *slot = Some(reply);
                drop(state);
                self.arrived.notify_all();
                true
            }
            _ => false,
        }
    }

    /// The link hung up: every asker is told at once.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.arrived.notify_all();
    }
}

/// What changed since the socket thread last looked. No id is in both lists: a socket
/// registered and let go in between is never shown to the thread (and the registry's copy of
/// it is dropped at once), so applying `removed` and then `added` gives the same watched set
/// as applying every change in the order it happened.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    /// Registered sockets the thread has not seen yet, in registration order (ids only grow).
    pub(crate) added: Vec<Watched>,
    /// Ids of sockets the thread was given earlier whose owners let go, in the order they did.
    pub(crate) removed: Vec<u64>,
}

impl Changes {
    pub(crate) fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }
}

/// The changes waiting for the thread, behind the registry's lock.
#[derive(Debug)]
struct Pending {
    next_id: u64,
    /// By id, so a guard dropped before the thread looked can take its socket back out.
    added: BTreeMap<u64, Watched>,
    removed: Vec<u64>,
}

/// The queue of watched-socket changes between the sockets' owners and the socket thread.
#[derive(Debug)]
pub(crate) struct SocketRegistry {
    pending: Mutex<Pending>,
    /// Poked after every change, so the thread comes to take it.
    pub(crate) changed: EventFd,
}

impl SocketRegistry {
    pub(crate) fn new() -> std::io::Result<Self> {
        let pending = Pending { next_id: 1, added: BTreeMap::new(), removed: Vec::new() };
        Ok(Self { pending: Mutex::new(pending), changed: EventFd::new(false)? })
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Every change is one push or one removal: a panicking holder leaves nothing half-done.
        self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers `socket`; it stays watched until the guard is dropped.
    pub(crate) fn register(self: &Arc<Self>, socket: Arc<SeqPacket>) -> SocketGuard {
        let replies = Arc::new(Replies::default());
        let id = {
            let mut pending = self.lock();
            let id = pending.next_id;
            pending.next_id += 1;
            pending
                .added
                .insert(id, Watched { id, socket: Arc::clone(&socket), replies: Arc::clone(&replies) });
            id
        };
        self.changed.signal(1);
        SocketGuard { id, socket, replies, registry: Arc::clone(self) }
    }

    /// An id no registered socket has or will have, for a connection the socket thread keeps
    /// itself (one a peer opened to us), so every hang-up names one connection.
    pub(crate) fn allocate_id(&self) -> u64 {
        let mut pending = self.lock();
        let id = pending.next_id;
        pending.next_id += 1;
        id
    }

    /// Hands the changes since the last call to the thread, leaving none behind. `into` must
    /// be empty (the thread passes the buffers it used last time, so a quiet steady state
    /// allocates nothing for removals).
    pub(crate) fn take_changes(&self, into: &mut Changes) {
        debug_assert!(into.is_empty(), "the previous changes were not applied");
        let added = {
            let mut pending = self.lock();
            into.removed.clear();
            std::mem::swap(&mut into.removed, &mut pending.removed);
            std::mem::take(&mut pending.added)
        };
        into.added.clear();
        into.added.extend(added.into_values());
    }

    /// A guard let go of socket `id`.
    fn unregister(&self, id: u64) {
        let unseen = {
            let mut pending = self.lock();
            let unseen = pending.added.remove(&id);
            if unseen.is_none() {
                pending.removed.push(id);
            }
            unseen
        };
        match unseen {
            // The thread never saw it: nothing to tell, and our copy goes now.
            Some(watched) => drop(watched),
            None => self.changed.signal(1),
        }
    }
}

/// Ownership of a registered socket.
#[derive(Debug)]
pub(crate) struct SocketGuard {
    pub(crate) id: u64,
    pub(crate) socket: Arc<SeqPacket>,
    pub(crate) replies: Arc<Replies>,
    registry: Arc<SocketRegistry>,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        self.registry.unregister(self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashSet};

    use super::*;
    use crate::sys::Listener;

    /// One connected socket; the registry does not care whether registrations share one.
    fn socket() -> (Listener, Arc<SeqPacket>) {
        let name = format!("lightpath-registry-test-{}", crate::address::random_gid().expect("gid").to_hex());
        let listener = Listener::bind_abstract(name.as_bytes()).expect("listener");
        let socket = SeqPacket::connect_abstract(name.as_bytes()).expect("connect");
        (listener, Arc::new(socket))
    }

    fn take(registry: &SocketRegistry) -> (Vec<u64>, Vec<u64>) {
        let mut changes = Changes::default();
        registry.take_changes(&mut changes);
        (changes.added.iter().map(|w| w.id).collect(), changes.removed)
    }

    /// What the socket thread would believe is watched, checked as it learns each change.
    #[derive(Default)]
    struct ThreadView {
        watched: BTreeSet<u64>,
        ever_added: HashSet<u64>,
        last_added: u64,
    }

    impl ThreadView {
        fn apply(&mut self, added: &[u64], removed: &[u64]) {
            for id in removed {
                assert!(self.watched.remove(id), "removal of {id}, which the thread does not watch");
            }
            for &id in added {
                assert!(self.ever_added.insert(id), "{id} handed over twice");
                assert!(id > self.last_added, "{id} handed over after {}", self.last_added);
                self.last_added = id;
                self.watched.insert(id);
            }
        }
    }

    #[test]
    fn adds_and_removes_are_seen_once_and_in_order() {
        let (_listener, sock) = socket();
        let registry = Arc::new(SocketRegistry::new().expect("registry"));
        let a = registry.register(Arc::clone(&sock));
        let b = registry.register(Arc::clone(&sock));
        let c = registry.register(Arc::clone(&sock));
        assert_eq!(registry.changed.take(), 3, "every registration rings the bell");

        let mut changes = Changes::default();
        registry.take_changes(&mut changes);
        let added: Vec<u64> = changes.added.iter().map(|w| w.id).collect();
        assert_eq!(added, vec![a.id, b.id, c.id]);
        assert!(changes.removed.is_empty());
        assert_eq!(take(&registry), (vec![], vec![]), "taken changes are gone");

        let (b_id, a_id) = (b.id, a.id);
        drop(b);
        let d = registry.register(Arc::clone(&sock));
        drop(a);
        assert_eq!(registry.changed.take(), 3, "removals of seen sockets ring the bell too");
        assert_eq!(take(&registry), (vec![d.id], vec![b_id, a_id]));

        let (c_id, d_id) = (c.id, d.id);
        drop(d);
        drop(c);
        assert_eq!(take(&registry), (vec![], vec![d_id, c_id]));
        assert_eq!(take(&registry), (vec![], vec![]));
    }

    #[test]
    fn a_socket_let_go_before_the_thread_looked_is_never_shown_and_not_kept() {
        let (_listener, sock) = socket();
        let registry = Arc::new(SocketRegistry::new().expect("registry"));
        let kept = registry.register(Arc::clone(&sock));
        let gone = registry.register(Arc::clone(&sock));
        // Ours, and for each guard its own and the registry's copy.
        assert_eq!(Arc::strong_count(&sock), 5);
        drop(gone);
        assert_eq!(Arc::strong_count(&sock), 3, "the registry let go of the unseen socket at once");
        let mut thread_copy = Changes::default();
        registry.take_changes(&mut thread_copy);
        assert_eq!(thread_copy.added.iter().map(|w| w.id).collect::<Vec<_>>(), vec![kept.id]);
        let kept_id = kept.id;
        drop(kept);
        assert_eq!(take(&registry), (vec![], vec![kept_id]));
        assert_eq!(Arc::strong_count(&sock), 2, "only the thread's copy is left, for the thread to drop");
    }

    /// Registrations, drops and takes interleaved in many pseudo-random orders: after every
    /// take the thread's view is exactly what is registered, and nothing is seen twice.
    #[test]
    fn interleavings_lose_nothing() {
        let (_listener, sock) = socket();
        for seed in 1..=64u64 {
            let registry = Arc::new(SocketRegistry::new().expect("registry"));
            let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let mut live: Vec<SocketGuard> = Vec::new();
            let mut view = ThreadView::default();
            // Dropped guards of sockets the thread has seen, in drop order: the removals due.
            let mut due: Vec<u64> = Vec::new();
            for _ in 0..400 {
                match next() % 5 {
                    0 | 1 => live.push(registry.register(Arc::clone(&sock))),
                    2 | 3 if !live.is_empty() => {
                        let guard = live.swap_remove((next() % live.len() as u64) as usize);
                        if view.watched.contains(&guard.id) {
                            due.push(guard.id);
                        }
                    }
                    _ => {
                        let (added, removed) = take(&registry);
                        assert_eq!(removed, std::mem::take(&mut due), "seed {seed}");
                        view.apply(&added, &removed);
                        let expected: BTreeSet<u64> = live.iter().map(|g| g.id).collect();
                        assert_eq!(view.watched, expected, "seed {seed}");
                    }
                }
            }
            let ids: Vec<u64> = live.iter().map(|g| g.id).collect();
            drop(live);
            let (added, removed) = take(&registry);
            view.apply(&added, &removed);
            assert!(view.watched.is_empty(), "seed {seed}: {:?} left of {ids:?}", view.watched);
        }
        assert_eq!(Arc::strong_count(&sock), 1, "every copy was let go");
    }

    /// Owners on several threads register and drop while the thread takes changes: when
    /// they are done, the thread's view is exactly the sockets still held.
    #[test]
    fn concurrent_owners_and_taker_agree() {
        let (_listener, sock) = socket();
        let registry = Arc::new(SocketRegistry::new().expect("registry"));
        let done = std::sync::atomic::AtomicUsize::new(0);
        const OWNERS: usize = 4;
        let mut view = ThreadView::default();
        let held: Vec<SocketGuard> = std::thread::scope(|scope| {
            let owners: Vec<_> = (0..OWNERS)
                .map(|owner| {
                    let (registry, sock, done) = (&registry, &sock, &done);
                    scope.spawn(move || {
                        let mut kept = Vec::new();
                        for round in 0..2_000 {
                            let guard = registry.register(Arc::clone(sock));
                            if round % 7 == owner {
                                kept.push(guard);
                            } else if round % 3 == 0 {
                                std::thread::yield_now();
                            }
                        }
                        done.fetch_add(1, std::sync::atomic::Ordering::Release);
                        kept
                    })
                })
                .collect();
            while done.load(std::sync::atomic::Ordering::Acquire) < OWNERS {
                let (added, removed) = take(&registry);
                view.apply(&added, &removed);
            }
            owners.into_iter().flat_map(|owner| owner.join().expect("owner")).collect()
        });
        let (added, removed) = take(&registry);
        view.apply(&added, &removed);
        let expected: BTreeSet<u64> = held.iter().map(|g| g.id).collect();
        let kept_per_owner = |owner: usize| (0..2_000).filter(|round| round % 7 == owner).count();
        assert_eq!(expected.len(), (0..OWNERS).map(kept_per_owner).sum::<usize>());
        assert_eq!(view.watched, expected);
        drop(held);
        let (added, removed) = take(&registry);
        view.apply(&added, &removed);
        assert!(view.watched.is_empty(), "{} still watched after every guard went", view.watched.len());
        assert_eq!(Arc::strong_count(&sock), 1, "every copy was let go");
    }
}
