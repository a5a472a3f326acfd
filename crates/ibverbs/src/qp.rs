//! [`IbvQp`]: a reliable-connected queue pair (`ibv_qp`).
//!
//! Transitions are checked by Lightpath before the device sees them ([`QpAttr::validate_transition`]
//! against the state the device reports), so a refused transition names the missing or bad
//! attribute instead of returning the device's bare `EINVAL`. Posting before RTS is refused from
//! a cached state (the device alone cannot leave RESET/INIT/RTR, so the cache is exact there)
//! at the cost of one atomic load per post.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use lightpath_verbs::{
    AddressVector, BatchError, Error, QpAttr, QpCaps, QpEndpoint, QpState, QueuePair, RecvWr, Result, SendWr,
};

use crate::cq::{CqInner, IbvCq};
use crate::device::QpShared;
use crate::error::{from_errno, from_rc};
use crate::ffi::ops;
use crate::ffi::types::{
    qp_mask, IbvAhAttr, IbvGid, IbvGlobalRoute, IbvQp as RawQp, IbvQpAttr, IbvQpCap, IbvQpInitAttr,
    IbvRecvWr, IbvSendWr, IbvSge, QPT_RC,
};
use crate::pd::PdInner;
use crate::wr;

/// Scatter/gather entries a single post keeps on the stack.
const STACK_SGES: usize = 8;

/// A queue pair of an [`IbvDevice`](crate::IbvDevice). It holds its protection domain and both
/// completion queues alive; dropping it destroys the queue pair (outstanding requests are
/// discarded without completions, as `ibv_destroy_qp` does).
pub struct IbvQp {
    qp: *mut RawQp,
    qpn: u32,
    caps: QpCaps,
    /// State and peer, shared with the completion queues.
    shared: Arc<QpShared>,
    pd: Arc<PdInner>,
    // Kept only so the queues outlive the queue pair that completes into them.
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
}

// SAFETY: libibverbs allows posting, modifying and destroying a QP from any thread; the
// provider serialises its queues internally.
unsafe impl Send for IbvQp {}
// SAFETY: as above.
unsafe impl Sync for IbvQp {}

impl IbvQp {
    pub(crate) fn create(pd: Arc<PdInner>, send_cq: &IbvCq, recv_cq: &IbvCq, caps: QpCaps) -> Result<Self> {
        let same_device = |cq: &IbvCq| Arc::ptr_eq(&cq.inner.device, &pd.device);
        if !same_device(send_cq) || !same_device(recv_cq) {
            return Err(Error::InvalidAttribute("completion queue belongs to another device"));
        }
        let mut init = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: send_cq.inner.cq,
            recv_cq: recv_cq.inner.cq,
            srq: std::ptr::null_mut(),
            cap: IbvQpCap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: domain and queues are alive (held by the Arcs this QP keeps); `init` is a
        // valid attribute structure the library updates with the granted sizes.
        let qp = unsafe { (pd.device.api.create_qp)(pd.pd, &mut init) };
        if qp.is_null() {
            let err = from_errno("ibv_create_qp");
            let attr = &pd.device.attr;
            let over = |asked: u32, limit: i32| i64::from(asked) > i64::from(limit);
            if over(caps.max_send_wr, attr.max_qp_wr)
                || over(caps.max_recv_wr, attr.max_qp_wr)
                || over(caps.max_send_sge, attr.max_sge)
                || over(caps.max_recv_sge, attr.max_sge)
            {
                return Err(Error::InvalidAttribute(
                    "queue pair sizes exceed the device's max_qp_wr/max_sge",
                ));
            }
            return Err(err);
        }
        // SAFETY: a queue pair the library just created.
        let qpn = unsafe { (*qp).qp_num };
        let shared = Arc::new(QpShared {
            state: AtomicU32::new(QpState::Reset.to_raw()),
            dest_qpn: AtomicU32::new(0),
        });
        let mut this = Self {
            qp,
            qpn,
            caps: granted_caps(&init.cap),
            shared,
            pd,
            _send_cq: Arc::clone(&send_cq.inner),
            _recv_cq: Arc::clone(&recv_cq.inner),
        };
        // Some devices grant more than create_qp reports back (rxe rounds its rings up); the
        // device's own answer to a query is what the queues really hold.
        if let Ok((_, cap)) = this.query(qp_mask::CAP) {
            let queried = granted_caps(&cap);
            let caps = &mut this.caps;
            caps.max_send_wr = caps.max_send_wr.max(queried.max_send_wr);
            caps.max_recv_wr = caps.max_recv_wr.max(queried.max_recv_wr);
            caps.max_send_sge = caps.max_send_sge.max(queried.max_send_sge);
            caps.max_recv_sge = caps.max_recv_sge.max(queried.max_recv_sge);
            caps.max_inline_data = caps.max_inline_data.max(queried.max_inline_data);
        }
        this.pd
            .device
            .qps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(qpn, Arc::downgrade(&this.shared));
        Ok(this)
    }

    /// The `ibv_qp` pointer, for measuring this wrapper against direct C calls
    /// (`examples/overhead.rs`). Valid while `self` lives; using it is `unsafe` C.
    #[doc(hidden)]
    pub fn as_raw(&self) -> *mut RawQp {
        self.qp
    }

    fn cached_state(&self) -> Option<QpState> {
        QpState::from_raw(self.shared.state.load(Ordering::Relaxed))
    }

    /// Asks the device for the attributes in `mask`.
    fn query(&self, mask: i32) -> Result<(IbvQpAttr, IbvQpCap)> {
        let mut attr = IbvQpAttr::default();
        let mut init = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: std::ptr::null_mut(),
            recv_cq: std::ptr::null_mut(),
            srq: std::ptr::null_mut(),
            cap: IbvQpCap::default(),
            qp_type: 0,
            sq_sig_all: 0,
        };
        // SAFETY: the QP is alive; both out-structures are writable.
        let rc = unsafe { (self.pd.device.api.query_qp)(self.qp, &mut attr, mask, &mut init) };
        if rc != 0 {
            return Err(from_rc("ibv_query_qp", rc));
        }
        Ok((attr, init.cap))
    }

    /// The state as the device reports it.
    fn query_state(&self) -> Result<QpState> {
        let (attr, _) = self.query(qp_mask::STATE)?;
        let state = QpState::from_raw(attr.qp_state).ok_or_else(|| {
            Error::Unavailable(format!("the device reported an unknown QP state {}", attr.qp_state))
        })?;
        self.shared.state.store(state.to_raw(), Ordering::Relaxed);
        Ok(state)
    }

    /// Refuses posting sends in a state that cannot send (from the cache, see the module doc).
    #[inline]
    fn check_can_send(&self) -> Result<()> {
        match self.cached_state() {
            Some(state @ (QpState::Reset | QpState::Init | QpState::Rtr)) => Err(Error::InvalidState(state)),
            _ => Ok(()),
        }
    }

    /// Refuses posting receives in RESET, and in ERR: not every device flushes a receive posted
    /// after the queue pair entered ERR (rxe keeps it forever), and a receive there can never
    /// complete otherwise.
    #[inline]
    fn check_can_receive(&self) -> Result<()> {
        match self.cached_state() {
            Some(state @ (QpState::Reset | QpState::Err)) => Err(Error::InvalidState(state)),
            _ => Ok(()),
        }
    }

    /// The error for a post the device refused with `rc`.
    fn post_error(&self, what: &'static str, rc: i32, sending: bool) -> Error {
        match rc {
            libc::ENOMEM => Error::QueueFull,
            libc::EINVAL => match self.query_state() {
                Ok(state @ (QpState::Reset | QpState::Init | QpState::Rtr | QpState::Err))
                    if sending || matches!(state, QpState::Reset | QpState::Err) =>
                {
                    Error::InvalidState(state)
                }
                _ => Error::InvalidAttribute("the device refused the work request (EINVAL)"),
            },
            _ => from_rc(what, rc),
        }
    }

    /// Checks attributes against this device (ports, GID indexes) beyond what
    /// [`QpAttr::validate_transition`] knows.
    fn check_addressing(&self, attr: &QpAttr) -> Result<()> {
        let device = &self.pd.device;
        let ports = device.attr.phys_port_cnt;
        if attr.port_num.is_some_and(|port| port == 0 || port > ports) {
            return Err(Error::InvalidAttribute("port_num: no such port on this device"));
        }
        if let Some(av) = attr.av {
            check_udp_dport(&av)?;
            if av.port_num == 0 || av.port_num > ports {
                return Err(Error::InvalidAttribute("av.port_num: no such port on this device"));
            }
            let port = device.query_port_raw(av.port_num)?;
            if i32::from(av.sgid_index) >= port.gid_tbl_len {
                return Err(Error::InvalidAttribute("sgid_index: beyond the port's GID table"));
            }
        }
        Ok(())
    }
}

/// The RoCE port every RNIC and rxe send to and listen on.
const ROCE_PORT: u16 = 4791;

/// Refuses an address vector that names a UDP port other than the RoCE port: `ibv_ah_attr`
/// has no port field, so the device would silently send to 4791 and the peer never hear it.
fn check_udp_dport(av: &AddressVector) -> Result<()> {
    match av.udp_dport {
        0 | ROCE_PORT => Ok(()),
        _ => Err(Error::InvalidAttribute(
            "av.udp_dport: libibverbs always sends to UDP port 4791; only 0 or 4791 can be used",
        )),
    }
}

fn granted_caps(cap: &IbvQpCap) -> QpCaps {
    QpCaps {
        max_send_wr: cap.max_send_wr,
        max_recv_wr: cap.max_recv_wr,
        max_send_sge: cap.max_send_sge,
        max_recv_sge: cap.max_recv_sge,
        max_inline_data: cap.max_inline_data,
    }
}

/// The C attribute structure and mask for `attr`.
fn c_attr(attr: &QpAttr) -> (IbvQpAttr, i32) {
    let mut out = IbvQpAttr::default();
    let mut mask = 0;
    if let Some(state) = attr.state {
        out.qp_state = state.to_raw();
        mask |= qp_mask::STATE;
    }
    if let Some(port) = attr.port_num {
        out.port_num = port;
        mask |= qp_mask::PORT;
    }
    if let Some(pkey_index) = attr.pkey_index {
        out.pkey_index = pkey_index;
        mask |= qp_mask::PKEY_INDEX;
    }
    if let Some(access) = attr.access {
        out.qp_access_flags = access.bits();
        mask |= qp_mask::ACCESS_FLAGS;
    }
    if let Some(av) = attr.av {
        out.ah_attr = IbvAhAttr {
            grh: IbvGlobalRoute {
                dgid: IbvGid { raw: av.dgid.0 },
                flow_label: av.flow_label,
                sgid_index: av.sgid_index,
                hop_limit: av.hop_limit,
                traffic_class: av.traffic_class,
            },
            dlid: 0,
            sl: av.sl,
            src_path_bits: 0,
            static_rate: 0,
            // RoCE always routes by GID (a global route header on the wire).
            is_global: 1,
            port_num: av.port_num,
        };
        mask |= qp_mask::AV;
    }
    if let Some(mtu) = attr.path_mtu {
        out.path_mtu = mtu.to_ibv();
        mask |= qp_mask::PATH_MTU;
    }
    if let Some(qpn) = attr.dest_qp_num {
        out.dest_qp_num = qpn;
        mask |= qp_mask::DEST_QPN;
    }
    if let Some(psn) = attr.rq_psn {
        out.rq_psn = psn;
        mask |= qp_mask::RQ_PSN;
    }
    if let Some(n) = attr.max_dest_rd_atomic {
        out.max_dest_rd_atomic = n;
        mask |= qp_mask::MAX_DEST_RD_ATOMIC;
    }
    if let Some(timer) = attr.min_rnr_timer {
        out.min_rnr_timer = timer;
        mask |= qp_mask::MIN_RNR_TIMER;
    }
    if let Some(timeout) = attr.timeout {
        out.timeout = timeout;
        mask |= qp_mask::TIMEOUT;
    }
    if let Some(retry) = attr.retry_cnt {
        out.retry_cnt = retry;
        mask |= qp_mask::RETRY_CNT;
    }
    if let Some(retry) = attr.rnr_retry {
        out.rnr_retry = retry;
        mask |= qp_mask::RNR_RETRY;
    }
    if let Some(psn) = attr.sq_psn {
        out.sq_psn = psn;
        mask |= qp_mask::SQ_PSN;
    }
    if let Some(n) = attr.max_rd_atomic {
        out.max_rd_atomic = n;
        mask |= qp_mask::MAX_QP_RD_ATOMIC;
    }
    (out, mask)
}

impl std::fmt::Debug for IbvQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvQp").field("device", &self.pd.device.name).field("qpn", &self.qpn).finish()
    }
}

impl QueuePair for IbvQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn endpoint(&self) -> QpEndpoint {
        let source = self.pd.device.source;
        // GID indexes above 255 do not fit an address vector; opening the device chose or
        // checked the index, and every RoCE table Lightpath has met is far smaller.
        QpEndpoint {
            gid: source.gid,
            gid_index: u8::try_from(source.index).unwrap_or(u8::MAX),
            qpn: self.qpn,
        }
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn state(&self) -> Result<QpState> {
        self.query_state()
    }

    fn modify(&self, attr: &QpAttr) -> Result<()> {
        let current = self.query_state()?;
        attr.validate_transition(current)?;
        self.check_addressing(attr)?;
        let (mut c, mask) = c_attr(attr);
        // SAFETY: the QP is alive; `c` is a complete attribute structure and `mask` names only
        // the fields set in it.
        let rc = unsafe { (self.pd.device.api.modify_qp)(self.qp, &mut c, mask) };
        if rc != 0 {
            return Err(match rc {
                libc::EINVAL => Error::InvalidAttribute("the device refused the QP attributes (EINVAL)"),
                _ => from_rc("ibv_modify_qp", rc),
            });
        }
        if let Some(state) = attr.state {
            self.shared.state.store(state.to_raw(), Ordering::Relaxed);
        }
        if let Some(qpn) = attr.dest_qp_num {
            self.shared.dest_qpn.store(qpn, Ordering::Relaxed);
        }
        Ok(())
    }

    #[inline]
    fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        self.check_can_send()?;
        wr::check_send(wr, &self.caps)?;
        let mut stack = [IbvSge::default(); STACK_SGES];
        let mut heap = Vec::new();
        let mut count = 0;
        for sge in wr::send_sges(wr) {
            if count < STACK_SGES {
                stack[count] = sge;
            } else {
                if heap.is_empty() {
                    heap.extend_from_slice(&stack);
                }
                heap.push(sge);
            }
            count += 1;
        }
        let list = if count > STACK_SGES { heap.as_mut_ptr() } else { stack.as_mut_ptr() };
        let mut c = wr::send_header(wr, count);
        c.sg_list = list;
        let mut bad: *mut IbvSendWr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `c` and its scatter/gather array (and inline bytes) live
        // until the call returns, which is all the device needs (inline data is copied).
        let rc = unsafe { ops::post_send(self.qp, &mut c, &mut bad) };
        if rc != 0 {
            return Err(self.post_error("ibv_post_send", rc, true));
        }
        Ok(())
    }

    #[inline]
    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        self.check_can_receive()?;
        wr::check_recv(wr, &self.caps)?;
        let mut stack = [IbvSge::default(); STACK_SGES];
        let mut heap = Vec::new();
        let list = if wr.sges.len() <= STACK_SGES {
            for (slot, sge) in stack.iter_mut().zip(wr.sges) {
                *slot = IbvSge { addr: sge.addr, length: sge.length, lkey: sge.lkey };
            }
            stack.as_mut_ptr()
        } else {
            let _ = wr::recv_wr(wr, &mut heap);
            heap.as_mut_ptr()
        };
        let mut c = IbvRecvWr {
            wr_id: wr.wr_id,
            next: std::ptr::null_mut(),
            sg_list: list,
            num_sge: wr.sges.len() as i32,
        };
        let mut bad: *mut IbvRecvWr = std::ptr::null_mut();
        // SAFETY: the QP is alive; `c` and its scatter/gather array live until the call returns.
        let rc = unsafe { ops::post_recv(self.qp, &mut c, &mut bad) };
        if rc != 0 {
            return Err(self.post_error("ibv_post_recv", rc, false));
        }
        Ok(())
    }

    /// Posts the whole batch with one `ibv_post_send` (one doorbell): the requests are chained
    /// as the C API expects. Requests Lightpath refuses up front end the chain there.
    fn post_send_batch(&self, wrs: &[SendWr<'_>]) -> std::result::Result<(), BatchError> {
        self.check_can_send().map_err(|error| BatchError { posted: 0, error })?;
        let valid = wrs.iter().position(|wr| wr::check_send(wr, &self.caps).is_err()).unwrap_or(wrs.len());
        let mut sges = Vec::new();
        let mut chain: Vec<IbvSendWr> = wrs[..valid].iter().map(|wr| wr::send_wr(wr, &mut sges)).collect();
        link_send(&mut chain, &mut sges);
        self.post_send_chain(&mut chain)?;
        match wrs.get(valid) {
            Some(wr) => {
                let error =
                    wr::check_send(wr, &self.caps).err().unwrap_or(Error::InvalidAttribute("refused"));
                Err(BatchError { posted: valid, error })
            }
            None => Ok(()),
        }
    }

    fn post_recv_batch(&self, wrs: &[RecvWr<'_>]) -> std::result::Result<(), BatchError> {
        self.check_can_receive().map_err(|error| BatchError { posted: 0, error })?;
        let valid = wrs.iter().position(|wr| wr::check_recv(wr, &self.caps).is_err()).unwrap_or(wrs.len());
        let mut sges = Vec::new();
        let mut chain: Vec<IbvRecvWr> = wrs[..valid].iter().map(|wr| wr::recv_wr(wr, &mut sges)).collect();
        let mut next = 0;
        for c in chain.iter_mut() {
            // SAFETY: `next + num_sge <= sges.len()` (each request appended exactly that many).
            c.sg_list = unsafe { sges.as_mut_ptr().add(next) };
            next += c.num_sge as usize;
        }
        link(&mut chain, |c, n| c.next = n);
        if let Some(first) = chain.first_mut() {
            let base = first as *mut IbvRecvWr;
            let mut bad: *mut IbvRecvWr = std::ptr::null_mut();
            // SAFETY: the QP is alive; the chain and its arrays live until the call returns.
            let rc = unsafe { ops::post_recv(self.qp, base, &mut bad) };
            if rc != 0 {
                let posted = bad_index(base, bad, chain.len());
                return Err(BatchError { posted, error: self.post_error("ibv_post_recv", rc, false) });
            }
        }
        match wrs.get(valid) {
            Some(wr) => {
                let error =
                    wr::check_recv(wr, &self.caps).err().unwrap_or(Error::InvalidAttribute("refused"));
                Err(BatchError { posted: valid, error })
            }
            None => Ok(()),
        }
    }
}

impl IbvQp {
    fn post_send_chain(&self, chain: &mut [IbvSendWr]) -> std::result::Result<(), BatchError> {
        let Some(first) = chain.first_mut() else { return Ok(()) };
        let base = first as *mut IbvSendWr;
        let mut bad: *mut IbvSendWr = std::ptr::null_mut();
        // SAFETY: the QP is alive; the chain and its scatter/gather arrays live until the call
        // returns.
        let rc = unsafe { ops::post_send(self.qp, base, &mut bad) };
        if rc != 0 {
            let posted = bad_index(base, bad, chain.len());
            return Err(BatchError { posted, error: self.post_error("ibv_post_send", rc, true) });
        }
        Ok(())
    }
}

/// Points each send request at its scatter/gather entries (appended in order to `sges`) and
/// chains them.
fn link_send(chain: &mut [IbvSendWr], sges: &mut [IbvSge]) {
    let mut next = 0;
    for c in chain.iter_mut() {
        // SAFETY: `next + num_sge <= sges.len()` (each request appended exactly that many).
        c.sg_list = unsafe { sges.as_mut_ptr().add(next) };
        next += c.num_sge as usize;
    }
    link(chain, |c, n| c.next = n);
}

/// Sets each element's `next` pointer to the following element (the last one's stays null).
fn link<T>(chain: &mut [T], mut set_next: impl FnMut(&mut T, *mut T)) {
    let base = chain.as_mut_ptr();
    for i in 1..chain.len() {
        // SAFETY: `i < len`, so the pointer is in bounds of the slice.
        let next = unsafe { base.add(i) };
        set_next(&mut chain[i - 1], next);
    }
}

/// Index of `bad` in the chain starting at `base`, or 0 when the library did not say.
fn bad_index<T>(base: *mut T, bad: *mut T, len: usize) -> usize {
    let offset = (bad as usize).wrapping_sub(base as usize) / std::mem::size_of::<T>().max(1);
    if bad.is_null() || offset >= len {
        0
    } else {
        offset
    }
}

impl Drop for IbvQp {
    fn drop(&mut self) {
        self.pd.device.qps.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.qpn);
        // SAFETY: the QP is destroyed once; the domain and CQs it uses are still alive (held by
        // this value's fields, dropped after this body).
        unsafe { (self.pd.device.api.destroy_qp)(self.qp) };
    }
}

#[cfg(test)]
mod tests {
    use lightpath_verbs::{AccessFlags, AddressVector, Mtu};

    use super::*;

    #[test]
    fn attribute_masks_name_exactly_the_fields_given() {
        let (c, mask) = c_attr(&QpAttr::to_init(AccessFlags::REMOTE_READ));
        assert_eq!(mask, qp_mask::STATE | qp_mask::PORT | qp_mask::PKEY_INDEX | qp_mask::ACCESS_FLAGS);
        assert_eq!((c.qp_state, c.port_num, c.qp_access_flags), (1, 1, 4));

        let av = AddressVector::new("10.78.0.2".parse().expect("gid"), 1);
        let (c, mask) = c_attr(&QpAttr::to_rtr(av, Mtu::Mtu4096, 0x12, 0x345));
        assert_eq!(
            mask,
            qp_mask::STATE
                | qp_mask::AV
                | qp_mask::PATH_MTU
                | qp_mask::DEST_QPN
                | qp_mask::RQ_PSN
                | qp_mask::MAX_DEST_RD_ATOMIC
                | qp_mask::MIN_RNR_TIMER
        );
        assert_eq!((c.path_mtu, c.dest_qp_num, c.rq_psn), (5, 0x12, 0x345));
        assert_eq!((c.ah_attr.is_global, c.ah_attr.grh.sgid_index, c.ah_attr.grh.hop_limit), (1, 1, 64));
        assert_eq!(&c.ah_attr.grh.dgid.raw[10..], &[0xff, 0xff, 10, 78, 0, 2]);

        let (c, mask) = c_attr(&QpAttr::to_rts(0x777));
        assert_eq!(
            mask,
            qp_mask::STATE
                | qp_mask::SQ_PSN
                | qp_mask::TIMEOUT
                | qp_mask::RETRY_CNT
                | qp_mask::RNR_RETRY
                | qp_mask::MAX_QP_RD_ATOMIC
        );
        assert_eq!((c.sq_psn, c.timeout, c.retry_cnt, c.rnr_retry, c.max_rd_atomic), (0x777, 14, 7, 7, 16));
    }

    #[test]
    fn only_the_roce_port_can_be_named_in_an_address_vector() {
        let av = AddressVector::new("10.78.0.2".parse().expect("gid"), 1);
        for port in [0, 4791] {
            assert!(check_udp_dport(&AddressVector { udp_dport: port, ..av }).is_ok(), "port {port}");
        }
        for port in [1, 4790, 5811, u16::MAX] {
            match check_udp_dport(&AddressVector { udp_dport: port, ..av }) {
                Err(Error::InvalidAttribute(why)) => {
                    assert!(why.contains("udp_dport") && why.contains("4791"))
                }
                other => panic!("port {port}: {other:?}"),
            }
        }
    }

    #[test]
    fn chains_link_in_order_and_bad_indexes_are_bounded() {
        let mut items = [0u64; 3];
        let mut nexts = Vec::new();
        let base = items.as_mut_ptr();
        link(&mut items, |item, next| {
            *item = 1;
            nexts.push(next);
        });
        // SAFETY: in-bounds pointers into `items`, compared only.
        let expected = unsafe { [base.add(1), base.add(2)] };
        assert_eq!(nexts, expected);
        // SAFETY: as above.
        assert_eq!(bad_index(base, unsafe { base.add(2) }, 3), 2);
        assert_eq!(bad_index(base, std::ptr::null_mut(), 3), 0);
        // SAFETY: one past the end, compared only.
        assert_eq!(bad_index(base, unsafe { base.add(3) }, 3), 0);
    }
}
