//! The completer: matches ACKs, NAKs, READ responses and atomic ACKs against the outstanding
//! send WQEs, completes them in order, and drives recovery — go-back-N on a sequence NAK,
//! retries of lost READ/atomic responses, the retransmit timer, and RNR waits.
//!
//! Every answer tells the completer two things, which it keeps separately:
//! * how far the responder has **executed** (`executed_until`): an ACK for PSN p covers every
//!   request packet up to p; a NAK or a response at p covers every one before p. That is all
//!   a SEND or WRITE needs to complete.
//! * which **responses** have arrived (`answered`, a window of PSNs past the oldest
//!   unacknowledged one): a READ completes when every one of its response packets has been
//!   placed in its buffer, an atomic when its ATOMIC ACKNOWLEDGE has.
//!
//! Choices (documented in the crate docs):
//! * An unsignaled WQE's slot is released as soon as it is acknowledged.
//! * Responses that arrive out of order (a later READ response packet, the answer to a later
//!   atomic) are kept: their data goes to its place in the buffer at once. rxe drops them
//!   and relies on the retry; keeping them means reordering never turns into failures.
//! * When the responder has executed past a READ/atomic whose response is missing (a later
//!   response, an ACK past its last PSN, or a NAK arrived first), the response is taken as
//!   lost and the READ/atomic is retried at once, as rxe does — but at most once per round
//!   trip (until the reply to that retry starts to arrive), so reordering cannot set off a
//!   storm of retries and replays.
//! * A fatal NAK (invalid request, remote access, operational error) for a request behind an
//!   unanswered READ/atomic is kept until everything before the NAKed request has completed,
//!   while the READ/atomic is retried: if its response was only overtaken and still
//!   arrives, the NAKed request then fails with its own error; if it was lost, the retries go
//!   unanswered (the responder is in ERR) and the oldest request ends in RETRY_EXC_ERR. A flush
//!   is never reported before the error that caused it.
//! * A response that does not fit the WQE it names (wrong length or position) is dropped and
//!   counted; the retransmit timer recovers, and a peer that keeps sending such responses ends
//!   in RETRY_EXC_ERR.

use lightpath_verbs::{QpState, WcStatus, WorkCompletion};
use lightpath_wire::{NakCode, OpKind, Position, Psn, Syndrome, TransportHeader};

use super::requester::{Recovery, MIN_SEND_WINDOW};
use super::response_window::RESPONSE_WINDOW;
use super::send_queue::SendWqe;
use super::timers::{ack_timeout_nanos, rnr_delay_nanos};
use super::Qp;
use crate::event::Ctx;
use crate::sgl;
use crate::time::Time;

/// The shortest probe delay (see `Recovery`).
const MIN_PROBE_NANOS: u64 = 1_000;

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
        self.req.rtt.on_answer(psn, now);
        let opens_reply = match kind {
            OpKind::ReadResponse => matches!(position, Position::First | Position::Only),
            OpKind::AtomicAck => true,
            _ => false,
        };
        if opens_reply && self.req.awaiting_retry_reply == Some(psn) {
            // The reply to our last retry (even if it is no longer needed): a round trip has
            // passed, so another missing response may trigger another retry.
            self.req.awaiting_retry_reply = None;
        }
        if psn.is_before(self.req.una) {
            // An answer to something already acknowledged: a duplicate ACK, or a response
            // overtaken by a retransmission's answer. Nothing to do — except for a sequence
            // NAK (see `overtaken_sequence_nak`).
            ctx.stats.stale_responses += 1;
            let syndrome = header.aeth.map(|a| a.syndrome);
            if kind == OpKind::Ack && syndrome == Some(Syndrome::Nak(NakCode::PsnSequenceError)) {
                self.overtaken_sequence_nak(now);
            }
            return;
        }
        if !self.sq.has_outstanding() || !psn.is_before(self.req.sent_high) {
            ctx.stats.drops_unexpected_response += 1;
            return;
        }
        match kind {
            OpKind::Ack => match header.aeth.map(|a| a.syndrome) {
                Some(Syndrome::Ack { .. }) => self.on_ack(ctx, now, psn),
                Some(Syndrome::RnrNak { timer_code }) => self.on_rnr_nak(ctx, now, psn, timer_code),
                Some(Syndrome::Nak(NakCode::PsnSequenceError)) => self.on_sequence_nak(ctx, now, psn),
                Some(Syndrome::Nak(code)) => self.on_fatal_nak(ctx, now, psn, code),
                None => ctx.stats.drops_unexpected_response += 1,
            },
            OpKind::ReadResponse => self.on_read_response(ctx, now, header, position, payload),
            OpKind::AtomicAck => self.on_atomic_ack(ctx, now, header),
            _ => ctx.stats.drops_unexpected_response += 1,
        }
        self.apply_pending_nak(ctx, now);
    }

    /// Records that the responder executed every request packet before `psn`; returns
    /// whether that is news.
    fn note_executed(&mut self, psn: Psn) -> bool {
        let news = psn.is_after(self.req.executed_until);
        if news {
            self.req.executed_until = psn;
        }
        news
    }

    /// Completes, in order, every WQE the answers so far allow (SEND/WRITE: executed;
    /// READ/atomic: every response applied), and moves `una` as far as they reach — also
    /// into the middle of a message. Returns whether `una` moved.
    fn settle(&mut self, ctx: &mut Ctx<'_>) -> bool {
        let start = self.req.una;
        while self.sq.has_outstanding() {
            let wqe = self.sq.get(self.sq.head);
            let last = wqe.last_psn();
            if wqe.is_read_or_atomic() {
                let mut una = self.req.una;
                while !una.is_after(last) && self.req.answered.contains(una.distance_from(start) as u32) {
                    una = una.add(1);
                }
                self.req.una = una;
                if !una.is_after(last) {
                    break;
                }
            } else {
                let executed = self.req.executed_until;
                if !executed.is_after(last) {
                    if executed.is_after(self.req.una) {
                        self.req.una = executed;
                    }
                    break;
                }
                self.req.una = last.add(1);
            }
            self.complete_head(ctx, WcStatus::Success);
        }
        let moved = self.req.una.distance_from(start);
        self.req.answered.advance(moved as u32);
        self.req.window = self.req.window.saturating_add(moved as u32).min(self.max_send_window());
        if self.req.una.is_after(self.req.executed_until) {
            // Keep the two within one window of each other, so PSN comparisons stay valid.
            self.req.executed_until = self.req.una;
        }
        moved > 0
    }

    /// Completes the head WQE with `status`. Unsignaled WQEs report only errors.
    fn complete_head(&mut self, ctx: &mut Ctx<'_>, status: WcStatus) {
        self.req.awaiting_retry_reply = None;
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

    /// Bookkeeping after an answer: reset the retry counters on progress (the answer
    /// acknowledged something new), keep the requester from resending what is already
    /// acknowledged, and (re)arm or stop the timer.
    fn after_ack(&mut self, now: Time, progress: bool) {
        if progress {
            self.req.retry_left = self.params.retry_cnt;
            self.req.rnr_left = self.params.rnr_retry;
            self.req.rewound_at = None;
            self.recovery_progress(now);
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

    /// Records what an answer said and completes what it allows.
    fn absorb(&mut self, ctx: &mut Ctx<'_>, now: Time, executed_until: Psn) {
        let news = self.note_executed(executed_until);
        let moved = self.settle(ctx);
        self.after_ack(now, news || moved);
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

    /// Go-back-N from `psn` (at or after the oldest unacknowledged PSN), once per loss.
    fn go_back_to(&mut self, ctx: &mut Ctx<'_>, now: Time, psn: Psn) {
        if self.req.rewound_at == Some(psn) {
            return;
        }
        if !self.spend_retry(ctx) {
            return;
        }
        tracing::debug!(
            qpn = self.qpn,
            from_psn = psn.value(),
            retries_left = self.req.retry_left,
            "go-back-N: resending from a lost request"
        );
        self.rewind_to(psn);
        self.req.rewound_at = Some(psn);
        self.req.window /= 2;
        self.arm_retransmit(now);
    }

    /// The responder executed past the head READ/atomic, but (part of) its response has not
    /// arrived: take it as lost and ask for it again at once — that one request alone, see
    /// `reissue` — unless a retry is already awaiting its reply (then this is most likely
    /// reordering, and the retry in flight covers it).
    ///
    /// Such a fast retry neither spends `retry_cnt` nor re-arms the retransmit timer: it is
    /// a guess that may be wrong under reordering, so it must not use up the retries that
    /// protect against a dead peer, and a peer that keeps answering without ever sending the
    /// response still runs into the timer, whose expiries do count.
    fn retry_missing_response(&mut self) {
        if self.req.awaiting_retry_reply.is_some() {
            return;
        }
        let una = self.req.una;
        if self.req.next_psn != una {
            self.req.reissue = Some(una);
        }
        self.req.awaiting_retry_reply = Some(una);
    }

    /// Whether the head WQE is a READ/atomic still missing a response although the responder
    /// has executed past its last PSN.
    fn head_response_missing(&self, executed_past: Psn) -> bool {
        self.sq.has_outstanding() && {
            let head = self.sq.get(self.sq.head);
            head.is_read_or_atomic() && executed_past.is_after(head.last_psn())
        }
    }

    fn on_ack(&mut self, ctx: &mut Ctx<'_>, now: Time, psn: Psn) {
        self.absorb(ctx, now, psn.add(1));
        if self.head_response_missing(psn) {
            // An ACK past an unanswered READ/atomic: its response was lost (or overtaken).
            self.retry_missing_response();
        }
    }

    fn on_sequence_nak(&mut self, ctx: &mut Ctx<'_>, now: Time, psn: Psn) {
        ctx.stats.naks_received += 1;
        self.stats.naks_received += 1;
        tracing::debug!(
            qpn = self.qpn,
            psn = psn.value(),
            "PSN sequence NAK received: the peer missed a packet"
        );
        if self.req.executed_until.is_after(psn) {
            // Overtaken (a READ/atomic before it holds `una` back, so the stale check in
            // `handle_response` did not catch it).
            ctx.stats.stale_responses += 1;
            self.overtaken_sequence_nak(now);
            return;
        }
        if self.timers.rnr.is_some() && self.req.rnr_resume == Some(psn) {
            // rxe follows an RNR NAK with a sequence NAK for the packets behind it; the RNR
            // wait already covers that loss.
            return;
        }
        self.absorb(ctx, now, psn);
        if !self.sq.has_outstanding() {
            return;
        }
        let rtt = self.req.rtt.smoothed_nanos();
        if let (Some(recovery), Some(rtt)) = (self.req.recovery, rtt) {
            if now < recovery.went_back_at.plus_nanos(rtt) {
                // Within a round trip of going back: this NAK answers packets sent before the
                // retransmission (see `Recovery`); the probe timer covers the case where the
                // retransmission does not fill the gap either.
                ctx.stats.stale_responses += 1;
                self.overtaken_sequence_nak(now);
                return;
            }
        }
        // Resend from the NAKed PSN. A READ/atomic before it whose response is still missing
        // was executed (the responder is past it): its response is on its way or lost, which
        // the other signs of a missing response and the timers take care of — re-requesting
        // it here would make the responder replay a READ that may still be streaming.
        self.go_back_to(ctx, now, psn);
        if matches!(self.state, QpState::Rts | QpState::Sqd) {
            self.start_recovery(now);
        }
    }

    /// A sequence NAK that is not followed: it arrived after the responder had already
    /// executed the PSN it asks for (an ACK overtook it), or within a round trip of the last
    /// go-back-N. Resending from there would be a retry for nothing — but the NAK
    /// still says that the responder dropped whatever arrived behind the gap until the gap
    /// was filled. If answers for those packets do not follow, they were lost: let the
    /// recovery probe find out (it spends no retry).
    fn overtaken_sequence_nak(&mut self, now: Time) {
        if !self.sq.has_outstanding() {
            return;
        }
        match self.req.recovery.as_mut() {
            // Whatever was sent until now may be among the dropped packets.
            Some(recovery) => recovery.until = self.req.sent_high,
            None => self.start_recovery(now),
        }
    }

    /// Starts a go-back-N recovery (see `Recovery`) covering everything sent so far.
    fn start_recovery(&mut self, now: Time) {
        let until = self.req.sent_high;
        self.req.recovery = Some(Recovery { until, went_back_at: now, probes: 0 });
        self.arm_probe(now);
    }

    /// How long the probe timer waits: three round trips, doubled for every probe since the
    /// last progress. `None` before the first round trip has been measured.
    fn probe_delay(&self) -> Option<u64> {
        let rtt = self.req.rtt.smoothed_nanos()?;
        let probes = self.req.recovery.map_or(0, |r| r.probes).min(16);
        Some((3 * rtt).max(MIN_PROBE_NANOS) << probes)
    }

    fn arm_probe(&mut self, now: Time) {
        self.timers.probe = self.probe_delay().map(|delay| now.plus_nanos(delay));
    }

    /// Progress during a recovery: it ends once everything outstanding at its start has been
    /// executed; until then the probe waits again from now.
    fn recovery_progress(&mut self, now: Time) {
        let Some(mut recovery) = self.req.recovery else { return };
        if !self.sq.has_outstanding() || !recovery.until.is_after(self.req.executed_until) {
            self.req.recovery = None;
            self.timers.probe = None;
            return;
        }
        recovery.probes = 0;
        self.req.recovery = Some(recovery);
        self.arm_probe(now);
    }

    /// The probe timer fired: nothing was acknowledged for a few round trips while requests
    /// are still unconfirmed. Go back to the first one not known to be executed (past a READ
    /// the responder is still answering), and ask again for a missing READ/atomic response.
    /// Spends no retry (see `Recovery`).
    fn fire_probe(&mut self, now: Time) {
        let Some(mut recovery) = self.req.recovery else { return };
        if !self.sq.has_outstanding() || self.timers.rnr.is_some() {
            self.req.recovery = None;
            return;
        }
        let mut target = self.req.executed_until;
        if let Some(index) = self.sq.find_started(target) {
            let wqe = self.sq.get(index);
            if wqe.is_read_or_atomic() && target != wqe.first_psn {
                target = wqe.last_psn().add(1);
            }
        }
        if target.is_before(self.req.sent_high) {
            self.rewind_to(target);
            self.req.rewound_at = Some(target);
            self.req.window /= 2;
        }
        if self.sq.get(self.sq.head).is_read_or_atomic() && self.req.executed_until.is_after(self.req.una) {
            // The responder is past the oldest READ/atomic, whose response is still missing.
            self.req.awaiting_retry_reply = None;
            self.retry_missing_response();
        }
        recovery.went_back_at = now;
        recovery.probes += 1;
        self.req.recovery = Some(recovery);
        self.arm_probe(now);
    }

    fn on_rnr_nak(&mut self, ctx: &mut Ctx<'_>, now: Time, psn: Psn, timer_code: u8) {
        ctx.stats.rnr_naks_received += 1;
        self.stats.rnr_naks_received += 1;
        tracing::debug!(
            qpn = self.qpn,
            psn = psn.value(),
            timer_code,
            rnr_retries_left = self.req.rnr_left,
            "RNR NAK received: the peer had no receive posted"
        );
        if self.req.executed_until.is_after(psn) {
            // Overtaken, as a stale sequence NAK: the request has executed since.
            ctx.stats.stale_responses += 1;
            return;
        }
        self.absorb(ctx, now, psn);
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
        self.stats.naks_received += 1;
        tracing::warn!(qpn = self.qpn, psn = psn.value(), code = ?code, "fatal NAK received");
        self.absorb(ctx, now, psn);
        let Some(index) = self.sq.find_started(psn) else {
            ctx.stats.drops_unexpected_response += 1;
            return;
        };
        let status = match code {
            NakCode::InvalidRequest => WcStatus::RemInvReqErr,
            NakCode::RemoteAccessError => WcStatus::RemAccessErr,
            // rxe treats every other code as a remote operational error.
            _ => WcStatus::RemOpErr,
        };
        if index != self.sq.head {
            // Only a READ/atomic whose response is missing can hold the head before the NAKed
            // request (everything else before it is complete now). The NAK proves the
            // responder executed it: like rxe, take the response as lost and retry it; keep
            // the NAK for when everything before it has completed (`apply_pending_nak`).
            if self.req.pending_nak.is_none_or(|(kept, _)| psn.is_before(kept)) {
                self.req.pending_nak = Some((psn, status));
            }
            self.retry_missing_response();
            return;
        }
        self.sq.get_mut(index).error = Some(status);
        self.enter_error(ctx, true);
    }

    /// Lets a fatal NAK kept behind an unanswered READ/atomic take effect once everything
    /// before the NAKed request has completed.
    fn apply_pending_nak(&mut self, ctx: &mut Ctx<'_>, now: Time) {
        let Some((psn, status)) = self.req.pending_nak else { return };
        if !matches!(self.state, QpState::Rts | QpState::Sqd) {
            return;
        }
        self.absorb(ctx, now, psn);
        if self.sq.has_outstanding() && self.sq.get(self.sq.head).contains(psn) {
            self.req.pending_nak = None;
            let head = self.sq.head;
            self.sq.get_mut(head).error = Some(status);
            self.enter_error(ctx, true);
        }
    }

    /// The WQE a response at `psn` answers and the response's offset in the window, if it is
    /// a started READ/atomic (per `is_wanted`) within the window and not yet applied.
    /// Counts the reason when it is not.
    fn response_target(
        &self,
        ctx: &mut Ctx<'_>,
        psn: Psn,
        is_wanted: impl Fn(&SendWqe) -> bool,
    ) -> Option<(u64, u32)> {
        let Some(index) = self.sq.find_started(psn).filter(|&i| is_wanted(self.sq.get(i))) else {
            ctx.stats.drops_unexpected_response += 1;
            return None;
        };
        let offset = psn.distance_from(self.req.una) as u32;
        if self.req.answered.contains(offset) {
            ctx.stats.stale_responses += 1;
            return None;
        }
        if offset >= RESPONSE_WINDOW {
            ctx.stats.drops_unexpected_response += 1;
            return None;
        }
        Some((index, offset))
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
        // A READ response implicitly acknowledges the requests before it.
        let news = self.note_executed(psn);
        let applied = match self.response_target(ctx, psn, |wqe| wqe.is_read()) {
            Some((index, offset)) => self.apply_read_data(ctx, index, offset, psn, position, payload),
            None => false,
        };
        if !matches!(self.state, QpState::Rts | QpState::Sqd) {
            return;
        }
        let moved = self.settle(ctx);
        self.after_ack(now, news || applied || moved);
        if psn.is_after(self.req.una) {
            // Responses before this one are missing: lost, or only overtaken.
            self.retry_missing_response();
        }
    }

    /// Places one READ response packet in the buffer of WQE `index` and records it;
    /// returns whether it did.
    fn apply_read_data(
        &mut self,
        ctx: &mut Ctx<'_>,
        index: u64,
        offset: u32,
        psn: Psn,
        position: Position,
        payload: &[u8],
    ) -> bool {
        let wqe = self.sq.get(index);
        let pmtu = u64::from(self.params.pmtu);
        let at = u64::from(psn.distance_from(wqe.first_psn) as u32) * pmtu;
        let remaining = u64::from(wqe.length).saturating_sub(at);
        // Any full packet may also close a replay of a sub-range (a reissue asks only for the
        // missing run), so only the READ's own last packet must be LAST/ONLY.
        let fits = if psn == wqe.last_psn() {
            payload.len() as u64 == remaining && matches!(position, Position::Last | Position::Only)
        } else {
            payload.len() as u64 == pmtu
        };
        if !fits {
            ctx.stats.drops_unexpected_response += 1;
            return false;
        }
        if sgl::scatter(ctx.mrs, &wqe.sges, at, payload).is_err() {
            if index == self.sq.head {
                self.sq.get_mut(index).error = Some(WcStatus::LocProtErr);
                self.enter_error(ctx, true);
            }
            // (A later WQE fails the same way once it is the oldest: its data is asked again.)
            return false;
        }
        self.req.answered.insert(offset)
    }

    fn on_atomic_ack(&mut self, ctx: &mut Ctx<'_>, now: Time, header: &TransportHeader) {
        let psn = header.bth.psn;
        let Some(ack) = header.atomic_ack else {
            ctx.stats.drops_unexpected_response += 1;
            return;
        };
        let news = self.note_executed(psn);
        let mut applied = false;
        let target = self.response_target(ctx, psn, |wqe| wqe.op().is_atomic() && wqe.first_psn == psn);
        if let Some((index, offset)) = target {
            let wqe = self.sq.get(index);
            if sgl::scatter(ctx.mrs, &wqe.sges, 0, &ack.orig.to_ne_bytes()).is_ok() {
                applied = self.req.answered.insert(offset);
            } else if index == self.sq.head {
                self.sq.get_mut(index).error = Some(WcStatus::LocProtErr);
                self.enter_error(ctx, true);
                return;
            }
        }
        if !matches!(self.state, QpState::Rts | QpState::Sqd) {
            return;
        }
        let moved = self.settle(ctx);
        self.after_ack(now, news || applied || moved);
        if psn.is_after(self.req.una) {
            self.retry_missing_response();
        }
    }

    /// Fires the retransmit, RNR and probe timers that are due.
    pub(crate) fn on_timers(&mut self, ctx: &mut Ctx<'_>, now: Time) {
        if self.timers.probe.is_some_and(|deadline| deadline <= now) {
            self.timers.probe = None;
            self.fire_probe(now);
        }
        if self.timers.rnr.is_some_and(|deadline| deadline <= now) {
            self.timers.rnr = None;
            let resume = self.req.rnr_resume.take().filter(|psn| psn.is_after_or_eq(self.req.una));
            if self.sq.has_outstanding() {
                self.rewind_to(resume.unwrap_or(self.req.una));
                // The responder dropped what followed the NAKed packet; like a go-back-N,
                // this resend is covered by the recovery probe.
                self.start_recovery(now);
            }
        }
        if self.timers.retransmit.is_some_and(|deadline| deadline <= now) {
            self.timers.retransmit = None;
            self.req.awaiting_retry_reply = None;
            if self.sq.has_outstanding() {
                ctx.stats.timeouts += 1;
                self.stats.timeouts += 1;
                tracing::debug!(
                    qpn = self.qpn,
                    from_psn = self.req.una.value(),
                    retries_left = self.req.retry_left,
                    "retransmit timer expired: going back to the oldest unacknowledged request"
                );
                if !self.spend_retry(ctx) {
                    return;
                }
                // Go back to the oldest unacknowledged PSN: everything from there is resent,
                // so no separate reissue (or recovery probe) is needed.
                self.req.reissue = None;
                self.req.recovery = None;
                self.timers.probe = None;
                self.req.window = MIN_SEND_WINDOW;
                self.rewind_to(self.req.una);
                self.req.rewound_at = Some(self.req.una);
                self.arm_retransmit(now);
            }
        }
    }
}
