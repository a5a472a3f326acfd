//! One RC queue pair: its queues, attributes and the three halves of the transport that rxe
//! also separates — the requester (turns send WQEs into request packets), the completer
//! (turns ACKs and responses into send completions) and the responder (executes incoming
//! requests and produces ACKs, NAKs and READ/atomic responses).
//!
//! Everything a queue pair owns is bounded by its capabilities: the send and receive rings
//! are allocated at creation, the responder's resource ring and output queue at RTR.

mod completer;
mod packet;
mod recv_queue;
mod requester;
mod resources;
mod responder;
mod response_queue;
mod response_window;
mod responses;
mod send_queue;
mod state;
mod table;
pub(crate) mod timers;

use std::net::{IpAddr, Ipv6Addr};

use lightpath_verbs::{AccessFlags, QpCaps, QpState, WcOpcode, WcStatus, WorkCompletion};

use crate::cq::CqHandle;
use crate::event::{Ctx, EngineEvent};
use crate::stats::QpStats;
use crate::time::Time;

pub(crate) use table::QpTable;

use recv_queue::RecvQueue;
use requester::Requester;
use responder::Responder;
use send_queue::SendQueue;
use timers::QpTimers;

/// Largest message (RETH DMA length limit; rxe checks against 2^31).
pub(crate) const MAX_MESSAGE: u64 = 1 << 31;
/// Largest `max_rd_atomic` / `max_dest_rd_atomic` (rxe's device limit).
pub(crate) const MAX_RD_ATOMIC: u8 = 128;
/// Limits on the capabilities a queue pair may ask for.
pub(crate) const MAX_WR: u32 = 1 << 15;
pub(crate) const MAX_SGE: u32 = 32;
pub(crate) const MAX_INLINE: u32 = 4096;

/// The attributes set by `modify_qp` that the data path reads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    pub(crate) access: AccessFlags,
    pub(crate) pmtu: u32,
    pub(crate) dest_qpn: u32,
    pub(crate) local_ip: IpAddr,
    pub(crate) peer_ip: IpAddr,
    pub(crate) src_port: u16,
    /// The peer's UDP port from the address vector; 0: the engine's configured RoCE port.
    pub(crate) dst_port: u16,
    /// The address vector's `lightpath_peer`: datagrams to this peer may be segmented.
    pub(crate) lightpath_peer: bool,
    /// The address vector's `lightpath_bundles` (with `lightpath_peer`): an acknowledgement to
    /// this peer may share a datagram with a request.
    pub(crate) lightpath_bundles: bool,
    /// The send window's upper bound in PSNs (see `Qp::max_send_window`), kept here because
    /// the requester asks for it several times per packet and it costs a division.
    pub(crate) max_send_window: u32,
    pub(crate) flow_label: u32,
    pub(crate) rq_psn: u32,
    pub(crate) sq_psn: u32,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) min_rnr_timer: u8,
    pub(crate) max_rd_atomic: u8,
    pub(crate) max_dest_rd_atomic: u8,
}

impl Params {
    fn new(local_ip: IpAddr) -> Self {
        Self {
            access: AccessFlags::NONE,
            pmtu: 256,
            dest_qpn: 0,
            local_ip,
            peer_ip: IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            src_port: 0xC000,
            dst_port: 0,
            lightpath_peer: false,
            lightpath_bundles: false,
            max_send_window: requester::MAX_UNACKED_PSNS as u32,
            flow_label: 0,
            rq_psn: 0,
            sq_psn: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            min_rnr_timer: 0,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
        }
    }
}

/// One reliable-connected queue pair.
#[derive(Debug)]
pub(crate) struct Qp {
    pub(crate) qpn: u32,
    pub(crate) state: QpState,
    caps: QpCaps,
    pub(crate) send_cq: CqHandle,
    pub(crate) recv_cq: CqHandle,
    pub(crate) params: Params,
    sq: SendQueue,
    rq: RecvQueue,
    req: Requester,
    resp: Responder,
    timers: QpTimers,
    /// Engine bookkeeping: the QP is in the engine's ready-to-transmit list.
    pub(crate) in_ready_list: bool,
    /// The responder's plain ACKs wait for this queue pair's next request, which takes them
    /// along, instead of making it ready to transmit on their own (`Engine::hold_answers`).
    pub(crate) answers_held: bool,
    /// Engine bookkeeping: the earliest deadline this QP has in the engine's timer heap.
    pub(crate) timer_queued: Option<Time>,
    /// Engine bookkeeping: a `QpError` event for this QP waits in the event queue.
    pub(crate) error_event_pending: bool,
    /// The packet `produce` just wrote left its payload in registered memory
    /// (`EngineConfig::gather_payloads`); `poll_transmit` takes it.
    pub(crate) gathered: Option<crate::event::Gathered>,
    /// This queue pair's counters.
    pub(crate) stats: QpStats,
}

impl Qp {
    pub(crate) fn new(
        qpn: u32,
        send_cq: CqHandle,
        recv_cq: CqHandle,
        caps: QpCaps,
        local_ip: IpAddr,
    ) -> Self {
        Self {
            qpn,
            state: QpState::Reset,
            caps,
            send_cq,
            recv_cq,
            params: Params::new(local_ip),
            sq: SendQueue::new(caps.max_send_wr, caps.max_send_sge),
            rq: RecvQueue::new(caps.max_recv_wr, caps.max_recv_sge),
            req: Requester::default(),
            resp: Responder::default(),
            timers: QpTimers::default(),
            in_ready_list: false,
            answers_held: false,
            timer_queued: None,
            error_event_pending: false,
            gathered: None,
            stats: QpStats::default(),
        }
    }

    /// The transport's bookkeeping, for a log line when something stalls: requester,
    /// responder, timers and the engine's flags for this queue pair.
    pub(crate) fn transport_state(&self) -> impl std::fmt::Debug + '_ {
        (
            &self.req,
            &self.resp,
            &self.timers,
            ("in_ready_list", self.in_ready_list, "answers_held", self.answers_held),
            ("timer_queued", self.timer_queued),
            &self.sq,
        )
    }

    /// Checks the capabilities a queue pair is created with.
    pub(crate) fn check_caps(caps: &QpCaps) -> lightpath_verbs::Result<()> {
        use lightpath_verbs::Error;
        if caps.max_send_wr > MAX_WR || caps.max_recv_wr > MAX_WR {
            return Err(Error::TooLarge("max_send_wr / max_recv_wr"));
        }
        if caps.max_send_sge > MAX_SGE || caps.max_recv_sge > MAX_SGE {
            return Err(Error::TooLarge("max_send_sge / max_recv_sge"));
        }
        if caps.max_inline_data > MAX_INLINE {
            return Err(Error::TooLarge("max_inline_data"));
        }
        Ok(())
    }

    /// Whether `poll_transmit` would get a packet from this queue pair now.
    pub(crate) fn wants_transmit(&self) -> bool {
        match self.state {
            QpState::Reset | QpState::Init | QpState::Sqe => false,
            QpState::Err | QpState::Rtr => !self.resp.output.is_empty(),
            QpState::Rts | QpState::Sqd => {
                (!self.resp.output.is_empty() && !self.answers_wait()) || self.requester_ready()
            }
        }
    }

    /// Whether the responder's output is held back: plain ACKs only, held for a request.
    fn answers_wait(&self) -> bool {
        self.answers_held && self.resp.output.only_plain_acks()
    }

    /// Holds the responder's plain ACKs for this queue pair's next request (see
    /// `Engine::hold_answers`). Returns whether they stay back now: false with nothing to
    /// hold, output that must not wait (a NAK, READ data) or a request ready to go with them.
    pub(crate) fn hold_answers(&mut self) -> bool {
        if !matches!(self.state, QpState::Rts | QpState::Sqd)
            || self.resp.output.is_empty()
            || !self.resp.output.only_plain_acks()
        {
            return false;
        }
        self.answers_held = true;
        !self.requester_ready()
    }

    /// Whether the responder has output queued (held or not).
    pub(crate) fn has_response_output(&self) -> bool {
        !self.resp.output.is_empty()
    }

    /// Writes the next datagram of this queue pair (without its ICRC) into `buf`. Responder
    /// output goes first: ACKs and READ responses unblock the peer, which is usually the
    /// bottleneck of the pair.
    pub(crate) fn produce(&mut self, ctx: &mut Ctx<'_>, now: Time, buf: &mut [u8]) -> Option<usize> {
        let response = self.produce_response(ctx, buf);
        if self.resp.output.is_empty() {
            // What was held went (with a request behind it, or released).
            self.answers_held = false;
        }
        if let Some(len) = response {
            return Some(len);
        }
        if matches!(self.state, QpState::Rts | QpState::Sqd) {
            return self.produce_request(ctx, now, buf);
        }
        None
    }

    /// The earliest armed timer.
    pub(crate) fn next_deadline(&self) -> Option<Time> {
        self.timers.next_deadline()
    }

    /// Fires the timers that are due at `now`.
    pub(crate) fn handle_timeout(&mut self, ctx: &mut Ctx<'_>, now: Time) {
        if matches!(self.state, QpState::Rts | QpState::Sqd) {
            self.on_timers(ctx, now);
        } else {
            self.timers = QpTimers::default();
        }
    }

    /// Moves to ERR: every send WQE completes in order (with the error decided for it, or
    /// WR_FLUSH_ERR), every receive WQE with WR_FLUSH_ERR, the responder forgets its queued
    /// output and the timers stop. `notify` queues a `QpError` event (errors the engine
    /// detected, as opposed to a `modify_qp` to ERR).
    pub(crate) fn enter_error(&mut self, ctx: &mut Ctx<'_>, notify: bool) {
        if notify {
            let head_error = (!self.sq.is_empty()).then(|| self.sq.get_mut(self.sq.head).error).flatten();
            tracing::warn!(
                qpn = self.qpn,
                dest_qpn = self.params.dest_qpn,
                peer = %self.params.peer_ip,
                from_state = ?self.state,
                status = ?head_error,
                "queue pair entered the error state"
            );
        }
        self.state = QpState::Err;
        self.timers = QpTimers::default();
        self.resp.output.clear();
        self.answers_held = false;
        self.flush_send_queue(ctx);
        self.flush_recv_queue(ctx);
        if notify && !self.error_event_pending {
            self.error_event_pending = true;
            ctx.events.push_back(EngineEvent::QpError { qpn: self.qpn });
        }
    }

    fn flush_send_queue(&mut self, ctx: &mut Ctx<'_>) {
        while !self.sq.is_empty() {
            let wqe = self.sq.get_mut(self.sq.head);
            let status = wqe.error.take().unwrap_or(WcStatus::WrFlushErr);
            let wc = WorkCompletion::new(wqe.wr_id, status, wqe.wc_opcode(), self.qpn);
            self.sq.head += 1;
            ctx.complete(self.send_cq, wc);
        }
        self.sq.started = self.sq.head;
        self.req.next_wqe = self.sq.head;
        self.req.rd_atomic_outstanding = 0;
        self.req.pending_nak = None;
        self.req.answered.clear();
        self.req.reissue = None;
    }

    /// Completes every posted receive with WR_FLUSH_ERR.
    fn flush_recv_queue(&mut self, ctx: &mut Ctx<'_>) {
        while let Some(wr_id) = self.rq.pop() {
            let mut wc = WorkCompletion::new(wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.qpn);
            wc.src_qp = self.params.dest_qpn;
            ctx.complete(self.recv_cq, wc);
        }
        self.resp.recv_active = false;
    }
}

impl Qp {
    /// `post_recv`: queues a receive request (or flushes it at once in ERR).
    pub(crate) fn post_recv(
        &mut self,
        ctx: &mut Ctx<'_>,
        wr: &lightpath_verbs::RecvWr<'_>,
    ) -> lightpath_verbs::Result<()> {
        use lightpath_verbs::Error;
        if self.state == QpState::Reset {
            return Err(Error::InvalidState(self.state));
        }
        if wr.sges.len() > self.caps.max_recv_sge as usize {
            return Err(Error::TooLarge("more scatter/gather entries than max_recv_sge"));
        }
        if self.rq.is_full() {
            return Err(Error::QueueFull);
        }
        self.rq.push(wr.wr_id, wr.sges);
        if self.state == QpState::Err {
            self.flush_recv_queue(ctx);
        }
        Ok(())
    }
}
