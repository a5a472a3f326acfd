//! The responder: checks each incoming request (PSN, opcode sequence, QP permissions,
//! receive resources, lengths, R_Key and bounds — in rxe's order), executes it against
//! registered memory, posts receive completions, and queues ACKs, NAKs, READ responses and
//! atomic ACKs. It also answers duplicates without executing them twice.
//!
//! Errors of class C (invalid request, remote access, operational) NAK the packet and move
//! the queue pair to ERR, as rxe does; nothing outside a checked region is ever touched.

use lightpath_verbs::{AccessFlags, WcOpcode, WcStatus, WorkCompletion};
use lightpath_wire::{NakCode, OpKind, OpcodeInfo, Position, Psn, Syndrome, TransportHeader};

use super::packet::packet_count;
use super::resources::{Resource, Resources};
use super::response_queue::{ResponseItem, ResponseQueue};
use super::{Qp, MAX_MESSAGE};
use crate::event::Ctx;
use crate::sgl;

/// A multi-packet message in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Inbound {
    /// A SEND whose FIRST arrived; its receive WQE is the receive queue's head.
    Send,
    /// An RDMA WRITE whose FIRST arrived: the next byte goes to `va`.
    Write { rkey: u32, va: u64, remaining: u64, total: u64 },
}

#[derive(Debug, Default)]
pub(crate) struct Responder {
    /// Expected PSN of the next new request.
    pub(crate) epsn: Psn,
    /// Messages completed (24-bit, carried in every AETH).
    pub(crate) msn: u32,
    /// A sequence NAK (or RNR NAK) went out for the current gap: drop silently until an
    /// in-order packet arrives.
    pub(crate) gap_nak_sent: bool,
    pub(crate) inbound: Option<Inbound>,
    /// The receive queue's head is being filled by a SEND.
    pub(crate) recv_active: bool,
    /// Bytes already written into that receive.
    pub(crate) recv_offset: u64,
    pub(crate) resources: Resources,
    pub(crate) output: ResponseQueue,
}

impl Responder {
    pub(crate) fn start(rq_psn: u32, max_dest_rd_atomic: u8) -> Self {
        let mut responder = Self { epsn: Psn::new(rq_psn), ..Self::default() };
        responder.resources.reset(max_dest_rd_atomic);
        responder.output.reset(responder.resources.capacity());
        responder
    }

    fn bump_msn(&mut self) {
        self.msn = (self.msn + 1) & 0xFF_FFFF;
    }
}

/// How a request failed; each is a NAK plus, when a receive WQE was consumed, its status.
#[derive(Clone, Copy, Debug)]
struct Fatal {
    nak: NakCode,
    recv_status: WcStatus,
}

const INVALID_REQUEST: Fatal = Fatal { nak: NakCode::InvalidRequest, recv_status: WcStatus::RemInvReqErr };
const REMOTE_ACCESS: Fatal = Fatal { nak: NakCode::RemoteAccessError, recv_status: WcStatus::RemAccessErr };

impl Qp {
    /// Handles a request packet (the caller checked opcode, state and addresses).
    pub(crate) fn handle_request(
        &mut self,
        ctx: &mut Ctx<'_>,
        header: &TransportHeader,
        info: OpcodeInfo,
        payload: &[u8],
    ) {
        let psn = header.bth.psn;
        let distance = psn.distance_from(self.resp.epsn);
        if distance > 0 {
            if self.resp.gap_nak_sent {
                ctx.stats.drops_out_of_sequence += 1;
            } else {
                self.resp.gap_nak_sent = true;
                let (epsn, msn) = (self.resp.epsn, self.resp.msn);
                self.queue_ack(ctx, epsn, Syndrome::Nak(NakCode::PsnSequenceError), msn);
            }
            return;
        }
        if distance < 0 {
            self.handle_duplicate(ctx, header, info.kind);
            return;
        }
        self.resp.gap_nak_sent = false;
        if let Err(fatal) = self.execute(ctx, header, info, payload) {
            self.responder_error(ctx, psn, fatal);
        }
    }

    fn queue_ack(&mut self, ctx: &mut Ctx<'_>, psn: Psn, syndrome: Syndrome, msn: u32) {
        if !self.resp.output.push_ack(psn, syndrome, msn) {
            ctx.stats.drops_responder_busy += 1;
        }
    }

    /// Class C error: complete a started receive with an error, NAK, and enter ERR.
    fn responder_error(&mut self, ctx: &mut Ctx<'_>, psn: Psn, fatal: Fatal) {
        if self.resp.recv_active {
            if let Some(wr_id) = self.rq.pop() {
                let mut wc = WorkCompletion::new(wr_id, fatal.recv_status, WcOpcode::Recv, self.qpn);
                wc.src_qp = self.params.dest_qpn;
                ctx.complete(self.recv_cq, wc);
            }
            self.resp.recv_active = false;
        }
        // Responses to the requests executed before this one are still owed (rxe has sent
        // them by now: it answers each request before it looks at the next). Keep them, ahead
        // of the NAK; entering ERR would discard them, and the requester would take the
        // missing READ/atomic responses for lost ones and end in RETRY_EXC_ERR.
        let owed = std::mem::take(&mut self.resp.output);
        self.enter_error(ctx, true);
        self.resp.output = owed;
        let msn = self.resp.msn;
        self.queue_ack(ctx, psn, Syndrome::Nak(fatal.nak), msn);
    }

    /// Sends an RNR NAK for `psn`; the request is not executed and the PSN not consumed.
    fn rnr_nak(&mut self, ctx: &mut Ctx<'_>, psn: Psn) {
        // Drop the packets already in flight behind this one silently, like after a
        // sequence NAK: the requester resumes from `psn` after its RNR wait anyway.
        self.resp.gap_nak_sent = true;
        let (code, msn) = (self.params.min_rnr_timer & 0x1F, self.resp.msn);
        self.queue_ack(ctx, psn, Syndrome::RnrNak { timer_code: code }, msn);
    }

    /// Executes an in-order request.
    fn execute(
        &mut self,
        ctx: &mut Ctx<'_>,
        header: &TransportHeader,
        info: OpcodeInfo,
        payload: &[u8],
    ) -> Result<(), Fatal> {
        let (kind, position) = (info.kind, info.position);
        let opens = matches!(position, Position::First | Position::Only);
        // Opcode sequence: a message in progress must continue; none in progress must start.
        let in_sequence = match (self.resp.inbound, kind) {
            (Some(Inbound::Send), OpKind::Send) | (Some(Inbound::Write { .. }), OpKind::Write) => !opens,
            (None, OpKind::Send | OpKind::Write) => opens,
            (None, OpKind::ReadRequest | OpKind::CompareSwap | OpKind::FetchAdd) => true,
            _ => false,
        };
        if !in_sequence {
            return Err(INVALID_REQUEST);
        }
        // What the queue pair lets the peer do (set at INIT); checked at the message start.
        let needed = match kind {
            OpKind::Write if opens => Some(AccessFlags::REMOTE_WRITE),
            OpKind::ReadRequest => Some(AccessFlags::REMOTE_READ),
            OpKind::CompareSwap | OpKind::FetchAdd => Some(AccessFlags::REMOTE_ATOMIC),
            _ => None,
        };
        if needed.is_some_and(|flag| !self.params.access.contains(flag)) {
            return Err(INVALID_REQUEST);
        }
        if matches!(kind, OpKind::ReadRequest | OpKind::CompareSwap | OpKind::FetchAdd)
            && self.resp.resources.capacity() == 0
        {
            return Err(INVALID_REQUEST);
        }
        // Receive resources: a SEND's first packet and a WRITE with immediate take a WQE.
        let needs_recv = (kind == OpKind::Send && opens) || (kind == OpKind::Write && info.has_immediate());
        if needs_recv && self.rq.is_empty() {
            self.rnr_nak(ctx, header.bth.psn);
            return Ok(());
        }
        if info.check_payload_len(payload.len(), self.params.pmtu as usize).is_err() {
            return Err(INVALID_REQUEST);
        }
        match kind {
            OpKind::Send => self.execute_send(ctx, header, info, payload),
            OpKind::Write => self.execute_write(ctx, header, info, payload),
            OpKind::ReadRequest => {
                self.execute_read(ctx, header);
                Ok(())
            }
            _ => self.execute_atomic(ctx, header, kind),
        }
    }

    fn finish_packet(&mut self, ctx: &mut Ctx<'_>, header: &TransportHeader) {
        self.resp.epsn = self.resp.epsn.add(1);
        if header.bth.ack_req {
            let (psn, msn) = (header.bth.psn, self.resp.msn);
            self.queue_ack(ctx, psn, Syndrome::ACK_UNLIMITED, msn);
        }
    }

    fn execute_send(
        &mut self,
        ctx: &mut Ctx<'_>,
        header: &TransportHeader,
        info: OpcodeInfo,
        payload: &[u8],
    ) -> Result<(), Fatal> {
        if matches!(info.position, Position::First | Position::Only) {
            self.resp.recv_active = true;
            self.resp.recv_offset = 0;
        }
        let Some(recv) = self.rq.front() else { return Err(INVALID_REQUEST) };
        let offset = self.resp.recv_offset;
        if offset + payload.len() as u64 > recv.capacity {
            // The spec's choice (rxe reports REM_INV_REQ_ERR here): the receive fails with a
            // local length error, the sender gets NAK invalid request.
            return Err(Fatal { nak: NakCode::InvalidRequest, recv_status: WcStatus::LocLenErr });
        }
        if sgl::scatter(ctx.mrs, &recv.sges, offset, payload).is_err() {
            return Err(Fatal { nak: NakCode::RemoteOperationalError, recv_status: WcStatus::LocProtErr });
        }
        self.resp.recv_offset += payload.len() as u64;
        if matches!(info.position, Position::Last | Position::Only) {
            let invalidated = header.ieth;
            if let Some(rkey) = invalidated {
                if !ctx.mrs.invalidate_remote(rkey) {
                    return Err(Fatal { nak: NakCode::RemoteAccessError, recv_status: WcStatus::LocProtErr });
                }
            }
            let wr_id = self.rq.pop().unwrap_or_default();
            let mut wc = WorkCompletion::new(wr_id, WcStatus::Success, WcOpcode::Recv, self.qpn);
            wc.byte_len = self.resp.recv_offset as u32;
            wc.imm_data = header.imm;
            wc.invalidated_rkey = invalidated;
            wc.src_qp = self.params.dest_qpn;
            wc.solicited = header.bth.solicited;
            ctx.complete(self.recv_cq, wc);
            self.resp.recv_active = false;
            self.resp.inbound = None;
            self.resp.bump_msn();
        } else {
            self.resp.inbound = Some(Inbound::Send);
        }
        self.finish_packet(ctx, header);
        Ok(())
    }

    fn execute_write(
        &mut self,
        ctx: &mut Ctx<'_>,
        header: &TransportHeader,
        info: OpcodeInfo,
        payload: &[u8],
    ) -> Result<(), Fatal> {
        let len = payload.len() as u64;
        let (rkey, va, remaining, total) = match (info.position, self.resp.inbound) {
            (Position::First | Position::Only, _) => {
                let Some(reth) = header.reth else { return Err(INVALID_REQUEST) };
                let total = u64::from(reth.dma_len);
                if total > MAX_MESSAGE {
                    return Err(INVALID_REQUEST);
                }
                if total > 0 && ctx.mrs.remote(reth.rkey, reth.va, total, AccessFlags::REMOTE_WRITE).is_err()
                {
                    return Err(REMOTE_ACCESS);
                }
                (reth.rkey, reth.va, total, total)
            }
            (_, Some(Inbound::Write { rkey, va, remaining, total })) => (rkey, va, remaining, total),
            _ => return Err(INVALID_REQUEST),
        };
        // Lengths must add up to the RETH's DMA length exactly.
        let last = matches!(info.position, Position::Last | Position::Only);
        if (last && len != remaining) || (!last && len >= remaining) {
            return Err(INVALID_REQUEST);
        }
        if len > 0 {
            let Ok((memory, offset)) = ctx.mrs.remote(rkey, va, len, AccessFlags::REMOTE_WRITE) else {
                return Err(REMOTE_ACCESS);
            };
            memory.write(offset, payload);
        }
        if last {
            self.resp.inbound = None;
            self.resp.bump_msn();
            if let Some(imm) = header.imm {
                let wr_id = self.rq.pop().unwrap_or_default();
                let mut wc =
                    WorkCompletion::new(wr_id, WcStatus::Success, WcOpcode::RecvRdmaWithImm, self.qpn);
                wc.byte_len = total as u32;
                wc.imm_data = Some(imm);
                wc.src_qp = self.params.dest_qpn;
                wc.solicited = header.bth.solicited;
                ctx.complete(self.recv_cq, wc);
            }
        } else {
            self.resp.inbound =
                Some(Inbound::Write { rkey, va: va + len, remaining: remaining - len, total });
        }
        self.finish_packet(ctx, header);
        Ok(())
    }

    fn execute_read(&mut self, ctx: &mut Ctx<'_>, header: &TransportHeader) {
        let Some(reth) = header.reth else { return };
        let len = u64::from(reth.dma_len);
        let psn = header.bth.psn;
        if len > MAX_MESSAGE {
            self.responder_error(ctx, psn, INVALID_REQUEST);
            return;
        }
        if len > 0 && ctx.mrs.remote(reth.rkey, reth.va, len, AccessFlags::REMOTE_READ).is_err() {
            self.responder_error(ctx, psn, REMOTE_ACCESS);
            return;
        }
        if !self.resp.output.has_room_for_work() {
            ctx.stats.drops_responder_busy += 1;
            return;
        }
        let count = packet_count(len, self.params.pmtu);
        let last = psn.add(count - 1);
        self.resp.resources.push(Resource::Read { first: psn, last, va: reth.va, rkey: reth.rkey, len });
        self.resp.bump_msn();
        self.resp.epsn = psn.add(count);
        self.resp.output.push_work(ResponseItem::ReadData {
            psn,
            va: reth.va,
            rkey: reth.rkey,
            remaining: len,
            first: true,
        });
    }

    fn execute_atomic(
        &mut self,
        ctx: &mut Ctx<'_>,
        header: &TransportHeader,
        kind: OpKind,
    ) -> Result<(), Fatal> {
        let Some(atomic) = header.atomic_eth else { return Err(INVALID_REQUEST) };
        if atomic.va % 8 != 0 {
            return Err(INVALID_REQUEST);
        }
        let Ok((memory, offset)) = ctx.mrs.remote(atomic.rkey, atomic.va, 8, AccessFlags::REMOTE_ATOMIC)
        else {
            return Err(REMOTE_ACCESS);
        };
        if !self.resp.output.has_room_for_work() {
            ctx.stats.drops_responder_busy += 1;
            return Ok(());
        }
        let orig = if kind == OpKind::CompareSwap {
            memory.compare_swap(offset, atomic.compare, atomic.swap_add)
        } else {
            memory.fetch_add(offset, atomic.swap_add)
        };
        let psn = header.bth.psn;
        self.resp.resources.push(Resource::Atomic { psn, orig });
        self.resp.bump_msn();
        self.resp.epsn = psn.add(1);
        let msn = self.resp.msn;
        self.resp.output.push_work(ResponseItem::AtomicAck { psn, orig, msn });
        Ok(())
    }

    /// A request before the expected PSN: SEND/WRITE are re-ACKed with ePSN − 1, READs
    /// replayed from the responder resources (a sub-range is allowed), atomics answered from
    /// the stored original value. Duplicates without a matching record are dropped.
    fn handle_duplicate(&mut self, ctx: &mut Ctx<'_>, header: &TransportHeader, kind: OpKind) {
        let psn = header.bth.psn;
        match kind {
            OpKind::Send | OpKind::Write => {
                ctx.stats.duplicates += 1;
                let (last_in_order, msn) = (self.resp.epsn.sub(1), self.resp.msn);
                self.queue_ack(ctx, last_in_order, Syndrome::ACK_UNLIMITED, msn);
            }
            OpKind::ReadRequest => {
                let (Some(reth), Some(Resource::Read { first, last, va, rkey, len })) =
                    (header.reth, self.resp.resources.find_read(psn))
                else {
                    ctx.stats.drops_stale_duplicate += 1;
                    return;
                };
                let want_len = u64::from(reth.dma_len);
                let within = reth.rkey == rkey
                    && reth.va >= va
                    && reth.va.checked_add(want_len).is_some_and(|end| end <= va.saturating_add(len));
                // The sub-range must start where the PSN says it does.
                let expected_va =
                    va.wrapping_add(u64::from(psn.distance_from(first) as u32) * u64::from(self.params.pmtu));
                if !within || reth.va != expected_va {
                    ctx.stats.drops_stale_duplicate += 1;
                    return;
                }
                let replay =
                    ResponseItem::ReadData { psn, va: reth.va, rkey, remaining: want_len, first: true };
                let to_the_end = reth.va.wrapping_add(want_len) == va.wrapping_add(len);
                // If the response stream of that READ is still queued, a duplicate never adds
                // a second copy of it: one the stream has yet to reach is answered by the
                // stream itself, and one for the whole rest restarts the stream there. (A
                // duplicate for a run the stream has already passed is queued on its own.)
                if let Some(stream) = self.resp.output.read_stream_mut(first, last) {
                    if let ResponseItem::ReadData { psn: next, .. } = *stream {
                        if !next.is_after(psn) || to_the_end {
                            if next.is_after(psn) {
                                *stream = replay;
                            }
                            ctx.stats.duplicates += 1;
                            return;
                        }
                    }
                }
                if !self.resp.output.has_room_for_work() {
                    ctx.stats.drops_responder_busy += 1;
                    return;
                }
                ctx.stats.duplicates += 1;
                self.resp.output.push_work(replay);
            }
            OpKind::CompareSwap | OpKind::FetchAdd => {
                let Some(orig) = self.resp.resources.find_atomic(psn) else {
                    ctx.stats.drops_stale_duplicate += 1;
                    return;
                };
                if !self.resp.output.has_room_for_work() {
                    ctx.stats.drops_responder_busy += 1;
                    return;
                }
                ctx.stats.duplicates += 1;
                let msn = self.resp.msn;
                self.resp.output.push_work(ResponseItem::AtomicAck { psn, orig, msn });
            }
            _ => ctx.stats.drops_unexpected_response += 1,
        }
    }
}
