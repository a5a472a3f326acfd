//! [`IbvCq`]: a completion queue with its own completion channel, whose file descriptor is the
//! [`CompletionQueue::notify_fd`] (non-blocking, for epoll/poll/tokio's `AsyncFd`).
//!
//! `wait` uses the same channel: poll, arm, poll again, then sleep in `poll(2)` on the fd. So a
//! program that drives the notification protocol itself should not also call `wait` on the same
//! queue at the same time (the two would take each other's events).

use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lightpath_verbs::{CompletionQueue, Error, Result, WcOpcode, WcStatus, WorkCompletion};

use crate::device::ContextInner;
use crate::error::{from_errno, from_rc};
use crate::ffi::ops;
use crate::ffi::types::{wc_flags, IbvCompChannel, IbvCq as RawCq, IbvWc};

/// `IBV_WC_RECV` and every receive-side opcode have this bit set.
const RECV_OPCODE_BIT: u32 = 1 << 7;

/// Completions taken from the device per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// A completion queue of an [`IbvDevice`](crate::IbvDevice). Cloning gives another handle; the
/// queue is destroyed when the last handle and the last queue pair using it are gone.
#[derive(Clone)]
pub struct IbvCq {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    pub(crate) device: Arc<ContextInner>,
    pub(crate) cq: *mut RawCq,
    channel: *mut IbvCompChannel,
    fd: RawFd,
    capacity: u32,
}

// SAFETY: libibverbs allows polling, arming and destroying a CQ from any thread; the provider
// locks its queue internally.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl IbvCq {
    pub(crate) fn new(device: Arc<ContextInner>, min_entries: u32) -> Result<Self> {
        let entries = i32::try_from(min_entries.max(1))
            .map_err(|_| Error::InvalidAttribute("completion queue size above 2^31"))?;
        // SAFETY: the context is open while `device` lives.
        let channel = unsafe { (device.api.create_comp_channel)(device.ctx) };
        if channel.is_null() {
            return Err(from_errno("ibv_create_comp_channel"));
        }
        // SAFETY: `channel` was just created and is valid.
        let fd = unsafe { (*channel).fd };
        // SAFETY: fcntl on the channel's own descriptor; non-blocking reads let take_notify and
        // wait never block inside ibv_get_cq_event.
        let nonblocking = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        let cq = if nonblocking {
            // SAFETY: context and channel are valid; no CQ context pointer is used.
            unsafe { (device.api.create_cq)(device.ctx, entries, std::ptr::null_mut(), channel, 0) }
        } else {
            std::ptr::null_mut()
        };
        if cq.is_null() {
            let err = if nonblocking {
                let size_hint = i64::from(entries) > i64::from(device.attr.max_cqe);
                if size_hint {
                    Error::InvalidAttribute("completion queue larger than the device's max_cqe")
                } else {
                    from_errno("ibv_create_cq")
                }
            } else {
                from_errno("fcntl(O_NONBLOCK) on the completion channel")
            };
            // SAFETY: destroying the channel created above, which no CQ uses.
            unsafe { (device.api.destroy_comp_channel)(channel) };
            return Err(err);
        }
        // SAFETY: `cq` was just created; the library reports how many entries it granted.
        let granted = unsafe { (*cq).cqe };
        let capacity = u32::try_from(granted).unwrap_or(min_entries).max(min_entries.max(1));
        Ok(Self { inner: Arc::new(CqInner { device, cq, channel, fd, capacity }) })
    }

    /// The `ibv_cq` pointer, for measuring this wrapper against direct C calls
    /// (`examples/overhead.rs`). Valid while `self` lives; using it is `unsafe` C.
    #[doc(hidden)]
    pub fn as_raw(&self) -> *mut RawCq {
        self.inner.cq
    }

    /// Polls once without blocking (the body of `poll`).
    fn poll_into(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        // Not zeroed: a busy-polling loop calls this millions of times, and the provider writes
        // every entry it reports.
        let mut raw = [const { MaybeUninit::<IbvWc>::uninit() }; POLL_BATCH];
        let mut taken = 0;
        while taken < out.len() {
            let want = (out.len() - taken).min(POLL_BATCH);
            // SAFETY: the CQ is alive while `self` is; `raw` has room for `want` entries.
            let n = unsafe { ops::poll_cq(self.inner.cq, want as i32, raw.as_mut_ptr().cast()) };
            if n < 0 {
                return Err(from_rc("ibv_poll_cq", n));
            }
            let n = (n as usize).min(want);
            // SAFETY: ibv_poll_cq initialised the first `n` entries (n <= want <= POLL_BATCH).
            let written = unsafe { std::slice::from_raw_parts(raw.as_ptr().cast::<IbvWc>(), n) };
            for (slot, wc) in out[taken..].iter_mut().zip(written) {
                *slot = convert(wc);
                if wc.status != 0 {
                    self.inner.device.note_error(wc.qp_num);
                } else if wc.src_qp == 0 && wc.opcode & RECV_OPCODE_BIT != 0 {
                    // RC receive without the sender's QPN (rxe): it is the connected peer.
                    if let Some(qp) = self.inner.device.qp(wc.qp_num) {
                        slot.src_qp = qp.dest_qpn.load(std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            taken += n;
            if n < want {
                break;
            }
        }
        Ok(taken)
    }

    /// Consumes one completion event from the channel if one is there.
    fn take_event(&self) -> Result<bool> {
        let mut cq: *mut RawCq = std::ptr::null_mut();
        let mut context: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is alive; its fd is non-blocking, so this returns at once.
        let rc = unsafe { (self.inner.device.api.get_cq_event)(self.inner.channel, &mut cq, &mut context) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            return match err.kind() {
                std::io::ErrorKind::WouldBlock => Ok(false),
                _ => Err(Error::Io(err)),
            };
        }
        // SAFETY: the event names the CQ it belongs to (this one: the channel serves only it);
        // every event is acknowledged, as ibv_destroy_cq requires.
        unsafe { (self.inner.device.api.ack_cq_events)(cq, 1) };
        Ok(true)
    }

    fn arm(&self) -> Result<()> {
        // SAFETY: the CQ is alive while `self` is.
        let rc = unsafe { ops::req_notify_cq(self.inner.cq, false) };
        if rc != 0 {
            return Err(from_rc("ibv_req_notify_cq", rc));
        }
        Ok(())
    }
}

/// A work completion from its C form; status and opcode values are converted by checked
/// constructors (unknown ones become `Other`).
pub(crate) fn convert(wc: &IbvWc) -> WorkCompletion {
    let mut out = WorkCompletion::new(
        wc.wr_id,
        WcStatus::from_raw(wc.status),
        WcOpcode::from_raw(wc.opcode),
        wc.qp_num,
    );
    out.byte_len = wc.byte_len;
    out.src_qp = wc.src_qp;
    out.vendor_err = wc.vendor_err;
    if wc.wc_flags & wc_flags::WITH_IMM != 0 {
        // The device hands over the immediate as it was on the wire (big endian).
        out.imm_data = Some(u32::from_be(wc.imm_data_or_invalidated_rkey));
    }
    if wc.wc_flags & wc_flags::WITH_INV != 0 {
        out.invalidated_rkey = Some(wc.imm_data_or_invalidated_rkey);
    }
    out
}

impl std::fmt::Debug for IbvCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvCq").field("capacity", &self.inner.capacity).field("fd", &self.inner.fd).finish()
    }
}

impl CompletionQueue for IbvCq {
    fn capacity(&self) -> u32 {
        self.inner.capacity
    }

    #[inline]
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.poll_into(out)
    }

    fn wait(&self, out: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let count = self.poll_into(out)?;
            if count > 0 {
                return Ok(count);
            }
            self.arm()?;
            // A completion that arrived before the arm raised no event: look once more.
            let count = self.poll_into(out)?;
            if count > 0 {
                return Ok(count);
            }
            let remaining = match deadline {
                Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return Ok(0),
                },
                None => None,
            };
            wait_readable(self.inner.fd, remaining)?;
            self.take_event()?;
        }
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.inner.fd)
    }

    fn request_notify(&self) -> Result<()> {
        self.arm()
    }

    fn take_notify(&self) -> Result<bool> {
        self.take_event()
    }
}

/// Sleeps until `fd` is readable or `timeout` passes (`None`: no limit).
fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> Result<()> {
    let millis = match timeout {
        // Round up so that a sub-millisecond remainder still sleeps instead of spinning.
        Some(left) => i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX),
        None => -1,
    };
    let mut pollfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut pollfd, 1, millis) };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Io(err));
        }
    }
    Ok(())
}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every queue pair using this CQ held an Arc to it, so none is left; all events
        // taken were acknowledged. Destroyed once, then its channel.
        unsafe {
            (self.device.api.destroy_cq)(self.cq);
            (self.device.api.destroy_comp_channel)(self.channel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_convert_with_checked_values() {
        let wc = IbvWc {
            wr_id: 7,
            status: 0,
            opcode: 129,
            byte_len: 12,
            imm_data_or_invalidated_rkey: 0x1234_5678u32.to_be(),
            qp_num: 0x11,
            src_qp: 0x12,
            wc_flags: wc_flags::WITH_IMM,
            ..IbvWc::default()
        };
        let out = convert(&wc);
        assert_eq!(out.opcode, WcOpcode::RecvRdmaWithImm);
        assert_eq!(out.imm_data, Some(0x1234_5678));
        assert_eq!((out.wr_id, out.byte_len, out.qp_num, out.src_qp), (7, 12, 0x11, 0x12));
        let odd = IbvWc { status: 99, opcode: 77, ..IbvWc::default() };
        let out = convert(&odd);
        assert_eq!((out.status, out.opcode, out.imm_data), (WcStatus::Other(99), WcOpcode::Other(77), None));
    }
}
