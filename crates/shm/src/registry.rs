//! The sockets a device's socket thread watches, and who owns them.
//!
//! Every connection between two queue pairs' devices is a Unix socket; when the peer process
//! dies, the kernel closes its end and ours reports a hang-up, which is how a survivor learns
//! about a crash within microseconds. The queue pair owns its sockets through
//! [`SocketGuard`]s; the socket thread polls whatever is registered. Dropping a guard removes
//! the socket and pokes the thread, which lets go of its copy, so the socket closes and the
//! peer in turn sees the hang-up.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::sys::{EventFd, SeqPacket};

/// What a watched socket is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SocketRole {
    /// Our connection to a peer's device (we send questions): watched for hang-ups only.
    Client,
    /// A peer's connection to us (it sends questions about our queue pair `qpn`).
    Served { qpn: u32 },
}

/// One registered socket.
#[derive(Clone, Debug)]
pub(crate) struct Watched {
    pub(crate) id: u64,
    pub(crate) socket: Arc<SeqPacket>,
    pub(crate) role: SocketRole,
}

/// The table of watched sockets.
#[derive(Debug)]
pub(crate) struct SocketRegistry {
    entries: Mutex<(u64, HashMap<u64, Watched>)>,
    /// Poked when the table changes, so the thread rebuilds its poll set.
    pub(crate) changed: EventFd,
}

impl SocketRegistry {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Self { entries: Mutex::new((1, HashMap::new())), changed: EventFd::new(false)? })
    }

    fn lock(&self) -> MutexGuard<'_, (u64, HashMap<u64, Watched>)> {
        // The table has no invariant a panicking holder could break half-way.
        self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers `socket`; it stays watched until the guard is dropped.
    pub(crate) fn register(self: &Arc<Self>, socket: Arc<SeqPacket>, role: SocketRole) -> SocketGuard {
        let id = {
            let mut entries = self.lock();
            let id = entries.0;
            entries.0 += 1;
            entries.1.insert(id, Watched { id, socket: Arc::clone(&socket), role });
            id
        };
        self.changed.signal(1);
        SocketGuard { id, socket, registry: Arc::clone(self) }
    }

    /// Everything watched now.
    pub(crate) fn snapshot(&self) -> Vec<Watched> {
        self.lock().1.values().cloned().collect()
    }
}

/// Ownership of a registered socket.
#[derive(Debug)]
pub(crate) struct SocketGuard {
    pub(crate) id: u64,
    pub(crate) socket: Arc<SeqPacket>,
    registry: Arc<SocketRegistry>,
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        self.registry.lock().1.remove(&self.id);
        self.registry.changed.signal(1);
    }
}
