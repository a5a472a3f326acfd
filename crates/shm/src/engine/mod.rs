//! The shm transport engine: queue pairs with their send and receive queues, the requester
//! and responder sides of each, and the device-wide tables they share. Everything here runs
//! under the device lock (one `Mutex<DeviceCore>` per device); the driver thread and the
//! application's calls take turns.
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

mod link;
mod qp;
mod requester;
mod responder;
mod sge;
mod wqe;

use std::sync::Arc;
use std::time::Instant;

use lightpath_verbs::Gid;

pub(crate) use link::PeerAttach;
pub(crate) use qp::QpCore;
pub(crate) use sge::{IdMap, Regions};

use crate::config::ShmConfig;
use crate::registry::SocketRegistry;
use crate::ring;
use crate::segment::OFF_WAKE;
use crate::sys::EventFd;

/// What the engine needs to know about its device (fixed when the device opens).
#[derive(Debug)]
pub(crate) struct DeviceContext {
    pub(crate) gid: Gid,
    pub(crate) uid: u32,
    pub(crate) config: ShmConfig,
    /// Peers write it to wake this device.
    pub(crate) doorbell: EventFd,
    pub(crate) registry: Arc<SocketRegistry>,
}

/// Something the socket thread learned, applied under the device lock.
#[derive(Debug)]
pub(crate) enum Event {
    /// A peer queue pair introduced itself.
    Attach(PeerAttach),
    /// The socket with this registry id hung up or misbehaved.
    SocketClosed(u64),
}

/// The device's mutable state.
#[derive(Debug)]
pub(crate) struct DeviceCore {
    pub(crate) qps: IdMap<QpCore>,
    pub(crate) regions: Regions,
    /// Threads sleeping until a peer rings (the driver thread, blocked waiters).
    sleepers: u32,
    /// Counts sleeps, so each one has its own wake value.
    epoch: u64,
    next_qpn: u32,
}

impl DeviceCore {
    pub(crate) fn new() -> Self {
        Self { qps: IdMap::default(), regions: Regions::default(), sleepers: 0, epoch: 0, next_qpn: 2 }
    }

    /// A queue-pair number not in use (2 … 2^24 − 1; 0 and 1 are reserved in verbs).
    pub(crate) fn alloc_qpn(&mut self) -> Option<u32> {
        for _ in 0..(1u32 << 24) {
            let qpn = self.next_qpn;
            self.next_qpn = if qpn >= 0xFF_FFFF { 2 } else { qpn + 1 };
            if !self.qps.contains_key(&qpn) {
                return Some(qpn);
            }
        }
        None
    }

    /// The wake value peers should see now, if anyone sleeps.
    fn sleep_value(&self) -> Option<u64> {
        (self.sleepers > 0).then(|| ring::sleeping_value(self.epoch))
    }

    /// Moves every queue pair forward; returns the earliest time one needs attention again.
    pub(crate) fn progress(&mut self) -> Option<Instant> {
        let regions = &self.regions;
        let mut next: Option<Instant> = None;
        for qp in self.qps.values_mut() {
            if let Some(deadline) = qp.progress(regions) {
                next = Some(next.map_or(deadline, |n| n.min(deadline)));
            }
        }
        next
    }

    /// Applies something the socket thread learned.
    pub(crate) fn apply(&mut self, event: Event) {
        let sleep_value = self.sleep_value();
        match event {
            Event::Attach(attach) => {
                if let Some(qp) = self.qps.get_mut(&attach.qpn) {
                    qp.offer_attach(attach, &self.regions, sleep_value);
                }
            }
            Event::SocketClosed(id) => {
                for qp in self.qps.values_mut() {
                    qp.socket_closed(id);
                }
            }
        }
    }

    /// A thread is about to sleep: ask every peer to ring (with a new wake value, so peers
    /// that rang for an earlier sleep ring again). The caller must look for work once more
    /// before it blocks.
    pub(crate) fn arm(&mut self) {
        self.sleepers += 1;
        self.epoch += 1;
        let value = ring::sleeping_value(self.epoch);
        for qp in self.qps.values() {
            if let Some(link) = &qp.link {
                ring::announce_sleep(&link.outbox.word(OFF_WAKE), value);
            }
        }
    }

    /// A sleeper woke up; when none is left, peers stop ringing. While others still sleep
    /// they get a new wake value: the doorbell this sleeper took may have been rung for them
    /// too, and peers ring only once per value.
    pub(crate) fn disarm(&mut self) {
        self.sleepers = self.sleepers.saturating_sub(1);
        if self.sleepers > 0 {
            self.epoch += 1;
        }
        let value = self.sleep_value();
        for qp in self.qps.values() {
            if let Some(link) = &qp.link {
                match value {
                    Some(value) => ring::announce_sleep(&link.outbox.word(OFF_WAKE), value),
                    None => ring::announce_awake(&link.outbox.word(OFF_WAKE)),
                }
            }
        }
    }

    /// The current wake value for a segment created now.
    pub(crate) fn current_sleep_value(&self) -> Option<u64> {
        self.sleep_value()
    }
}
