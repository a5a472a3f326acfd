//! [`ShmQp`]: a reliable-connected queue pair between two shm devices.

use lightpath_verbs::{
    BatchError, Error, QpAttr, QpCaps, QpEndpoint, QpState, QueuePair, RecvWr, Result, SendWr, WakeFor,
};

use crate::activity::Wake;

use crate::engine::{lock_qp, QpCell, QpCore, Regions};
use crate::pd::ShmPd;

/// A queue pair of an [`ShmDevice`](crate::ShmDevice). It holds its protection domain (and
/// through the engine both completion queues) alive; dropping it discards outstanding requests
/// without completions, as `ibv_destroy_qp` does, and closes the link so the peer's queue pair
/// sees it go.
pub struct ShmQp {
    pub(crate) pd: ShmPd,
    pub(crate) qpn: u32,
    /// Its activity slot (fixed for its life).
    pub(crate) slot: u32,
    /// Its link was introduced with its own doorbell (shared with the engine's `QpCore`).
    pub(crate) waiter_linked: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub(crate) caps: QpCaps,
    /// Its engine state (also in the device's table), locked on its own by calls on it.
    pub(crate) cell: std::sync::Arc<QpCell>,
}

impl std::fmt::Debug for ShmQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmQp").field("device", &self.pd.device.shared.name).field("qpn", &self.qpn).finish()
    }
}

impl ShmQp {
    /// Runs `f` on this queue pair's engine state with this queue pair locked, not the device
    /// (see `DeviceShared::with_qp_alone`); `f` also gets the region table.
    pub(crate) fn with_core<R>(&self, f: impl FnOnce(&mut QpCore, &Regions) -> R) -> Result<R> {
        Ok(self.pd.device.shared.with_qp_alone(&self.cell, false, f))
    }
}

/// Longest a first write sleeps for the peer's introduction before it looks again (see
/// `QueuePair::write_direct`).
const MAIL_WAIT_SLICE: std::time::Duration = std::time::Duration::from_millis(1);

impl QueuePair for ShmQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn endpoint(&self) -> QpEndpoint {
        QpEndpoint { gid: self.pd.device.shared.ctx.gid, gid_index: 0, qpn: self.qpn }
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn state(&self) -> Result<QpState> {
        self.pd.device.shared.apply_pending_events();
        Ok(lock_qp(&self.cell).state)
    }

    fn modify(&self, attr: &QpAttr) -> Result<()> {
        let shared = &self.pd.device.shared;
        // Going to RTR, the queue pair hands its domain's region for the peer only (if one
        // waits) to the peer with its introduction; one that did not go is put back.
        let mut offer = match attr.state {
            Some(QpState::Rtr) => shared.lock_exports().take_offer(self.pd.id),
            _ => None,
        };
        let result = self.with_core(|qp, regions| qp.modify(attr, regions, &shared.ctx, &mut offer));
        if let Some((offer, memfd)) = offer {
            shared.lock_exports().return_offer(self.pd.id, offer, memfd);
        }
        result?
    }

    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        self.with_core(|qp, regions| qp.post_send(wr, regions))?
    }

    /// One copy from the caller's memory into the peer's mapped region (see
    /// `QueuePair::write_direct`). Right after set-up the peer's introduction may still be on
    /// its way (posted requests wait for it in the queue); this waits for the socket thread
    /// to post it, at most the device's `rpc_timeout`, without holding the device lock.
    fn write_direct(&self, remote_addr: u64, rkey: u32, bytes: &[u8]) -> Option<Result<()>> {
        let shared = &self.pd.device.shared;
        let mut deadline = None;
        loop {
            // Read before the look: mail posted or applied after it ends the wait below at once.
            let seen = shared.mail_seen();
            if bytes.is_empty() {
                // Nothing to write, nothing to wait for (the stream layer asks this way, right
                // after RTS, before the peer can have attached).
                return Some(self.with_core(|qp, _| qp.check_rts()).and_then(|r| r));
            }
            // The target is found under the device lock; the copy is made after releasing it,
            // so that connections writing at once (and their 64 KiB copies) do not queue up
            // behind each other. The region stays mapped while `region` holds it.
            let target = self.with_core(|qp, _| qp.direct_target(remote_addr, rkey, bytes.len() as u64));
            match target.and_then(|r| r) {
                Ok(Some((region, offset))) => {
                    return Some(if region.map.write_from_caller(offset, bytes) {
                        Ok(())
                    } else {
                        Err(Error::NotFound("a writable range of the peer's region"))
                    });
                }
                Ok(None) => {}
                Err(err) => return Some(Err(err)),
            }
            let now = std::time::Instant::now();
            let deadline = *deadline.get_or_insert(now + shared.ctx.config.rpc_timeout);
            if now >= deadline {
                return Some(Err(Error::Unavailable("the peer queue pair never attached".into())));
            }
            // The introduction arrives as a post of the socket thread, applied by the next
            // look or by whoever holds the engine lock. Sleeping in fixed steps instead cost a
            // new connection's first write two to four sleeps of 50 µs (and the timer slack
            // on each). The wait still ends after a millisecond without mail, to look again:
            // waiting for mail alone, `many_shm_streams_at_once` (64 streams of one process
            // connected at once) took 82 and 493 s in two of four full runs instead of 2-3 s,
            // a wait that outlived what it waited for (not diagnosed).
            shared.wait_for_mail(seen, (deadline - now).min(MAIL_WAIT_SLICE));
        }
    }

    /// Keeps a reference to `fd`, which goes to the peer with the introduction at RTR: the
    /// peer then writes it whenever it publishes something for this queue pair while a waiter
    /// is armed (`arm_waiter`), and so does this device when another thread makes one of the
    /// queue pair's completions. Too late once in RTR (`Ok(false)`): that introduction went
    /// without it.
    fn set_waiter_fd(&self, fd: &std::sync::Arc<std::os::fd::OwnedFd>) -> Result<bool> {
        self.with_core(|qp, _| {
            if qp.state != QpState::Reset && qp.state != QpState::Init {
                return false;
            }
            qp.waiter_fd = Some(std::sync::Arc::clone(fd));
            true
        })
    }

    /// Keeps `wake` for the task that will wait for this queue pair: the introduction at RTR
    /// tells the peer to ring the device's task doorbell ([`QueuePair::task_doorbell`]) rather
    /// than a doorbell of the queue pair's own, and this device's threads call `wake` for the
    /// completions they make while the task is armed. Too late once in RTR (`Ok(false)`).
    fn set_waiter_task(&self, wake: lightpath_verbs::TaskWake) -> Result<bool> {
        let taken = self.with_core(|qp, _| {
            if qp.state != QpState::Reset && qp.state != QpState::Init {
                return false;
            }
            qp.waiter_fd = None;
            qp.waiter_task = Some(crate::engine::TaskWaker(std::sync::Arc::clone(&wake)));
            true
        })?;
        if taken {
            self.pd.device.shared.register_task(self.slot, wake);
        }
        Ok(taken)
    }

    fn task_doorbell(&self) -> Option<std::sync::Arc<dyn lightpath_verbs::TaskDoorbell>> {
        let shared = &self.pd.device.shared;
        Some(std::sync::Arc::new(crate::device::ShmTaskDoorbell(std::sync::Arc::clone(shared))))
    }

    /// Sets this queue pair's waiting bit in the device's activity area, then moves the device
    /// forward as `poll` does (under its lock unless nothing is marked or owed): news the peer
    /// published before the bit was visible is found by that look or by the look another
    /// thread has begun (whose completions then ring this doorbell: `tell_waiter` fences and
    /// reads the bit after it adds them), and later news writes the queue pair's own doorbell.
    /// `Ok(false)` if the peer was not given one (nothing armed).
    fn arm_waiter(&self, wake: WakeFor) -> Result<bool> {
        let shared = &self.pd.device.shared;
        if !self.waiter_linked.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(false);
        }
        let slot = self.slot;
        let wake = match wake {
            WakeFor::Anything => Wake::Anything,
            WakeFor::Arrivals => Wake::Arrivals,
        };
        shared.ctx.activity.arm_waiter(slot, wake);
        // This thread's own look, at its queue pair alone (the other queue pairs' news is for
        // their own waiters, which their peers ring, or for whoever drives the device).
        shared.progress_alone(&self.cell, true);
        Ok(true)
    }

    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        self.with_core(|qp, regions| qp.post_recv(wr, regions))?
    }

    fn post_send_batch(&self, wrs: &[SendWr<'_>]) -> std::result::Result<(), BatchError> {
        self.with_core(|qp, regions| qp.post_send_batch(wrs, regions))
            .map_err(|error| BatchError { posted: 0, error })?
    }

    fn post_recv_batch(&self, wrs: &[RecvWr<'_>]) -> std::result::Result<(), BatchError> {
        self.with_core(|qp, regions| qp.post_recv_batch(wrs, regions))
            .map_err(|error| BatchError { posted: 0, error })?
    }
}

impl Drop for ShmQp {
    fn drop(&mut self) {
        let shared = &self.pd.device.shared;
        // Before the slot is freed: until then no other queue pair has it.
        shared.unregister_task(self.slot);
        let removed = shared.lock_core().remove_qp(self.qpn);
        {
            let qp = lock_qp(&self.cell);
            qp.send_cq.detach(&self.cell);
            qp.recv_cq.detach(&self.cell);
        }
        shared.lock_exports().qp_pds.remove(&self.qpn);
        // Unmapping and closing happen here, outside the lock.
        drop(removed);
    }
}
