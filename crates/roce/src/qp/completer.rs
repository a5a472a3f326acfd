//! The completer: matches ACKs, NAKs, READ responses and atomic ACKs against the outstanding
//! send WQEs, completes them in order, and drives recovery — go-back-N on a sequence NAK or a
//! gap in READ responses, the retransmit timer, and RNR waits.
//!
//! Choices (documented in the crate docs):
//! * An unsignaled WQE's slot is released as soon as it is acknowledged.
//! * An ACK never completes a READ or atomic (only its response does). When an ACK covers an
//!   unanswered READ/atomic — which happens when the network reorders a later ACK ahead of the
//!   response — the completer waits for the response or the retransmit timer instead of
//!   retrying at once as rxe does; that avoids needless retransmissions under reordering.
//! * A fatal NAK (invalid request, remote access, operational error) for a request behind an
//!   unanswered READ/atomic is, as in rxe, taken as proof that the earlier response was lost:
//!   the completer retries from it instead of failing the NAKed request first, so a flush is
//!   never reported before the error that caused it.
//! * A gap inside a READ response stream reissues the READ for the rest at once (as rxe), but
//!   at most once per round trip — until the reply to the previous reissue starts arriving —
//!   so reordering cannot set off a storm of reissues.
//! * A response that does not fit the WQE it names (wrong length or position) is dropped and
//!   counted; the retransmit timer recovers, and a peer that keeps sending such responses ends
//!   in RETRY_EXC_ERR.

use lightpath_verbs::{WcStatus, WorkCompletion};
use lightpath_wire::{NakCode, OpKind, Position, Psn, Syndrome, TransportHeader};

use super::timers::{ack_timeout_nanos, rnr_delay_nanos};
use super::Qp;
use crate::event::Ctx;
use crate::sgl;
use crate::time::Time;

impl Qp {
    /// Handles a response packet (the caller checked opcode, state and addresses).
    pub(crate) fn handle_response(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Time,
        header: &TransportHeader,
        kind: OpKind,
        position: Position,
        payload: &[u8],
    ) {
        let psn = header.bth.psn;
        if kind == OpKind::ReadResponse
            && matches!(position, Position::First | Position::Only)
            && self.req.read_reissue == Some(psn)
        {
            // The reply to our last READ reissue (even if its data is no longer needed):
            // a round trip has passed, so another gap may trigger another reissue.
            self.req.read_reissue = None;
        }
        if psn.is_before(self.req.una) {
            // An answer to something already acknowledged: a duplicate ACK, or a response
            // overtaken by a retransmission's answer. Nothing to do.
            ctx.stats.stale_responses += 1;
            return;
        }
        if !self.sq.has_outstanding() || !psn.is_before(self.req.sent_high) {
            ctx.stats.drops_unexpected_response += 1;
            return;
        }
        match kind {
            OpKind::Ack => match header.aeth.map(|a| a.syndrome) {
                Some(Syndrome::Ack { .. }) => {
                    let progress = self.ack_through(ctx, psn);
                    self.after_ack(now, progress);
                }
                Some(Syndrome::RnrNak { timer_code }) => self.on_rnr_nak(ctx, now, psn, timer_code),
                Some(Syndrome::Nak(NakCode::PsnSequenceError)) => self.on_sequence_nak(ctx, now, psn),
                Some(Syndrome::Nak(code)) => self.on_fatal_nak(ctx, now, psn, code),
                None => ctx.stats.drops_unexpected_response += 1,
            },
            OpKind::ReadResponse => self.on_read_response(ctx, now, header, position, payload),
            OpKind::AtomicAck => self.on_atomic_ack(ctx, now, header),
            _ => ctx.stats.drops_unexpected_response += 1,
        }
    }

    /// Completes every SEND/WRITE WQE whose last PSN is at or before `psn` (stopping at the
    /// first READ/atomic, which only its response completes) and moves `una`. Returns whether
    /// anything was acknowledged.
    fn ack_through(&mut self, ctx: &mut Ctx<'_>, psn: Psn) -> bool {
        let mut progress = false;
        while self.sq.has_outstanding() {
            let wqe = self.sq.get(self.sq.head);
            if wqe.is_read_or_atomic() || !psn.is_after_or_eq(self.req.una) {
                break;
            }
            if psn.is_after_or_eq(wqe.last_psn()) {
                self.req.una = wqe.last_psn().add(1);
                self.complete_head(ctx, WcStatus::Success);
                progress = true;
            } else {
                if wqe.contains(psn) {
                    self.req.una = psn.add(1);
                    progress = true;
                }
                break;
            }
        }
        progress
    }

    /// Completes the head WQE with `status`. Unsignaled WQEs report only errors.
    fn complete_head(&mut self, ctx: &mut Ctx<'_>, status: WcStatus) {
        self.req.read_reissue = None;
        let wqe = self.sq.get(self.sq.head);
        if wqe.signaled || status != WcStatus::Success {
            let mut wc = WorkCompletion::new(wqe.wr_id, status, wqe.wc_opcode(), self.qpn);
            wc.byte_len = if wqe.op().is_atomic() { 8 } else { wqe.length };
            ctx.complete(self.send_cq, wc);
        }
        if wqe.is_read_or_atomic() {
            self.req.rd_atomic_outstanding = self.req.rd_atomic_outstanding.saturating_sub(1);
        }
        self.sq.head += 1;
    }

    /// Bookkeeping after an acknowledgement: reset the retry counters on progress, keep the
    /// requester from resending what is already acknowledged, and (re)arm or stop the timer.
    fn after_ack(&mut self, now: Time, progress: bool) {
        if progress {
            self.req.retry_left = self.params.retry_cnt;
            self.req.rnr_left = self.params.rnr_retry;
            self.req.rewound_at = None;
        }
        if self.req.next_psn.is_before(self.req.una) || self.req.next_wqe < self.sq.head {
            self.rewind_to(self.req.una);
        }
        if !self.sq.has_outstanding() {
            self.timers.retransmit = None;
        } else if self.timers.rnr.is_none() && (progress || self.timers.retransmit.is_none()) {
            // (During an RNR wait nothing is in flight to time out; sending again re-arms.)
            self.arm_retransmit(now);
        }
    }

    fn arm_retransmit(&mut self, now: Time) {
        self.timers.retransmit = ack_timeout_nanos(self.params.timeout).map(|nanos| now.plus_nanos(nanos));
    }

    /// Spends one transport retry. When none are left the oldest WQE fails with
    /// RETRY_EXC_ERR and the queue pair enters ERR; returns false then.
    fn spend_retry(&mut self, ctx: &mut Ctx<'_>) -> bool {
        if self.req.retry_left == 0 {
            let head = self.sq.head;
            self.sq.get_mut(head).error = Some(WcStatus::RetryExcErr);
            self.enter_error(ctx, true);
            return false;
        }
        self.req.retry_left -= 1;
        true
    }

    /// Go-back-N from the oldest unacknowledged PSN, once per loss.
    fn retry_from_una(&mut self, ctx: &mut Ctx<'_>, now: Time) {
        let una = self.req.una;
        if self.req.rewound_at == Some(una) {
            return;
        }
        if !self.spend_retry(ctx) {
            return;
        }
        self.rewind_to(una);
        self.req.rewound_at = Some(una);
        self.arm_retransmit(now);
    }

    fn on_sequence_nak(&mut self, ctx: &mut Ctx<'_>, now: Time, psn: Psn) {
        ctx.stats.naks_received += 1;
        if self.timers.rnr.is_some() && self.req.rnr_resume == Some(psn) {
            // rxe follows an RNR NAK with a sequence NAK for the packets behind it; the RNR
            // wait already covers that loss.
            return;
        }
        let progress = self.ack_through(ctx, psn.sub(1));
        self.after_ack(now, progress);
        if self.sq.has_outstanding() {
            self.retry_from_una(ctx, now);
        }
    }

    fn on_rnr_nak(&mut self, ctx: &mut Ctx<'_>, now: Time, psn: Psn, timer_code: u8) {
        ctx.stats.rnr_naks_received += 1;
        let progress = self.ack_through(ctx, psn.sub(1));
        self.after_ack(now, progress);
        let Some(index) = self.sq.find_started(psn) else { return };
        if self.params.rnr_retry != 7 {
            if self.req.rnr_left == 0 {
                self.sq.get_mut(index).error = Some(WcStatus::RnrRetryExcErr);
                self.enter_error(ctx, true);
                return;
            }
            self.req.rnr_left -= 1;
        }
        self.timers.rnr = Some(now.plus_nanos(rnr_delay_nanos(timer_code)));
        self.timers.retransmit = None;
        self.req.rnr_resume = Some(psn);
    }

    fn on_fatal_nak(&mut self, ctx: &mut Ctx<'_>, now: Time, psn: Psn, code: NakCode) {
        ctx.stats.naks_received += 1;
        let progress = self.ack_through(ctx, psn.sub(1));
        self.after_ack(now, progress);
        let Some(index) = self.sq.find_started(psn) else {
            ctx.stats.drops_unexpected_response += 1;
            return;
        };
        if index != self.sq.head && self.sq.get(self.sq.head).is_read_or_atomic() {
            // The NAK implies the responder executed the earlier READ/atomic, whose response
            // is missing: like rxe, treat that as a lost response and retry from it. (The
            // responder is in ERR by now, so this normally ends in RETRY_EXC_ERR on the oldest
            // request — never in a flush reported before an error.)
            self.retry_from_una(ctx, now);
            return;
        }
        let status = match code {
            NakCode::InvalidRequest => WcStatus::RemInvReqErr,
            NakCode::RemoteAccessError => WcStatus::RemAccessErr,
            // rxe treats every other code as a remote operational error.
            _ => WcStatus::RemOpErr,
        };
        self.sq.get_mut(index).error = Some(status);
        self.enter_error(ctx, true);
    }

    fn on_read_response(
        &mut self,
        ctx: &mut Ctx<'_>,
        now: Time,
        header: &TransportHeader,
        position: Position,
        payload: &[u8],
    ) {
        let psn = header.bth.psn;
        if header.aeth.is_some_and(|a| !matches!(a.syndrome, Syndrome::Ack { .. })) {
            ctx.stats.drops_unexpected_response += 1;
            return;
        }
        // A READ response implicitly acknowledges the SEND/WRITE requests before it.
        let implicit = self.ack_through(ctx, psn.sub(1));
        if implicit {
            self.after_ack(now, true);
        }
        let head = self.sq.head;
        if !self.sq.has_outstanding() || !self.sq.get(head).is_read() || !self.sq.get(head).contains(psn) {
            ctx.stats.drops_unexpected_response += 1;
            return;
        }
        if psn.is_after(self.req.una) {
            // Earlier response packets of this READ are missing: lost, or only overtaken.
            // Reissue the rest at once (as rxe does), but at most once per round trip, so a
            // reordering network does not set off a storm of reissues and replays.
            ctx.stats.drops_unexpected_response += 1;
            if self.req.read_reissue.is_none() {
                let una = self.req.una;
                self.retry_from_una(ctx, now);
                if self.state != lightpath_verbs::QpState::Err {
                    self.req.read_reissue = Some(una);
                }
            }
            return;
        }
        let wqe = self.sq.get(head);
        let pmtu = u64::from(self.params.pmtu);
        let offset = u64::from(psn.distance_from(wqe.first_psn) as u32) * pmtu;
        let remaining = u64::from(wqe.length).saturating_sub(offset);
        let last = psn == wqe.last_psn();
        let fits = if last {
            payload.len() as u64 == remaining && matches!(position, Position::Last | Position::Only)
        } else {
            payload.len() as u64 == pmtu && matches!(position, Position::First | Position::Middle)
        };
        if !fits {
            ctx.stats.drops_unexpected_response += 1;
            return;
        }
        if sgl::scatter(ctx.mrs, &wqe.sges, offset, payload).is_err() {
            self.sq.get_mut(head).error = Some(WcStatus::LocProtErr);
            self.enter_error(ctx, true);
            return;
        }
        self.req.una = psn.add(1);
        if last {
            self.complete_head(ctx, WcStatus::Success);
        }
        self.after_ack(now, true);
    }

    fn on_atomic_ack(&mut self, ctx: &mut Ctx<'_>, now: Time, header: &TransportHeader) {
        let psn = header.bth.psn;
        let implicit = self.ack_through(ctx, psn.sub(1));
        if implicit {
            self.after_ack(now, true);
        }
        let head = self.sq.head;
        let (Some(ack), true) = (header.atomic_ack, self.sq.has_outstanding()) else {
            ctx.stats.drops_unexpected_response += 1;
            return;
        };
        let wqe = self.sq.get(head);
        if !wqe.op().is_atomic() || wqe.first_psn != psn || psn != self.req.una {
            ctx.stats.drops_unexpected_response += 1;
            return;
        }
        if sgl::scatter(ctx.mrs, &wqe.sges, 0, &ack.orig.to_ne_bytes()).is_err() {
            self.sq.get_mut(head).error = Some(WcStatus::LocProtErr);
            self.enter_error(ctx, true);
            return;
        }
        self.req.una = psn.add(1);
        self.complete_head(ctx, WcStatus::Success);
        self.after_ack(now, true);
    }

    /// Fires the retransmit and RNR timers that are due.
    pub(crate) fn on_timers(&mut self, ctx: &mut Ctx<'_>, now: Time) {
        if self.timers.rnr.is_some_and(|deadline| deadline <= now) {
            self.timers.rnr = None;
            self.req.rnr_resume = None;
            if self.sq.has_outstanding() {
                self.rewind_to(self.req.una);
            }
        }
        if self.timers.retransmit.is_some_and(|deadline| deadline <= now) {
            self.timers.retransmit = None;
            self.req.read_reissue = None;
            if self.sq.has_outstanding() {
                ctx.stats.timeouts += 1;
                if !self.spend_retry(ctx) {
                    return;
                }
                self.rewind_to(self.req.una);
                self.req.rewound_at = Some(self.req.una);
                self.arm_retransmit(now);
            }
        }
    }
}
