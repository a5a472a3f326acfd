//! The requester: accepts send work requests and turns them into request packets, in order,
//! within the 128-PSN window and the `max_rd_atomic` limit, resuming mid-message after a
//! go-back-N rewind (SEND/WRITE continue with MIDDLE/LAST; a READ is reissued for the
//! remaining sub-range).
//!
//! Payload bytes are copied exactly once, from registered memory (or the WQE's inline copy)
//! straight into the datagram buffer.

use lightpath_verbs::{Error, QpState, Result, SendFlags, SendOp, SendPayload, SendWr, WcStatus};
use lightpath_wire::{AtomicEthRepr, Opcode, Position, Psn, RethRepr};

use super::packet::{header, packet_count, position, request_opcode};
use super::response_window::ResponseWindow;
use super::timers::{ack_timeout_nanos, RttEstimate};
use super::{Qp, MAX_MESSAGE};
use crate::event::Ctx;
use crate::sgl;
use crate::time::Time;

/// The requester stops once its next PSN is this far past the oldest unacknowledged one
/// (rxe's `RXE_MAX_UNACKED_PSNS`).
pub(crate) const MAX_UNACKED_PSNS: i32 = 128;
/// The same limit towards a Lightpath soft peer (address vector `lightpath_peer`), which
/// takes bursts this long without dropping (its socket buffer holds several MB)...
pub(crate) const LIGHTPATH_MAX_UNACKED_PSNS: i32 = 1024;
/// ...as long as they stay within this many payload bytes (4 MiB: 1,024 packets of 4 KiB); with
/// a larger path MTU (`QpAttr::lightpath_pmtu`) the window holds fewer, larger packets, never
/// fewer than [`MAX_UNACKED_PSNS`].
pub(crate) const LIGHTPATH_WINDOW_BYTES: u32 = 4 << 20;
/// AckReq is set on the last packet of every message and, in long messages, on every this
/// many packets (towards rxe and RNICs; see `Qp::ack_req_interval`), so a peer that only ACKs
/// AckReq packets (rxe) keeps our window moving.
pub(crate) const ACK_REQ_INTERVAL: u32 = 64;
/// The smallest send window (in PSNs) a go-back-N shrinks it to.
pub(crate) const MIN_SEND_WINDOW: u32 = 16;

/// Requester and completer position in the PSN space.
#[derive(Debug, Default)]
pub(crate) struct Requester {
    /// PSN of the next request packet.
    pub(crate) next_psn: Psn,
    /// The send WQE that packet belongs to.
    pub(crate) next_wqe: u64,
    /// Its PSN offset inside that WQE.
    pub(crate) next_pkt: u32,
    /// Oldest PSN not yet acknowledged.
    pub(crate) una: Psn,
    /// The responder has executed every request packet before this PSN (an ACK, NAK or
    /// response said so); never behind `una`. SEND/WRITE messages before it are complete.
    pub(crate) executed_until: Psn,
    /// READ response and atomic ACK PSNs at or past `una` that have arrived and been applied.
    pub(crate) answered: ResponseWindow,
    /// One past the highest PSN ever sent (anything before it that is sent again is a
    /// retransmission; responses beyond it answer nothing we asked).
    pub(crate) sent_high: Psn,
    /// Packets sent since the last one with AckReq.
    pub(crate) since_ack_req: u32,
    /// How far past `una` the requester may send, in PSNs (at most `MAX_UNACKED_PSNS`).
    /// Every go-back-N halves it, every acknowledged PSN widens it by one, so after a loss
    /// or under reordering the requester resends short bursts instead of flooding the path
    /// with window after window of packets that the responder drops (it discards everything
    /// after a gap). A local choice that rxe does not make; nothing on the wire changes.
    pub(crate) window: u32,
    /// READ/atomic WQEs transmitted and not yet completed.
    pub(crate) rd_atomic_outstanding: u32,
    /// Transport retries left (timeouts, sequence NAKs, gaps in READ responses).
    pub(crate) retry_left: u8,
    /// RNR retries left (ignored when `rnr_retry` is 7, which means infinite).
    pub(crate) rnr_left: u8,
    /// The PSN to resume from when the RNR timer fires.
    pub(crate) rnr_resume: Option<Psn>,
    /// The PSN of the last go-back-N rewind, until progress is made: a second NAK or gap
    /// for the same PSN is the same loss, not a new one.
    pub(crate) rewound_at: Option<Psn>,
    /// A READ or atomic was retried at this PSN because its response looked lost (a later
    /// response or ACK arrived first). Until the reply to that retry (a response opening at
    /// this PSN) arrives — one round trip — further such signs are taken for reordering, not
    /// loss, and cause no new retry.
    pub(crate) awaiting_retry_reply: Option<Psn>,
    /// Send this READ/atomic request again, alone, before anything else: its response looks
    /// lost. Unlike a go-back-N rewind it leaves the send cursor where it is, so a missing
    /// response costs one request (and a READ replays only the missing run), not a resend of
    /// everything after it.
    pub(crate) reissue: Option<Psn>,
    /// The round-trip estimate.
    pub(crate) rtt: RttEstimate,
    /// The go-back-N recovery in progress after a sequence NAK, if any.
    pub(crate) recovery: Option<Recovery>,
    /// A fatal NAK (its PSN and the status it means) that arrived while an earlier READ or
    /// atomic was still unanswered. The completer retries that request first; once every
    /// request before the NAKed one has completed, the NAK takes effect.
    pub(crate) pending_nak: Option<(Psn, WcStatus)>,
}

/// A go-back-N recovery: from a sequence NAK until everything that was outstanding then has
/// been executed by the responder.
///
/// Two rules make go-back-N robust when the network reorders, where a responder that drops
/// everything behind a gap NAKs again and again:
/// * within a round trip of going back, a sequence NAK is not followed — the responder
///   cannot have seen the retransmission yet, so the NAK answers packets sent before it;
/// * if the answers stop while requests are still unconfirmed (the retransmission itself was
///   overtaken, and the responder dropped the rest silently), the requester goes back again
///   after a few round trips (the probe timer) instead of waiting for the retransmit timer.
///   Probes back off exponentially and spend no retries: the retransmit timer alone decides
///   when a peer is gone.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Recovery {
    /// The send frontier when the recovery began.
    pub(crate) until: Psn,
    /// When the requester last went back.
    pub(crate) went_back_at: Time,
    /// Probes fired since the last progress (the backoff exponent).
    pub(crate) probes: u32,
}

impl Requester {
    pub(crate) fn start(sq_psn: u32, retry_cnt: u8, rnr_retry: u8) -> Self {
        let psn = Psn::new(sq_psn);
        Self {
            next_psn: psn,
            una: psn,
            executed_until: psn,
            sent_high: psn,
            retry_left: retry_cnt,
            rnr_left: rnr_retry,
            window: MAX_UNACKED_PSNS as u32,
            ..Self::default()
        }
    }
}

impl Qp {
    /// `post_send`: checks the request and queues it (or flushes it at once in ERR).
    pub(crate) fn post_send(&mut self, ctx: &mut Ctx<'_>, wr: &SendWr<'_>) -> Result<()> {
        match self.state {
            QpState::Rts | QpState::Sqd | QpState::Err => {}
            state => return Err(Error::InvalidState(state)),
        }
        let length = wr.payload.len();
        if length > MAX_MESSAGE {
            return Err(Error::TooLarge("message longer than 2^31 bytes"));
        }
        match wr.payload {
            SendPayload::Sges(sges) if sges.len() > self.caps.max_send_sge as usize => {
                return Err(Error::TooLarge("more scatter/gather entries than max_send_sge"));
            }
            SendPayload::Inline(bytes) if bytes.len() > self.caps.max_inline_data as usize => {
                return Err(Error::TooLarge("inline data longer than max_inline_data"));
            }
            _ => {}
        }
        if wr.op.is_read_or_atomic() {
            if matches!(wr.payload, SendPayload::Inline(_)) {
                return Err(Error::InvalidAttribute(
                    "READ and atomics need scatter/gather entries, not inline data",
                ));
            }
            if wr.op.is_atomic() && length != 8 {
                return Err(Error::InvalidAttribute("atomics need exactly 8 bytes of local buffer"));
            }
            if self.state != QpState::Err && self.params.max_rd_atomic == 0 {
                return Err(Error::InvalidAttribute("max_rd_atomic is 0: READ and atomics are disabled"));
            }
        }
        if self.sq.is_full() {
            return Err(Error::QueueFull);
        }
        let wqe = self.sq.next_free();
        wqe.wr_id = wr.wr_id;
        wqe.op = wr.op;
        wqe.signaled = wr.flags.contains(SendFlags::SIGNALED);
        wqe.solicited = wr.flags.contains(SendFlags::SOLICITED);
        wqe.fence = wr.flags.contains(SendFlags::FENCE);
        wqe.length = length as u32;
        wqe.error = None;
        wqe.sges.clear();
        wqe.inline_data.clear();
        match wr.payload {
            SendPayload::Sges(sges) => {
                wqe.inline = false;
                wqe.sges.extend_from_slice(sges);
            }
            SendPayload::Inline(bytes) => {
                wqe.inline = true;
                wqe.inline_data.extend_from_slice(bytes);
            }
        }
        self.sq.commit();
        if self.state == QpState::Err {
            self.flush_send_queue(ctx);
        }
        Ok(())
    }

    /// Whether the requester has a packet to send now.
    pub(crate) fn requester_ready(&self) -> bool {
        if !matches!(self.state, QpState::Rts | QpState::Sqd) || self.timers.rnr.is_some() {
            return false;
        }
        if self.req.reissue.is_some() {
            return true; // a duplicate of a request already sent: the window does not limit it
        }
        let index = self.req.next_wqe;
        if index >= self.sq.tail || self.window_full() {
            return false;
        }
        if index < self.sq.started {
            return true; // a retransmission: only the window limits it
        }
        if self.state == QpState::Sqd || self.req.pending_nak.is_some() {
            // Draining, or a request already failed: no new WQE starts.
            return false;
        }
        let wqe = self.sq.get(index);
        if wqe.fence && self.req.rd_atomic_outstanding > 0 {
            return false;
        }
        !(wqe.is_read_or_atomic() && self.req.rd_atomic_outstanding >= u32::from(self.params.max_rd_atomic))
    }

    /// The largest send window towards this peer, in PSNs.
    pub(crate) fn max_send_window(&self) -> u32 {
        self.params.max_send_window
    }

    /// How many packets of a long message go between two with AckReq: [`ACK_REQ_INTERVAL`],
    /// or a quarter of the send window towards a Lightpath peer, whose window is up to eight
    /// times larger. Every AckReq costs the peer an ACK datagram and us its receipt (a full
    /// trip through both network stacks); a quarter window still keeps three quarters in
    /// flight while the ACK travels.
    fn ack_req_interval(&self) -> u32 {
        if self.params.lightpath_peer {
            (self.send_window() as u32 / 4).max(ACK_REQ_INTERVAL)
        } else {
            ACK_REQ_INTERVAL
        }
    }

    /// The current send limit in PSNs past `una`.
    fn send_window(&self) -> i32 {
        (self.req.window.clamp(MIN_SEND_WINDOW, self.max_send_window())) as i32
    }

    /// Whether the next PSN lies at or beyond the send window.
    fn window_full(&self) -> bool {
        self.req.next_psn.distance_from(self.req.una) >= self.send_window()
    }

    /// Assigns PSNs to the next new WQE and checks its local buffers. On a local protection
    /// error the WQE fails and the queue pair enters ERR.
    fn start_wqe(&mut self, ctx: &mut Ctx<'_>) -> bool {
        let index = self.sq.started;
        let next_psn = self.req.next_psn;
        let pmtu = self.params.pmtu;
        let wqe = self.sq.get_mut(index);
        let op = wqe.op();
        wqe.first_psn = next_psn;
        wqe.psn_count = if op.is_atomic() { 1 } else { packet_count(u64::from(wqe.length), pmtu) };
        let checked =
            if wqe.inline { Ok(()) } else { sgl::validate(ctx.mrs, &wqe.sges, op.is_read_or_atomic()) };
        self.sq.started += 1;
        if op.is_read_or_atomic() {
            self.req.rd_atomic_outstanding += 1;
        }
        if checked.is_err() {
            self.sq.get_mut(index).error = Some(WcStatus::LocProtErr);
            self.enter_error(ctx, true);
            return false;
        }
        true
    }

    /// Writes the READ/atomic request that `reissue` asks for into `buf`. A READ asks only for
    /// its first missing run: from the PSN up to the next response that already arrived.
    fn produce_reissue(&mut self, ctx: &mut Ctx<'_>, now: Time, psn: Psn, buf: &mut [u8]) -> Option<usize> {
        let index = self.sq.find_started(psn).filter(|&i| self.sq.get(i).is_read_or_atomic())?;
        let wqe = self.sq.get(index);
        let k = psn.distance_from(wqe.first_psn) as u32;
        let dest_qpn = self.params.dest_qpn;
        let len = match wqe.op() {
            SendOp::Read { remote_addr, rkey } => {
                let pmtu = u64::from(self.params.pmtu);
                let offset = u64::from(k) * pmtu;
                let base = psn.distance_from(self.req.una).max(0) as u32;
                let run = (1..wqe.psn_count - k)
                    .find(|&i| self.req.answered.contains(base + i))
                    .unwrap_or(wqe.psn_count - k);
                let dma_len = (u64::from(run) * pmtu).min(u64::from(wqe.length).saturating_sub(offset));
                let mut h = header(Opcode::RC_RDMA_READ_REQUEST, dest_qpn, psn, true, false);
                h.reth =
                    Some(RethRepr { va: remote_addr.wrapping_add(offset), rkey, dma_len: dma_len as u32 });
                h.emit(0, buf).ok()?;
                h.datagram_len(0)
            }
            op => atomic_request(op, dest_qpn, psn, buf)?,
        };
        ctx.stats.retransmits += 1;
        self.stats.retransmits += 1;
        tracing::trace!(qpn = self.qpn, psn = psn.value(), "request packet sent again (response reissue)");
        self.req.rtt.on_retransmit();
        if self.timers.retransmit.is_none() {
            self.timers.retransmit =
                ack_timeout_nanos(self.params.timeout).map(|nanos| now.plus_nanos(nanos));
        }
        Some(len)
    }

    /// Writes the next request packet into `buf`.
    pub(crate) fn produce_request(&mut self, ctx: &mut Ctx<'_>, now: Time, buf: &mut [u8]) -> Option<usize> {
        if !self.requester_ready() {
            return None;
        }
        if let Some(psn) = self.req.reissue.take() {
            if let Some(len) = self.produce_reissue(ctx, now, psn, buf) {
                return Some(len);
            }
            // (Completed meanwhile: nothing to reissue.)
            if !self.requester_ready() {
                return None;
            }
        }
        if self.req.next_wqe == self.sq.started && !self.start_wqe(ctx) {
            return None;
        }
        let index = self.req.next_wqe;
        let psn = self.req.next_psn;
        let pmtu = u64::from(self.params.pmtu);
        let dest_qpn = self.params.dest_qpn;
        let wqe = self.sq.get(index);
        let op = wqe.op();
        let k = self.req.next_pkt;
        let offset = u64::from(k) * pmtu;
        let length = u64::from(wqe.length);

        let (len, ack_req, advance) = match op {
            SendOp::Read { remote_addr, rkey } => {
                let mut h = header(Opcode::RC_RDMA_READ_REQUEST, dest_qpn, psn, true, false);
                let remaining = length.saturating_sub(offset);
                h.reth =
                    Some(RethRepr { va: remote_addr.wrapping_add(offset), rkey, dma_len: remaining as u32 });
                h.emit(0, buf).ok()?;
                (h.datagram_len(0), true, wqe.psn_count - k)
            }
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
                (atomic_request(op, dest_qpn, psn, buf)?, true, 1)
            }
            _ => {
                let count = wqe.psn_count;
                let pos = position(k, count);
                let last = matches!(pos, Position::Last | Position::Only);
                let payload_len = (length - offset.min(length)).min(pmtu) as usize;
                // Also on the packet that fills the send window: only its ACK can open it.
                let fills_window = psn.add(1).distance_from(self.req.una) >= self.send_window();
                let ack_req = last || fills_window || self.req.since_ack_req + 1 >= self.ack_req_interval();
                let solicited = last && wqe.solicited && !matches!(op, SendOp::Write { .. });
                let mut h = header(request_opcode(op, pos), dest_qpn, psn, ack_req, solicited);
                match op {
                    SendOp::Write { remote_addr, rkey } | SendOp::WriteWithImm { remote_addr, rkey, .. }
                        if matches!(pos, Position::First | Position::Only) =>
                    {
                        h.reth = Some(RethRepr { va: remote_addr, rkey, dma_len: wqe.length });
                    }
                    _ => {}
                }
                if last {
                    match op {
                        SendOp::SendWithImm { imm } | SendOp::WriteWithImm { imm, .. } => h.imm = Some(imm),
                        SendOp::SendWithInv { rkey } => h.ieth = Some(rkey),
                        _ => {}
                    }
                }
                let header_len = h.emit(payload_len, buf).ok()?;
                // Towards a Lightpath peer the driver may send the payload from where it lies.
                let in_place = (ctx.gather && self.params.lightpath_peer && !wqe.inline && payload_len > 0)
                    .then(|| sgl::stable_span(ctx.mrs, &wqe.sges, offset, payload_len))
                    .flatten();
                if let Some(addr) = in_place {
                    let trailer = h.datagram_len(payload_len) - header_len - payload_len;
                    self.gathered = Some(crate::event::Gathered { addr, len: payload_len, trailer });
                    (header_len, ack_req, 1)
                } else {
                    let payload = &mut buf[header_len..header_len + payload_len];
                    let copied = if wqe.inline {
                        let start = offset as usize;
                        match wqe.inline_data.get(start..start + payload_len) {
                            Some(bytes) => {
                                payload.copy_from_slice(bytes);
                                Ok(())
                            }
                            None => Err(crate::memory::LocalProtectionError),
                        }
                    } else {
                        sgl::gather(ctx.mrs, &wqe.sges, offset, payload)
                    };
                    if copied.is_err() {
                        // The region was deregistered (or shrank) after the WQE started.
                        self.sq.get_mut(index).error = Some(WcStatus::LocProtErr);
                        self.enter_error(ctx, true);
                        return None;
                    }
                    (h.datagram_len(payload_len), ack_req, 1)
                }
            }
        };

        if psn.is_before(self.req.sent_high) {
            ctx.stats.retransmits += 1;
            self.stats.retransmits += 1;
            tracing::trace!(qpn = self.qpn, psn = psn.value(), "request packet sent again");
            self.req.rtt.on_retransmit();
        } else {
            self.req.rtt.on_new_packet(psn, now);
        }
        self.req.next_psn = psn.add(advance);
        if self.req.next_psn.is_after(self.req.sent_high) {
            self.req.sent_high = self.req.next_psn;
        }
        self.req.since_ack_req = if ack_req { 0 } else { self.req.since_ack_req + 1 };
        let count = self.sq.get(index).psn_count;
        if op.is_read_or_atomic() || k + 1 >= count {
            self.req.next_wqe += 1;
            self.req.next_pkt = 0;
        } else {
            self.req.next_pkt += 1;
        }
        if self.timers.retransmit.is_none() {
            self.timers.retransmit =
                ack_timeout_nanos(self.params.timeout).map(|nanos| now.plus_nanos(nanos));
        }
        Some(len)
    }

    /// Go-back-N: the next packet sent will be the one with PSN `psn` (which must lie between
    /// the oldest unacknowledged PSN and the send frontier).
    pub(crate) fn rewind_to(&mut self, psn: Psn) {
        match self.sq.find_started(psn) {
            Some(index) => {
                self.req.next_wqe = index;
                self.req.next_pkt = psn.distance_from(self.sq.get(index).first_psn) as u32;
            }
            None => {
                self.req.next_wqe = self.sq.started;
                self.req.next_pkt = 0;
            }
        }
        self.req.next_psn = psn;
    }
}

/// Writes the request packet of an atomic `op` with PSN `psn` into `buf`; returns its length
/// (`None` for other operations, or when `buf` is too small).
fn atomic_request(op: SendOp, dest_qpn: u32, psn: Psn, buf: &mut [u8]) -> Option<usize> {
    let (opcode, atomic) = match op {
        SendOp::CompareSwap { remote_addr, rkey, compare, swap } => {
            (Opcode::RC_COMPARE_SWAP, AtomicEthRepr { va: remote_addr, rkey, swap_add: swap, compare })
        }
        SendOp::FetchAdd { remote_addr, rkey, add } => {
            (Opcode::RC_FETCH_ADD, AtomicEthRepr { va: remote_addr, rkey, swap_add: add, compare: 0 })
        }
        _ => return None,
    };
    let mut h = header(opcode, dest_qpn, psn, true, false);
    h.atomic_eth = Some(atomic);
    h.emit(0, buf).ok()?;
    Some(h.datagram_len(0))
}

/// The send window's upper bound in PSNs for a queue pair's peer and path MTU:
/// [`MAX_UNACKED_PSNS`], or towards a Lightpath peer [`LIGHTPATH_WINDOW_BYTES`] of payload
/// (between [`MAX_UNACKED_PSNS`] and [`LIGHTPATH_MAX_UNACKED_PSNS`] packets).
pub(crate) fn send_window_bound(lightpath_peer: bool, pmtu: u32) -> u32 {
    if !lightpath_peer {
        return MAX_UNACKED_PSNS as u32;
    }
    (LIGHTPATH_WINDOW_BYTES / pmtu.max(1)).clamp(MAX_UNACKED_PSNS as u32, LIGHTPATH_MAX_UNACKED_PSNS as u32)
}
