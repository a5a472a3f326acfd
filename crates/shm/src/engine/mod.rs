//! The shm transport engine: queue pairs with their send and receive queues, the requester
//! and responder sides of each, and the device-wide tables they share.
//!
//! # Locks
//!
//! Each queue pair's state ([`QpCore`]) has a lock of its own ([`QpCell`]): a call on one
//! queue pair (posting, a direct write, arming its waiter) takes only that lock, so the
//! connections of a busy server, each driven by its own thread, do not queue up behind one
//! another. The device lock (one `Mutex<DeviceCore>`) guards what concerns every queue pair:
//! the table of queue pairs, activity slots, sleepers, and which queue pairs a round of
//! progress looks at (those peers marked in the activity area, those owed a look:
//! `device_core`); a poll that finds nothing marked takes no lock at all. The region table
//! and the agenda of owed looks are [`Tables`], shared without the device lock.
//!
//! Order, to rule out deadlock: the device lock, then the region table (read), then one
//! queue pair, then the agenda. No thread holding a queue pair's lock takes the device lock or
//! the region table, and no thread holds two queue pairs' locks at once.
//!
//! # How operations move
//!
//! | operation | who does the work | when it completes |
//! |---|---|---|
//! | SEND (with immediate) below `direct_min` | the sender copies the payload into its ring (in pieces of at most `max_fragment`); the receiver copies it out into a posted receive | at the sender when the receiver publishes that it received the whole message |
//! | SEND from `direct_min` (32 KiB) on | the sender puts descriptors of its scatter/gather entries (rkey, offset, length) into the ring; the receiver maps those regions and copies straight into the posted receive: one copy | as above |
//! | RDMA WRITE | the requester copies straight into the peer's region, mapped here | at once |
//! | WRITE with immediate | as WRITE, then a ring record that consumes a receive | when the receiver acknowledges the record |
//! | RDMA READ | the requester copies out of the peer's region | at once |
//! | atomics | the requester runs a real atomic on the peer's region | at once |
//!
//! Every one-sided access is checked first, as a responder NIC would: the region must still be
//! registered (its header says so), belong to the peer queue pair's protection domain, grant
//! the access, and contain the whole range; the peer queue pair must accept remote operations
//! of that kind and be ready to receive. Receivers acknowledge with a counter in their segment
//! (and a NAK word for failures), which requesters read back.

mod agenda;
mod device_core;
mod link;
mod qp;
mod requester;
mod responder;
mod sge;
mod wqe;

use std::sync::Arc;

use lightpath_verbs::Gid;

pub(crate) use device_core::{lock_qp, DeviceCore, Hints, QpCell, Tables};
pub(crate) use link::{send_patiently, Links, PeerAttach, Refusal};
pub(crate) use qp::QpCore;
pub(crate) use qp::TaskWaker;
pub(crate) use sge::{IdMap, Regions};

use crate::activity::area::OwnArea;
use crate::config::ShmConfig;
use crate::registry::SocketRegistry;
use crate::sys::EventFd;

/// Locks `mutex` unless another thread holds it. A holder that panicked left the state
/// memory-safe to use (the engine never panics while holding a lock by design), as
/// [`lock_qp`] and `DeviceShared::lock_core` treat it.
pub(crate) fn try_lock<T>(mutex: &std::sync::Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    match mutex.try_lock() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// What the engine needs to know about its device (fixed when the device opens).
#[derive(Debug)]
pub(crate) struct DeviceContext {
    pub(crate) gid: Gid,
    pub(crate) uid: u32,
    pub(crate) config: ShmConfig,
    /// Peers write it to wake this device.
    pub(crate) doorbell: EventFd,
    /// Peers write it to wake tasks waiting for our queue pairs (see `crate::activity`).
    pub(crate) task_doorbell: EventFd,
    /// Where peers mark which of our queue pairs has news (see [`crate::activity`]).
    pub(crate) activity: Arc<OwnArea>,
    pub(crate) registry: Arc<SocketRegistry>,
    /// Our connections to peer devices, shared by the queue pairs linked there.
    pub(crate) links: Links,
}

/// Something the socket thread learned, applied under the device lock.
#[derive(Debug)]
pub(crate) enum Event {
    /// A peer queue pair introduced itself.
    Attach(PeerAttach),
    /// The connection with this id hung up or misbehaved.
    SocketClosed(u64),
    /// The peer queue pair `from_qpn` said goodbye to our `qpn` on connection `link` (it went,
    /// or refused our introduction).
    PeerLeft { link: u64, qpn: u32, from_qpn: u32 },
}
