//! [`QpCore`]: one queue pair's state machine, queues and link, and the verbs calls on it.

use std::sync::Arc;
use std::time::Instant;

use lightpath_verbs::{
    AccessFlags, Error, Gid, QpAttr, QpCaps, QpState, RecvWr, Result, SendFlags, SendOp, SendPayload, SendWr,
    WcOpcode, WcStatus, WorkCompletion,
};

use super::link::{IntroWaiter, Introduction, Link, LinkFailure, PeerAttach};
use super::requester::Requester;
use super::responder::Responder;
use super::sge::{Regions, SgeList};
use super::wqe::{Payload, RecvWqe, SendWqe, Stage};
use super::DeviceContext;

/// The wake-up of the task that waits for a queue pair (`QueuePair::set_waiter_task`).
#[derive(Clone)]
pub(crate) struct TaskWaker(pub(crate) lightpath_verbs::TaskWake);

impl std::fmt::Debug for TaskWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TaskWaker")
    }
}
use crate::address::is_shm_gid;
use crate::cq::CqShared;
use crate::segment::PeerStatus;
use crate::sys::Memfd;
use crate::wire::RegionOffer;

/// Most rounds of taking in what a peer that hung up had published (each reads up to the
/// responder's batch of records): more than a ring holds.
const DRAIN_ROUNDS_AT_HANG_UP: usize = 1 << 12;

/// Largest message (as RC: 2^31 bytes).
pub(crate) const MAX_MESSAGE: u64 = 1 << 31;

/// One queue pair.
#[derive(Debug)]
pub(crate) struct QpCore {
    pub(crate) qpn: u32,
    /// Where peers mark this queue pair in the device's activity area.
    pub(crate) slot: u32,
    pub(crate) pd: u32,
    pub(crate) caps: QpCaps,
    pub(crate) state: QpState,
    /// Remote operations this queue pair accepts as responder.
    pub(crate) access: AccessFlags,
    /// The peer (GID, QPN), from RTR on.
    pub(crate) dest: Option<(Gid, u32)>,
    pub(crate) min_rnr_timer: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) send_cq: Arc<CqShared>,
    pub(crate) recv_cq: Arc<CqShared>,
    pub(crate) req: Requester,
    pub(crate) resp: Responder,
    pub(crate) link: Option<Link>,
    /// A peer introduction that arrived before this queue pair reached RTR.
    pub(crate) pending: Option<PeerAttach>,
    /// Why the link was given up, for the `vendor_err` of later flushes.
    pub(crate) failure: Option<LinkFailure>,
    /// Something the peer may be waiting for was published (ring it if it sleeps).
    pub(crate) published: bool,
    /// What was published includes an arrival for the peer (records, a NAK, a new state), not
    /// only acknowledgements or freed ring space (see `crate::activity::Wake`).
    pub(crate) published_arrival: bool,
    /// SENDs of at least this many bytes go as source descriptors.
    pub(crate) direct_min: u32,
    /// When the RNR wait of the last read expires, if one runs.
    pub(crate) wake_at: Option<Instant>,
    /// The last read stopped with records left (it reads a bounded batch).
    pub(crate) more_to_read: bool,
    /// Queued in the device's list of queue pairs with records left.
    pub(crate) queued: bool,
    /// The deadline queued in the device's timers for this queue pair.
    pub(crate) timer: Option<Instant>,
    /// The queue pair's own doorbell (see `crate::activity`), shared with the application
    /// (no descriptor of its own), handed to the peer with the introduction at RTR.
    pub(crate) waiter_fd: Option<Arc<std::os::fd::OwnedFd>>,
    /// Or the wake-up of the task that waits for it (see `crate::activity`; the peer then
    /// rings the device's task doorbell).
    pub(crate) waiter_task: Option<TaskWaker>,
    /// The current link was introduced with the queue pair's own doorbell: a thread may wait
    /// for this queue pair alone.
    pub(crate) waiter_linked: Arc<std::sync::atomic::AtomicBool>,
    /// A completion was added since the device last looked whether a waiter must hear of it.
    pub(crate) completed: bool,
    /// One of them was a receive, an error or a local operation's result, not only the
    /// acknowledgement of a request (which a reader does not wait for).
    pub(crate) completed_arrival: bool,
}

/// The shm device has one port (1) and one GID (index 0); refuse anything else up front.
fn check_addressing(attr: &QpAttr) -> Result<()> {
    if attr.port_num.is_some_and(|port| port != 1) {
        return Err(Error::InvalidAttribute("port_num: an shm device has one port, number 1"));
    }
    if let Some(av) = attr.av {
        if av.sgid_index != 0 {
            return Err(Error::InvalidAttribute("sgid_index: an shm device has one GID, index 0"));
        }
        if av.port_num != 1 {
            return Err(Error::InvalidAttribute("av.port_num: an shm device has one port, number 1"));
        }
        if !is_shm_gid(av.dgid) {
            return Err(Error::InvalidAttribute("dgid: not the GID of an shm device"));
        }
    }
    Ok(())
}

fn missing(from: QpState, to: QpState, attribute: &'static str) -> Error {
    Error::MissingAttribute { transition: (from, to), attribute }
}

impl QpCore {
    pub(crate) fn new(
        qpn: u32,
        slot: u32,
        pd: u32,
        caps: QpCaps,
        send_cq: Arc<CqShared>,
        recv_cq: Arc<CqShared>,
        direct_min: u32,
    ) -> Self {
        Self {
            qpn,
            slot,
            pd,
            caps,
            state: QpState::Reset,
            access: AccessFlags::NONE,
            dest: None,
            min_rnr_timer: 0,
            rnr_retry: 0,
            send_cq,
            recv_cq,
            req: Requester::default(),
            resp: Responder::default(),
            link: None,
            pending: None,
            failure: None,
            published: false,
            published_arrival: false,
            direct_min,
            wake_at: None,
            more_to_read: false,
            queued: false,
            timer: None,
            waiter_fd: None,
            waiter_task: None,
            waiter_linked: Arc::default(),
            completed: false,
            completed_arrival: false,
        }
    }

    fn status(&self) -> PeerStatus {
        PeerStatus { state: self.state, access: self.access, rnr_retry: self.rnr_retry }
    }

    fn publish_status(&mut self) {
        if let Some(link) = &self.link {
            link.outbox.publish_status(self.status());
            self.published = true;
            self.published_arrival = true;
        }
    }

    /// `modify_qp`.
    /// `offer`: a region for the peer only, handed over with the introduction at INIT→RTR
    /// (taken out of the option once it went).
    pub(crate) fn modify(
        &mut self,
        attr: &QpAttr,
        regions: &Regions,
        ctx: &DeviceContext,
        offer: &mut Option<(RegionOffer, Memfd)>,
    ) -> Result<()> {
        check_addressing(attr)?;
        attr.validate_transition(self.state)?;
        let from = self.state;
        let to = attr.state.unwrap_or(from);
        match (from, to) {
            (_, QpState::Reset) => self.reset(),
            (_, QpState::Err) => self.enter_error(None),
            (QpState::Reset, QpState::Init) => {
                self.access = attr.access.ok_or_else(|| missing(from, to, "access"))?;
                self.state = QpState::Init;
            }
            (QpState::Init, QpState::Rtr) => {
                let av = attr.av.ok_or_else(|| missing(from, to, "av"))?;
                let dqpn = attr.dest_qp_num.ok_or_else(|| missing(from, to, "dest_qp_num"))?;
                let min_rnr_timer = attr.min_rnr_timer.ok_or_else(|| missing(from, to, "min_rnr_timer"))?;
                let access = attr.access.unwrap_or(self.access);
                let status = PeerStatus { state: QpState::Rtr, access, rnr_retry: self.rnr_retry };
                let waiter = match (&self.waiter_fd, &self.waiter_task) {
                    (Some(fd), _) => IntroWaiter::Own(std::os::fd::AsFd::as_fd(&**fd)),
                    (None, Some(_)) => IntroWaiter::Task,
                    (None, None) => IntroWaiter::Device,
                };
                let intro = Introduction {
                    qpn: self.qpn,
                    slot: self.slot,
                    dgid: av.dgid,
                    dqpn,
                    status,
                    waiter,
                    offer: offer.as_ref(),
                };
                let link = Link::establish(intro, ctx)?;
                // In flight, the introduction holds the region's file; the peer maps it.
                *offer = None;
                self.link = Some(link);
                let linked = self.waiter_fd.is_some() || self.waiter_task.is_some();
                self.waiter_linked.store(linked, std::sync::atomic::Ordering::Release);
                self.dest = Some((av.dgid, dqpn));
                self.min_rnr_timer = min_rnr_timer;
                self.access = access;
                self.req = Requester::default();
                // Receives may be posted from INIT on; a fresh responder keeps them.
                let posted = std::mem::take(&mut self.resp.rq);
                self.resp = Responder::default();
                self.resp.rq = posted;
                self.failure = None;
                self.state = QpState::Rtr;
                self.publish_status();
                if let Some(pending) = self.pending.take() {
                    self.offer_attach(pending, regions);
                }
            }
            (QpState::Rtr, QpState::Rts) => {
                self.rnr_retry = attr.rnr_retry.ok_or_else(|| missing(from, to, "rnr_retry"))?;
                self.access = attr.access.unwrap_or(self.access);
                self.state = QpState::Rts;
            }
            (QpState::Init, QpState::Init) | (QpState::Rts | QpState::Sqd, QpState::Rts | QpState::Sqd) => {
                self.access = attr.access.unwrap_or(self.access);
                self.min_rnr_timer = attr.min_rnr_timer.unwrap_or(self.min_rnr_timer);
                self.rnr_retry = attr.rnr_retry.unwrap_or(self.rnr_retry);
                self.state = to;
            }
            _ => return Err(Error::InvalidTransition { from, to }),
        }
        self.publish_status();
        if to == QpState::Rts {
            self.progress(regions);
        }
        self.ring_peer();
        Ok(())
    }

    /// RESET: everything is dropped without completions, the link let go (the peer hears our
    /// goodbye), and the queue pair can be connected anew.
    fn reset(&mut self) {
        self.state = QpState::Reset;
        self.link = None;
        self.waiter_linked.store(false, std::sync::atomic::Ordering::Release);
        self.pending = None;
        self.dest = None;
        self.failure = None;
        self.req = Requester::default();
        self.resp = Responder::default();
        self.wake_at = None;
        self.more_to_read = false;
    }

    fn flush_wc(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode) -> WorkCompletion {
        let mut wc = WorkCompletion::new(wr_id, status, opcode, self.qpn);
        wc.vendor_err = self.failure.map_or(0, LinkFailure::vendor_err);
        wc
    }

    /// Moves to ERR and completes everything outstanding: the first send request still in
    /// progress with `head_status` if given (the reason the link failed), every other one and
    /// every receive with `WrFlushErr`.
    pub(crate) fn enter_error(&mut self, head_status: Option<WcStatus>) {
        if self.state == QpState::Err {
            return;
        }
        self.state = QpState::Err;
        self.publish_status();
        let mut head_status = head_status;
        for wqe in std::mem::take(&mut self.req.sq) {
            let status = match wqe.stage {
                Stage::Done { .. } => WcStatus::WrFlushErr,
                _ => head_status.take().unwrap_or(WcStatus::WrFlushErr),
            };
            self.send_cq.push(self.flush_wc(wqe.wr_id, status, wqe.opcode()));
            self.completed = true;
            self.completed_arrival = true;
        }
        self.req.clear_queue();
        if let Some(assembly) = self.resp.assembling.take() {
            self.recv_cq.push(self.flush_wc(assembly.recv.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv));
            self.completed = true;
            self.completed_arrival = true;
        }
        for recv in std::mem::take(&mut self.resp.rq) {
            self.recv_cq.push(self.flush_wc(recv.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv));
            self.completed = true;
            self.completed_arrival = true;
        }
    }

    /// Gives the link up: the queue pair goes to ERR, the request in flight reports why, the
    /// peer's memory is unmapped and the peer hears our goodbye at once.
    pub(crate) fn fail_link(&mut self, failure: LinkFailure) {
        self.failure = Some(failure);
        self.enter_error(Some(failure.head_status()));
        self.link = None;
    }

    /// A peer introduced itself: attach now if this queue pair expects exactly that peer,
    /// keep it for later if this queue pair has not reached RTR, refuse it otherwise (dropped,
    /// the introduction answers the peer with a goodbye).
    pub(crate) fn offer_attach(&mut self, attach: PeerAttach, regions: &Regions) {
        match self.state {
            QpState::Reset | QpState::Init => self.pending = Some(attach),
            QpState::Rtr | QpState::Rts | QpState::Sqd => {
                let expected = self.dest == Some((attach.from_gid, attach.from_qpn));
                let Some(link) = self.link.as_mut().filter(|link| expected && link.peer.is_none()) else {
                    return;
                };
                if !link.attach(attach) {
                    return;
                }
                self.progress(regions);
            }
            QpState::Sqe | QpState::Err => {}
        }
    }

    /// The connection with id `id` hung up: if this queue pair's link or its peer's
    /// introduction uses it, the peer is gone.
    pub(crate) fn socket_closed(&mut self, id: u64, regions: &Regions) {
        if self.pending.as_ref().is_some_and(|p| p.served == id) {
            self.drop_pending_silently();
        }
        let ours = self.link.as_ref().is_some_and(|link| {
            link.client.id() == id || link.peer.as_ref().is_some_and(|peer| peer.served == id)
        });
        if ours {
            self.lose_peer(regions);
        }
    }

    /// Peer queue pair `from_qpn` said goodbye on connection `id`: if it is this queue pair's
    /// peer (on the connection its introduction came over, or, refusing ours, on our link),
    /// the peer is gone.
    pub(crate) fn peer_left(&mut self, id: u64, from_qpn: u32, regions: &Regions) {
        if self.pending.as_ref().is_some_and(|p| p.served == id && p.from_qpn == from_qpn) {
            self.drop_pending_silently();
        }
        let ours = self.dest.is_some_and(|(_, dqpn)| dqpn == from_qpn)
            && self.link.as_ref().is_some_and(|link| {
                link.client.id() == id || link.peer.as_ref().is_some_and(|peer| peer.served == id)
            });
        if ours {
            self.lose_peer(regions);
        }
    }

    /// Forgets an introduction whose sender is gone (no goodbye back).
    fn drop_pending_silently(&mut self) {
        if let Some(mut pending) = self.pending.take() {
            pending.refusal.armed = false;
        }
    }

    /// The peer went. What it published before it went (records, acknowledgements) is still
    /// in its segment, which stays mapped until the link fails: that is taken in first, as a
    /// TCP socket delivers the bytes that arrived before the peer's reset. A process that
    /// sends and exits at once (a close record, a collective's last part) then loses nothing
    /// the kernel would have delivered for a socket.
    fn lose_peer(&mut self, regions: &Regions) {
        // Bounded: a peer can have published at most one ring of records.
        for _ in 0..DRAIN_ROUNDS_AT_HANG_UP {
            self.progress(regions);
            if !self.more_to_read || self.link.is_none() {
                break;
            }
        }
        if self.link.is_some() {
            self.fail_link(LinkFailure::PeerGone);
        }
    }

    /// Does everything that can be done now, and notes what it needs next (`wake_at`,
    /// `more_to_read`).
    pub(crate) fn progress(&mut self, regions: &Regions) {
        self.wake_at = None;
        self.more_to_read = false;
        let attached = self.link.as_ref().is_some_and(|link| link.peer.is_some());
        if !attached {
            return;
        }
        if matches!(self.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            self.respond(regions);
        }
        if matches!(self.state, QpState::Rts | QpState::Sqd) {
            if let Err(failure) = self.poll_acks() {
                self.fail_link(failure);
            }
            self.issue(regions);
            self.retire();
        }
        self.ring_peer();
    }

    /// Tells the peer's device if something was published for its queue pair (marking it in
    /// the activity area, and ringing if that device sleeps).
    pub(crate) fn ring_peer(&mut self) {
        if !std::mem::take(&mut self.published) {
            return;
        }
        let arrival = std::mem::take(&mut self.published_arrival);
        if let Some(peer) = self.link.as_ref().and_then(|link| link.peer.as_ref()) {
            peer.signal(arrival);
        }
    }

    /// `post_send`.
    pub(crate) fn post_send(&mut self, wr: &SendWr<'_>, regions: &Regions) -> Result<()> {
        self.accept_send(wr)?;
        self.issue(regions);
        self.retire();
        self.ring_peer();
        Ok(())
    }

    /// Posts several send requests, stopping at the first refusal.
    pub(crate) fn post_send_batch(
        &mut self,
        wrs: &[SendWr<'_>],
        regions: &Regions,
    ) -> std::result::Result<(), lightpath_verbs::BatchError> {
        let mut outcome = Ok(());
        for (posted, wr) in wrs.iter().enumerate() {
            if let Err(error) = self.accept_send(wr) {
                outcome = Err(lightpath_verbs::BatchError { posted, error });
                break;
            }
        }
        self.issue(regions);
        self.retire();
        self.ring_peer();
        outcome
    }

    /// Checks a send request and queues it (or flushes it in ERR).
    fn accept_send(&mut self, wr: &SendWr<'_>) -> Result<()> {
        match self.state {
            QpState::Rts => {}
            QpState::Err => {
                let wqe = Self::build_send(wr, self.caps)?;
                self.send_cq.push(self.flush_wc(wqe.wr_id, WcStatus::WrFlushErr, wqe.opcode()));
                self.completed = true;
                self.completed_arrival = true;
                return Ok(());
            }
            other => return Err(Error::InvalidState(other)),
        }
        if self.req.sq.len() >= self.caps.max_send_wr as usize {
            return Err(Error::QueueFull);
        }
        let wqe = Self::build_send(wr, self.caps)?;
        self.req.sq.push_back(wqe);
        Ok(())
    }

    fn build_send(wr: &SendWr<'_>, caps: QpCaps) -> Result<SendWqe> {
        if matches!(wr.op, SendOp::SendWithInv { .. }) {
            return Err(Error::Unsupported("SEND with invalidate (shm has no memory windows)"));
        }
        let payload = match wr.payload {
            SendPayload::Sges(sges) => {
                if sges.len() > caps.max_send_sge as usize {
                    return Err(Error::TooLarge("more scatter/gather entries than max_send_sge"));
                }
                Payload::Sges(SgeList::new(sges))
            }
            SendPayload::Inline(bytes) => {
                if bytes.len() > caps.max_inline_data as usize {
                    return Err(Error::TooLarge("inline data larger than max_inline_data"));
                }
                if wr.op.is_read_or_atomic() {
                    return Err(Error::InvalidAttribute("READ and atomics need a scatter/gather entry"));
                }
                Payload::Inline(bytes.to_vec())
            }
        };
        let len = wr.payload.len();
        if len > MAX_MESSAGE {
            return Err(Error::TooLarge("messages are limited to 2^31 bytes"));
        }
        Ok(SendWqe {
            wr_id: wr.wr_id,
            op: wr.op,
            signaled: wr.flags.contains(SendFlags::SIGNALED),
            solicited: wr.flags.contains(SendFlags::SOLICITED),
            payload,
            len: len as u32,
            stage: Stage::NEW,
        })
    }

    /// `post_recv`.
    pub(crate) fn post_recv(&mut self, wr: &RecvWr<'_>, regions: &Regions) -> Result<()> {
        self.accept_recv(wr)?;
        if self.resp.rnr_waiting() {
            self.respond(regions);
        }
        self.ring_peer();
        Ok(())
    }

    /// Posts several receives, stopping at the first refusal.
    pub(crate) fn post_recv_batch(
        &mut self,
        wrs: &[RecvWr<'_>],
        regions: &Regions,
    ) -> std::result::Result<(), lightpath_verbs::BatchError> {
        let mut outcome = Ok(());
        for (posted, wr) in wrs.iter().enumerate() {
            if let Err(error) = self.accept_recv(wr) {
                outcome = Err(lightpath_verbs::BatchError { posted, error });
                break;
            }
        }
        if self.resp.rnr_waiting() {
            self.respond(regions);
        }
        self.ring_peer();
        outcome
    }

    fn accept_recv(&mut self, wr: &RecvWr<'_>) -> Result<()> {
        if wr.sges.len() > self.caps.max_recv_sge as usize {
            return Err(Error::TooLarge("more scatter/gather entries than max_recv_sge"));
        }
        match self.state {
            QpState::Reset => return Err(Error::InvalidState(QpState::Reset)),
            QpState::Err => {
                self.recv_cq.push(self.flush_wc(wr.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv));
                self.completed = true;
                self.completed_arrival = true;
                return Ok(());
            }
            _ => {}
        }
        if self.resp.rq.len() >= self.caps.max_recv_wr as usize {
            return Err(Error::QueueFull);
        }
        let sges = SgeList::new(wr.sges);
        let capacity = sges.total();
        self.resp.rq.push_back(RecvWqe { wr_id: wr.wr_id, sges, capacity });
        Ok(())
    }
}
